"""The discrete-event simulator: the real Scheduler (one per replica), fed the same workloads
as `tollway bench`, with a step-time profile standing in for the runner.

Each replica loops plan -> "execute" -> commit, as the engine does; a step takes the profile's
predicted time for its shape, times a draw from the measured jitter (in runs of consecutive
steps, for a served profile: a slow spell slows a request's every token), plus the engine's own
time per step; a served profile's calls add the server's own time per call (server_time.py).
The schedulers keep their own adaptive step models, as on a real machine.
Every step is metered by the real attribution code, so a simulated request carries the engine
seconds a real one would be billed for. The output is a bench result: the same JSON and HTML
report as a measured run.

Prompts and outputs are random token ids: no prefix-cache hits, and no n-gram drafts for the
fast lane (speculation is not simulated, so it is off).

Plain decodes coast (coasting.py, coasting_groups.py): the scheduler carries them as groups, and this
loop meters them and stamps their token times from each replica's StepLog when they stop. The
results are those of planning every sequence in every step (`coast=False`), only faster.
"""
from __future__ import annotations

import copy
import datetime
import functools
import heapq
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from tollway.config import SchedulerConfig
from tollway.meter.attribution import READINESS, carry_readiness, shares
from tollway.request import QueueFullError, Request, SamplingParams
from tollway.scheduler.machine_profile import MachineProfile
from tollway.scheduler.plan import SampledToken, StepPlan, StepResult
from tollway.scheduler.policies import POLICY_TYPES
from tollway.scheduler.scheduler import Scheduler
from tollway.sim.coasting import Coasting
from tollway.sim.coasting_groups import CoastingGroups, CoastingPlan
from tollway.sim.routing import make_router
from tollway.sim.server_time import ServerTime
from tollway.sim.step_log import StepLog
from tollway.sim.step_series import step_series
from tollway.traffic.patterns import Limits, LoadPattern, Stage
from tollway.traffic.records import RequestRecord
from tollway.traffic.results import FORMAT, stage_dict
from tollway.traffic.stats import SLO
from tollway.traffic.workload import Workload, read_jsonl

_ARRIVAL, _STEP_DONE, _STEP_STOPS, _ADMIT = 0, 1, 2, 3
TOKEN_TIMES = 20_000
# A served profile's jitter is drawn in runs of consecutive steps as they ran, about this many
# long: a served machine's slow spells last tens of steps (its steps' jitter stays correlated
# over a few tens of steps apart, and fades by about this many), and slow every token of a
# request in one.
JITTER_RUN = 50


@dataclass
class LayerRun:
    """Layers of a step that may stop between them for a fast arrival, running from `start`,
    `layer_seconds` each; it stops after `stop` of them (all: `layers`) unless asked sooner."""
    start: float
    layer_seconds: float
    layers: int
    stop: int


@dataclass
class PausedStep:
    """A step stopped between layers (the scheduler's suspended plan), run on in slices beside
    fast steps, as Engine._beside_paused does."""
    plan: StepPlan
    runner: float  # its runner seconds, all layers
    layers_left: int


@dataclass
class Replica:
    index: int
    scheduler: Scheduler | None = None
    log: StepLog = field(default_factory=StepLog)
    outstanding_tokens: int = 0  # prompt + max_tokens of its unfinished requests (for routing)
    in_flight: tuple[StepPlan, float] | None = None  # the running step and its runner seconds
    busy_seconds: float = 0.0
    coasting: Coasting | None = None  # its coasters, where its scheduler coasts
    readiness_seconds: float = 0.0  # capacity held idle for the fast lane, not yet charged (as meter.py)
    run: LayerRun | None = None  # the layers in flight, where they may stop for a fast arrival
    paused: PausedStep | None = None
    jitter_at: int | None = None  # where in a served profile's jitter its steps are drawn from
    epoch: int = 0  # a step's end or stop scheduled under an older epoch was called off


@dataclass
class TraceRow:
    arrival: float  # seconds from the stage's start
    tier: str
    prompt_tokens: int
    output_tokens: int


def read_trace(path: str | Path) -> list[TraceRow]:
    """JSONL: {"arrival": s, "tier": "fast", "prompt_tokens": N, "output_tokens": M} per line."""
    rows = []
    for number, d in read_jsonl(path, "--trace"):
        try:
            rows.append(TraceRow(float(d["arrival"]), str(d.get("tier", "standard")), int(d["prompt_tokens"]),
                                 int(d["output_tokens"])))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--trace: line {number} of {path} needs arrival, prompt_tokens and output_tokens") from None
    return sorted(rows, key=lambda r: r.arrival)


