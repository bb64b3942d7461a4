"""The stream-K W4A16 GEMV (kernels/w4_gemv_stream.py) against ``w4a16_matmul_ref``: its bf16 form (the fix-up of
column tiles that several programs share, by poll and by counter) and its add form (y added to an fp32 row), over
shapes that leave a column tile ragged, a group of 64, one unit a program and many programs a tile, and in a CUDA
graph; the poll with NaNs, and its refusal of programs that could not all be resident.

Gluon has no interpreter: the numerical tests need an sm_90 GPU. On the CPU, ``plan`` (the work's split) is tested,
and the kernel is compiled for sm_90 (tests/test_w4_gemv_stream_sass.py).
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import split_k, w4_gemv_stream as stream
from minillm.kernels.quant_matmul import w4a16_matmul_ref

from test_quant_matmul import (assert_matches, assert_replays_in_a_graph, counters_are_clean, int4_problem,
                               poisoned)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and stream.GLUON_USABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")

CASES = [  # k, n, group, programs an SM, slots
    (4096, 11008, 128, 3, 2),  # Llama-2-7B's gate/up: ~9 programs a column tile
    (11008, 4096, 128, 2, 3),  # its down_proj: 86 units a column tile
    (4096, 4128, 128, 2, 2),  # a ragged last column tile (TMA's zero fill)
    (4096, 1024, 64, 3, 2),  # two groups a unit
    (11008, 256, 128, 2, 2),  # one column tile, one unit a program: 86 partials
    (512, 96, 64, 1, 4),  # fewer units than programs
]


def program_of(unit: int, programs: int, units: int) -> int:
    """By search, not by the kernel's formula: the program whose run [p U / P, (p + 1) U / P) holds ``unit``."""
    return next(p for p in range(programs) if p * units // programs <= unit < (p + 1) * units // programs)


@pytest.mark.parametrize("k,n,programs", [(4096, 11008, 396), (11008, 4096, 264), (11008, 256, 528), (512, 96, 132),
                                          (4096, 4096, 132)])
def test_plan_covers_every_unit_once_and_counts_a_tiles_programs(k, n, programs):
    numbers = stream.plan(k, n, programs)
    units, kt, p = numbers["U"], numbers["KT"], numbers["P"]
    assert kt == -(-k // 128) and units == kt * -(-n // 256) and p == min(programs, units)
    runs = [(i * units // p, (i + 1) * units // p) for i in range(p)]
    assert runs[0][0] == 0 and runs[-1][1] == units and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    longest = max(b - a for a, b in runs)
    assert longest >= 1 and numbers["UNITS"] >= longest and numbers["UNITS"] & (numbers["UNITS"] - 1) == 0
    sharing = [program_of((c + 1) * kt - 1, p, units) - program_of(c * kt, p, units) + 1 for c in range(units // kt)]
    assert numbers["MAX_SLOTS"] >= max(sharing) and numbers["MAX_SLOTS"] < 2 * max(sharing)
    assert stream.partials_needed(k, n, programs) == units // kt * numbers["MAX_SLOTS"] * 256


def test_it_refuses_what_it_cannot_run_and_says_why():
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    qweight = torch.zeros(512, 1000, dtype=torch.int32)  # N = 1000: not a multiple of 32
    with pytest.raises(ValueError, match="N of 32.*N = 1000"):
        stream.w4_gemv_stream(x, qweight, None, None, 128, None, None, None)


def slots_are_empty(device) -> bool:
    """FIXUP_POLL leaves every slot of the device's fix-up EMPTY for the next launch."""
    slots = stream.POLL_SLOTS.get(device)
    return slots is None or bool((slots == stream.EMPTY).all())


@needs_sm90
@pytest.mark.parametrize("k,n,group,per_sm,stages", CASES)
@pytest.mark.parametrize("form", ["poll", "counter", "add"])
def test_stream_gemv_matches_ref(k, n, group, per_sm, stages, form):
    add = form == "add"
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + group + add)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group)
    partials = torch.full((stream.partials_needed(k, n, per_sm * stream.num_sms(x.device)),), float("nan"),
                          device=x.device)
    counters = split_k.tile_counters(x.device)
    fixup = stream.FIXUP_COUNTER if form == "counter" else stream.FIXUP_POLL
    start = torch.randn(1, n, device=x.device) if add else None
    out = start.clone() if add else poisoned((1, n), torch.bfloat16)
    stream.w4_gemv_stream(x, qweight, scales, zeros, group, out, partials, counters, programs_per_sm=per_sm,
                          stages=stages, add=add, fixup=fixup)
    if add:  # y added to the row in fp32
        torch.testing.assert_close(out - start, want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())
    else:
        assert_matches(out, want, torch.bfloat16)
        for _ in range(3):
            again = poisoned((1, n), torch.bfloat16)
            stream.w4_gemv_stream(x, qweight, scales, zeros, group, again, partials, counters,
                                  programs_per_sm=per_sm, stages=stages, fixup=fixup)
            assert torch.equal(again, out), "the fix-up sums in an order the plan fixes: the same bits every run"
    assert counters_are_clean() and slots_are_empty(x.device)


@needs_sm90
def test_poll_fix_up_passes_nans_through_and_leaves_its_slots_empty():
    """A NaN in x makes NaN partials, which the poll must take as stored (not EMPTY, which would leave the tile's
    first program waiting for ever): y is NaN where the reference's is (everywhere: NaN times any weight)."""
    k, n = 4096, 11008
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=5)
    x[0, 3000] = float("nan")
    out = poisoned((1, n), torch.bfloat16)
    stream.w4_gemv_stream(x, qweight, scales, zeros, 128, out, programs_per_sm=3, stages=2)
    torch.cuda.synchronize()
    want = w4a16_matmul_ref(x, qweight, scales, zeros, 128)
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()
    assert slots_are_empty(x.device)


@needs_sm90
def test_poll_refuses_more_programs_an_sm_than_fit():
    """The poll's first programs wait for the others: programs that could not all be resident would hang, so the
    launch says so instead (3 programs of 12 slots, ~200 KB each, on a 228 KB SM)."""
    k, n = 4096, 4096
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=6)
    out = poisoned((1, n), torch.bfloat16)
    with pytest.raises(ValueError, match="programs_per_sm=3, but an SM holds [01] of these programs"):
        stream.w4_gemv_stream(x, qweight, scales, zeros, 128, out, programs_per_sm=3, stages=12)
    stream.w4_gemv_stream(x, qweight, scales, zeros, 128, out, programs_per_sm=1, stages=12)
    assert_matches(out, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("fixup", ["poll", "counter"])
def test_stream_gemv_replays_in_a_cuda_graph(fixup):
    """Counters reset by each tile's last program, poll slots emptied by each tile's first: replays with new x stay
    right."""
    k, n = 4096, 11008
    fixup = stream.FIXUP_POLL if fixup == "poll" else stream.FIXUP_COUNTER
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=12)
    partials = torch.empty(stream.partials_needed(k, n, 3 * stream.num_sms(x.device)), device=x.device)
    counters = split_k.tile_counters(x.device)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)

    def run():
        stream.w4_gemv_stream(x, qweight, scales, zeros, 128, out, partials, counters, programs_per_sm=3, stages=2,
                              fixup=fixup)
        return out
    assert_replays_in_a_graph(run, x, qweight, scales, zeros, 128)
    assert counters_are_clean() and slots_are_empty(x.device)


@needs_sm90
@pytest.mark.parametrize("form", ["add", "gated", "normed", "scaled"])
def test_fused_forms_on_the_stream_kernel_match_the_split_k_kernel(monkeypatch, form):
    """``fused_gemv``'s add forms with MINILLM_GEMV_STREAM=1 (``w4_gemv_hopper.STREAM``) against the split-K kernel's
    (the reference the fused forms' own tests hold it to): Llama-2-7B's o_proj (add), down_proj (gated; scaled: the
    1 / rms gate_up left it), gate_up_proj (normed: y without 1 / rms, and the whole row's sum of squares in the
    slots of column tile 0's programs, zeros after). The order of the REDs differs, so to the body's error."""
    from minillm.kernels import w4_gemv_fused as fused_forms, w4_gemv_hopper as hopper
    from minillm.kernels.w4_gemv_norms import Norm, Rms
    k, n = {"add": (4096, 4096), "gated": (11008, 4096), "normed": (4096, 22016), "scaled": (11008, 4096)}[form]
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=k + n + len(form))
    g = torch.Generator().manual_seed(n)
    row = {"add": lambda: torch.randn(1, k, generator=g).to(torch.bfloat16),
           "gated": lambda: (torch.randn(1, 2 * k, generator=g) * 3).to(torch.bfloat16),
           "normed": lambda: torch.randn(1, k, generator=g) * 3,
           "scaled": lambda: torch.randn(1, 2 * k, generator=g) * 40}[form]().cuda()
    slots = k // 128
    kwargs = {"add": {}, "gated": {"gated": True}, "normed": {"norm": Norm(torch.rand(k, generator=g).to(
        torch.bfloat16).cuda() + 0.5, 1e-5)}, "scaled": {"gated": True}}[form]
    if form == "scaled":  # a gate_up row's sums of squares as its GEMV would have left them, zeros after
        sums = torch.zeros(2 * k // 128, device="cuda")
        sums[:5] = (torch.rand(5, generator=g) * 1e5).cuda()
        kwargs["rms"] = Rms(sums, 4096, 1e-5)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(hopper, "STREAM", hopper.STREAM_FORMS if on else ())
        start = torch.randn(1, n, generator=torch.Generator().manual_seed(1)).cuda() * (0 if form == "normed" else 4)
        squares = torch.zeros(slots, device="cuda") if form == "normed" else None  # (zeroed, as the engine's are)
        out = fused_forms.fused_gemv(row, qweight, scales, zeros, 128, residual=start, squares=squares, **kwargs)
        results[on] = (out.clone(), None if squares is None else squares.clone())
    (split_k_y, split_k_squares), (stream_y, stream_squares) = results[False], results[True]
    scale = split_k_y.abs().max().item()
    torch.testing.assert_close(stream_y, split_k_y, rtol=0, atol=1e-2 * scale)
    if form == "normed":
        for squares in (split_k_squares, stream_squares):
            assert torch.allclose(squares.double().sum(), row.double().square().sum(), rtol=1e-5)
        sms = stream.num_sms(row.device)
        numbers = stream.plan(k, n, stream.choose_shape(k, n, sms)[0] * sms)
        first_tile = (numbers["KT"] * numbers["P"] - 1) // numbers["U"] + 1  # the programs holding column tile 0
        assert stream_squares[:first_tile].all() and not stream_squares[first_tile:].any()
    assert counters_are_clean()


@needs_sm90
@pytest.mark.parametrize("k,n", [(4096, 12288), (11008, 4096)])
def test_w4a16_matmul_runs_the_plain_form_on_the_stream_kernel_where_asked(monkeypatch, k, n):
    """MINILLM_GEMV_STREAM=plain (``w4_gemv_hopper.STREAM``): a bf16 row's y = x W through ``w4a16_matmul`` comes from
    the stream kernel with ``choose_fixup``'s fix-up (Llama-2-7B's qkv_proj where norms are not folded: the poll, its
    slots used; down_proj: the counter), equal to the split-K kernel's to the fp32 sums' order."""
    from minillm.kernels import w4_gemv_hopper as hopper
    from minillm.kernels.quant_matmul import w4a16_matmul
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=21)
    monkeypatch.setattr(hopper, "COLUMNS", ())  # (by default the plain form takes the column kernel)
    monkeypatch.setattr(hopper, "STREAM", ())
    split_k_y = w4a16_matmul(x, qweight, scales, zeros, 128)
    monkeypatch.setattr(hopper, "STREAM", ("plain",))
    monkeypatch.setattr(stream, "POLL_SLOTS", {})
    launches = []
    stream_launch = stream.w4_gemv_stream
    monkeypatch.setattr(stream, "w4_gemv_stream", lambda *a, **kw: launches.append(kw["fixup"]) or stream_launch(
        *a, **kw))
    stream_y = w4a16_matmul(x, qweight, scales, zeros, 128)
    sms = stream.num_sms(x.device)
    assert launches == [stream.choose_fixup(k, n, stream.choose_shape(k, n, sms)[0] * sms)]
    assert (x.device in stream.POLL_SLOTS) == (launches[0] == stream.FIXUP_POLL) and slots_are_empty(x.device)
    assert counters_are_clean()
    torch.testing.assert_close(stream_y.float(), split_k_y.float(), rtol=0,
                               atol=1e-2 * split_k_y.float().abs().max().item())
    assert_matches(stream_y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)


