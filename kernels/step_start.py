"""The first kernel of a batch-1 decode step with the norms folded: the token's embedding row gathered into the
residual stream's fp32 row, and the model's pending rows zeroed, in one launch.

Why it exists: with the norms folded (``minillm/model/norm_folding.py``) a one-row step started with the memset of
the rows gate_up_proj and qkv_proj add to, the embedding's gather and layer 0's input norm, and copied the embedding
to the fp32 stream after it for o_proj to add to. Each kernel is ~2-3 us of an INT4 llama2-7b token's ~1.57 ms on an
H200, where each launch, not its bytes, is the cost (figures/h200/sweeps/decode_graph_deferred_norms.json's
step_in_order). Here the memset, the gather and the copy are one kernel; layer 0's qkv_proj GEMV normalises the row
itself, as every later layer's does, and starts its weight copies while this kernel runs (PDL, ``pdl.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.checks import check, check_runnable
from minillm.kernels.pdl import let_next_start, supported as pdl_supported

BLOCK = 2048  # elements a program zeroes (and gathers, for the programs the row spans)


@triton.jit
def _step_start_kernel(Ids, Table, Row, ToZero, stride_table, hidden, zero_numel, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    let_next_start(PDL)  # the GEMV behind waits for this kernel's writes before it reads them
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ToZero + offsets, tl.zeros([BLOCK], tl.float32), mask=offsets < zero_numel)
    token = tl.load(Ids).to(tl.int64)
    in_row = offsets < hidden
    values = tl.load(Table + token * stride_table + offsets, mask=in_row, other=0.0)
    tl.store(Row + offsets, values.to(tl.float32), mask=in_row)


def step_start_ref(token_id: torch.Tensor, table: torch.Tensor, to_zero: torch.Tensor) -> torch.Tensor:
    """The three ops this kernel replaces, in torch: zero ``to_zero``, return the embedding row [1, 1, hidden] in
    fp32."""
    to_zero.zero_()
    return torch.nn.functional.embedding(token_id.reshape(1, 1), table).float()


def step_start(token_id: torch.Tensor, table: torch.Tensor, to_zero: torch.Tensor | None) -> torch.Tensor:
    """``step_start_ref`` in one kernel: the embedding ``table``'s row [vocab, hidden] for the one ``token_id`` (an
    integer tensor of one element, on the device) as a new fp32 row [1, 1, hidden], and the fp32 buffer ``to_zero``
    (contiguous; None: nothing to zero) set to zeros. The id is not range-checked on the device (as torch's
    embedding asserts): the engine's tokenizer and sampler produce ids below the vocabulary size."""
    check(token_id.numel() == 1 and not token_id.is_floating_point(),
          f"token_id must be one integer id, got {token_id.dtype} {tuple(token_id.shape)}")
    check(table.dim() == 2 and table.stride(1) == 1, f"table must be [vocab, hidden] with contiguous rows, got "
          f"shape {tuple(table.shape)} strides {table.stride()}")
    others = (("to_zero", to_zero),) if to_zero is not None else ()
    for name, t in (("token_id", token_id), ("table", table)) + others:
        check_runnable(name, t)
        check(t.device == table.device, f"{name} is on {t.device}, the table on {table.device}")
    if to_zero is None:
        to_zero = torch.empty(0, dtype=torch.float32, device=table.device)
    check(to_zero.dtype == torch.float32 and to_zero.is_contiguous(),
          f"to_zero must be a contiguous fp32 buffer, got {to_zero.dtype} strides {to_zero.stride()}")
    hidden = table.shape[1]
    row = torch.empty(1, 1, hidden, dtype=torch.float32, device=table.device)
    grid = (triton.cdiv(max(hidden, to_zero.numel()), BLOCK),)
    _step_start_kernel[grid](token_id, table, row, to_zero, table.stride(0), hidden, to_zero.numel(), BLOCK=BLOCK,
                             PDL=pdl_supported(table.device))
    return row
