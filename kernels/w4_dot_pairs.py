"""The W4A16 dot's weight tile dequantized two weights per instruction: ``quant_matmul``'s PAIRS variant.

Why it exists: from M = 16 to 64 the dot path was never faster than bf16 ``torch.matmul`` on an H200
(0.38 to 0.91 times its speed, figures/h200/sweeps/w4a16_dot.json), though it reads a quarter of the
bytes. Its tile is dequantized one fp32 weight at a time: two shifts, a LOP3, a subtract, a multiply
and half a conversion per weight before the tensor cores see it. Here a packed int32's nibbles j and
j + 4 become one *pair* of 16-bit floats in a single LOP3, the idea of FasterTransformer's and Marlin's
converters (Kim et al., https://arxiv.org/abs/2211.10017; Frantar et al., https://arxiv.org/abs/2408.11743):

- ``(packed >> 4j) & 0x000F000F | MAGIC`` puts nibble j in the low half's mantissa and nibble j + 4
  in the high half's, under the exponent of 128.0 (bf16, 0x4300: 7 mantissa bits, each worth 1) or
  1024.0 (fp16, 0x6400: 10 bits, each worth 1), so the halves are exactly 128 + q (or 1024 + q);
- one HFMA2 subtracts the pair (128 + z, 128 + z): (q - z) exactly, an integer in [-15, 15];
- one more multiplies by (s, s): (q - z) s rounded once to 16 bits, which is the reference's weight
  (``dequantize_int4`` rounds the exact fp32 product once), so the dot sees the same numbers.

Eight weights cost three shifts, four LOP3s and eight HFMA2s; the pairs are then split into 16-bit
values and joined so that rows come out in k's order (k = 8r + j is the low half of pair j, 8r + j + 4
its high half). What that join and the tensor-core operand layout cost is in the SASS:
figures/cpu/w4a16_dot_sass.json. Dequantization drops from 7-9.5 to 5.4-6.8 instructions per weight, but
one of those is now a 16-bit shared-memory store (STS.U16): each thread holds eight consecutive k of one
column, while Triton lays the tile out in shared memory with n fastest. Building the tile transposed
([N, K], so a K-major layout would take 16-byte stores) did not change Triton 3.9's choice with SWAP_AB,
and without it failed to compile ("Illegal shared layout"); an explicit layout (Gluon) is the next step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minillm.kernels.w4_gemv_pairs import _fma2


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
