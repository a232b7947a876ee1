"""What `tollway bench` shows while it runs: a progress bar per stage and a table per tier,
refreshed as requests finish (rich), and the final table of every stage."""
from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.stats import SLO, summarize


class LiveView:
    def __init__(self, limits: Limits, slo: SLO, show: bool = True, console: Console | None = None):
        self.limits, self.slo, self.show = limits, slo, show
        self.console = console or Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=self.console)
        self._records: list = []
        self._drawn = 0.0  # when the table was last recomputed: at most twice a second
        self._live = Live(Group(self.progress), console=self.console, refresh_per_second=2, transient=False)

    def __enter__(self) -> LiveView:
        if self.show:
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.show:
            self._live.__exit__(*exc)

    @contextlib.contextmanager
    def stage(self, pattern: LoadPattern):
        """Yields the callback for each finished request of the stage."""
        total = self.limits.max_requests
        task = self.progress.add_task(pattern.name, total=total, note="")
        self._records = []

        def on_record(record) -> None:
            self._records.append(record)
            if not record.warmup:
                self.progress.advance(task)
            errors = sum(r.error is not None for r in self._records)
            self.progress.update(task, note=f"{errors} errors" if errors else "")
            if self.show and time.monotonic() - self._drawn > 0.5:
                self._drawn = time.monotonic()
                self._live.update(Group(self.progress, tier_table(summarize(self._records, self.slo, None))))

        yield on_record
        self.progress.update(task, total=self.progress.tasks[task].completed)


def stdout_console() -> Console:
    """For the final tables: piped into a file, they keep every column rather than fit 80."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def tier_table(summary: dict, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("tier", "done", "errors", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s/user", "out tok/s",
                   "goodput req/s", "$/1M out"):
        table.add_column(column, justify="left" if column == "tier" else "right")
    for name, m in [*summary["tiers"].items(), ("all", summary["all"])]:
        table.add_row(name, str(m["completed"]), str(sum(m["errors"].values())),
                      f"{fmt_ms(m['ttft']['p50'])} / {fmt_ms(m['ttft']['p99'])}",
                      f"{fmt_ms(m['tpot']['p50'])} / {fmt_ms(m['tpot']['p99'])}",
                      fmt_num(m["tok_s_per_user"]["mean"]), fmt_num(m["output_tok_s"]),
                      fmt_num(m["goodput_requests_per_s"], ".3f"), fmt_num(m["cost_per_m_output"], ".4f"))
    return table


def fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


def fmt_num(value: float | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)
