"""The paged decode and prefill kernels on quantized KV caches (int8, fp8, int4) against their torch
references, the references against attention over the dequantized cache, and the wrappers' errors.

Every slot a sequence does not own (other blocks, the tail of its last block) holds random codes and
NaN scales: a kernel that reads one outputs NaN. On CPU under TRITON_INTERPRET=1, in fp32 / fp16.
"""

from __future__ import annotations

import pytest
import torch

import minillm.kernels.paged_attention as pa
from minillm.kernels.flash_attention import paged_prefill_attention, paged_prefill_attention_ref
from minillm.kernels.paged_attention import PagedAttentionWorkspace, paged_decode_attention, paged_decode_attention_ref
from minillm.kv.quant import dequantize_kv, quantize_kv
from test_flash_attention import make_paged  # tests/kernels is on sys.path (pytest's rootdir-less import)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def quantized_paged(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype, seed):
    """``make_paged``'s pool (NaN in every slot no sequence owns, shuffled tables padded with other
    valid ids), keys spread over two orders of magnitude per token with an outlier channel as real
    keys have, quantized as ``kv_cache_dtype``: the unowned slots get NaN scales."""
    q, _, _, k_cache, v_cache, tables, cu_q, _, ctx = make_paged(q_lens, ctx_lens, heads, kv_heads, head_dim,
                                                                 block_size, dtype, seed)
    spread = torch.exp(torch.randn(*k_cache.shape[:-1], 1, generator=torch.Generator().manual_seed(seed)))
    k_cache = k_cache.float() * spread.to(DEVICE)
    k_cache[..., 3] *= 8
    (kq, ks), (vq, vs) = quantize_kv(k_cache, kv_cache_dtype), quantize_kv(v_cache, kv_cache_dtype)
    return q, kq, vq, ks, vs, tables, cu_q, ctx


# (context_lens, heads, kv_heads, head_dim, block_size, num_splits, dtype, kv_cache_dtype): odd lengths,
# partial blocks, one-token contexts, GQA ratios 1 / 2 / 4, empty splits, a head_dim that is not a
# power of two (masked columns).
DECODE_CASES = [
    ([1, 17, 32, 5], 2, 2, 16, 16, 1, torch.float32, "int8"),
    ([33, 8, 1], 4, 2, 32, 8, 3, torch.float32, "fp8"),
    ([40, 3, 24], 8, 2, 32, 8, 16, torch.float32, "int4"),
    ([50, 16, 1], 8, 2, 64, 16, 3, torch.float16, "int8"),
    ([45, 2], 4, 1, 32, 32, 2, torch.float16, "fp8"),
    ([29, 9], 4, 4, 64, 8, 1, torch.float16, "int4"),
    ([21, 9], 6, 3, 48, 8, 2, torch.float32, "int4"),
    # int8 for a 16-bit q is read as words of four codes and multiplied in fp16 (a bf16 q rescaled per row),
    # unless head_dim is not a multiple of 4 (6: rows off 4-byte boundaries), which reads it code by code.
    # Per-token scales load for 2 heads at once here, for 1 with 3 KV heads, in groups of 2 starting at heads
    # 0, 2 and 4 with 6 (kernels' SCALE_HEADS).
    ([50, 16, 1], 8, 2, 64, 16, 3, torch.bfloat16, "int8"),
    ([13, 30], 6, 3, 6, 8, 2, torch.float16, "int8"),
    ([13, 30], 12, 6, 32, 8, 2, torch.float16, "int8"),
]
if DEVICE == "cuda":  # bf16 (the interpreter's bf16 tl.dot is wrong) and the engine's shapes
    DECODE_CASES += [([1, 100, 333, 2048], 32, 8, 128, 16, splits, torch.bfloat16, kv)
                     for splits, kv in ((1, "int8"), (4, "fp8"), (37, "int4"))]
OTHER_MERGE = {"kernel": "last_split", "last_split": "kernel"}


@pytest.mark.parametrize("lens,heads,kv_heads,dim,block_size,splits,dtype,kv", DECODE_CASES)
def test_decode_kernel_matches_ref_on_quantized_cache(lens, heads, kv_heads, dim, block_size, splits, dtype, kv):
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1] * len(lens), lens, heads, kv_heads, dim, block_size, dtype,
                                                        kv, seed=len(lens) + dim)
    out = torch.full_like(q, float("nan"))
    ws = None
    if splits > 1:
        ws = PagedAttentionWorkspace.allocate(len(lens), heads, dim, splits, q.device)
        ws.out.fill_(float("nan")), ws.lse.fill_(float("nan"))
    got = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                 k_scale=ks, v_scale=vs)
    want = paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs)
    assert got is out and torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL[dtype])
    if splits > 1:  # the other merge (second kernel or last split program) gives the same bits
        ws.out.fill_(float("nan")), ws.lse.fill_(float("nan"))
        other = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=splits, out=torch.full_like(q, float("nan")),
                                       workspace=ws, k_scale=ks, v_scale=vs, merge=OTHER_MERGE[pa.DEFAULT_MERGE])
        assert torch.equal(other, got)


