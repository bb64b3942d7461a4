"""The RMSNorm between two batch-1 INT4 GEMVs folded into them (kernels/hopper/w4_gemv_norms.py): the GEMV ahead adds
its output to the residual stream's fp32 row, the GEMV behind normalises its input, 1 / rms applied where its fix-up
writes y.

Against fp64 references: the folded forms round differently from the unfolded ones by design (fp32 stream, one
rounding of s * weight), so each is checked to the error of the HFMA2 body's 16-bit sums, far below what a missing
add, norm or weight would leave. Gluon has no interpreter: the kernels need an sm_90 GPU. The refusals are checked
on any machine, and the model's side of the fold (what falls back to torch and the norm kernel) in
tests/test_norm_folding.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from minillm.kernels import split_k
from minillm.kernels.hopper import w4_gemv as hopper, w4_gemv_fused as fused_forms
from minillm.kernels.quant_pack import dequantize_int4
from minillm.kernels.fused_layer_ops import Norm, Rms

from test_quant_matmul import counters_are_clean, int4_problem, poisoned
from test_hopper_w4_gemv import ENGINE_LOGITS_TOLERANCE, assert_greedy_runs_agree, greedy_runs_with_logits, needs_sm90

EPS = 1e-5
# k, n, group: Llama-2-7B's o_proj and down_proj (many splits, 16 column tiles), one tile and no split, SmolLM2's
# width (576: K ending inside a tile, N = 2.25 column tiles), a group of 64.
CASES = [(4096, 4096, 128), (11008, 4096, 128), (128, 256, 128), (576, 576, 128), (1536, 576, 64)]
# The HFMA2 body's error relative to max |y| is ~6e-3 at most (hopper/w4_gemv.py); a folded form that dropped its
# add, its norm or the norm's weight would be off by about max |y| or more.
TOLERANCE = 1e-2
# Two such GEMVs in a chain (gate_up_proj, then down_proj on silu(gate) * up rounded to bf16): each adds its error.
# Measured on an H200 against fp64, SmolLM2's MLP: 1.03e-2 of max |y|.
CHAIN_TOLERANCE = 2 * TOLERANCE


def random_row(width: int, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, width, generator=g) * scale).to(dtype).to("cuda")


def assert_close_to(got: torch.Tensor, want: torch.Tensor, scale: float, tolerance: float = TOLERANCE) -> None:
    assert torch.isfinite(got).all()
    error = (got.double() - want).abs().max().item()
    assert error <= tolerance * scale, (error, scale)
    return error / scale


@needs_sm90
@pytest.mark.parametrize("k,n,group", CASES)
def test_added_to_the_residual_stream(k, n, group):
    """The stream's fp32 row gains x @ W in place, each split's part added where it is computed."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n)
    stream = random_row(n, seed=n, scale=4.0, dtype=torch.float32)
    y = x.double() @ dequantize_int4(qweight, scales, zeros, group, torch.float64)
    want = stream.double() + y
    returned = fused_forms.fused_gemv(x, qweight, scales, zeros, group, residual=stream)
    assert returned is stream
    assert_close_to(stream, want, y.abs().max().item())
    assert counters_are_clean()


