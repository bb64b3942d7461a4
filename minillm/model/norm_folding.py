"""The residual add and RMSNorm between two of a decoder layer's INT4 projections, folded into their GEMVs at batch 1:
what the layer hands between them instead of a normalised row.

Why: a batch-1 INT4 llama2-7b layer runs two norm kernels (each with the residual add before it) between its GEMVs,
0.23 ms of a 2.30 ms token, where bf16's longer GEMVs hide theirs (figures/h200/sweeps/latency_what_if.json). With
the norms folded (``FusedLlamaForCausalLM.fold_norms``, ``fused.py``), and the step one row, the residual stream is
an fp32 row (``residual_stream``) that the GEMVs add to in place (``kernels/w4_gemv_norms.py`` says why fp32 and in
place):

- o_proj, given the stream (``add_to``), adds its output to it and returns it as a ``ResidualRow``;
- the post-attention RMSNorm turns that into a ``NormedRow`` and runs no kernel;
- gate_up_proj's GEMV normalises the row as it reads it. down_proj, the next layer's input norm and its qkv_proj
  do the same. The last layer's down_proj does not: the final norm and the LM head follow it, and take the stream
  back in the model's dtype (``FusedRMSNorm.forward`` rounds a residual of another dtype to x's).
- The first layer's input norm folds too: the step's first kernel (``step_start`` in
  ``kernels/fused_layer_ops.py``) writes the token's embedding as the stream's fp32 row and zeroes the pending
  rows below, and layer 0's qkv_proj normalises that row as every later one does.

One step further, gate_up_proj leaves its norm's 1 / rms to down_proj: its GEMV adds its
unnormalised output to a zeroed fp32 row and stores its splits' sums of squares beside it (a ``PendingSlot`` of the
model's ``PendingRows``, zeroed once a step), and down_proj, given the ``PendingNorm``, scales the row as it loads it.
Then no GEMV of the MLP has a split-K fix-up. qkv_proj does the same for the decode attention kernel, which scales
q, k and v as it loads them for RoPE (``kernels/rope_in_decode.py``), where the step's
attention context can (``takes_pending_norm``: a decode-only step on the Triton backend, an unquantized cache).

Nothing is lost where a kernel cannot run: a projection that cannot fold the add calls ``ResidualRow.add`` (the
same add, in torch), and one that cannot take a ``NormedRow`` calls ``materialize`` (the norm's own forward on the
row, what the unfolded layer computes; ``PendingNorm.materialize`` likewise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn



def residual_stream(residual: torch.Tensor) -> torch.Tensor:
    """The residual as the fp32 row a folded GEMV adds to in place: itself if it is one, else an fp32 copy (the
    first folded add of a step, whose residual is the embedding or a norm kernel's sum)."""
    return residual if residual.dtype == torch.float32 else residual.float()


@dataclass(frozen=True)
class ResidualRow:
    """The residual stream's fp32 row ``total``, a projection's output just added to it (in place): what a projection
    returns where it folded the residual add; an RMSNorm makes a ``NormedRow`` of it."""
    total: torch.Tensor

    @classmethod
    def add(cls, y: torch.Tensor, stream: torch.Tensor) -> ResidualRow:
        """y added to the stream in torch, in place as the GEMV adds it: where no GEMV folds the add."""
        return cls(stream.add_(y))


@dataclass(frozen=True)
class NormedRow:
    """``norm(row.total)`` not yet computed: a GEMV that folds norms computes it as it reads its slice of the row;
    anything else calls ``materialize``."""
    row: ResidualRow
    norm: nn.Module  # the RMSNorm (its weight and eps)

    @property
    def shape(self) -> torch.Size:
        return self.row.total.shape

    def materialize(self) -> torch.Tensor:
        """The normalised row, by the norm's own forward on the row in the norm's dtype: what the unfolded layer
        computes."""
        return self.norm(self.row.total.to(self.norm.weight.dtype))


def folds_norms(layer: nn.Module) -> bool:
    """Whether ``layer`` (a projection) takes ``NormedRow`` inputs and ``add_to`` residuals in its GEMV: a layer that
    says so itself (``QuantLinear.folds_norms``)."""
    own = getattr(layer, "folds_norms", None)
    return callable(own) and own()


@dataclass(frozen=True)
class PendingSlot:
    """A layer's part of ``PendingRows``: ``total``, the zeroed fp32 row gate_up_proj's (or qkv_proj's) GEMV adds its
    output to, and ``squares``, a slot for each of its splits' sums of squares."""
    total: torch.Tensor
    squares: torch.Tensor


@dataclass(frozen=True)
class PendingNorm:
    """gate_up_proj's (or qkv_proj's) output before its norm's 1 / rms: the slot's row and sums of squares, the
    ``norm`` (its eps), its input's ``width`` and the output's ``shape`` (the slot's row, with the input's leading
    dimensions). down_proj's GEMV (the decode attention kernel) applies 1 / rms as it reads the row; anything else
    calls ``materialize``."""
    slot: PendingSlot
    norm: nn.Module
    width: int
    shape: torch.Size

    @property
    def row(self) -> torch.Tensor:
        """The slot's row in the output's shape."""
        return self.slot.total.view(self.shape)

    def materialize(self) -> torch.Tensor:
        """The row times 1 / rms in the norm's dtype: what the GEMV would have written itself."""
        inv = 1.0 / torch.sqrt(self.slot.squares.sum() / self.width + self.norm.eps)
        return (self.row * inv).to(self.norm.weight.dtype)


class PendingRows:
    """Every layer's ``PendingSlot``s in one fp32 buffer, so that one memset a step (``clear``, at the start of a
    one-row forward) zeroes them all. ``parts``: {name: (width, slots)}, a row of ``width`` (a projection's output) and
    ``slots`` sums of squares each; every row starts 16 bytes aligned, as the kernels read them."""

    def __init__(self, layers: int, parts: dict[str, tuple[int, int]], device: torch.device):
        self.parts, start = {}, 0
        for name, (width, slots) in parts.items():
            self.parts[name] = (start, width, slots)
            start += -(-(width + slots) // 4) * 4
        self.buffer = torch.zeros(layers, start, dtype=torch.float32, device=device)

    def slot(self, layer: int, part: str) -> PendingSlot:
        start, width, slots = self.parts[part]
        row = self.buffer[layer, start:]
        return PendingSlot(row[:width], row[width:width + slots])

    def clear(self) -> None:
        self.buffer.zero_()
