# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex08_tp_sharding.py by exercises/make_stubs.py.
"""Exercise 08: tensor parallelism by hand — split an MLP's weights over N ranks and sum the partials.

Notebook 08 splits every big matrix of the model over N processes (Megatron-LM, Shoeybi et al. 2019).
Here you do it for the Llama MLP, ``down(silu(gate(x)) * up(x))``, with PyTorch's weight layout
``[out_features, in_features]`` (``y = x @ W.T``):

- **column-parallel** ``gate_proj`` and ``up_proj``: rank r keeps a contiguous slice of the *output*
  features (the hidden units). Its input is the whole ``x``; its output is its slice of the hidden units,
  and ``silu(gate) * up`` needs nothing from the other ranks, because gate and up are split alike.
- **row-parallel** ``down_proj``: rank r keeps the *input* features that multiply its hidden units. Its
  output is a full-size *partial* sum; adding the N partials (the all-reduce) gives the layer's output.

So the MLP needs one all-reduce and no other communication. Here the ranks are a Python loop and the
all-reduce is a sum.

Where it lives in minillm: ``checkpoint_slice`` in ``minillm/parallel/tp.py`` says which rows or columns
of each checkpoint tensor a rank loads, and ``RowParallelLinear`` does the all-reduce.
``test_wired_into_minillm`` checks that your shards are exactly the ones minillm's loader picks.

Test your version (from the repository root)::

    .venv/bin/pytest exercises/tests/test_ex08_tp_sharding.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a column-parallel weight ``[out, in]``: its slice of the output features.
    Raise ValueError if ``size`` does not divide them evenly."""
    raise NotImplementedError("ex08: equal contiguous slices of the output features (dimension 0)")


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a row-parallel weight ``[out, in]``: its slice of the input features.
    Raise ValueError if ``size`` does not divide them evenly."""
    raise NotImplementedError("ex08: equal contiguous slices of the input features (dimension 1)")


def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The Llama MLP in one process (given, for comparison)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def tensor_parallel_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        size: int) -> torch.Tensor:
    """``mlp(x, gate, up, down)`` computed as ``size`` ranks would: each rank runs the MLP on its shards
    of the three weights (``x`` is replicated), then the partial outputs are summed (the all-reduce).

    Hint: every rank's computation is ``mlp`` itself, on smaller weights.
    """
    raise NotImplementedError("ex08: what each rank computes on its own shards, then the all-reduce")
