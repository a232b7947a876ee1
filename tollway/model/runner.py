"""StepPlan -> batched tensors -> forward -> sample -> StepResult. The only place a step touches torch."""
from __future__ import annotations

import time

import torch

from tollway.config import SchedulerConfig
from tollway.model.decoder import DecoderModel
from tollway.model.gemma3 import Gemma3Model
from tollway.model.host_memory import keep_freed_memory
from tollway.model.layers import AttentionMetadata, AttentionView, KVCache, PrefillSpan
from tollway.model.llama import LlamaModel
from tollway.model.sampling import sample
from tollway.scheduler.plan import ScheduledSeq, StepPlan, StepResult

ARCHITECTURES = {"gemma3": Gemma3Model, "llama": LlamaModel}


class ModelRunner:
    def __init__(self, model_config, tensors: dict[str, torch.Tensor], sched: SchedulerConfig,
                 device: torch.device, kernels: set[str], seed: int = 0):
        keep_freed_memory()
        self.cfg = model_config
        self.device = device
        self.kernels = kernels
        self.block_size = sched.block_size
        max_positions = min(model_config.max_position_embeddings, sched.max_model_len)
        self.model: DecoderModel = ARCHITECTURES[model_config.architecture](
            model_config, tensors, kernels, max_positions, device)
        # float32 KV on CPU: no native bf16 math on AVX2, and the fp32 kernel then matches transformers exactly.
        kv_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.caches = [KVCache(sched.num_blocks * sched.block_size, model_config.num_kv_heads,
                               model_config.head_dim, kv_dtype, device) for _ in range(model_config.num_layers)]
        self.window = model_config.sliding_window if "sliding" in model_config.layer_types else None
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        if plan.kernel not in self.kernels:
            raise ValueError(f"kernel {plan.kernel!r} was not loaded (loaded: {sorted(self.kernels)})")
        # Decodes first so they form one contiguous, batched group of rows.
        seqs = sorted(plan.seqs, key=lambda s: not s.is_decode)
        input_ids, positions, meta, last_rows = self._prepare(seqs)
        hidden = self.model.forward(input_ids, positions, self.caches, meta, plan.kernel)
        sampled = [s for s in seqs if s.sample]
        tokens = {}
        if sampled:
            rows = torch.tensor([last_rows[s.request_id] for s in sampled], device=self.device)
            logits = self.model.logits(hidden.index_select(0, rows), plan.kernel)
            for seq, tok in zip(sampled, sample(logits, sampled, self.generator)):
                tokens[seq.request_id] = tok
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(plan.step_id, tokens, time.perf_counter() - start)

    def _prepare(self, seqs: list[ScheduledSeq]):
        dev, bs = self.device, self.block_size
        ids, pos, slots, last_rows, prefills = [], [], [], {}, []
        decodes = [s for s in seqs if s.is_decode]
        row = 0
        for s in seqs:
            p = list(range(s.start_pos, s.context_len))
            ids.extend(s.token_ids)
            pos.extend(p)
            slots.extend(s.block_table[q // bs] * bs + q % bs for q in p)
            last_rows[s.request_id] = row + s.num_new - 1
            if not s.is_decode:
                prefills.append(PrefillSpan(row, s.num_new, self._prefill_views(s)))
            row += s.num_new
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decodes),
            decode_views=self._decode_views(decodes) if decodes else {},
            prefills=prefills,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, last_rows)

    def _layer_types(self):
        return ("full", "sliding") if self.window else ("full",)

    def _decode_views(self, decodes: list[ScheduledSeq]) -> dict[str, AttentionView]:
        dev, bs = self.device, self.block_size
        ctx = torch.tensor([s.context_len for s in decodes], device=dev)
        width = max(len(s.block_table) for s in decodes)
        tables = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in decodes],
                              dtype=torch.long, device=dev)
        views = {}
        for kind in self._layer_types():
            first = (ctx - self.window).clamp(min=0) if kind == "sliding" else torch.zeros_like(ctx)
            length = int((ctx - first).max())
            key_pos = first.unsqueeze(1) + torch.arange(length, device=dev)  # [B, L]
            valid = key_pos < ctx.unsqueeze(1)
            key_pos = torch.where(valid, key_pos, 0)
            slot = tables.gather(1, key_pos // bs) * bs + key_pos % bs
            bias = torch.zeros(valid.shape, device=dev).masked_fill_(~valid, float("-inf"))
            views[kind] = AttentionView(slot, bias.view(len(decodes), 1, 1, length))
        return views

    def _prefill_views(self, s: ScheduledSeq) -> dict[str, AttentionView]:
        dev, bs = self.device, self.block_size
        table = torch.tensor(s.block_table, dtype=torch.long, device=dev)
        q_pos = torch.arange(s.start_pos, s.context_len, device=dev).unsqueeze(1)  # [n, 1]
        views = {}
        for kind in self._layer_types():
            first = max(0, s.start_pos - self.window + 1) if kind == "sliding" else 0
            key_pos = torch.arange(first, s.context_len, device=dev)
            allowed = key_pos.unsqueeze(0) <= q_pos
            if kind == "sliding":
                allowed &= key_pos.unsqueeze(0) > q_pos - self.window
            bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))
            slot = table[key_pos // bs] * bs + key_pos % bs
            views[kind] = AttentionView(slot.unsqueeze(0), bias.view(1, 1, *allowed.shape))
        return views
