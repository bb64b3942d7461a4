"""Reading a quantized KV cache inside the attention kernels (``kv_cache_dtype``, ``minillm/kv/quant.py``).

Why it exists: both paged kernels (decode in ``paged_attention.py``, prefill in ``flash_attention.py``)
take the same optional ``k_scale`` / ``v_scale`` pools and dequantize right after loading a tile, so
only the quantized bytes cross the memory bus. One compile-time switch, ``KV_QUANT``, picks the
code; with ``NO_QUANT`` none of it is compiled, and the kernel is the one it was before.

- ``PER_TOKEN`` (int8, fp8): one scale per token and KV head. The tiles are never multiplied by
  it: q . (s_j k_j) = s_j (q . k_j), so K's scale multiplies token j's *score*, and
  sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j, so V's scale multiplies its softmax *weight*. That is
  a [rows, BLOCK_N] multiply instead of a [BLOCK_N, head_dim] one, and int8 and e4m3 values
  convert exactly to fp16 / bf16 for ``tl.dot``. The decode kernel multiplies them in fp16 whatever
  q's dtype (``per_token_query``), weighting V's tokens relative to the tile's largest scale. Both
  kernels load a token's scales for a group of KV heads as one aligned vector (``per_token_rows``,
  ``per_token_scales``): one head's 2-byte scale would be too narrow for the software pipeline.
- ``INT4_GROUPS`` (int4): a scale and a minimum per 16 channels. They vary along the dot's
  reduction axis, so they cannot be factored out: the tile itself is dequantized (``dequant_int4``).

How an int4 tile is read. Each packed byte is loaded once, as a [BLOCK_N, head_dim / 2] tile; its
low nibbles are channels 0..D/2-1 and its high nibbles D/2..D-1 (``kv_formats.py``), so the two halves
come out side by side and are joined into one [BLOCK_N, D] tile for ``tl.dot`` (a relabelling of
registers, no data movement). The (scale, minimum) pairs come as a small [BLOCK_N, groups] tile, one
4-byte load per pair, broadcast over their channels. Indexing every channel of a [BLOCK_N, D] tile
instead would load each byte twice and issue two scalar 2-byte loads of its pair per *value*, outside
the software pipeline: about twice the decode loop's instructions per K/V byte (compiled for sm_90,
``figures/h200/sweeps/kv_quant_sass.json``). What remains is
arithmetic: per value a nibble shift/mask, a float conversion (``int8_to_float``), an FMA, half a pack.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check
from .int_float import int8_to_float
from .kv_formats import dequantize_kv, format_of, kv_layout

# The KV_QUANT values; constexpr so that the kernels may read them as globals.
NO_QUANT, PER_TOKEN, INT4_GROUPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def kv_quant_mode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  q_dtype: torch.dtype | None = None) -> tl.constexpr:
    """Check a cache's pools and scales against q ([..., head_dim]; ``q_dtype``: the dtype it stands for, where the
    kernel rounds it on loading: by default its own); return the kernels' KV_QUANT.

    A float cache must match q's dtype and come without scales; a quantized one (int8, fp8, or
    uint8 = packed int4) needs both scale pools in ``kv_layout``'s shape, with equal strides."""
    kind, q_dtype = format_of(k_cache.dtype), q_dtype or q.dtype
    if kind == "auto":
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            check(cache.dtype == q_dtype, f"{name} has dtype {cache.dtype} but q has {q_dtype}; they must match "
                  "(or be a quantized cache: int8, float8_e4m3fn, uint8 = packed int4)")
        check(k_scale is None and v_scale is None, f"k_scale / v_scale dequantize a quantized KV cache, but the "
              f"cache holds {k_cache.dtype}; pass None")
        return NO_QUANT
    check(v_cache.dtype == k_cache.dtype, f"k_cache holds {k_cache.dtype} but v_cache {v_cache.dtype}; they must match")
    check(k_scale is not None and v_scale is not None,
          f"an {kind} KV cache ({k_cache.dtype}) needs its scales: pass k_scale and v_scale")
    head_dim = q.shape[-1]
    layout = kv_layout(kind, head_dim, q_dtype)
    check(k_cache.shape[-1] == layout.width, f"an {kind} cache for head_dim {head_dim} has a last dim of "
          f"{layout.width}, got k_cache {tuple(k_cache.shape)}")
    want = (*k_cache.shape[:-1], *layout.scale_shape)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(tuple(scale.shape) == want and scale.dtype in FLOAT_DTYPES,
              f"{name} must be a float tensor of shape {want} for this {kind} cache, "
              f"got {scale.dtype} {tuple(scale.shape)}")
        check(scale.device == q.device, f"{name} is on {scale.device} but q is on {q.device}")
    check(k_scale.stride() == v_scale.stride(), f"k_scale and v_scale need equal strides, got {k_scale.stride()} "
          f"and {v_scale.stride()}")
    if kind == "int4":  # the kernels load each (scale, minimum) pair as one 4-byte word
        check(k_scale.stride()[-2:] == (2, 1) and all(stride % 2 == 0 for stride in k_scale.stride()[:-1]),
              f"int4 scales need contiguous (scale, minimum) pairs at even offsets, got strides {k_scale.stride()}")
        return INT4_GROUPS
    return PER_TOKEN


