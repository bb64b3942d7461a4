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
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, v_full, kv_empty, m_start, n_blocks,
            HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m_start, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [m_start + HALF_M, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh barrier's "previous phase" is done
        mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_full.index(slot), k_smem.index(slot))
        mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_full.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(half, q_smem, k_smem, v_smem, q_bar, k_full, v_full, kv_empty, turns, Out, stride_ot, stride_oh, h,
              q_start, q_len, k_len, diag, m_start, n_blocks, unmasked_end, qk_scale, HEAD_DIM: gl.constexpr,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    my_turn = turns.index(half)
    their_turn = turns.index(1 - half)
    row0 = m_start + half * HALF_M
    offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(half)
    mbarrier.wait(q_bar, 0)

    mbarrier.wait(k_full.index(0), 0)
    mbarrier.wait(my_turn, 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    if unmasked_end <= 0:
        s = _mask(s, 0, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    p = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_full.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_full.index(prev), ((j - 1) // STAGES) & 1)
        mbarrier.wait(my_turn, j & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        if j * BLOCK_N >= unmasked_end:
            s = _mask(s, j * BLOCK_N, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(p.to(dtype), p_layout)
        acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_full.index(last), ((n_blocks - 1) // STAGES) & 1)
    mbarrier.wait(my_turn, n_blocks & 1)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.expand_dims(l_o, 1)
    rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = (Out + (q_start + gl.expand_dims(rows, 1)).to(gl.int64) * stride_ot + h * stride_oh
            + gl.expand_dims(cols, 0))
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def hopper_attention_kernel(Q, K, V, Out, cu_seqlens_q, cu_seqlens_k, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_ot, stride_oh, num_heads, num_kv_heads, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    HALF_M: gl.constexpr = BLOCK_M // 2
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    b = gl.program_id(1) // num_heads
    h = gl.program_id(1) % num_heads
    kv_h = h // (num_heads // num_kv_heads)
    q_start = gl.load(cu_seqlens_q + b)
    q_len = gl.load(cu_seqlens_q + b + 1) - q_start
    k_start = gl.load(cu_seqlens_k + b)
    k_len = gl.load(cu_seqlens_k + b + 1) - k_start
    m_start = tile * BLOCK_M
    if m_start < q_len:
        dtype: gl.constexpr = Q.dtype.element_ty
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_DIM], dtype)
        kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_desc = tma.make_tensor_descriptor(Q + q_start.to(gl.int64) * stride_qt + h * stride_qh,
                                            shape=[q_len, HEAD_DIM], strides=[stride_qt, 1],
                                            block_shape=[HALF_M, HEAD_DIM], layout=q_shared)
        k_rows = gl.maximum(k_len, 1)
        k_desc = tma.make_tensor_descriptor(K + k_start.to(gl.int64) * stride_kt + kv_h * stride_kh,
                                            shape=[k_rows, HEAD_DIM], strides=[stride_kt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=kv_shared)
        v_desc = tma.make_tensor_descriptor(V + k_start.to(gl.int64) * stride_vt + kv_h * stride_vh,
                                            shape=[k_rows, HEAD_DIM], strides=[stride_vt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=kv_shared)
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_shared)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        mbarrier.init(turns.index(0), count=1)
        mbarrier.init(turns.index(1), count=1)
        fence_async_shared()
        mbarrier.arrive(turns.index(0), count=1)  # the first half issues its products first

        diag = k_len - q_len
        if CAUSAL:
            hi = gl.minimum(m_start + BLOCK_M + diag, k_len)
            unmasked_end = gl.maximum(m_start + diag + 1, 0) // BLOCK_N * BLOCK_N
        else:
            hi = k_len
            unmasked_end = k_len // BLOCK_N * BLOCK_N
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_full, v_full, kv_empty, turns, Out, stride_ot, stride_oh, h,
                         q_start, q_len, k_len, diag, m_start, n_blocks, unmasked_end, qk_scale, HEAD_DIM, HALF_M,
                         BLOCK_N, STAGES, CAUSAL)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_full, v_full, kv_empty, turns, Out, stride_ot, stride_oh, h,
                         q_start, q_len, k_len, diag, m_start, n_blocks, unmasked_end, qk_scale, HEAD_DIM, HALF_M,
                         BLOCK_N, STAGES, CAUSAL)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, v_full, kv_empty, m_start,
                       n_blocks, HALF_M, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])
