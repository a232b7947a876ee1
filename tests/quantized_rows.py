"""For the tests of qmatmul.c's weight formats: activations as it quantizes them, and the checks
every format passes on every path."""
import torch


def quantized_rows(x: torch.Tensor, span: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x in float64 as int8 values [M, K / 32, 32] with a scale per block of 32, one scale shared by
    each `span` values (32, or the K-quants' superblock of 256)."""
    spans = x.view(x.shape[0], -1, span)
    amax = spans.abs().amax(-1, keepdim=True)
    qx = torch.round(spans * torch.where(amax > 0, 127 / amax, 0.0)).clamp(-127, 127).double()
    scale = (amax / 127).expand(spans.shape).reshape(x.shape[0], -1, 32)[..., 0]
    return qx.view(x.shape[0], -1, 32), scale.double()


def check_fused_argmax(native_library, packed, x: torch.Tensor) -> None:
    """packed's fused argmax of x on every path, at 1 to 3 threads, is the argmax of its outputs, a
    tie going to the first column. Row 0 of x is set up to tie at columns 17, 3000, 4000, 4999."""
    expected = packed(x).argmax(dim=1)
    assert int(expected[0]) == 17
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)  # ties across the threads' column ranges too
            for isa in native_library.supported:
                assert torch.equal(packed.argmax(x, isa), expected), (count, isa)
    finally:
        torch.set_num_threads(threads)
