"""Activations as qmatmul.c quantizes them, for the tests of its weight formats."""
import torch


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in float64 as int8 values [M, K / 32, 32] with a scale per block of 32."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    qx = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0.0).unsqueeze(-1)).clamp(-127, 127).double()
    return qx, (amax / 127).double()
