"""INT4 packing and dequantization in plain torch: the layout ``kernels/quant_matmul.py`` reads.

Why a file of its own: it imports no Triton, so the quantization code and its CPU path (a
dequantize-then-matmul) can use the one definition of the layout on any machine.

Eight 4-bit values fill one int32, value j of the eight in bits 4j..4j+3 (GPTQ's "v1" packing):
- weights along the input dim K: ``qweight`` int32 [K // 8, N], input k = 8i + j in row i;
- zero points along the output dim N: ``zeros`` int32 [groups, N // 8], column n = 8c + j in column c.
"""

from __future__ import annotations

import sys

import torch

def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, ...] codes in [0, 2^bits) -> int32 [R * bits // 32, ...]: code of row r = (32 // bits) i + j
    in bits j*bits.. of row i. The top code's high bit lands in the sign bit: int32 wraps, as GPTQ's
    words do, and readers shift and mask, which sign does not disturb. 4 bits for the runtime layout,
    8 for GPTQ checkpoints of INT8 weights."""
    per_word = 32 // bits
    if codes.shape[0] % per_word:
        raise ValueError(f"{codes.shape[0]} rows do not pack into int32 words of {per_word} {bits}-bit codes; "
                         f"the dimension must be a multiple of {per_word}")
    parts = codes.to(torch.int32).reshape(-1, per_word, *codes.shape[1:])
    packed = torch.zeros_like(parts[:, 0])
    for j in range(per_word):
        packed |= parts[:, j] << (bits * j)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_codes``: int32 [R * bits // 32, ...] -> int32 codes [R, ...]."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts.view(1, per_word, *[1] * (packed.dim() - 1))) & (2 ** bits - 1)
    return codes.reshape(-1, *packed.shape[1:])


def unpack_int4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_codes(packed, 4)`` as uint8 [K, N], a quarter of the memory traffic: each int32 read as its four
    bytes (little-endian: byte b holds codes 2b and 2b + 1 in its low and high nibble), the bytes gathered per
    position, then split. The CPU's dequantize-then-matmul spends most of its time unpacking, hence this path."""
    if sys.byteorder != "little":
        return unpack_codes(packed, 4).to(torch.uint8)
    rows, n = packed.shape
    word_bytes = packed.contiguous().view(torch.uint8).view(rows, n, 4).transpose(1, 2).contiguous()  # [K/8, 4, N]
    codes = torch.empty(rows, 4, 2, n, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(word_bytes, 15, out=codes[:, :, 0])
    torch.bitwise_right_shift(word_bytes, 4, out=codes[:, :, 1])
    return codes.view(rows * 8, n)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] with values in 0..15 -> int32 [K // 8, N]: q[8i + j, n] in bits 4j..4j+3 of row i
    (``pack_codes`` at 4 bits, after checking the shape and the range)."""
    if q.dim() != 2 or q.shape[0] % 8 != 0:
        raise ValueError(f"q must be [K, N] with K a multiple of 8, got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"q.dtype is {q.dtype}; expected an integer dtype holding 0..15")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"q holds values in {int(q.min())}..{int(q.max())}; expected 0..15")
    return pack_codes(q, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> int32 [K, N] in 0..15: the inverse of ``pack_int4``."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(f"packed must be int32 [K // 8, N], got {packed.dtype} of shape {tuple(packed.shape)}")
    return unpack_codes(packed, 4)


def pack_int4_along_n(z: torch.Tensor) -> torch.Tensor:
    """int [G, N] in 0..15 -> int32 [G, N // 8]: z[g, 8c + j] in bits 4j..4j+3 of column c (the zeros' layout)."""
    if z.dim() != 2:
        raise ValueError(f"z must be [groups, N], got shape {tuple(z.shape)}")
    return pack_int4(z.t()).t().contiguous()


def unpack_int4_along_n(packed: torch.Tensor) -> torch.Tensor:
    """int32 [G, N // 8] -> int32 [G, N] in 0..15: the inverse of ``pack_int4_along_n``."""
    if packed.dim() != 2:
        raise ValueError(f"packed must be int32 [groups, N // 8], got shape {tuple(packed.shape)}")
    return unpack_int4(packed.t()).t().contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [K, N] in ``dtype``: w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n], computed
    in fp32 and rounded once. group_size -1 (or K) means one group per column."""
    q = unpack_int4(qweight)
    k = q.shape[0]
    group = k if group_size == -1 else group_size
    if group <= 0:
        raise ValueError(f"group_size is {group_size}; expected a positive size or -1 (one group per column)")
    g = torch.arange(k, device=q.device) // group
    z = unpack_int4_along_n(zeros)
    if scales.shape != z.shape or scales.shape[0] != -(-k // group):
        raise ValueError(f"scales {tuple(scales.shape)} and zeros (unpacked) {tuple(z.shape)} must both be "
                         f"[ceil(K / group_size), N] = [{-(-k // group)}, {q.shape[1]}]")
    return ((q - z[g]).float() * scales[g].float()).to(dtype)