@dataclass
class _Stage:
    pattern: LoadPattern
    limits: Limits
    start: float
    measured: int = 0
    records: list[RequestRecord] = field(default_factory=list)


class Simulator:
    def __init__(self, config: SchedulerConfig, machine: MachineProfile, replicas: int = 1,
                 routing: str = "least_outstanding", seed: int = 0, token_times: int = TOKEN_TIMES,
                 coast: bool = True):
        """`token_times`: how many requests (the first ones) keep every token's time, from which
        inter-token latency is measured; the rest keep first and last. A million requests'
        token times would be gigabytes, and ITL percentiles need far fewer. `coast=False`
        plans every sequence in every step (the same results, slower: for checking)."""
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        config = copy.deepcopy(config)
        config.int8_max_tokens, config.dense_kernel = machine.int8_max_tokens, machine.dense_kernel
        config.pause_layers = machine.pause_layers  # plan and pause steps as the profiled engine does
        config.speculative_tokens = 0  # stand-in tokens never repeat: no draft would be found
        # Every prompt starts with its own token: no prefix ever hits, and hashing every block of
        # every prompt for the cache was a third of a large simulation's time.
        config.enable_prefix_caching = False
        if machine.kv_tokens is not None:
            config.num_blocks = max(1, machine.kv_tokens // config.block_size)
        config.validate()
        self.config, self.machine = config, machine
        self.now = 0.0
        self.truth = machine.step_model(adaptive=False)
        clock = lambda: self.now  # noqa: E731
        self.replicas = [Replica(i) for i in range(replicas)]
        for replica in self.replicas:
            if coast and POLICY_TYPES[config.policy].coasts:
                replica.coasting = Coasting(self._stand_in_tokens, functools.partial(self._coasted, replica))
                replica.scheduler = Scheduler(copy.deepcopy(config), machine.step_model(), clock,
                                              CoastingGroups(replica.coasting))
            else:
                replica.scheduler = Scheduler(copy.deepcopy(config), machine.step_model(), clock)
        self.route = make_router(routing)
        self.rng = random.Random(seed)
        self.server_time = ServerTime(machine.calls, seed + 1)  # apart from the jitter's draws
        self.token_times = token_times
        self._events: list = []
        self._order = 0
        # request id -> its record, replica, stage and the seconds its tokens take to the client
        self._live: dict[str, tuple[RequestRecord, Replica, _Stage, float]] = {}
        self._ids = 0
        self._token = seed
        self.steps: list[tuple[float, int, int, float]] = []  # (start, sequences, tokens, seconds)
        self.coasted = 0  # sequence-steps planned as coasting groups
        self.steps_paused = 0  # steps that stopped between layers for a fast arrival

    # ---- a stage ---------------------------------------------------------------------------

    def run_stage(self, workload: Workload, pattern: LoadPattern, limits: Limits, trace: list[TraceRow] | None = None,
                  progress: bool = True) -> Stage:
        """One stage of load, as `tollway bench` runs it, until every request it sent is done."""
        limits.check()
        stage = _Stage(pattern, limits, self.now)
        draws = random.Random(workload.seed)
        if trace is not None:
            shapes = iter((r.tier, r.prompt_tokens, r.output_tokens) for r in trace)
            for row in trace:
                self._push(stage.start + row.arrival, _ARRIVAL, stage)
        else:
            shapes = iter(lambda: workload.draw(draws), None)
        self._shapes = shapes
        step_log_start = len(self.steps)
        with tqdm(total=limits.max_requests, desc=f"simulating {pattern.name}", unit="req", disable=not progress,
                  leave=False) as bar:
            self._bar = bar
            if trace is None and pattern.concurrency is not None:
                for _ in range(pattern.concurrency):
                    self._push(self.now, _ARRIVAL, stage)
            elif trace is None:
                self._arrivals = random.Random(workload.seed + 1)
                self._push(self.now, _ARRIVAL, stage)
            self._trace = trace is not None
            while self._events:
                t, _, kind, data = heapq.heappop(self._events)
                self.now = t
                if kind == _ARRIVAL:
                    self._arrive(data)
                elif kind == _ADMIT:
                    self._admit(*data)
                elif data[1] == data[0].epoch:  # else called off by a stop
                    (self._finish_step if kind == _STEP_DONE else self._stopped)(data[0])
        end = max([self.now, *(r.end for r in stage.records if r.end is not None)])
        steps = step_series(self.steps[step_log_start:], stage.start, end)
        return Stage(pattern, stage.start, end, sorted(stage.records, key=lambda r: r.index), steps)

    def _more(self, stage: _Stage) -> bool:
        limits = stage.limits
        if limits.max_duration is not None and self.now - stage.start >= limits.max_duration:
            return False
        return limits.max_requests is None or stage.measured < limits.max_requests

    def _push(self, t: float, kind: int, data) -> None:
        self._order += 1
        heapq.heappush(self._events, (t, self._order, kind, data))

    def _arrive(self, stage: _Stage) -> None:
        if not self._more(stage):
            return
        shape = next(self._shapes, None)
        if shape is None:
            return
        tier, prompt_tokens, max_tokens = shape
        warmup = self.now - stage.start < stage.limits.warmup
        stage.measured += not warmup
        if not self._trace and stage.pattern.rate is not None:
            shape_k = stage.pattern.burstiness
            self._push(self.now + self._arrivals.gammavariate(shape_k, 1.0 / (stage.pattern.rate * shape_k)),
                       _ARRIVAL, stage)
        self._ids += 1
        record = RequestRecord(self._ids, stage.pattern.name, tier, warmup, prompt_tokens, max_tokens, self.now)
        stage.records.append(record)
        replica = self.replicas[self.route(self.replicas, tier)]
        # The server's time on the call beside the engine: before its scheduler sees it, and
        # from each token to the client.
        intake, delivery = self.server_time.draw(tier, replica.scheduler.num_unfinished)
        if intake > 0:
            self._push(self.now + intake, _ADMIT, (record, stage, replica, delivery))
        else:
            self._admit(record, stage, replica, delivery)

    def _admit(self, record: RequestRecord, stage: _Stage, replica: Replica, delivery: float) -> None:
        """The request reaches its replica's scheduler, past the server's intake."""
        tier, prompt_tokens, max_tokens = record.tier, record.prompt_tokens, record.max_tokens
        # A first token of its own makes every block's hash its own (no prefix-cache hits), and
        # the rest costs nothing to make.
        rid = f"sim-{record.index}"
        prompt = [1_000_000 + record.index, *range(1000, 1000 + prompt_tokens - 1)]
        request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          tier=tier, arrival_time=self.now)
        try:
            replica.scheduler.add(request)
        except QueueFullError as e:
            record.error, record.error_message, record.end = "http_429", str(e), self.now
            self._done(record, stage)
            return
        except ValueError as e:  # a prompt past the context
            record.error, record.error_message, record.end = "http_400", str(e), self.now
            self._done(record, stage)
            return
        record.engine_seconds = 0.0
        replica.outstanding_tokens += prompt_tokens + max_tokens
        self._live[rid] = (record, replica, stage, delivery)
        if replica.in_flight is None:
            self._start_step(replica)
        elif replica.run is not None and replica.scheduler.policy.fast_lane(tier):
            self._ask_stop(replica)

    def _done(self, record: RequestRecord, stage: _Stage) -> None:
        """A request ended: the closed loop's user sends the next, as a client would at once
        (after a refusal, a millisecond later: simulated time must move), or once the end has
        reached it."""
        if not record.warmup:
            self._bar.update()
        if stage.pattern.concurrency is not None and not self._trace:
            if record.error:
                self._push(self.now + 1e-3, _ARRIVAL, stage)
            elif record.end > self.now:
                self._push(record.end, _ARRIVAL, stage)
            else:
                self._arrive(stage)  # before the replica plans its next step, as the engine's callers do

    def _stand_in_tokens(self, count: int) -> range:
        """Output tokens: runs of distinct ids (speculation is off, and nothing else reads them)."""
        self._token = (self._token + count) % 199_000
        return range(1000 + self._token, 1000 + self._token + count)

    def _coasted(self, replica: Replica, request: Request, first: int, last: int, offset: int) -> None:
        """A request coasted through steps first..last: bill them and stamp their tokens."""
        record, _, _, delivery = self._live[request.request_id]
        record.engine_seconds += replica.log.charge(first, last, offset, request.tier == "fast")
        if record.index <= self.token_times:
            record.chunk_times.extend(t + delivery for t in replica.log.times(first, last))

    def _fast_in(self, plan: StepPlan, replica: Replica) -> list[str]:
        """The fast requests the step ran: its own and, when the fast group coasted in it, that group's."""
        fast = [s.request_id for s in plan.seqs if s.tier == "fast" and s.request_id in self._live]
        if isinstance(plan, CoastingPlan) and any(g.fast for g in plan.coasting):
            fast += [rid for rid, c in replica.coasting.members.items() if c.group == "fast"]
        return fast

    def _start_step(self, replica: Replica) -> None:
        plan = replica.scheduler.plan()
        num_seqs = plan.num_seqs
        if not num_seqs:
            if replica.paused is not None:  # no fast step beside it: it runs on to its end
                self._run_on(replica, None)
            else:
                replica.in_flight = None
            return
        runner = self.truth.predict(plan.shape) * self._jitter(replica)
        seconds = runner + self.machine.overhead[0] + self.machine.overhead[1] * num_seqs
        replica.in_flight = (plan, runner)
        replica.busy_seconds += seconds
        self.coasted += num_seqs - len(plan.seqs)
        self.steps.append((self.now, num_seqs, plan.num_tokens, seconds))
        layers = self.config.pause_layers
        replica.run = LayerRun(self.now + seconds - runner, runner / layers, layers, layers) \
            if replica.paused is None and replica.scheduler.may_pause(plan) else None
        self._push(self.now + seconds, _STEP_DONE, (replica, replica.epoch))

    def _jitter(self, replica: Replica) -> float:
        """A step's time over its shape's fit: drawn alone from a grid profile's (ordered by
        shape), and in runs (JITTER_RUN) from a served profile's, which are in the order the
        steps ran."""
        jitter = self.machine.jitter
        if not jitter:
            return 1.0
        if not self.machine.served:
            return self.rng.choice(jitter)
        if replica.jitter_at is None or self.rng.random() < 1 / JITTER_RUN:
            replica.jitter_at = self.rng.randrange(len(jitter))
        else:
            replica.jitter_at = (replica.jitter_at + 1) % len(jitter)
        return jitter[replica.jitter_at]

    # ---- a step paused between layers for a fast arrival (Engine.step, _beside_paused) ------

    def _ask_stop(self, replica: Replica) -> None:
        """A fast request arrived: the layers in flight stop after the current one, unless
        they end or stop sooner."""
        run = replica.run
        done = max(1, math.ceil((self.now - run.start) / run.layer_seconds - 1e-9))
        if done >= run.stop:
            return
        run.stop = done
        replica.epoch += 1
        self._push(run.start + done * run.layer_seconds, _STEP_STOPS, (replica, replica.epoch))

    def _stopped(self, replica: Replica) -> None:
        """The layers in flight stopped partway: a fast step goes next, beside the rest."""
        run, replica.run = replica.run, None
        if replica.paused is None:
            plan, runner = replica.in_flight
            replica.scheduler.suspend()
            replica.paused = PausedStep(plan, runner, run.layers - run.stop)
            self.steps_paused += 1
        else:
            replica.paused.layers_left -= run.stop
        self._start_step(replica)  # plans only fast requests while one is suspended

    def _run_on(self, replica: Replica, fast_seconds: float | None) -> None:
        """The paused step's next slice: until the fast lane's next token is due (the fast
        TPOT target after the fast step began) where fast requests run, else to its end."""
        paused, scheduler = replica.paused, replica.scheduler
        layer_seconds = paused.runner / self.config.pause_layers
        layers = paused.layers_left
        tpot = scheduler.tiers["fast"].tpot_target
        if fast_seconds is not None and tpot is not None and scheduler.running_in("fast"):
            layers = min(layers, max(1, math.ceil(max(0.0, tpot - fast_seconds) / layer_seconds - 1e-9)))
        replica.in_flight = (paused.plan, paused.runner)
        replica.run = LayerRun(self.now, layer_seconds, paused.layers_left, layers)
        replica.epoch += 1
        end = self.now + layers * layer_seconds
        self._push(end, _STEP_DONE if layers == paused.layers_left else _STEP_STOPS, (replica, replica.epoch))

    def _finish_step(self, replica: Replica) -> None:
        replica.run = None
        plan, runner = replica.in_flight
        if replica.paused is not None and plan is replica.paused.plan:  # its last slice ended
            replica.paused = None
            replica.scheduler.resume()
        coefficients = self.truth.coefficients[plan.kernel]
        # Metered before the commit: coasters that stop in it are billed from the log.
        split = shares(plan, runner, coefficients, 1.0, plan.groups() if isinstance(plan, CoastingPlan) else ())
        charged = split.by_request  # the log reads only the rates
        # As the meter does; the step's fast requests are looked up only when there is readiness to charge.
        holding = replica.readiness_seconds or charged.get(READINESS)
        fast = self._fast_in(plan, replica) if holding else ()
        replica.readiness_seconds = carry_readiness(charged, replica.readiness_seconds, fast)
        for rid, seconds in charged.items():
            self._live[rid][0].engine_seconds += seconds
        replica.log.record(plan.step_id, self.now, split, coefficients)
        tokens = {s.request_id: [SampledToken(self._stand_in_tokens(1)[0])] for s in plan.seqs if s.sample}
        changed = replica.scheduler.commit(plan, StepResult(plan.step_id, tokens, runner))
        for request, _ in changed:
            record, _, stage, delivery = self._live[request.request_id]
            seen = self.now + delivery  # when the client has it
            if record.first_token is None:
                record.first_token = seen
            if record.index <= self.token_times and request.request_id in tokens:  # coasters' are stamped
                record.chunk_times.append(seen)
            if request.finished:
                del self._live[request.request_id]
                record.end, record.output_tokens = seen, len(request.output_token_ids)
                replica.outstanding_tokens -= record.prompt_tokens + record.max_tokens
                self._done(record, stage)
        if replica.paused is not None:  # a fast step beside it ended
            self._run_on(replica, runner)
        else:
            self._start_step(replica)
        for other in self.replicas:  # new closed-loop requests may have gone to an idle replica
            if other.in_flight is None and other.scheduler.has_unfinished():
                self._start_step(other)


