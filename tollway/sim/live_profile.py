"""A machine profile fitted to a running server's own steps (`tollway profile --from URL`,
which reads GET /dashboard/steps): the machine as it is now, under the traffic it serves.

A grid profile times the runner alone, on a quiet machine, minutes before a run; a served run's
steps share the cores with the server's own work (HTTP, streaming, detokenizing) and follow the
machine's drift. Here the steps the server kept are grouped by shape, and the step model is
fitted to each group's median time, one sample a group, as a grid profile is to each step's: fitted
to every step, the thousands of small decodes outweighed the few large steps, which it then put
a third short, and drawn as jitter that misfit slowed every simulated step by a tenth. The jitter
is each step's time over its own group's median: the machine's and the server's noise around a
shape. The engine's time per step beside the runner is the gap between one step's end and the
next's, less the next's runner time, wherever the first left requests running (so the engine
went straight on). The server's own time per streamed call, before the engine's queue and from a
token to the wire, comes as the server kept it (/dashboard/steps' `calls`)."""
from __future__ import annotations

import math
import statistics

from tollway.scheduler.machine_profile import MachineProfile, overhead_line
from tollway.scheduler.step_model import StepShape

MIN_STEPS = 200  # fewer leave a fit to a handful of shapes


def live_profile(body: dict, source: str) -> MachineProfile:
    """The profile of the steps in `body` (the server's /dashboard/steps), read from `source`."""
    steps = body.get("steps") or []
    if len(steps) < MIN_STEPS:
        raise ValueError(f"{source} has kept {len(steps)} steps; profile it after it has served traffic "
                         f"(at least {MIN_STEPS} steps)")
    measured = [(StepShape(kernel, tokens, sampled, attention, chunks), seconds)
                for _, kernel, tokens, sampled, attention, chunks, _, seconds, _ in steps]
    groups: dict[tuple, list[tuple[StepShape, float]]] = {}
    for shape, seconds in measured:
        groups.setdefault(_group(shape), []).append((shape, seconds))
    medians = {key: statistics.median(seconds for _, seconds in group) for key, group in groups.items()}
    samples = [(_mean_shape([shape for shape, _ in group]), medians[key]) for key, group in groups.items()]
    # A shape seen once or twice says nothing of the noise around it.
    jitter = [seconds / medians[key] for shape, seconds in measured if len(groups[key := _group(shape)]) >= 3]
    gaps = [(cur[6], cur[0] - prev[0] - cur[7]) for prev, cur in zip(steps, steps[1:]) if prev[8] > 0]
    overhead = overhead_line([(seqs, max(0.0, gap)) for seqs, gap in gaps]) if gaps else [0.0, 0.0]
    return MachineProfile(f"{body['hardware']}, served", body["model"],
                          [[s.kernel, s.tokens, s.sampled, s.attention, s.chunks, t] for s, t in samples],
                          body["int8_max_tokens"], body["dense_kernel"], estimate=False, overhead=overhead,
                          jitter=jitter, served=True, pause_layers=body.get("pause_layers", 0),
                          calls=body.get("calls") or {}, notes=f"tollway profile --from {source}: {len(steps)} served steps, {len(samples)} shapes")


def _group(shape: StepShape) -> tuple:
    """Steps alike to within a tenth of their attention work: the same kernel, tokens, sampled
    rows and chunks."""
    return shape.kernel, shape.tokens, shape.sampled, shape.chunks, round(math.log1p(shape.attention) / math.log(1.1))


def _mean_shape(shapes: list[StepShape]) -> StepShape:
    first = shapes[0]
    return first._replace(attention=statistics.fmean(s.attention for s in shapes))
