"""FlashAttention-3's structure for Hopper (sm_90), in Gluon: the prefill kernel ``flash_attention`` runs
on an H100/H200 for bf16 and fp16 with head_dim 64 or 128.

Why it exists: the Triton kernel (``../flash_attention.py``) reaches about 75 % of cuDNN's attention on
the H200 (figures/h200/prefill_tma.json). What it cannot say in ``tl.dot``'s language is how
FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, 2024, https://arxiv.org/abs/2407.08608)
keeps Hopper's tensor cores busy. Gluon, Triton's explicit-layout dialect
(``triton.experimental.gluon``), can: its programs name the shared-memory buffers, the mbarriers, the
asynchronous warpgroup matrix products (wgmma) and which warps run what. The design, and why:

- **Warp specialization.** One producer warp only issues TMA copies of Q, K and V into a ring of
  ``STAGES`` shared-memory slots; an mbarrier per slot says "full" (the copy landed) and another
  "empty" (every consumer is done with it). Three consumer warpgroups only compute. No thread of
  theirs spends an instruction on an address. Registers are moved from the producer to the
  consumers (``setmaxnreg``, via ``warp_specialize``'s register counts).
- **Persistent.** One program per SM walks the tiles, the longest (latest rows of a causal
  sequence) first, so the short tiles fill in at the end.
- **A 192-row tile, 64 rows per consumer, 64 keys per block.** Each consumer stops at its own last
  visible block and masks only its own diagonal blocks. 64-key blocks keep a consumer's registers
  (output 64 + scores 32 + weights 16 + Q 32 per thread) within the 160 that three warpgroups can
  have each.
- **Q in registers.** A 64x64x16 wgmma with both operands in shared memory reads 4 KB per 32
  tensor-core cycles: the SM's whole shared-memory bandwidth (128 B/clk). With Q as the register
  operand only K is read.
- **Register operands live until their wait.** wgmma reads its register operand after it is issued,
  and it is the program's job to keep that value alive until the product is retired:
  ``warpgroup_mma_wait(deps=...)`` returns its dependencies, so threading Q and P through the wait
  makes each trip's Q the wait's output, which ptxas keeps in registers of its own and copies into
  the operand's before each product. Without it, Triton 3.6's toolchain (the H200's) reused Q's
  registers for the softmax and P at head_dim 64, and the output was wrong.
- **Tiles aligned to the end of each sequence.** 2048 rows are not a multiple of 192. Tiles from
  row 0 leave the last tile's third part all padding (rows 2048..2111), and causally it would still
  see every key: 6 % more work. Tiles aligned to the end put the padding before row 0, where it sees
  no key and is skipped. TMA zero-fills rows outside the tensor, negative ones too.

Measured on the H200 (figures/h200/kernels_prefill.json, ``minillm bench kernels --only prefill``): 86 % of
cuDNN's TFLOP/s at B=8, H=32, S=2048, D=128 causal (86-88 % in three runs); the Triton kernel reaches 75 % there
(figures/h200/prefill_tma.json).

Causal masking is bottom-right aligned (query i sees keys j <= i + k_len - q_len), as in
``../flash_attention.py``; rows outside a sequence are computed over zeros or a neighbour's rows and
never stored. Not under Triton's interpreter (Gluon has none): its tests run on an sm_90 GPU, and on
the CPU the kernel is compiled for sm_90 and its loops are checked: pipelined, Q kept (tests/test_hopper_sass.py).
"""

from __future__ import annotations

import torch

import triton

from ..checks import num_sms
from .tma import not_describable

from .gluon import GLUON_USABLE, MIN_TRITON, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon import tma_load

PART_M = 64  # query rows per consumer warpgroup: one wgmma's M
CONSUMERS = 3
BLOCK_M = CONSUMERS * PART_M
BLOCK_N = 64
STAGES = 4
CONSUMER_REGS = 160  # per thread, for the two worker consumers; the default partition gets the rest (168)
LOADER_REGS = 24
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why this kernel cannot run ``flash_attention``'s inputs, or None if it can."""
    if not GLUON_USABLE:
        return f"it is written in Gluon for Triton >= {'.'.join(map(str, MIN_TRITON))}, not {triton.__version__}"
    if q.dtype not in DTYPES:
        return f"it takes {DTYPES}, not {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"it takes head_dim in {HEAD_DIMS}, not {q.shape[-1]}"
    if k.shape[0] == 0:
        return "k holds no tokens (a TMA descriptor needs at least one row)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        # One TMA descriptor over [tokens, heads * head_dim] serves every head: the heads must be packed.
        reason = not_describable(name, t) or (t.stride(1) != t.shape[2] and f"{name} has strides {t.stride()}; "
                                                                            "its heads must be packed")
        if reason:
            return reason
    if out.stride(2) != 1:
        return f"out has strides {out.stride()}; it needs a contiguous last dim"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "it needs an sm_90 GPU (H100/H200)"
    return None


