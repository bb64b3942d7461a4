"""INT4 weights in packed 16-bit math, two weights per instruction: the W4A16 GEMV's HFMA2 body (``gemv_pairs``,
``gemv_pairs_tiles``) and the dot's PAIRS tile (``dequant_tile_pairs``, below) of ``quant_matmul``.

Why it exists: the fp32 GEMV spends about 5.5 instructions per weight in the sm_90 SASS (a shift, a
LOP3 and an FFMA each, plus x loads and zero points), while an H200 issues only ~3.5 per weight at
full HBM bandwidth (132 SMs x 128 lanes x 1.98 GHz against ~9.6 G int4 weights per us), and its
shifts and LOP3s issue at half the FMA rate (64 against 128 a clock per SM: CUDA C Programming
Guide, arithmetic instruction throughput, cc 9.0). A packed int32 holds nibble j in its low 16 bits and
nibble j + 4 in its high 16, so one LOP3 makes a *pair* of 16-bit floats and one HFMA2
(``fma.rn.bf16x2``/``f16x2``) multiplies both into a pair of partial sums (the idea of
FasterTransformer's and Marlin's converters: Kim et al., https://arxiv.org/abs/2211.10017;
Frantar et al., https://arxiv.org/abs/2408.11743). Here without their 0x4300/0x6400 exponent:

- a 16-bit float whose bits b sit below its first normal binade's end (b < 256 for bf16, < 2048 for
  fp16) is exactly b * 2**-133 (bf16) or b * 2**-24 (fp16), subnormal or not. So ``packed &
  0x000F000F`` *is* the pair (q_j, q_j+4) scaled, ``packed & 0x00F000F0`` the next pair 16 times
  larger: four LOP3s and one shift by 8 unpack eight weights, and no offset needs subtracting.
- bf16: x is scaled by 2**101 (2**97 for the 16-times pairs) so that x q 2**-32 stays normal, and
  the zero point comes off once per run or tile as z * sum(x): 9 instructions per 8 weights in the
  core, 1.7 to 2.2 per weight in all (figures/cpu/w4a16_gemv_sass.json). |x| must stay below 2**27.
- fp16 lacks the range for that: one more HFMA2 per pair makes (q - z) 2**-10 exactly (2.3 per
  weight in all at RUN = 2); the 2**-10 keeps the 16-bit sums of any fp16 x finite.

Two entry points: ``gemv_pairs`` (1D loads row by row, 16-bit sums over runs of RUN rows) and ``gemv_pairs_tiles``
(one 2-d load per tile, spread over all the program's threads, the next tile loaded ahead, one row's 8 products
summed in 16 bits and the rest in fp32; RUN = 1's accuracy).

Accuracy: products and sums are rounded to 16 bits within a run of RUN packed rows (4 RUN products
per half), then summed in fp32. bf16's 8-bit mantissa up to doubles the fp32 GEMV's distance from
the reference at RUN <= 2 (1.0e-2 of max |y| against 5.2e-3 at K = 11008; RUN = 4 adds the error of
16-term bf16 sums of x); fp16 stays within 1e-3 (figures/cpu/w4a16_gemv_error.json). Under
the interpreter ``_fma2`` computes in fp32 and rounds to 16 bits, the same up to rare double rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .int_float import ASM, int8_to_float


@triton.jit
def _halves(v, BF16: tl.constexpr):
    """The two 16-bit floats in each int32 of v, as fp32: (low half, high half)."""
    if BF16:
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)
    else:
        lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fma2(a, b, c, BF16: tl.constexpr):
    """a * b + c on the pairs of 16-bit floats (bf16 or fp16) held in int32s: one HFMA2 on a GPU."""
    if ASM:
        if BF16:
            return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter runs no PTX: the same in fp32 (exact for these products), rounded to 16 bits
        a0, a1 = _halves(tl.cast(a, tl.int32), BF16)  # (the casts: some operands are Python ints)
        b0, b1 = _halves(tl.cast(b, tl.int32), BF16)
        c0, c1 = _halves(tl.cast(c, tl.int32), BF16)
        return _to_16_bits(a0 * b0 + c0, BF16) | (_to_16_bits(a1 * b1 + c1, BF16) << 16)


@triton.jit
def _to_16_bits(v, BF16: tl.constexpr):
    """fp32 v rounded to nearest even in bf16 or fp16: the bits in the low 16 of an int32 (the interpreter's own
    fp32 -> bf16 conversion truncates)."""
    if BF16:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 65535
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 65535


@triton.jit
def _join_halves(a, b, HIGH: tl.constexpr):
    """(a's low half, b's low half) in one int32, or with HIGH their high halves: one PRMT on a GPU."""
    if ASM:
        if HIGH:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                             dtype=tl.int32, is_pure=True, pack=1)
    elif HIGH:
        return ((a >> 16) & 65535) | (b & -65536)
    else:
        return (a & 65535) | (b << 16)


@triton.jit
def _scale_zero(S, Z, r, end, n, N, group_size, stride_s, stride_z):
    """The scale (fp32) and zero point (int32) of packed row r's group, per column n."""
    g = (8 * r) // group_size
    ok = n < tl.where(r < end, N, 0)  # (n < N) & (r < end), which the interpreter refuses as a mask
    scale = tl.load(S + g * stride_s + n, mask=ok, other=0.0).to(tl.float32)
    return scale, (tl.load(Z + g * stride_z + n // 8, mask=ok, other=0) >> ((n % 8) * 4)) & 15


@triton.jit
def _run(x_ptr, q_ptrs, r0, end, n, N, z, stride_q, BF16: tl.constexpr, BLOCK_N: tl.constexpr, RUN: tl.constexpr,
         MASKED: tl.constexpr, EVEN_N: tl.constexpr):
    """Packed rows r0 .. r0 + RUN in 16-bit pairs: (the sums per column, the sum of x (bf16 only)). x_ptr and
    q_ptrs point at row r0 (a base per tile, so the rows' offsets are constants or multiples of stride_q)."""
    acc2 = tl.zeros((BLOCK_N,), tl.int32)  # the bits of +0.0 in both halves
    x_sum2 = tl.zeros((1,), tl.int32)
    if not BF16:  # -z 2**-10 in both halves: z's bits are the fp16 z 2**-24 (see the module docstring), times 2**14
        neg_zero = _fma2(z * 0x10001 - 2147450880, 0x74007400, 0, BF16)  # (the sign bits: + 0x80008000)
    for i in tl.static_range(RUN):
        r = r0 + i
        if MASKED:
            packed = tl.load(q_ptrs + i * stride_q, mask=n < tl.where(r < end, N, 0), other=0)
            x_words = tl.load(x_ptr + 4 * i + tl.arange(0, 4), mask=4 * r + tl.arange(0, 4) < 4 * end, other=0)
        elif EVEN_N:  # no mask: no zeroing of the registers before each load
            packed = tl.load(q_ptrs + i * stride_q)
            x_words = tl.load(x_ptr + 4 * i + tl.arange(0, 4))
        else:
            packed = tl.load(q_ptrs + i * stride_q, mask=n < N)
            x_words = tl.load(x_ptr + 4 * i + tl.arange(0, 4))
        # x_words holds inputs 8r .. 8r + 7 two by two; nibble pair j = (j, j + 4) needs (x_j, x_j+4).
        x01, x23 = tl.split(tl.reshape(x_words, (2, 2)))
        x0, x2 = tl.split(x01)
        x1, x3 = tl.split(x23)
        shifted = packed >> 8  # nibbles 2, 3, 6, 7 down to where 0, 1, 4, 5 were
        for j in tl.static_range(4):
            src = packed if j < 2 else shifted
            xj = _join_halves(x0 if j < 2 else x1, x2 if j < 2 else x3, j % 2 == 1)
            v = src & (0x000F000F if j % 2 == 0 else 0x00F000F0)  # (q, q') 2**-133 or 2**-24 (or 16 times that)
            if BF16:
                x_sum2 = _fma2(xj, 0x3F803F80, x_sum2, BF16)  # + x_j * 1.0
                x_big = _fma2(xj, 0x72007200 if j % 2 == 0 else 0x70007000, 0, BF16)  # x * 2**101 or 2**97
                acc2 = _fma2(x_big, v, acc2, BF16)  # + x q 2**-32
            else:  # (q - z) 2**-10 = q 2**-24 * 2**14 - z 2**-10, or 16 q 2**-24 * 2**10 - z 2**-10: exact
                acc2 = _fma2(xj, _fma2(v, 0x74007400 if j % 2 == 0 else 0x64006400, neg_zero, BF16), acc2, BF16)
    return acc2, x_sum2


@triton.jit
def _tile(XW, QW, S, Z, r0, end, n, N, group_size, stride_q, stride_s, stride_z, BF16: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, RUN: tl.constexpr, ONE_GROUP: tl.constexpr,
          MASKED: tl.constexpr, EVEN_N: tl.constexpr):
    """sum_k x_k w[k, n] over packed rows r0 .. r0 + BLOCK_KP, in fp32; runs of RUN rows in 16-bit pairs."""
    out = tl.zeros((BLOCK_N,), tl.float32)
    part = tl.zeros((BLOCK_N,), tl.float32)
    x_sum = tl.zeros((1,), tl.float32)
    if ONE_GROUP:  # the whole tile in one group: its scale and zero once
        scale, z = _scale_zero(S, Z, r0, end, n, N, group_size, stride_s, stride_z)
    for r1 in tl.static_range(0, BLOCK_KP, RUN):
        if not ONE_GROUP:  # a run lies in one group (checked by the launcher)
            scale, z = _scale_zero(S, Z, r0 + r1, end, n, N, group_size, stride_s, stride_z)
        acc2, x_sum2 = _run(XW + 4 * (r0 + r1), QW + (r0 + r1) * stride_q + n, r0 + r1, end, n, N, z, stride_q, BF16,
                            BLOCK_N, RUN, MASKED, EVEN_N)
        lo, hi = _halves(acc2, BF16)
        part += lo + hi
        if BF16:
            x_lo, x_hi = _halves(x_sum2, BF16)
            x_sum += x_lo + x_hi
        if not ONE_GROUP or r1 + RUN == BLOCK_KP:  # sum x (q - z) = 2**32 sum x q 2**-32 - z sum x
            if BF16:
                out += scale * (part * 4294967296.0 - int8_to_float(z) * x_sum)
            else:
                out += scale * (part * 1024.0)
            part = tl.zeros((BLOCK_N,), tl.float32)
            x_sum = tl.zeros((1,), tl.float32)
    return out


@triton.jit
def gemv_pairs(X, QW, S, Z, start, end, n, N, group_size, stride_q, stride_s, stride_z, BLOCK_N: tl.constexpr,
               BLOCK_KP: tl.constexpr, RUN: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN_N: tl.constexpr):
    """sum_k x[k] w[k, n] over packed rows start .. end for x's row X (16-bit, 4-byte aligned): [BLOCK_N] fp32.
    ONE_GROUP: every tile of BLOCK_KP rows lies in one group; EVEN_N: N % BLOCK_N == 0 (no column mask)."""
    BF16: tl.constexpr = X.dtype.element_ty == tl.bfloat16
    XW = X.to(tl.pointer_type(tl.int32), bitcast=True)  # x two inputs per word
    acc = tl.zeros((BLOCK_N,), tl.float32)
    full_end = start + (end - start) // BLOCK_KP * BLOCK_KP  # whole tiles run without row masks
    for r0 in range(start, full_end, BLOCK_KP):
        acc += _tile(XW, QW, S, Z, r0, end, n, N, group_size, stride_q, stride_s, stride_z, BF16, BLOCK_N,
                     BLOCK_KP, RUN, ONE_GROUP, False, EVEN_N)
    if full_end < end:
        acc += _tile(XW, QW, S, Z, full_end, end, n, N, group_size, stride_q, stride_s, stride_z, BF16,
                     BLOCK_N, BLOCK_KP, RUN, ONE_GROUP, True, EVEN_N)
    return acc


@triton.jit
def _x_pairs(XW, r, row_ok, BF16: tl.constexpr):
    """The inputs of packed rows r [BLOCK_KP, 1] as the four pairs (x_j, x_j+4), j = 0..3, each an int32 of two
    16-bit floats, and their sum in fp32 ([BLOCK_KP, 1] each). Rows past the end (row_ok False) read as zeros.
    Four loads of [BLOCK_KP, 1], not one of [BLOCK_KP, 4] split apart: this shape broadcasts against the weight
    tile in the layout it was loaded in, where a split's result went through shared memory to get there."""
    w0 = tl.load(XW + 4 * r, mask=row_ok, other=0)  # inputs 8r, 8r + 1
    w1 = tl.load(XW + 4 * r + 1, mask=row_ok, other=0)
    w2 = tl.load(XW + 4 * r + 2, mask=row_ok, other=0)
    w3 = tl.load(XW + 4 * r + 3, mask=row_ok, other=0)
    pairs = (_join_halves(w0, w2, False), _join_halves(w0, w2, True), _join_halves(w1, w3, False),
             _join_halves(w1, w3, True))
    sum2 = 0
    for j in tl.static_range(4):  # + x * 1.0, pairwise, in 16 bits
        sum2 = _fma2(pairs[j], 0x3F803F80 if BF16 else 0x3C003C00, sum2, BF16)
    lo, hi = _halves(sum2, BF16)
    return pairs, lo + hi


@triton.jit
def _tile_2d(acc, packed, pairs, x_sum, scale, z, BF16: tl.constexpr):
    """acc [1, BLOCK_N] fp32 += sum over one tile of packed rows (inside one group) of x (q - z) s: per packed int32,
    a shift, four LOP3s and four HFMA2s (eight in fp16) make the 8 products' two 16-bit sums (module docstring),
    and one FADD adds them to the column's fp32 sum over the tile's rows; the scale and zero point come once per
    column and tile. The sum over rows stays inside each thread where the tile is BLOCK_N = 128 num_warps wide
    (warps along N)."""
    acc2 = tl.zeros(packed.shape, tl.int32)
    shifted = packed >> 8
    if not BF16:
        neg_zero = _fma2(z * 0x10001 - 2147450880, 0x74007400, 0, BF16)
    for j in tl.static_range(4):
        src = packed if j < 2 else shifted
        v = src & (0x000F000F if j % 2 == 0 else 0x00F000F0)
        if BF16:
            x_big = _fma2(pairs[j], 0x72007200 if j % 2 == 0 else 0x70007000, 0, BF16)  # x 2**101 or 2**97
            acc2 = _fma2(x_big, v, acc2, BF16)
        else:
            acc2 = _fma2(pairs[j], _fma2(v, 0x74007400 if j % 2 == 0 else 0x64006400, neg_zero, BF16), acc2, BF16)
    lo, hi = _halves(acc2, BF16)
    part = tl.sum(lo + hi, axis=0, keep_dims=True)
    if BF16:  # sum x (q - z) s = (2**32 s) sum x q 2**-32 - (z s) sum x
        return acc + part * (scale * 4294967296.0) - tl.sum(x_sum, axis=0, keep_dims=True) * (int8_to_float(z) * scale)
    else:
        return acc + part * (scale * 1024.0)


@triton.jit
def _group_params(S, Z, r, n, stride_s, stride_z, BLOCK_KP: tl.constexpr, GROUP_TILES: tl.constexpr):
    """Scale (fp32) and zero point (int32) per column n ([1, BLOCK_N]: the weight tile's layout, broadcast, so no
    conversion through shared memory) of the group holding packed row r."""
    g = (r // BLOCK_KP) // GROUP_TILES if GROUP_TILES else 0  # constexpr divisors: no run-time integer division
    scale = tl.load(S + g * stride_s + n).to(tl.float32)
    return scale, (tl.load(Z + g * stride_z + n // 8) >> ((n % 8) * 4)) & 15


@triton.jit
def gemv_pairs_tiles(X, QW, S, Z, start, end, n, N, stride_q, stride_s, stride_z, BLOCK_N: tl.constexpr,
                     BLOCK_KP: tl.constexpr, GROUP_TILES: tl.constexpr, EVEN_N: tl.constexpr):
    """``gemv_pairs`` in 2-d tiles: the tile [BLOCK_KP, BLOCK_N] of packed weights is one 2-d load, spread over
    all of the program's threads, and the next tile's load is issued before this one is computed (Triton leaves
    this loop's loads unpipelined), so a program keeps two tiles of bytes in flight. Each tile's rows are summed
    into a [1, BLOCK_N] fp32 accumulator (``_tile_2d``).
    Tiles lie inside one group: GROUP_TILES tiles a group, or 0 for one group over all of K. No load is masked:
    rows past ``end`` re-read row end - 1 and columns past N column N - 1, and x is 0 for those rows, so they
    add nothing (masks cost a predicate per row and tile; ``split_k.finish`` stores y only where n < N).
    -> [BLOCK_N] fp32."""
    BF16: tl.constexpr = X.dtype.element_ty == tl.bfloat16
    XW = X.to(tl.pointer_type(tl.int32), bitcast=True)
    rows = tl.arange(0, BLOCK_KP)
    cols = n if EVEN_N else tl.minimum(n, N - 1)
    last = end - 1  # >= 0: an empty split has start >= end = K // 8
    acc = tl.zeros((1, BLOCK_N), tl.float32)
    packed = tl.load(QW + tl.minimum(start + rows, last)[:, None] * stride_q + cols[None, :])
    scale, z = _group_params(S, Z, tl.minimum(start, last), cols[None, :], stride_s, stride_z, BLOCK_KP, GROUP_TILES)
    for r0 in range(start, end, BLOCK_KP):
        # The next tile's weights, scales and zeros first (past the end: clamped re-reads), then this tile's math.
        packed_next = tl.load(QW + tl.minimum(r0 + BLOCK_KP + rows, last)[:, None] * stride_q + cols[None, :])
        scale_next, z_next = _group_params(S, Z, tl.minimum(r0 + BLOCK_KP, last), cols[None, :], stride_s, stride_z,
                                           BLOCK_KP, GROUP_TILES)
        pairs, x_sum = _x_pairs(XW, (r0 + rows)[:, None], (r0 + rows < end)[:, None], BF16)
        acc = _tile_2d(acc, packed, pairs, x_sum, scale, z, BF16)
        packed, scale, z = packed_next, scale_next, z_next
    return tl.sum(acc, axis=0)  # [BLOCK_N]


# -----------------------------------------------------------------------------
# The W4A16 dot's weight tile dequantized two weights per instruction: ``quant_matmul``'s PAIRS variant.
#
# Why it exists: from M = 16 to 64 the dot path was never faster than bf16 ``torch.matmul`` on an H200
# (0.38 to 0.91 times its speed, figures/h200/sweeps/w4a16_dot.json), though it reads a quarter of the
# bytes. Its tile is dequantized one fp32 weight at a time: two shifts, a LOP3, a subtract, a multiply
# and half a conversion per weight before the tensor cores see it. Here a packed int32's nibbles j and
# j + 4 become one *pair* of 16-bit floats in a single LOP3, the idea of FasterTransformer's and Marlin's
# converters (Kim et al., https://arxiv.org/abs/2211.10017; Frantar et al., https://arxiv.org/abs/2408.11743):
#
# - ``(packed >> 4j) & 0x000F000F | MAGIC`` puts nibble j in the low half's mantissa and nibble j + 4
#   in the high half's, under the exponent of 128.0 (bf16, 0x4300: 7 mantissa bits, each worth 1) or
#   1024.0 (fp16, 0x6400: 10 bits, each worth 1), so the halves are exactly 128 + q (or 1024 + q);
# - one HFMA2 subtracts the pair (128 + z, 128 + z): (q - z) exactly, an integer in [-15, 15];
# - one more multiplies by (s, s): (q - z) s rounded once to 16 bits, which is the reference's weight
#   (``dequantize_int4`` rounds the exact fp32 product once), so the dot sees the same numbers.
#
# Eight weights cost three shifts, four LOP3s and eight HFMA2s; the pairs are then split into 16-bit
# values and joined so that rows come out in k's order (k = 8r + j is the low half of pair j, 8r + j + 4
# its high half). What that join and the tensor-core operand layout cost is in the SASS:
# figures/cpu/w4a16_dot_sass.json. Dequantization drops from 7-9.5 to 5.4-6.8 instructions per weight, but
# one of those is now a 16-bit shared-memory store (STS.U16): each thread holds eight consecutive k of one
# column, while Triton lays the tile out in shared memory with n fastest (an explicit layout, as Gluon
# allows, would be needed to change that).


@triton.jit
def _bits16(v):
    """The 16 bits of each 16-bit float in v, zero-extended to int32."""
    return v.to(tl.int16, bitcast=True).to(tl.int32) & 65535


@triton.jit
def _split16(v, DTYPE: tl.constexpr):
    """Each int32 of v as its two 16-bit floats (low half, high half) of DTYPE."""
    return v.to(tl.int16).to(DTYPE, bitcast=True), (v >> 16).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit
def _pair(packed, j: tl.constexpr, neg_z2, s2, MAGIC: tl.constexpr, BF16: tl.constexpr):
    """Weights j and j + 4 of each packed int32, (q - z) s, as a pair of 16-bit floats in an int32."""
    v = ((packed >> (4 * j)) & 0x000F000F) | MAGIC  # (128 + q_j, 128 + q_j+4)
    q_minus_z = _fma2(v, 0x3F803F80 if BF16 else 0x3C003C00, neg_z2, BF16)  # * 1.0 - (128 + z): exact
    return _fma2(q_minus_z, s2, -2147450880, BF16)  # * s + (-0.0): rounded once


@triton.jit
def dequant_tile_pairs(packed, scale, zero, DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """packed int32 [BLOCK_K // 8, BLOCK_N] (input k = 8r + j in bits 4j..4j+3 of row r) -> the weight tile
    [BLOCK_K, BLOCK_N] in DTYPE (bf16 or fp16): (q - z) s. scale: DTYPE, zero: int32 in 0..15, each
    [BLOCK_K // 8, BLOCK_N] or [1, BLOCK_N] (one group for the whole tile)."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    MAGIC: tl.constexpr = 0x43004300 if BF16 else 0x64006400  # 128.0 or 1024.0 in both halves
    s = _bits16(scale)
    s2 = s | (s << 16)
    neg_z2 = (zero | (zero << 16)) | (MAGIC ^ -2147450880)  # -(128 + z) in both halves (sign bits 0x80008000)
    p0 = tl.join(*_split16(_pair(packed, 0, neg_z2, s2, MAGIC, BF16), DTYPE))  # [KP, N, h]: k = 8r + 4h
    p1 = tl.join(*_split16(_pair(packed, 1, neg_z2, s2, MAGIC, BF16), DTYPE))  # k = 8r + 4h + 1
    p2 = tl.join(*_split16(_pair(packed, 2, neg_z2, s2, MAGIC, BF16), DTYPE))  # k = 8r + 4h + 2
    p3 = tl.join(*_split16(_pair(packed, 3, neg_z2, s2, MAGIC, BF16), DTYPE))  # k = 8r + 4h + 3
    # [KP, N, h, b1, b0] with k - 8r = 4h + 2 b1 + b0; b0 joined last, so that it varies fastest in each thread's
    # registers, as k does in memory.
    w = tl.join(tl.join(p0, p2), tl.join(p1, p3))
    return tl.reshape(tl.permute(w, (0, 2, 3, 4, 1)), (BLOCK_K, BLOCK_N))