@needs_sm90
@pytest.mark.parametrize("k,n,group", [(11008, 4096, 128), (1536, 576, 64)])
def test_gated_input_added_to_the_stream(k, n, group):
    """down_proj's folded form, SiLU-and-multiply on the way in and the stream added to on the way out: the gated
    GEMV's y added to the row."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + 2)
    gate_up, stream = random_row(2 * k, seed=k, scale=3.0), random_row(n, seed=n + 1, scale=4.0, dtype=torch.float32)
    y = fused_forms.fused_gemv(gate_up, qweight, scales, zeros, group, gated=True)
    want = stream.double() + y.double()
    fused_forms.fused_gemv(gate_up, qweight, scales, zeros, group, gated=True, residual=stream)
    assert_close_to(stream, want, y.abs().max().item())  # (y itself rounded to bf16: within the tolerance)
    assert counters_are_clean()


def rms_normed_fp64(s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.square().mean() + EPS) * weight.double()


@needs_sm90
@pytest.mark.parametrize("k,n,group", CASES)
def test_normed_input(k, n, group):
    """The GEMV of RMSNorm(s), s the stream's fp32 row: s times the norm's weight in the x tables, each split's
    squares beside its partial, 1 / rms where y is written (at one split, by the only program)."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + 1)
    s, weight = random_row(k, seed=k, scale=3.0, dtype=torch.float32), random_row(k, seed=k + 1)[0] + 1
    out = poisoned((1, n), torch.bfloat16)
    hopper.gemv(s, qweight, scales, zeros, group, out, norm=Norm(weight, EPS))
    want = rms_normed_fp64(s, weight) @ dequantize_int4(qweight, scales, zeros, group, torch.float64)
    assert_close_to(out, want, want.abs().max().item())
    assert counters_are_clean()


@needs_sm90
def test_folds_in_a_cuda_graph():
    """Replayed in a CUDA graph with new inputs: the normalising GEMV gives what a launch outside the graph gives
    (its fix-up sums in a fixed order; the counters reset), and the adding one adds again at each replay."""
    k, n, group = 4096, 4096, 128
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=9)
    w = dequantize_int4(qweight, scales, zeros, group, torch.float64)
    weight = random_row(k, seed=10)[0] + 1
    s, stream = random_row(k, seed=11, scale=2.0, dtype=torch.float32), random_row(n, seed=12, dtype=torch.float32)

    def run():
        y = fused_forms.fused_gemv(s, qweight, scales, zeros, group, norm=Norm(weight, EPS))
        return fused_forms.fused_gemv(y, qweight, scales, zeros, group, residual=stream), y

    run()  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, y = run()
    for seed in (13, 14):
        s.copy_(random_row(k, seed=seed, scale=2.0, dtype=torch.float32))
        y.fill_(float("nan"))
        before = stream.clone()
        graph.replay()
        eager = fused_forms.fused_gemv(s, qweight, scales, zeros, group, norm=Norm(weight, EPS))
        assert torch.equal(y, eager)
        assert_close_to(y, rms_normed_fp64(s, weight) @ w, y.abs().max().item())
        added = y.double() @ w
        assert_close_to(stream, before.double() + added, added.abs().max().item())
    assert counters_are_clean()


def deferred_mlp(s, weight, gate_up, down, slot_total, slot_squares, stream):
    """gate_up_proj leaving its norm's 1 / rms to down_proj (``fused_gemv(norm, residual, squares)``, then
    ``fused_gemv(gated, rms, residual)``): the MLP of a layer with its norms folded, the slot zeroed first."""
    slot_total.zero_()
    slot_squares.zero_()
    fused_forms.fused_gemv(s, *gate_up, norm=Norm(weight, EPS), residual=slot_total, squares=slot_squares)
    return fused_forms.fused_gemv(slot_total, *down, gated=True, rms=Rms(slot_squares, s.shape[-1], EPS),
                                  residual=stream)


