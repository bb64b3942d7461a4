"""The column W4A16 GEMV (kernels/hopper/w4_gemv_columns.py: a program 32 columns over all of K, no fix-up) against
``w4a16_matmul_ref``: Llama-2-7B's shapes, a ragged last band, groups of 64 and 128, one program, fewer bands than
slots, each warp count and ring depth it takes, bit-equal reruns, and a CUDA graph.

Gluon has no interpreter: the numerical tests need an sm_90 GPU. On the CPU, ``plan`` and the refusals are tested,
and the kernel is compiled for sm_90 (tests/test_w4_gemv_columns_sass.py).
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.hopper import w4_gemv_columns as columns
from minillm.kernels.checks import num_sms
from minillm.kernels.quant_matmul import w4a16_matmul_ref

from test_quant_matmul import assert_matches, assert_replays_in_a_graph, int4_problem, poisoned

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and columns.GLUON_USABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")

CASES = [  # k, n, group, warps, stages, blocks a warp
    (4096, 11008, 128, 8, 2, 2),  # Llama-2-7B's gate/up: 344 programs
    (4096, 11008, 64, 4, 4, 2),
    (11008, 4096, 128, 8, 4, 2),  # its down_proj: 10.75 bands of 1024 inputs, the last ragged
    (11008, 4096, 64, 16, 2, 2),
    (4096, 4128, 128, 4, 2, 2),  # 4 groups of 128 a band: zero points' slots padded to TMA's 128-byte alignment
    (4160, 96, 128, 8, 4, 2),  # K = 65 blocks: half a group of 128 at the end, and past the scales' last row
    (1024, 32, 64, 8, 8, 2),  # one program, one band, more slots than bands
    (512, 64, 128, 2, 1, 2),  # one slot: every band waits for its own copies
    (4096, 11008, 128, 8, 2, 4),  # four blocks a warp: two bands of 2048 inputs
    (11008, 4096, 64, 8, 4, 4),  # 5.375 bands, the last ragged
    (4160, 96, 128, 4, 4, 4),  # two groups of 128 a warp, half a group at the end
    (1024, 32, 64, 2, 8, 4),  # two warps, eight zero-point rows a band
]


@pytest.mark.parametrize("k,warps,blocks", [(4096, 8, 2), (11008, 8, 2), (11008, 4, 2), (64, 2, 2),
                                            (11008, 8, 4), (4096, 16, 4)])
def test_plan_counts_the_bands_of_a_column(k, warps, blocks):
    numbers = columns.plan(k, warps, blocks)
    band = 64 * blocks * warps  # inputs a band
    assert (numbers["n_bands"] - 1) * band < k <= numbers["n_bands"] * band
    assert numbers["BANDS"] >= numbers["n_bands"] and numbers["BANDS"] & (numbers["BANDS"] - 1) == 0


@pytest.mark.parametrize("k,n,group,dtype,rows,words", [
    (4096, 1000, 128, torch.bfloat16, 1, "N of 32.*N = 1000"), (4104, 1024, 128, torch.bfloat16, 1, "K = 4104"),
    (4096, 1024, 32, torch.bfloat16, 1, "group 32"), (4096, 1024, 128, torch.float16, 1, "torch.float16"),
    (4096, 1024, 128, torch.bfloat16, 2, "not 2 of")])
def test_it_refuses_what_it_cannot_run_and_says_why(k, n, group, dtype, rows, words):
    x = torch.zeros(rows, k, dtype=dtype)
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    with pytest.raises(ValueError, match=words):
        columns.w4_gemv_columns(x, qweight, None, None, group, None)


@pytest.mark.parametrize("warps,stages,blocks,refused", [(16, 8, 2, True), (16, 4, 2, False), (8, 8, 2, False),
                                                         (8, 8, 4, True), (8, 4, 4, False), (16, 4, 4, True)])
def test_it_refuses_a_ring_larger_than_shared_memory_allows(warps, stages, blocks, refused):
    """More than 128 KB of weights in flight is refused with the numbers; 128 KB rings pass this check (and, on the
    CPU, fail the next one: no scales were given)."""
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    qweight = torch.zeros(512, 64, dtype=torch.int32)
    with pytest.raises((ValueError, AttributeError, TypeError)) as error:
        columns.w4_gemv_columns(x, qweight, None, None, 128, torch.zeros(1, 64, dtype=torch.bfloat16), warps=warps,
                                stages=stages, blocks=blocks)
    assert (f"warps={warps} x stages={stages} x blocks={blocks} would hold 256 KB" in str(error.value)) == refused, \
        error.value


@pytest.mark.parametrize("warps,blocks,group,refused", [(2, 4, 128, True), (2, 2, 64, True), (2, 2, 128, False),
                                                        (4, 2, 64, False), (2, 4, 64, False)])
def test_it_refuses_too_few_zero_point_rows_a_band(warps, blocks, group, refused):
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    qweight = torch.zeros(512, 64, dtype=torch.int32)
    with pytest.raises((ValueError, AttributeError, TypeError)) as error:
        columns.w4_gemv_columns(x, qweight, None, None, group, torch.zeros(1, 64, dtype=torch.bfloat16), warps=warps,
                                stages=2, blocks=blocks)
    assert ("zero-point rows a band, too few" in str(error.value)) == refused, error.value


@pytest.mark.parametrize("warps,stages,blocks", [(3, 2, 2), (8, 3, 2), (8, 16, 2), (8, 2, 3)])
def test_it_refuses_warps_stages_and_blocks_it_has_no_views_for(warps, stages, blocks):
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    qweight = torch.zeros(128, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"warps={warps}, stages={stages}, blocks={blocks}"):
        columns.w4_gemv_columns(x, qweight, None, None, 128, torch.zeros(1, 64, dtype=torch.bfloat16), warps=warps,
                                stages=stages, blocks=blocks)


@needs_sm90
@pytest.mark.parametrize("k,n,group,warps,stages,blocks", CASES)
def test_column_gemv_matches_ref_and_repeats_its_bits(k, n, group, warps, stages, blocks):
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + group + warps)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group)
    out = poisoned((1, n), torch.bfloat16)
    columns.w4_gemv_columns(x, qweight, scales, zeros, group, out, warps=warps, stages=stages, blocks=blocks)
    assert_matches(out, want, torch.bfloat16)
    again = poisoned((1, n), torch.bfloat16)
    columns.w4_gemv_columns(x, qweight, scales, zeros, group, again, warps=warps, stages=stages, blocks=blocks)
    assert torch.equal(again, out), "no atomics, sums in a fixed order: the same bits every run"


@needs_sm90
@pytest.mark.parametrize("k,n,warps,stages,blocks,late", [(4096, 1024, 8, 2, 4, 1), (11008, 512, 8, 4, 4, 2),
                                                          (11008, 512, 8, 4, 4, 4), (4096, 96, 4, 8, 2, 3)])
def test_column_gemv_fills_late_slots_after_xs_loads_to_the_same_bits(k, n, warps, stages, blocks, late):
    """``late`` slots of the first fill wait for x's loads: the same answer, bit for bit, as all filled early."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=k + n + late)
    outs = []
    for slots in (0, late):
        outs.append(poisoned((1, n), torch.bfloat16))
        columns.w4_gemv_columns(x, qweight, scales, zeros, 128, outs[-1], warps=warps, stages=stages, blocks=blocks,
                                late=slots)
    assert_matches(outs[1], w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)
    assert torch.equal(outs[0], outs[1])


