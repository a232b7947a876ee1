"""A machine profile fitted to a running server's own steps (`tollway profile --from URL`,
which reads GET /dashboard/steps): the machine as it is now, under the traffic it serves.

A grid profile times the runner alone, on a quiet machine, minutes before a run; a served run's
steps share the cores with the server's own work (HTTP, streaming, detokenizing) and follow the
machine's drift. Here every step the server kept is a sample: the step model is fitted to them,
the jitter is each one's time over that fit, and the engine's time per step beside the runner is
the gap between one step's end and the next's, less the next's runner time, wherever the first
left requests running (so the engine went straight on)."""
from __future__ import annotations

from tollway.scheduler.machine_profile import MachineProfile, overhead_line
from tollway.scheduler.step_model import StepShape, StepTimeModel

MIN_STEPS = 200  # fewer leave a fit to a handful of shapes


def live_profile(body: dict, source: str) -> MachineProfile:
    """The profile of the steps in `body` (the server's /dashboard/steps), read from `source`."""
    steps = body.get("steps") or []
    if len(steps) < MIN_STEPS:
        raise ValueError(f"{source} has kept {len(steps)} steps; profile it after it has served traffic "
                         f"(at least {MIN_STEPS} steps)")
    samples = [(StepShape(kernel, tokens, sampled, attention, chunks), seconds)
               for _, kernel, tokens, sampled, attention, chunks, _, seconds, _ in steps]
    fitted = StepTimeModel.fit(samples)
    jitter = [seconds / fitted.predict(shape) for shape, seconds in samples]
    gaps = [(cur[6], cur[0] - prev[0] - cur[7]) for prev, cur in zip(steps, steps[1:]) if prev[8] > 0]
    overhead = overhead_line([(seqs, max(0.0, gap)) for seqs, gap in gaps]) if gaps else [0.0, 0.0]
    return MachineProfile(f"{body['hardware']}, served", body["model"],
                          [[s.kernel, s.tokens, s.sampled, s.attention, s.chunks, t] for s, t in samples],
                          body["int8_max_tokens"], body["dense_kernel"], estimate=False, overhead=overhead,
                          jitter=jitter, served=True, pause_layers=body.get("pause_layers", 0), notes=f"tollway profile --from {source}: {len(steps)} served steps")
