"""Paged decode attention (split-K): the Triton kernel against its torch reference, the reference
against SDPA, the split/merge algebra, buffer reuse as a CUDA graph replays it, the split heuristic
and the wrapper's errors. On CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import minillm.kernels.paged_attention as pa
from minillm.kernels import split_k
from minillm.kernels.paged_attention import (PagedAttentionWorkspace, choose_num_splits, merge_attention_partials,
                                             paged_decode_attention, paged_decode_attention_ref, split_partials_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_inputs(context_lens, heads, kv_heads, dim, block_size, dtype=torch.float32, seed=0, device=DEVICE):
    """Random q and pool, and a block table whose blocks are shuffled pool ids; the padding past each
    sequence's blocks holds other valid (garbage) ids, which must not change the result."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    max_blocks = max(needed) + 1
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=g)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[start : start + n]
        start += n
    q = torch.randn(len(context_lens), heads, dim, generator=g)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            tables.to(torch.int32).to(**to), torch.tensor(context_lens, dtype=torch.int32, **to))


def poisoned(q, batch_splits=None):
    out = torch.full_like(q, float("nan"))
    if batch_splits is None:
        return out, None
    batch, splits = batch_splits
    ws = PagedAttentionWorkspace.allocate(batch, q.shape[1], q.shape[2], splits, q.device)
    ws.out.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    return out, ws