@pytest.mark.parametrize("value,forms", [("0", ()), ("off", ()), ("1", ("plain", "add", "gated", "normed")),
                                         ("", ("plain",)), ("plain", ("plain",)), (" Plain , add ", ("plain", "add")),
                                         ("plain,", ("plain",)), ("bogus", None), (",", None)])
def test_the_switch_names_forms_and_refuses_others(value, forms):
    """MINILLM_GEMV_STREAM: 0, 1 (and their words), empty for the default, or forms by name; anything else says
    what is valid."""
    from minillm.kernels import w4_gemv_hopper as hopper
    if forms is None:
        with pytest.raises(ValueError, match="MINILLM_GEMV_STREAM must be 0, 1 or forms among plain, add, gated, "
                                             "normed"):
            hopper.forms_switch("MINILLM_GEMV_STREAM", value, hopper.STREAM_FORMS, ("plain",))
    else:
        assert hopper.forms_switch("MINILLM_GEMV_STREAM", value, hopper.STREAM_FORMS, ("plain",)) == forms


def test_a_bad_switch_stops_the_import_with_the_reason():
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", "import minillm.kernels.w4_gemv_hopper"], capture_output=True,
                          text=True, env={**os.environ, "MINILLM_GEMV_STREAM": "plan"})
    assert done.returncode != 0 and "got 'plan'" in done.stderr


