"""The W4A16 GEMV (M = 1) for Hopper (sm_90), from Python: which Gluon kernel a form runs, how many tiles a program
gets, and the launch. ``w4a16_matmul`` runs ``gemv`` for one row of bf16 x on an H100/H200;
``w4_gemv_fused.fused_gemv`` runs its forms with a norm, a residual or SiLU-and-multiply folded in.

Two kernels, because each is the faster one for the forms it serves on the H200:

- the column kernel (``w4_gemv_columns.py``): no split of K, so no fix-up; it runs the plain form (a bf16 y), which
  ``QuantLinear`` and ``w4a16_matmul`` run by default;
- the split-K kernel (``w4_gemv_split_k.py``): it runs the fused forms (SiLU-and-multiply, the norm ahead, y added
  to the residual stream), whose splits add to the fp32 stream with reductions (no fix-up either) and leave the
  norm's sums of squares to the kernel behind; and the plain form where the column kernel cannot (K not a multiple
  of 64).

What it takes (``unsupported`` names what is missing): bf16 x, one row (M = 1), group_size 64 or 128, N a multiple of
32 (TMA's 16-byte row strides for the packed zero points), 16-byte aligned tensors, sm_90. fp16 x, other groups and
M > 1 take the Triton kernels.
"""

from __future__ import annotations

import torch
import triton

from ..checks import num_sms
from ..fused_layer_ops import Norm, Rms
from ..split_k import MAX_TILES, tile_counters
from . import w4_gemv_columns as columns
from . import w4_gemv_split_k as kernel  # (its kernel exists where GLUON_USABLE)
from .gluon import GLUON_USABLE, MIN_TRITON
from .pdl import supported as pdl_supported
from .tma import TMA_ALIGN
from .w4_gemv_split_k import BLOCK_N, RUN, TILE_ROWS, WARPS

GROUP_SIZES = (64, 128)
# Tiles a program of the split-K kernel. In the batch-1 decode graph of Llama-2-7B on an H200, 4 is the fastest
# (figures/h200/sweeps/decode_graph_tiles.json).
TILES = 4
# Programs an SM below which a GEMV takes fewer tiles a program: Llama-2-7B's o_proj (4096 x 4096) at 4 tiles is 128
# programs, one an SM, whose math after the wait nothing hides
# (figures/h200/sweeps/decode_graph_tiles_by_projection.json).
MIN_PROGRAMS_PER_SM = 2
# Split-K tiles a program copies after x's loads are issued, not before the wait for the kernel ahead: copies issued
# before it are queued ahead of x's loads (figures/h200/sweeps/latency_late.json).
LATE_TILES = 1


def unsupported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int, normed: bool = False) -> str | None:
    """Why this kernel cannot run ``w4a16_matmul``'s checked inputs (x [M, K], group the checked group size), or
    None if it can; ``normed``: x is the residual stream's fp32 row, which the kernel normalises."""
    if x.dtype != (torch.float32 if normed else torch.bfloat16):
        return f"it takes {'an fp32 row to normalise' if normed else 'bf16 x'}, not {x.dtype}"
    if x.shape[0] != 1:
        return f"it computes one row of x (a GEMV), not {x.shape[0]}"
    reason = weight_unsupported(qweight, scales, group)
    if reason:
        return reason
    # x is read as int32 words, the others through TMA descriptors: 16-byte aligned bases and row strides.
    tensors = {"x": x, "qweight": qweight, "scales": scales, "zeros": zeros}
    for name, t in tensors.items():
        if t.stride(-1) != 1 or (t.dim() == 2 and t.stride(0) * t.element_size() % TMA_ALIGN and t is not x):
            return f"it needs contiguous rows {TMA_ALIGN}-byte aligned, got {name} with strides {t.stride()}"
        if t.data_ptr() % TMA_ALIGN:
            return f"it needs {TMA_ALIGN}-byte aligned tensors, got {name} at {t.data_ptr():#x}"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "it needs an sm_90 GPU (H100/H200)"
    return None


