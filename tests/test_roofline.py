"""Roofline arithmetic checked against numbers worked out by hand (no timings are asserted)."""

import math

import pytest
import torch

from minillm.bench import roofline as rl
from minillm.model.config import PRESETS, ModelConfig

# A toy model small enough to count on paper:
# per layer: q 4·(2·2)=16, k 4·2=8, v 8, o 4·4=16 -> 48; MLP 3·4·8=96; two norms 2·4=8 -> 152.
# Two layers 304, untied embeddings 2·10·4=80, final norm 4 -> 388 parameters.
TOY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2)
TOY_PARAMS = 388
TOY_KV_BYTES_FP16 = 2 * 2 * 1 * 2 * 2  # K and V, 2 layers, 1 KV head, head_dim 2, 2 bytes = 16
ATTN_PER_PAIR = 4 * 2 * 2 * 2  # 4 · layers · heads · head_dim = 32 FLOPs per (query, key) pair

# Round numbers: ridge = 1e12 / 1e9 = 1000 FLOP/byte.
ROUND = rl.Ceilings(device="paper", dtype="float16", bandwidth_gbs=1.0, peak_tflops=1.0)


def test_toy_model_counts_match_hand_counts():
    assert TOY.num_params == TOY_PARAMS
    assert TOY.kv_bytes_per_token(2) == TOY_KV_BYTES_FP16
    assert rl.weight_bytes(TOY, 2) == 776


def test_attention_pairs_are_causal():
    # A 4-token prefill: query i sees i keys -> 1+2+3+4 = 10 pairs.
    assert rl.attention_flops(TOY, 4) == ATTN_PER_PAIR * 10
    # 2 new tokens after 3 cached: 4 + 5 = 9 pairs.
    assert rl.attention_flops(TOY, 2, past_tokens=3) == ATTN_PER_PAIR * 9
    # Chunking a prefill does not change the total work.
    assert rl.attention_flops(TOY, 3) + rl.attention_flops(TOY, 5, 3) == rl.attention_flops(TOY, 8)


def test_prefill_and_decode_by_hand():
    assert rl.prefill_flops(TOY, 4) == 2 * 388 * 4 + ATTN_PER_PAIR * 10 == 3424
    assert rl.prefill_bytes(TOY, 2, 4) == 776 + 4 * 16
    # 3 sequences, each one new token attending to 5 tokens.
    assert rl.decode_flops(TOY, 3, 5) == 3 * (2 * 388 + ATTN_PER_PAIR * 5) == 2808
    assert rl.decode_bytes(TOY, 2, 3, 5) == 776 + 3 * 5 * 16 == 1016
    # A quantized model or cache: the bytes it really stores replace the dtype's count.
    assert rl.decode_bytes(TOY, 2, 3, 5, weights=200, kv_per_token=9) == 200 + 3 * 5 * 9
    assert rl.decode_bytes(TOY, 2, 3, 5, weights=200) == 200 + 3 * 5 * 16
    assert rl.arithmetic_intensity(2808, 1016) == pytest.approx(2.7638, rel=1e-4)


def test_time_floor_is_the_larger_roof():
    # 1 GB/s and 1 TFLOP/s: 1e9 bytes take 1 s; 1e12 FLOPs take 1 s.
    assert rl.time_floor(flops=1e9, nbytes=2e9, ceilings=ROUND) == pytest.approx(2.0)
    assert rl.time_floor(flops=3e12, nbytes=1e9, ceilings=ROUND) == pytest.approx(3.0)
    assert ROUND.ridge_intensity == pytest.approx(1000.0)
    assert rl.attainable_tflops(10.0, ROUND) == pytest.approx(0.01)  # on the slope: 1e9 B/s · 10 FLOP/B
    assert rl.attainable_tflops(5000.0, ROUND) == pytest.approx(1.0)  # on the flat roof


def test_decode_roofline_matches_benchmarks_md():
    # BENCHMARKS.md: llama2-7b bf16 at 4.2 TB/s reads 6.74e9 · 2 bytes per token -> ~312 tok/s.
    h200 = rl.Ceilings(device="h200", dtype="bfloat16", bandwidth_gbs=4200.0, peak_tflops=770.0)
    llama = PRESETS["llama2-7b"]
    expected = 4200e9 / (llama.num_params * 2)
    assert rl.decode_roofline_tok_s(llama, 2, batch=1, context=1, ceilings=h200) == pytest.approx(expected, rel=1e-3)
    assert round(expected) == 312


