"""Fused RMSNorm (+ residual), RoPE and SiLU-and-multiply against their torch references, and the
references against the model's own torch path. Under TRITON_INTERPRET=1 on CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.fused_layer_ops import rms_norm, rms_norm_ref, rope, rope_ref, silu_and_mul, silu_and_mul_ref
from minillm.model.llama import apply_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 96), (5, 576)])
def test_rms_norm_matches_reference(dtype, rows, hidden):
    x, w = randn(1, rows, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_norm_and_sum(dtype):
    x, r, w = randn(1, 9, 80, dtype=dtype), randn(1, 9, 80, dtype=dtype, seed=2), randn(80, dtype=dtype, seed=1)
    y, s = rms_norm(x, w, 1e-6, residual=r)
    y_ref, s_ref = rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the sum is rounded exactly as torch rounds it
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_rms_norm_rounds_an_fp32_residual_as_it_loads_it(dtype):
    """The folded norms' fp32 stream as the residual: the same bits as with the residual rounded to x's dtype first."""
    x, w = randn(1, 3, 96, dtype=dtype), randn(96, dtype=dtype, seed=1)
    r = randn(1, 3, 96, seed=2) / 3  # fp32 values that rounding to x's dtype changes
    assert not torch.equal(r, r.to(dtype).float())
    y, s = rms_norm(x, w, 1e-6, residual=r)
    y_rounded, s_rounded = rms_norm(x, w, 1e-6, residual=r.to(dtype))
    assert s.dtype == dtype and torch.equal(s, s_rounded) and torch.equal(y, y_rounded)
    y_ref, s_ref = rms_norm_ref(x, w, 1e-6, residual=r.to(dtype))
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_rms_norm_reference_is_rms_norm():
    x, w = randn(3, 16), randn(16, seed=1)
    expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, dim", [(1, 3, 16), (6, 5, 32), (4, 12, 64)])
def test_rope_matches_reference_and_the_models_rope(dtype, tokens, heads, dim):
    x = randn(tokens, heads, dim, dtype=dtype)
    angles = randn(tokens, dim // 2, seed=3).float()
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = torch.full_like(x, float("nan"))
    torch.testing.assert_close(rope(x, cos, sin, out=out), rope_ref(x, cos, sin), **TOL[dtype])
    if dtype == torch.float32:  # the model's path (per-op rounding) agrees where rounding does not matter
        model = apply_rope(x[None], cos[None, :, None], sin[None, :, None])[0]
        torch.testing.assert_close(out, model, atol=1e-5, rtol=1e-5)


def test_rope_in_place_on_a_strided_view():
    """The model rotates the q and k heads inside the fused qkv tensor, skipping the v heads."""
    qkv = randn(5, 6, 16)  # 3 query + 1 key heads to rotate, 2 value heads to leave alone
    expected_v = qkv[:, 4:].clone()
    emb = randn(5, 8, seed=4)
    emb = torch.cat((emb, emb), dim=-1)
    expected = rope_ref(qkv[:, :4], emb.cos(), emb.sin())
    rope(qkv[:, :4], emb.cos(), emb.sin(), out=qkv[:, :4])
    torch.testing.assert_close(qkv[:, :4], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 4:], expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner", [(1, 40), (3, 130), (2, 256)])
def test_silu_and_mul_matches_reference(dtype, rows, inner):
    x = randn(1, rows, 2 * inner, dtype=dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_ref(x).float(), gate * torch.sigmoid(gate) * up, **TOL[dtype])


def test_bad_inputs_are_refused_with_the_bad_value():
    x = randn(2, 8)
    with pytest.raises(ValueError, match=r"weight has shape \(4,\)"):
        rms_norm(x, randn(4), 1e-5)
    with pytest.raises(ValueError, match="odd|even size"):
        silu_and_mul(randn(2, 7))
    with pytest.raises(ValueError, match=r"expected \(3, 16\)"):
        rope(randn(3, 2, 16), randn(3, 8), randn(3, 8))
    with pytest.raises(ValueError, match=r"residual is torch.float64"):
        rms_norm(x.half(), randn(8).half(), 1e-5, residual=x.double())
    with pytest.raises(ValueError, match="int64"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64, device=DEVICE), randn(8), 1e-5)
