"""`tollway advise`: the cheapest lane for each class of traffic that still meets its SLOs.

The mix is simulated on a machine profile with the real scheduler (simulator.py): one trace
of every class's arrivals (Poisson at its rate, lengths drawn from its distributions, one
seed), replayed with each class in a lane. Every assignment replays the same arrivals, so
two assignments differ only by their lanes.

Search, by coordinate descent (small: a few classes take seconds to a minute): start with every
class in standard (or its first allowed lane); then, class by class, simulate the mix with
that class in each lane it may use and the other classes at their current best lanes, and
keep the cheapest lane (its cost per 1M output tokens) in which it meets its SLOs without
pushing a class that met its SLOs past them. Repeat until a round changes nothing (at most
`max_rounds`). Simulations are memoised by assignment, so a class's figures in each lane
come from the final assignment with only that class moved. A class that no lane serves
keeps its lane and is reported as such.

A class meets its SLOs when its TTFT and its TPOT at its percentile are within the limits;
a refused or failed request counts as one past them. Its cost is what the meter charges: the
engine time attributed to its requests at the machine's price (the ledger's `cost`), so what
the fast lane's capped steps hold idle is charged to it, and idle time to no one (the fleet's
$/hour is reported beside it).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tqdm import tqdm

from tollway.config import TIERS, SchedulerConfig
from tollway.scheduler.machine_profile import MachineProfile
from tollway.sim.simulator import TraceRow, simulate
from tollway.sim.traffic_classes import TrafficClass
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.records import RequestRecord
from tollway.traffic.stats import SLO, percentile, request_latencies, summarize
from tollway.traffic.workload import Workload  # labels the run; the trace sets every request

# Costs closer than this are a tie, which goes to the lane billed least (batch, then standard).
TIE = 0.02
_CHEAPEST_FIRST = tuple(reversed(TIERS))


@dataclass
class LaneOutcome:
    """One class in one lane, with the others at their best lanes."""

    lane: str
    meets: bool
    ttft_p99: float | None
    tpot_p99: float | None
    ttft_at: float | None  # at the class's own percentile
    tpot_at: float | None
    cost_per_m_output: float | None
    failed: int  # refused or errored requests
    breaks: list[str] = field(default_factory=list)  # classes that met their SLOs and no longer do
    why_not: str = ""  # why this lane lost, for the lanes not chosen

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class ClassAdvice:
    traffic: TrafficClass
    lane: str | None  # None: no lane meets its SLOs
    lanes: dict[str, LaneOutcome]

    def to_dict(self) -> dict:
        return {"class": self.traffic.to_dict(), "lane": self.lane,
                "lanes": {lane: o.to_dict() for lane, o in self.lanes.items()}}


@dataclass
class Advice:
    classes: list[ClassAdvice]
    hardware: str
    estimate: bool
    replicas: int
    usd_per_hour: float  # the fleet's
    cost_per_m_output: float | None  # the whole mix's, in the recommended assignment
    simulations: int
    requests: int  # simulated per assignment
    search: str = "coordinate descent"

    def to_dict(self) -> dict:
        return {"format": "tollway-advice/1", "hardware": self.hardware, "estimate": self.estimate,
                "replicas": self.replicas, "usd_per_hour": self.usd_per_hour,
                "cost_per_m_output": self.cost_per_m_output, "simulations": self.simulations,
                "requests": self.requests, "search": self.search,
                "assignment": {c.traffic.name: c.lane for c in self.classes},
                "classes": [c.to_dict() for c in self.classes]}


def class_trace(classes: list[TrafficClass], requests: int, seed: int) -> tuple[list[TraceRow], list[int]]:
    """`requests` arrivals of the mix in time order (tier left to fill in) and each one's class."""
    rng = random.Random(seed)
    total = sum(c.rate for c in classes)
    duration = requests / total
    arrivals = []
    for i, c in enumerate(classes):
        t = rng.expovariate(c.rate)
        while t < duration:
            arrivals.append((t, i, c.prompt.draw(rng), c.output.draw(rng)))
            t += rng.expovariate(c.rate)
    arrivals.sort()
    return [TraceRow(t, "", p, o) for t, _, p, o in arrivals], [i for _, i, _, _ in arrivals]