def simulate(config: SchedulerConfig, machine: MachineProfile, workload: Workload, patterns: list[LoadPattern], limits: Limits,
             replicas: int = 1, routing: str = "least_outstanding", slo: SLO | None = None,
             usd_per_hour: float | None = None, trace: list[TraceRow] | None = None, progress: bool = True,
             token_times: int = TOKEN_TIMES, seed: int | None = None) -> dict:
    """A bench result (FORMAT) for the workload on `replicas` simulated replicas. `seed` draws
    the step times' jitter (default: the workload's seed)."""
    slo = slo or SLO({})
    started = time.perf_counter()
    sim = Simulator(config, machine, replicas, routing, workload.seed if seed is None else seed, token_times)
    stages = [sim.run_stage(workload, p, limits, trace, progress) for p in patterns]
    fleet_price = usd_per_hour if usd_per_hour is not None else (
        machine.usd_per_hour * replicas if machine.usd_per_hour is not None else None)
    label = f"simulated: {replicas} x {machine.hardware}" + (" (estimate)" if machine.estimate else "")
    busy = sum(r.busy_seconds for r in sim.replicas)
    return {
        "format": FORMAT, "label": label, "url": "simulated", "model": machine.model, "endpoint": "simulated",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": workload.to_dict(), "limits": asdict(limits), "slo": slo.limits, "usd_per_hour": fleet_price,
        "steps_exposed": True,
        "stages": [stage_dict(s, slo, fleet_price) for s in stages],
        "simulation": {"hardware": machine.hardware, "estimate": machine.estimate, "replicas": replicas,
                       "routing": routing, "policy": config.policy, "max_num_seqs": config.max_num_seqs,
                       "fast_reserved_seq_share": config.tiers["fast"].reserved_seq_share,
                       "steps": len(sim.steps), "steps_paused": sim.steps_paused, "busy_seconds": busy, "wall_seconds": time.perf_counter() - started,
                       # held idle for the fast lane after its last fast request: no one was charged it
                       "readiness_seconds": sum(r.readiness_seconds for r in sim.replicas),
                       "trace": trace is not None, "left_out": left_out(config, machine)},
    }


def left_out(config: SchedulerConfig, machine: MachineProfile) -> list[str]:
    """What a served run of these settings does that the simulation does not: the bench report
    says so beside the simulated figures."""
    missing = ["prefix-cache hits (every simulated prompt is its own)"]
    if config.speculative_tokens:
        missing.append(f"the fast lane's n-gram drafts (speculative_tokens = {config.speculative_tokens}: "
                       "stand-in tokens never repeat, so nothing is drafted)")
    if not machine.served:
        missing.append("the server's own work on the same cores (HTTP, streaming, detokenizing): the profile "
                       "times the runner alone; `tollway profile --from URL` fits one to a server's own steps")
    if not machine.calls:
        missing.append("the server's time per call beside the engine (reading, tokenizing and checking a request; "
                       "each token's way to the wire): a profile from a server that streamed calls draws it")
    missing.append("the network and the client's own time per call (sending it, reading the stream)")
    return missing
