"""The residual add and RMSNorm between two of a decoder layer's INT4 projections, folded into their GEMVs at batch 1:
what the layer hands between them instead of a normalised row.

Why: a batch-1 INT4 llama2-7b layer runs two norm kernels (each with the residual add before it) between its GEMVs,
0.23 ms of a 2.30 ms token, where bf16's longer GEMVs hide theirs (figures/h200/sweeps/latency_what_if.json). With
the norms folded (``LlamaForCausalLM.fold_norms``), and the step one row:

- o_proj, given the residual (``add_to``), returns a ``ResidualRow``: the residual stream's new row and the sums of
  its squares, written by its GEMV (``kernels/w4_gemv_norms.py``);
- the post-attention RMSNorm turns that into a ``NormedRow`` and runs no kernel;
- gate_up_proj's GEMV normalises the row as it reads it. down_proj, the next layer's input norm and its qkv_proj
  do the same. The last layer's down_proj does not: the final norm and the LM head follow it.

Nothing is lost where a kernel cannot run: a projection that cannot fold the add returns ``ResidualRow.add`` (the
same sum, in torch), and one that cannot take a ``NormedRow`` calls ``materialize`` (the norm's own forward on the
row, what the unfolded layer computes). MINILLM_NORM_IN_GEMV=0 keeps the norm kernels (for A/B runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.kernels.checks import switched_on

# MINILLM_NORM_IN_GEMV=0: the norms between INT4 GEMVs stay kernels of their own.
ENABLED = switched_on("MINILLM_NORM_IN_GEMV")


@dataclass(frozen=True)
class ResidualRow:
    """The residual stream's new row ``total`` = residual + a projection's output (rounded to the dtype, as the norm
    kernel's add is), with ``sumsq``: fp32 sums of total**2 over each 256 columns (``w4_gemv_norms.SUMSQ_COLUMNS``).
    What a projection returns where it folded the residual add; an RMSNorm makes a ``NormedRow`` of it."""
    total: torch.Tensor
    sumsq: torch.Tensor

    @classmethod
    def add(cls, y: torch.Tensor, residual: torch.Tensor) -> ResidualRow:
        """The row and its sums of squares computed in torch: where no GEMV folds the add."""
        from minillm.kernels.w4_gemv_norms import SUMSQ_COLUMNS

        total = y + residual
        flat = total.reshape(-1).float()
        tiles = -(-flat.numel() // SUMSQ_COLUMNS)
        squares = F.pad(flat, (0, tiles * SUMSQ_COLUMNS - flat.numel())).square()
        return cls(total, squares.view(tiles, SUMSQ_COLUMNS).sum(dim=1))


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
        """The normalised row, by the norm's own forward: what the unfolded layer computes."""
        return self.norm(self.row.total)


def folds_norms(layer: nn.Module) -> bool:
    """Whether ``layer`` (a projection) takes ``NormedRow`` inputs and ``add_to`` residuals in its GEMV: a layer that
    says so itself (``QuantLinear.folds_norms``)."""
    own = getattr(layer, "folds_norms", None)
    return callable(own) and own()
