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
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, block, slot, pred, BLOCK_N: gl.constexpr):
    mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(k_desc, [block * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot), pred)
    mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(v_desc, [block * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot), pred)


@gluon.jit
def hopper_attention_kernel(Q, K, V, Out, cu_seqlens_q, cu_seqlens_k, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_ot, stride_oh, num_heads, num_kv_heads, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr):
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
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                            instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

        q_desc = tma.make_tensor_descriptor(Q + q_start.to(gl.int64) * stride_qt + h * stride_qh,
                                            shape=[q_len, HEAD_DIM], strides=[stride_qt, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM], layout=q_shared)
        k_rows = gl.maximum(k_len, 1)  # a descriptor needs a row; rows past k_len are masked
        k_desc = tma.make_tensor_descriptor(K + k_start.to(gl.int64) * stride_kt + kv_h * stride_kh,
                                            shape=[k_rows, HEAD_DIM], strides=[stride_kt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=kv_shared)
        v_desc = tma.make_tensor_descriptor(V + k_start.to(gl.int64) * stride_vt + kv_h * stride_vh,
                                            shape=[k_rows, HEAD_DIM], strides=[stride_vt, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM], layout=kv_shared)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_shared)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_shared)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        fence_async_shared()

        diag = k_len - q_len
        if CAUSAL:
            hi = gl.minimum(m_start + BLOCK_M + diag, k_len)
            unmasked_end = gl.maximum(m_start + diag + 1, 0) // BLOCK_N * BLOCK_N
        else:
            hi = k_len
            unmasked_end = k_len // BLOCK_N * BLOCK_N
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m_start, 0], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, i, i < n_blocks, BLOCK_N)

        offs_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        # Block 0: its scores, then its weights.
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        if unmasked_end <= 0:
            s = _mask(s, 0, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_blocks):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            # Issue block j's scores and block j-1's weighted values together; the softmax of block j
            # then runs while the tensor cores still work on the values.
            mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
            mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            if j * BLOCK_N >= unmasked_end:
                s = _mask(s, j * BLOCK_N, offs_m, k_len, diag, s_layout, BLOCK_N, CAUSAL)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            p = gl.convert_layout(p.to(dtype), p_layout)
            # The weights pass through the wait as operands: the compiler may not hoist the wait above
            # the softmax that is meant to run under the matrix product.
            acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            gl.thread_barrier()  # every warp is done with slot prev before TMA refills it
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, j - 1 + STAGES, prev,
                     j - 1 + STAGES < n_blocks, BLOCK_N)

        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_bars.index(last), ((n_blocks - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / gl.expand_dims(l_o, 1)
        rows = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = (Out + (q_start + gl.expand_dims(rows, 1)).to(gl.int64) * stride_ot + h * stride_oh
                + gl.expand_dims(cols, 0))
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < q_len, 1))
