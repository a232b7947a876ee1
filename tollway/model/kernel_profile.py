"""Time every linear layer plus the LM head per kernel and step size.

This is the matmul-only floor of a step, and it is how `kernel="auto"` learns the
step size at which the int8 weight-only kernel stops beating the dense one
(a GEMV-style kernel wins while memory-bound, loses once compute-bound).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from tollway.model.decoder import DecoderModel
from tollway.model.layers import Linear
from tollway.model.measured import remembered


def model_linears(model: DecoderModel) -> list[Linear]:
    found = []
    for layer in model.layers:
        found += [layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down]
    return found + [model.lm_head]


@torch.inference_mode()
def matmul_floor_seconds(model: DecoderModel, kernel: str, num_tokens: int, repeats: int = 3,
                         head: bool = True) -> float:
    """Median time of `repeats` passes through every linear layer (the LM head only if `head`) at
    `num_tokens` rows: the median, like the step times it is compared with, so machine noise
    biases neither side."""
    linears = model_linears(model) if head else model_linears(model)[:-1]
    device = model.embed.device
    inputs = {lin.in_features: torch.randn(num_tokens, lin.in_features, device=device) for lin in linears}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for lin in linears:
            lin(inputs[lin.in_features], kernel)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def int8_crossover(model: DecoderModel, dense_kernel: str, sizes=(1, 2, 4, 8, 16, 32)) -> tuple[int, dict]:
    """Largest step size (tokens) up to which int8 is at least as fast as `dense_kernel`, with the
    timings; 0 when the model has no int8 copies (the config leaves int8 out beside q8)."""
    if model.lm_head.int8 is None:
        return 0, {}
    timings = {}
    crossover = 0
    for n in sizes:
        t_int8 = matmul_floor_seconds(model, "int8", n)
        t_dense = matmul_floor_seconds(model, dense_kernel, n)
        timings[n] = {"int8": t_int8, dense_kernel: t_dense}
        if t_int8 > t_dense:
            break
        crossover = n
    return crossover, timings


def cached_int8_crossover(model: DecoderModel, dense_kernel: str, cache_file: Path, key: str) -> int:
    """int8_crossover, measured once per (model, machine, threads) and remembered in `cache_file`."""
    return remembered(cache_file, f"{key}|{dense_kernel}", lambda: int8_crossover(model, dense_kernel)[0])