def test_ref_matches_sdpa_on_a_gathered_copy():
    lens = [1, 13, 40]
    q, k, v, tables, ctx = make_inputs(lens, heads=8, kv_heads=2, dim=16, block_size=8, device="cpu")
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, scale=0.3)
    for b, n in enumerate(lens):
        blocks = tables[b, : -(-n // 8)].long()
        keys = k[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [Hkv, n, D]
        values = v[blocks].flatten(0, 1)[:n].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[b, :, None], keys, values, scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(ref[b], want, atol=1e-5, rtol=1e-5)


# (context_lens, heads, kv_heads, head_dim, block_size, num_splits, dtype): lengths 1, odd, whole
# blocks and partial ones; GQA ratios 1/2/4/8; more splits than a sequence has tiles (empty splits).
CASES = [
    ([1, 17, 32, 5], 2, 2, 16, 16, 1, torch.float32),
    ([33, 8, 1], 4, 2, 32, 8, 3, torch.float32),
    ([64, 31], 8, 2, 64, 32, 1, torch.float16),
    ([50, 16, 1], 8, 1, 128, 16, 3, torch.float16),
    ([40, 3, 24], 8, 2, 32, 8, 16, torch.float32),
    ([45, 2], 4, 2, 16, 32, 7, torch.float16),
    ([21, 9], 6, 3, 24, 8, 2, torch.float32),  # head_dim not a power of two: masked columns
    ([300, 40], 4, 2, 16, 16, 20, torch.float32),  # more splits than split_merge.MERGE_CHUNK, both chunks non-empty
]


@pytest.mark.parametrize("lens,heads,kv_heads,dim,block_size,splits,dtype", CASES)
def test_kernel_matches_ref(lens, heads, kv_heads, dim, block_size, splits, dtype):
    q, k, v, tables, ctx = make_inputs(lens, heads, kv_heads, dim, block_size, dtype, seed=len(lens) + dim)
    out, ws = poisoned(q, (len(lens), splits) if splits > 1 else None)
    got = paged_decode_attention(q, k, v, tables, ctx, num_splits=splits, out=out, workspace=ws)
    assert got is out
    torch.testing.assert_close(got, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[dtype])


def test_default_splits_and_scale():
    q, k, v, tables, ctx = make_inputs([9, 30], 4, 2, 16, 8, seed=3)
    torch.testing.assert_close(paged_decode_attention(q, k, v, tables, ctx, scale=0.7),
                               paged_decode_attention_ref(q, k, v, tables, ctx, scale=0.7), **TOL[torch.float32])


def test_kernel_partials_match_split_ref():
    """Stage 1 alone: each split's output and lse, the empty splits' -inf included."""
    q, k, v, tables, ctx = make_inputs([1, 35, 70], 4, 2, 16, 8, seed=5)
    out, ws = poisoned(q, (3, 5))
    paged_decode_attention(q, k, v, tables, ctx, num_splits=5, out=out, workspace=ws, block_n=16)
    want_out, want_lse = split_partials_ref(q, k, v, tables, ctx, 5, tile=16)
    assert torch.isinf(want_lse).any() and torch.isfinite(want_lse).any()
    torch.testing.assert_close(ws.lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ws.out, want_out, atol=1e-5, rtol=1e-5)


def test_merged_splits_equal_the_unsplit_ref():
    q, k, v, tables, ctx = make_inputs([1, 20, 57], 4, 2, 16, 8, seed=6, device="cpu")
    whole = paged_decode_attention_ref(q, k, v, tables, ctx)
    for splits in (2, 3, 8, 64):
        torch.testing.assert_close(paged_decode_attention_ref(q, k, v, tables, ctx, num_splits=splits), whole)
    # Merging is associative: merging two merged halves gives the merge of all four parts.
    # Merged results merge again: two merged halves give the whole output and its log-sum-exp.
    out, lse = split_partials_ref(q, k, v, tables, ctx, 4)
    left = merge_attention_partials(out[:, :, :2], lse[:, :, :2])
    right = merge_attention_partials(out[:, :, 2:], lse[:, :, 2:])
    pair_out, pair_lse = merge_attention_partials(torch.stack([left[0], right[0]], dim=2),
                                                  torch.stack([left[1], right[1]], dim=2))
    torch.testing.assert_close(pair_out, whole)
    torch.testing.assert_close(pair_lse, split_partials_ref(q, k, v, tables, ctx, 1)[1][:, :, 0])


def test_reference_uses_the_patched_merge(monkeypatch):
    q, k, v, tables, ctx = make_inputs([12, 30], 2, 2, 16, 8, device="cpu")
    monkeypatch.setattr(pa, "merge_attention_partials", lambda out, lse: (out.mean(dim=-2), lse[..., 0]))
    naive = paged_decode_attention_ref(q, k, v, tables, ctx, num_splits=3)
    assert not torch.allclose(naive, paged_decode_attention_ref(q, k, v, tables, ctx))


def test_reused_buffers_see_new_lengths_and_tables():
    """What a CUDA graph replay does: the same out / workspace / length and table tensors, new values."""
    q, k, v, tables, ctx = make_inputs([30, 7], 4, 2, 16, 8, seed=7)
    out, ws = poisoned(q, (4, 6))  # larger than needed: the call uses its leading views
    first = paged_decode_attention(q, k, v, tables, ctx, num_splits=3, out=out, workspace=ws).clone()
    torch.testing.assert_close(first, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.float32])
    ctx.copy_(torch.tensor([5, 31], dtype=torch.int32))
    tables.copy_(tables.flip(1).roll(1, dims=0))  # new block ids, all valid
    second = paged_decode_attention(q, k, v, tables, ctx, num_splits=3, out=out, workspace=ws)
    torch.testing.assert_close(second, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.float32])
    assert not torch.allclose(first, second)


# (context_lens, heads, kv_heads, head_dim, block_size, num_splits, dtype) for the two merges: splits 1,
# 2, 3, 8; GQA 1/2/4/8; odd lengths; 8 splits of 16-token tiles over 1..70 tokens (most splits empty);
# lengths 1 and 200 in one batch.
MERGE_CASES = [
    ([13, 70, 1], 4, 2, 16, 8, 1, torch.float32),
    ([33, 8, 1], 4, 4, 32, 8, 2, torch.float32),
    ([45, 17], 8, 1, 16, 16, 3, torch.float16),
    ([1, 35, 70, 5], 8, 2, 16, 8, 8, torch.float32),
    ([200, 1], 4, 1, 24, 16, 3, torch.float32),
    ([57, 3, 129], 6, 3, 32, 32, 8, torch.float16),
    ([300, 40], 4, 2, 16, 16, 20, torch.float32),  # more splits than split_merge.MERGE_CHUNK: two chunks of loads
]


def _counters_clean(device) -> bool:
    return all(int(c.count_nonzero()) == 0 for c in split_k.COUNTERS.values() if c.device == torch.device(device))


@pytest.mark.parametrize("lens,heads,kv_heads,dim,block_size,splits,dtype", MERGE_CASES)
def test_last_split_merge_matches_ref_and_the_merge_kernel_bit_for_bit(lens, heads, kv_heads, dim, block_size,
                                                                       splits, dtype):
    q, k, v, tables, ctx = make_inputs(lens, heads, kv_heads, dim, block_size, dtype, seed=sum(lens) + splits)
    results = {}
    for merge in ("kernel", "last_split"):
        out, ws = poisoned(q, (len(lens), splits))
        # block_n=16 as the reference's tile: a split is whole tiles long, so the tile sets the split bounds.
        results[merge] = paged_decode_attention(q, k, v, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                                merge=merge, block_n=16)
        assert results[merge] is out
        if splits > 1:  # the partials stay in the workspace, as ex04 and notebook 04 read them
            want_out, want_lse = split_partials_ref(q, k, v, tables, ctx, splits, tile=16)
            torch.testing.assert_close(ws.lse, want_lse, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ws.out, want_out, **TOL[dtype])
    torch.testing.assert_close(results["last_split"], paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[dtype])
    assert torch.equal(results["last_split"], results["kernel"])  # same arithmetic in the same order
    assert _counters_clean(q.device)


def test_last_split_merge_leaves_counters_clean_for_the_next_launch():
    """Two launches on the same buffers (a graph replay's view): the second must find every counter at
    zero, or its last arrival would come early and merge partials not yet written."""
    q, k, v, tables, ctx = make_inputs([30, 7, 50], 8, 2, 16, 8, seed=11)
    out, ws = poisoned(q, (3, 5))
    first = paged_decode_attention(q, k, v, tables, ctx, num_splits=5, out=out, workspace=ws,
                                   merge="last_split").clone()
    torch.testing.assert_close(first, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.float32])
    assert _counters_clean(q.device)
    ctx.copy_(torch.tensor([5, 64, 1], dtype=torch.int32))
    tables.copy_(tables.flip(1).roll(1, dims=0))
    out.fill_(float("nan")), ws.out.fill_(float("nan")), ws.lse.fill_(float("nan"))
    second = paged_decode_attention(q, k, v, tables, ctx, num_splits=5, out=out, workspace=ws, merge="last_split")
    torch.testing.assert_close(second, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.float32])
    assert _counters_clean(q.device) and not torch.allclose(first, second)


