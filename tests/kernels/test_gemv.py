"""The dense GEMV (kernels/gemv.py) against its fp32 reference: ragged N and K, one and several K-splits,
fp32/fp16 (bf16 on a GPU), into a poisoned output; its input checks; the default tiles per shape; on a GPU
also the default launch inside a CUDA graph (with PDL on Hopper) and the model's routing of one-row
products to it."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import gemv as gemv_module
from minillm.kernels.gemv import gemv, gemv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + 0.25).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, split", [(48, 128, 2), (37, 96, 2), (16, 64, 1), (70, 200, 3), (5, 33, 4)])
def test_gemv_matches_reference(dtype, n, k, split):
    """Whole tiles (no masks) and ragged ones, K-splits whose last program sums the partials, and a
    split longer than its share of K (empty programs still arrive)."""
    x, w = randn(1, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    config = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split)
    y = gemv(x, w, config=config, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, gemv_ref(x, w), **TOL[dtype])
    torch.testing.assert_close(gemv(x[0], w, config=config), y[0], atol=0, rtol=0)  # [K] -> [N], same bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, split", [(48, 128, 2), (37, 96, 2), (5, 33, 1)])
def test_gated_gemv_is_silu_and_mul_then_the_gemv_bit_for_bit(dtype, n, k, split):
    """gated=True: x is a gate_up row [2K] and the GEMV's input silu(gate) * up, computed as it loads x. Same
    bits as the SiLU-and-multiply kernel followed by the plain GEMV (the MLP's unfused path), whole and
    ragged tiles; and close to the reference."""
    from minillm.kernels.fused_layer_ops import silu_and_mul
    gate_up = randn(1, 2 * k, dtype=dtype, seed=4) * 3  # both signs, beyond silu's near-linear range
    w = randn(n, k, dtype=dtype, seed=5)
    config = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    y = gemv(gate_up, w, config=config, out=out, gated=True)
    torch.testing.assert_close(y, gemv(silu_and_mul(gate_up), w, config=config), atol=0, rtol=0)
    torch.testing.assert_close(y, gemv_ref(gate_up, w, gated=True), **TOL[dtype])
    with pytest.raises(ValueError, match="2K"):
        gemv(gate_up[:, :k], w, gated=True)


def test_gemv_reads_a_strided_weight():
    """Rows of a bigger matrix (a stride over N): the GEMV reads only the view's columns."""
    big = randn(24, 160)
    w, x = big[:, :96], randn(1, 96, seed=2)
    torch.testing.assert_close(gemv(x, w, config=dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)), gemv_ref(x, w),
                               **TOL[torch.float32])


@pytest.mark.parametrize("x_shape, w_shape, dtype, message", [
    ((2, 64), (16, 64), torch.float32, "one row"),
    ((1, 48), (16, 64), torch.float32, "one row"),
    ((1, 64), (16, 64), torch.int32, "x.dtype"),
])
def test_gemv_rejects_bad_inputs(x_shape, w_shape, dtype, message):
    x = torch.ones(x_shape, device=DEVICE).to(dtype)
    with pytest.raises(ValueError, match=message):
        gemv(x, randn(*w_shape))


def test_gemv_rejects_a_weight_of_another_dtype_or_layout():
    x = randn(1, 64)
    with pytest.raises(ValueError, match="weight.dtype"):
        gemv(x, randn(16, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, randn(64, 16).t())
    with pytest.raises(ValueError, match="out is"):
        gemv(x, randn(16, 64), out=torch.empty(1, 15, device=DEVICE))


def test_default_tiles_are_the_sweeps_winners_and_split_k_only_for_few_rows():
    """The H200 sweep's best configs for Llama-2-7B's shapes (figures/h200/sweeps/gemv_bf16.json); a narrow
    weight gets K-splits so that it has a program per SM, a short K none."""
    narrow = dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=8, num_stages=3)
    wide = dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=1, num_stages=2)
    for n, k in [(4096, 2048), (6144, 4096), (4096, 5504), (11008, 4096), (12288, 4096), (4096, 11008)]:
        assert gemv_module.default_config(n, k) == narrow
    for n, k in [(22016, 4096), (32000, 4096), (16000, 4096)]:
        assert gemv_module.default_config(n, k) == wide
    assert gemv_module.default_config(2048, 4096)["SPLIT_K"] == 2  # 128 programs of rows -> 256
    assert gemv_module.default_config(1024, 4096)["SPLIT_K"] == 4  # 64 -> 128 -> 256
    assert gemv_module.default_config(576, 4096)["SPLIT_K"] == 4  # 36 -> 72 -> 144
    assert gemv_module.default_config(576, 576)["SPLIT_K"] == 1  # K is one tile: nothing to split


