"""Tests for exercise 01 (the roofline), counting a decode step's FLOPs and bytes (the roofline)."""

from __future__ import annotations

import pytest

import minillm.bench.roofline as roofline
from minillm.model.config import ModelConfig

TINY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=2)
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                        num_heads=32, num_kv_heads=32, head_dim=128)
SHAPES = [(1, 1), (1, 512), (8, 100), (64, 2048)]


def test_tiny_model_by_hand(impl):
    flops = impl.decode_flops(TINY, batch=1, context=3)
    params = TINY.num_params
    # 2 FLOPs per weight, and 4 * layers * heads * head_dim * context for attention
    assert flops == pytest.approx(2 * params + 4 * 2 * 2 * 2 * 3)
    # K and V: 2 values * 2 layers * 1 KV head * 2 dims = 8 values per token
    assert impl.decode_bytes(TINY, 2, batch=1, context=3) == pytest.approx(2 * params + 3 * 8 * 2)


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA2_7B], ids=["smollm2-135m", "llama2-7b"])
@pytest.mark.parametrize("batch,context", SHAPES)
def test_matches_minillm(impl, config, batch, context):
    assert impl.decode_flops(config, batch, context) == pytest.approx(roofline.decode_flops(config, batch, context))
    for dtype_bytes in (4, 2, 1):
        assert impl.decode_bytes(config, dtype_bytes, batch, context) == pytest.approx(
            roofline.decode_bytes(config, dtype_bytes, batch, context))


def test_weights_do_not_grow_with_the_batch(impl):
    one = impl.decode_bytes(LLAMA2_7B, 2, batch=1, context=1)
    many = impl.decode_bytes(LLAMA2_7B, 2, batch=64, context=1)
    assert many < 1.01 * one, "the weights are read once per step, not once per sequence"
    assert impl.decode_flops(LLAMA2_7B, 64, 1) == pytest.approx(64 * impl.decode_flops(LLAMA2_7B, 1, 1))


@pytest.mark.parametrize("flops,nbytes,expected", [
    (1e12, 1e9, 1e-3),     # memory-bound: 1 GB at 1000 GB/s
    (1e15, 1e9, 1.0),      # compute-bound: 1 PFLOP at 1000 TFLOP/s
    (0.0, 0.0, 0.0),
])
def test_time_floor(impl, flops, nbytes, expected):
    assert impl.time_floor(flops, nbytes, bandwidth_gbs=1000.0, peak_tflops=1000.0) == pytest.approx(expected)


def test_decode_is_memory_bound_at_batch_1(impl):
    flops, nbytes = impl.decode_flops(LLAMA2_7B, 1, 512), impl.decode_bytes(LLAMA2_7B, 2, 1, 512)
    # an H100-like device: 3350 GB/s, 990 TFLOP/s (bf16 dense)
    assert impl.time_floor(flops, nbytes, 3350.0, 990.0) == pytest.approx(nbytes / 3350e9)


def test_wired_into_minillm(impl, monkeypatch):
    ceilings = roofline.Ceilings(device="a device", dtype="bfloat16", bandwidth_gbs=3350.0, peak_tflops=990.0)
    expected = roofline.decode_roofline_tok_s(LLAMA2_7B, 2, 32, 1024, ceilings)
    monkeypatch.setattr(roofline, "decode_flops", impl.decode_flops)
    monkeypatch.setattr(roofline, "decode_bytes",
                        lambda config, dtype_bytes, batch, context, **_: impl.decode_bytes(config, dtype_bytes,
                                                                                           batch, context))
    monkeypatch.setattr(roofline, "time_floor", lambda flops, nbytes, c: impl.time_floor(
        flops, nbytes, c.bandwidth_gbs, c.peak_tflops))
    assert roofline.decode_roofline_tok_s(LLAMA2_7B, 2, 32, 1024, ceilings) == pytest.approx(expected)