@needs_sm90
@pytest.mark.parametrize("hidden,inner,group", [(4096, 11008, 128), (576, 1536, 64)])
def test_gate_up_leaves_its_norm_to_down_proj(hidden, inner, group):
    """Llama-2-7B's and SmolLM2's MLP: gate_up's splits add their unnormalised parts to the zeroed slot and store
    their sums of squares (one a split, zeros after), and down_proj applies 1 / rms as it loads the slot: the stream
    gains MLP(RMSNorm(s)) computed in fp64 (to two chained GEMVs' error) and what the undeferred fold gives (the same
    roundings, the sums in another order). Replayed in a CUDA graph with new inputs, it gives what it gives eagerly
    each time (the slot is zeroed inside the graph)."""
    gate_up = int4_problem(1, hidden, 2 * inner, group, torch.bfloat16, seed=hidden)[1:4] + (group,)
    down = int4_problem(1, inner, hidden, group, torch.bfloat16, seed=inner)[1:4] + (group,)
    w_gate_up, w_down = (dequantize_int4(*w, torch.float64) for w in (gate_up, down))
    weight = random_row(hidden, seed=hidden + 1)[0] + 1
    s = random_row(hidden, seed=hidden + 2, scale=3.0, dtype=torch.float32)
    stream = random_row(hidden, seed=hidden + 3, scale=4.0, dtype=torch.float32)
    slots = hopper.splits_needed(hidden, 1)
    slot = poisoned((2 * inner + slots,), torch.float32)
    slot_total, slot_squares = slot[:2 * inner], slot[2 * inner:]

    def want(s, stream):
        gate, up = (rms_normed_fp64(s, weight) @ w_gate_up).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w_down
        return stream.double() + y, y.abs().max().item()

    before = stream.clone()
    deferred_mlp(s, weight, gate_up, down, slot_total, slot_squares, stream)
    reference, scale = want(s, before)
    errors = [assert_close_to(stream, reference, scale, CHAIN_TOLERANCE)]
    used = hopper.splits_needed(hidden, hopper.choose_tiles(hidden, 2 * inner, hopper.num_sms(s.device)))
    assert torch.allclose(slot_squares[:used].double().sum(), s.double().square().sum(), rtol=1e-5)
    assert not slot_squares[used:].any()
    undeferred = before.clone()  # gate_up normalising itself (its fix-up applies 1 / rms)
    normed = fused_forms.fused_gemv(s, *gate_up, norm=Norm(weight, EPS))
    fused_forms.fused_gemv(normed, *down, gated=True, residual=undeferred)
    assert_close_to(stream, undeferred.double(), scale)
    assert counters_are_clean()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deferred_mlp(s, weight, gate_up, down, slot_total, slot_squares, stream)
    for seed in (5, 6):
        s.copy_(random_row(hidden, seed=seed, scale=2.0, dtype=torch.float32))
        stream.copy_(before)
        graph.replay()
        replayed = stream.clone()
        reference, scale = want(s, before)
        errors.append(assert_close_to(replayed, reference, scale, CHAIN_TOLERANCE))
        stream.copy_(before)
        deferred_mlp(s, weight, gate_up, down, slot_total, slot_squares, stream)
        assert_close_to(replayed, stream.double(), scale, 1e-3)  # (the same, reduced in another order)
    print(f"largest error against fp64 over max |y|: {max(errors):.2e}")


