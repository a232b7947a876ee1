"""`tollway plan`: the cheapest fleet that meets every tier's SLOs at a target request rate.

Candidates cross the batch cap (max_num_seqs) with the fast lane's reserved share of
sequences; for each, the replica count is searched (fewest that meets the SLOs: more replicas
never make latency worse at a fixed rate). Each candidate is judged by simulating the
workload on the real scheduler: a tier meets its SLOs when at least `attainment` of its
requests finish within all of its limits (the bench's goodput rule). The cheapest fleet wins;
ties go to the higher goodput.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tqdm import tqdm

from tollway.config import SchedulerConfig
from tollway.scheduler.machine_profile import MachineProfile
from tollway.sim.simulator import simulate
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.stats import SLO
from tollway.traffic.workload import Workload


@dataclass
class Candidate:
    replicas: int
    max_num_seqs: int
    fast_reserved_seq_share: float
    usd_per_hour: float
    meets: bool = False
    attainment: dict[str, float] = field(default_factory=dict)  # tier -> share of requests within its SLOs
    cost_per_m_output: dict[str, float | None] = field(default_factory=dict)  # tier (and "all") -> $
    result: dict | None = None

    def describe(self) -> str:
        return (f"{self.replicas} replica{'s' * (self.replicas > 1)}, max_num_seqs {self.max_num_seqs}, "
                f"fast reserve {self.fast_reserved_seq_share:.0%}")


def candidate_config(config: SchedulerConfig, slo: SLO, max_num_seqs: int, reserve: float) -> SchedulerConfig:
    """The scheduler settings a candidate runs with: its batch cap and fast reserve, and each
    lane's targets set from the SLOs it must meet (fast and standard TPOT, fast TTFT), so that
    the scheduler shapes steps for them."""
    cfg = copy.deepcopy(config)
    cfg.max_num_seqs = max_num_seqs
    cfg.tiers["fast"].reserved_seq_share = reserve
    for tier in ("fast", "standard"):
        limits = slo.for_tier(tier)
        if "tpot" in limits:
            cfg.tiers[tier].tpot_target = limits["tpot"]
    if "ttft" in slo.for_tier("fast"):
        cfg.tiers["fast"].ttft_target = slo.for_tier("fast")["ttft"]
    cfg.validate()
    return cfg


def evaluate(config: SchedulerConfig, machine: MachineProfile, workload: Workload, qps: float, requests: int,
             slo: SLO, attainment: float, replicas: int, max_num_seqs: int, reserve: float,
             routing: str = "tier_aware") -> Candidate:
    if machine.usd_per_hour is None:
        raise ValueError("the profile has no price: give --usd-per-hour")
    cfg = candidate_config(config, slo, max_num_seqs, reserve)
    result = simulate(cfg, machine, workload, [LoadPattern(f"rate {qps:g}/s", rate=qps)], Limits(max_requests=requests),
                      replicas, routing, slo, progress=False, token_times=0)
    summary = result["stages"][0]["summary"]
    shares = {t: m["goodput_share"] or 0.0 for t, m in summary["tiers"].items()}
    costs = {t: m["cost_per_m_output"] for t, m in summary["tiers"].items()} | {"all": summary["all"]["cost_per_m_output"]}
    meets = bool(shares) and all(s >= attainment for s in shares.values())
    return Candidate(replicas, max_num_seqs, reserve, machine.usd_per_hour * replicas, meets, shares, costs, result)


def plan(config: SchedulerConfig, machine: MachineProfile, workload: Workload, qps: float, slo: SLO,
         attainment: float = 0.99, requests: int = 2000, max_replicas: int = 64,
         batch_caps: tuple[int, ...] = (64, 128, 256), reserves: tuple[float, ...] = (0.05, 0.125, 0.25),
         progress: bool = True) -> list[Candidate]:
    """Every candidate's cheapest feasible fleet, cheapest first (infeasible ones last)."""
    if not slo.limits:
        raise ValueError("plan needs SLOs to meet: --slo ttft=...,tpot=...")
    if not qps > 0:
        raise ValueError(f"--qps must be > 0, got {qps}")
    best = []
    combos = [(cap, reserve) for cap in batch_caps for reserve in reserves]
    with tqdm(total=len(combos), desc="planning", unit="config", disable=not progress) as bar:
        for cap, reserve in combos:
            def at(n: int) -> Candidate:
                return evaluate(config, machine, workload, qps, requests, slo, attainment, n, cap, reserve)

            # Grow the fleet by doubling until it meets the SLOs, then bisect down to the fewest.
            lo, hi, found = 0, 1, at(1)
            while not found.meets and hi < max_replicas:
                lo, hi = hi, min(hi * 2, max_replicas)
                found = at(hi)
            while found.meets and hi - lo > 1:
                mid = (lo + hi) // 2
                trial = at(mid)
                if trial.meets:
                    hi, found = mid, trial
                else:
                    lo = mid
            best.append(found)
            bar.update()
    return sorted(best, key=lambda c: (not c.meets, c.usd_per_hour, -min(c.attainment.values(), default=0)))