def test_last_split_merge_needs_a_counter_per_sequence_and_kv_head(monkeypatch):
    q, k, v, tables, ctx = make_inputs([5, 9], 4, 2, 16, 8)
    monkeypatch.setattr(pa, "MAX_TILES", 3)  # 2 sequences x 2 KV heads = 4 counters
    with pytest.raises(ValueError, match=r"batch 2 x 2 KV heads > 3 \(split_k.MAX_TILES\); use merge='kernel'"):
        paged_decode_attention(q, k, v, tables, ctx, num_splits=2, merge="last_split")
    paged_decode_attention(q, k, v, tables, ctx, num_splits=1, merge="last_split")  # one split: no counters
    with pytest.raises(ValueError, match=r"merge must be one of \['kernel', 'last_split'\], got 'fused'"):
        paged_decode_attention(q, k, v, tables, ctx, merge="fused")


def test_choose_num_splits():
    assert choose_num_splits(1, 8, 32768, 132) == math.ceil(2 * 132 / 8)  # batch 1: two waves
    assert choose_num_splits(1, 8, 2048, 132) == 16  # capped: no split under 128 tokens
    assert choose_num_splits(64, 8, 2048, 132) == 1  # 512 programs already >= two waves
    assert choose_num_splits(33, 8, 4096, 132) == 1
    assert choose_num_splits(1, 1, 16, 132) == 1
    for batch in (1, 2, 5, 16, 200):
        for context in (16, 300, 4096, 131072):
            splits = choose_num_splits(batch, 4, context, 132)
            assert splits >= 1 and (splits == 1 or context // splits >= 128)


def _bad(field, value):
    q, k, v, tables, ctx = make_inputs([5, 9], 4, 2, 16, 8)
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=tables, context_lens=ctx)
    args[field] = value(args)
    return args


@pytest.mark.parametrize("field,value,message", [
    ("q", lambda a: a["q"][0], r"q must be \[batch, heads, head_dim\]"),
    ("q", lambda a: a["q"][:, :3], "not a multiple of the cache's 2 KV heads"),
    ("q", lambda a: a["q"][:, :, :8], "head_dim 8 but the cache has 16"),
    ("q", lambda a: a["q"].double(), "valid: float16, bfloat16, float32"),
    ("v_cache", lambda a: a["v_cache"][:, :4], "must both be"),
    ("v_cache", lambda a: a["v_cache"].half(), "v_cache has dtype torch.float16 but q has torch.float32"),
    ("block_tables", lambda a: a["block_tables"].long(), "block_tables must be int32"),
    ("block_tables", lambda a: a["block_tables"][:1], r"block_tables must be int32 \[batch=2"),
    ("context_lens", lambda a: a["context_lens"].long(), "context_lens must be contiguous int32"),
    ("block_tables", lambda a: a["block_tables"].t().contiguous().t(), "with contiguous rows"),
    ("context_lens", lambda a: a["context_lens"].to("meta"), "context_lens is on meta"),
])
def test_errors_name_the_bad_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_bad(field, value))


