"""Steps over time, bucketed into the shape `tollway bench` reads from a server's /metrics, for
runs that see every step themselves: the simulator, and the engine run it is checked against."""
from __future__ import annotations

BUCKETS = 200


def step_series(steps: list[tuple[float, int, int, float]], start: float, end: float) -> list[dict]:
    """`steps`: (start, sequences, tokens, seconds) per step."""
    if not steps:
        return []
    width = max((end - start) / BUCKETS, 1e-9)
    buckets: dict[int, list] = {}
    for t, seqs, tokens, seconds in steps:
        b = buckets.setdefault(int((t - start) / width), [0, 0, 0, 0.0])
        b[0] += 1
        b[1] += seqs
        b[2] += tokens
        b[3] += seconds
    return [{"t": start + (k + 1) * width, "interval": width, "steps": n, "seqs_per_step": seqs / n,
             "tokens_per_step": tokens / n, "seconds_per_step": secs / n}
            for k, (n, seqs, tokens, secs) in sorted(buckets.items())]
