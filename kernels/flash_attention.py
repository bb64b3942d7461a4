"""FlashAttention-2 forward in Triton: prefill attention over a packed batch, from contiguous K/V or
from the paged KV cache.

Why it exists: the torch backend materialises every [q_len, k_len] score matrix in memory; this
kernel never does. It follows FlashAttention-2 (Tri Dao, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", 2023). The facts it rests on:

- softmax can be computed *online*: keep a running row maximum m and row sum l, and when a new block
  of scores raises the maximum from m to m', rescale what was accumulated by exp(m - m'). So K/V can
  be streamed block by block while the output tile stays in registers (fp32);
- each program owns one tile of BLOCK_M query rows of one head (FA-2's split over queries: no
  communication between programs) and divides by l once, at the end (FA-2's deferred rescaling);
- exp(x) = exp2(x * log2 e), and exp2 is the GPU's native instruction, so the softmax scale and
  log2 e are folded into one multiplier of the scores;
- with causal masking, key blocks wholly below the diagonal need no mask at all: they run in a loop
  without one, and only the few blocks that cross the diagonal (or the end of the keys) pay for it;
- grouped-query attention (GQA) shares one K/V head among H // Hkv query heads: query head h reads
  KV head h // (H // Hkv), so K/V are never copied per query head.

Causal masking is bottom-right aligned, as when new tokens follow a cached prefix: in a sequence of
q_len queries and k_len keys, query i sees keys j <= i + (k_len - q_len). That needs k_len >= q_len;
a query that sees no key at all comes out NaN, as in the reference.

``head_dim`` must be a power of two from 16 to 256 (every Llama-family model's is); anything else
raises a ValueError rather than paying for padded, masked loads on every block.

On CUDA the block sizes of fp16/bf16 runs are autotuned (keyed on head dim, causal, layout and
dtype); fp32 runs use exact fp32 dots (not TF32) and one small pinned config, as does Triton's CPU
interpreter, to keep compile times and tests short. ``config=`` pins one, e.g. for benchmarks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES as DTYPES
from .checks import check as _check
from .checks import check_runnable, interpreter_on
from .hopper import flash_attention as hopper
from .kv_dequant import (INT4_GROUPS, NO_QUANT, PER_TOKEN, dequant_int4, dequantize_as_kernels_do,
                                        kv_quant_mode, per_token_codes, per_token_rows, per_token_scales,
                                        scale_heads, scale_strides)
from .kv_formats import INT4_GROUP_SIZE

INTERPRET = interpreter_on()
LOG2E = 1.4426950408889634

# Small on purpose: every config is compiled and timed the first time a key is seen. Picked from a
# wider sweep on the H200 (bf16, D=128): 128x128 tiles with 8 warps led for contiguous K/V,
# 128x64 with 4 warps for the paged gather; stage counts other than 3 never won.
GPU_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3)]
]
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16}
# fp32 dots are exact ("ieee"), so they run on FMA units rather than tensor cores: big tiles take
# tens of seconds each to compile. fp32 on a GPU is for correctness checks, so it gets one small tile.
GPU_FP32_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, offs_m, lo, hi, k_len, diag, K, V, KScale, VScale, k_start, table,
                   stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, stride_sb, stride_st, kv_h,
                   stride_sh, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                   KV_QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr, SCALE_HEADS: tl.constexpr):
    """Fold keys [lo, hi) into the running (acc, m_i, l_i) of one query tile, BLOCK_N at a time.
    MASKED=False is the fast path: every key in range is real and visible to every row. A quantized
    cache (KV_QUANT, paged only) is dequantized as ``kv_dequant.py`` explains; int8 / fp8 scales come for
    SCALE_HEADS KV heads at once (``kv_dequant.per_token_scales``: one head's 2-byte scale a token would be a
    load too narrow for the pipeline)."""
    if KV_QUANT == INT4_GROUPS:
        offs_d = tl.arange(0, HEAD_DIM // 2)  # tiles of packed bytes, each loaded once (kv_dequant.py)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)  # lo is a multiple of BLOCK_N: aligned tiles
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < k_len
        if PAGED:
            # Key position p lives in page table[p // PAGE_SIZE], slot p % PAGE_SIZE; one tile may
            # span several pages or part of one. Table entries past the context are never loaded.
            if MASKED:
                page = tl.load(table + offs_n // PAGE_SIZE, mask=in_range, other=0)
            else:
                page = tl.load(table + offs_n // PAGE_SIZE)
            page = page.to(tl.int64)  # page * stride overflows int32 on large pools
            k_rows = page * stride_kb + (offs_n % PAGE_SIZE) * stride_kt
            v_rows = page * stride_vb + (offs_n % PAGE_SIZE) * stride_vt
        else:
            k_rows = (k_start + offs_n).to(tl.int64) * stride_kt
            v_rows = (k_start + offs_n).to(tl.int64) * stride_vt
        k_ptrs = K + k_rows[None, :] + offs_d[:, None] * stride_kd  # K^T tile: [HEAD_DIM, BLOCK_N]
        v_ptrs = V + v_rows[:, None] + offs_d[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM]
        if MASKED:
            k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if KV_QUANT == PER_TOKEN:  # scales go on the scores and weights (kv_dequant.py)
            scale_rows = per_token_rows(page, offs_n % PAGE_SIZE, stride_sb, stride_st, SCALE_HEADS)
            k_scale = per_token_scales(KScale, scale_rows, in_range, kv_h, stride_sh, SCALE_HEADS)
            v_scale = per_token_scales(VScale, scale_rows, in_range, kv_h, stride_sh, SCALE_HEADS)
            k = per_token_codes(k, q)
        if KV_QUANT == INT4_GROUPS:  # head_dim is a power of two here: tile column c is channel c
            scale_rows = page * stride_sb + (offs_n % PAGE_SIZE) * stride_st
            scale_rows = tl.multiple_of(scale_rows, 2)  # even (kv_quant_mode checks): one 4-byte load a pair
            k = tl.trans(dequant_int4(tl.trans(k), KScale + scale_rows, in_range, HEAD_DIM // 2, QUANT_GROUP))
            k = k.to(q.dtype)
        # "ieee": fp32 inputs would otherwise be rounded to TF32 on the GPU; 16-bit ones ignore it.
        s = tl.dot(q, k, input_precision="ieee")
        if KV_QUANT == PER_TOKEN:
            s = s * k_scale[None, :]
        if MASKED:
            visible = in_range[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        # Online softmax in base 2 (m_i is in scaled units): rescale the old sum and output by
        # exp2(m_old - m_new) whenever the row maximum grows.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)  # 0, not garbage: 0 * NaN = NaN
        else:
            v = tl.load(v_ptrs)
        if KV_QUANT == PER_TOKEN:
            p = p * v_scale[None, :]  # after the denominator: V's scale weighs values, not probabilities
            v = per_token_codes(v, q)
        if KV_QUANT == INT4_GROUPS:
            v = dequant_int4(v, VScale + scale_rows, in_range, HEAD_DIM // 2, QUANT_GROUP).to(q.dtype)
        # Accumulating in place lets the tensor cores add into acc rather than into a fresh tile.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


# Arguments that change from step to step in the engine are not specialised. Triton compiles a
# variant per pattern of its other arguments (an integer "== 1" or "% 16 == 0", a pointer on a
# 16-byte boundary or not), and a pattern first met inside a timed run stalls it for the compile.
# The table's row stride is its width; ``context_lens`` and ``block_tables`` arrive as views past a
# mixed step's decode rows (TritonPagedBatch), 4 bytes a row in, so their alignment followed the
# number of decode rows (tests/test_kernel_specialization.py tells the story). Nothing is lost: the
# kernel loads one length and gathers page ids, which no alignment hint can widen into vector loads.
PER_STEP_ARGS = ("stride_table", "context_lens", "block_tables")


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def _attention_kernel(Q, K, V, Out, cu_seqlens_q, cu_seqlens_k, context_lens, block_tables,
                      stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
                      stride_vb, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                      stride_table, num_heads, num_kv_heads, qk_scale,
                      KScale, VScale, stride_sb, stride_st, stride_sh,
                      HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      KV_QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr, SCALE_HEADS: tl.constexpr = 1):
    # Tiles in reverse order: under causal masking the last tiles of a sequence do the most work,
    # and starting them first leaves short ones to fill the tail of the grid.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    kv_h = h // (num_heads // num_kv_heads)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    m_start = tile * BLOCK_M
    if m_start >= q_len:  # the grid is sized for the longest sequence
        return
    if PAGED:
        k_start = 0
        k_len = tl.load(context_lens + b)
        table = block_tables + b * stride_table
    else:
        k_start = tl.load(cu_seqlens_k + b)
        k_len = tl.load(cu_seqlens_k + b + 1) - k_start
        table = block_tables

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=offs_m[:, None] < q_len, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    diag = k_len - q_len  # query i sees keys j <= i + diag
    if CAUSAL:
        # Keys every row of the tile sees (j <= m_start + diag), in whole blocks, need no mask;
        # the blocks up to the last row's limit cross the diagonal and do.
        unmasked_end = tl.maximum(m_start + diag + 1, 0) // BLOCK_N * BLOCK_N
        masked_end = tl.minimum(m_start + BLOCK_M + diag, k_len)
    else:
        unmasked_end = k_len // BLOCK_N * BLOCK_N
        masked_end = k_len
    K += kv_h * stride_kh
    V += kv_h * stride_vh
    if KV_QUANT == INT4_GROUPS:  # per-token scales pick their head in _attend_blocks
        head_scales = tl.multiple_of(kv_h * stride_sh, 2)  # even, as scale_rows there
        KScale += head_scales
        VScale += head_scales
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, offs_m, 0, unmasked_end, k_len, diag, K, V, KScale,
                                   VScale, k_start, table, stride_kb, stride_kt, stride_kd, stride_vb,
                                   stride_vt, stride_vd, stride_sb, stride_st, kv_h, stride_sh, qk_scale, HEAD_DIM,
                                   BLOCK_N, PAGED, PAGE_SIZE, CAUSAL, MASKED=False, KV_QUANT=KV_QUANT,
                                   QUANT_GROUP=QUANT_GROUP, SCALE_HEADS=SCALE_HEADS)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, offs_m, unmasked_end, masked_end, k_len, diag,
                                   K, V, KScale, VScale, k_start, table, stride_kb, stride_kt, stride_kd,
                                   stride_vb, stride_vt, stride_vd, stride_sb, stride_st, kv_h, stride_sh, qk_scale,
                                   HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE, CAUSAL, MASKED=True, KV_QUANT=KV_QUANT,
                                   QUANT_GROUP=QUANT_GROUP, SCALE_HEADS=SCALE_HEADS)
    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=offs_m[:, None] < q_len)


_attention_kernel_tuned = triton.autotune(GPU_CONFIGS, key=["HEAD_DIM", "CAUSAL", "PAGED", "KV_QUANT", "SCALE_HEADS"])(
    _attention_kernel)


# ---------------------------------------------------------------------------------------------
# References: what the kernels compute, in plain fp32 torch, one sequence at a time.


def _attention_one_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q [q_len, H, D], k/v [k_len, Hkv, D] -> [q_len, H, D] in fp32, bottom-right causal. A query that sees no
    key is NaN, as the kernels leave it (their softmax sum is 0): also when there are no keys at all, where a softmax
    over nothing would sum to an empty 0."""
    if k.shape[0] == 0:
        return torch.full(q.shape, float("nan"), device=q.device)
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    scores = q @ k.transpose(1, 2) * scale
    if causal:
        q_len, k_len = q.shape[1], k.shape[1]
        i = torch.arange(q_len, device=q.device)[:, None]
        j = torch.arange(k_len, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (k_len - q_len), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """What ``flash_attention`` computes (its max_seqlen_q is only a launch hint)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        out[cq[b]:cq[b + 1]] = _attention_one_ref(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]],
                                                  v[ck[b]:ck[b + 1]], causal, scale).to(q.dtype)
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float | None = None,
                                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What ``paged_prefill_attention`` computes: gather each sequence's context from its pages
    (dequantized as the kernel does, ``kv_dequant.dequantize_as_kernels_do``, if the cache is
    quantized), then causal attention of its new (last q_len) tokens over the whole context."""
    block_size = k_cache.shape[1]
    ks, vs = [], []
    for b, ctx in enumerate(context_lens.tolist()):
        pos = torch.arange(ctx, device=q.device)
        slots = (block_tables[b, pos // block_size].long(), pos % block_size)
        for cache, scales, gathered in ((k_cache, k_scale, ks), (v_cache, v_scale, vs)):
            if scales is None:
                gathered.append(cache[slots])
            else:
                gathered.append(dequantize_as_kernels_do(cache[slots], scales[slots], q.dtype))
    cu_seqlens_k = torch.nn.functional.pad(context_lens.cumsum(0), (1, 0)).to(torch.int32)
    return flash_attention_ref(q, torch.cat(ks), torch.cat(vs), cu_seqlens_q, cu_seqlens_k, True, scale)


# ---------------------------------------------------------------------------------------------
# Wrappers: check everything that can be checked without reading device memory, then launch.


def _check_common(q, k, v, kv_name: str, out, scale, quant=NO_QUANT):
    """The checks both wrappers share; a quantized cache's dtypes and width were checked by
    ``kv_quant_mode`` (which gave ``quant``)."""
    _check(q.dim() == 3, f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    _check(q.dtype in DTYPES, f"q.dtype is {q.dtype}; expected one of {DTYPES}")
    check_runnable("q", q)
    for name, t in ((f"k{kv_name}", k), (f"v{kv_name}", v)):
        if quant == NO_QUANT:
            _check(t.dtype == q.dtype, f"{name}.dtype is {t.dtype} but q.dtype is {q.dtype}; they must match")
        _check(t.device == q.device, f"{name} is on {t.device} but q is on {q.device}")
    _check(k.shape == v.shape, f"k{kv_name} shape {tuple(k.shape)} != v{kv_name} shape {tuple(v.shape)}")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[-2]
    if quant == NO_QUANT:
        _check(k.shape[-1] == head_dim, f"k{kv_name} head_dim is {k.shape[-1]} but q's is {head_dim}; they must match")
    _check(kv_heads >= 1 and heads % kv_heads == 0,
           f"q has {heads} heads, k{kv_name} has {kv_heads}; q's must be a multiple of k's (GQA)")
    _check(head_dim in (16, 32, 64, 128, 256), f"head_dim is {head_dim}; expected a power of two in 16..256")
    if out is None:
        out = torch.empty_like(q)
    _check(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
           f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected {tuple(q.shape)} {q.dtype} on {q.device}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return out, scale


def _check_index(name: str, t: torch.Tensor, dims: int, device) -> None:
    _check(t.dtype == torch.int32 and t.dim() == dims,
           f"{name} must be a {dims}-d int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device} but q is on {device}")


def _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, context_lens, block_tables, max_seqlen_q: int,
            page_strides, causal: bool, paged: bool, page_size: int, scale: float, config: dict | None,
            k_scale=None, v_scale=None, quant=NO_QUANT):
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or max_seqlen_q <= 0 or q.shape[0] == 0:
        return out
    # Without scales K and V stand in for them: never read (KV_QUANT=NO_QUANT compiles no load).
    scales = (k, v) if k_scale is None else (k_scale, v_scale)
    # The scale arguments come last so that the others keep their places: the unquantized kernel
    # compiles to the same instructions as before they existed.
    args = (q, k, v, out, cu_seqlens_q, cu_seqlens_k, context_lens, block_tables,
            *q.stride(), page_strides[0], *k.stride()[-3:], page_strides[1], *v.stride()[-3:],
            *out.stride(), block_tables.stride(0), q.shape[1], k.shape[-2], scale * LOG2E,
            *scales, *scale_strides(k_scale))
    consts = dict(HEAD_DIM=q.shape[2], CAUSAL=causal, PAGED=paged, PAGE_SIZE=page_size, KV_QUANT=quant,
                  QUANT_GROUP=INT4_GROUP_SIZE, SCALE_HEADS=scale_heads(k.shape[-2], k_scale))
    if config is None and INTERPRET:
        config = INTERPRETER_CONFIG
    elif config is None and q.dtype == torch.float32:
        config = GPU_FP32_CONFIG
    if config is None:
        grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), batch * q.shape[1])  # noqa: E731
        _attention_kernel_tuned[grid](*args, **consts)
    else:
        grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), batch * q.shape[1])
        _attention_kernel[grid](*args, **consts, **config)
    return out


