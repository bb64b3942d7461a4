"""The quantized KV-cache formats, as the kernels read them: storage dtypes, scale shapes, the dequantization.

Why a file of its own: the kernels (``kv_store.py``, ``kv_dequant.py``, the attention kernels) and the engine's
cache (``minillm/kv/quant.py``, which quantizes and says why each format is what it is) must agree on one
definition of each format, and the kernels import nothing from ``minillm``; so the definition lives here, below
both, and imports no Triton.

Per token and KV head (a vector of ``head_dim`` values):

- ``"int8"``: int8 codes and one fp16 scale, x ~ q * s, |q| <= 127;
- ``"fp8"``: float8 e4m3 codes and one fp16 scale, x ~ q * s, |q| <= 448;
- ``"int4"``: uint8 bytes of two codes (byte j: channel j in the low nibble, channel j + head_dim / 2 in the high
  one) and, for each group of ``INT4_GROUP_SIZE`` channels, an fp16 scale and minimum: x ~ q * s + m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "int4", "fp8")
INT4_GROUP_SIZE = 16
SCALE_DTYPE = torch.float16
# The element type of each quantized format's pools; the kernels tell the formats apart by it.
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CODE_MAX = {"int8": 127.0, "fp8": FP8_MAX}  # the largest |code| of the per-token formats (symmetric)


@dataclass(frozen=True)
class KVLayout:
    """How one token of one KV head is stored: K/V pools of ``dtype`` with last dim ``width``, and
    scale pools (K's and V's) with ``scale_shape`` per token-head — None for no scales, () for one."""

    dtype: torch.dtype
    width: int
    scale_shape: tuple[int, ...] | None

    def bytes_per_token_head(self) -> int:
        """K or V bytes (one of them) of one token in one KV head, scales included."""
        data = self.width * self.dtype.itemsize
        if self.scale_shape is None:
            return data
        return data + SCALE_DTYPE.itemsize * int(torch.Size(self.scale_shape).numel())


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; valid: {KV_CACHE_DTYPES}")


def kv_layout(kv_cache_dtype: str, head_dim: int, dtype: torch.dtype) -> KVLayout:
    """The storage of ``kv_cache_dtype`` for heads of ``head_dim``; "auto" stores the model's ``dtype``."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return KVLayout(dtype, head_dim, None)
    if kv_cache_dtype == "int4":
        if head_dim % INT4_GROUP_SIZE:
            raise ValueError(f"kv_cache_dtype='int4' quantizes groups of {INT4_GROUP_SIZE} channels, but "
                             f"head_dim={head_dim} is not a multiple of {INT4_GROUP_SIZE}; use 'int8' or 'fp8'")
        return KVLayout(torch.uint8, head_dim // 2, (head_dim // INT4_GROUP_SIZE, 2))
    return KVLayout(STORAGE_DTYPES[kv_cache_dtype], head_dim, ())


def format_of(storage: torch.dtype) -> str:
    """The kv_cache_dtype a pool of element type ``storage`` holds ("auto" for a float pool)."""
    for name, dtype in STORAGE_DTYPES.items():
        if storage == dtype:
            return name
    return "auto"


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """K or V codes back to values [..., head_dim] in ``dtype`` (the format read from ``data``'s dtype); a float
    pool without scales comes back as it is, cast to ``dtype``."""
    kind = format_of(data.dtype)
    if kind == "auto":
        return data.to(dtype)
    if kind == "int4":
        q = torch.cat([data & 15, data >> 4], dim=-1).float()
        groups = q.unflatten(-1, (scale.shape[-2], -1))
        x = groups * scale[..., 0, None].float() + scale[..., 1, None].float()
        return x.flatten(-2).to(dtype)
    return (data.float() * scale.float()[..., None]).to(dtype)
