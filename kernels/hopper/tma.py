"""What Hopper's tensor memory accelerator (TMA) asks of a tensor before a descriptor can describe it: the Gluon
kernels here (``flash_attention.py``, ``paged_decode.py``, the W4A16 GEMVs) copy their tiles through TMA descriptors
and check their inputs with these first.

Why TMA: with pointer loads every tile is gathered by instructions whose addresses the warps compute themselves;
a TMA copy moves a whole box from global to shared memory in one instruction (UTMALDG), from a 128-byte descriptor
that holds the tensor's base, shape and strides; the hardware computes the addresses and fills rows outside the shape
with zeros (NVIDIA, CUDA C++ Programming Guide, "Tensor Memory Access"). A descriptor needs its base and every stride
but the last on 16-byte boundaries, and the last dimension contiguous.
"""

from __future__ import annotations

import torch

TMA_ALIGN = 16  # bytes: a descriptor's base and its row stride (CUDA driver API, cuTensorMapEncodeTiled)


def not_describable(name: str, t: torch.Tensor) -> str | None:
    """Why ``t`` [tokens, heads, head_dim] cannot back a descriptor of one head (contiguous channels, base and
    token/head strides on 16-byte boundaries), or None if it can."""
    size = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} has strides {t.stride()}; TMA needs a contiguous last dim"
    if t.data_ptr() % TMA_ALIGN:
        return (f"{name}'s data pointer is {t.data_ptr() % TMA_ALIGN} bytes past a {TMA_ALIGN}-byte boundary; "
                "TMA needs it on one")
    for dim in (0, 1):
        if t.stride(dim) * size % TMA_ALIGN:
            return (f"{name}.stride({dim}) is {t.stride(dim)} elements of {size} bytes; TMA needs a multiple of "
                    f"{TMA_ALIGN} bytes")
    return None