def test_decode_roofline_is_monotone_in_batch_and_context():
    cfg, c = PRESETS["smollm2-135m"], rl.Ceilings("x", "float32", bandwidth_gbs=20.0, peak_tflops=0.2)
    by_batch = [rl.decode_roofline_tok_s(cfg, 4, b, 512, c) for b in (1, 2, 4, 8, 16, 64, 256)]
    assert all(a <= b for a, b in zip(by_batch, by_batch[1:]))
    by_context = [rl.decode_roofline_tok_s(cfg, 4, 8, ctx, c) for ctx in (1, 16, 256, 2048, 8192)]
    assert all(a >= b for a, b in zip(by_context, by_context[1:]))
    intensity = [rl.arithmetic_intensity(rl.prefill_flops(cfg, t), rl.prefill_bytes(cfg, 4, t))
                 for t in (1, 16, 256, 2048)]
    assert all(a < b for a, b in zip(intensity, intensity[1:]))


def test_decode_intensity_is_about_two_flops_per_weight_byte_per_sequence():
    # Short context: FLOPs ~ 2·N·B, bytes ~ N·s, so intensity ~ 2B/s (fp16: B FLOP/byte).
    cfg = PRESETS["llama2-7b"]
    for batch in (1, 8, 64):
        ai = rl.arithmetic_intensity(rl.decode_flops(cfg, batch, 1), rl.decode_bytes(cfg, 2, batch, 1))
        assert ai == pytest.approx(batch, rel=0.01)


def test_compute_bound_batch_is_where_the_roofs_cross():
    cfg, context = PRESETS["smollm2-135m"], 64
    c = rl.Ceilings("x", "float32", bandwidth_gbs=20.0, peak_tflops=0.2)
    b_star = rl.compute_bound_batch(cfg, 4, context, c)
    assert 1 < b_star < 1000
    memory_s = rl.decode_bytes(cfg, 4, b_star, context) / 20e9
    compute_s = rl.decode_flops(cfg, b_star, context) / 0.2e12
    assert memory_s == pytest.approx(compute_s, rel=1e-9)
    below, above = math.floor(b_star), math.ceil(b_star)
    assert rl.decode_bytes(cfg, 4, below, context) / 20e9 > rl.decode_flops(cfg, below, context) / 0.2e12
    assert rl.decode_bytes(cfg, 4, above, context) / 20e9 < rl.decode_flops(cfg, above, context) / 0.2e12


def test_toy_compute_bound_batch_by_hand():
    # ROUND: 1e9 B/s, 1e12 FLOP/s. Context 1: per sequence 776+32 = 808 FLOPs and 16 KV bytes.
    # B·808/1e12 = (776 + 16B)/1e9  ->  B·(0.808 - 16) = 776  -> negative: never compute-bound.
    assert rl.compute_bound_batch(TOY, 2, 1, ROUND) == math.inf
    fast_memory = rl.Ceilings("paper", "float16", bandwidth_gbs=1000.0, peak_tflops=0.01)  # ridge 0.01
    # B·808/1e10 = (776 + 16B)/1e12  ->  80800B = 776 + 16B  ->  B = 776 / 80784
    assert rl.compute_bound_batch(TOY, 2, 1, fast_memory) == pytest.approx(776 / 80784)


def test_long_context_decode_never_becomes_compute_bound():
    # llama2-7b has no GQA: each sequence's KV bytes grow as fast as its attention FLOPs, and
    # attention does ~1 FLOP per KV byte, far below an H200's ridge (~183 FLOP/byte).
    h200 = rl.Ceilings("h200", "bfloat16", bandwidth_gbs=4200.0, peak_tflops=770.0)
    assert rl.compute_bound_batch(PRESETS["llama2-7b"], 2, 4096, h200) == math.inf
    assert rl.compute_bound_batch(PRESETS["llama2-7b"], 2, 16, h200) < 1000


def test_measurements_run_on_cpu_and_are_positive():
    assert rl.measure_bandwidth("cpu", nbytes=2**20, repeats=2) > 0
    assert rl.measure_matmul_flops("cpu", torch.float32, n=64, repeats=2) > 0
    ceilings = rl.Ceilings("cpu", "float32", 10.0, 0.1)
    assert ceilings.ridge_intensity == pytest.approx(10.0)