def test_errors_for_options():
    q, k, v, tables, ctx = make_inputs([5, 9], 4, 2, 16, 8)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        paged_decode_attention(q, k, v, tables, ctx, num_splits=0)
    with pytest.raises(ValueError, match=r"block_n must be a power of two >= 16 \(tl.dot.s minimum\), got 24"):
        paged_decode_attention(q, k, v, tables, ctx, block_n=24)
    with pytest.raises(ValueError, match=r"out must be torch.float32 \(2, 4, 16\)"):
        paged_decode_attention(q, k, v, tables, ctx, out=q.half())
    with pytest.raises(ValueError, match=r"this call needs float32 at least \[2, 4, 3, 16\]"):
        paged_decode_attention(q, k, v, tables, ctx, num_splits=3,
                               workspace=PagedAttentionWorkspace.allocate(2, 4, 16, 2, q.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot and CUDA graphs need a GPU")
def test_bf16_and_cuda_graph_replay_on_gpu():
    lens = [1, 100, 333, 2048]
    q, k, v, tables, ctx = make_inputs(lens, 32, 8, 128, 16, torch.bfloat16)
    for splits in (1, 4, 37):
        torch.testing.assert_close(paged_decode_attention(q, k, v, tables, ctx, num_splits=splits),
                                   paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.bfloat16])
        assert torch.equal(paged_decode_attention(q, k, v, tables, ctx, num_splits=splits, merge="last_split"),
                           paged_decode_attention(q, k, v, tables, ctx, num_splits=splits, merge="kernel"))
    for merge in ("kernel", "last_split"):
        out, ws = poisoned(q, (len(lens), 8))
        args = dict(num_splits=8, out=out, workspace=ws, merge=merge)
        paged_decode_attention(q, k, v, tables, ctx, **args)  # compile (and allocate the counters) outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode_attention(q, k, v, tables, ctx, **args)
        for new_lens in ([2048, 1, 17, 640], [5, 1999, 64, 1], [1, 1, 1, 1]):
            ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
            tables.copy_(tables.roll(1, dims=0))
            for _ in range(3):  # replays back to back: each must find the counters clean
                out.fill_(float("nan"))
                graph.replay()
            torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, ctx), **TOL[torch.bfloat16])
            assert _counters_clean(q.device)