def judge_class(c: TrafficClass, lane: str, records: list[RequestRecord],
                cost_per_m_output: float | None) -> LaneOutcome:
    """A class's outcome in a lane from its requests' records, simulated or measured (the
    advise_check benchmark judges a real run with it)."""
    latencies = [request_latencies(r) for r in records]
    # A failed request is past every limit; TPOT is undefined for one-token replies.
    ttfts = [x["ttft"] if x["ttft"] is not None else math.inf for x in latencies]
    tpots = [math.inf if x["ttft"] is None else x["tpot"] for x in latencies
             if x["ttft"] is None or x["tpot"] is not None]
    at = {"ttft": percentile(ttfts, c.percentile), "tpot": percentile(tpots, c.percentile)}
    meets = bool(records) and all(at[m] is not None and at[m] <= limit for m, limit in c.slo.items())
    return LaneOutcome(lane, meets, _finite(percentile(ttfts, 0.99)), _finite(percentile(tpots, 0.99)),
                       _finite(at["ttft"]), _finite(at["tpot"]), cost_per_m_output, sum(not r.ok for r in records))


class Advisor:
    def __init__(self, config: SchedulerConfig, machine: MachineProfile, classes: list[TrafficClass],
                 replicas: int = 1, routing: str = "tier_aware", requests: int = 1000, seed: int = 0):
        if not classes:
            raise ValueError("advise needs at least one class of traffic")
        names = [c.name for c in classes]
        if len(set(names)) < len(names):
            raise ValueError(f"class names must differ, got {', '.join(names)}")
        if machine.usd_per_hour is None:
            raise ValueError("the profile has no price: give --usd-per-hour")
        if requests < len(classes):
            raise ValueError(f"--requests must be at least the number of classes ({len(classes)}), got {requests}")
        self.config, self.machine, self.classes = config, machine, classes
        self.replicas, self.routing, self.seed = replicas, routing, seed
        self.trace, self.owner = class_trace(classes, requests, seed)
        self._memo: dict[tuple[str, ...], list[LaneOutcome]] = {}
        self._mix_cost: dict[tuple[str, ...], float | None] = {}  # the whole mix's $ per 1M output tokens

    def outcomes(self, assignment: tuple[str, ...]) -> list[LaneOutcome]:
        """Each class's figures with the classes in these lanes (simulated once per assignment)."""
        if assignment not in self._memo:
            trace = [TraceRow(r.arrival, assignment[i], r.prompt_tokens, r.output_tokens)
                     for r, i in zip(self.trace, self.owner)]
            result = simulate(self.config, self.machine, Workload(seed=self.seed), [LoadPattern("advise")],
                              Limits(max_requests=len(trace)), self.replicas, self.routing, trace=trace,
                              progress=False, token_times=0, seed=self.seed)
            self._memo[assignment] = self._judge(assignment, result["stages"][0]["requests"])
        return self._memo[assignment]

    def _judge(self, assignment: tuple[str, ...], requests: list[dict]) -> list[LaneOutcome]:
        # Records come back in arrival order, which is the trace's: record i is arrival i.
        per_second = self.machine.usd_per_hour / 3600
        records = [RequestRecord(**{**r, "tier": self.classes[self.owner[r["index"] - 1]].name,
                                    "cost": None if r["engine_seconds"] is None else r["engine_seconds"] * per_second})
                   for r in requests]
        # priced=False: the cost is the requests' own (usage.cost), not the machine's idle time too.
        summary = summarize(records, SLO({}), None)
        self._mix_cost[assignment] = summary["all"]["cost_per_m_output"]
        return [judge_class(c, lane, [r for r in records if r.tier == c.name],
                            summary["tiers"].get(c.name, {}).get("cost_per_m_output"))
                for c, lane in zip(self.classes, assignment)]

    def advise(self, max_rounds: int = 4, progress: bool = True) -> Advice:
        assignment = [("standard" if "standard" in c.lanes else c.lanes[0]) for c in self.classes]
        steps = max_rounds * sum(len(c.lanes) for c in self.classes)
        with tqdm(total=steps, desc="advising", unit="lane", disable=not progress, leave=False) as bar:
            for _ in range(max_rounds):
                changed = False
                for i, c in enumerate(self.classes):
                    best = self._best_lane(i, tuple(assignment), bar)
                    if best is not None and best != assignment[i]:
                        assignment[i], changed = best, True
                if not changed:
                    break
            bar.update(bar.total - bar.n)
        final = tuple(assignment)
        advice = [self._class_advice(i, final) for i in range(len(self.classes))]
        return Advice(advice, self.machine.hardware, self.machine.estimate, self.replicas,
                      self.machine.usd_per_hour * self.replicas, self._mix_cost[final], len(self._memo),
                      len(self.trace))

    def _moved(self, i: int, assignment: tuple[str, ...], lane: str) -> LaneOutcome:
        """Class i's outcome in `lane`, with the classes it pushes past their SLOs."""
        moved = (*assignment[:i], lane, *assignment[i + 1:])
        before, after = self.outcomes(assignment), self.outcomes(moved)
        outcome = after[i]
        outcome.breaks = [self.classes[j].name for j in range(len(self.classes))
                          if j != i and before[j].meets and not after[j].meets]
        return outcome

    def _best_lane(self, i: int, assignment: tuple[str, ...], bar) -> str | None:
        candidates = []
        for lane in self.classes[i].lanes:
            outcome = self._moved(i, assignment, lane)
            bar.update()
            if outcome.meets and not outcome.breaks:
                candidates.append(outcome)
        return _cheapest(candidates).lane if candidates else None

    def _class_advice(self, i: int, final: tuple[str, ...]) -> ClassAdvice:
        lanes = {lane: self._moved(i, final, lane) for lane in self.classes[i].lanes}
        serving = [o for o in lanes.values() if o.meets and not o.breaks]
        chosen = _cheapest(serving) if serving else None
        for o in lanes.values():
            if o is not chosen:
                o.why_not = _why_not(o, self.classes[i], chosen)
        return ClassAdvice(self.classes[i], chosen.lane if chosen else None, lanes)


