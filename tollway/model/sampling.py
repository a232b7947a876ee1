"""Turn one step's logits into tokens: allowed tokens, bans (min_tokens, bad words), logit_bias,
repetition penalties, grammars' masks and min_p, then greedy, temperature, top-k, top-p, seeds,
logprobs, and the verification of speculative drafts.

A sampled row without drafts is drawn in one native call for the whole step where sampling.c
compiles (`NativeDraw`); torch does the same draw otherwise, and for drafts."""
from __future__ import annotations

import ctypes
import math
import os
from concurrent.futures import Future
from pathlib import Path

import torch

from tollway.model.native.build import native_code_enabled, native_flags, start_build
from tollway.model.native.qmatmul import q8_library
from tollway.checkpoint import cache_root
from tollway.scheduler.plan import SampledToken, ScheduledSeq

_SOURCE = Path(__file__).with_name("sampling.c")
_HEADERS = (Path(__file__).with_name("fast_exp.h"),)


class NativeDraw:
    """sampling.c's draw_rows: a token per row from temperature, top_k, top_p and a uniform,
    on the matmuls' thread pool."""

    def __init__(self, lib: ctypes.CDLL, parallel: int):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._draw = lib.draw_rows
        self._draw.argtypes, self._draw.restype = [p, i64, p, i64, p, p, p, p, p, p, ctypes.c_int32], None
        self._parallel = parallel

    def __call__(self, logits: torch.Tensor, rows: list[int], params: list, uniforms: list[float]) -> list[int]:
        """logits: [*, V] float32, contiguous; params: the rows' SamplingParams (none greedy)."""
        rows_t = torch.tensor(rows, dtype=torch.int64)
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        u = torch.tensor(uniforms, dtype=torch.float64)
        out = torch.empty(len(rows), dtype=torch.int64)
        self._draw(logits.data_ptr(), logits.shape[1], rows_t.data_ptr(), len(rows), temperature.data_ptr(),
                   top_k.data_ptr(), top_p.data_ptr(), u.data_ptr(), out.data_ptr(), self._parallel,
                   torch.get_num_threads())
        drawn = out.tolist()
        if min(drawn) < 0:
            raise MemoryError("draw_rows: out of memory for a row's candidates")
        return drawn


def native_draw(cache_dir: str | os.PathLike | None = None) -> NativeDraw | None:
    """sampling.c built for this machine (native/build.py), on the q8 library's thread pool;
    None without a compiler, or with TOLLWAY_NATIVE=0."""
    if not native_code_enabled():
        return None
    q8 = q8_library(cache_dir)
    lib = sampling_build(cache_dir, q8.forced if q8 else None).result()
    return NativeDraw(ctypes.CDLL(str(lib)), q8.address("q8_parallel")) if lib and q8 else None


def sampling_build(cache_dir: str | os.PathLike | None, forced_isa: str | None) -> Future:
    """The build of sampling.c (build.start_build): the path of the library to come, or None."""
    return start_build(_SOURCE, cache_root(cache_dir) / "native", native_flags(forced_isa), _HEADERS,
                       fallback="torch for sampling")


def sample(logits: torch.Tensor, seqs: list[ScheduledSeq], generator: torch.Generator,
           draw: NativeDraw | None = None, masks: dict[str, torch.Tensor] | None = None) -> list[list[SampledToken]]:
    """logits: [rows, V] float32, seq i owning the next seq.num_logit_rows rows (1, or 1 + k
    when verifying k drafts). Per seq: the drafts it keeps, then the token sampled after them.
    `draw`: the native draw for sampled rows without drafts (else torch's); `masks`: by request
    id, the tokens its grammar allows (grammar.py)."""
    adjust_logits(logits, seqs, masks)
    # argmax over every row costs less than copying out the greedy ones (rows of a whole
    # vocabulary each), and is skipped where no row is greedy.
    argmax = logits.argmax(dim=-1).tolist() if any(seq.params.greedy for seq in seqs) else []
    drawn = _draw_plain(logits, seqs, generator, draw) if draw is not None else {}
    out = []
    row = 0
    for seq in seqs:
        n = seq.num_logit_rows
        if seq.params.greedy:
            ids = _verify_greedy(argmax[row:row + n], seq.drafts)
        elif row in drawn:
            ids = [drawn[row]]
        else:
            ids = _verify_sampled(logits[row:row + n], seq, generator)
        tokens = [SampledToken(t) for t in ids]
        if seq.params.logprobs is not None:
            _add_logprobs(tokens, logits[row:row + len(tokens)], seq.params.logprobs)
        out.append(tokens)
        row += n
    return out