@pytest.mark.parametrize("value, start", [("0", 0), ("2", 2), (" 1 ", 1), ("3", None), ("late", None), ("", None)])
def test_the_start_switch_takes_0_1_or_2(value, start):
    """MINILLM_GEMV_STREAM_START (a sweep's START for ``gemv``'s launches)."""
    if start is None:
        with pytest.raises(ValueError, match=f"must be 0, 1 or 2 .*got {value!r}"):
            stream.start_switch(value)
    else:
        assert stream.start_switch(value) == start


@pytest.mark.parametrize("k,n,programs,fixup", [(4096, 11008, 396, stream.FIXUP_POLL),  # 9-10 programs a tile
                                                (4096, 12288, 396, stream.FIXUP_POLL),
                                                (11008, 4096, 396, stream.FIXUP_COUNTER),  # ~25
                                                (4096, 4096, 264, stream.FIXUP_COUNTER)])  # 16-17
def test_choose_fixup_polls_only_where_few_programs_share_a_tile(k, n, programs, fixup):
    assert stream.choose_fixup(k, n, programs) == fixup
    assert (stream.plan(k, n, programs)["MAX_SLOTS"] <= 16) == (fixup == stream.FIXUP_POLL)


@needs_sm90
def test_gemv_takes_the_split_k_kernel_where_the_poll_would_not_fit(monkeypatch):
    """``w4_gemv_hopper.gemv``: a stream launch refused for residency (``DoesNotFit``, before any launch) runs the
    split-K kernel instead, not an error."""
    from minillm.kernels import w4_gemv_hopper as hopper
    from minillm.kernels.quant_matmul import w4a16_matmul
    k, n = 4096, 12288
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=22)
    monkeypatch.setattr(hopper, "COLUMNS", ())
    monkeypatch.setattr(hopper, "STREAM", ("plain",))
    monkeypatch.setattr(stream, "FITS", {})
    monkeypatch.setattr(stream, "programs_that_fit", lambda *args: 0)
    launches = []
    split_k_launch = hopper.w4_gemv
    monkeypatch.setattr(hopper, "w4_gemv", lambda *a, **kw: launches.append(1) or split_k_launch(*a, **kw))
    y = w4a16_matmul(x, qweight, scales, zeros, 128)
    assert launches == [1]
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)
