"""StepPlan -> batched tensors -> forward -> sample -> StepResult. The only place a step touches torch."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Generator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tollway.config import KV_CACHE_DTYPES, SchedulerConfig
from tollway.model.decoder import DecoderModel, take_rows
from tollway.model.gemma3 import Gemma3Model
from tollway.model.grammar import Grammars
from tollway.model.host_memory import keep_freed_memory, populate_in_background
from tollway.model.attention_metadata import long_tensor, step_metadata
from tollway.model.layers import KVCache, LinearBuilder
from tollway.model.llama import LlamaModel
from tollway.model.native.qmatmul import q8_library
from tollway.model.prompt_logprobs import score_prompt
from tollway.model.row_ops import row_ops_for
from tollway.model.sampling import native_draw, only_argmax_needed, sample, sample_greedy
from tollway.model.step_yield import Paused, StepYield
from tollway.scheduler.plan import ScheduledSeq, StepPlan, StepResult

ARCHITECTURES = {"gemma3": Gemma3Model, "llama": LlamaModel}


class ModelRunner:
    def __init__(self, model_config, tensors: dict[str, torch.Tensor], sched: SchedulerConfig,
                 device: torch.device, kernels: set[str], seed: int = 0, int8_cache: Path | None = None,
                 cache_dir: str | None = None, kv_cache_dtype: str = "auto"):
        """`int8_cache`: a safetensors file that keeps the int8 weight copies between starts;
        `cache_dir`: where compiled kernels are kept (see row_ops.py); `kv_cache_dtype`: one of
        config.KV_CACHE_DTYPES."""
        keep_freed_memory()
        self.device = device
        self.kernels = kernels
        self.block_size = sched.block_size
        max_positions = min(model_config.max_position_embeddings, sched.context_limit())
        int8 = _read_int8(int8_cache) if "int8" in kernels and int8_cache else {}
        # the native library packs q8 weights, and reads any engine's embedding rows on the CPU
        q8 = q8_library(cache_dir) if device.type == "cpu" else None
        build = LinearBuilder(tensors, kernels, device, int8, q8)
        self.model: DecoderModel = ARCHITECTURES[model_config.architecture](
            model_config, tensors, build, max_positions, row_ops_for(device, model_config.head_dim, cache_dir), device)
        if build.quantized and int8_cache:
            _write_int8(int8_cache, int8)
        self.kv_dtype = kv_dtype_for(device, kv_cache_dtype, kernels)
        self.caches = [KVCache(sched.num_blocks * sched.block_size, model_config.num_kv_heads,
                               model_config.head_dim, self.kv_dtype, device) for _ in range(model_config.num_layers)]
        self.window = model_config.sliding_window if "sliding" in model_config.layer_types else None
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.draw = native_draw(cache_dir) if device.type == "cpu" else None
        self.grammars: Grammars | None = None  # the engine's, where its model has a tokenizer
        self.step_yield = StepYield()  # asks a pausable step to stop between layers
        self._paused: tuple[Generator, float, int] | None = None  # (the step, its seconds so far, its id)

    def fault_in_kv(self) -> threading.Thread | None:
        """The CPU KV pool's pages faulted in on a thread of its own, for a server: its first steps
        would otherwise each wait for the pages they first write (host_memory.py). The thread, for
        a benchmark to wait on; None on a GPU."""
        if self.device.type != "cpu":
            return None
        return populate_in_background([t for cache in self.caches for t in (cache.k, cache.v)])

    def execute(self, plan: StepPlan, pausable: bool = False) -> StepResult | None:
        """Runs the step under inference mode, entered here unless the calling thread is in it
        already: a loop of steps enters it once (the server's engine thread does), for entering
        the guard every step is a measurable part of a batch-1 step, its code cold after the LM
        head. `pausable`: the step may stop between two layers where `step_yield` asks it to
        (native layers only): None then, and `resume` runs it on; other steps may run between
        (they must not touch its requests' KV)."""
        if plan.kernel not in self.kernels:
            raise ValueError(f"kernel {plan.kernel!r} was not loaded (loaded: {sorted(self.kernels)})")
        if pausable and self._paused is not None:
            raise RuntimeError(f"step {self._paused[2]} is paused: one paused step at a time")
        return self._advance(self._run(plan, self.step_yield if pausable else None), 0.0, plan.step_id)

    def resume(self) -> StepResult | None:
        """Run the paused step on from where it stopped: its result, or None where it stopped again."""
        if self._paused is None:
            raise RuntimeError("no step is paused")
        run, seconds, step_id = self._paused
        self._paused = None
        return self._advance(run, seconds, step_id)

    @property
    def paused_step(self) -> int | None:
        """The id of the step paused between layers, if one is."""
        return self._paused[2] if self._paused is not None else None

    def _advance(self, run: Generator[None, None, StepResult], seconds: float, step_id: int) -> StepResult | None:
        """Run a step until it ends or pauses; its seconds are the time spent in it, not between."""
        start = time.perf_counter()
        try:
            if torch.is_inference_mode_enabled():
                next(run)
            else:
                with torch.inference_mode():
                    next(run)
        except StopIteration as ended:
            result = ended.value
            result.seconds = seconds + time.perf_counter() - start
            return result
        self._paused = (run, seconds + time.perf_counter() - start, step_id)
        return None

    def _run(self, plan: StepPlan, pause: StepYield | None) -> Generator[None, None, StepResult]:
        """The step, yielding each time its layers stop between two (only where `pause` is given)."""
        # Decodes first so they form one contiguous, batched group of rows.
        seqs = sorted(plan.seqs, key=lambda s: not s.is_decode)
        self.model.cover_positions(max(s.context_len for s in seqs))
        input_ids, positions, meta, logit_rows = self._prepare(seqs)
        sampled = [s for s in seqs if s.sample]
        rows = [r for s in sampled for r in logit_rows[s.request_id]]  # ascending: seqs are in row order
        scoring = [s for s in seqs if s.scored_ids]
        if scoring:  # a chunk's first rows too: they score the prompt tokens after them
            sample_rows = rows
            rows = sorted({*rows, *(r for s in scoring for r in _scored_rows(s, logit_rows))})
        keep = None if len(rows) == len(input_ids) else long_tensor(rows, self.device)
        greedy = bool(sampled) and not scoring and only_argmax_needed(sampled)
        out = self.model.greedy_forward(input_ids, self.caches, meta, plan.kernel, keep, pause) if greedy else None
        if out is None:
            out = self.model.forward(input_ids, positions, self.caches, meta, plan.kernel, keep, pause)
        while isinstance(out, Paused):
            yield
            out = self.model.resume(out, positions, self.caches, meta, plan.kernel, keep, pause)
        argmax = hidden = None
        if isinstance(out, list):
            argmax = out
        else:
            hidden = out
            argmax = self.model.greedy_tokens(hidden, plan.kernel) if greedy else None
        prompt_logprobs, scoring_seconds = {}, {}
        if scoring:
            at = {r: i for i, r in enumerate(rows)}
            for s in scoring:
                start = time.perf_counter()
                mine = take_rows(hidden, long_tensor([at[r] for r in _scored_rows(s, logit_rows)], self.device))
                prompt_logprobs[s.request_id] = score_prompt(self.model, mine, s.scored_ids, s.params.prompt_logprobs,
                                                             plan.kernel)
                scoring_seconds[s.request_id] = time.perf_counter() - start
            if sampled:
                hidden = take_rows(hidden, long_tensor([at[r] for r in sample_rows], self.device))
        tokens, own = {}, {}
        if sampled:
            if argmax is not None:
                picked = sample_greedy(argmax, sampled)
            else:
                masks, own = self.grammars.masks(sampled) if self.grammars is not None else ({}, {})
                logits = self.model.logits(hidden, plan.kernel)
                picked = sample(logits, sampled, self.generator, self.draw, masks)
                if masks:
                    self.grammars.fit(sampled, picked, logits, own)
            for seq, kept in zip(sampled, picked):
                tokens[seq.request_id] = kept
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # Scoring a prompt is its request's own work, as a grammar's mask is: charged to it alone, and
        # left out of what the step model learns a step of this shape costs.
        for rid, seconds in scoring_seconds.items():
            own[rid] = own.get(rid, 0.0) + seconds
        return StepResult(plan.step_id, tokens, 0.0, own, prompt_logprobs)  # its seconds are _advance's

    def _prepare(self, seqs: list[ScheduledSeq]):
        dev, bs = self.device, self.block_size
        ids, pos, slots, logit_rows = [], [], [], {}
        row = 0
        for s in seqs:
            p = list(range(s.start_pos, s.context_len))
            ids.extend(s.token_ids)
            pos.extend(p)
            slots.extend(s.block_table[q // bs] * bs + q % bs for q in p)
            logit_rows[s.request_id] = range(row + s.num_new - s.num_logit_rows, row + s.num_new)
            row += s.num_new
        meta = step_metadata(seqs, pos, slots, bs, self.window, dev, self.model.ops.needs_views)
        return long_tensor(ids, dev), meta.positions, meta, logit_rows


def _scored_rows(seq: ScheduledSeq, logit_rows: dict[str, range]) -> range:
    """The rows of `seq`'s chunk whose logits score its scored_ids: its first ones."""
    first = logit_rows[seq.request_id].stop - seq.num_new  # its logit rows end with its chunk
    return range(first, first + len(seq.scored_ids))


def kv_dtype_for(device: torch.device, kv_cache_dtype: str, kernels: set[str]) -> torch.dtype:
    """"auto": on the CPU float16, which halves what attention reads (greedy output stays within
    test_reference's bounds of transformers), but float32 under the pinned fp32 kernel, which then
    matches transformers exactly; bfloat16 on a GPU."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        if device.type != "cpu":
            return torch.bfloat16
        return torch.float32 if kernels == {"fp32"} else torch.float16
    return getattr(torch, kv_cache_dtype)


def _read_int8(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError):  # absent or damaged: quantize again and rewrite it
        return {}


def _write_int8(path: Path, int8: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(int8, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
