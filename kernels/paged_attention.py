"""Decode attention over the paged KV cache, split along the context (flash-decoding).

Why it exists: in a decode step every sequence brings one query token, and attention must read all
of that sequence's cached K/V, scattered over fixed-size blocks of a shared pool (PagedAttention,
Kwon et al., SOSP 2023, https://arxiv.org/abs/2309.06180). The torch path gathers those blocks into
a contiguous copy first; this kernel reads them in place through the block table. Decode attention
does little arithmetic per byte, so its speed is how close it comes to the memory bandwidth.

Two ideas make that possible:

- **GQA packing.** One program handles one KV head and *all* the query heads that share it, as the
  rows of one tile, so K/V are read from memory once per group instead of once per query head, and
  the dot products run as ``tl.dot`` on the tensor cores (rows padded to 16, their minimum).
- **Split-K (Flash-Decoding, Dao, Haziza, Massa, Sizov 2023,
  https://crfm.stanford.edu/2023/10/12/flashdecoding.html).** With one sequence and 8 KV heads there
  are only 8 programs for 132 SMs. Stage 1 cuts each sequence's context into ``num_splits`` ranges
  and runs one program per (sequence, KV head, split), each an online softmax (Milakov & Gimelshein
  2018, https://arxiv.org/abs/1805.02867) over its range; stage 2 merges the partial results exactly
  (``merge_attention_partials`` says how). With num_splits == 1 stage 1 writes the output itself.
  Stage 2 is either a second kernel (``merge="kernel"``) or done inside stage 1 by the last split
  program of each (sequence, KV head) to finish (``merge="last_split"``: an arrival counter per pair,
  as ``split_k.py`` does for the quantized matmuls), which saves a launch per layer and token; both
  merge with ``split_merge.py``.

**CUDA graphs.** The grid, (batch, KV heads, num_splits), depends on tensor *shapes* only, never on
the values in ``context_lens``: each program reads its sequence's length on the GPU and derives its
split's token range there (an empty range writes a partial of weight zero). A graph captured once
can therefore be replayed after new lengths and block tables are copied into the same tensors. The
partials live in a ``PagedAttentionWorkspace`` (``split_merge.py``); pass one allocated for the largest batch and split
count and every captured graph reuses that one buffer (views of its leading rows), instead of each
capture keeping its own allocation. Without one the wrapper allocates per call, which is fine eagerly.
The last-split merge's arrival counters (``split_k.tile_counters``) are left at zero by every
launch, empty splits included (they arrive too), so replays find them clean.

**RoPE and the new token's K/V (``new_kv``)**: in a decode-only step the kernel also does ``rope_store_kv``'s work
(``rope_in_decode.py`` says how and what it buys).

Layout (one layer): ``k_cache``/``v_cache`` [num_blocks, block_size, Hkv, D]; token p of sequence b
is at ``k_cache[block_tables[b, p // block_size], p % block_size]``; ``context_lens[b]`` counts the
cached tokens including the new one; q [B, H, D], query head h reads KV head h // (H // Hkv).
A quantized cache (int8, fp8 or packed int4, ``minillm/kv/quant.py``) comes with ``k_scale`` /
``v_scale`` pools of the same block layout and is dequantized in registers (``kv_dequant.py``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_runnable, num_sms
from .kv_dequant import (INT4_GROUPS, NO_QUANT, PER_TOKEN, dequant_int4, kv_quant_mode,
                                        per_token_codes, per_token_query, per_token_rows, per_token_scales,
                                        reads_int8_words, scale_heads, scale_strides, tile_channels)
from .int_float import int8_words_to_fp16
from .split_merge import split_partials_ref
from .hopper.paged_decode import int8_decode, use_hopper
from .rope_in_decode import check_new_kv, check_pending_rms, rope_and_store_new_kv, stored_inv_rms
from .split_k import MAX_TILES, last_arrival, tile_counters
from .split_merge import (MERGE_KERNEL, MERGE_LAST_SPLIT, MERGES, NO_MERGE,
                                         PagedAttentionWorkspace, choose_num_splits, merge_by_kernel,
                                         merge_splits)
from .kv_formats import INT4_GROUP_SIZE

_LN2 = tl.constexpr(math.log(2.0))


# ----------------------------------------------------------------------------- references (torch)


def merge_attention_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results computed over disjoint parts of one context into the result over all.

    ``out`` [..., S, D] holds S partial outputs, each normalised by its own softmax denominator
    l_i = sum_j exp(score_j) over its part; ``lse`` [..., S] holds log l_i. Attention over the union
    is the softmax over all scores, so each part's output must be re-weighted by its share of the
    total denominator:

        lse = log(sum_i exp(lse_i)),    o = sum_i exp(lse_i - lse) * o_i

    In the (max, sum) form that an online softmax carries (m_i = max score, l_i = sum exp(s - m_i)),
    merging two parts reads m = max(m1, m2), l = l1 exp(m1 - m) + l2 exp(m2 - m),
    o = (o1 l1 exp(m1 - m) + o2 l2 exp(m2 - m)) / l — the same thing, since lse_i = m_i + log l_i.
    Subtracting the largest lse before exp keeps every weight in [0, 1] (no overflow); an empty part
    (lse -inf) gets weight 0. Returns (o [..., D], lse [...]), so merged results can be merged again.
    """
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all parts empty: no NaN
    weights = torch.exp(lse - top)
    total = weights.sum(dim=-1)
    merged = (weights.unsqueeze(-1) * out).sum(dim=-2) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    return merged, top.squeeze(-1) + torch.log(total)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float | None = None, num_splits: int = 1, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What ``paged_decode_attention`` computes, in plain torch with fp32 math; returns q's dtype.

    With ``num_splits`` > 1 it goes through ``split_partials_ref`` (``split_merge.py``) and this module's
    ``merge_attention_partials`` (looked up when called, so a replacement patched into this module
    is the one used) — the same result by the algebra in that function's docstring.
    """
    out, lse = split_partials_ref(q, k_cache, v_cache, block_tables, context_lens, num_splits, scale,
                                  k_scale=k_scale, v_scale=v_scale)
    return (merge_attention_partials(out, lse)[0] if num_splits > 1 else out[:, :, 0]).to(q.dtype)


# ----------------------------------------------------------------------------- Triton kernels


# The wrapper's default merge: a second kernel ("last_split", the merge in stage 1's last program, is the other).
DEFAULT_MERGE = "kernel"
# The Triton kernel's launch on a GPU where the call names none of block_n, num_warps, num_stages: the defaults below
# unless set here (a sweep's variants do: figures/h200/sweeps/decode_graph_timeline.py).
GPU_LAUNCH: dict = {}


# Arguments that change with the batch (table width, split count, workspace strides) are not
# specialised: Triton would otherwise compile new variants ("== 1", "% 16 == 0") mid-run.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_ob", "stride_oh", "stride_os", "stride_lb",
                               "stride_lh", "stride_outb", "stride_outh"])
def _split_kernel(Q, K, V, BlockTables, ContextLens, O, Lse,
                  qk_scale, num_splits,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  KScale, VScale, stride_sb, stride_st, stride_sh,
                  Out, stride_outb, stride_outh, Counters,
                  NewK, NewV, Cos, Sin, Slots, stride_nk, stride_nv, stride_c,
                  Squares, square_slots, norm_width, norm_eps,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  MERGE: tl.constexpr, KV_QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr,
                  INT8_WORDS: tl.constexpr = False, SCALE_HEADS: tl.constexpr = 1, NEW_KV: tl.constexpr = False,
                  PENDING: tl.constexpr = False, SQUARE_SLOTS: tl.constexpr = 1):
    """Stage 1: program (b, kv_head, split) attends the GROUP query heads of kv_head over its split.
    KV_QUANT: how K/V are stored (``kv_dequant.py``). INT8_WORDS: an int8 cache for a 16-bit q, read
    as int32 words of four codes, each word turned into four fp16s in the registers it was loaded into
    (``int_float.int8_words_to_fp16``): loaded byte-wise into the dot's layout, the codes cost a
    shared-memory load per one or two bytes (``figures/h200/sweeps/kv_quant_sass.json``).
    SCALE_HEADS: the KV heads whose per-token scales are loaded together (``kv_dequant.per_token_scales``).
    The scale arguments come late, then the merge's (Out, Counters) and NEW_KV's, so that without them the
    kernel compiles to the instructions it had before.
    MERGE: NO_MERGE writes the output to O; otherwise O and Lse get the split's partial, and with
    MERGE_LAST_SPLIT the last program of (b, kv_head) to finish merges all splits into Out.
    NEW_KV (an unquantized cache, HEAD_DIM a power of two, 16 or more): q and the step's new k arrive without RoPE,
    and this kernel does ``kv_store.rope_store_kv``'s work for its rows, with its arithmetic: each program rotates its
    query heads (``rotated_halves`` with the row's Cos/Sin), and the program whose split holds position ctx - 1
    rotates the new k of its KV head and stores it and v (NewK, NewV [B, Hkv, D]) at slot Slots[b] before it reads
    its tiles.
    PENDING (with NEW_KV): q, k and v are qkv_proj's fp32 row whose norm's 1 / rms its GEMV left to this kernel
    (``hopper/w4_gemv_norms.py``): each program forms it from the ``square_slots`` sums of squares at Squares (a row of
    ``norm_width``, ``norm_eps``) and scales each value as it loads it (``rope_in_decode.py``)."""
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ContextLens + b)
    # Splits are whole tiles long (only a sequence's last tile is partial); from the length on the
    # GPU, so the grid stays the same whatever the lengths are.
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims, dim_ok = tile_channels(BLOCK_D, HEAD_DIM, KV_QUANT)  # the head channel of each tile column
    row_dim_mask = (rows < GROUP)[:, None] & dim_ok[None, :]
    if NEW_KV:
        inv = 1.0
        if PENDING:
            inv = stored_inv_rms(Squares, square_slots, SQUARE_SLOTS, norm_width, norm_eps)
        q = rope_and_store_new_kv(Q, b, kv_head, heads, rows < GROUP, ctx, start, end, stride_qb, stride_qh, K, V,
                                  stride_kb, stride_kt, stride_kh, NewK, NewV, Cos, Sin, Slots, stride_nk, stride_nv,
                                  stride_c, inv, BLOCK_SIZE, HEAD_DIM, GROUP_PAD, PENDING)
    else:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_dim_mask, other=0.0)
    row_scale = qk_scale
    if KV_QUANT == PER_TOKEN:  # the dots run in fp16 (kv_dequant.per_token_query says why)
        q, q_unit = per_token_query(q)
        row_scale = qk_scale * q_unit[:, None]

    # Online softmax in base 2: qk_scale = scale * log2(e), and exp2 is the GPU's native exp.
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = BlockTables + b * stride_bt
    if KV_QUANT == INT4_GROUPS:  # [BLOCK_N, D/2] tiles of bytes: each byte is loaded once
        columns = tl.arange(0, BLOCK_D // 2)
        column_ok = columns < HEAD_DIM // 2
    elif INT8_WORDS:  # [BLOCK_N, D/4] tiles of int32 words, four codes each (rows start at multiples of 4 bytes)
        columns = tl.arange(0, BLOCK_D // 4)
        column_ok = columns < HEAD_DIM // 4
    else:
        columns, column_ok = dims, dim_ok
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end
        # A tile may span several blocks: gather each position's block id. Padding entries of the
        # table past the sequence's length are never read (masked).
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # int64: big pools
        rows_at = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        kv_mask = valid[:, None] & column_ok[None, :]
        if INT8_WORDS:
            words_at = (rows_at // 4)[:, None] + columns[None, :]
            k = int8_words_to_fp16(tl.load(K.to(tl.pointer_type(tl.int32), bitcast=True) + words_at, mask=kv_mask,
                                           other=0))
            v = int8_words_to_fp16(tl.load(V.to(tl.pointer_type(tl.int32), bitcast=True) + words_at, mask=kv_mask,
                                           other=0))
        else:
            k = tl.load(K + rows_at[:, None] + columns[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + rows_at[:, None] + columns[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT == INT4_GROUPS:
            token_at = block * stride_sb + (pos % BLOCK_SIZE) * stride_st  # the tokens' first scales
        if KV_QUANT == PER_TOKEN:  # scales go on the scores and weights, below (kv_dequant.py)
            token_at = per_token_rows(block, pos % BLOCK_SIZE, stride_sb, stride_st, SCALE_HEADS)
            k_scale = per_token_scales(KScale, token_at, valid, kv_head, stride_sh, SCALE_HEADS)
            v_scale = per_token_scales(VScale, token_at, valid, kv_head, stride_sh, SCALE_HEADS)
            if not INT8_WORDS:
                k, v = per_token_codes(k, q), per_token_codes(v, q)
        if KV_QUANT == INT4_GROUPS:  # pairs at even offsets (kv_quant_mode checks): one 4-byte load each
            pairs = tl.multiple_of(token_at + kv_head * stride_sh, 2)
            k = dequant_int4(k, KScale + pairs, valid, HEAD_DIM // 2, QUANT_GROUP).to(q.dtype)
            v = dequant_int4(v, VScale + pairs, valid, HEAD_DIM // 2, QUANT_GROUP).to(q.dtype)

        # "ieee": fp32 inputs get fp32 products, not TF32's 10-bit mantissa; 16-bit inputs ignore it.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * row_scale
        if KV_QUANT == PER_TOKEN:
            scores = scores * k_scale[None, :]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT == PER_TOKEN:
            # After the denominator: V's scale weighs values, not probabilities. Relative to the tile's
            # largest scale, so that the weights stay in fp16's normal range (in [0, 1]); times it after the dot.
            v_unit = tl.max(v_scale, axis=0)
            v_unit = tl.where(v_unit > 0, v_unit, 1.0)
            p = p * (v_scale / v_unit)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee") * v_unit
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # An empty split (start >= end) ran no tile: l_i = 0, so it writes out 0 and lse -inf.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_dim_mask)
    if MERGE != NO_MERGE:
        # Natural log, as the reference returns it; log2(1) for empty splits avoids log2(0) warnings.
        lse_ptrs = Lse + b * stride_lb + heads * stride_lh
        lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(lse_ptrs + split, lse, mask=rows < GROUP)
    if MERGE == MERGE_LAST_SPLIT:
        # Every split arrives, an empty one too: its partial (weight 0) was stored all the same.
        if last_arrival(Counters, b * tl.num_programs(1) + kv_head, num_splits):
            part_ptrs = O + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
            merged = merge_splits(part_ptrs, lse_ptrs, num_splits, stride_os, rows < GROUP, row_dim_mask)
            out_ptrs = Out + b * stride_outb + heads[:, None] * stride_outh + dims[None, :]
            tl.store(out_ptrs, merged.to(Out.dtype.element_ty), mask=row_dim_mask)


# ----------------------------------------------------------------------------- wrapper


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, out, k_scale, v_scale,
                  q_dtype: torch.dtype | None = None) -> tl.constexpr:
    """Everything that can be checked without reading device memory; returns the cache's KV_QUANT. ``q_dtype``: what
    q stands for (``paged_decode_attention``'s ``rms``: fp32 values the kernel rounds to the cache's dtype)."""
    q_dtype = q_dtype or q.dtype
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; valid: float16, bfloat16, float32")
    quant = kv_quant_mode(q, k_cache, v_cache, k_scale, v_scale, q_dtype)  # a quantized cache's width and scales
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    if quant == NO_QUANT and k_cache.shape[3] != dim:
        raise ValueError(f"q has head_dim {dim} but the cache has {k_cache.shape[3]}")
    # The kernel shares one address computation between K and V and steps the last dims by one.
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache and v_cache need equal strides ending in 1, got {k_cache.stride()} "
                         f"and {v_cache.stride()}")
    if q.stride(2) != 1:
        raise ValueError(f"q needs a contiguous last dim, got strides {q.stride()}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks] with contiguous rows, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (batch,) or context_lens.stride(0) != 1:
        raise ValueError(f"context_lens must be contiguous int32 [batch={batch}], "
                         f"got {context_lens.dtype} {tuple(context_lens.shape)} strides {context_lens.stride()}")
    if out is not None and (out.shape != q.shape or out.dtype != q_dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {q_dtype} {tuple(q.shape)} with a contiguous last dim, "
                         f"got {out.dtype} {tuple(out.shape)}")
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "context_lens": context_lens}
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}; all must share one device")
    check_runnable("q", q)
    return quant


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                           workspace: PagedAttentionWorkspace | None = None, merge: str | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, hopper: bool | None = None,
                           new_kv: tuple | None = None, rms=None) -> torch.Tensor:
    """softmax(q K^T * scale) V for one new token per sequence over the paged cache -> out [B, H, D].

    ``scale`` defaults to head_dim ** -0.5; ``num_splits`` to ``choose_num_splits`` on this GPU.
    ``out`` and ``workspace`` let a CUDA graph keep its memory (module docstring). ``block_n``
    (tokens per tile, a power of two >= 16), ``num_warps`` and ``num_stages`` override the launch
    configuration, for benchmarks. ``merge`` says who merges the splits' partials: "kernel" (a second
    kernel, one program per query head) or "last_split" (the last split program of each sequence and
    KV head to finish, inside the first kernel: one launch fewer); default ``DEFAULT_MERGE``. Both
    leave the partials in the workspace and give bit-identical outputs. ``context_lens`` values must
    lie in [1, max_blocks * block_size] and the table's entries below them must be valid block ids;
    checking that would need a device sync, so it is the caller's promise.

    A quantized cache (int8, float8_e4m3fn, or uint8 = packed int4; ``minillm/kv/quant.py``) comes
    with its ``k_scale`` / ``v_scale`` pools and is dequantized inside the kernel.

    On an sm_90 GPU an int8 cache goes to the Gluon kernel of ``hopper/paged_decode.py`` where it can run
    (``hopper=None``; its ``unsupported`` says where not); ``hopper=False`` keeps the Triton kernel, ``hopper=True``
    demands the Gluon one (a ValueError with the reason where it cannot run). Launch overrides (``block_n``,
    ``num_warps``, ``num_stages``) are the Triton kernel's, so they choose it. The Gluon kernel merges splits with
    the merge kernel whatever ``merge`` says (the same result).

    ``new_kv`` = (k, v [B, Hkv, D], cos, sin [B, D] as ``rope`` takes them, slot_mapping int64 [B]), for an
    unquantized cache: q and the new k arrive without RoPE, and the kernel applies it and stores k and v itself, as
    ``kv_store.rope_store_kv`` would have first (``rope_in_decode.py``). The pools get the same bits; on a GPU the
    output may differ in its last bit (seen on the H200 at 32 query heads; at the tests' shapes they are equal).

    ``rms`` (with ``new_kv``; a ``w4_gemv_norms.Rms``: sums of squares, width, eps): q, k and v are fp32 views of
    qkv_proj's output before its norm's 1 / rms, which the kernel forms from the sums and applies as it loads them,
    rounding to the cache's dtype (``out``'s), as the GEMV would have (``rope_in_decode.py``).
    """
    if rms is not None:
        check_pending_rms(q, k_cache, new_kv, rms)
    q_dtype = k_cache.dtype if rms is not None else None
    quant = _check_inputs(q, k_cache, v_cache, block_tables, context_lens, out, k_scale, v_scale, q_dtype)
    if new_kv is not None:
        check_new_kv(q, k_cache, quant, new_kv, pending=rms is not None)
    gluon = use_hopper(q, k_cache, v_cache, k_scale, hopper, block_n or num_warps or num_stages)
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    on_gpu = q.device.type == "cuda"
    # Under the interpreter every tile costs Python time: small tiles keep the tests fast.
    block_n = block_n or (GPU_LAUNCH.get("block_n", 64) if on_gpu else 16)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot's minimum), got {block_n}")
    if num_splits is None:
        # Counted in the Triton kernel's programs (one per KV head) for the Gluon kernel too, whose programs take a
        # pair: counting pairs would give B=64 two waves and B=1 twice the splits, both slower on the H200
        # (figures/h200/sweeps/decode_int8_gluon_run10.json).
        num_splits = choose_num_splits(batch, kv_heads, block_tables.shape[1] * block_size, num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    merge = DEFAULT_MERGE if merge is None else merge
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {sorted(MERGES)}, got {merge!r}")
    if merge == "last_split" and num_splits > 1 and batch * kv_heads > MAX_TILES and not gluon:
        raise ValueError(f"merge='last_split' needs an arrival counter per (sequence, KV head): batch {batch} x "
                         f"{kv_heads} KV heads > {MAX_TILES} (split_k.MAX_TILES); use merge='kernel'")
    scale = dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q, dtype=q_dtype) if out is None else out

    if num_splits == 1:
        # No partials to merge: stage 1 writes the output itself (split stride 0, no lse).
        partial, lse, partial_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        if workspace is None:
            workspace = PagedAttentionWorkspace.allocate(batch, heads, dim, num_splits, q.device)
        ws_batch, ws_heads, ws_splits, ws_dim = workspace.out.shape
        if (ws_heads, ws_dim) != (heads, dim) or ws_batch < batch or ws_splits < num_splits \
                or workspace.out.device != q.device or workspace.out.dtype != torch.float32:
            raise ValueError(f"workspace holds {workspace.out.dtype} [{ws_batch}, {ws_heads}, {ws_splits}, "
                             f"{ws_dim}] on {workspace.out.device}; this call needs float32 at least "
                             f"[{batch}, {heads}, {num_splits}, {dim}] on {q.device} "
                             "(PagedAttentionWorkspace.allocate makes one)")
        partial, lse = workspace.out[:batch, :, :num_splits], workspace.lse[:batch, :, :num_splits]
        partial_strides, lse_strides = partial.stride()[:3], lse.stride()[:2]

    block_d = max(16, triton.next_power_of_2(dim))
    # Launch defaults from H200 sweeps at B=64, 2k context (figures/h200/sweeps/decode_launch.json): a 1-byte
    # cache's tiles are converted in registers before the dot, and 2 warps with a 4-deep pipeline
    # read it at 50 % of copy bandwidth where the 4 warps / 3 stages kept for bf16 got 31 %.
    warps, stages = (2, 4) if quant == PER_TOKEN else (4, 3)
    launch = dict(num_warps=num_warps or GPU_LAUNCH.get("num_warps", warps),
                  num_stages=num_stages or GPU_LAUNCH.get("num_stages", stages)) if on_gpu else {}
    # Without scales the cache stands in for them: never read (KV_QUANT=NO_QUANT compiles no load).
    k_scales, v_scales = (k_cache, v_cache) if k_scale is None else (k_scale, v_scale)
    mode = NO_MERGE if num_splits == 1 else MERGES[merge]
    if gluon:
        int8_decode(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale, partial, lse, partial_strides,
                    lse_strides, num_splits, scale * math.log2(math.e))
        if num_splits > 1:
            merge_by_kernel(partial, lse, out, num_splits, partial_strides, lse_strides, dim, block_d)
        return out
    # The counters only exist where they are used: a graph captured with "kernel" never allocates them.
    counters = tile_counters(q.device) if mode == MERGE_LAST_SPLIT else lse
    # Without new_kv its arguments are never read (NEW_KV=False compiles no load of them).
    new_k, new_v, cos, sin, slots = new_kv if new_kv is not None else (q, q, q, q, context_lens)
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial, lse,
        scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *partial_strides, *lse_strides, k_scales, v_scales, *scale_strides(k_scale),
        out, out.stride(0), out.stride(1), counters,
        new_k, new_v, cos, sin, slots, new_k.stride(0), new_v.stride(0), cos.stride(0),
        *((rms.squares, rms.squares.numel(), rms.width, rms.eps) if rms is not None else (lse, 0, 0, 0.0)),
        NEW_KV=new_kv is not None, PENDING=rms is not None,
        SQUARE_SLOTS=triton.next_power_of_2(rms.squares.numel()) if rms is not None else 1,
        BLOCK_SIZE=block_size, HEAD_DIM=dim, BLOCK_D=block_d, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, MERGE=mode,
        KV_QUANT=quant, QUANT_GROUP=INT4_GROUP_SIZE, INT8_WORDS=reads_int8_words(q, k_cache, v_cache),
        SCALE_HEADS=scale_heads(kv_heads, k_scale), **launch)
    if mode == MERGE_KERNEL:
        merge_by_kernel(partial, lse, out, num_splits, partial_strides, lse_strides, dim, block_d)
    return out
