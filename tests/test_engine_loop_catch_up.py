"""Where a step's threads take every core, the engine thread lets the event loops write a
step's outputs before it starts the next step, so that their writing does not preempt it; a
busy loop holds the steps back only briefly."""
from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict

import pytest
import torch

from tollway import async_engine
from tollway.async_engine import AsyncEngine
from tollway.request import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def counting_steps(engine) -> list[float]:
    """The start time of every step the engine takes from now on."""
    started: list[float] = []
    step = engine.step

    def counted():
        started.append(time.monotonic())
        return step()

    engine.step = counted
    return started


def test_each_step_s_outputs_are_handled_by_their_loop_before_the_next_step_starts(make_engine, monkeypatch):
    engine = make_engine()
    assert engine.steps_take_every_core()
    # No cap on the wait here: a slow machine must not make the test pass or fail by chance.
    monkeypatch.setattr(async_engine, "MAX_CATCH_UP_SECONDS", 30.0)
    monkeypatch.setattr(async_engine, "MAX_CATCH_UP_SHARE", 1e9)
    started = counting_steps(engine)
    produced: dict[str, list[int]] = defaultdict(list)  # per request: the step each output came from
    received: dict[str, list[int]] = defaultdict(list)  # and how many steps had started when it arrived

    def on_step(_engine, plan, result, outputs):
        for out in outputs:
            produced[out.request_id].append(len(started))

    async def consume(prompt: str) -> None:
        async for out in loop_engine.generate(prompt, PARAMS):
            received[out.request_id].append(len(started))

    async def main() -> None:
        await asyncio.gather(*(consume(p) for p in ("One two", "Three four five", "Six")))

    loop_engine = AsyncEngine(engine, on_step=on_step)
    try:
        asyncio.run(main())
    finally:
        loop_engine.shutdown()
    assert len(received) == 3 and all(len(steps) >= PARAMS.max_tokens for steps in received.values())
    assert received == produced


def test_a_busy_event_loop_holds_the_steps_back_only_briefly(make_engine):
    engine = make_engine()
    started = counting_steps(engine)
    blocked: list[int] = []

    async def main() -> None:
        async for _ in loop_engine.generate("One two", SamplingParams(max_tokens=40, temperature=0.0,
                                                                     ignore_eos=True)):
            if not blocked:
                before = len(started)
                time.sleep(1.0)  # the loop does something else, holding its thread
                blocked.append(len(started) - before)

    loop_engine = AsyncEngine(engine)
    try:
        asyncio.run(main())
    finally:
        loop_engine.shutdown()
    assert blocked[0] >= 5  # steps went on meanwhile, each waiting a quarter of a step at most


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a core to leave free")
def test_an_engine_with_a_core_to_spare_does_not_wait_for_the_loops(make_engine):
    engine = make_engine()
    assert engine.steps_take_every_core()
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) - 1)
    try:
        assert not engine.steps_take_every_core()
        spare = AsyncEngine(engine)
        spare.shutdown()
        assert not spare._catch_up
    finally:
        torch.set_num_threads(threads)