def reads_int8_words(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel reads this cache as int32 words of four codes (its INT8_WORDS): an int8
    cache for a 16-bit q whose rows start at multiples of 4 bytes (head_dim, strides and pointers)."""
    return k_cache.dtype == torch.int8 and q.dtype != torch.float32 and q.shape[-1] % 4 == 0 and all(
        x % 4 == 0 for cache in (k_cache, v_cache) for x in (*cache.stride()[:3], cache.data_ptr()))


def scale_heads(kv_heads: int, k_scale: torch.Tensor | None) -> int:
    """How many KV heads' per-token scales the paged kernels load together (``per_token_scales``): all
    of them up to 16 (32 bytes a token) when that divides them, a token's scales are contiguous (the
    heads' stride is 1) and the block and slot strides are multiples of the group (the kernels tell
    Triton each token's first scale is a multiple of the group, ``per_token_rows``, so that the group
    loads as one aligned vector), else one. 1 for other scale layouts (int4's)."""
    if k_scale is None or k_scale.dim() != 3 or k_scale.stride(2) != 1:
        return 1
    for group in (16, 8, 4, 2):
        if kv_heads % group == 0 and k_scale.stride(0) % group == 0 and k_scale.stride(1) % group == 0:
            return group
    return 1


def dequantize_as_kernels_do(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the kernels multiply them, in fp32, for the references: int8 and fp8 codes are exact
    in fp16 / bf16 and their scales apply in fp32, so they are exact; int4 values are computed in
    fp32 and rounded to q's ``dtype`` for ``tl.dot`` (in bf16 a 2^-9 relative step, small next to
    int4's own but not next to a test's tolerance). A float pool comes back in fp32."""
    if format_of(data.dtype) == "int4":
        return dequantize_kv(data, scales, dtype).float()
    return dequantize_kv(data, scales, torch.float32)


def scale_strides(k_scale: torch.Tensor | None) -> tuple[int, int, int]:
    """(block, slot, head) strides of a scale pool; zeros stand in when there is none."""
    return (0, 0, 0) if k_scale is None else k_scale.stride()[:3]


@triton.jit
def tile_channels(BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    """The head channel in each of a K/V tile's BLOCK_D columns, and which columns hold one. The
    columns of ``dequant_int4``'s tiles are its own order; otherwise, and whenever head_dim is a
    power of two, column c is channel c."""
    columns = tl.arange(0, BLOCK_D)
    if KV_QUANT == INT4_GROUPS:
        HALF_PAD: tl.constexpr = BLOCK_D // 2
        return columns % HALF_PAD + columns // HALF_PAD * (HEAD_DIM // 2), columns % HALF_PAD < HEAD_DIM // 2
    return columns, columns < HEAD_DIM


@triton.jit
def _dequant_runs(codes, pairs, groups, mask, RUN: tl.constexpr):
    """4-bit ``codes`` [N, C] -> code * scale + minimum in fp32 (``quantize_kv``'s inverse, the same
    operations), where run r (columns r*RUN .. r*RUN+RUN-1) belongs to group ``groups[r]``, whose
    (scale, minimum) pair sits at ``pairs`` [N] + 2 * groups[r]: loaded as a [N, C / RUN, 2] tile and
    broadcast over each run, one load per pair rather than per value."""
    N: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    params = (pairs[:, None] + 2 * groups[None, :])[:, :, None] + tl.arange(0, 2)[None, None, :]
    scale, minimum = tl.split(tl.load(params, mask=mask[:, :, None], other=0.0).to(tl.float32))
    runs = int8_to_float(tl.reshape(codes, [N, C // RUN, RUN]))
    return tl.reshape(runs * scale[:, :, None] + minimum[:, :, None], [N, C])


@triton.jit
def dequant_int4(raw, pairs, valid, HALF: tl.constexpr, QUANT_GROUP: tl.constexpr):
    """Packed int4 -> fp32: ``raw`` [N, HALF_PAD] the tile of packed bytes (channel j and HALF + j
    in byte j, HALF = head_dim / 2), ``pairs`` [N] pointers to each token's first (scale, minimum)
    pair, ``valid`` [N] the tokens to read. Returns [N, 2 * HALF_PAD]: the low nibbles' channels in
    columns 0..HALF_PAD-1, the high nibbles' from HALF_PAD on (``tile_channels`` maps them)."""
    # A run: channels of one byte half in one group. A whole group, or half of one when head_dim is
    # an odd multiple of 16 (e.g. 48: the high half starts at channel 24, mid-group).
    RUN: tl.constexpr = QUANT_GROUP if HALF % QUANT_GROUP == 0 else QUANT_GROUP // 2
    HALF_PAD: tl.constexpr = raw.shape[1]
    first = tl.arange(0, HALF_PAD // RUN) * RUN  # each run's first channel within its half
    mask = valid[:, None] & (first < HALF)[None, :]
    raw = raw.to(tl.int32)  # one widening per byte, shared by its two nibbles
    low = _dequant_runs(raw & 15, pairs, first // QUANT_GROUP, mask, RUN)
    high = _dequant_runs(raw >> 4, pairs, (HALF + first) // QUANT_GROUP, mask, RUN)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), [raw.shape[0], 2 * HALF_PAD])


@triton.jit
def per_token_codes(raw, like):
    """int8 or e4m3 codes -> ``like``'s dtype, exactly; int8 through ``int8_to_float`` (no I2F per value)."""
    if raw.dtype == tl.int8:
        return int8_to_float(raw).to(like.dtype)
    return raw.to(like.dtype)


@triton.jit
def per_token_query(q):
    """A 16-bit q [rows, D] as fp16 for the dot with per-token codes, and each row's factor back.

    int8 codes become fp16 four at a time (``int_float.int8_words_to_fp16``) where bf16 needs a float
    add per value, so the decode kernel multiplies in fp16 whatever q's dtype (e4m3 codes too: exact). A bf16 q may exceed fp16's range,
    so each row is divided by the power of two at or below its largest |value| (exact), into [0, 2);
    the scores are multiplied back by it. Values under 2**-16 of their row's largest lose low bits in
    fp16's subnormals, an error below 2**-24 of the row's largest, far under bf16's own rounding
    (2**-9). An fp32 q stays as it is (factor 1)."""
    if q.dtype == tl.float32:
        unit = tl.full([q.shape[0]], 1.0, tl.float32)
        scaled = q
    else:
        top = tl.max(tl.abs(q.to(tl.float32)), axis=1)
        unit = (top.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2**floor(log2 top)
        unit = tl.where(unit > 0, unit, 1.0)  # a row of zeros (padding) or of subnormals: left as is
        scaled = (q.to(tl.float32) / unit[:, None]).to(tl.float16)
    return scaled, unit


@triton.jit
def per_token_rows(block, slot, stride_sb, stride_st, SCALE_HEADS: tl.constexpr):
    """Each token's first per-token scale, block * stride_sb + slot * stride_st, written so that Triton sees it is a
    multiple of SCALE_HEADS (``scale_heads`` groups heads only when both strides are): a product with the constant.
    Why: the token stride of a [blocks, slots, kv_heads] pool is the number of KV heads, 8 in the benchmarks' 32/8-head
    shape (GQA, as Llama-3-8B's), and Triton specialises only integers divisible by 16 (Llama-2-7B's 32 heads are),
    so as a plain sum it could not prove a group of 8 scales 16-byte aligned and loaded them 2 bytes at a time
    (LDG.E.U16) in the decode loop, outside the software pipeline: on the H200 that loop then waited for every
    outstanding copy at its top (figures/h200/sweeps/ncu_decode_int8_source.json).
    (``tl.multiple_of`` on the sum did not survive to the load.)"""
    return (block * (stride_sb // SCALE_HEADS) + slot * (stride_st // SCALE_HEADS)) * SCALE_HEADS


@triton.jit
def per_token_scales(Scales, rows_at, valid, kv_head, stride_sh, SCALE_HEADS: tl.constexpr):
    """The fp32 scale of each token of a tile for ``kv_head``: [BLOCK_N], 0 where not ``valid``.

    Loaded for SCALE_HEADS neighbouring heads at once (the aligned group holding kv_head; the number
    of KV heads must be a multiple of it), then picked: one head's 2-byte scale per token is too
    narrow for the GPU's async copy (4, 8 or 16 bytes), so Triton's pipeliner leaves such a load out
    and the tile waits on it (an LDG in the loop's SASS). A group's scales of one token share a
    32-byte sector, so DRAM moves no more bytes. The mask is per token only: one that varied along
    the heads would make the load as narrow again (Triton's AssignLatencies.cpp, isSmallLoad).
    ``rows_at`` must come from ``per_token_rows``, so that Triton can prove the group's load aligned."""
    first = kv_head // SCALE_HEADS * SCALE_HEADS
    heads = first + tl.arange(0, SCALE_HEADS)
    group = tl.load(Scales + rows_at[:, None] + heads[None, :] * stride_sh, mask=valid[:, None],
                    other=0.0).to(tl.float32)
    return tl.sum(tl.where((heads == kv_head)[None, :], group, 0.0), axis=1)  # where, not a product: no NaN leaks