@pytest.mark.parametrize("lens,heads,kv_heads,dim,splits,merge", [
    ([5, 33, 17], 4, 2, 16, 1, "kernel"), ([40, 9], 4, 2, 32, 3, "kernel"), ([70], 2, 2, 16, 4, "last_split"),
    ([1, 24], 6, 3, 16, 2, "kernel")])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_new_kv_is_rope_store_kv_then_the_kernel_bit_for_bit(lens, heads, kv_heads, dim, splits, merge, dtype):
    """new_kv: the kernel rotates q and the new k itself and stores k and v at the new token's slot (the last
    position of each sequence, in whichever split holds it; one-token sequences too): the output and the pools are
    those of rope_store_kv followed by the kernel, bit for bit at these shapes (the wrapper's docstring says where a
    GPU may differ in the output's last bit), and q, k and v are left as they were."""
    from minillm.kernels.kv_store import rope_store_kv
    q, k_pool, v_pool, tables, ctx = make_inputs(lens, heads, kv_heads, dim, 8, dtype, seed=sum(lens) + dim)
    g = torch.Generator().manual_seed(len(lens) + splits)
    new_k, new_v = (torch.randn(len(lens), kv_heads, dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    angles = torch.randn(len(lens), dim // 2, generator=g) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    last = ctx.long() - 1
    slots = tables.long().gather(1, (last // 8)[:, None])[:, 0] * 8 + last % 8
    pools = {}
    for fused in (True, False):
        kp, vp, qq, kk, vv = k_pool.clone(), v_pool.clone(), q.clone(), new_k.clone(), new_v.clone()
        out, ws = poisoned(q, (len(lens), splits))
        if fused:
            got = paged_decode_attention(qq, kp, vp, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                         merge=merge, new_kv=(kk, vv, cos, sin, slots))
            assert torch.equal(qq, q) and torch.equal(kk, new_k) and torch.equal(vv, new_v)
        else:
            rope_store_kv(qq, kk, vv, cos, sin, kp, vp, slots)
            want = paged_decode_attention(qq, kp, vp, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                          merge=merge)
        pools[fused] = (kp, vp)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(pools[True], pools[False]))
    assert not torch.equal(pools[True][0], k_pool)  # the new k was stored


@pytest.mark.parametrize("lens,heads,kv_heads,dim,splits", [([70], 2, 2, 16, 4), ([9], 4, 2, 32, 1)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_pending_rms_scales_q_k_and_v_as_they_are_loaded(lens, heads, kv_heads, dim, splits, dtype):
    """rms: q, k and v arrive as fp32 rows before their norm's 1 / rms (qkv_proj's GEMV left it to this kernel), and
    the kernel forms 1 / rms from the sums of squares and scales each value as it loads it, rounding to the cache's
    dtype: the output and pools of new_kv on the rows scaled and rounded first (to the last bit of 1 / rms, whose
    sum runs in another order)."""
    from minillm.kernels.fused_layer_ops import Rms
    q, k_pool, v_pool, tables, ctx = make_inputs(lens, heads, kv_heads, dim, 8, dtype, seed=dim + splits)
    g = torch.Generator().manual_seed(dim)
    raw_q = torch.randn(1, heads, dim, generator=g).to(DEVICE) * 40
    raw_k, raw_v = (torch.randn(1, kv_heads, dim, generator=g).to(DEVICE) * 40 for _ in range(2))
    squares = torch.zeros(8, device=DEVICE)
    squares[:5] = torch.rand(5, generator=g).to(DEVICE) * 3e4  # (slots past the producer's splits stay zero)
    rms = Rms(squares, 64, 1e-5)
    inv = 1.0 / torch.sqrt(squares.sum() / rms.width + rms.eps)
    angles = torch.randn(1, dim // 2, generator=g) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    last = ctx.long() - 1
    slots = tables.long().gather(1, (last // 8)[:, None])[:, 0] * 8 + last % 8
    pools = {}
    for pending in (True, False):
        kp, vp = k_pool.clone(), v_pool.clone()
        out, ws = poisoned(q, (1, splits))
        if pending:
            got = paged_decode_attention(raw_q, kp, vp, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                         new_kv=(raw_k, raw_v, cos, sin, slots), rms=rms)
        else:
            scaled = [(t * inv).to(dtype) for t in (raw_q, raw_k, raw_v)]
            want = paged_decode_attention(scaled[0], kp, vp, tables, ctx, num_splits=splits, out=out, workspace=ws,
                                          new_kv=(*scaled[1:], cos, sin, slots))
        pools[pending] = (kp, vp)
    assert got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tolerance)
    for a, b in zip(pools[True], pools[False]):
        torch.testing.assert_close(a, b, **tolerance)
    assert not torch.equal(pools[True][0], k_pool)
    with pytest.raises(ValueError, match="needs new_kv"):
        paged_decode_attention(raw_q, k_pool, v_pool, tables, ctx, rms=rms)
    with pytest.raises(ValueError, match="one fp32 row"):
        paged_decode_attention(raw_q.to(dtype) if dtype != torch.float32 else raw_q.expand(2, -1, -1), k_pool,
                               v_pool, tables, ctx, new_kv=(raw_k, raw_v, cos, sin, slots), rms=rms)
    with pytest.raises(ValueError, match="sums of squares"):
        paged_decode_attention(raw_q, k_pool, v_pool, tables, ctx, new_kv=(raw_k, raw_v, cos, sin, slots),
                               rms=Rms(squares.double(), 64, 1e-5))


def test_new_kv_refusals_name_the_reason():
    q, k_pool, v_pool, tables, ctx = make_inputs([9, 4], 4, 2, 16, 8)
    new_k = torch.randn(2, 2, 16, device=DEVICE)
    cos = sin = torch.ones(2, 16, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, new_kv=(new_k, new_k, cos, sin, slots.int()))
    with pytest.raises(ValueError, match="new_kv's k must be"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, new_kv=(new_k[:1], new_k, cos, sin, slots))
    with pytest.raises(ValueError, match="cos/sin"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, new_kv=(new_k, new_k, cos[:1], sin[:1], slots))
    with pytest.raises(ValueError, match="5 items|new_kv must be"):
        paged_decode_attention(q, k_pool, v_pool, tables, ctx, new_kv=(new_k, new_k))
    q8, k8, v8, tables8, ctx8 = make_inputs([9, 4], 4, 2, 8, 8)
    new_k8 = torch.randn(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        paged_decode_attention(q8, k8, v8, tables8, ctx8, new_kv=(new_k8, new_k8, cos[:, :8], sin[:, :8], slots))