def _cheapest(outcomes: list[LaneOutcome]) -> LaneOutcome:
    """The lowest cost per 1M output tokens; within TIE of it, the lane billed least."""
    low = min(o.cost_per_m_output if o.cost_per_m_output is not None else math.inf for o in outcomes)
    near = [o for o in outcomes if (o.cost_per_m_output if o.cost_per_m_output is not None else math.inf)
            <= low * (1 + TIE)]
    return min(near, key=lambda o: _CHEAPEST_FIRST.index(o.lane))


def _why_not(o: LaneOutcome, c: TrafficClass, chosen: LaneOutcome | None) -> str:
    if o.failed:
        return f"misses the SLO: {o.failed} requests refused or failed"
    if not o.meets:
        at = {"ttft": o.ttft_at, "tpot": o.tpot_at}
        misses = [f"{m.upper()} p{c.percentile * 100:g} {_ms(at[m])} > {_ms(limit)}"
                  for m, limit in c.slo.items() if at[m] is None or at[m] > limit]
        return "misses the SLO: " + "; ".join(misses)
    if o.breaks:
        return "pushes " + ", ".join(o.breaks) + " past its SLO"
    if chosen is not None and o.cost_per_m_output is not None and chosen.cost_per_m_output is not None \
            and o.cost_per_m_output > chosen.cost_per_m_output * (1 + TIE):
        return f"costs more: ${o.cost_per_m_output:.4f} vs ${chosen.cost_per_m_output:.4f} per 1M output tokens"
    return f"costs about the same; {chosen.lane if chosen else 'the chosen lane'} is billed less"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
