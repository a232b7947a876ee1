"""Analytic machine profiles: step times estimated from the model's shapes and a hardware
specs table, for machines this project cannot measure. Every profile built here says
`estimate: true`, and every simulated output labels it so.

A step of T tokens, S sampled rows and P query-key pairs is estimated as

    fixed + max(bytes / (bandwidth x BANDWIDTH_EFFICIENCY), flops / (peak x COMPUTE_EFFICIENCY))

bytes: every weight once (linear layers and LM head) plus the KV read: a decode reads each
key of its context once, a prefill once per tile of QUERY_TILE queries (as flash attention
does), in KV bytes per token per layer; flops: 2 x linear parameters x T + 2 x LM-head
parameters x S + 4 x heads x head_dim x layers x P. The simulator fits its step model to these
estimates over the same grid `tollway profile` measures, exactly as it does to measured times.
Sliding-window layers are counted as full attention (an overestimate at long context).

The efficiencies describe a tuned runner (CUDA graphs, fused paged attention: vLLM-class).
tollway's own CUDA path is not one yet: on an H200 it measured 7-8x these estimates
(benchmarks/h200_profile.py), so plan on a measured profile where the runner is tollway's.
"""
from __future__ import annotations

from dataclasses import dataclass

from tollway.model_config import ModelConfig
from tollway.scheduler.machine_profile import MachineProfile

# Achieved fractions of peak, typical of well-tuned inference kernels (vLLM/SGLang decode
# reaches 70-85% of HBM bandwidth; prefill GEMMs 50-70% of dense peak).
BANDWIDTH_EFFICIENCY = 0.75
COMPUTE_EFFICIENCY = 0.6
MEMORY_FOR_KV = 0.9  # of device memory left after the weights (vLLM's gpu_memory_utilization)
QUERY_TILE = 128  # prefill queries per attention tile: each reads the keys once


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_gb_s: float  # memory bandwidth
    bf16_tflops: float  # dense (no sparsity)
    fp8_tflops: float | None
    usd_per_hour: float  # on-demand, one device, late 2026 cloud list prices (rounded)
    fixed_seconds: float  # per step: launches and host work the roofline misses
    memory_gb: float  # device memory: weights, then KV cache
    weight_bytes: float = 2.0  # per parameter as served
    kernel: str = "bf16"  # the dense kernel tollway runs there


# Datasheet figures (dense). CPU: this project's 2-core AVX2 VM class, fp32 FMA peak.
HARDWARE = {h.name: h for h in (
    Hardware("H100", 3350, 989, 1979, 2.50, 0.0015, 80),
    Hardware("H200", 4800, 989, 1979, 3.50, 0.0015, 141),
    Hardware("B200", 8000, 2250, 4500, 5.50, 0.0015, 180),
    Hardware("A100", 2039, 312, None, 1.50, 0.0020, 80),
    Hardware("L4", 300, 121, 242, 0.70, 0.0020, 24),
    Hardware("CPU-2core-AVX2", 12, 0.19, None, 0.10, 0.0050, 24, weight_bytes=4.0, kernel="fp32"),
)}


def hardware(name: str) -> Hardware:
    for key, h in HARDWARE.items():
        if key.lower() == name.lower():
            return h
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")


def linear_parameters(m: ModelConfig) -> tuple[float, float]:
    """(parameters in the layers' linear maps, parameters in the LM head)."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    mlp = 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * (attention + mlp), m.vocab_size * m.hidden_size


def kv_tokens(m: ModelConfig, h: Hardware) -> int:
    """Tokens of KV cache that fit beside the weights."""
    body, head = linear_parameters(m)
    free = h.memory_gb * 1e9 * MEMORY_FOR_KV - (body + head) * h.weight_bytes
    if free <= 0:
        raise ValueError(f"the model's weights do not fit in {h.name}'s {h.memory_gb:g} GB")
    return int(free // m.kv_bytes_per_token())  # bf16


def step_work(m: ModelConfig, h: Hardware, tokens: int, sampled: int, decode_pairs: float,
              prefill_pairs: float = 0.0) -> tuple[float, float]:
    """(bytes moved, FLOPs) of a step: T tokens, S sampled rows, and its query-key pairs."""
    body, head = linear_parameters(m)
    moved = (body + head) * h.weight_bytes + (decode_pairs + prefill_pairs / QUERY_TILE) * m.kv_bytes_per_token()
    flops = (2 * body * tokens + 2 * head * sampled
             + 4 * m.num_heads * m.head_dim * m.num_layers * (decode_pairs + prefill_pairs))
    return moved, flops


def step_seconds(m: ModelConfig, h: Hardware, tokens: int, sampled: int, decode_pairs: float,
                 prefill_pairs: float = 0.0) -> float:
    moved, flops = step_work(m, h, tokens, sampled, decode_pairs, prefill_pairs)
    return h.fixed_seconds + max(moved / (h.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY),
                                 flops / (h.bf16_tflops * 1e12 * COMPUTE_EFFICIENCY))


def analytic_profile(m: ModelConfig, model_name: str, h: Hardware, max_num_seqs: int = 256,
                     max_batched_tokens: int = 8192) -> MachineProfile:
    """Estimated steps over a grid of decodes x context x prefill, in the profile's format."""
    samples = []
    decodes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max_num_seqs]
    for context in (128, 512, 2048, 8192):
        for b in decodes:
            for prefill in (0, 128, 512, 2048):
                if b + prefill > max_batched_tokens:
                    continue
                tokens, sampled = b + prefill, b + (1 if prefill else 0)
                decode_pairs, prefill_pairs = b * context, prefill * (prefill + 1) / 2
                samples.append([h.kernel, tokens, sampled, (decode_pairs + prefill_pairs) / 1000, int(prefill > 0),
                                step_seconds(m, h, tokens, sampled, decode_pairs, prefill_pairs)])
    return MachineProfile(h.name, model_name, samples, int8_max_tokens=0, dense_kernel=h.kernel, estimate=True,
                          usd_per_hour=h.usd_per_hour, kv_tokens=kv_tokens(m, h),
                          notes=(f"estimate from specs: {h.bandwidth_gb_s:g} GB/s x {BANDWIDTH_EFFICIENCY}, "
                                 f"{h.bf16_tflops:g} TFLOP/s bf16 x {COMPUTE_EFFICIENCY}, {h.fixed_seconds * 1e3:g} ms "
                                 "fixed per step"))


def estimated_profile(name: str, model: str) -> MachineProfile:
    """The analytic profile of the named hardware serving `model` (a name or path): an unknown
    hardware name fails before the model is read."""
    from tollway.checkpoint import model_config

    spec = hardware(name)
    return analytic_profile(model_config(model), model, spec)
