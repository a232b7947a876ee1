"""Lanes benchmark: how much faster the fast lane really is, and what that costs the others.

    python benchmarks/lanes.py           # full run: about 25 min on a quiet 2-core machine
    python benchmarks/lanes.py --quick   # a few minutes, for development; writes benchmarks/out/ only

One engine on the embedded Gemma 3 270M runs a saturating mixed load: a fixed number of
standard streams (closed loop: a finished request is replaced at once) plus fast requests
arriving at random, about 10% of all requests. The same load, with the same arrival times, runs
under each policy (fcfs, priority, lanes), then without fast traffic (the cost of lanes when
unused), then under lanes at several fast TPOT targets (the price of speed). Every figure is a
ratio between runs of this same script on this same machine.
"""
from __future__ import annotations

import copy
import datetime
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from tqdm import tqdm  # noqa: E402

from common import machine_info, run_benchmark, targets_line  # noqa: E402
from tollway.config import EngineConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.request import SamplingParams  # noqa: E402
from tollway.scheduler.scheduler import Scheduler  # noqa: E402
from tollway.scheduler.step_model import StepShape  # noqa: E402

BENCHMARKS = ROOT / "benchmarks"
FULL = dict(duration=75.0, warmup=20.0, streams=64, fast_share=0.10, standard_prompt=64, standard_tokens=64,
            fast_prompt=64, fast_tokens=32, sweep=(0.02, 0.03, 0.05, 0.1), idle_runs=3)
QUICK = dict(duration=20.0, warmup=8.0, streams=16, fast_share=0.10, standard_prompt=32, standard_tokens=24,
             fast_prompt=32, fast_tokens=16, sweep=(0.03, 0.08), idle_runs=1)


def prompt(rng: random.Random, length: int) -> list[int]:
    # Ordinary vocabulary ids, distinct per request: no prefix-cache shortcuts.
    return [rng.randrange(1000, 100_000) for _ in range(length)]


# Fast requests are chat-like text: speculation's n-gram drafts need text that text follows.
TOPICS = ["rivers of Europe", "how a bicycle works", "the water cycle", "baking bread", "the planets",
          "how vaccines work", "the history of tea", "learning to swim", "volcanoes", "the Roman roads"]