def adjust_logits(logits: torch.Tensor, seqs: list[ScheduledSeq], masks: dict[str, torch.Tensor] | None = None) -> None:
    """In place, each seq's rows, in vLLM's order: allowed_token_ids, bans (min_tokens, bad
    words) and logit_bias, then the penalties (repetition, then frequency and presence), then its
    grammar's mask, then min_p on a sampled row. A row's adjustment depends on its own request
    alone, so batching never changes it."""
    row = 0
    for seq in seqs:
        rows = logits[row:row + seq.num_logit_rows]
        p = seq.params
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(rows.shape[-1], dtype=torch.bool, device=logits.device)
            allowed[p.allowed_token_ids] = True
            rows.masked_fill_(~allowed, float("-inf"))
        if seq.banned_token_ids:  # min_tokens not reached, or a bad word's last token
            rows[:, list(seq.banned_token_ids)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            rows[:, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        for i in range(len(rows)) if p.penalizes_seen or p.penalizes_repeats else ():
            drafts = seq.drafts[:i]  # row i samples after the first i drafts: they count too
            if p.penalizes_seen:
                _penalize_seen(rows[i], seq.seen_token_ids or set(), drafts, p.repetition_penalty)
            if p.penalizes_repeats:
                _penalize(rows[i], seq.output_counts or {}, drafts, p.presence_penalty, p.frequency_penalty)
        allowed = masks.get(seq.request_id) if masks else None
        if allowed is not None:  # a grammar's seq samples one row: it has no drafts
            rows.masked_fill_(~allowed.to(logits.device), float("-inf"))
        if p.min_p and not p.greedy:
            _min_p(rows, p.min_p, p.temperature)
        row += seq.num_logit_rows


def _penalize_seen(row: torch.Tensor, seen: set[int], drafts: tuple[int, ...], penalty: float) -> None:
    """vLLM's repetition_penalty: the logit of each token in the prompt or output (and the drafts
    before the row) divided by `penalty` where positive, multiplied by it where not."""
    ids = torch.tensor(list(seen.union(drafts)), dtype=torch.int64, device=row.device)
    picked = row[ids]
    row[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)


def _penalize(row: torch.Tensor, counts: dict[int, int], drafts: tuple[int, ...], presence: float,
              frequency: float) -> None:
    """OpenAI's penalties: row[t] -= presence * (count_t > 0) + frequency * count_t, counting the
    request's output and the drafts before the row."""
    if drafts:
        counts = dict(counts)
        for t in drafts:
            counts[t] = counts.get(t, 0) + 1
    if counts:
        ids = torch.tensor(list(counts), device=row.device)
        row[ids] -= presence + frequency * torch.tensor(list(counts.values()), device=row.device, dtype=row.dtype)


def _min_p(rows: torch.Tensor, min_p: float, temperature: float) -> None:
    """vLLM's min_p, in logit space: p_t < min_p * p_max after temperature T is
    logit_t < logit_max + T * log(min_p), so no softmax is needed."""
    floor = rows.max(dim=-1, keepdim=True).values + temperature * math.log(min_p)
    rows.masked_fill_(rows < floor, float("-inf"))


def _draw_plain(logits: torch.Tensor, seqs: list[ScheduledSeq], generator: torch.Generator,
                draw: NativeDraw) -> dict[int, int]:
    """Row -> token for every sampled seq without drafts, in one native call; each row's uniform
    comes from the same generator, in the same order, as torch's draw would take it."""
    rows, params, uniforms, row = [], [], [], 0
    for seq in seqs:
        if not seq.params.greedy and not seq.drafts:
            rows.append(row)
            params.append(seq.params)
            uniforms.append(_uniform(_generator(seq, seq.context_len, generator), logits.device))
        row += seq.num_logit_rows
    return dict(zip(rows, draw(logits.float().contiguous(), rows, params, uniforms))) if rows else {}


def only_argmax_needed(seqs: list[ScheduledSeq]) -> bool:
    """Whether each row's raw argmax alone decides the step's tokens: all greedy, no logprobs, nothing
    banned, no penalty, bias or grammar."""
    return all(s.params.greedy and s.params.logprobs is None and not s.banned_token_ids
               and not s.params.adjusts_logits for s in seqs)


def sample_greedy(argmax: list[int], seqs: list[ScheduledSeq]) -> list[list[SampledToken]]:
    """sample() for steps where only_argmax_needed, from the rows' argmax."""
    out, row = [], 0
    for seq in seqs:
        out.append([SampledToken(t) for t in _verify_greedy(argmax[row:row + seq.num_logit_rows], seq.drafts)])
        row += seq.num_logit_rows
    return out


def _verify_greedy(argmax: list[int], drafts: tuple[int, ...]) -> list[int]:
    """Keep drafts while each is the model's own choice; then the model's choice. The output is
    exactly what decoding one token at a time would give."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == argmax[kept]:
        kept += 1
    return list(drafts[:kept]) + [argmax[kept]]


def _verify_sampled(rows: torch.Tensor, seq: ScheduledSeq, generator: torch.Generator) -> list[int]:
    """Rejection sampling against a draft that is a point mass: keep draft d with probability
    p(d); on rejection sample from p with d removed. Each kept token is thereby distributed
    exactly as p, as if sampled one step at a time (Leviathan et al. 2023, with q = 1 at d)."""
    kept: list[int] = []
    first = seq.context_len - seq.num_draft  # the position the first sampled token takes
    for i, draft in enumerate(seq.drafts):
        probs = _probs(rows[i], seq)
        gen = _generator(seq, first + i, generator)
        if float(torch.rand((), generator=gen, device=rows.device)) < float(probs[draft]):
            kept.append(draft)
            continue
        probs[draft] = 0.0
        return kept + [_draw(probs, gen)]
    return kept + [_draw(_probs(rows[len(kept)], seq), _generator(seq, first + len(kept), generator))]


def _probs(row: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
    p = seq.params
    scaled = row / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        scaled = _top_p(scaled, p.top_p)
    return torch.softmax(scaled, dim=-1)


def _top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop a token once the mass of the tokens before it (most likely first) reaches top_p; the
    top token always stays. The kept tokens are a prefix of the descending order, found with
    top-k over ever more tokens rather than a sort of the whole vocabulary, which a large
    vocabulary makes the slowest part of a sampled row."""
    probs = torch.softmax(scaled, dim=-1)
    k = min(_TOP_P_FIRST, probs.numel())
    while True:
        top, order = torch.topk(probs, k)
        mass = torch.cumsum(top, dim=-1)
        if float(mass[-1]) >= top_p or k == probs.numel():
            break
        k = min(k * 16, probs.numel())
    keep = order[(mass - top) < top_p]
    return torch.full_like(scaled, float("-inf")).index_copy_(0, keep, scaled[keep])


_TOP_P_FIRST = 64  # tokens first looked at for top_p: most steps' mass is there


def _generator(seq: ScheduledSeq, position: int, generator: torch.Generator) -> torch.Generator:
    if seq.params.seed is None:
        return generator
    # Seeded by (seed, position) rather than a running stream, so the draw does not depend on
    # batching, on other requests, on recompute after preemption, or on speculation.
    return torch.Generator(device=generator.device).manual_seed((seq.params.seed * 1_000_003 + position) % (2**63))


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A draw from probs (unnormalised is fine) by inverting their running sum at one uniform:
    one random number, where the exponential race draws one per token of the vocabulary."""
    cdf = torch.cumsum(probs, dim=-1)
    u = _uniform(generator, probs.device) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True))
    # u lands past the last step only by rounding; and never on a token of probability 0
    index = min(index, probs.numel() - 1)
    while float(probs[index]) == 0.0:
        index -= 1
    return index


def _uniform(generator: torch.Generator, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64))


def _add_logprobs(tokens: list[SampledToken], rows: torch.Tensor, top_n: int) -> None:
    logp = torch.log_softmax(rows, dim=-1)
    for j, token in enumerate(tokens):
        token.logprob = float(logp[j, token.token_id])
        if top_n:
            top = torch.topk(logp[j], top_n)
            # Tokens a grammar or a ban ruled out have no logprob to show (JSON has no -inf).
            token.top_logprobs = {t: v for t, v in zip(top.indices.tolist(), top.values.tolist()) if v != float("-inf")}
