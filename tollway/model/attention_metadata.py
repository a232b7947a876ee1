"""What every layer's attention needs to know about a step, built once per step: where the new
keys go, and which cached keys each token reads."""
from __future__ import annotations

import numpy as np
import torch

from tollway.model.layers import ATTENTION_BLOCK, AttentionMetadata, AttentionView, PrefillSpan
from tollway.scheduler.plan import ScheduledSeq

_CPU = torch.device("cpu")  # the native path's block tables stay in host memory


def long_tensor(values: list, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long, device=device), through numpy on the CPU: a decode
    step builds five of these, and torch.tensor's per-call overhead shows in a one-sequence
    step."""
    if device.type != "cpu":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.from_numpy(np.array(values, dtype=np.int64))


def step_metadata(seqs: list[ScheduledSeq], positions: list[int], slots: list[int], block_size: int,
                  window: int | None, device: torch.device, needs_views: bool) -> AttentionMetadata:
    """seqs in row order, decodes first; positions and slots per token. `window`: the sliding
    layers' window (None: the model has none). `needs_views`: the torch path's gathered-key
    views rather than the native path's block tables."""
    meta = AttentionMetadata(slot_mapping=long_tensor(slots, device), positions=long_tensor(positions, device),
                             block_size=block_size)
    layer_types = ("full", "sliding") if window else ("full",)
    if not needs_views:
        width = max(len(s.block_table) for s in seqs)
        meta.tables = long_tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs], _CPU)
        meta.table_rows = long_tensor([i for i, s in enumerate(seqs) for _ in range(s.num_new)], _CPU)
        return meta
    decodes = [s for s in seqs if s.is_decode]
    meta.num_decode = len(decodes)
    if decodes:
        q_pos = torch.tensor([[s.start_pos] for s in decodes], device=device)
        meta.decode_views = _views([s.block_table for s in decodes], q_pos, block_size, window, layer_types)
    row = len(decodes)
    for s in seqs[len(decodes):]:
        q_pos = torch.arange(s.start_pos, s.context_len, device=device).unsqueeze(0)
        meta.prefills.append(PrefillSpan(row, s.num_new, _views([s.block_table], q_pos, block_size, window, layer_types)))
        row += s.num_new
    return meta


def _views(tables: list[tuple[int, ...]], q_pos: torch.Tensor, block_size: int, window: int | None,
           layer_types: tuple[str, ...]) -> dict[str, AttentionView]:
    """Per layer type, the keys for a group of sequences whose query rows sit at positions
    q_pos [B, n]. Keys start at a block-aligned position so padding never reorders a sum."""
    dev, bs = q_pos.device, block_size
    width = max(len(t) for t in tables)
    table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
    last = q_pos.amax(dim=1)  # [B]
    views = {}
    for kind in layer_types:
        if kind == "sliding":
            first = (q_pos.amin(dim=1) - window + 1).clamp(min=0) // ATTENTION_BLOCK * ATTENTION_BLOCK
        else:
            first = torch.zeros_like(last)
        span = int((last + 1 - first).max())
        length = -(-span // ATTENTION_BLOCK) * ATTENTION_BLOCK
        key_pos = first.unsqueeze(1) + torch.arange(length, device=dev)  # [B, L]
        slot_pos = torch.where(key_pos <= last.unsqueeze(1), key_pos, 0)
        slots = table.gather(1, slot_pos // bs) * bs + slot_pos % bs
        allowed = key_pos.unsqueeze(1) <= q_pos.unsqueeze(2)  # [B, n, L]
        if kind == "sliding":
            allowed &= key_pos.unsqueeze(1) > q_pos.unsqueeze(2) - window
        bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))
        views[kind] = AttentionView(slots, bias.unsqueeze(1))
    return views

