"""The model's dense (unquantized) linear layers, whose one-row products may run minillm's GEMV kernel.

Why it exists: at batch-1 decode every linear layer is a matrix-vector product whose time is its
weight's bytes over the bandwidth it reaches. On an H200, ``kernels/gemv.py`` beats cuBLAS on every
Llama-2-7B projection, whole or halved by tensor parallelism, by 5-16 %
(``figures/h200/sweeps/gemv_bf16.json``), and on Hopper it starts while the kernel ahead of it still
runs (``kernels/hopper/pdl.py``). So ``LlamaForCausalLM.enable_fused_kernels`` points every layer's ``gemv``
at that kernel. A product takes
it only where it can: one row of 16-bit x on a GPU, and no bias (Qwen2's qkv bias keeps cuBLAS, which
adds it before rounding, as transformers does). Everything else is ``F.linear``, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, gemv, width: int) -> bool:
    """Whether ``gemv`` can take x: one 16-bit row of ``width`` on a GPU, the weight contiguous along K."""
    return (gemv is not None and x.is_cuda and x.shape[-1] == x.numel() == width and weight.stride(1) == 1
            and x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16))


def product(x: torch.Tensor, weight: torch.Tensor, gemv, gated: bool = False) -> torch.Tensor:
    """x @ weight^T: by ``gemv`` (the ``kernels.gemv`` module, or None) where x is one 16-bit row on a GPU.
    ``gated``: x is the MLP's gate_up row and the GEMV computes silu(gate) * up as it loads it; only where
    ``takes_gated`` said the layer can."""
    if gated:
        if not _gemv_fits(x, weight, gemv, 2 * weight.shape[1]):
            raise ValueError(f"gated=True needs the Triton GEMV and one 16-bit gate_up row of {2 * weight.shape[1]} "
                             f"on a GPU (takes_gated); got {x.dtype} {tuple(x.shape)} on {x.device}, GEMV "
                             f"{'on' if gemv is not None else 'off'}")
        return gemv.gemv(x.reshape(1, -1), weight, gated=True).view(*x.shape[:-1], weight.shape[0])
    if _gemv_fits(x, weight, gemv, weight.shape[1]):
        return gemv.gemv(x.reshape(1, -1), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def takes_gated(layer: nn.Module, gate_up: torch.Tensor) -> bool:
    """Whether ``layer(gate_up, gated=True)`` works: a layer that says so itself (``QuantLinear.takes_gated``), or a
    bias-free layer built on ``product`` (``Linear``, the tensor-parallel row-parallel linear) whose product of this
    one row goes to the GEMV. The MLP then leaves SiLU-and-multiply to down_proj's GEMV (``kernels/gemv.py``, or
    ``w4_gemv_fused.fused_gemv``) instead of launching a kernel for it. (A forward hook on such a down_proj then sees
    gate_up as its input; calibration hooks run on many rows, never this path.)"""
    own = getattr(layer, "takes_gated", None)
    if callable(own):  # a layer with a gated kernel of its own (QuantLinear's INT4 GEMV)
        return own(gate_up)
    weight = getattr(layer, "weight", None)
    return (getattr(layer, "bias", True) is None and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and _gemv_fits(gate_up, weight, getattr(layer, "gemv", None), 2 * weight.shape[1]))


class Linear(nn.Linear):
    """``nn.Linear`` with ``product``'s choice of kernel (bias-free layers only)."""

    gemv = None  # kernels.gemv once enable_fused_kernels() is called

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        if self.bias is not None:
            if gated:
                raise ValueError("gated=True is for bias-free layers only (takes_gated)")
            return F.linear(x, self.weight, self.bias)
        return product(x, self.weight, self.gemv, gated)
