"""Tests for exercise 08, tensor-parallel sharding of the Llama MLP (column- then row-parallel)."""

from __future__ import annotations

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.parallel.tp import Shard, checkpoint_slice

HIDDEN, INTERMEDIATE = 32, 96


def weights(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(INTERMEDIATE, HIDDEN, generator=g, dtype=dtype) / HIDDEN ** 0.5
    up = torch.randn(INTERMEDIATE, HIDDEN, generator=g, dtype=dtype) / HIDDEN ** 0.5
    down = torch.randn(HIDDEN, INTERMEDIATE, generator=g, dtype=dtype) / INTERMEDIATE ** 0.5
    x = torch.randn(5, HIDDEN, generator=g, dtype=dtype)
    return x, gate, up, down


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_cover_the_weight(impl, size):
    _, gate, _, down = weights(0)
    columns = [impl.column_shard(gate, r, size) for r in range(size)]
    rows = [impl.row_shard(down, r, size) for r in range(size)]
    assert all(c.shape == (INTERMEDIATE // size, HIDDEN) for c in columns)
    assert all(r.shape == (HIDDEN, INTERMEDIATE // size) for r in rows)
    assert torch.equal(torch.cat(columns, dim=0), gate)
    assert torch.equal(torch.cat(rows, dim=1), down)


def test_uneven_split_is_refused(impl):
    _, gate, _, down = weights(0)
    with pytest.raises(ValueError):
        impl.column_shard(gate, 0, 5)
    with pytest.raises(ValueError):
        impl.row_shard(down, 0, 7)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_sum_of_partials_is_the_mlp(impl, size):
    x, gate, up, down = weights(1)
    full = impl.mlp(x, gate, up, down)
    assert torch.allclose(impl.tensor_parallel_mlp(x, gate, up, down, size), full, rtol=1e-10, atol=1e-12)


def test_a_rank_alone_is_only_a_partial(impl):
    x, gate, up, down = weights(2)
    rank0 = impl.mlp(x, impl.column_shard(gate, 0, 2), impl.column_shard(up, 0, 2), impl.row_shard(down, 0, 2))
    assert not torch.allclose(rank0, impl.mlp(x, gate, up, down), atol=1e-3), "one rank's output needs the all-reduce"


@pytest.mark.parametrize("size", [2, 4])
def test_wired_into_minillm(impl, size):
    """Your shards are exactly the rows and columns minillm's loader reads for each rank."""
    config = ModelConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_layers=1,
                         num_heads=4, num_kv_heads=4, head_dim=HIDDEN // 4)
    _, gate, _, down = weights(3)
    for rank in range(size):
        shard = Shard(rank, size)
        assert torch.equal(impl.column_shard(gate, rank, size),
                           gate[checkpoint_slice("model.layers.0.mlp.gate_proj.weight", config, shard)])
        assert torch.equal(impl.row_shard(down, rank, size),
                           down[checkpoint_slice("model.layers.0.mlp.down_proj.weight", config, shard)])