def choose_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  config: dict | None = None) -> tuple[str, dict | None]:
    """Which kernel ``flash_attention`` runs on these inputs, "gluon_hopper" or "triton", and the Triton kernel's
    config (``config`` without its "HOPPER" key). Raises where the config asks for the Gluon kernel and it cannot run."""
    wants_hopper = None if config is None else config.get("HOPPER")  # None: where it can run
    if config is not None and "HOPPER" in config:
        config = {key: value for key, value in config.items() if key != "HOPPER"} or None
        _check(not (wants_hopper and config), f"config {config} goes with HOPPER=True, whose kernel takes no config")
    if wants_hopper or (wants_hopper is None and config is None and not INTERPRET):
        reason = "Gluon has no interpreter" if INTERPRET else hopper.unsupported(q, k, v, out)
        _check(reason is None or not wants_hopper, f"config HOPPER=True asks for the Hopper kernel, but {reason}")
        if reason is None:
            return "gluon_hopper", None
    return "triton", config


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, causal: bool = True,
                    scale: float | None = None, out: torch.Tensor | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """Attention over a packed batch of variable-length sequences.

    q [Tq_total, H, D]; k, v [Tk_total, Hkv, D]; cu_seqlens_q/k int32 [B+1] prefix sums: sequence b's
    queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and its keys cu_seqlens_k[b]:cu_seqlens_k[b+1].
    max_seqlen_q must be at least the longest q_len (it sizes the grid; with a smaller one some rows stay unwritten).
    causal is bottom-right aligned. scale defaults to 1/sqrt(D). Returns out [Tq_total, H, D] in q's
    dtype. config pins e.g. {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}.

    Without a config, an sm_90 GPU (H100/H200) runs bf16/fp16 inputs of head_dim 64 or 128 through the
    FlashAttention-3-style Gluon kernel (``hopper/flash_attention.py``), anything else through the
    autotuned Triton kernel; config={"HOPPER": True} demands the Gluon kernel (a ValueError says why not), and
    {"HOPPER": False, ...} the Triton one (with the rest of the config, if any).
    """
    out, scale = _check_common(q, k, v, "", out, scale)
    _check(k.dim() == 3, f"k must be [tokens, kv_heads, head_dim], got shape {tuple(k.shape)}")
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, q.device)
    _check_index("cu_seqlens_k", cu_seqlens_k, 1, q.device)
    _check(cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.shape[0] >= 1,
           f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)}; "
           "both must be [batch + 1]")
    kernel, config = choose_kernel(q, k, v, out, config)
    if kernel == "gluon_hopper":
        return hopper.hopper_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, scale * LOG2E)
    return _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q, cu_seqlens_q, max_seqlen_q,
                   (0, 0), causal, False, 1, scale, config)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, max_seqlen_q: int, scale: float | None = None,
                            out: torch.Tensor | None = None, config: dict | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new tokens over their whole context, read from the paged KV cache.

    q [T_total, H, D]: the new tokens of B sequences, packed (cu_seqlens_q int32 [B+1]); they are the
    last q_len positions of each context and are already written to the cache. k_cache, v_cache
    [num_blocks, block_size, Hkv, D]: one layer's pool, block_size a power of two. block_tables
    int32 [B, max_blocks]: token p of sequence b is at cache[block_tables[b, p // block_size],
    p % block_size]; entries past the context are never read. context_lens int32 [B]: tokens in each
    context, new ones included (>= q_len). q_len may be 1 (decode rows in a mixed batch). A
    quantized cache (int8, float8_e4m3fn, or uint8 = packed int4; ``minillm/kv/quant.py``) comes
    with its ``k_scale`` / ``v_scale`` pools and is dequantized inside the kernel.
    """
    quant = kv_quant_mode(q, k_cache, v_cache, k_scale, v_scale)
    out, scale = _check_common(q, k_cache, v_cache, "_cache", out, scale, quant)
    _check(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, kv_heads, head_dim], "
           f"got shape {tuple(k_cache.shape)}")
    block_size = k_cache.shape[1]
    _check(block_size >= 1 and block_size & (block_size - 1) == 0,
           f"block_size (k_cache.shape[1]) is {block_size}; expected a power of two")
    _check_index("block_tables", block_tables, 2, q.device)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, q.device)
    _check_index("context_lens", context_lens, 1, q.device)
    batch = block_tables.shape[0]
    _check(cu_seqlens_q.shape[0] == batch + 1 and context_lens.shape[0] == batch,
           f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)}, context_lens {tuple(context_lens.shape)}, "
           f"block_tables {tuple(block_tables.shape)}; expected [{batch + 1}], [{batch}] for {batch} sequences")
    return _launch(q, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_q, context_lens, block_tables,
                   max_seqlen_q, (k_cache.stride(0), v_cache.stride(0)), True, True, block_size, scale, config,
                   k_scale, v_scale, quant)
