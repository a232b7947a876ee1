"""Prompt logprobs: each prompt token's logprob under the model given the tokens before it, its
rank, and the top-n at its position, from the hidden states its prefill computed anyway. Exact:
the log-softmax in float32 of the same logits sampling would see, before any request's
adjustment (bias, penalties, grammar), as vLLM's prompt_logprobs are."""
from __future__ import annotations

import torch

from tollway.model.decoder import DecoderModel

# Rows of logits made at a time: a whole chunk's (thousands of rows of a 262k vocabulary) would
# be gigabytes; this many is tens of megabytes.
ROWS_AT_ONCE = 32


def score_prompt(model: DecoderModel, hidden: torch.Tensor, targets: tuple[int, ...], top_n: int,
                 kernel: str) -> list[dict]:
    """hidden: [len(targets), H], row i the last layer's state at the position before targets[i].
    An entry per target: {"token_id", "logprob", "rank", "top_logprobs": {id: logprob}} (the
    target first, then the top `top_n`)."""
    entries = []
    for at in range(0, len(targets), ROWS_AT_ONCE):
        logp = torch.log_softmax(model.logits(hidden[at:at + ROWS_AT_ONCE], kernel).float(), dim=-1)
        ids = torch.tensor(targets[at:at + ROWS_AT_ONCE], device=logp.device)
        own = logp.gather(1, ids[:, None])
        ranks = ((logp > own).sum(dim=-1) + 1).tolist()
        top = torch.topk(logp, top_n) if top_n else None
        for j, (token, logprob) in enumerate(zip(ids.tolist(), own[:, 0].tolist())):
            best = {token: logprob}
            if top is not None:
                best.update((t, v) for t, v in zip(top.indices[j].tolist(), top.values[j].tolist()) if t != token)
            entries.append({"token_id": token, "logprob": logprob, "rank": ranks[j], "top_logprobs": best})
    return entries
