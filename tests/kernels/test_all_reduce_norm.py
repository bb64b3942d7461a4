"""The fused all-reduce + residual + RMSNorm kernel, with one process playing every rank: a rank's
push half and its wait-and-reduce half run as separate launches, in orders two GPUs could take, on
workspaces that point at each other as symmetric memory would (under TRITON_INTERPRET=1 on CPU; on a
GPU too). One process cannot test the spinning itself (a row that arrives while a rank waits): two
GPUs run the whole kernel in tests/test_parallel_gpu.py."""

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
    return [Workspace(rank, world, dtype, buffers[rank], Workspace.zeroed_epochs(programs, DEVICE),
                      peer_buffers) for rank in range(world)]


def poisoned(x):
    return torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))


def call_every_rank(workspaces, partials, weight, residual, eps=1e-5):
    """One all-reduce call on every rank: pushes first, then reductions. Outputs are poisoned first."""
    outs = [poisoned(x) for x in partials]
    for ws, x, out in zip(workspaces, partials, outs):
        all_reduce_rms_norm(x, weight, eps, residual, ws, out=out, phases=(1,))
    for ws, x, out in zip(workspaces, partials, outs):
        all_reduce_rms_norm(x, weight, eps, residual, ws, out=out, phases=(2,))
    return outs


def problem(call: int, world: int, rows: int, hidden: int, dtype):
    """Call ``call``'s partial sums (one a rank) and residual."""
    partials = [randn(1, rows, hidden, dtype=dtype, seed=10 * call + r) for r in range(world)]
    return partials, randn(1, rows, hidden, dtype=dtype, seed=100 + call)


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
        partials, residual = problem(call, world, rows, hidden, dtype)
        outs = call_every_rank(workspaces, partials, weight, residual)
        y_ref, s_ref = all_reduce_rms_norm_ref(partials, weight, 1e-5, residual)
        for y, s in outs:
            torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the sum, rounded as an all-reduce's then torch's
            torch.testing.assert_close(y, y_ref, **TOL[dtype])
            assert torch.equal(y, outs[0][0])  # the same bits on every rank: each sums in rank order
    for ws in workspaces:
        assert ws.epochs.tolist() == [5] * programs + [0]  # every program counted every call, rows or not


def test_a_peer_one_call_ahead_does_not_overwrite_the_rows_being_read():
    # Rank 1 finishes call 1 and pushes call 2 before rank 0 has read call 1: call 2 goes to the other slot.
    world, hidden, dtype = 2, 64, torch.float32
    workspaces = simulated_ranks(world, 2, 4, hidden, dtype)
    weight = randn(hidden, dtype=dtype, seed=1)
    (p1, r1), (p2, r2) = problem(1, world, 3, hidden, dtype), problem(2, world, 3, hidden, dtype)
    outs = [[poisoned(p1[0]), poisoned(p1[0])], [poisoned(p1[0]), poisoned(p1[0])]]  # [call][rank]

    def half(rank, call, phase):
        partials, residual = (p1, r1) if call == 0 else (p2, r2)
        all_reduce_rms_norm(partials[rank], weight, 1e-5, residual, workspaces[rank], out=outs[call][rank],
                            phases=(phase,), max_spin=3)

    for rank, call, phase in [(0, 0, 1), (1, 0, 1), (1, 0, 2), (1, 1, 1), (0, 0, 2), (0, 1, 1), (0, 1, 2), (1, 1, 2)]:
        half(rank, call, phase)
    for call, (partials, residual) in enumerate([(p1, r1), (p2, r2)]):
        y_ref, s_ref = all_reduce_rms_norm_ref(partials, weight, 1e-5, residual)
        for rank in range(world):
            torch.testing.assert_close(outs[call][rank][1], s_ref, atol=0, rtol=0)
            torch.testing.assert_close(outs[call][rank][0], y_ref, **TOL[dtype])


def test_the_epoch_counter_may_wrap():
    world, hidden, dtype = 2, 32, torch.float32
    workspaces = simulated_ranks(world, 2, 4, hidden, dtype)
    for ws in workspaces:
        ws.epochs[:-1] = 2**31 - 3  # three calls from the int32 wrap
    weight = randn(hidden, dtype=dtype, seed=1)
    for call in range(6):
        partials, residual = problem(call, world, 3, hidden, dtype)
        outs = call_every_rank(workspaces, partials, weight, residual)
        _, s_ref = all_reduce_rms_norm_ref(partials, weight, 1e-5, residual)
        assert all(torch.equal(s, s_ref) for _, s in outs), f"call {call}"
    assert workspaces[0].epochs.tolist() == [-2**31 + 3] * 2 + [0]  # 2**31 - 3 + 6, wrapped


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernel traps, which ends the process's CUDA context")
@pytest.mark.parametrize("earlier_calls", [0, 3])
def test_a_rank_left_waiting_stops_with_an_error(earlier_calls):
    # With earlier calls, the slot holds rows two calls old: stale rows must not pass for this call's.
    world, hidden, dtype = 2, 32, torch.float32
    workspaces = simulated_ranks(world, 2, 4, hidden, dtype)
    weight = randn(hidden, dtype=dtype, seed=1)
    for call in range(earlier_calls):
        earlier, earlier_residual = problem(call, world, 2, hidden, dtype)
        call_every_rank(workspaces, earlier, weight, earlier_residual)
    partials, residual = problem(9, world, 2, hidden, dtype)
    all_reduce_rms_norm(partials[0], weight, 1e-5, residual, workspaces[0], phases=(1,))
    with pytest.raises(RuntimeError, match="never arrived"):  # rank 1 never pushed
        all_reduce_rms_norm(partials[0], weight, 1e-5, residual, workspaces[0], phases=(2,), max_spin=3)


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
