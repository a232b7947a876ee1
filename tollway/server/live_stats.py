"""A rolling record of what the engine did, for the live dashboard (/dashboard).

Fed on the engine thread after every step (AsyncEngine's on_step hook, like Metrics) and read
from the event loop, so both sides hold a lock, and a read copies before it computes. Memory
is bounded whatever the load: steps and latency samples live in deques with a maximum length,
and a read looks only at the last WINDOW seconds (HISTORY for the charts over time).
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from tollway.config import TIERS
from tollway.scheduler.step_model import StepShape
from tollway.step_report import StepReport
from tollway.traffic.stats import percentile

WINDOW = 60.0  # seconds: the figures per lane, the prefix-cache hit rate, the rates
HISTORY = 120.0  # seconds: the charts over time
MAX_STEPS = 16384  # ~20 min of CPU steps, ~2 min of GPU ones: the batch economics curve's data
MAX_SAMPLES = 4096  # latency samples kept per tier and kind
HISTORY_BINS = 480  # points per chart over time, whatever the step rate
ECONOMICS_POINTS = 400  # latest steps drawn one by one on the batch economics plot


class StepSplit(NamedTuple):
    """A step's work in two parts: sequences generating (one token each, maybe with drafts to
    verify) and prompt chunks, with the generating part's share of the step's time."""

    decode_seqs: int
    decode_tokens: int  # the tokens they generated, accepted drafts included
    prefill_tokens: int
    decode_share: float | None  # None: a step with both, and no step model to split it

    @classmethod
    def of(cls, plan, result, model) -> StepSplit:
        """The decodes' share is what the step model predicts for them alone: a step's fixed
        cost (reading the weights) is theirs, and prefill pays what it adds to the step."""
        decodes = [s for s in plan.seqs if s.is_generation]
        generated = sum(len(result.tokens.get(s.request_id, ())) for s in decodes)
        prefill = sum(s.num_new for s in plan.seqs if not s.is_generation)
        share = 1.0 if not prefill else 0.0 if not decodes else None
        if share is None and model is not None:
            whole = model.predict(plan.shape)
            share = min(1.0, model.predict(StepShape.of(plan, decodes)) / whole) if whole > 0 else None
        return cls(len(decodes), generated, prefill, share)


@dataclass(frozen=True)
class StepSample:
    time: float  # monotonic
    seqs: int
    tokens: int
    seconds: float
    capped_by: str | None
    kv_usage: float  # share of KV blocks in use after the step
    running: tuple[int, ...]  # per tier, in TIERS order, after the step
    waiting: tuple[int, ...]
    tier_tokens: tuple[int, ...]  # per tier: prompt tokens (at the first token) + generated tokens
    tier_charged: tuple[float, ...]  # per tier: engine seconds the meter charged in this step
    tier_finished: tuple[int, ...]  # per tier: requests that finished in this step (aborts aside)
    prefix_queried: int  # prompt tokens of requests that got their first token in this step
    prefix_hits: int  # of those, found in the prefix cache
    split: StepSplit
    shape: StepShape  # what the step model saw of it: `tollway profile --from` fits a profile to these


class LiveStats:
    def __init__(self, meter=None, engine=None):
        """`meter`, when given, must be observing the same engine, before this: its per-lane
        charges give the cost figures (without it there are none). `engine` (an AsyncEngine):
        the current running and waiting counts and KV use are its published occupancy, not
        the last step's, which an abort after it would leave stale."""
        self.meter, self.engine = meter, engine
        self._lock = threading.Lock()
        self._steps: deque[StepSample] = deque(maxlen=MAX_STEPS)
        self._ttft = {t: deque(maxlen=MAX_SAMPLES) for t in TIERS}  # (time, seconds)
        self._tpot = {t: deque(maxlen=MAX_SAMPLES) for t in TIERS}
        self._calls = {t: deque(maxlen=MAX_SAMPLES) for t in TIERS}  # (intake, delivery seconds, held) per stream
        self._charged = self._meter_totals()
        self.num_steps = 0
        self.generated_tokens = 0
        self.started: float | None = None  # the first step's time

    def _meter_totals(self) -> tuple[float, ...]:
        return tuple(self.meter.tier_seconds[t] for t in TIERS) if self.meter else (0.0,) * len(TIERS)

    def on_step(self, report: StepReport) -> None:
        """Called on the engine thread with each step's report; aborts between steps and paused
        steps are no step, and no finish."""
        if not report.ran:
            return
        plan, result, outputs = report.plan, report.result, report.outputs
        held, now = report.occupancy, time.monotonic()
        tokens, finished = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0)
        queried = hits = generated = 0
        ttft, tpot = [], []
        for out in outputs:
            n = len(out.new_token_ids)
            tokens[out.tier] += n
            generated += n
            if n and out.num_output_tokens == n:  # every token is new: this is the first
                tokens[out.tier] += len(out.prompt_token_ids)
                queried += len(out.prompt_token_ids)
                hits += out.num_cached_prompt_tokens
                ttft.append((out.tier, out.first_token_time - out.arrival_time))
            if out.finished and out.finish_reason != "abort":
                finished[out.tier] += 1
                if out.num_output_tokens > 1:
                    tpot.append((out.tier, (out.time - out.first_token_time) / (out.num_output_tokens - 1)))
        charged = self._meter_totals()
        sample = StepSample(
            now, len(plan.seqs), plan.num_tokens, result.seconds, plan.capped_by,
            held.kv_usage, tuple(held.running[t] for t in TIERS), tuple(held.waiting[t] for t in TIERS),
            tuple(tokens[t] for t in TIERS), tuple(b - a for a, b in zip(self._charged, charged)),
            tuple(finished[t] for t in TIERS), queried, hits,
            StepSplit.of(plan, result, report.step_model), plan.shape)
        self._charged = charged
        with self._lock:
            self._steps.append(sample)
            for tier, value in ttft:
                self._ttft[tier].append((now, value))
            for tier, value in tpot:
                self._tpot[tier].append((now, value))
            self.num_steps += 1
            self.generated_tokens += generated
            if self.started is None:
                self.started = now

    def on_call(self, tier: str, intake: float, delivery: float, held: int) -> None:
        """A streamed call's time in the server beside the engine's (CallTiming.overhead); from
        the event loop."""
        with self._lock:
            self._calls[tier].append((intake, delivery, held))

    def snapshot(self, samples: bool = False) -> dict:
        """The dashboard's figures: the last WINDOW seconds, and the last HISTORY seconds as
        charts over time (times in seconds before now). `samples` adds the window's latencies
        themselves, per kind and tier: a fleet's ingress merges its replicas' percentiles from
        them, since percentiles of parts do not give the percentile of the whole."""
        now = time.monotonic()
        with self._lock:
            steps = list(self._steps)
            ttft = {t: [v for at, v in q if at > now - WINDOW] for t, q in self._ttft.items()}
            tpot = {t: [v for at, v in q if at > now - WINDOW] for t, q in self._tpot.items()}
            totals = {"steps": self.num_steps, "generated_tokens": self.generated_tokens}
            # Rates divide by the time observed: the window, or less in the first minute.
            span = min(WINDOW, now - self.started) if self.started is not None else WINDOW
        recent = [s for s in steps if s.time > now - WINDOW]
        price = self.meter.price_card.price_per_second if self.meter else None
        held = self.engine.occupancy if self.engine else None  # None: no engine behind it (tests)
        tiers = {}
        for i, tier in enumerate(TIERS):
            tier_tokens = sum(s.tier_tokens[i] for s in recent)
            cost = price * sum(s.tier_charged[i] for s in recent) if price is not None else None
            tiers[tier] = {
                **lane_latency(ttft[tier], tpot[tier]),
                "finished": sum(s.tier_finished[i] for s in recent),
                "running": held.running[tier] if held else 0, "waiting": held.waiting[tier] if held else 0,
                "tokens": tier_tokens, "cost": cost, "cost_per_m_tokens": per_million(cost, tier_tokens),
            }
        queried = sum(s.prefix_queried for s in recent)
        totals.update(tokens_per_s=sum(s.tokens for s in recent) / span, steps_per_s=len(recent) / span,
                      busy=min(1.0, sum(s.seconds for s in recent) / span))
        body = {
            "window": WINDOW, "history": HISTORY, "totals": totals, "tiers": tiers,
            "kv_usage": held.kv_usage if held else 0.0,
            "prefix_cache": prefix_cache(queried, sum(s.prefix_hits for s in recent)),
            "timeline": _timeline([s for s in steps if s.time > now - HISTORY], now),
            "economics": _economics(steps, price),
        }
        if samples:
            body["samples"] = {"ttft": ttft, "tpot": tpot}
        return body


    def steps(self) -> tuple[int, list[list]]:
        """The steps run in all, and every step kept, oldest first, as `tollway profile --from`
        reads them: [monotonic end time, kernel, tokens, sampled, attention, chunks, sequences,
        runner seconds, requests running after it (more than 0: the next step began at once)]."""
        with self._lock:
            total, steps = self.num_steps, list(self._steps)
        return total, [[s.time, *s.shape, s.seqs, s.seconds, sum(s.running)] for s in steps]

    def calls(self) -> dict[str, list[list[float]]]:
        """Per lane, the streamed calls kept, oldest first, [intake seconds, delivery seconds,
        requests the engine held]: what a simulation adds to the engine's latencies for the
        server's own work on each call, as busy as the server was."""
        with self._lock:
            return {tier: [list(c) for c in q] for tier, q in self._calls.items() if q}


