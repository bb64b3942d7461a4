"""Integer <-> float conversions by bit tricks, shared by the kernels that need them.

Why: on Hopper an int->float conversion (I2F) issues at 1/8 of the FMA rate (CUDA C Programming
Guide, arithmetic instruction throughput, cc 9.0). A kernel that converts one int8 per byte it
reads (a W8A16 matmul, attention over an int8 KV cache) can then be bound by conversions rather
than by memory. The same value comes from an integer add and a float subtract:

- an int8 v added to the bits of 1.5 * 2**23 (0x4B400000), whose last mantissa bit is worth 1,
  is the float 12582912 + v; subtracting 12582912 leaves v, exactly (the trick of FasterTransformer's
  converters: Kim et al., https://arxiv.org/abs/2211.10017);
- conversely, adding 12582912 to an fp32 y with |y| < 2**22 rounds it to an integer (ties to even,
  as IEEE addition rounds), and subtracting it gives that integer as a float: torch.round's result.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
