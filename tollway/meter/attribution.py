"""Who pays for a step: its measured seconds x the price per second, split over its sequences.

Each sequence's share follows its marginal work under the step-time model (tokens through the
linear layers, rows through the LM head, attention pairs, its own attention pass). The step's
fixed cost (reading every weight once) is spread in the same proportion, as a full step
spreads it thin over many sequences.

When the fast lane's target left work out of the step (`plan.capped_by == "fast"`), the other
lanes pay only their marginal work, as they would in the full step they were denied; the fixed
cost and everything else the small step wasted goes to the fast requests in it. That idle
capacity is the real price of speed. A step kept short so that the next fast arrival waits
little (fast's `warm_for`) has no fast request in it: its idle capacity is returned under
READINESS, for the meter to charge to the next fast requests. Either way the shares add up to
the whole step: attributed cost is conserved.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tollway.scheduler.plan import StepPlan
from tollway.scheduler.step_model import attention_pairs

READINESS = "(fast lane readiness)"  # not a request id: the capacity a ready fast lane held idle


class Shares(NamedTuple):
    """A step's cost: per request id (or READINESS), and per unit of marginal work for decodes
    the plan carries as groups (the simulator's coasting, charged over a whole coast at once)."""

    by_request: dict[str, float]
    rate: float  # cost per unit of a grouped decode's marginal work, outside the fast lane
    fast_rate: float  # the same in the fast lane's group


def attribute(plan: StepPlan, seconds: float, coefficients: list[float], price_per_second: float) -> dict[str, float]:
    """request id (or READINESS) -> cost of this step, summing to seconds * price_per_second.
    `coefficients`: the step model's, for the plan's kernel (fixed first)."""
    return shares(plan, seconds, coefficients, price_per_second).by_request


def carry_readiness(by_request: dict[str, float], held: float, fast: Sequence[str]) -> float:
    """Moves a step's READINESS share out of `by_request` into what is `held`, and all that is
    held onto the step's `fast` requests, evenly, when it has any. Returns what is still held.
    The meter and the simulator charge by this one rule."""
    held += by_request.pop(READINESS, 0.0)
    if not fast or not held:
        return held
    for rid in fast:
        by_request[rid] = by_request.get(rid, 0.0) + held / len(fast)
    return 0.0


def decode_work(coefficients: list[float], count: int, pairs: int) -> float:
    """Marginal work of `count` single-token decodes reading `pairs` query-key pairs in all."""
    _, per_token, per_row, per_pair, _ = coefficients
    return (per_token + per_row) * count + per_pair * pairs / 1000


def shares(plan: StepPlan, seconds: float, coefficients: list[float], price_per_second: float,
           groups: Sequence[tuple[int, int, bool]] = ()) -> Shares:
    """attribute(), with the rates that `groups` of decodes beside plan.seqs pay, each
    (count, query-key pairs, whether it is the fast lane's): together all add up to the step."""
    total = seconds * price_per_second
    fixed, per_token, per_row, per_pair, per_chunk = coefficients
    marginal = {}
    for s in plan.seqs:  # the step model's features of this sequence alone (StepShape.plus), unrounded
        n = s.num_new
        pairs = attention_pairs(s.start_pos, n)
        marginal[s.request_id] = (per_token * n + per_row * s.num_logit_rows + per_pair * pairs / 1000
                                  + per_chunk * (n > 1))
    grouped = {fast: sum(decode_work(coefficients, count, pairs) for count, pairs, g_fast in groups if g_fast == fast)
               for fast in (False, True)}
    num_seqs = len(marginal) + sum(count for count, _, _ in groups)
    if not num_seqs:
        return Shares({}, 0.0, 0.0)
    work = sum(marginal.values()) + grouped[False] + grouped[True]
    if work <= 0:  # a model that sees no work: split evenly (grouped decodes need work to share by)
        return Shares({rid: total / len(marginal) for rid in marginal}, 0.0, 0.0)
    fast = {s.request_id for s in plan.seqs if s.tier == "fast"}
    num_fast = len(fast) + sum(count for count, _, g_fast in groups if g_fast)
    if plan.capped_by != "fast" or num_fast == num_seqs:
        rate = total / work
        return Shares({rid: rate * m for rid, m in marginal.items()}, rate, rate)
    # Capped by the fast lane: the others pay their marginal work at the model's rate for this
    # step; the fast requests pay the rest, in proportion to their own work.
    rate = total / (fixed + work)
    others = {rid: rate * m for rid, m in marginal.items() if rid not in fast}
    rest = total - sum(others.values()) - rate * grouped[False]
    if not num_fast:
        return Shares({**others, READINESS: rest}, rate, 0.0)
    fast_work = sum(marginal[rid] for rid in fast) + grouped[True]
    if fast_work <= 0:
        return Shares({**others, **{rid: rest / max(1, len(fast)) for rid in fast}}, rate, 0.0)
    fast_rate = rest / fast_work
    return Shares({**others, **{rid: fast_rate * marginal[rid] for rid in fast}}, rate, fast_rate)