PREFILL_CASES = [
    # q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype
    ([1, 9, 1, 20], [37, 9, 5, 50], 4, 2, 32, 16, torch.float32, "int8"),  # decode rows mixed with prefill
    ([33, 1], [40, 64], 2, 2, 16, 8, torch.float16, "fp8"),
    ([7, 16], [7, 70], 4, 1, 64, 32, torch.float32, "int4"),  # a page larger than BLOCK_N
    ([5, 3], [13, 3], 2, 1, 32, 1, torch.float16, "int4"),  # one token per page
    ([12, 4], [30, 4], 4, 2, 16, 4, torch.float16, "int8"),
]
if DEVICE == "cuda":
    PREFILL_CASES += [([512, 1, 1, 300], [2000, 17, 1024, 300], 8, 2, 128, 16, torch.bfloat16, kv)
                      for kv in ("int8", "fp8", "int4")]


@pytest.mark.parametrize("q_lens,ctx_lens,heads,kv_heads,dim,block_size,dtype,kv", PREFILL_CASES)
def test_prefill_kernel_matches_ref_on_quantized_cache(q_lens, ctx_lens, heads, kv_heads, dim, block_size, dtype, kv):
    q, kq, vq, ks, vs, tables, cu_q, ctx = quantized_paged(q_lens, ctx_lens, heads, kv_heads, dim, block_size, dtype,
                                                           kv, seed=block_size + dim)
    out = paged_prefill_attention(q, kq, vq, tables, cu_q, ctx, max(q_lens), out=torch.full_like(q, float("nan")),
                                  k_scale=ks, v_scale=vs)
    want = paged_prefill_attention_ref(q, kq, vq, tables, cu_q, ctx, k_scale=ks, v_scale=vs)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4"])
def test_references_equal_attention_over_the_dequantized_cache(kv):
    """Independent of the references' own gather: dequantize the whole pool first (scales of unowned
    slots made finite), then run the unquantized references."""
    qp, kq, vq, ks, vs, tables, cu_q, ctx = quantized_paged([5, 1, 7], [19, 1, 40], 4, 2, 32, 8, torch.float32, kv,
                                                            seed=11)
    ks, vs = ks.nan_to_num(0.5), vs.nan_to_num(0.5)
    k, v = dequantize_kv(kq, ks, torch.float32), dequantize_kv(vq, vs, torch.float32)
    torch.testing.assert_close(paged_prefill_attention_ref(qp, kq, vq, tables, cu_q, ctx, k_scale=ks, v_scale=vs),
                               paged_prefill_attention_ref(qp, k, v, tables, cu_q, ctx), atol=1e-6, rtol=1e-6)
    q = qp[cu_q[1:].long() - 1]  # each sequence's last token, as a decode step
    torch.testing.assert_close(paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs),
                               paged_decode_attention_ref(q, k, v, tables, ctx), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_decode_kernel_reads_a_head_major_pool(kv):
    """The kernel takes the pools' strides: the same values stored [blocks, kv_heads, slots, ...] (vLLM's order; a
    permuted view of the logical shape) give the same output. Its scales are then per head, not per token,
    contiguous, so they load one head at a time (SCALE_HEADS = 1)."""
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1, 1], [37, 16, 70], 8, 4, 32, 8, torch.float16, kv, seed=9)
    want = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=2, k_scale=ks, v_scale=vs)

    def head_major(t):
        order = [0, 2, 1, *range(3, t.dim())]
        return t.permute(order).contiguous().permute(order)

    assert head_major(kq).stride(1) < head_major(kq).stride(2) and head_major(ks).stride(2) != 1
    got = paged_decode_attention(q, head_major(kq), head_major(vq), tables, ctx, num_splits=2, k_scale=head_major(ks),
                                 v_scale=head_major(vs))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def _restrided(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """The same scales [blocks, slots, 4 heads] in NaN-padded memory: "rows of 6" (slot stride 6, a view of a wider
    pool) or "blocks of 34" (block stride 34, two spare elements after each block's 8 x 4)."""
    blocks, slots, heads = scales.shape
    if layout == "rows of 6":
        wide = torch.full((blocks, slots, 6), float("nan"), dtype=scales.dtype, device=scales.device)
        view = wide[..., :heads]
    else:
        flat = torch.full((blocks * 34,), float("nan"), dtype=scales.dtype, device=scales.device)
        view = flat.as_strided((blocks, slots, heads), (34, heads, 1))
    view.copy_(scales)
    return view


@pytest.mark.parametrize("layout", ["rows of 6", "blocks of 34"])
def test_kernels_group_scales_only_where_their_strides_allow(layout):
    """The kernels load the per-token scales of SCALE_HEADS heads as one vector from a token offset they compute as
    (block * (stride_sb // S) + slot * (stride_st // S)) * S, so that Triton sees the alignment; that is the offset
    only when both strides are multiples of S, which ``scale_heads`` must check. Here 4 KV heads' scales sit in pools
    whose slot or block stride is a multiple of 2 but not of 4: grouping all 4 would read the wrong scales (NaN
    padding), grouping 2 is right. Decode and paged prefill."""
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [37, 70], 8, 4, 32, 8, torch.float16, "int8", seed=3)
    want = paged_decode_attention_ref(q, kq, vq, tables, ctx, k_scale=ks, v_scale=vs)
    ks2, vs2 = _restrided(ks, layout), _restrided(vs, layout)
    assert pa.scale_heads(4, ks2) == 2 and pa.scale_heads(4, ks) == 4
    got = paged_decode_attention(q, kq, vq, tables, ctx, num_splits=2, k_scale=ks2, v_scale=vs2)
    torch.testing.assert_close(got, want, **TOL[torch.float16])
    qp, kq, vq, ks, vs, tables, cu_q, ctx = quantized_paged([5, 9], [37, 70], 8, 4, 32, 8, torch.float16, "int8", seed=4)
    got = paged_prefill_attention(qp, kq, vq, tables, cu_q, ctx, 9, k_scale=_restrided(ks, layout),
                                  v_scale=_restrided(vs, layout))
    want = paged_prefill_attention_ref(qp, kq, vq, tables, cu_q, ctx, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])


