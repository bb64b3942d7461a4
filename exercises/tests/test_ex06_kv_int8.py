"""Tests for exercise 06, INT8 KV-cache quantization (one fp16 scale per token and head)."""

from __future__ import annotations

import pytest
import torch

from minillm.kv.quant import dequantize_kv, quantize_kv

SHAPES = [(1, 1, 8), (3, 4, 64), (2, 16, 9, 128)]  # [..., head_dim]


def sample(shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_and_dtypes(impl, shape):
    codes, scale = impl.quantize_int8(sample(shape, 0))
    assert codes.shape == shape and codes.dtype == torch.int8
    assert scale.shape == shape[:-1] and scale.dtype == torch.float16
    assert codes.abs().max() <= 127


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_round_trip_within_half_a_step(impl, shape, magnitude):
    x = sample(shape, 1, magnitude)
    codes, scale = impl.quantize_int8(x)
    back = impl.dequantize_int8(codes, scale)
    assert back.dtype == torch.float32
    step = scale.float()[..., None]
    assert ((back - x).abs() <= step / 2 * (1 + 1e-3) + 1e-12).all()
    # the largest magnitude of each vector uses (nearly) the whole range
    assert (codes.abs().amax(-1) >= 126).all()


def test_by_hand(impl):
    x = torch.tensor([[127.0, -63.5, 0.0, 1.0]])
    codes, scale = impl.quantize_int8(x)
    assert scale.item() == 1.0
    assert codes.tolist() == [[127, -64, 0, 1]] or codes.tolist() == [[127, -63, 0, 1]]


def test_zeros_and_bf16(impl):
    codes, scale = impl.quantize_int8(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert (codes == 0).all() and (scale > 0).all()
    assert (impl.dequantize_int8(codes, scale, torch.bfloat16) == 0).all()
    x = sample((4, 64), 2, dtype=torch.bfloat16)
    back = impl.dequantize_int8(*impl.quantize_int8(x), torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.allclose(back.float(), x.float(), atol=0.05)


@pytest.mark.parametrize("shape", SHAPES)
def test_wired_into_minillm(impl, shape):
    """Bit for bit what minillm's INT8 KV cache stores, so yours could replace quantize_kv."""
    x = sample(shape, 3, 2.0)
    codes, scale = impl.quantize_int8(x)
    theirs_codes, theirs_scale = quantize_kv(x, "int8")
    assert torch.equal(codes, theirs_codes) and torch.equal(scale, theirs_scale)
    assert torch.equal(impl.dequantize_int8(codes, scale), dequantize_kv(theirs_codes, theirs_scale, torch.float32))