if gluon is not None:
    # The shape constants as constexprs, which is how Gluon code may read globals.
    _PART_M, _CONSUMERS, _BLOCK_M = gl.constexpr(PART_M), gl.constexpr(CONSUMERS), gl.constexpr(BLOCK_M)
    _BLOCK_N, _STAGES = gl.constexpr(BLOCK_N), gl.constexpr(STAGES)
    _CONSUMER_REGS, _LOADER_REGS = gl.constexpr(CONSUMER_REGS), gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _tile(t, schedule, CAUSAL: gl.constexpr):
        """Tile t of the schedule, the same for producer and consumers: tile index m counts from each
        sequence's end (the longest tiles of every head first), and rows start at q_len - (m + 1) * BLOCK_M."""
        cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total = schedule
        m_tile = t // n_heads_total
        bh = t % n_heads_total
        b = bh // num_heads
        h = bh % num_heads
        kv_h = h // (num_heads // num_kv_heads)
        q_start = gl.load(cu_seqlens_q + b)
        q_len = gl.load(cu_seqlens_q + b + 1) - q_start
        k_start = gl.load(cu_seqlens_k + b)
        k_len = gl.load(cu_seqlens_k + b + 1) - k_start
        has_tile = m_tile < gl.cdiv(q_len, _BLOCK_M)
        m_start = q_len - (m_tile + 1) * _BLOCK_M
        diag = k_len - q_len
        if CAUSAL:
            n_blocks = gl.cdiv(gl.minimum(m_start + _BLOCK_M + diag, k_len), _BLOCK_N)
        else:
            n_blocks = gl.cdiv(k_len, _BLOCK_N)
        return has_tile, h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, n_blocks  # 0 if no keys

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, shared, schedule, n_tiles, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr):
        """The producer warp: each tile's three Q parts, then its K/V blocks into the ring of slots."""
        q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty = shared
        kv_step = 0  # K/V blocks loaded so far: slot kv_step % STAGES, its round kv_step // STAGES
        tiles_done = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            has_tile, h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, n_blocks = _tile(t, schedule, CAUSAL)
            if has_tile:
                mbarrier.wait(q_empty, (tiles_done & 1) ^ 1)
                mbarrier.expect(q_full, _CONSUMERS * q_desc.block_type.nbytes)
                for c in gl.static_range(_CONSUMERS):
                    tma_load(q_desc, [q_start + m_start + c * _PART_M, h * HEAD_DIM], q_full, q_smem.index(c))
                for j in range(n_blocks):
                    slot = kv_step % _STAGES
                    mbarrier.wait(kv_empty.index(slot), ((kv_step // _STAGES) & 1) ^ 1)
                    mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
                    tma_load(k_desc, [k_start + j * _BLOCK_N, kv_h * HEAD_DIM], k_full.index(slot), k_smem.index(slot))
                    mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
                    tma_load(v_desc, [k_start + j * _BLOCK_N, kv_h * HEAD_DIM], v_full.index(slot), v_smem.index(slot))
                    kv_step += 1
                tiles_done += 1

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale):
        """One block of the online softmax in base 2 (``../flash_attention.py`` explains it): weights p, the
        factor alpha that rescales what was accumulated, and the new running max and sum."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _mask(s, start, rows, k_len, diag, s_layout: gl.constexpr, CAUSAL: gl.constexpr):
        """Scores of keys past the end, or (causal) past a row's diagonal, to -inf."""
        cols = start + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < k_len, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + diag)
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _consumer(part, shared, schedule, n_tiles, Out, stride_ot, stride_oh, qk_scale, HEAD_DIM: gl.constexpr,
                  CAUSAL: gl.constexpr):
        """Consumer warpgroup ``part``: rows [part * 64, part * 64 + 64) of every tile."""
        q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty = shared
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, _BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_zero = gl.zeros([_PART_M, _BLOCK_N], gl.float32, layout=s_layout)
        kv_step = 0
        tiles_done = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            has_tile, h, kv_h, q_start, q_len, k_start, k_len, m_start, diag, n_blocks = _tile(t, schedule, CAUSAL)
            if has_tile:
                row0 = m_start + part * _PART_M
                rows = row0 + gl.arange(0, _PART_M, layout=gl.SliceLayout(1, s_layout))
                # The blocks this part's rows see, and the first that needs a mask. The slots of later
                # blocks (the other parts' diagonals) are still waited for and released, in order.
                if CAUSAL:
                    my_blocks = gl.cdiv(gl.minimum(row0 + _PART_M + diag, k_len), _BLOCK_N)
                    first_masked = gl.minimum(gl.maximum(row0 + diag + 1, 0), k_len) // _BLOCK_N * _BLOCK_N
                else:
                    my_blocks = gl.cdiv(k_len, _BLOCK_N)
                    first_masked = k_len // _BLOCK_N * _BLOCK_N
                if row0 + _PART_M <= 0:  # padding rows before the sequence (tiles are aligned to its end)
                    my_blocks = 0
                mbarrier.wait(q_full, tiles_done & 1)
                q = q_smem.index(part).load(q_layout)
                mbarrier.arrive(q_empty, count=1)  # Q lives in registers now: the next tile's may load
                tiles_done += 1
                m_i = gl.full([_PART_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
                l_i = gl.zeros([_PART_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
                acc = gl.zeros([_PART_M, HEAD_DIM], gl.float32, layout=o_layout)
                for j in range(n_blocks):
                    slot = kv_step % _STAGES
                    phase = (kv_step // _STAGES) & 1
                    mbarrier.wait(k_full.index(slot), phase)
                    if j < my_blocks:
                        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                          is_async=True)
                        s, q = warpgroup_mma_wait(0, deps=(s, q))  # Q live until the product is retired
                        if j * _BLOCK_N >= first_masked:
                            s = _mask(s, j * _BLOCK_N, rows, k_len, diag, s_layout, CAUSAL)
                        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                        p = gl.convert_layout(p.to(dtype), p_layout)
                        mbarrier.wait(v_full.index(slot), phase)
                        acc = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
                        acc, p = warpgroup_mma_wait(0, deps=(acc, p))  # and P likewise
                    else:
                        mbarrier.wait(v_full.index(slot), phase)
                    mbarrier.arrive(kv_empty.index(slot), count=1)
                    kv_step += 1
                out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
                out_rows = row0 + gl.arange(0, _PART_M, layout=gl.SliceLayout(1, o_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                ptrs = (Out + (q_start + gl.expand_dims(out_rows, 1)).to(gl.int64) * stride_ot + h * stride_oh
                        + gl.expand_dims(cols, 0))
                stored = (out_rows >= 0) & (out_rows < q_len)  # not the padding, nor a neighbour's rows
                gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(stored, 1))

    @gluon.jit
    def _hopper_attention_kernel(q_desc, k_desc, v_desc, Out, cu_seqlens_q, cu_seqlens_k, stride_ot, stride_oh,
                                 num_heads, num_kv_heads, n_heads_total, n_tiles, qk_scale,
                                 HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr):
        """The shared memory (Q's three parts, STAGES K/V slots) and its mbarriers, then the four partitions:
        consumers 0-2 (consumer 0 runs in the kernel's own four warps) and the producer warp."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, _PART_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [_STAGES, _BLOCK_N, HEAD_DIM], v_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full, count=1)
        mbarrier.init(q_empty, count=_CONSUMERS)
        for i in gl.static_range(_STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=_CONSUMERS)
        fence_async_shared()
        shared = (q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, kv_empty)
        schedule = (cu_seqlens_q, cu_seqlens_k, num_heads, num_kv_heads, n_heads_total)
        gl.warp_specialize([
            (_consumer, (0, shared, schedule, n_tiles, Out, stride_ot, stride_oh, qk_scale, HEAD_DIM, CAUSAL)),
            (_consumer, (1, shared, schedule, n_tiles, Out, stride_ot, stride_oh, qk_scale, HEAD_DIM, CAUSAL)),
            (_consumer, (2, shared, schedule, n_tiles, Out, stride_ot, stride_oh, qk_scale, HEAD_DIM, CAUSAL)),
            (_loader, (q_desc, k_desc, v_desc, shared, schedule, n_tiles, HEAD_DIM, CAUSAL)),
        ], [4, 4, 1], [_CONSUMER_REGS, _CONSUMER_REGS, _LOADER_REGS])


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor over ``t`` [tokens, heads, head_dim] seen as [tokens, heads * head_dim], loading
    [rows, head_dim] boxes: one head of ``rows`` consecutive tokens."""
    tokens, heads, dim = t.shape
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor(t, [tokens, heads * dim], [t.stride(0), 1], [rows, dim],
                            gl.NVMMASharedLayout.get_default_for([rows, dim], element))


def hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, causal: bool,
                     qk_scale: float) -> torch.Tensor:
    """Launch on inputs that ``flash_attention`` checked and ``unsupported`` accepted; writes ``out``. ``qk_scale``
    is the softmax scale times log2(e) (the kernel's softmax is in base 2)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    n_heads_total = (cu_seqlens_q.shape[0] - 1) * heads
    n_tiles = -(-max_seqlen_q // BLOCK_M) * n_heads_total
    if n_tiles <= 0 or q.shape[0] == 0:  # nothing to attend (and no rows to describe)
        return out
    sms = num_sms(q.device)
    _hopper_attention_kernel[(min(n_tiles, sms),)](
        _descriptor(q, PART_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, cu_seqlens_q, cu_seqlens_k,
        out.stride(0), out.stride(1), heads, kv_heads, n_heads_total, n_tiles, qk_scale,
        HEAD_DIM=dim, CAUSAL=causal, num_warps=4)
    return out

