# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex06_kv_int8.py by exercises/make_stubs.py.
"""Exercise 06: quantize K and V to INT8, one scale per token and head, and back.

Notebook 06 shows why an INT8 KV cache doubles the tokens a card holds (a quarter of fp32's bytes,
half of bf16's) at a small error. The scheme is symmetric absmax quantization: for each vector of
``head_dim`` values (one token, one head), one scale maps the largest magnitude to 127, and every value
is stored as the nearest integer code in [-127, 127]::

    x ≈ code · scale

The scale is stored in float16 (2 bytes per token and head), so it is rounded before use: divide by the
scale *as stored*, or the codes and the stored scale disagree. Two corner cases: a vector of zeros
(its scale must not be 0: clamp it to at least ``SMALLEST_SCALE``), and a value pushed past 127 by the
rounded scale (clamp the scaled values to [-127, 127] before rounding).

Where it lives in minillm: ``quantize_kv(x, "int8")`` and ``dequantize_kv`` in ``minillm/kv/quant.py``;
the engine uses them with ``LLM(kv_cache_dtype="int8")`` (on a GPU, ``kernels/kv_store.py`` does the
same arithmetic inside the kernel that writes the cache). ``test_wired_into_minillm`` checks that
yours gives minillm's codes and scales bit for bit, so it could replace them.

Test your version (from the repository root)::

    .venv/bin/pytest exercises/tests/test_ex06_kv_int8.py
"""

from __future__ import annotations

import torch

SMALLEST_SCALE = 2.0 ** -24  # float16's smallest positive value: the floor for an all-zero vector's scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V ``[..., head_dim]`` (any float dtype) -> ``(codes, scale)``.

    Returns:
        codes: ``[..., head_dim]`` int8 in [-127, 127];
        scale: ``[...]`` float16, one per vector, such that ``codes * scale`` is within half a step
        (``scale / 2``) of ``x``.

    Hints:
        - Work in float32, and reduce over the last dimension only.
        - To match minillm bit for bit: multiply by ``1 / 127`` rather than dividing by 127 (torch on a
          GPU computes a division by a scalar that way), and keep the scale inside float16's range
          before you cast it.
    """
    raise NotImplementedError("ex06: one float16 scale per vector, then the vector's codes")


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse: ``[..., head_dim]`` in ``dtype``. Hint: compute in float32, then cast."""
    raise NotImplementedError("ex06: from codes and scales back to values")
