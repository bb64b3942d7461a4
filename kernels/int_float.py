"""Integer <-> float conversions by bit tricks, shared by the kernels that need them: int8 codes, and INT4 weights
read as 1 + q / 16 for the fp32 bodies of the W4A16 GEMV and dot (the second part of this file).

Why: on Hopper an int->float conversion (I2F) issues at 1/8 of the FMA rate (CUDA C Programming
Guide, arithmetic instruction throughput, cc 9.0). A kernel that converts one int8 per byte it
reads (a W8A16 matmul, attention over an int8 KV cache) can then be bound by conversions rather
than by memory. The same value comes from an integer add and a float subtract:

- an int8 v added to the bits of 1.5 * 2**23 (0x4B400000), whose last mantissa bit is worth 1,
  is the float 12582912 + v; subtracting 12582912 leaves v, exactly (the trick of FasterTransformer's
  converters: Kim et al., https://arxiv.org/abs/2211.10017);
- conversely, adding 12582912 to an fp32 y with |y| < 2**22 rounds it to an integer (ties to even,
  as IEEE addition rounds), and subtracting it gives that integer as a float: torch.round's result;
- four int8s to four fp16s at once (``int8_words_to_fp16``): flipping each byte's sign bit makes it
  v + 128, an unsigned byte u; placed under the high byte 0x64 it is the fp16 1024 + u (whose last
  mantissa bit is worth 1), and one packed subtract of 1152 leaves v in both halves. Per four values:
  a LOP3, two PRMTs and two HSUB2s, where ``int8_to_float`` spends an add and a subtract on each
  value and a pack on each pair (FasterTransformer's fast_int8_to_half, in the same paper).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checks import interpreter_on

ASM = tl.constexpr(not interpreter_on())  # inline PTX; the interpreter runs none, so it gets the same values in tl

MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
MAGIC_BITS = tl.constexpr(0x4B400000)  # its bits


@triton.jit
def int8_to_float(q):
    """int8 (or any integer in [-2**22, 2**22)) -> the same value in fp32, without an I2F."""
    return (q.to(tl.int32) + MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def round_half_even(y):
    """fp32 y with |y| < 2**22 -> the nearest integer as fp32, ties to even (torch.round)."""
    return (y + MAGIC) - MAGIC


@triton.jit
def int8_words_to_fp16(words):
    """int32 words [N, W], each four int8s (the first in the low byte) -> their values in fp16, [N, 4 W], exact
    (|value| <= 128), four per five instructions on a GPU. Taking words rather than int8s keeps the four
    bytes in one register, loaded as they lie in memory; the conversion then works in that load's layout."""
    if ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            """{ .reg .b32 u, high, bias, lo, hi;
            xor.b32 u, $4, 0x80808080;
            mov.b32 high, 0x64646464;
            mov.b32 bias, 0x64806480;
            prmt.b32 lo, u, high, 0x5140;
            prmt.b32 hi, u, high, 0x5342;
            sub.f16x2 lo, lo, bias;
            sub.f16x2 hi, hi, bias;
            mov.b32 {$0, $1}, lo;
            mov.b32 {$2, $3}, hi; }""",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:  # byte i sign-extended by shifting it to the top and back
        v0 = int8_to_float((words << 24) >> 24).to(tl.float16)
        v1 = int8_to_float((words << 16) >> 24).to(tl.float16)
        v2 = int8_to_float((words << 8) >> 24).to(tl.float16)
        v3 = int8_to_float(words >> 24).to(tl.float16)
    N: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    # join(join(v0, v2), join(v1, v3))[n, w, i, j] = v_(2 i + j): byte 2 i + j of word w, channel 4 w + 2 i + j
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [N, 4 * W])


# ----------------------------------------------------------------------------- INT4 nibbles as 1 + q / 16
# INT4 weights in fp32 math: a nibble read as the float 1 + q / 16, for the W4A16 GEMV and dot (``quant_matmul.py``).
#
# Why: an int->float conversion (I2F) issues at 1/8 of the FMA rate (CUDA C Programming Guide,
# arithmetic instruction throughput, cc 9.0), slower than HBM delivers nibbles. Instead the integer is
# written into the mantissa of a float (the trick of FasterTransformer's and Marlin's converters: Kim et
# al., https://arxiv.org/abs/2211.10017; Frantar et al., https://arxiv.org/abs/2408.11743): a nibble q
# shifted into mantissa bits 19..22 under the exponent of 1.0 (bits 0x3F800000) *is* the float
# 1 + q / 16, one shift and one LOP3 per weight. The GEMV multiplies x into 1 + q / 16 and corrects
# once per packed row: sum_j x_j (q_j - z) = 16 (sum_j x_j (1 + q_j / 16) - (1 + z / 16) sum_j x_j),
# so a weight costs a shift, a LOP3 and one FMA (about 5.5 instructions per weight in all on sm_90, by
# the SASS); the dot forms (1 + q/16 - (1 + z/16)) * 16 s = (q - z) s. Computing 1 + q / 16 rather
# than q keeps the products and sums near 1, so fp32 loses nothing. (The 16-bit variants,
# ``w4_pairs.py``, work on pairs of 16-bit floats instead.)


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
