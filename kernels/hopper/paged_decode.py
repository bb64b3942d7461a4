"""Decode attention over an INT8 paged KV cache for Hopper (sm_90), in Gluon: ``paged_decode_attention`` runs it
for int8 caches on an H100/H200.

Why it exists: the Triton kernel (``../paged_attention.py``) reads bf16 pools at the copy bandwidth but int8 pools at
about half of it, so an INT8 cache halved the bytes and bought no time. Two things held it back, both measured on
the H200 (ncu, figures/h200/sweeps/ncu_decode_int8_source.json): 0.17 warp-instructions per byte read, against
bf16's 0.065, most of them moving the converted tiles through shared memory into ``tl.dot``'s layout (6.9-way bank
conflicts); and one tile in flight per program, which the loop's top waited for. A skeleton of this kernel's data
path, a TMA ring and consumers that only wait, read the same pools at 99 % of copy bandwidth
(figures/h200/sweeps/decode_tma_skeleton.json). The design:

- **A producer warp and a ring of TMA copies.** One program per (sequence, pair of KV heads, split). Its producer
  warp (a partition of its own, ``warp_specialize``) copies each 16-token page's K and V for both heads as one
  [16, 2, head_dim] box each, SLOT_PAGES pages a slot, into ``STAGES`` slots; an mbarrier per slot says full,
  another empty. It loads the block ids 32 at a time, the next 32 while it issues the current ones.
- **Both heads in one product, block-diagonally.** A slot holds 128 (page, token, head) rows; consumer warp w
  takes page w's 32. Scores are computed transposed, S^T = K Q^T, [rows, NCOL]: the columns are both heads' query
  heads (GQA: 2 x group, padded to 8), and a row meets only its own head's columns, the others masked. The
  weights P^T, zero outside the diagonal blocks, give O^T = V^T P^T [head_dim, NCOL] for both heads at once, with
  ``mma_v2`` (m16n8k16), at a few percent of the tensor cores.
- **A softmax per warp.** Each warp keeps its own running max, sum and output over its pages, so no step needs
  another warp's values; the four are merged once, at the end (``merge_attention_partials``' algebra). A warp's
  tensors keep a leading dimension for the warps: the products are batched over it.
- **Operands straight from the ring.** K's int8 rows load from the slot into the product's operand layout with four
  codes per register (``DotOperandLayout(k_width=4)``); with k_width 4 on both operands the product pairs channels
  in its own order, the same for K and Q, so the sum is the same. V's operand is V transposed (its tokens are the
  reduction), which ldmatrix can transpose only for 16-bit elements: so V is read as int16 pairs of channels,
  transposed, and a PRMT splits each register's two tokens x two channels into the even channels' and the odd
  channels' fp16 pairs, accumulated as two halves of O^T. No converted tile goes back through shared memory
  (V stored as fp16 in a scratch tile would cost a quarter of the copy bandwidth).
- **Codes biased, not converted.** Four codes become four fp16s of value code + 1152 by a LOP3 and two PRMTs
  (``int_float.int8_words_to_fp16``'s trick without its two subtractions): each score starts from -1152 sum(q),
  computed once by the same product, and each step's output from -1152 sum(weights).
- **Scales on scores and weights**, as in ``../kv_dequant.py``: K's per-token scale multiplies the scores, V's the
  weights, relative to the largest V scale a column has met (so that they stay in fp16's range; the Triton kernel
  takes each tile's largest, so where a warp's V scales span more than about 1e4 this one rounds the smaller
  weights more coarsely, in fp16's subnormals), and q is divided by a power of two into fp16 (``per_token_query``'s
  rule). The scales are loaded a step ahead and their block ids
  two: loaded in one chain per step, they held the warps (figures/h200/sweeps/ncu_decode_gluon.json).

Measured on the H200 (B=64, 2048 tokens, 32/8 heads, D=128): 72 µs, 91 % of copy bandwidth, where the Triton kernel
takes 118 µs on the same pools and 125 µs on bf16 ones (103 %); 89 % of the bf16 kernel's utilisation in the same
interleaved rounds, best against best, 80-89 % round by round (figures/h200/kernels_decode_quant.json,
figures/h200/sweeps/decode_int8_gluon.json). What is left: the consumers are bound by their latency, not by issue
(ncu: the warps wait at the two barriers a step, the slot's release and one Triton 3.6 puts before the mbarrier
wait), and registers allow two programs an SM.

Split-K and the merge are ``../paged_attention.py``'s: with more than one split the programs write partials and lse
to its workspace and ``merge_by_kernel`` merges them. Not under Triton's interpreter (Gluon has none): its tests
run on an sm_90 GPU, and on the CPU the kernel is compiled for sm_90 and its loops checked
(tests/test_decode_hopper_sass.py).
"""