# These three are public: a fleet's dashboard (tollway/fleet/dashboard.py) works its figures
# out again from the replicas' samples and sums in the same way.
def lane_latency(ttft: list[float], tpot: list[float]) -> dict:
    """A lane's latency figures from its samples (seconds): TTFT, TPOT and tokens/s per user."""
    return {"ttft": _quantiles(ttft), "tpot": _quantiles(tpot),
            "tok_s_per_user": _quantiles([1 / v for v in tpot if v > 0])}


def per_million(cost: float | None, tokens: int) -> float | None:
    return cost / tokens * 1e6 if cost is not None and tokens else None


def prefix_cache(queried: int, hits: int) -> dict:
    return {"queried": queried, "hits": hits, "hit_rate": hits / queried if queried else None}


def _timeline(steps: list[StepSample], now: float) -> dict:
    """Steps in fixed time bins: means of their sizes and KV use, how many the fast lane's
    target capped, and the lanes' queues at the bin's end."""
    width = HISTORY / HISTORY_BINS
    bins: dict[int, list[StepSample]] = {}
    for s in steps:
        bins.setdefault(int((now - s.time) / width), []).append(s)
    out = {"bin_seconds": width, "t": [], "steps": [], "seqs": [], "tokens": [], "capped": [], "kv_usage": [],
           "running": {t: [] for t in TIERS}, "waiting": {t: [] for t in TIERS}}
    for index in sorted(bins, reverse=True):  # oldest first
        group = bins[index]
        out["t"].append(-(index + 0.5) * width)
        out["steps"].append(len(group))
        out["seqs"].append(sum(s.seqs for s in group) / len(group))
        out["tokens"].append(sum(s.tokens for s in group) / len(group))
        out["capped"].append(sum(s.capped_by == "fast" for s in group))
        out["kv_usage"].append(sum(s.kv_usage for s in group) / len(group))
        for i, tier in enumerate(TIERS):
            out["running"][tier].append(group[-1].running[i])
            out["waiting"][tier].append(group[-1].waiting[i])
    return out


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def _economics(steps: list[StepSample], price_per_second: float | None) -> dict:
    """What a generated token costs against how many sequences generate together, with prefill
    apart: a step's time split by the step model (StepSplit), the decodes' part over the tokens
    they generated, per million, binned by decode sequences in powers of two (1, 2, 3-4, 5-8,
    ...) with the median per bin; the prefill part over its prompt tokens. Mixing the two
    would price a step by what it happened to carry: a one-sequence step with accepted drafts
    looks cheap, a mid-size one with a prompt chunk dear. In dollars when the meter gives a
    price, else in engine seconds."""
    scale = (price_per_second if price_per_second is not None else 1.0) * 1e6
    per_bin: dict[int, list[float]] = {}
    seqs: dict[int, list[int]] = {}
    points, prefill, split_seconds, prefill_seconds = [], [], 0.0, 0.0
    for s in steps:
        d = s.split
        if d.decode_share is None:
            continue
        split_seconds += s.seconds
        prefill_seconds += s.seconds * (1 - d.decode_share)
        if d.prefill_tokens:
            prefill.append(s.seconds * (1 - d.decode_share) / d.prefill_tokens * scale)
        if d.decode_tokens:
            cost = s.seconds * d.decode_share / d.decode_tokens * scale
            b = math.ceil(math.log2(d.decode_seqs))
            per_bin.setdefault(b, []).append(cost)
            seqs.setdefault(b, []).append(d.decode_seqs)
            points.append([d.decode_seqs, cost])
    bins = [{"seqs_min": 2 ** (b - 1) + 1 if b else 1, "seqs_max": 2 ** b, "steps": len(v),
             "seqs_mean": sum(seqs[b]) / len(v), "median": percentile(v, 0.5)} for b, v in sorted(per_bin.items())]
    return {"unit": "$" if price_per_second is not None else "s", "steps": len(steps), "bins": bins,
            "points": points[-ECONOMICS_POINTS:],
            "prefill": {"steps": len(prefill), "median": percentile(prefill, 0.5),
                        "share": prefill_seconds / split_seconds if split_seconds else None},
            "unsplit": sum(s.split.decode_share is None for s in steps)}
