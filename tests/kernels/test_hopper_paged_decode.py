"""The Gluon INT8 decode kernel for Hopper (kernels/hopper/paged_decode.py) against the plain-torch reference, and
when ``paged_decode_attention`` picks it.

Gluon has no interpreter, so the numerical tests need an sm_90 GPU; on the CPU the dispatch and its reasons are
tested, and tests/test_decode_hopper_sass.py compiles the kernel for sm_90 and checks its loops.
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.hopper import paged_decode as hopper
from minillm.kernels.paged_attention import PagedAttentionWorkspace, paged_decode_attention, paged_decode_attention_ref

from test_quantized_kv import TOL, quantized_paged

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.GLUON_USABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")

CASES = [
    # context_lens, heads, kv_heads, head_dim, num_splits, dtype: lengths around a page (16 tokens) and a slot (64),
    # a split count that leaves splits empty, GQA 1 (Llama-2), 2, 4 and 8 (16 columns), head_dim 64 and 128, and a
    # split of 94 pages (the producer's last chunk of block ids partial: 32 + 32 + 30).
    ([1, 15, 16, 17, 31, 32, 33, 2048], 32, 8, 128, 1, torch.bfloat16),
    ([63, 64, 65, 1500], 32, 8, 128, 1, torch.bfloat16),
    ([1, 15, 16, 17, 31, 32, 33, 2048], 32, 8, 128, 5, torch.bfloat16),
    ([1, 100, 333], 8, 8, 128, 1, torch.float16),
    ([70, 7, 500], 16, 2, 64, 3, torch.bfloat16),
    ([40, 9], 4, 2, 64, 1, torch.float16),
    ([4096, 1000], 32, 8, 128, 16, torch.bfloat16),
]


@needs_sm90
@pytest.mark.parametrize("lens,heads,kv_heads,dim,splits,dtype", CASES)
def test_hopper_int8_decode_matches_ref(lens, heads, kv_heads, dim, splits, dtype, monkeypatch):
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1] * len(lens), lens, heads, kv_heads, dim, 16, dtype, "int8",
                                                        seed=len(lens) + dim)
    calls = []
    launch = hopper.int8_decode
    monkeypatch.setattr("minillm.kernels.paged_attention.int8_decode", lambda *a: calls.append(1) or launch(*a))
    out = torch.full_like(q, float("nan"))
    ws = PagedAttentionWorkspace.allocate(len(lens), heads, dim, splits, q.device)
    ws.out.fill_(float("nan")), ws.lse.fill_(float("nan"))
    got = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=splits, out=out, workspace=ws, k_scale=ks,
                                 v_scale=vs)
    want = paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs)
    assert calls == [1] and got is out and torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL[dtype])
    triton = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=splits, k_scale=ks, v_scale=vs, hopper=False)
    torch.testing.assert_close(got, triton, **TOL[dtype])


@needs_sm90
def test_hopper_int8_decode_takes_bf16_queries_outside_fp16_range():
    """q is divided per column by a power of two into fp16, as the Triton kernel does: 1e6 and 1e-6 both survive."""
    for magnitude in (1e-6, 1e6):
        q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [40, 230], 8, 2, 128, 16, torch.bfloat16, "int8",
                                                            seed=5)
        q = (q.float() * magnitude * torch.linspace(0.5, 2, q.shape[1], device=q.device)[:, None]).to(torch.bfloat16)
        scale = 128 ** -0.5 / magnitude
        got = paged_decode_attention(q, kq, vq, tables, ctx, scale=scale, k_scale=ks, v_scale=vs, hopper=True)
        want = paged_decode_attention_ref(q, kq, vq, tables, ctx, scale=scale, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


def _inputs(dtype=torch.bfloat16, cache=torch.int8, block=16, kv_heads=8, heads=32, dim=128):
    q = torch.randn(2, heads, dim).to(dtype)
    k_cache = torch.randint(-127, 128, (4, block, kv_heads, dim), dtype=torch.int8).to(cache)
    return q, k_cache, torch.rand(4, block, kv_heads).half()


@pytest.mark.parametrize("change,reason", [
    (dict(dtype=torch.float32), "16-bit q"),
    (dict(cache=torch.float8_e4m3fn), "int8 caches"),
    (dict(block=8), "16-token blocks"),
    (dict(dim=96), "head_dim in (64, 128)"),
    (dict(kv_heads=3, heads=6), "KV heads in pairs"),
    (dict(kv_heads=2, heads=32), "at most 8 query heads"),
])
def test_unsupported_names_the_reason(change, reason):
    q, k_cache, k_scale = _inputs(**change)
    assert reason in hopper.unsupported(q, k_cache, k_cache, k_scale)


def test_unsupported_needs_a_contiguous_pool_and_an_sm90_gpu():
    q, k_cache, k_scale = _inputs()
    wide = torch.zeros(4, 16, 8, 256, dtype=torch.int8)[..., :128]
    assert "contiguous pool" in hopper.unsupported(q, wide, wide, k_scale)
    offset = torch.zeros(4 * 16 * 8 * 128 + 8, dtype=torch.int8)[8:].view(4, 16, 8, 128)  # 8 bytes past alignment
    assert "aligned" in hopper.unsupported(q, k_cache, offset, k_scale)
    if not SM90:
        assert hopper.unsupported(q, k_cache, k_cache, k_scale) is not None


@pytest.mark.skipif(SM90, reason="checks the refusal where the kernel cannot run")
def test_demanding_the_kernel_where_it_cannot_run_says_why():
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [20, 9], 4, 2, 64, 16, torch.float16, "int8", seed=2)
    with pytest.raises(ValueError, match="hopper=True.*cannot run"):
        paged_decode_attention(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs, hopper=True)


def test_demanding_the_kernel_with_launch_overrides_or_a_float_cache_is_refused():
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [20, 9], 4, 2, 64, 16, torch.float16, "int8", seed=2)
    with pytest.raises(ValueError, match="hopper=True.*block_n"):
        paged_decode_attention(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs, hopper=True, block_n=32)
    float_q, float_cache = q.float(), kq.float()
    with pytest.raises(ValueError, match="hopper=True.*not quantized"):
        paged_decode_attention(float_q, float_cache, float_cache, tables, ctx, hopper=True)


@needs_sm90
def test_launch_overrides_choose_the_triton_kernel(monkeypatch):
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [200, 90], 8, 2, 128, 16, torch.bfloat16, "int8",
                                                        seed=4)
    calls = []
    monkeypatch.setattr("minillm.kernels.paged_attention.int8_decode", lambda *a: calls.append(1))
    got = paged_decode_attention(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs, block_n=32)
    assert calls == []
    torch.testing.assert_close(got, paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs),
                               **TOL[torch.bfloat16])


@needs_sm90
def test_hopper_int8_decode_replays_in_a_cuda_graph():
    """The engine captures decode in CUDA graphs and replays them after copying new lengths and block tables into
    the same tensors: the grid and the TMA descriptors (over the pools, fixed) must not depend on them."""
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1] * 4, [700, 30, 1, 333], 32, 8, 128, 16, torch.bfloat16,
                                                        "int8", seed=6)
    out = torch.full_like(q, float("nan"))
    ws = PagedAttentionWorkspace.allocate(4, 32, 128, 4, q.device)
    call = lambda: paged_decode_attention(q, kq, vq, tables, ctx, num_splits=4, out=out, workspace=ws,  # noqa: E731
                                          k_scale=ks, v_scale=vs, hopper=True)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    # Then each sequence reads another's blocks (the rows reversed), no further than that one's tokens: past them
    # lie NaN slots.
    for lens, new_tables in (([700, 30, 1, 333], tables.clone()), ([300, 1, 17, 699], tables.flip(0))):
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(new_tables)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs),
                                   **TOL[torch.bfloat16])
