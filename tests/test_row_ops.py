"""The compiled row-wise ops agree with the torch reference, and a row's bits never depend
on the rows around it."""
from __future__ import annotations

import shutil

import pytest
import torch

from tollway.model.layers import Rotary
from tollway.model.row_ops import NativeRowOps, TorchRowOps, compiled_library, row_ops_for

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")

CLOSE = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    ops = row_ops_for(torch.device("cpu"), tmp_path_factory.mktemp("cache"))
    assert isinstance(ops, NativeRowOps)
    return ops


def _pairs(native, make):
    """(native result, torch result) of one op on the same fresh inputs."""
    return make(native), make(TorchRowOps())


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_norms_match_torch(native, rows):
    g = torch.Generator().manual_seed(rows)
    x, h = torch.randn(rows, 640, generator=g) * 3, torch.randn(rows, 640, generator=g)
    w1, w2 = torch.rand(640, generator=g) + 0.5, torch.rand(640, generator=g) + 0.5
    for weight in (w1, None):
        torch.testing.assert_close(native.rms_norm(x, weight, 1e-6), TorchRowOps().rms_norm(x, weight, 1e-6), **CLOSE)
    for h_weight, weight in ((w1, w2), (None, w2), (w1, None), (None, None)):
        xa, xb = x.clone(), x.clone()
        na = native.add_rms_norm(xa, h, h_weight, weight, 1e-6)
        nb = TorchRowOps().add_rms_norm(xb, h, h_weight, weight, 1e-6)
        torch.testing.assert_close(xa, xb, **CLOSE)  # the residual is updated in place by both
        assert (na is None) == (nb is None) == (weight is None)
        if na is not None:
            torch.testing.assert_close(na, nb, **CLOSE)


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_torch(native, with_norm):
    heads, kv_heads, d = 4, 1, 256
    rotary = Rotary(d, 10_000.0, 64, None, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g)  # q, k, then v: the kernel reads a strided prefix
    weight = torch.rand(heads + kv_heads, d, generator=g) + 0.5 if with_norm else None
    positions = torch.tensor([0, 7, 8, 40, 63])
    got, want = _pairs(native, lambda ops: ops.qk_norm_rope(qkv, heads + kv_heads, d, weight, 1e-6, rotary, positions))
    assert got.shape == want.shape == (5, heads + kv_heads, d)
    torch.testing.assert_close(got, want, **CLOSE)


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_gated_activation_matches_torch(native, activation):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(6, 2 * 300, generator=g) * 4
    gate_up[0, :4] = torch.tensor([0.0, 50.0, -50.0, 1e-30])  # saturated and tiny inputs
    got, want = _pairs(native, lambda ops: ops.gated(gate_up, 300, activation))
    torch.testing.assert_close(got, want, **CLOSE)


def test_a_row_alone_equals_the_same_row_in_a_batch(native):
    g = torch.Generator().manual_seed(3)
    x, h, w = torch.randn(9, 640, generator=g), torch.randn(9, 640, generator=g), torch.rand(640, generator=g)
    batch_x, alone_x = x.clone(), x[4:5].clone()
    batch = native.add_rms_norm(batch_x, h, w, w, 1e-6)
    alone = native.add_rms_norm(alone_x, h[4:5], w, w, 1e-6)
    assert torch.equal(batch[4:5], alone) and torch.equal(batch_x[4:5], alone_x)
    gate_up = torch.randn(9, 64, generator=g)
    assert torch.equal(native.gated(gate_up, 32, "gelu_tanh")[4:5], native.gated(gate_up[4:5], 32, "gelu_tanh"))


def test_the_build_is_reused_and_a_broken_compiler_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    first = compiled_library(tmp_path)
    assert first is not None and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert compiled_library(tmp_path) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails: a different key, so a fresh build
    assert compiled_library(tmp_path / "other") is None
    assert "row_ops.c" in caplog.text
    assert type(row_ops_for(torch.device("cpu"), tmp_path / "other")) is TorchRowOps
    assert not list((tmp_path / "other").rglob("*.so")) and not list((tmp_path / "other").rglob(".row_ops-*"))
