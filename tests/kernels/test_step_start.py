"""A one-row decode step's first kernel (kernels/fused_layer_ops.py) against the three torch ops it replaces. Under
TRITON_INTERPRET=1 on CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.fused_layer_ops import STEP_START_BLOCK as BLOCK, step_start, step_start_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def random(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3 - 0.5).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, zeros", [(64, 3 * BLOCK + 5), (576, 10), (BLOCK + 8, 0), (96, None)])
def test_row_and_zeros_match_the_torch_ops(dtype, hidden, zeros):
    """The embedding row, exactly, in fp32 (a widening is exact), and every element of the buffer zero, whether it is
    longer than the row (more programs zero than gather), shorter, empty or absent."""
    table = random(50, hidden, dtype=dtype)
    token = torch.tensor([[37]], device=DEVICE)
    buffer = random((zeros or 0) + 100, seed=1)  # poisoned: random, never zeros
    beyond = buffer[zeros or 0:].clone()
    to_zero = None if zeros is None else buffer[:zeros]
    row = step_start(token, table, to_zero)
    want = step_start_ref(token, table, torch.empty(0, device=DEVICE))
    assert row.shape == want.shape == (1, 1, hidden) and row.dtype == torch.float32
    assert torch.equal(row, want) and torch.equal(row[0, 0], table[37].float())
    if to_zero is not None:
        assert not to_zero.any()
    assert torch.equal(buffer[zeros or 0:], beyond)  # nothing past the buffer it was given


def test_rows_of_a_strided_table_and_the_last_id():
    """A table whose rows are padded (stride beyond hidden) and the vocabulary's last id."""
    padded = random(20, 80)
    table = padded[:, :72]
    token = torch.tensor([19], device=DEVICE, dtype=torch.int32)
    assert torch.equal(step_start(token, table, None)[0, 0], table[19])


def test_bad_inputs_say_what_is_wrong():
    table = random(10, 32)
    with pytest.raises(ValueError, match="one integer id"):
        step_start(torch.tensor([1, 2], device=DEVICE), table, None)
    with pytest.raises(ValueError, match="one integer id"):
        step_start(torch.tensor([1.0], device=DEVICE), table, None)
    with pytest.raises(ValueError, match="contiguous rows"):
        step_start(torch.tensor([1], device=DEVICE), table.t(), None)
    with pytest.raises(ValueError, match="to_zero must be a contiguous fp32 buffer"):
        step_start(torch.tensor([1], device=DEVICE), table, torch.ones(8, dtype=torch.float16, device=DEVICE))
