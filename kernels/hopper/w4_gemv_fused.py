"""A batch-1 decoder layer's INT4 GEMV with what surrounds it folded in, from Python: ``fused_gemv`` runs
``w4_gemv``'s split-K kernel with SiLU-and-multiply applied to its input (the MLP's down projection), the RMSNorm ahead
of it applied to its input, or the residual added to its output (``w4_gemv_norms.py``), and ``fused_unsupported``
says why it cannot. ``QuantLinear`` calls them; each form is tested against the unfused kernels it replaces
(tests/kernels/test_hopper_w4_gemv.py, test_hopper_w4_gemv_norms.py).
"""

from __future__ import annotations

import torch

from ..int4_dequantize import check_int4_layout
from .w4_gemv import gemv, splits_needed, unsupported
from ..fused_layer_ops import Norm, Rms, holds_squares


def fused_unsupported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, gated: bool = False, residual: torch.Tensor | None = None,
                      norm: Norm | None = None, squares: torch.Tensor | None = None,
                      rms: Rms | None = None) -> str | None:
    """Why ``fused_gemv`` cannot take this row and INT4 weight (``QuantLinear``'s layout, checked here too), or None
    if it can."""
    return _fused_check(x, qweight, scales, zeros, group_size, gated, residual, norm, squares, rms)[0]


def _fused_check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 gated: bool, residual: torch.Tensor | None, norm: Norm | None, squares: torch.Tensor | None,
                 rms: Rms | None) -> tuple[str | None, int]:
    """(``fused_unsupported``'s answer, the group size the launch takes): the layout is checked once."""
    try:
        k, n, group = check_int4_layout(qweight, scales, zeros, group_size, scales)
    except ValueError as error:
        return str(error), 0
    if x.device != qweight.device:
        return f"its row is on {x.device}, its weight on {qweight.device}", group
    width = 2 * k if gated else k
    if x.dim() < 1 or x.shape[-1] != width or x.numel() != width:
        return f"it takes one {'gate_up row of 2K' if gated else 'row of K'} = {width} inputs, not shape " \
               f"{tuple(x.shape)}", group
    if gated and norm is not None:
        return "it applies SiLU-and-multiply to x or normalises it, not both", group
    if norm is not None and residual is not None and squares is None:
        return "it normalises its input and adds to a row only with squares (it then leaves the norm's 1 / rms to " \
               "the row's reader)", group
    if squares is not None and (norm is None or residual is None):
        return "squares are where a GEMV that normalises its input and adds y to a row leaves its sums of squares: " \
               "it needs both norm and residual", group
    if rms is not None and not gated:
        return "rms applies the 1 / rms a gate_up GEMV left to its row's reader: it needs gated=True", group
    most = splits_needed(k, 1)  # (at one tile a program)
    if squares is not None and not holds_squares(squares, x.device, most):
        return f"it takes squares as a contiguous fp32 vector on {x.device} with a slot for each of up to {most} " \
               f"splits, not {squares.dtype} {tuple(squares.shape)} on {squares.device}", group
    if rms is not None and not holds_squares(rms.squares, x.device):
        return f"it takes rms.squares as a contiguous fp32 vector on {x.device}, not {rms.squares.dtype} " \
               f"{tuple(rms.squares.shape)} on {rms.squares.device}", group
    if residual is not None and (residual.shape[-1] != n or residual.numel() != n or residual.dtype != torch.float32
                                 or residual.device != x.device or not residual.is_contiguous()):
        return f"it adds to one contiguous fp32 residual row of N = {n} on {x.device}, not " \
               f"{residual.dtype} {tuple(residual.shape)} on {residual.device}", group
    if norm is not None:
        if x.dtype != torch.float32:
            return f"it normalises the residual stream's fp32 row, not a {x.dtype} one", group
        weight = norm.weight
        if (weight.shape != (k,) or weight.dtype != scales.dtype or weight.device != x.device
                or not weight.is_contiguous() or weight.data_ptr() % 4):
            return f"it takes the norm's weight as a contiguous {scales.dtype} [K = {k}] on {x.device}, not " \
                   f"{weight.dtype} {tuple(weight.shape)} on {weight.device}", group
    fp32_row = norm is not None or rms is not None  # the row is read in fp32 and scaled as it is read
    return unsupported(x.reshape(1, width), qweight, scales, zeros, group, normed=fp32_row), group


def fused_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               gated: bool = False, residual: torch.Tensor | None = None, norm: Norm | None = None,
               squares: torch.Tensor | None = None, rms: Rms | None = None) -> torch.Tensor:
    """x @ W for one row x [..., K] of a batch-1 decoder layer, with what surrounds the product folded in:
    ``gated``: x is the MLP's gate_up row [..., 2K] (K gates, then K ups) and the product's input silu(gate) * up,
    bit for bit ``fused_layer_ops.silu_and_mul`` followed by the GEMV (one kernel where there were two; ``../gemv.py``
    does the same for bf16 weights); ``norm``: x is the residual stream's fp32 row s and the input RMSNorm(s);
    ``residual``: the residual stream's fp32 row [..., N], to which x @ W is added in place, and which is returned
    instead of y (``w4_gemv_norms.py``: the norm between two GEMVs folded into them). ``norm``, ``residual`` and
    ``squares`` together: ``residual`` is a zeroed fp32 row [..., N] that gets y before the norm's 1 / rms, and
    ``squares`` the sums of squares a reader needs for it; ``gated`` with ``rms`` (``w4_gemv_norms.Rms``): x is such
    a gate_up row, scaled by 1 / rms as it is read."""
    reason, group = _fused_check(x, qweight, scales, zeros, group_size, gated, residual, norm, squares, rms)
    if reason:
        raise ValueError(f"the Gluon W4A16 GEMV cannot run these inputs: {reason}")
    n = qweight.shape[1]
    out = residual if residual is not None else torch.empty(*x.shape[:-1], n, dtype=scales.dtype, device=x.device)
    gemv(x.reshape(1, -1), qweight, scales, zeros, group, out.view(1, n), gated=gated, add=residual is not None,
         norm=norm, squares=squares, rms=rms)
    return out