def test_fold_refusals_name_the_reason():
    """On any machine: the inputs the folded forms cannot take, and why."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 64, 128, torch.bfloat16, seed=1)
    norm = Norm(torch.ones(256, dtype=torch.bfloat16, device=x.device), EPS)
    stream = torch.zeros(1, 64, device=x.device)
    refusals = {
        "not both": dict(x=torch.cat([x, x], 1), gated=True, norm=norm),
        "fp32 residual row of N = 64": dict(residual=stream[:, :32]),
        "not torch.bfloat16 (1, 64)": dict(residual=stream.bfloat16()),
        "fp32 row, not a torch.bfloat16": dict(norm=norm),
        "weight as a contiguous": dict(x=x.float(), norm=norm._replace(weight=norm.weight[:128])),
        "adds to a row only with squares": dict(x=x.float(), norm=norm, residual=stream),
        "it needs both norm and residual": dict(x=x.float(), norm=norm, squares=torch.zeros(2, device=x.device)),
        "a slot for each of up to 2 splits": dict(x=x.float(), norm=norm, residual=stream,
                                                  squares=torch.zeros(1, device=x.device)),
        "it needs gated=True": dict(x=x.float(), rms=Rms(torch.zeros(2, device=x.device), 64, EPS)),
        "rms.squares as a contiguous fp32": dict(x=torch.cat([x, x], 1).float(), gated=True,
                                                 rms=Rms(torch.zeros(2, device=x.device).bfloat16(), 64, EPS)),
        "an fp32 row to normalise, not torch.bfloat16": dict(x=torch.cat([x, x], 1), gated=True,
                                                             rms=Rms(torch.zeros(2, device=x.device), 64, EPS)),
    }
    for reason, change in refusals.items():
        args = dict(x=x, residual=None, norm=None, gated=False) | change
        row = args.pop("x")
        assert reason in fused_forms.fused_unsupported(row, qweight, scales, zeros, 128, **args)
        with pytest.raises(ValueError, match=re.escape(reason)):
            fused_forms.fused_gemv(row, qweight, scales, zeros, 128, **args)
    launch = (x, qweight, scales, zeros, 128, poisoned((1, 64), torch.bfloat16), stream,
              split_k.tile_counters(x.device), False)
    with pytest.raises(ValueError, match="fp32 row in out, not to torch.bfloat16"):
        hopper.w4_gemv(*launch, add=True)
    with pytest.raises(ValueError, match="normalises its input and adds y to a row only if"):
        hopper.w4_gemv(*launch, add=True, norm=norm)
    with pytest.raises(ValueError, match="needs gated=True"):
        hopper.w4_gemv(*launch, rms=Rms(stream[0], 64, EPS))


@needs_sm90
def test_int4_engine_with_the_norms_folded_decodes_as_with_the_norm_kernels(monkeypatch):
    """Batch-1 decode of SmolLM2's shapes (dummy weights) at RTN INT4 with the norms folded and not: the
    folded GEMVs run (o_proj and down_proj adding, gate_up_proj and qkv_proj normalising). The folded layer keeps the
    residual stream in fp32 where the unfolded one rounds it to bf16, so the two need not choose the same tokens:
    while their tokens agree, their logits must be close, and where a token first differs, the norm kernels' engine
    must have had the two nearly tied (its logits for them no further apart than the engines' logits differ)."""
    from minillm import LLM, SamplingParams
    from minillm.model.fused import FusedLlamaForCausalLM
    fold_norms = FusedLlamaForCausalLM.fold_norms

    calls, fused = {True: [], False: []}, fused_forms.fused_gemv  # (adds, normalises) of each fused GEMV, by engine
    building = [None]
    monkeypatch.setattr(fused_forms, "fused_gemv", lambda *a, **kw: calls[building[0]].append(
        (kw.get("residual") is not None, kw.get("norm") is not None)) or fused(*a, **kw))

    def make_llm(folded):
        building[0] = folded
        monkeypatch.setattr(FusedLlamaForCausalLM, "fold_norms",  # (unfolded: the norms stay kernels)
                            lambda self, on=True: fold_norms(self, on and folded))
        return LLM("smollm2-135m", load_format="dummy", quantization="rtn-int4", batching="continuous",
                   max_num_seqs=1, max_model_len=128, num_kv_blocks=64,  # two engines in one process: a small cache each
                   async_scheduling=False)  # a sampler call a step, so the logits line up step by step

    prompts = [list(range(5, 40)), list(range(300, 317))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens, logits = greedy_runs_with_logits(monkeypatch, make_llm, (True, False), prompts, params)
    # (o_proj adding; gate_up_proj and qkv_proj leaving their norms' 1 / rms to the kernels behind them)
    assert (True, False) in calls[True] and (True, True) in calls[True], "batch-1 decode never folded a norm"
    assert not any(add or norm for add, norm in calls[False])
    worst = assert_greedy_runs_agree(tokens, logits, ENGINE_LOGITS_TOLERANCE, reference=False, other=True)
    print(f"largest logit difference over max |logit|: {worst:.2e}; same tokens: {tokens[True] == tokens[False]}")
