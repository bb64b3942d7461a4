"""INT4 weights in fp32 math: a nibble read as the float 1 + q / 16, for the W4A16 GEMV and dot (``quant_matmul.py``).

Why: an int->float conversion (I2F) issues at 1/8 of the FMA rate (CUDA C Programming Guide,
arithmetic instruction throughput, cc 9.0), slower than HBM delivers nibbles. Instead the integer is
written into the mantissa of a float (the trick of FasterTransformer's and Marlin's converters: Kim et
al., https://arxiv.org/abs/2211.10017; Frantar et al., https://arxiv.org/abs/2408.11743): a nibble q
shifted into mantissa bits 19..22 under the exponent of 1.0 (bits 0x3F800000) *is* the float
1 + q / 16, one shift and one LOP3 per weight. The GEMV multiplies x into 1 + q / 16 and corrects
once per packed row: sum_j x_j (q_j - z) = 16 (sum_j x_j (1 + q_j / 16) - (1 + z / 16) sum_j x_j),
so a weight costs a shift, a LOP3 and one FMA (about 5.5 instructions per weight in all on sm_90, by
the SASS); the dot forms (1 + q/16 - (1 + z/16)) * 16 s = (q - z) s. Computing 1 + q / 16 rather
than q keeps the products and sums near 1, so fp32 loses nothing. (The 16-bit variants,
``w4_gemv_pairs.py`` and ``w4_dot_pairs.py``, work on pairs of 16-bit floats instead.)
"""

from __future__ import annotations

import triton
import triton.language as tl

ONE_BITS = 0x3F800000  # the float 1.0: mantissa bits 19..22 under its exponent count sixteenths


@triton.jit
def one_plus_sixteenth(v, one_bits):
    """1 + v / 16 as fp32, exactly, for int32 v whose bits 19..22 hold v (all other bits are ignored).
    ``one_bits`` is 0x3F800000, the float 1.0, passed in as an argument: as a second immediate next to
    the mask it would cost an extra instruction per weight (ptxas re-creates it before every LOP3)."""
    return ((v & 0x00780000) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def nibble(packed, j: tl.constexpr, one_bits):
    """1 + q / 16 for nibble j (bits 4j..4j+3) of each packed int32: one shift and one LOP3 each."""
    if 4 * j <= 19:
        return one_plus_sixteenth(packed << (19 - 4 * j), one_bits)
    else:
        return one_plus_sixteenth(packed >> (4 * j - 19), one_bits)


@triton.jit
def zero_point(packed_zero, n, one_bits):
    """1 + z / 16 for columns n, from zeros packed eight columns per int32 (nibble n % 8)."""
    return one_plus_sixteenth((packed_zero >> ((n % 8) * 4)) << 19, one_bits)


@triton.jit
def int4_tile(QW, S, Z, r0, end, n, N, group_size, one_bits, stride_q, stride_s, stride_z, BLOCK_KP: tl.constexpr):
    """Packed rows r = r0 .. r0 + BLOCK_KP (those below end) of columns n: (r, the packed int32 words,
    their scales in fp32, 1 + zero / 16), each [BLOCK_KP, len(n)] but r."""
    r = r0 + tl.arange(0, BLOCK_KP)
    mask = (r < end)[:, None] & (n < N)[None, :]
    packed = tl.load(QW + r[:, None] * stride_q + n[None, :], mask=mask, other=0)
    g = (8 * r) // group_size  # all eight weights of packed row r share this group (group_size % 8 == 0)
    scale = tl.load(S + g[:, None] * stride_s + n[None, :], mask=mask, other=0.0).to(tl.float32)
    packed_zero = tl.load(Z + g[:, None] * stride_z + (n // 8)[None, :], mask=mask, other=0)
    return r, packed, scale, zero_point(packed_zero, n[None, :], one_bits)


@triton.jit
def dequant_tile(packed, r, mask, n, N, S, Z, k0, group_size, one_bits, stride_s, stride_z,
                 ONE_GROUP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dot's weight tile [BLOCK_K, BLOCK_N] in DTYPE from BLOCK_K // 8 packed rows, in fp32 math."""
    # Row k = 8r + j of the tile is nibble j of packed row r: shifting each packed word by 4j for
    # j = 0..7 gives a [BLOCK_K // 8, 8, BLOCK_N] block whose row-major order is k's order.
    shifts = 4 * tl.arange(0, 8)
    nibbles = one_plus_sixteenth((packed[:, None, :] >> shifts[None, :, None]) << 19, one_bits)
    if ONE_GROUP:  # one scale and zero per column for the whole tile
        g = k0 // group_size
        scale = 16.0 * tl.load(S + g * stride_s + n, mask=n < N, other=0.0).to(tl.float32)
        zero = zero_point(tl.load(Z + g * stride_z + n // 8, mask=n < N, other=0), n, one_bits)
        w = (nibbles - zero[None, None, :]) * scale[None, None, :]
    else:
        g = (8 * r) // group_size  # the eight weights of a packed row share a group (group_size % 8 == 0)
        scale = 16.0 * tl.load(S + g[:, None] * stride_s + n[None, :], mask=mask, other=0.0).to(tl.float32)
        packed_zero = tl.load(Z + g[:, None] * stride_z + (n // 8)[None, :], mask=mask, other=0)
        zero = zero_point(packed_zero, n[None, :], one_bits)
        w = (nibbles - zero[:, None, :]) * scale[:, None, :]
    # (1 + q/16 - (1 + z/16)) * 16 s = (q - z) s exactly in fp32, rounded once to x's dtype: the
    # reference's weight. Rounded before the reshape, so a reshape that moves data moves half the bytes.
    return tl.reshape(w.to(DTYPE), (BLOCK_K, BLOCK_N))
