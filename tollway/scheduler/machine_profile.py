"""A machine profile: what the simulator knows of a machine running a model.

It holds step timings, (shape, seconds) pairs that the StepTimeModel is fitted to, measured
on a real runner (`tollway profile`) or estimated from hardware specs (hardware.py); the
engine's own time per step beside the runner (planning, committing, detokenizing); the jitter
of measured steps about the fitted model; and the kernel settings the scheduler needs. JSON on disk.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tollway.scheduler.step_model import StepShape, StepTimeModel

FORMAT = "tollway-profile/1"


@dataclass
class MachineProfile:
    hardware: str  # "this machine: AMD EPYC (2 cores)", "H200", ...
    model: str
    samples: list[list]  # [kernel, tokens, sampled, attention, chunks, seconds]
    int8_max_tokens: int  # the scheduler's kernel choice (0: dense only)
    dense_kernel: str
    estimate: bool  # True: built from specs, not measured
    # Engine time per step beside the runner: seconds = a + b * sequences in the step.
    overhead: list[float] = field(default_factory=lambda: [0.0, 0.0])
    jitter: list[float] = field(default_factory=list)  # measured / fitted time of profiled steps, in the order they ran
    usd_per_hour: float | None = None  # one replica's price, where known
    kv_tokens: int | None = None  # KV cache capacity, where the profile knows it (sets num_blocks)
    # Fitted to a server's own steps (tollway profile --from): its HTTP and streaming work on the
    # cores is in the step times, where a grid profile times the runner alone.
    served: bool = False
    # The engine's SchedulerConfig.pause_layers: its steps stop between layers for a fast
    # arrival, so its scheduler plans longer steps beside the fast lane than one whose steps run
    # whole. The simulated scheduler must plan as the engine's does.
    pause_layers: int = 0
    # A served profile's streamed calls, per lane: [intake, delivery] seconds in the server beside
    # the engine and the requests the engine held then (CallTiming.overhead), which the simulator
    # draws per call, from calls made as busy: the scheduler sees a call `intake` after it was
    # sent, and its client each token `delivery` after it was made.
    calls: dict[str, list[list[float]]] = field(default_factory=dict)
    notes: str = ""

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a tollway step profile ({FORMAT})")
        fields = {k: v for k, v in data.items() if k != "format"}
        try:
            profile = cls(**fields)
        except TypeError as e:
            raise ValueError(f"a step profile with bad fields: {e}") from None
        if not profile.samples:
            raise ValueError("a step profile without samples")
        if not isinstance(profile.calls, dict) or not all(
                isinstance(calls, list) and all(_call(c) for c in calls) for calls in profile.calls.values()):
            raise ValueError("a step profile whose calls are not [intake seconds, delivery seconds, requests held] "
                             "per lane")
        return profile

    @classmethod
    def load(cls, path: str | Path) -> MachineProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise ValueError(f"cannot read the profile {path}: {e.strerror}") from None
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not JSON") from None

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def shapes(self) -> list[tuple[StepShape, float]]:
        return [(StepShape(kernel, tokens, sampled, attention, chunks), seconds)
                for kernel, tokens, sampled, attention, chunks, seconds in self.samples]

    def drift(self) -> float | None:
        """How much slower (above 0) or faster the machine ran at the end of the profiling than at
        its start: the later half's steps over the fit against the earlier half's (the jitter is in
        the order the steps ran). None without enough steps to tell."""
        half = len(self.jitter) // 2
        if half < 8:
            return None
        return statistics.fmean(self.jitter[half:]) / statistics.fmean(self.jitter[:half]) - 1

    def step_model(self, adaptive: bool = True) -> StepTimeModel:
        """The model fitted to the samples: adaptive for a scheduler (it tracks its overruns and
        refits from the steps it sees every 16 steps, as the engine's does: refitting less
        often left simulated standard steps 18% slower per token than the engine's, against
        11%, in sim_fidelity); fixed for the simulator's ground truth."""
        return StepTimeModel.fit(self.shapes(), refit_every=16 if adaptive else 1 << 62)


def _call(value) -> bool:
    return (isinstance(value, list) and len(value) == 3 and isinstance(value[2], int)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value))


def overhead_line(points: list[tuple[int, float]]) -> list[float]:
    """[a, b]: seconds = a + b x sequences, the least-squares line through (sequences, seconds)
    points of the engine's time per step beside the runner, neither part below 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    return [max(0.0, my - slope * mx), slope]
