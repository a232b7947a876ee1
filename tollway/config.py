"""Engine and scheduler settings (plain dataclasses; no torch here)."""
from __future__ import annotations

from dataclasses import dataclass, field

KERNELS = ("int8", "bf16", "fp32")


@dataclass
class SchedulerConfig:
    block_size: int = 16
    num_blocks: int = 2048  # KV blocks in the pool
    max_num_seqs: int = 64  # cap on sequences per step
    max_num_batched_tokens: int = 512  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int = 8192  # prompt + output, per request
    enable_prefix_caching: bool = True
    # Linear-layer kernel: a fixed name from KERNELS, or "auto" to pick per step by its token count.
    kernel: str = "auto"
    # With kernel="auto": steps of at most this many tokens use int8 weight-only matmuls,
    # larger steps use `dense_kernel`. None: measured on this machine at the first start, then cached.
    int8_max_tokens: int | None = None
    dense_kernel: str = "fp32"

    def validate(self) -> None:
        if self.kernel not in KERNELS + ("auto",):
            raise ValueError(f"kernel must be one of {', '.join(KERNELS + ('auto',))}, got {self.kernel!r}")
        if self.dense_kernel not in KERNELS:
            raise ValueError(f"dense_kernel must be one of {', '.join(KERNELS)}, got {self.dense_kernel!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def kernels_to_load(self) -> set[str]:
        if self.kernel != "auto":
            return {self.kernel}
        return {self.dense_kernel} | ({"int8"} if self.int8_max_tokens != 0 else set())

    def kernel_for(self, num_tokens: int) -> str:
        if self.kernel != "auto":
            return self.kernel
        return "int8" if num_tokens <= self.int8_max_tokens else self.dense_kernel


@dataclass
class EngineConfig:
    model: str = "gemma3-270m"  # a GGUF file, an HF folder, or the embedded default's name
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "cpu", "cuda", or "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores
    cache_dir: str | None = None  # converted-weights cache; None = the user's cache directory
