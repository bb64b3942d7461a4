"""The routing behind ``tp_all_reduce="fused"`` (parallel/all_reduce.py), on one gloo rank: the
row-parallel linears leave their outputs unreduced, every norm that takes a residual sums its input
exactly once, and the model computes what it computes unfused. The kernel itself is tested in
tests/kernels/test_all_reduce_norm.py, and on two GPUs in tests/test_parallel_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minillm.parallel.tp as tp
from minillm.kernels.fused_layer_ops import rms_norm_ref
from minillm.model.config import PRESETS
from minillm.model.llama import LlamaForCausalLM
from minillm.parallel.all_reduce import fuse_into_norms
from minillm.parallel.workers import _free_port


class SumThenNorm:
    """A stand-in for FusedAllReduceNorm that reduces with the process group, then normalises."""

    def __init__(self, max_rows: int):
        self.max_rows, self.calls = max_rows, 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() // x.shape[-1] <= self.max_rows

    def __call__(self, x, weight, eps, residual):
        self.calls += 1
        dist.all_reduce(x)
        return rms_norm_ref(x, weight, eps, residual)


def causal_attention(layer_idx, q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tokens, fused_calls", [(5, 2 * 2), (9, 0)])  # 2 layers x 2 norms; 9 rows: too many
def test_each_row_parallel_output_is_summed_once_by_the_norm_after_it(one_rank_group, monkeypatch, tokens,
                                                                      fused_calls):
    torch.manual_seed(0)
    dense = LlamaForCausalLM(PRESETS["tiny"])
    model = copy.deepcopy(dense)
    tp.parallelize(model, tp.Shard(0, 1))  # row-parallel o_proj and down_proj, vocab-parallel ends
    model.load_state_dict(dense.state_dict())
    reductions = []
    monkeypatch.setattr(tp, "all_reduce", lambda y: (reductions.append(y.shape), dist.all_reduce(y)))
    ids = torch.randint(0, PRESETS["tiny"].vocab_size, (1, tokens))
    positions = torch.arange(tokens)[None]
    expected = dense(ids, positions, causal_attention)
    op = SumThenNorm(max_rows=8)
    fuse_into_norms(model, op)
    torch.testing.assert_close(model(ids, positions, causal_attention), expected, atol=0, rtol=0)
    assert op.calls == fused_calls
    assert len(reductions) == 1 + 2 * 2 - fused_calls  # the embedding's, and the linears' the norms did not take
    fuse_into_norms(model, None)  # back to the linears
    reductions.clear()
    torch.testing.assert_close(model(ids, positions, causal_attention), expected, atol=0, rtol=0)
    assert len(reductions) == 1 + 2 * 2


def test_a_row_parallel_linear_with_a_bias_is_refused():
    model = LlamaForCausalLM(PRESETS["tiny"])
    tp.parallelize(model, tp.Shard(0, 1))
    model.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(PRESETS["tiny"].hidden_size))
    with pytest.raises(ValueError, match="without a bias; this model has RowParallelLinear"):
        fuse_into_norms(model, SumThenNorm(max_rows=8))