def weight_unsupported(qweight: torch.Tensor, scales: torch.Tensor, group: int) -> str | None:
    """What in an INT4 weight (``QuantLinear``'s layout, group the checked group size) keeps this kernel from it
    whatever the row and the device, or None (``QuantLinear.folds_norms`` asks before a model folds norms into it)."""
    if not GLUON_USABLE:
        return f"it is written in Gluon for Triton >= {'.'.join(map(str, MIN_TRITON))}, not {triton.__version__}"
    if scales.dtype != torch.bfloat16:
        return f"it takes bf16 x and scales, not {scales.dtype}"
    if group not in GROUP_SIZES:
        return f"it takes group_size in {GROUP_SIZES}, not {group}"
    n = qweight.shape[1]
    if n == 0 or n % 32:
        return f"it needs N a positive multiple of 32 (16-byte rows of packed zero points), not {n}"
    return None


def use_hopper(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               hopper: bool | None, config: dict | None) -> bool:
    """Whether ``w4a16_matmul`` runs this kernel: ``hopper`` None (where it can run and no Triton ``config`` was
    pinned), False, or True (demanded: a ValueError with the reason where it cannot)."""
    if hopper is False or (hopper is None and config):
        return False
    if hopper and config:
        raise ValueError(f"hopper=True runs the Gluon W4A16 GEMV, which takes no Triton config; got config {config}")
    reason = unsupported(x, qweight, scales, zeros, group)
    if reason and hopper:
        raise ValueError(f"hopper=True, but the Gluon W4A16 GEMV cannot run these inputs: {reason}")
    return reason is None


