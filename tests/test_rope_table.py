"""RoPE's cos and sin from a table on a GPU (``FusedLlamaForCausalLM.rope_table``, model/fused.py): the rows a step
gathers are the values ``rope_values`` computes from its positions, bit for bit on the GPU, and in the layout the fused
kernels take."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minillm.kernels.fused_layer_ops import check_rope_inputs
from minillm.model.config import PRESETS
from minillm.model import fused
from minillm.model.fused import FusedLlamaForCausalLM
from minillm.model.llama import LlamaForCausalLM

# Llama 3.1's frequency scaling (its config.json's rope_scaling).
LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def small_model(scaled: bool, device: str) -> FusedLlamaForCausalLM:
    """A model of one layer with llama3-8b's RoPE (theta, head_dim; ``scaled``: Llama 3.1's scaling), on ``device``,
    its layers the fused ones."""
    config = dataclasses.replace(PRESETS["llama3-8b"], num_layers=1, hidden_size=256, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, vocab_size=64, max_position_embeddings=2048,
                                 rope_scaling=LLAMA31_SCALING if scaled else None)
    model = LlamaForCausalLM(config).to(device)
    fused.enable(model)
    return model


def test_table_rows_are_their_positions():
    """Row p holds position p's cos and sin, in that order (on the CPU to a rounding: there the table is not used,
    and the vectorised cos may round differently from a single position's)."""
    model = small_model(True, "cpu")
    table = model.rope_table(torch.float32)
    assert table.shape == (2048, 2, model.config.head_dim)
    for p in (0, 1, 2, 17, 511, 2047):
        cos, sin = model.rope_values(torch.tensor([[p]]), torch.float32)
        torch.testing.assert_close(table[p, 0], cos[0, 0, 0])
        torch.testing.assert_close(table[p, 1], sin[0, 0, 0])
    assert torch.equal(model.rope(torch.tensor([[3, 9]]), torch.float32)[0],
                       model.rope_values(torch.tensor([[3, 9]]), torch.float32)[0])  # the CPU computes


def test_post_init_rebuilds_the_table():
    """``post_init`` (after ``to_empty``) recomputes the frequencies; the tables built from the old ones go."""
    model = small_model(False, "cpu")
    first = model.rope_table(torch.float32)
    model.config = dataclasses.replace(model.config, rope_theta=10000.0)  # (500000 before)
    model.post_init()
    again = model.rope_table(torch.float32)
    cos, sin = model.rope_values(torch.tensor([[700]]), torch.float32)
    torch.testing.assert_close(again[700], torch.stack((cos[0, 0, 0], sin[0, 0, 0])))
    assert not torch.allclose(again[700], first[700])


def test_rows_gathered_where_they_fit():
    """``rope_rows`` gathers a row of positions (the CPU's gather, to a rounding of the computed values), and gives
    None for a row of more positions than the table holds (a perplexity window past max_position_embeddings), which
    ``rope`` then computes rather than reading past the table."""
    model = small_model(True, "cpu")
    positions = torch.tensor([[5, 2047, 0], [9, 1000, 3]])
    cos, sin = model.rope_rows(positions, torch.float32)
    want_cos, want_sin = model.rope_values(positions, torch.float32)
    assert cos.shape == want_cos.shape == (2, 3, 1, model.config.head_dim)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)
    assert model.rope_rows(torch.arange(2049)[None], torch.float32) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the table is used on a GPU only")
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gathered_rows_equal_computed_ones(scaled, dtype, monkeypatch):
    """Every position's gathered cos and sin equal the computed ones bit for bit, in batches of several shapes, and
    their [tokens, head_dim] views pass the fused kernels' check (equal strides, contiguous along head_dim)."""
    model = small_model(scaled, "cuda")
    every = torch.arange(2048, device="cuda")
    for positions in (every[None], every.view(16, 128), every[1000:1001][None],
                      every[torch.randperm(2048, device="cuda")[:37]][None]):
        cos, sin = model.rope(positions, dtype)
        want_cos, want_sin = model.rope_values(positions, dtype)
        assert cos.shape == want_cos.shape == (*positions.shape, 1, model.config.head_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        tokens = cos.flatten(0, 1)[:, 0], sin.flatten(0, 1)[:, 0]
        check_rope_inputs("x", torch.randn(positions.numel(), 2, model.config.head_dim, device="cuda"), *tokens)