def text_prompt(engine: Engine, rng: random.Random, length: int) -> list[int]:
    topic = rng.choice(TOPICS)
    text = (f"Write a short list about {topic}. Item 1: {topic} are interesting. Item 2: {topic} are useful. "
            f"Item 3: {topic} are")
    ids = engine.tokenizer.encode(text)
    return (ids * (length // len(ids) + 1))[-length:] if len(ids) < length else ids[-length:]


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LoadRun:
    """One policy under the load, recording every token's arrival time and every step."""

    def __init__(self, engine: Engine, settings: dict, fast_arrivals: list[float], seed: int):
        self.engine, self.s, self.fast_arrivals, self.rng = engine, settings, fast_arrivals, random.Random(seed)
        self.requests: dict[str, dict] = {}  # rid -> tier, arrival, [(time, tokens)]
        self.steps: list[dict] = []
        self.count = 0
        self.typical_context = settings["standard_prompt"] + settings["standard_tokens"] // 2

    def add(self, tier: str, prompt_len: int, max_tokens: int, now: float) -> None:
        rid = f"{tier}-{self.count}"
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = text_prompt(self.engine, self.rng, prompt_len) if tier == "fast" else prompt(self.rng, prompt_len)
        self.engine.add_request(ids, params, tier=tier, request_id=rid)
        self.requests[rid] = {"tier": tier, "arrival": now, "tokens": [], "finished": False}

    def run(self, desc: str) -> dict:
        s, engine = self.s, self.engine
        start = time.monotonic()
        window = (start + s["warmup"], start + s["warmup"] + s["duration"])
        arrivals = [start + t for t in self.fast_arrivals]
        active_standard = 0
        with tqdm(total=round(window[1] - start), desc=desc, unit="s", leave=False) as bar:
            while (now := time.monotonic()) < window[1]:
                while active_standard < s["streams"]:  # closed loop; lengths vary so streams desynchronise
                    n = self.rng.randint(s["standard_tokens"] // 2, s["standard_tokens"] * 3 // 2)
                    self.add("standard", s["standard_prompt"], n, now)
                    active_standard += 1
                pause = engine.runner.step_yield
                pause.clear()  # as the server's engine thread does before each step
                while arrivals and arrivals[0] <= now:
                    # Its TTFT counts from when it arrived, mid-step if so, as a client's would.
                    self.add("fast", s["fast_prompt"], s["fast_tokens"], arrivals.pop(0))
                sched = engine.scheduler
                waiting_standard = len(sched.waiting["standard"])
                # A fast request due while the step runs asks it to stop between layers, from a
                # thread of its own as the server's add does; it is added once the step returns.
                due = arrivals[0] - time.monotonic() if arrivals else None
                ask = threading.Timer(due, pause.ask) if due is not None and due < 1.0 else None
                if ask is not None:
                    ask.start()
                report = engine.step()
                if ask is not None:
                    ask.cancel()
                done = time.monotonic()
                plan, result, outputs = report.plan, report.result, report.outputs
                if report.ran:
                    scheduled = {x.request_id for x in plan.seqs}
                    skipped = sum(1 for r in sched.running.values() if r.tier == "standard" and r.request_id not in scheduled)
                    self.steps.append({
                        "end": done - start, "seconds": result.seconds, "predicted": plan.predicted_seconds,
                        "budget": plan.budget_seconds, "fast": sum(x.tier == "fast" for x in plan.seqs),
                        "fast_decodes": sum(x.tier == "fast" and (x.is_decode or x.num_draft > 0) for x in plan.seqs),
                        "seqs": len(plan.seqs), "tokens": plan.num_tokens, "drafts": sum(x.num_draft for x in plan.seqs),
                        "standard_waiting": waiting_standard + skipped, "in_window": window[0] <= done <= window[1],
                        # the plan with one more standard decode: whether the budget had room for it
                        "one_more": engine.step_model.predict(
                            plan.shape.plus(self.typical_context, 1, 1)),
                    })
                for out in outputs:
                    record = self.requests[out.request_id]
                    if out.new_token_ids:
                        record["tokens"].append((done, len(out.new_token_ids)))
                    if out.finished:
                        record["finished"] = True
                        active_standard -= out.tier == "standard"
                bar.update(max(0, min(bar.total, int(done - start)) - bar.n))
        engine.runner.step_yield.clear()
        engine.abort_all()
        while engine.has_unfinished():  # a step paused at the window's end runs on, then its requests go
            engine.step()
        return self.metrics(*window)

    def metrics(self, t0: float, t1: float) -> dict:
        tiers = {}
        for tier in ("fast", "standard"):
            reqs = [r for r in self.requests.values() if r["tier"] == tier]
            ttft = [r["tokens"][0][0] - r["arrival"] for r in reqs if r["tokens"] and t0 <= r["arrival"] <= t1]
            gaps, per_user = [], []
            for r in reqs:
                # Token events after the first, inside the window, each with the event before it.
                pairs = [(a[0], b) for a, b in zip(r["tokens"], r["tokens"][1:]) if t0 <= b[0] <= t1]
                for before, (t, n) in pairs:
                    gaps += [(t - before) / n] * n  # n tokens at once (accepted drafts) share the gap
                if pairs:
                    per_user.append(sum(n for _, (_, n) in pairs) / (pairs[-1][1][0] - pairs[0][0]))
            tokens = sum(n for r in reqs for t, n in r["tokens"] if t0 <= t <= t1)
            tiers[tier] = {
                "requests": len(reqs), "finished": sum(r["finished"] for r in reqs),
                "tok_s_per_user": statistics.mean(per_user) if per_user else None,
                "ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99),
                "tpot_p50": quantile(gaps, 0.5), "tpot_p99": quantile(gaps, 0.99),
                "tok_s": tokens / (t1 - t0),
            }
        total = sum(t["tok_s"] for t in tiers.values())
        return {"tiers": tiers, "total_tok_s": total, "steps": self.steps}


def fast_steps_of(steps: list[dict]) -> list[dict]:
    """The measured steps that carried fast decodes: the steps a fast TPOT is made of."""
    return [x for x in steps if x["in_window"] and x["fast_decodes"]]


def shaping(run: dict, target: float) -> dict:
    """How the steps that carried fast decodes used the fast target's time. A plan is fitted to
    its budget: the target in predicted seconds, i.e. shrunk by the step model's recent p98
    overrun, so that measured steps meet the target."""
    fast_steps = fast_steps_of(run["steps"])
    crowded = [x for x in fast_steps if x["standard_waiting"] and x["budget"] is not None]
    # Steps planned past the budget on purpose: a newly arrived fast prompt always gets one
    # block, so its first token is not held back by the others' TPOT.
    planned_within = [x for x in fast_steps if x["budget"] is None or x["predicted"] <= x["budget"] * (1 + 1e-9)]

    def share(steps, ok):
        return sum(map(ok, steps)) / len(steps) if steps else None

    return {
        "fast_steps": len(fast_steps),
        "planned_within_budget": len(planned_within),
        "measured_within_target": share(planned_within, lambda x: x["seconds"] <= target),
        "measured_within_target_all": share(fast_steps, lambda x: x["seconds"] <= target),
        "crowded_steps": len(crowded),
        "planned_fill_mean": statistics.mean(x["predicted"] / x["budget"] for x in crowded) if crowded else None,
        # Full: 90% of the budget, or no room left for one more decode (the kernels take rows in
        # groups, so the next row can cost a whole group: see ROW_GROUP in step_model.py).
        "planned_fill_at_least_90pct": share(
            crowded, lambda x: x["predicted"] >= 0.9 * x["budget"] or x["one_more"] > x["budget"]),
        "measured_fill_mean": statistics.mean(x["seconds"] / target for x in crowded) if crowded else None,
        "budget_over_target_mean": statistics.mean(x["budget"] / target for x in crowded) if crowded else None,
        "drafts_sent": sum(x["drafts"] for x in fast_steps),
    }


def idle_single_stream(engine: Engine, settings: dict, runs: int) -> dict:
    """One standard request alone: the speed a user gets from an idle engine."""
    base = copy.deepcopy(engine.config.scheduler)
    base.policy = "fcfs"
    rng = random.Random(99)
    ttfts, speeds = [], []
    for _ in range(runs):
        engine.scheduler = Scheduler(base, engine.step_model)
        start = time.monotonic()
        engine.add_request(text_prompt(engine, rng, settings["fast_prompt"]), SamplingParams(
            max_tokens=settings["fast_tokens"], temperature=0.0, ignore_eos=True), request_id="idle")
        times = []
        while engine.has_unfinished():
            for out in engine.step().outputs:
                times.append(time.monotonic())
        ttfts.append(times[0] - start)
        speeds.append((len(times) - 1) / (times[-1] - times[0]))
    return {"ttft": statistics.median(ttfts), "tok_s": statistics.median(speeds), "runs": runs}


def fast_arrival_times(engine: Engine, s: dict, seed: int) -> list[float]:
    """Poisson fast arrivals at fast_share of all requests, from the step model's estimate of
    how quickly the standard streams turn over; the same times for every policy."""
    shape = StepShape("")
    for _ in range(s["streams"]):
        shape = shape.plus(s["standard_prompt"] + s["standard_tokens"] // 2, 1, 1)
    step = engine.step_model.predict(shape, engine.scheduler.kernel_for(shape))
    standard_rate = s["streams"] / (s["standard_tokens"] * step * 1.3)  # 1.3: the prefill share
    rate = standard_rate * s["fast_share"] / (1 - s["fast_share"])
    rng, t, times = random.Random(seed), s["warmup"] / 2, []
    while t < s["warmup"] + s["duration"]:
        t += rng.expovariate(rate)
        times.append(t)
    return times


def run(settings: dict, quick: bool) -> dict:
    started = time.perf_counter()
    engine = Engine(EngineConfig(), progress=True)
    base = engine.config.scheduler
    default_target = base.tiers["fast"].tpot_target
    result = {
        "command": "python benchmarks/lanes.py" + (" --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {**settings, "default_fast_target": default_target,
                     "standard_slo": base.tiers["standard"].tpot_target, "max_num_seqs": base.max_num_seqs,
                     "fast_ttft_target": base.tiers["fast"].ttft_target, "warm_for": base.tiers["fast"].warm_for,
                     "speculative_tokens": base.speculative_tokens},
        "step_model_start": engine.step_model.to_dict(),
    }
    result["idle"] = idle_single_stream(engine, settings, settings["idle_runs"])
    arrivals = fast_arrival_times(engine, settings, seed=1)
    result["fast_arrivals"] = len(arrivals)

    def load(name: str, policy: str, target: float, with_fast: bool, speculate: bool = True,
             keep_ready: bool = True) -> dict:
        cfg = copy.deepcopy(base)
        cfg.policy = policy
        cfg.tiers["fast"].tpot_target = target
        if not keep_ready:  # neither does a step stop for a fast arrival nor are steps kept short for one
            cfg.tiers["fast"].warm_for, cfg.pause_layers = None, 0
        cfg.speculative_tokens = base.speculative_tokens if speculate else 0
        engine.scheduler = Scheduler(cfg, engine.step_model)
        out = LoadRun(engine, settings, arrivals if with_fast else [], seed=2).run(name)
        out.update(policy=policy, fast_target=target, with_fast=with_fast, shaping=shaping(out, target))
        # The raw steps are kept for the run the shaping figures describe, and only those that
        # `shaping` read: every run's steps came to 4 MB on the q8 engine, its fast steps to 2.4 MB.
        out["num_steps"] = len(out["steps"])
        out["steps"] = fast_steps_of(out["steps"]) if name == "lanes" else []
        if engine.scheduler.speculation.proposed:
            spec = engine.scheduler.speculation
            out["speculation"] = {"proposed": spec.proposed, "accepted": spec.accepted,
                                  "acceptance": spec.accepted / spec.proposed}
        return out

    runs = {}
    for policy in ("fcfs", "priority", "lanes"):
        runs[policy] = load(policy, policy, default_target, True)
    runs["lanes_no_speculation"] = load("lanes without speculation", "lanes", default_target, True, speculate=False)
    runs["lanes_not_ready"] = load("lanes, steps neither paused nor capped for fast", "lanes", default_target, True,
                                   keep_ready=False)
    # Without fast traffic the two policies differ by a few percent at most, less than this
    # machine drifts over minutes: run them A B B A and compare the pairs' means.
    for name in ("fcfs_no_fast", "lanes_no_fast", "lanes_no_fast_again", "fcfs_no_fast_again"):
        policy = name.split("_")[0]
        runs[name] = load(f"{policy} without fast", policy, default_target, False)
    for target in settings["sweep"]:
        if target != default_target:
            runs[f"lanes_{target}"] = load(f"lanes at {target * 1e3:.0f} ms", "lanes", target, True)
    result["runs"] = runs
    model = engine.step_model
    result["step_model"] = {**model.to_dict(), "by_kernel": {
        k: {"steps": e.count, "mean_abs_seconds": e.mean_abs_seconds, "mean_rel": e.mean_rel}
        for k, e in model.error_by_kernel.items()}}
    result["summary"] = summarize(result)
    result["total_seconds"] = time.perf_counter() - started
    result["machine"]["load_average_at_end"] = os.getloadavg()[0]
    return result


def summarize(r: dict) -> dict:
    runs, idle, target = r["runs"], r["idle"], r["settings"]["default_fast_target"]
    lanes = runs["lanes"]
    fast, standard = lanes["tiers"]["fast"], lanes["tiers"]["standard"]
    sweep = []
    for target_s in sorted(r["settings"]["sweep"]):
        run_ = lanes if target_s == target else runs[f"lanes_{target_s}"]
        sweep.append({"fast_target": target_s, "fast_tok_s_per_user": run_["tiers"]["fast"]["tok_s_per_user"],
                      "total_tok_s": run_["total_tok_s"], "fast_finished": run_["tiers"]["fast"]["finished"]})
    no_fast = (runs["lanes_no_fast"]["total_tok_s"] + runs["lanes_no_fast_again"]["total_tok_s"]) / 2
    fcfs_no_fast = (runs["fcfs_no_fast"]["total_tok_s"] + runs["fcfs_no_fast_again"]["total_tok_s"]) / 2
    given_up = (no_fast - lanes["total_tok_s"]) * r["settings"]["duration"]
    summary = {
        "fast_over_standard_per_user": _ratio(fast["tok_s_per_user"], standard["tok_s_per_user"]),
        "fast_over_idle_single_stream": _ratio(fast["tok_s_per_user"], idle["tok_s"]),
        "fast_ttft_p99_over_idle": _ratio(fast["ttft_p99"], idle["ttft"]),
        "not_ready_fast_ttft_p99_over_idle": _ratio(runs["lanes_not_ready"]["tiers"]["fast"]["ttft_p99"], idle["ttft"]),
        "total_over_not_ready": _ratio(lanes["total_tok_s"], runs["lanes_not_ready"]["total_tok_s"]),
        "speculation_speedup": _ratio(fast["tok_s_per_user"],
                                      runs["lanes_no_speculation"]["tiers"]["fast"]["tok_s_per_user"]),
        "priority_fast_over_standard_per_user": _ratio(runs["priority"]["tiers"]["fast"]["tok_s_per_user"],
                                                       runs["priority"]["tiers"]["standard"]["tok_s_per_user"]),
        "lanes_over_fcfs_without_fast": _ratio(no_fast, fcfs_no_fast),
        "planned_fill_at_least_90pct": lanes["shaping"]["planned_fill_at_least_90pct"],
        "measured_within_target": lanes["shaping"]["measured_within_target"],
        "tokens_given_up_per_fast_request": given_up / max(1, fast["finished"]),
        "engine_seconds_given_up_per_fast_request": given_up / no_fast / max(1, fast["finished"]),
        "step_model_mean_abs_ms": r["step_model"]["error"]["mean_abs_seconds"] * 1e3,
        "step_model_mean_rel": r["step_model"]["error"]["mean_rel"],
        "sweep": sweep,
    }
    s = summary
    summary["targets"] = {
        "fast_at_least_4x_standard_per_user": (s["fast_over_standard_per_user"] or 0) >= 4,
        "fast_at_least_half_idle_single_stream": (s["fast_over_idle_single_stream"] or 0) >= 0.5,
        "fast_ttft_p99_within_2x_idle": s["fast_ttft_p99_over_idle"] is not None and s["fast_ttft_p99_over_idle"] <= 2,
        "planned_steps_fill_90pct_of_budget": (s["planned_fill_at_least_90pct"] or 0) >= 0.95,
        "measured_steps_meet_target_95pct": (s["measured_within_target"] or 0) >= 0.95,
        "lanes_within_5pct_of_fcfs_without_fast": (s["lanes_over_fcfs_without_fast"] or 0) >= 0.95,
    }
    return summary


def _ratio(a, b):
    return a / b if a is not None and b else None


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = r["summary"]["sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([p["total_tok_s"] for p in sweep], [p["fast_tok_s_per_user"] for p in sweep], "o-", label="lanes, by fast TPOT target")
    for p in sweep:
        ax.annotate(f"{p['fast_target'] * 1e3:.0f} ms", (p["total_tok_s"], p["fast_tok_s_per_user"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    for policy, marker in (("fcfs", "s"), ("priority", "^")):
        run_ = r["runs"][policy]
        ax.plot([run_["total_tok_s"]], [run_["tiers"]["fast"]["tok_s_per_user"]], marker, label=policy)
    ax.axhline(r["idle"]["tok_s"], color="gray", ls="--", lw=0.8, label="idle single stream")
    ax.set_xlabel("total tokens/s (all lanes)")
    ax.set_ylabel("fast lane tokens/s per user")
    ax.set_title("The price of speed: fast-lane speed against total throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(r: dict, raw: str, png: str) -> str:
    m, s, runs = r["machine"], r["summary"], r["runs"]
    f = lambda v, fmt=".2f": "–" if v is None else format(v, fmt)  # noqa: E731
    ms = lambda v: "–" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
    st = r["settings"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; "
        f"{', '.join(m.get('isa_flags') or ['no AVX2'])}; torch "
        f"{m['torch_threads']} threads); load average {m['load_average_at_start']:.1f} at start, "
        f"{m['load_average_at_end']:.1f} at end. Raw: `{raw}`.",
        "",
        f"Load: {st['streams']} standard streams (closed loop, {st['standard_prompt']}-token prompts, "
        f"{st['standard_tokens'] // 2}–{st['standard_tokens'] * 3 // 2} new tokens) and {r['fast_arrivals']} fast requests "
        f"arriving at random (~{st['fast_share']:.0%} of requests; {st['fast_prompt']}-token prompts, {st['fast_tokens']} "
        f"new tokens); {st['duration']:.0f} s measured after {st['warmup']:.0f} s of warm-up. Fast TPOT target "
        f"{st['default_fast_target'] * 1e3:.0f} ms, standard p99 TPOT SLO {st['standard_slo']:.1f} s. "
        f"Idle single stream: {r['idle']['tok_s']:.1f} tok/s, TTFT {r['idle']['ttft'] * 1e3:.0f} ms. A fast request's "
        "TTFT counts from its arrival, which usually falls in the middle of a step that it must wait out.",
        "",
        "| policy | tier | tok/s per user | TTFT p50 / p99 ms | TPOT p50 / p99 ms | tier tok/s | total tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("fcfs", "priority", "lanes", "lanes_no_speculation", "lanes_not_ready", "fcfs_no_fast", "lanes_no_fast",
                 "lanes_no_fast_again", "fcfs_no_fast_again"):
        run_ = runs[name]
        for tier in ("fast", "standard"):
            t = run_["tiers"][tier]
            if not t["requests"]:
                continue
            lines.append(f"| {name} | {tier} | {f(t['tok_s_per_user'])} | {ms(t['ttft_p50'])} / {ms(t['ttft_p99'])} | "
                         f"{ms(t['tpot_p50'])} / {ms(t['tpot_p99'])} | {f(t['tok_s'], '.1f')} | {f(run_['total_tok_s'], '.1f')} |")
    sh = runs["lanes"]["shaping"]
    spec = runs["lanes"].get("speculation")
    lines += [
        "",
        f"Lanes vs its targets: fast per user {f(s['fast_over_standard_per_user'])}× standard (target ≥ 4) and "
        f"{f(s['fast_over_idle_single_stream'])}× the idle single stream (≥ 0.5); fast TTFT p99 "
        f"{f(s['fast_ttft_p99_over_idle'])}× idle (≤ 2); of {sh['crowded_steps']} fast steps with standard work waiting, "
        f"{f(s['planned_fill_at_least_90pct'], '.0%')} were planned to ≥ 90% of their budget (mean planned fill "
        f"{f(sh['planned_fill_mean'], '.0%')}; the budget averaged {f(sh['budget_over_target_mean'], '.0%')} of the "
        f"target after the step model's p98 overrun, and measured steps filled {f(sh['measured_fill_mean'], '.0%')} of "
        f"the target); {f(s['measured_within_target'], '.0%')} of the {sh['planned_within_budget']} fast steps planned "
        f"within their budget measured within the target (≥ 95%; {sh['fast_steps'] - sh['planned_within_budget']} more "
        f"were planned past it to give a newly arrived fast prompt its first block, and counting them "
        f"{f(sh['measured_within_target_all'], '.0%')} of all {sh['fast_steps']} met it); without fast traffic lanes ran at {f(s['lanes_over_fcfs_without_fast'])}× "
        f"fcfs throughput (≥ 0.95; the mean of two runs each, in the order fcfs, lanes, lanes, fcfs). Under `priority`, fast got {f(s['priority_fast_over_standard_per_user'])}× standard's "
        f"per-user speed: reordering alone does not make it faster.",
        "",
        f"A fast request that arrives mid-step would wait that step out, and standard's SLO alone lets steps "
        f"grow long. So a step stops between two layers for it (the CPU default; the fast arrival asks from a "
        f"thread of its own, as in the server), and no layer is planned past half of fast's "
        f"{st['fast_ttft_target'] * 1e3:.0f} ms TTFT target: fast TTFT p99 {f(s['fast_ttft_p99_over_idle'])}× idle, "
        f"against {f(s['not_ready_fast_ttft_p99_over_idle'])}× with neither pausing nor the warm cap that stands in "
        f"for it where steps cannot stop (`lanes_not_ready`), for {f(s['total_over_not_ready'])}× its total "
        f"throughput.",
        "",
        f"Speculation in the fast lane: {spec['proposed']} drafts, {spec['accepted']} accepted "
        f"({spec['acceptance']:.0%}); fast tok/s per user {f(s['speculation_speedup'])}× the same run without it."
        if spec else "Speculation in the fast lane: no drafts were sent.",
        "",
        f"The price of speed (plot: `{png}`): each fast request cost the other lanes "
        f"{s['tokens_given_up_per_fast_request']:.0f} tokens, {s['engine_seconds_given_up_per_fast_request']:.1f} s of "
        "the whole engine's output.",
        "",
        "| fast TPOT target ms | fast tok/s per user | total tok/s | fast finished |",
        "|---|---|---|---|",
    ]
    for p in s["sweep"]:
        lines.append(f"| {p['fast_target'] * 1e3:.0f} | {f(p['fast_tok_s_per_user'])} | {p['total_tok_s']:.1f} | {p['fast_finished']} |")
    lines += [
        "",
        f"Step-time model: mean absolute prediction error {s['step_model_mean_abs_ms']:.1f} ms "
        f"({s['step_model_mean_rel']:.0%} of the step) over {r['step_model']['error']['steps']} steps.",
        "",
        targets_line(s["targets"]),
    ]
    return "\n".join(lines)


def figures(result: dict, quick: bool) -> list[str]:
    png = "out/lanes-quick.png" if quick else "results/lanes_tradeoff.png"
    plot(result, BENCHMARKS / png)
    return [png]


if __name__ == "__main__":
    run_benchmark("lanes", __doc__, run, markdown, FULL, QUICK, figures)