from __future__ import annotations

import math

import torch

from .gluon import GLUON_USABLE, MIN_TRITON, gluon
from .tma import TMA_ALIGN

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon import reinterpret, tma_load, warps_barrier

PAGE = 16  # tokens per block
SLOT_PAGES = 4  # pages a slot: 4 x 16 tokens x 2 heads = 128 rows, 32 a warp
HEADS_PER_PROGRAM = 2
HEAD_DIMS = (64, 128)
STAGES = 3  # slots of four pages (32 KB of K and V): two programs an SM, each with 64 KB in flight
CONSUMER_WARPS = 4
LOADER_REGS = 40
MAX_REGISTERS = 128  # per thread at launch, 8 warps (the producer's warpgroup counts whole): two programs an SM
ID_CHUNK = 32  # block ids loaded at once by the producer


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor) -> str | None:
    """Why this kernel cannot run ``paged_decode_attention``'s checked int8 inputs, or None if it can."""
    if not GLUON_USABLE:
        import triton
        return f"it is written in Gluon for Triton >= {'.'.join(map(str, MIN_TRITON))}, not {triton.__version__}"
    blocks, page, kv_heads, dim = k_cache.shape
    if k_cache.dtype != torch.int8:
        return f"it reads int8 caches, not {k_cache.dtype}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes a 16-bit q, not {q.dtype}"
    if page != PAGE:
        return f"it takes {PAGE}-token blocks, not {page}"
    if dim not in HEAD_DIMS:
        return f"it takes head_dim in {HEAD_DIMS}, not {dim}"
    if kv_heads % HEADS_PER_PROGRAM:
        return f"it takes KV heads in pairs, not {kv_heads}"
    group = q.shape[1] // kv_heads
    if HEADS_PER_PROGRAM * group > 16:
        return f"it takes at most {16 // HEADS_PER_PROGRAM} query heads per KV head, not {group}"
    # One 3-D TMA descriptor over the pool seen as [blocks * 16, kv_heads, head_dim].
    if k_cache.stride()[1:] != (kv_heads * dim, dim, 1) or k_cache.stride(0) != page * kv_heads * dim:
        return f"it needs a contiguous pool, got strides {k_cache.stride()}"
    if k_cache.data_ptr() % TMA_ALIGN or v_cache.data_ptr() % TMA_ALIGN:
        return f"its TMA descriptors need {TMA_ALIGN}-byte aligned pools"
    if k_scale.stride(2) != 1:  # (v_scale's strides equal k_scale's: kv_quant_mode checked)
        return f"it needs each token's scales contiguous, got strides {k_scale.stride()}"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "it needs an sm_90 GPU (H100/H200)"
    return None


def use_hopper(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               hopper: bool | None, launch_overridden) -> bool:
    """Whether ``paged_decode_attention`` runs this kernel (its docstring says when): ``hopper`` None (where it can
    run), False or True (demanded: a ValueError with the reason where it cannot); ``launch_overridden``: the call
    set the Triton kernel's launch (block_n, num_warps or num_stages)."""
    if hopper is False or (hopper is None and launch_overridden):
        return False
    if hopper and launch_overridden:
        raise ValueError("hopper=True runs the Gluon int8 decode kernel, which takes no block_n / num_warps / "
                         "num_stages (they configure the Triton kernel); pass one or the other")
    reason = unsupported(q, k_cache, v_cache, k_scale) if k_scale is not None else "the cache is not quantized"
    if reason and hopper:
        raise ValueError(f"hopper=True, but the Gluon int8 decode kernel cannot run these inputs: {reason}")
    return reason is None


