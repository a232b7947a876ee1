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

from tollway.scheduler.plan import StepPlan

READINESS = "(fast lane readiness)"  # not a request id: the capacity a ready fast lane held idle


def attribute(plan: StepPlan, seconds: float, coefficients: list[float], price_per_second: float) -> dict[str, float]:
    """request id (or READINESS) -> cost of this step, summing to seconds * price_per_second.
    `coefficients`: the step model's, for the plan's kernel (fixed first)."""
    total = seconds * price_per_second
    if not plan.seqs:
        return {}
    fixed, per_token, per_row, per_pair, per_chunk = coefficients
    marginal = {}
    for s in plan.seqs:  # the step model's features of this sequence alone (StepShape.plus), unrounded
        n = s.num_new
        pairs = n * s.start_pos + n * (n + 1) // 2
        marginal[s.request_id] = (per_token * n + per_row * s.num_logit_rows + per_pair * pairs / 1000
                                  + per_chunk * (n > 1))
    work = sum(marginal.values())
    if work <= 0:  # a model that sees no work: split evenly
        return {rid: total / len(marginal) for rid in marginal}
    fast = {s.request_id for s in plan.seqs if s.tier == "fast"}
    if plan.capped_by != "fast" or len(fast) == len(marginal):
        return {rid: total * m / work for rid, m in marginal.items()}
    # Capped by the fast lane: the others pay their marginal work at the model's rate for this
    # step; the fast requests pay the rest, in proportion to their own work.
    others = {rid: total * m / (fixed + work) for rid, m in marginal.items() if rid not in fast}
    rest = total - sum(others.values())
    if not fast:
        return {**others, READINESS: rest}
    fast_work = sum(marginal[rid] for rid in fast)
    charged = {rid: rest * (marginal[rid] / fast_work if fast_work > 0 else 1 / len(fast)) for rid in fast}
    return {**others, **charged}
