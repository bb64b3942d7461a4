import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _mask(s, start, offs_m, k_len, diag, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    visible = gl.expand_dims(offs_n < k_len, 0)
    if CAUSAL:
        visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1) + diag)
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _tile(t, n_heads_total, num_heads, num_kv_heads, cu_seqlens_q, cu_seqlens_k, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile t of the schedule: the longest tiles of every head first."""
    m_tile = t // n_heads_total
    bh = t % n_heads_total
    b = bh // num_heads
    h = bh % num_heads
    kv_h = h // (num_heads // num_kv_heads)
    q_start = gl.load(cu_seqlens_q + b)
    q_len = gl.load(cu_seqlens_q + b + 1) - q_start
    k_start = gl.load(cu_seqlens_k + b)
    k_len = gl.load(cu_seqlens_k + b + 1) - k_start
    m_start = (gl.cdiv(q_len, BLOCK_M) - 1 - m_tile) * BLOCK_M  # negative: this sequence has no such tile
    diag = k_len - q_len
    if CAUSAL:
        hi = gl.minimum(m_start + BLOCK_M + diag, k_len)
        unmasked_end = gl.maximum(m_start + diag + 1, 0) // BLOCK_N * BLOCK_N
    else:
        hi = k_len
        unmasked_end = k_len // BLOCK_N * BLOCK_N
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    return h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, unmasked_end, n_blocks


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty,
            cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, HEAD_DIM: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    PART_M: gl.constexpr = 64
    CONSUMERS: gl.constexpr = BLOCK_M // PART_M
    it = 0
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, unmasked_end, n_blocks = _tile(
            t, n_heads_total, num_heads, num_kv_heads, cu_seqlens_q, cu_seqlens_k, BLOCK_M, BLOCK_N, CAUSAL)
        if m_start >= 0:
            mbarrier.wait(q_empty, (done & 1) ^ 1)
            mbarrier.expect(q_full, CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [q_start + m_start + c * PART_M, h * HEAD_DIM], q_full,
                                                q_smem.index(c))
            for j in range(n_blocks):
                slot = it % STAGES
                mbarrier.wait(kv_empty.index(slot), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [k_start + j * BLOCK_N, kv_h * HEAD_DIM], k_full.index(slot),
                                                k_smem.index(slot))
                mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [k_start + j * BLOCK_N, kv_h * HEAD_DIM], v_full.index(slot),
                                                v_smem.index(slot))
                it += 1
            done += 1


@gluon.jit
def _consumer(half, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
              cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, Q_IN_REGS: gl.constexpr, ARRIVE_MODE: gl.constexpr = 0):
    HALF_M: gl.constexpr = 64
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_init = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q_smem_half = q_smem.index(half)
    it = 0
    done = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, unmasked_end, n_blocks = _tile(
            t, n_heads_total, num_heads, num_kv_heads, cu_seqlens_q, cu_seqlens_k, BLOCK_M, BLOCK_N, CAUSAL)
        if m_start >= 0:
            row0 = m_start + half * HALF_M
            offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
            m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
            mbarrier.wait(q_full, done & 1)
            if Q_IN_REGS:  # Q as the product's register operand: shared memory then only feeds K
                q = q_smem_half.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
            else:
                q = q_smem_half
            # This part's rows see keys below my_end only: later blocks are all masked for it. It still
            # waits for them (in order) and releases them, so the slots' release counts stay per block.
            if CAUSAL:
                my_end = gl.minimum(row0 + HALF_M + diag, k_len)
            else:
                my_end = k_len
            my_blocks = gl.maximum(gl.cdiv(my_end, BLOCK_N), 1)
            # FA3's order within the part: block j's scores and block j-1's weighted values are issued
            # together, and block j's softmax runs while the values are multiplied.
            it0 = it
            mbarrier.wait(k_full.index(it0 % STAGES), (it0 // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(it0 % STAGES).permute((1, 0)), s_init, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            if unmasked_end <= 0:
                s = _mask(s, 0, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
            p32, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            p = gl.convert_layout(p32.to(dtype), p_layout)
            for j in range(1, my_blocks):
                cur = it0 + j
                prev = cur - 1
                mbarrier.wait(k_full.index(cur % STAGES), (cur // STAGES) & 1)
                s_tok = warpgroup_mma(q, k_smem.index(cur % STAGES).permute((1, 0)), s_init, use_acc=False,
                                      is_async=True)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                mbarrier.wait(v_full.index(prev % STAGES), (prev // STAGES) & 1)
                o_tok = warpgroup_mma(p, v_smem.index(prev % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                if j * BLOCK_N >= unmasked_end:
                    s = _mask(s, j * BLOCK_N, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
                p32, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
                if ARRIVE_MODE == 3:
                    # Always true (j < my_blocks): a branch, so that ptxas cannot schedule the wait above the softmax
                    if k_len > j * BLOCK_N:
                        acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                        mbarrier.arrive(kv_empty.index(prev % STAGES), count=1)
                else:
                    acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                if ARRIVE_MODE == 0:
                    mbarrier.arrive(kv_empty.index(prev % STAGES), count=1)
                p = gl.convert_layout(p32.to(dtype), p_layout)
                if ARRIVE_MODE == 2:
                    mbarrier.arrive(kv_empty.index(prev % STAGES), count=1)
            last = it0 + my_blocks - 1
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            mbarrier.wait(v_full.index(last % STAGES), (last // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
            for j in range(my_blocks, n_blocks):  # blocks wholly above this part's diagonal
                skip = it0 + j
                mbarrier.wait(k_full.index(skip % STAGES), (skip // STAGES) & 1)
                mbarrier.wait(v_full.index(skip % STAGES), (skip // STAGES) & 1)
                mbarrier.arrive(kv_empty.index(skip % STAGES), count=1)
            it = it0 + n_blocks
            mbarrier.arrive(q_empty, count=1)
            done += 1
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            out = acc / gl.expand_dims(l_o, 1)
            rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = (Out + (q_start + gl.expand_dims(rows, 1)).to(gl.int64) * stride_ot + h * stride_oh
                    + gl.expand_dims(cols, 0))
            gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def hopper_attention_kernel(q_desc, k_desc, v_desc, Out, cu_seqlens_q, cu_seqlens_k, stride_ot, stride_oh, num_heads,
                            num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, Q_IN_REGS: gl.constexpr = False, ARRIVE_MODE: gl.constexpr = 0):
    HALF_M: gl.constexpr = 64
    CONSUMERS: gl.constexpr = BLOCK_M // HALF_M
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
                             cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, Q_IN_REGS, ARRIVE_MODE)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
                             cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, Q_IN_REGS, ARRIVE_MODE)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty,
                       cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, HEAD_DIM, BLOCK_M,
                       BLOCK_N, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
                             cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, Q_IN_REGS, ARRIVE_MODE)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
                             cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM,
                             BLOCK_M, BLOCK_N, STAGES, CAUSAL, Q_IN_REGS, ARRIVE_MODE)),
            (_consumer, (2, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty, Out, stride_ot, stride_oh,
                         cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale, HEAD_DIM,
                         BLOCK_M, BLOCK_N, STAGES, CAUSAL, Q_IN_REGS, ARRIVE_MODE)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty,
                       cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total, n_tiles, HEAD_DIM, BLOCK_M,
                       BLOCK_N, STAGES, CAUSAL)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
