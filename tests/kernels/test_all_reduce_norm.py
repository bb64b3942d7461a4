"""The fused all-reduce + residual + RMSNorm kernel, with one process playing every rank: each rank's
push-and-signal half runs, then each rank's wait-and-reduce half, on workspaces that point at each
other as symmetric memory would (under TRITON_INTERPRET=1 on CPU; on a GPU too). Two GPUs run the
whole kernel in tests/test_parallel_gpu.py."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.all_reduce_norm import Workspace, all_reduce_rms_norm, all_reduce_rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def simulated_ranks(world: int, programs: int, max_rows: int, hidden: int, dtype: torch.dtype) -> list[Workspace]:
    """``world`` workspaces in this process, each one's peers the others' buffers."""
    g = torch.Generator().manual_seed(5)
    # Slots start as random data stamped with an epoch older than any call's (a negative high half).
    shape = Workspace.buffer_shape(world, max_rows, hidden, dtype)
    buffers = [(torch.randint(0, 2**32, shape, generator=g) - 2**62).to(DEVICE) for _ in range(world)]
    peer_buffers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    return [Workspace(rank, world, programs, dtype, buffers[rank], torch.zeros(programs, dtype=torch.int32,
                                                                                device=DEVICE), peer_buffers)
            for rank in range(world)]


def call_every_rank(workspaces, partials, weight, residual, eps=1e-5):
    """One all-reduce call on every rank: pushes first, then reductions. Outputs are poisoned first."""
    outs = [(torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))) for x in partials]
    for ws, x, out in zip(workspaces, partials, outs):
        all_reduce_rms_norm(x, weight, eps, residual, ws, out=out, phases=(1,))
    for ws, x, out in zip(workspaces, partials, outs):
        all_reduce_rms_norm(x, weight, eps, residual, ws, out=out, phases=(2,))
    return outs


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world, hidden", [(2, 64), (3, 96)])
def test_every_rank_gets_the_normed_sum_over_calls_of_any_row_count(dtype, world, hidden):
    programs, max_rows = 4, 9
    workspaces = simulated_ranks(world, programs, max_rows, hidden, dtype)
    weight = randn(hidden, dtype=dtype, seed=1)
    # Row counts below, at and above the grid, and the buffer's full height; successive calls alternate slots.
    for call, rows in enumerate([1, 7, 4, 9, 3]):
        partials = [randn(1, rows, hidden, dtype=dtype, seed=10 * call + r) for r in range(world)]
        residual = randn(1, rows, hidden, dtype=dtype, seed=100 + call)
        outs = call_every_rank(workspaces, partials, weight, residual)
        y_ref, s_ref = all_reduce_rms_norm_ref(partials, weight, 1e-5, residual)
        for y, s in outs:
            torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the sum, rounded as an all-reduce's then torch's
            torch.testing.assert_close(y, y_ref, **TOL[dtype])
            assert torch.equal(y, outs[0][0])  # the same bits on every rank: each sums in rank order
    for ws in workspaces:
        assert ws.epochs.tolist() == [5] * programs  # every program counted every call, rows or not


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernel traps, which ends the process's CUDA context")
def test_a_rank_left_waiting_stops_with_an_error():
    workspaces = simulated_ranks(2, 2, 4, 32, torch.float32)
    x, r = (randn(1, 2, 32, dtype=torch.float32, seed=s) for s in (1, 2))
    w = randn(32, dtype=torch.float32, seed=3)
    all_reduce_rms_norm(x, w, 1e-5, r, workspaces[0], phases=(1,))
    with pytest.raises(RuntimeError, match="never signalled"):  # rank 1 never pushed
        all_reduce_rms_norm(x, w, 1e-5, r, workspaces[0], phases=(2,), max_spin=3)


@pytest.mark.parametrize("bad, message", [
    (dict(rows=10), r"at most 9"),
    (dict(hidden=48), r"rows of 64"),
    (dict(dtype=torch.float16), r"takes contiguous torch.float32"),
])
def test_inputs_the_workspace_cannot_take_are_refused(bad, message):
    ws = simulated_ranks(2, 2, 9, 64, torch.float32)[0]
    shape = dict(rows=3, hidden=64, dtype=torch.float32) | bad
    x = randn(1, shape["rows"], shape["hidden"], dtype=shape["dtype"], seed=1)
    with pytest.raises(ValueError, match=message):
        all_reduce_rms_norm(x, randn(shape["hidden"], dtype=shape["dtype"], seed=2), 1e-5, x.clone(), ws)
