"""Integer <-> float conversions by bit tricks, shared by the kernels that need them.

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

from minillm.kernels.checks import interpreter_on

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
