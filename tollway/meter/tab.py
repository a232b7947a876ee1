"""A request's tab: the engine seconds the meter charges it, step by step.

The tab travels with the request (Request.tab, then each step's ScheduledSeq.tab), so the meter
keeps no books by request id: it adds each step's shares to the tabs in the step, and whoever
opened a tab reads it once the request has ended. Written on the engine thread only (the meter's
on_step), before the step's outputs are handed out, so a request's tab is complete by the time
its final output arrives."""
from __future__ import annotations


class Tab:
    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0