@pytest.mark.parametrize("magnitude", [1e-6, 1e6])
def test_int8_decode_takes_bf16_queries_outside_fp16_range(magnitude):
    """The int8 path multiplies in fp16 (kernel INT8_WORDS): a bf16 q of any magnitude is rescaled per
    row by a power of two, so neither 1e6 (past fp16's 65504) nor 1e-6 (fp16 subnormals) loses it."""
    q, kq, vq, ks, vs, tables, _, ctx = quantized_paged([1, 1], [40, 23], 4, 2, 32, 8, torch.bfloat16, "int8", seed=5)
    q = (q.float() * magnitude * torch.linspace(0.5, 2, q.shape[1], device=q.device)[:, None]).to(torch.bfloat16)
    scale = 32 ** -0.5 / magnitude  # keeps the scores, and so the softmax, as peaked as at magnitude 1
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale=scale, num_splits=2, k_scale=ks, v_scale=vs)
    want = paged_decode_attention_ref(q, kq, vq, tables, ctx, scale=scale, k_scale=ks, v_scale=vs)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


def test_wrapper_errors_name_the_bad_value():
    q, kq, vq, ks, vs, tables, cu_q, ctx = quantized_paged([1, 1], [5, 9], 4, 2, 16, 8, torch.float32, "int8", seed=0)
    with pytest.raises(ValueError, match=r"an int8 KV cache \(torch.int8\) needs its scales"):
        paged_decode_attention(q, kq, vq, tables, ctx)
    with pytest.raises(ValueError, match=r"k_scale must be a float tensor of shape \(\d+, 8, 2\)"):
        paged_decode_attention(q, kq, vq, tables, ctx, k_scale=ks[..., None], v_scale=vs)
    with pytest.raises(ValueError, match="k_cache holds torch.int8 but v_cache torch.float8_e4m3fn"):
        paged_decode_attention(q, kq, vq.view(torch.float8_e4m3fn), tables, ctx, k_scale=ks, v_scale=vs)
    float_cache = torch.randn(*kq.shape, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale / v_scale dequantize a quantized KV cache.*pass None"):
        paged_decode_attention(q, float_cache, float_cache, tables, ctx, k_scale=ks, v_scale=vs)
    packed = kq.view(torch.uint8)  # int4 packs two channels a byte: 16 bytes are 32 channels, not 16
    with pytest.raises(ValueError, match=r"an int4 cache for head_dim 16 has a last dim of 8"):
        paged_prefill_attention(q, packed, packed, tables, cu_q, ctx, 1, k_scale=ks, v_scale=vs)
    q, kq, vq, ks, vs, tables, cu_q, ctx = quantized_paged([1, 1], [5, 9], 4, 2, 32, 8, torch.float32, "int4", seed=0)
    # Pairs at odd offsets (a head stride of 5 halves): the kernels load each pair as one 4-byte word.
    odd = torch.empty(ks.numel() // 4 * 5, dtype=ks.dtype, device=DEVICE).as_strided(
        ks.shape, (ks.shape[1] * ks.shape[2] * 5, ks.shape[2] * 5, 5, 2, 1))
    with pytest.raises(ValueError, match=r"int4 scales need contiguous \(scale, minimum\) pairs at even offsets"):
        paged_decode_attention(q, kq, vq, tables, ctx, k_scale=odd, v_scale=odd)
