"""Turn one step's logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs."""
from __future__ import annotations

import torch

from tollway.scheduler.plan import SampledToken, ScheduledSeq


def sample(logits: torch.Tensor, seqs: list[ScheduledSeq], generator: torch.Generator) -> list[SampledToken]:
    """logits: [S, V] float32, row i belongs to seqs[i]."""
    # argmax over every row costs less than copying out the greedy ones (47 MB at 45 rows).
    tokens = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[i] = _sample_row(logits[i], seq, generator)
    ids = tokens.tolist()
    out = [SampledToken(t) for t in ids]
    wants = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if wants:
        logp = torch.log_softmax(logits[wants], dim=-1)
        for j, i in enumerate(wants):
            out[i].logprob = float(logp[j, ids[i]])
            n = seqs[i].params.logprobs
            if n:
                top = torch.topk(logp[j], n)
                out[i].top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
    return out


def _sample_row(row: torch.Tensor, seq: ScheduledSeq, generator: torch.Generator) -> torch.Tensor:
    p = seq.params
    scaled = row / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True)
        probs_sorted = torch.softmax(sorted_vals, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top token always stays.
        drop = (torch.cumsum(probs_sorted, dim=-1) - probs_sorted) >= p.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.seed is not None:
        # Seeded by (seed, position) rather than a running stream, so the draw does not
        # depend on batching, on other requests, or on recompute after preemption.
        generator = torch.Generator(device=row.device).manual_seed((p.seed * 1_000_003 + seq.context_len) % (2**63))
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()
