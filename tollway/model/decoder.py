"""What every architecture exposes to the runner."""
from __future__ import annotations

import torch

from tollway.model.embedding import Embedding
from tollway.model.layers import AttentionMetadata, KVCache, Linear
from tollway.model.row_ops import TorchRowOps
from tollway.model.step_yield import Paused, StepYield


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along the first dimension. On the CPU through numpy: torch runs a decode step's
    gathers on its OpenMP pool, whose threads then spin on the cores the native kernels need."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.int64):
        return t.index_select(0, index)
    return torch.from_numpy(t.numpy()[index.numpy()])


class DecoderModel:
    """A decoder-only LM: `forward` maps a step's tokens to the last layer's hidden states,
    `logits` applies the final norm and the LM head to the rows that sample: only those, for the
    norm is row by row and a prefill's other rows need neither."""

    # each with .attn (qkv_proj, o_proj), .mlp (gate_up, down) and .norms: (input, post-attention,
    # pre-MLP, post-MLP) weights, None where the block has no such norm
    layers: list
    embed: Embedding
    lm_head: Linear
    final_norm: torch.Tensor
    eps: float
    ops: TorchRowOps  # norms, attention and the rest between the matmuls
    final_logit_softcapping: float | None = None

    def cover_positions(self, positions: int) -> None:
        """Rotary tables for positions 0..positions-1 in every layer (Rotary.cover): called before a
        step that reaches them."""
        for rotary in {id(layer.attn.rotary): layer.attn.rotary for layer in self.layers}.values():
            rotary.cover(positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, kernel: str, keep: torch.Tensor | None = None,
                pause: StepYield | None = None) -> torch.Tensor | Paused:
        """The last layer's hidden states of the rows in `keep` (indices, ascending), or of every
        row; every row's K and V go to the caches either way. Paused where `pause` stopped the
        layers (only the native layer loop stops): `resume` runs them on."""
        x = self.embed.rows(input_ids)
        return self.run_layers(x, positions, caches, meta, kernel, keep, pause=pause)

    def resume(self, paused: Paused, positions: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
               kernel: str, keep: torch.Tensor | None = None, pause: StepYield | None = None) -> torch.Tensor | Paused:
        """forward's result for a step `paused` between layers, run on from there (the same step:
        the same rows, positions, caches and metadata)."""
        return self.run_layers(paused.x, positions, caches, meta, kernel, keep, paused.layer, pause)

    def greedy_forward(self, input_ids: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata, kernel: str,
                       keep: torch.Tensor | None = None, pause: StepYield | None = None) -> list[int] | Paused | None:
        """greedy_tokens(forward(...)) in one native call, where the row ops have one for this
        kernel and the LM head's plain argmax kernel serves these rows; None, with nothing run,
        where not. At batch 1 the Python between forward's call and the head's is a few percent of
        a step, its caches cold after the head's weights (row_ops.c's decoder_greedy; the figures
        are in benchmarks/README.md). Paused where `pause` stopped it between layers: `resume`
        runs them on, and greedy_tokens then picks the same tokens."""
        native = self._argmax_head(kernel)
        if native is None or native.prunes(len(input_ids) if keep is None else len(keep)):
            return None
        return self.ops.greedy_step(self, input_ids, caches, meta, kernel, keep, pause)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
                   kernel: str, keep: torch.Tensor | None = None, start: int = 0,
                   pause: StepYield | None = None) -> torch.Tensor | Paused:
        """x through layers `start`.., in place, and then the rows in `keep` (all if None): in one
        native call where the row ops have one for this kernel (native_layers.py), whose last
        layer computes only those rows past their K and V, and which `pause` may stop between
        layers; else layer by layer, every row."""
        done = self.ops.run_layers(self.layers, x, caches, meta, kernel, keep, start, pause)
        if done is not None:
            if done < len(self.layers):
                return Paused(x, done)
            return x if keep is None else x[:len(keep)]
        for layer, cache in zip(self.layers[start:], caches[start:]):
            x = layer(x, positions, cache, meta, kernel)
        return x if keep is None else take_rows(x, keep)

    def logits(self, hidden: torch.Tensor, kernel: str) -> torch.Tensor:
        out = self.lm_head(self.ops.rms_norm(hidden, self.final_norm, self.eps), kernel)
        if self.final_logit_softcapping:
            out = torch.tanh(out / self.final_logit_softcapping) * self.final_logit_softcapping
        return out

    def greedy_tokens(self, hidden: torch.Tensor, kernel: str) -> list[int] | None:
        """Each row's argmax of `logits(hidden, kernel)`, from the LM head's fused epilogue where
        it has one (q8 on the CPU), without writing the logits; None where it has not. The same
        tokens either way: the same matmul, and the first column on ties, as torch.argmax. Not
        under softcapping: tanh can round two different logits to one value."""
        native = self._argmax_head(kernel)
        if native is None:
            return None
        return native.argmax(self.ops.rms_norm(hidden, self.final_norm, self.eps)).tolist()

    def _argmax_head(self, kernel: str):
        """The LM head's native packing where its argmax gives the greedy token, else None."""
        native = self.lm_head.packed(kernel)
        if native is None or self.lm_head.bias is not None or self.final_logit_softcapping:
            return None
        return native