def choose_tiles(k: int, n: int, sms: int) -> int:
    """Tiles a program for a K x N weight on a GPU of ``sms`` SMs: TILES, halved while that leaves fewer than
    MIN_PROGRAMS_PER_SM programs an SM (and 1 where K is one tile)."""
    tiles = TILES
    while tiles > 1 and -(-n // BLOCK_N) * -(-k // (8 * TILE_ROWS * tiles)) < MIN_PROGRAMS_PER_SM * sms:
        tiles //= 2
    return 1 if k <= 8 * TILE_ROWS else tiles


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
            out: torch.Tensor, partials: torch.Tensor, counters: torch.Tensor, pdl: bool,
            tiles: int | None = None, gated: bool = False, run: int = RUN, add: bool = False,
            norm: Norm | None = None, squares: torch.Tensor | None = None, rms: Rms | None = None) -> None:
    """y = x @ W into ``out`` [1, N] on inputs ``w4a16_matmul`` checked and ``unsupported`` accepted. ``partials``:
    fp32, at least ``partials_needed``; ``counters``: ``split_k.tile_counters``; ``tiles`` (a program's, for sweeps):
    by default ``choose_tiles``. ``run`` (for sweeps): packed rows a 16-bit sum, 1 or 2. What
    ``w4_gemv_fused.fused_unsupported`` checked: ``gated``: x is the MLP's gate_up row [1, 2K] and the product's
    input silu(gate) * up; ``add``: ``out`` is the residual stream's fp32 row, and y is added to it; ``norm``: x is
    that row s and the product's input RMSNorm(s) (``w4_gemv_norms.py``). ``add`` and ``norm`` together: ``out`` is a
    zeroed fp32 row that gets y without the norm's 1 / rms, and ``squares`` (fp32, a slot a split) the splits' sums of
    squares, for the GEMV that reads ``out``: ``gated`` with ``rms`` (whose squares those are) takes x = that row."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    tiles = tiles or choose_tiles(k, n, num_sms(x.device))
    if tiles not in (1, 2, 4, 8):
        raise ValueError(f"tiles must be 1, 2, 4 or 8 (a power of two, 16 KB of shared memory each), got {tiles}")
    if run not in (1, 2):
        raise ValueError(f"run must be 1 or 2 (packed rows a 16-bit sum; longer runs lose accuracy), got {run}")
    grid = (-(-n // BLOCK_N), splits_needed(k, tiles))
    if add and norm and (squares is None or squares.dtype != torch.float32 or squares.numel() < grid[1]):
        raise ValueError(f"it normalises its input and adds y to a row only if it leaves the norm's 1 / rms to the "
                         f"row's reader: that needs squares, fp32 with a slot for each of its {grid[1]} splits; got "
                         f"{None if squares is None else (squares.dtype, squares.numel())}")
    if add and out.dtype != torch.float32:
        raise ValueError(f"add=True adds y to the residual stream's fp32 row in out, not to {out.dtype}")
    if rms is not None and not gated:
        raise ValueError("rms (the 1 / rms of a gate_up row its GEMV left unnormalised) needs gated=True")
    needed = partials_needed(k, n, tiles, norm is not None)
    if partials.numel() < needed:
        raise ValueError(f"partials holds {partials.numel()} floats; {grid[1]} splits of N = {n}"
                         f"{' and their sums of squares' if norm else ''} need {needed}")
    if grid[1] > 1 and not add and grid[0] > MAX_TILES:
        raise ValueError(f"N = {n} is {grid[0]} column tiles; the split-K counters hold {MAX_TILES}")
    weight, eps = (norm.weight.view(torch.int32), norm.eps) if norm else (partials, rms.eps if rms else 0.0)
    squares_at = squares if add and norm else rms.squares if rms else partials  # written, read, or not used
    descriptors = kernel._descriptors(qweight, scales, zeros, group)
    kernel._w4_gemv_kernel[grid](x if norm or rms else x.view(torch.int32), *descriptors, out, partials, counters, n,
                                 k // 8, weight, eps, squares_at, rms.squares.numel() if rms else 0,
                                 rms.width if rms else 0, TILES=tiles, GROUP_ROWS=group // 8, PDL=pdl, GATED=gated,
                                 RUN=run, ADD=add, NORMED=norm is not None, SCALED=rms is not None,
                                 SQUARE_SLOTS=triton.next_power_of_2(rms.squares.numel()) if rms else 1,
                                 LATE=min(LATE_TILES, tiles - 1), num_warps=WARPS, launch_pdl=pdl)


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
         out: torch.Tensor, gated: bool = False, add: bool = False, norm: Norm | None = None,
         squares: torch.Tensor | None = None, rms: Rms | None = None) -> None:
    """What ``w4a16_matmul`` and ``w4_gemv_fused.fused_gemv`` run: the plain form (a bf16 y) on the column kernel
    where it takes the shape, every other form (and the plain one where the column kernel cannot) on the split-K
    kernel at the default tiles, with the partials its splits need, the device's split-K counters, and PDL where the
    device has it."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    plain = not (gated or add or norm is not None or rms is not None)
    if plain and out.dtype == torch.bfloat16 and not columns.unsupported(k, n, group, x.dtype, x.shape[0]):
        warps, stages, blocks, late = columns.choose_shape(k, n, num_sms(x.device))
        columns.w4_gemv_columns(x, qweight, scales, zeros, group, out, pdl=pdl_supported(x.device), warps=warps,
                                stages=stages, blocks=blocks, late=late)
        return
    tiles = choose_tiles(k, n, num_sms(x.device))
    partials = torch.empty(max(partials_needed(k, n, tiles, norm is not None), 1), dtype=torch.float32,
                           device=x.device)
    w4_gemv(x, qweight, scales, zeros, group, out, partials, tile_counters(x.device), pdl_supported(x.device),
            tiles=tiles, gated=gated, add=add, norm=norm, squares=squares, rms=rms)


def partials_needed(k: int, n: int, tiles: int, normed: bool = False) -> int:
    """fp32 the fix-up of a K x N GEMV at ``tiles`` a program needs: N for each split, and with a norm each split's
    sum of squares; none at one split."""
    splits = splits_needed(k, tiles)
    return 0 if splits == 1 else splits * (n + normed)


def splits_needed(k: int, tiles: int) -> int:
    """The splits ``w4_gemv`` launches at ``tiles`` a program (``choose_tiles``'s, by default): the partials it needs
    are this times N floats."""
    return -(-k // (8 * TILE_ROWS * tiles))