def test_late_slots_are_counted_among_the_ring_slots():
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    qweight = torch.zeros(128, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="0 to stages=2, got 3"):
        columns.w4_gemv_columns(x, qweight, None, None, 128, torch.zeros(1, 64, dtype=torch.bfloat16), stages=2,
                                late=3)


@needs_sm90
def test_column_gemv_passes_nans_through():
    x, qweight, scales, zeros, _, _ = int4_problem(1, 4096, 1024, 128, torch.bfloat16, seed=5)
    x[0, 3000] = float("nan")
    out = poisoned((1, 1024), torch.bfloat16)
    columns.w4_gemv_columns(x, qweight, scales, zeros, 128, out)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, 128)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().all()


@needs_sm90
def test_column_gemv_replays_in_a_cuda_graph():
    k, n = 4096, 11008
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=12)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)

    def run():
        columns.w4_gemv_columns(x, qweight, scales, zeros, 128, out)
        return out
    assert_replays_in_a_graph(run, x, qweight, scales, zeros, 128)


@pytest.mark.parametrize("k,n,slots", [(1024, 11008, 1), (4096, 11008, 4), (8192, 8192, 4), (11008, 8192, 4),
                                       (4096, 4096, 8), (11008, 4096, 8), (1024, 32, 8)])
def test_the_chosen_ring_holds_a_columns_bands_up_to_four_or_an_sm_to_itself(k, n, slots):
    """More programs than SMs: as many 16 KB slots as bands, up to 4; no more than the SMs: 8 (128 KB), one program
    an SM. Every slot but the first is filled after x's loads."""
    warps, stages, blocks, late = columns.choose_shape(k, n, 132)
    assert (warps, stages, blocks, late) == (4, slots, 4, slots - 1)
    assert columns.shape_unsupported(warps, stages, blocks) is None
    assert columns.ring_bytes(warps, stages, blocks) == slots * 16 * 1024


@needs_sm90
def test_gemv_runs_the_plain_form_on_the_column_kernel():
    """``w4_gemv.gemv``'s plain form (a bf16 y): the column kernel's bits (the answer it gives alone), and within
    rounding the split-K kernel's."""
    from minillm.kernels.hopper import w4_gemv as hopper
    from minillm.kernels.hopper.pdl import supported as pdl_supported
    from minillm.kernels.split_k import tile_counters
    k, n = 4096, 4096
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=21)
    routed = poisoned((1, n), torch.bfloat16)
    hopper.gemv(x, qweight, scales, zeros, 128, routed)
    alone = poisoned((1, n), torch.bfloat16)
    warps, stages, blocks, late = columns.choose_shape(k, n, num_sms(x.device))
    columns.w4_gemv_columns(x, qweight, scales, zeros, 128, alone, warps=warps, stages=stages, blocks=blocks,
                            late=late)
    assert torch.equal(routed, alone)
    split_k = poisoned((1, n), torch.bfloat16)
    tiles = hopper.choose_tiles(k, n, num_sms(x.device))
    partials = torch.empty(max(hopper.partials_needed(k, n, tiles), 1), dtype=torch.float32, device=x.device)
    hopper.w4_gemv(x, qweight, scales, zeros, 128, split_k, partials, tile_counters(x.device),
                   pdl_supported(x.device), tiles=tiles)
    scale = split_k.abs().max().item()
    torch.testing.assert_close(routed, split_k, rtol=0, atol=2e-2 * scale)