if GLUON_USABLE:
    _PAGE = gl.constexpr(PAGE)
    _LN2 = gl.constexpr(math.log(2.0))
    _BIAS = gl.constexpr(1152.0)  # 1024 + 128: what _biased_fp16 adds to each code
    _ID_CHUNK, _LOADER_REGS = gl.constexpr(ID_CHUNK), gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _biased_fp16(codes):
        """int8 codes -> code + 1152 in fp16, exact, four codes per LOP3 + 2 PRMT (``int_float.int8_words_to_fp16``'s
        trick without its subtraction: the products take the bias out, see the module docstring), in the codes'
        own layout: each thread's four consecutive elements must share a register."""
        return gl.inline_asm_elementwise(
            """{ .reg .b32 u, high;
            xor.b32 u, $2, 0x80808080;
            mov.b32 high, 0x64646464;
            prmt.b32 $0, u, high, 0x5140;
            prmt.b32 $1, u, high, 0x5342; }""",
            "=r,=r,r", [codes], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _biased_fp16_pairs(pairs):
        """int16 elements, each two int8 codes (channels 2m, 2m + 1 of one token), two tokens' to a register ->
        (channel 2m's codes, channel 2m + 1's) + 1152 in fp16, each two tokens' to a register: ``_biased_fp16``
        with the PRMTs picking bytes 0, 2 and 1, 3."""
        return gl.inline_asm_elementwise(
            """{ .reg .b32 u, high;
            xor.b32 u, $2, 0x80808080;
            mov.b32 high, 0x64646464;
            prmt.b32 $0, u, high, 0x4240;
            prmt.b32 $1, u, high, 0x4341; }""",
            "=r,=r,r", [pairs], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _split_range(b, context_lens, num_splits, SLOT_PAGES: gl.constexpr):
        """This program's split of its sequence: its context length, first page, and number of pages."""
        ctx = gl.load(context_lens + b)
        pages = gl.cdiv(ctx, _PAGE)
        per_split = gl.cdiv(gl.cdiv(pages, num_splits), SLOT_PAGES) * SLOT_PAGES  # whole slots but the last
        first = gl.program_id(2) * per_split
        n = gl.maximum(gl.minimum(per_split, pages - first), 0)
        return ctx, first, n

    @gluon.jit
    def _producer(k_desc, v_desc, k_smem, v_smem, full, empty, block_tables, stride_bt, context_lens, num_splits,
                  STAGES: gl.constexpr, SLOT_PAGES: gl.constexpr):
        """The producer warp: each page of the split, K and V of both heads as one [16, 2, head_dim] box each, into
        slot (page // SLOT_PAGES) % STAGES once the consumers have released it; block ids 32 at a time."""
        b = gl.program_id(0)
        head = gl.program_id(1) * 2
        ctx, first, n_pages = _split_range(b, context_lens, num_splits, SLOT_PAGES)
        table = block_tables + b * stride_bt + first
        lanes = gl.arange(0, _ID_CHUNK, layout=gl.BlockedLayout([1], [32], [1], [0]))
        page_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes  # K and V
        # Each chunk's ids are loaded while the previous chunk's pages are issued: no wait between chunks.
        next_ids = gl.load(table + lanes, mask=lanes < n_pages, other=0)
        for chunk in range(0, n_pages, _ID_CHUNK):
            ids = next_ids
            next_ids = gl.load(table + chunk + _ID_CHUNK + lanes, mask=chunk + _ID_CHUNK + lanes < n_pages, other=0)
            for jj in gl.static_range(_ID_CHUNK):
                j = chunk + jj
                if j < n_pages:
                    row = gl.sum(gl.where(lanes == jj, ids, 0), axis=0) * _PAGE
                    step = j // SLOT_PAGES
                    slot = step % STAGES
                    i: gl.constexpr = jj % SLOT_PAGES  # chunks start at whole slots
                    if i == 0:
                        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                        pages = gl.minimum(n_pages - j, SLOT_PAGES)  # the split's last slot may hold fewer
                        for c in gl.static_range(SLOT_PAGES):
                            mbarrier.expect(full.index(slot), (c + 1) * page_bytes, pred=pages == c + 1)
                    tma_load(k_desc, [row, head, 0], full.index(slot), k_smem.index(slot).slice(i * _PAGE, _PAGE))
                    tma_load(v_desc, [row, head, 0], full.index(slot), v_smem.index(slot).slice(i * _PAGE, _PAGE))

    @gluon.jit
    def _query(Q, stride_qb, stride_qh, b, first_head, GROUP: gl.constexpr, NCOL: gl.constexpr,
               HEAD_DIM: gl.constexpr, layout: gl.constexpr, unit_layout: gl.constexpr, WARPS: gl.constexpr):
        """Q^T [warps, HEAD_DIM, NCOL], one copy a warp, for the program's two KV heads' query heads (column c is
        query head first_head + c, zero past 2 * GROUP) in fp16, each column divided by the power of two at or
        below its largest |value| (``kv_dequant.per_token_query``); and those factors [warps, NCOL]."""
        load: gl.constexpr = gl.BlockedLayout([1, HEAD_DIM // 32, 1], [1, 32, 1], [WARPS, 1, 1], [1, 2, 0])
        copy = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, load)))[:, None, None]
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, load)))[None, :, None]
        cols = gl.arange(0, NCOL, layout=gl.SliceLayout(0, gl.SliceLayout(1, load)))[None, None, :]
        mask = (cols < 2 * GROUP) & (dims >= 0) & (copy >= 0)
        q = gl.load(Q + b * stride_qb + (first_head + cols) * stride_qh + dims + copy * 0, mask=mask,
                    other=0.0).to(gl.float32)
        top = gl.max(gl.abs(q), axis=1)
        unit = (top.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True)
        unit = gl.where(unit > 0, unit, 1.0)
        scaled = gl.convert_layout((q / unit[:, None, :]).to(gl.float16), layout)
        return scaled, gl.convert_layout(unit, unit_layout)

    @gluon.jit
    def _row_pages(table, step, first, ctx, layout: gl.constexpr, WARPS: gl.constexpr, SLOT_PAGES: gl.constexpr):
        """Slot ``step``'s rows (page, token, head), [warps, rows / warps]: the block id of each (0 past the context),
        which lie in the context, and the rows' indices in the slot. The ids stay int32 until used: widened here, the
        widening would wait for the load at once."""
        WARP_ROWS: gl.constexpr = 2 * _PAGE * SLOT_PAGES // WARPS
        rows = (gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))[:, None] * WARP_ROWS
                + gl.arange(0, WARP_ROWS, layout=gl.SliceLayout(0, layout))[None, :])
        page_index = SLOT_PAGES * step + rows // (2 * _PAGE)
        valid = (first + page_index) * _PAGE + (rows // 2) % _PAGE < ctx
        return gl.load(table + page_index, mask=valid, other=0), valid, rows

    @gluon.jit
    def _row_scales(KScale, VScale, pages, kv_head, stride_sb, stride_st):
        """The per-token scales of K and V for the rows ``_row_pages`` described, in fp32, 0 past the context."""
        block, valid, rows = pages
        at = block.to(gl.int64) * stride_sb + (rows // 2) % _PAGE * stride_st + kv_head + rows % 2
        return (gl.load(KScale + at, mask=valid, other=0.0).to(gl.float32),
                gl.load(VScale + at, mask=valid, other=0.0).to(gl.float32), valid)

    @gluon.jit
    def _consumer(Q, KScale, VScale, O, Lse, k_smem, v_smem, full, empty, block_tables, context_lens, qk_scale,
                  num_splits, stride_qb, stride_qh, stride_bt, stride_sb, stride_st, stride_ob, stride_oh, stride_os,
                  stride_lb, stride_lh, GROUP: gl.constexpr, NCOL: gl.constexpr, HEAD_DIM: gl.constexpr,
                  WRITE_LSE: gl.constexpr, STAGES: gl.constexpr, SLOT_PAGES: gl.constexpr):
        """The consumer warps: attention over each slot the producer fills."""
        WARPS: gl.constexpr = gl.num_warps()
        WARP_ROWS: gl.constexpr = 2 * _PAGE * SLOT_PAGES // WARPS
        b = gl.program_id(0)
        kv_head = gl.program_id(1) * 2
        first_head = kv_head * GROUP
        ctx, first, n_pages = _split_range(b, context_lens, num_splits, SLOT_PAGES)
        table = block_tables + b * stride_bt + first  # the split's block ids
        n_steps = gl.cdiv(n_pages, SLOT_PAGES)

        # Each warp owns WARP_ROWS of a slot's rows, with a softmax of its own: products batched over the warps, so
        # that no step needs another warp's values (merged once, at the end).
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        rows_l: gl.constexpr = gl.SliceLayout(2, mma)  # [warps, WARP_ROWS]
        cols_l: gl.constexpr = gl.SliceLayout(1, mma)  # [warps, NCOL]
        # K's codes and Q four channels to a register (k_width 4); V and the weights two tokens.
        k_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        q_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        v_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # V read as int16 pairs of channels, transposed (ldmatrix.trans moves 16-bit elements): [warps, D / 2, rows].
        pairs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=v_smem.layout.swizzle_byte_width,
                                                          element_bitwidth=16, rank=3)

        q, q_unit = _query(Q, stride_qb, stride_qh, b, first_head, GROUP, NCOL, HEAD_DIM, q_op, cols_l, WARPS)
        cols = gl.arange(0, NCOL, layout=gl.SliceLayout(0, cols_l))
        col_scale = q_unit * qk_scale
        col_head = gl.where(cols < 2 * GROUP, cols // GROUP, -1)  # -1: a padding column meets no row
        row_head = gl.arange(0, WARP_ROWS, layout=gl.SliceLayout(0, rows_l)) % 2
        meets_head = gl.expand_dims(gl.expand_dims(row_head, 0), 2) == gl.expand_dims(gl.expand_dims(col_head, 0), 1)

        # K's codes come biased by 1152 (_biased_fp16): each score starts from -1152 * sum(q), by the same product.
        bias = gl.full([WARPS, WARP_ROWS, HEAD_DIM], _BIAS, gl.float16, layout=k_op)
        score_start = -mma_v2(bias, q, gl.zeros([WARPS, WARP_ROWS, NCOL], gl.float32, layout=mma))

        m_i = gl.full([WARPS, NCOL], float("-inf"), gl.float32, layout=cols_l)
        l_i = gl.zeros([WARPS, NCOL], gl.float32, layout=cols_l)
        v_unit = gl.zeros([WARPS, NCOL], gl.float32, layout=cols_l)  # the largest V scale met so far, per column
        # O^T in two halves, the even channels' and the odd channels' (how V's pairs come apart).
        acc_even = gl.zeros([WARPS, HEAD_DIM // 2, NCOL], gl.float32, layout=mma)
        acc_odd = gl.zeros([WARPS, HEAD_DIM // 2, NCOL], gl.float32, layout=mma)
        # The scales are loaded one step ahead and the block ids they need two, so that no step waits on memory for
        # them (a chain of two loads per step held the warps on the H200: figures/h200/sweeps/ncu_decode_gluon.json).
        first_pages = _row_pages(table, 0, first, ctx, rows_l, WARPS, SLOT_PAGES)
        k_scale, v_scale, valid = _row_scales(KScale, VScale, first_pages, kv_head, stride_sb, stride_st)
        pages = _row_pages(table, 1, first, ctx, rows_l, WARPS, SLOT_PAGES)
        for step in range(n_steps):
            next_scales = _row_scales(KScale, VScale, pages, kv_head, stride_sb, stride_st)
            pages = _row_pages(table, step + 2, first, ctx, rows_l, WARPS, SLOT_PAGES)

            slot = step % STAGES
            mbarrier.wait(full.index(slot), (step // STAGES) & 1)
            k_codes = k_smem.index(slot).reshape([WARPS, WARP_ROWS, HEAD_DIM]).load(k_op)
            v_pairs = reinterpret(v_smem.index(slot), gl.int16, [WARPS, WARP_ROWS, HEAD_DIM // 2], pairs_layout)
            v_pairs = v_pairs.permute((0, 2, 1)).load(v_op)
            warps_barrier()  # all four warps hold their rows: the slot may be refilled
            mbarrier.arrive(empty.index(slot), count=1)

            scores = mma_v2(_biased_fp16(k_codes), q, score_start)
            scores = scores * col_scale[:, None, :] * k_scale[:, :, None]
            meets = valid[:, :, None] & meets_head
            scores = gl.where(meets, scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)  # a column no row of the warp met yet
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - m_safe[:, None, :])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            # V's scales weigh the values, relative to the largest a column has met (the accumulators hold the output
            # over it), so that the weights stay in [0, 1]: fp16's range.
            v_new = gl.maximum(v_unit, gl.max(gl.where(meets, v_scale[:, :, None], 0.0), axis=1))
            v_safe = gl.where(v_new > 0, v_new, 1.0)
            p = (p * v_scale[:, :, None] * (1.0 / v_safe)[:, None, :]).to(gl.float16)
            # V's codes come biased by 1152 too: the accumulators start each step 1152 * sum(weights) lower.
            start = -_BIAS * gl.sum(p.to(gl.float32), axis=1)[:, None, :]
            p = gl.convert_layout(p, p_op)
            rescale = (alpha * gl.where(v_unit > 0, v_unit, 1.0) / v_safe)[:, None, :]
            v_even, v_odd = _biased_fp16_pairs(v_pairs)
            acc_even = mma_v2(v_even, p, acc_even * rescale + start)
            acc_odd = mma_v2(v_odd, p, acc_odd * rescale + start)
            v_unit = v_new
            m_i = m_new
            k_scale, v_scale, valid = next_scales

        # The warps' softmaxes merged (paged_attention.merge_attention_partials' algebra); an empty split ran no
        # step: l = 0, out 0 and lse -inf, as paged_attention's partials.
        m_all = gl.max(m_i, axis=0)
        m_all_safe = gl.where(m_all > float("-inf"), m_all, 0.0)
        weight = gl.exp2(m_i - m_all_safe[None, :])
        l_all = gl.sum(l_i * weight, axis=0)
        value_weight = (weight * v_unit)[:, None, :]
        store: gl.constexpr = gl.BlockedLayout([1, 2, 1], [HEAD_DIM // 4, 1, 32 // (HEAD_DIM // 4)], [1, 1, WARPS],
                                               [1, 0, 2])
        # [D / 2, NCOL] twice -> [D / 2, 2, NCOL]: channel 2m + j at [m, j].
        out = gl.convert_layout(gl.permute(gl.join(gl.sum(acc_even * value_weight, axis=0),
                                                   gl.sum(acc_odd * value_weight, axis=0)), (0, 2, 1)), store)
        l_out = gl.convert_layout(l_all, gl.SliceLayout(0, gl.SliceLayout(1, store)))
        out = out / gl.where(l_out > 0, l_out, 1.0)[None, None, :]
        pairs = gl.arange(0, HEAD_DIM // 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, store)))[:, None, None]
        halves = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, store)))[None, :, None]
        out_cols = gl.arange(0, NCOL, layout=gl.SliceLayout(0, gl.SliceLayout(1, store)))[None, None, :]
        split = gl.program_id(2)
        o_ptrs = O + b * stride_ob + (first_head + out_cols) * stride_oh + split * stride_os + 2 * pairs + halves
        gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(out_cols < 2 * GROUP) & (pairs >= 0) & (halves >= 0))
        if WRITE_LSE:
            nonempty = l_all > 0
            lse = gl.where(nonempty, (m_all + gl.log2(gl.where(nonempty, l_all, 1.0))) * _LN2, float("-inf"))
            gl.store(Lse + b * stride_lb + (first_head + cols) * stride_lh + split, lse, mask=cols < 2 * GROUP)

    @gluon.jit
    def kv_ring(k_desc, v_desc, shape: gl.constexpr):
        """The ring of slots the producer fills with K and V codes (int8, [STAGES, ...] = ``shape``, laid out as the
        descriptors' boxes) and its mbarriers, one "full" and one "empty" a slot, initialised for one arrival each."""
        k_smem = gl.allocate_shared_memory(gl.int8, shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.int8, shape, v_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [shape[0], 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [shape[0], 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(shape[0]):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        return k_smem, v_smem, full, empty

    # As paged_attention's _split_kernel: arguments that change with the batch are not specialised, so that a new
    # split count or table width does not compile a new variant mid-run.
    @gluon.jit(do_not_specialize=["num_splits", "stride_bt", "stride_ob", "stride_oh", "stride_os", "stride_lb",
                                  "stride_lh"])
    def _int8_decode_kernel(Q, k_desc, v_desc, KScale, VScale, O, Lse, block_tables, context_lens,
                            qk_scale, num_splits, stride_qb, stride_qh, stride_bt, stride_sb, stride_st,
                            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                            GROUP: gl.constexpr, NCOL: gl.constexpr, HEAD_DIM: gl.constexpr,
                            WRITE_LSE: gl.constexpr, STAGES: gl.constexpr, SLOT_PAGES: gl.constexpr):
        k_smem, v_smem, full, empty = kv_ring(k_desc, v_desc, [STAGES, SLOT_PAGES * _PAGE, 2, HEAD_DIM])
        gl.warp_specialize([
            (_consumer, (Q, KScale, VScale, O, Lse, k_smem, v_smem, full, empty, block_tables, context_lens, qk_scale,
                         num_splits, stride_qb, stride_qh, stride_bt, stride_sb, stride_st, stride_ob, stride_oh,
                         stride_os, stride_lb, stride_lh, GROUP, NCOL, HEAD_DIM, WRITE_LSE, STAGES, SLOT_PAGES)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, full, empty, block_tables, stride_bt, context_lens,
                         num_splits, STAGES, SLOT_PAGES)),
        ], [1], [_LOADER_REGS])


def columns(group: int) -> int:
    """The products' columns: both heads' query heads (2 x group), padded to a power of two of at least 8 (m16n8k16's
    N)."""
    return max(8, 1 << (2 * group - 1).bit_length())


def pool_descriptor(pool: torch.Tensor) -> TensorDescriptor:
    """The int8 pool [blocks, 16, kv_heads, head_dim] seen as [blocks * 16, kv_heads, head_dim], loaded one page of
    two heads, [16, 2, head_dim], at a time."""
    blocks, page, kv_heads, dim = pool.shape
    box = [page, HEADS_PER_PROGRAM, dim]
    return TensorDescriptor(pool, [blocks * page, kv_heads, dim], [kv_heads * dim, dim, 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, gl.int8))


def int8_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, partial: torch.Tensor,
                lse: torch.Tensor, partial_strides: tuple[int, int, int], lse_strides: tuple[int, int],
                num_splits: int, qk_scale: float, stages: int = STAGES, max_registers: int | None = MAX_REGISTERS,
                warps: int = CONSUMER_WARPS, slot_pages: int = SLOT_PAGES) -> None:
    """Launch on inputs that ``paged_decode_attention`` checked and ``unsupported`` accepted: writes ``partial``
    (the output itself when num_splits == 1) and, with splits, ``lse``. ``qk_scale`` is the softmax scale times
    log2(e). ``stages``, ``max_registers`` (per thread at launch), ``warps`` (the consumers') and ``slot_pages`` are for
    sweeps."""
    rows = 2 * PAGE * slot_pages // warps  # a consumer warp's rows a step: a whole number of m16 tiles, even pages
    if ID_CHUNK % slot_pages or rows % 16 or stages < 1:
        raise ValueError(f"slot_pages must divide {ID_CHUNK} and give each of the {warps} consumer warps a multiple "
                         f"of 16 rows (2 x 16 x slot_pages / warps), and stages must be >= 1; got slot_pages="
                         f"{slot_pages}, warps={warps}, stages={stages}")
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    _int8_decode_kernel[(batch, kv_heads // HEADS_PER_PROGRAM, num_splits)](
        q, pool_descriptor(k_cache), pool_descriptor(v_cache), k_scale, v_scale, partial, lse, block_tables,
        context_lens, qk_scale, num_splits, q.stride(0), q.stride(1), block_tables.stride(0),
        k_scale.stride(0), k_scale.stride(1), *partial_strides, *lse_strides,
        GROUP=group, NCOL=columns(group), HEAD_DIM=dim, WRITE_LSE=num_splits > 1,
        STAGES=stages, SLOT_PAGES=slot_pages, num_warps=warps, maxnreg=max_registers)
