"""Exercise 07, part 1: group-wise round-to-nearest (RTN) quantization, packed eight INT4 codes to an int32.

A weight matrix ``w`` [out, in] in float32 takes 4 bytes a weight. INT4 takes half a byte: each
weight becomes a *code* q in 0..15, and a small group of weights shares one float scale ``s`` and one
integer zero point ``z``, so that ``w ≈ (q - z) * s``. Groups run along the input dimension: output
channel n's inputs [k0, k0 + group_size) form one group (``group_size=-1``: the whole row is one
group). Smaller groups follow the weights more closely and cost more scales.

For each group (GPTQ's quantizer, which minillm uses everywhere):

- its range [min, max] is widened to contain 0; asymmetric: ``s = (max - min) / 15`` and
  ``z = round(-min / s)``; symmetric: ``s = 2 * max|w| / 15`` and ``z = 8``;
- ``q = clamp(round(w / s) + z, 0, 15)``.

``minillm.quant.rtn.minmax_params(rows, bits, sym)`` gives ``s`` and ``z`` for each row of a 2-D
tensor (it also rounds ``s`` up to a float16 value, as checkpoints store it): use it. Your part is the
grouping and the codes. Watch the last group: SmolLM2's layers have 576 inputs, and 576 / 128 = 4.5,
so with ``group_size=128`` the fifth group holds only 64 weights.

Worked example, one row of four weights in one asymmetric group::

    w = [0.0, 0.3, -0.45, 0.15]     range [-0.45, 0.3]  ->  s = 0.75 / 15 = 0.05,  z = round(9.0) = 9
    q = [9, 15, 0, 12]              (0.0 / 0.05 + 9,  0.3 / 0.05 + 9,  -9 + 9,  3 + 9)

Then the codes are **packed** for the kernels (the GPTQ v1 layout, ``minillm/quant/linear.py``): the
codes are laid out input-major, [in, out], and input rows k = 8 i + j of a column go into bits
4j..4j+3 of word i, so [in, out] codes become int32 [in / 8, out]. Worked example, one column::

    codes 1 2 3 4 5 6 7 8 (rows 0..7)  ->  0x87654321  (row 0 in the lowest 4 bits)

As a signed int32 that word is negative (the top code sets the sign bit); that is fine, the bits
are what count.

Where it lives in minillm: ``minillm/quant/rtn.py`` (``quantize_groupwise``) and
``minillm/quant/linear.py`` (``pack``, here for bits=4). Both are looked up when a model is quantized,
so you can swap yours in::

    import minillm.quant.rtn as rtn, minillm.quant.linear as linear
    from exercises.ex07_rtn_int4 import quantize_groupwise, pack_int4   # yours (from the repo root)

    rtn.quantize_groupwise = quantize_groupwise
    linear.pack = lambda codes, bits: pack_int4(codes)                  # minillm packs INT4 only here
    llm = LLM(quantization="rtn-int4-g64")                              # quantized by your code

``test_wired_into_minillm`` does that on a small model and compares every packed buffer and the
greedy tokens with minillm's own.

Test your version (from the repository root)::

    pytest exercises/tests/test_ex07_rtn_int4.py --impl=mine
"""

from __future__ import annotations

import torch

from minillm.quant.rtn import minmax_params


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest of ``w`` [out, in] in groups of ``group_size`` inputs (-1: one group a row).

    Returns:
        ``codes`` [out, in] uint8 in 0..2^bits - 1; ``scales`` [out, groups] float32; ``zeros``
        [out, groups] int32, where groups = ceil(in / group_size) and the last group may be short.
        ``w`` is not modified.

    Hints:
        - Loop over group starts ``range(0, in, size)``: ``w[:, start:start + size]`` is one group for
          every output channel at once, and it is automatically short at the end.
        - ``minmax_params(group, bits, sym)`` returns float32 ``scale`` and ``zero`` of shape [out];
          broadcast them with ``[:, None]``. Convert the codes with ``.to(torch.uint8)`` and the
          stacked zeros with ``.to(torch.int32)``.
    """
    # BEGIN SOLUTION: per group, its scale and zero point, then every weight's code
    in_features = w.shape[1]
    size = in_features if group_size == -1 else group_size
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scales, zeros = [], []
    for start in range(0, in_features, size):
        group = w[:, start:start + size].float()
        scale, zero = minmax_params(group, bits, sym)
        q = torch.clamp(torch.round(group / scale[:, None]) + zero[:, None], 0, 2 ** bits - 1)
        codes[:, start:start + size] = q.to(torch.uint8)
        scales.append(scale)
        zeros.append(zero)
    return codes, torch.stack(scales, dim=1), torch.stack(zeros, dim=1).to(torch.int32)
    # END SOLUTION


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack INT4 codes [rows, cols] (any integer dtype, values 0..15) into int32 [rows / 8, cols]:
    row 8 i + j of a column goes into bits 4j..4j+3 of word i. Raise ValueError (naming the row
    count) when rows is not a multiple of 8.

    Hints:
        - ``codes.to(torch.int32).reshape(rows // 8, 8, cols)`` puts the eight codes of each word on
          the middle axis; shift each by ``4 * j`` (``<<``) and combine them with ``|``.
    """
    # BEGIN SOLUTION: reshape to [rows / 8, 8, cols], shift code j left by 4 j, OR them together
    rows, cols = codes.shape
    if rows % 8:
        raise ValueError(f"{rows} rows do not pack into words of 8 INT4 codes; need a multiple of 8")
    parts = codes.to(torch.int32).reshape(rows // 8, 8, cols)
    packed = torch.zeros(rows // 8, cols, dtype=torch.int32, device=codes.device)
    for j in range(8):
        packed |= parts[:, j] << (4 * j)
    return packed
    # END SOLUTION