def test_gemv_refuses_an_out_that_overlaps_its_inputs():
    x, w = randn(1, 64), randn(64, 64, seed=1)
    with pytest.raises(ValueError, match="overlaps"):
        gemv(x, w, out=x)
    with pytest.raises(ValueError, match="overlaps"):
        gemv(x, w, out=w[3:4])


@pytest.mark.skipif(DEVICE != "cuda", reason="the default launch, CUDA graphs and PDL need a GPU")
@pytest.mark.parametrize("n, k", [(4096, 2048), (6144, 4096), (1000, 5504), (22016, 4096)])
def test_gemv_in_a_cuda_graph(n, k):
    """The engine's way: default tiles (PDL and the L2 warm-up on Hopper) and replayed from a graph, after a
    norm kernel that lets it start early and writes its x."""
    from minillm.kernels.fused_layer_ops import rms_norm
    h, nw, w = randn(1, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16, seed=3), \
        randn(n, k, dtype=torch.bfloat16, seed=1)
    x = rms_norm(h, nw, 1e-5)
    gemv(x, w)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = rms_norm(h, nw, 1e-5)
        y = gemv(x, w)
    for seed in range(3):  # new inputs each replay: the GEMV must read the norm's new output
        h.copy_(randn(1, k, dtype=torch.bfloat16, seed=10 + seed))
        y.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(y, gemv_ref(rms_norm(h, nw, 1e-5), w), **TOL[torch.bfloat16])


@pytest.mark.skipif(DEVICE != "cuda", reason="one-row products take the GEMV on a GPU only")
def test_model_routes_one_row_products_to_the_gemv(monkeypatch):
    """enable_fused_kernels() sends a bias-free dense layer's one-row product to the GEMV, and more rows to
    F.linear."""
    from minillm.model.dense import Linear
    from minillm.model.config import ModelConfig
    from minillm.model.llama import LlamaForCausalLM
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16)
    model = LlamaForCausalLM(config).to(DEVICE, torch.bfloat16)
    model.enable_fused_kernels()
    layer = next(m for m in model.modules() if isinstance(m, Linear) and m.bias is None)
    x = randn(1, 1, layer.in_features, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), **TOL[torch.bfloat16])
    assert len(calls) == 1
    layer(randn(1, 3, layer.in_features, dtype=torch.bfloat16))
    assert len(calls) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="one-row products take the GEMV on a GPU only")
def test_mlp_leaves_silu_and_mul_to_down_projs_gemv(monkeypatch):
    """At one row the fused MLP launches no SiLU-and-multiply kernel: down_proj's GEMV takes gate_up with
    gated=True, and the output has the bits of the two-kernel path (three rows still take it)."""
    from minillm.kernels import fused_layer_ops
    from minillm.model.config import ModelConfig
    from minillm.model.fused import FusedMLP
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=16)
    mlp = FusedMLP(config).to(DEVICE, torch.bfloat16)
    for p in mlp.parameters():
        p.data.copy_(randn(*p.shape, dtype=torch.bfloat16, seed=p.numel()) * 0.2)
    mlp.fused_ops = fused_layer_ops
    mlp.gate_up_proj.gemv = mlp.down_proj.gemv = gemv_module
    gated, unfused = [], []
    real_gemv, real_silu = gemv_module.gemv, fused_layer_ops.silu_and_mul
    monkeypatch.setattr(gemv_module, "gemv",
                        lambda *a, **kw: gated.append(kw.get("gated", False)) or real_gemv(*a, **kw))
    monkeypatch.setattr(fused_layer_ops, "silu_and_mul", lambda *a: unfused.append(1) or real_silu(*a))
    x = randn(1, 1, 64, dtype=torch.bfloat16, seed=9)
    y = mlp(x)
    assert gated == [False, True] and unfused == []
    expected = real_gemv(real_silu(real_gemv(x.reshape(1, -1), mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    torch.testing.assert_close(y.reshape(1, -1), expected, atol=0, rtol=0)
    mlp(randn(1, 3, 64, dtype=torch.bfloat16))
    assert unfused == [1]


def test_a_gated_product_the_gemv_cannot_take_is_refused():
    """gated=True where takes_gated would say no (no GEMV, a CPU row, a biased layer): a clear error, never a
    product of the wrong input."""
    from minillm.model.dense import Linear, product
    w = randn(8, 16)
    with pytest.raises(ValueError, match="gated=True needs"):
        product(randn(1, 32).cpu(), w.cpu(), None, gated=True)
    layer = Linear(16, 8, bias=True)
    with pytest.raises(ValueError, match="bias-free"):
        layer(torch.randn(1, 32), gated=True)
