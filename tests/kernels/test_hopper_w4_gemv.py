"""The Gluon W4A16 GEMV for Hopper (kernels/hopper/w4_gemv.py) against ``w4a16_matmul_ref``, and when
``w4a16_matmul`` picks it.

Gluon has no interpreter, so the numerical tests need an sm_90 GPU; on the CPU the dispatch and its reasons are
tested, and tests/test_w4_gemv_hopper_sass.py compiles the kernel for sm_90 and counts its instructions.
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import split_k
from minillm.kernels.hopper import w4_gemv as hopper, w4_gemv_fused as fused_forms
from minillm.kernels.checks import num_sms
from minillm.kernels.fused_layer_ops import silu_and_mul
from minillm.kernels.hopper.pdl import supported as pdl_supported
from minillm.kernels.quant_matmul import w4a16_matmul, w4a16_matmul_ref
from minillm.parallel.tp import RowParallelQuantLinear
from minillm.quant.linear import QuantLinear

from test_quant_matmul import assert_matches, counters_are_clean, int4_problem, poisoned

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.GLUON_USABLE
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")

CASES = [
    # k, n, group, tiles: one tile and no split; K ending inside a tile and inside a group of 128 (576, SmolLM2's
    # width: 4.5 groups); N not a multiple of 256 (the last column tile partial, TMA's zero fill); group 64 (two
    # groups a tile); splits that leave the last program short of tiles (11008 = 86 tiles, 4 a program), 1 to 8
    # tiles a program, and 86 splits (more than a fix-up chunk of 32 partials).
    (128, 256, 128, None),
    (576, 608, 128, None),
    (4096, 1024, 128, None),
    (576, 96, 64, 2),
    (4096, 1024, 128, 1),
    (4096, 1024, 64, 8),
    (11008, 512, 128, None),
    (11008, 544, 64, 4),
    (2048, 4096, 128, 2),
    (11008, 256, 128, 1),
]


@needs_sm90
@pytest.mark.parametrize("k,n,group,tiles", CASES)
def test_hopper_w4_gemv_matches_ref(k, n, group, tiles):
    """Through ``w4a16_matmul`` at the default tiles; a pinned tile count launches the kernel itself, with the partials
    its splits need."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + group)
    out = poisoned((1, n), torch.bfloat16)
    if tiles is None:
        assert w4a16_matmul(x, qweight, scales, zeros, group, out=out) is out
    else:
        partials = torch.full((hopper.splits_needed(k, tiles) * n,), float("nan"), device=x.device)
        hopper.w4_gemv(x, qweight, scales, zeros, group, out, partials, split_k.tile_counters(x.device), True,
                       tiles=tiles)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group)
    assert_matches(out, want, torch.bfloat16)
    assert counters_are_clean()
    # (A pinned Triton config: autotuning it per shape made this file outlast a device call.)
    pinned = dict(BLOCK_N=64, BLOCK_KP=16, SPLIT_K=2, num_warps=4)
    triton = w4a16_matmul(x, qweight, scales, zeros, group, config=pinned)
    torch.testing.assert_close(out.float(), triton.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())


@needs_sm90
@pytest.mark.parametrize("magnitude", [1e-6, 1e6])
def test_hopper_w4_gemv_keeps_large_and_small_activations(magnitude):
    """x is scaled by 2**101 for the 16-bit products: 1e6 must not overflow, 1e-6 not vanish into subnormals."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 1024, 512, 128, torch.bfloat16, seed=3)
    x = (x.float() * magnitude).to(torch.bfloat16)
    y = w4a16_matmul(x, qweight, scales, zeros, 128, hopper=True)
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)


@needs_sm90
def test_hopper_w4_gemv_replays_in_a_cuda_graph():
    """Split-K arrival counters reset by the last program: replays with new x each stay right."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 4096, 1024, 128, torch.bfloat16, seed=11)
    h = x.clone()
    w4a16_matmul(h, qweight, scales, zeros, 128, hopper=True)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_matmul(h, qweight, scales, zeros, 128, hopper=True)
    for seed in range(3):
        h.copy_(int4_problem(1, 4096, 8, 128, torch.bfloat16, seed=30 + seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        assert_matches(y, w4a16_matmul_ref(h, qweight, scales, zeros, 128), torch.bfloat16)
    assert counters_are_clean()


@needs_sm90
def test_hopper_w4_gemv_is_what_m1_bf16_takes_and_config_keeps_triton(monkeypatch):
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 256, 128, torch.bfloat16, seed=2)
    calls = []
    launch = hopper.gemv  # (which picks the Gluon kernel: the column kernel, by default, for this plain form)
    monkeypatch.setattr(hopper, "gemv", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    w4a16_matmul(x, qweight, scales, zeros, 128)
    w4a16_matmul(x, qweight, scales, zeros, 128, hopper=False)
    w4a16_matmul(x, qweight, scales, zeros, 128, config=dict(BLOCK_N=64, BLOCK_KP=16, SPLIT_K=2, num_warps=4))
    w4a16_matmul(x.half(), qweight, scales.half(), zeros, 128)  # fp16: the Triton GEMV
    w4a16_matmul(x.expand(2, -1), qweight, scales, zeros, 128)  # two rows: the Triton GEMV
    w4a16_matmul(x, qweight, scales, zeros, 128, path="dot")
    assert calls == [1]


def gate_up_row(k: int, seed: int, device: torch.device) -> torch.Tensor:
    """A random gate_up row [1, 2K] spread like an MLP's (gates of both signs, a few large)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2 * k, generator=g) * 3).to(torch.bfloat16).to(device)


def split_k_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group: int) -> torch.Tensor:
    """The plain form (a bf16 y) on the split-K kernel at its default tiles (``gemv`` runs the column kernel)."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    tiles = hopper.choose_tiles(k, n, num_sms(x.device))
    out = poisoned((1, n), torch.bfloat16)
    partials = torch.empty(max(hopper.partials_needed(k, n, tiles), 1), dtype=torch.float32, device=x.device)
    hopper.w4_gemv(x, qweight, scales, zeros, group, out, partials, split_k.tile_counters(x.device),
                   pdl_supported(x.device), tiles=tiles)
    return out


@needs_sm90
@pytest.mark.parametrize("k,n,group", [(11008, 4096, 128), (1536, 576, 64), (576, 608, 128)])
def test_gated_gemv_is_silu_and_mul_then_the_gemv_bit_for_bit(k, n, group):
    """The down projection with SiLU-and-multiply applied as x is loaded: bit for bit the two kernels it replaces
    (Llama-2-7B's down_proj, a group of 64, K ending inside a tile), both on the split-K kernel."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n)
    gate_up = gate_up_row(k, n, qweight.device)
    fused = fused_forms.fused_gemv(gate_up, qweight, scales, zeros, group, gated=True)
    x = silu_and_mul(gate_up)
    assert torch.equal(fused, split_k_gemv(x, qweight, scales, zeros, group))
    assert_matches(fused, w4a16_matmul_ref(x, qweight, scales, zeros, group), torch.bfloat16)
    assert counters_are_clean()


@needs_sm90
@pytest.mark.parametrize("late", [1, 3, 8])
def test_split_k_tiles_copied_after_x_give_the_same_bits(monkeypatch, late):
    """``hopper.LATE_TILES``: a program's last tiles copied after x's tables, not before the wait (at most all but
    one; one by default): the plain and gated forms' bits unchanged."""
    k, n = 11008, 4096
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=31)
    gate_up = gate_up_row(k, 32, qweight.device)
    answers = {}
    for tiles in (0, late):
        monkeypatch.setattr(hopper, "LATE_TILES", tiles)
        answers[tiles] = (split_k_gemv(x, qweight, scales, zeros, 128),
                          fused_forms.fused_gemv(gate_up, qweight, scales, zeros, 128, gated=True))
    assert torch.equal(answers[0][0], answers[late][0]) and torch.equal(answers[0][1], answers[late][1])
    assert_matches(answers[late][0], w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.bfloat16)
    assert counters_are_clean()


@needs_sm90
def test_quant_linear_takes_gate_up_where_the_gluon_gemv_can():
    """QuantLinear.forward(gated=True) equals forward(silu_and_mul(gate_up)); act-order, a bias or two rows refuse."""
    k, n = 1024, 512
    _, qweight, scales, zeros, q, z = int4_problem(1, k, n, 128, torch.bfloat16, seed=5)
    layer = QuantLinear(k, n, 4, 128, bias=False, dtype=torch.bfloat16, device="cuda")
    layer.qweight.copy_(qweight), layer.scales.copy_(scales), layer.zeros.copy_(zeros)
    gate_up = gate_up_row(k, 6, qweight.device)
    assert layer.takes_gated(gate_up) and not layer.takes_gated(gate_up.expand(2, -1))
    assert torch.equal(layer(gate_up, gated=True), layer(silu_and_mul(gate_up)))
    for refused, reason in ((QuantLinear(k, n, 4, 128, bias=True, dtype=torch.bfloat16, device="cuda"), "bias"),
                            (QuantLinear(k, n, 4, 128, bias=False, act_order=True, dtype=torch.bfloat16,
                                         device="cuda"), "act-order")):
        assert not refused.takes_gated(gate_up)
        with pytest.raises(ValueError, match=reason):
            refused(gate_up, gated=True)


def greedy_runs_with_logits(monkeypatch, make_llm, variants, prompts, params):
    """Run ``make_llm(variant)`` for each variant on the same prompts, greedy; return the tokens and the logits
    the sampler saw (one row a step, in order), by variant."""
    from minillm.sampling import Sampler

    seen, sample = [], Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, requests: seen.append(logits.float().clone())
                        or sample(self, logits, requests))
    tokens, logits = {}, {}
    for variant in variants:
        llm = make_llm(variant)
        tokens[variant] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
        logits[variant], seen[:] = list(seen), []
        assert len(logits[variant]) == len(prompts) * params.max_tokens  # one row a step, in order
    return tokens, logits


def assert_greedy_runs_agree(tokens, logits, tolerance: float, reference, other) -> float:
    """Two engines' greedy decodes agree where their arithmetic does: while their tokens agree their logits are
    within ``tolerance`` of max |logit|, and where a token first differs, ``reference`` had the two nearly tied (its
    logits for them no further apart than the engines' logits differ). Returns the largest relative difference."""
    worst = 0.0
    for p, (ref_tokens, other_tokens) in enumerate(zip(tokens[reference], tokens[other])):
        for t, (chosen, instead) in enumerate(zip(ref_tokens, other_tokens)):
            step = p * len(ref_tokens) + t
            ref_logits, other_logits = logits[reference][step][0], logits[other][step][0]
            difference = (other_logits - ref_logits).abs().max().item()
            worst = max(worst, difference / ref_logits.abs().max().item())
            assert difference <= tolerance * ref_logits.abs().max().item(), (p, t, difference)
            if chosen != instead:  # the contexts differ from here on
                assert ref_logits[chosen] - ref_logits[instead] <= 2 * difference, (p, t)
                break
    return worst


# Two INT4 engines' logits while their contexts agree, relative to max |logit|. The logits are bf16 and, with dummy
# weights, small (max |logit| about 2.3, where a bf16 step is 1/64): a few steps apart is 2-3e-2. Measured on an H100,
# gated GEMV against SiLU-and-multiply and the plain GEMV: 2.2e-2; on an H200, folded norms: 2.48e-2.
ENGINE_LOGITS_TOLERANCE = 5e-2


@needs_sm90
def test_int4_engine_decodes_as_with_the_gated_gemv(monkeypatch):
    """Batch-1 decode of SmolLM2's shapes (dummy weights: the device need not hold the model) at RTN INT4: down_proj
    takes gate_up (one kernel less a layer), and the engine decodes as with SiLU-and-multiply's own kernel: the
    same logits within rounding, and the same greedy tokens but at a near tie."""
    from minillm import LLM, SamplingParams
    from minillm.model.fused import FusedLlamaForCausalLM

    gated_calls, fused = {True: [], False: []}, fused_forms.fused_gemv  # the gated= of each fused GEMV, by engine
    building = [None]
    monkeypatch.setattr(fused_forms, "fused_gemv",
                        lambda *a, **kw: gated_calls[building[0]].append(kw.get("gated")) or fused(*a, **kw))
    # Without the norms folded: tests/kernels/test_hopper_w4_gemv_norms.py compares those engines.
    monkeypatch.setattr(FusedLlamaForCausalLM, "fold_norms", lambda self, enabled=True: None)
    takes_gated = QuantLinear.takes_gated

    def make_llm(gated):
        building[0] = gated
        monkeypatch.setattr(QuantLinear, "takes_gated", takes_gated if gated else lambda self, gate_up: False)
        return LLM("smollm2-135m", load_format="dummy", quantization="rtn-int4", batching="continuous",
                   max_num_seqs=1, max_model_len=128, num_kv_blocks=64,  # two engines in one process: a small cache each
                   async_scheduling=False)  # a sampler call a step, so the logits line up step by step

    prompts = [list(range(5, 40)), list(range(300, 317))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens, logits = greedy_runs_with_logits(monkeypatch, make_llm, (True, False), prompts, params)
    assert any(gated_calls[True]), "batch-1 decode never took the gated GEMV"
    assert not any(gated_calls[False]), "the engine without the gated form still took it"
    worst = assert_greedy_runs_agree(tokens, logits, ENGINE_LOGITS_TOLERANCE, reference=False, other=True)
    print(f"largest logit difference over max |logit|: {worst:.2e}; same tokens: {tokens[True] == tokens[False]}")


def test_gated_gemv_refusals_name_the_reason():
    """On any machine: a gate_up row of the wrong width, two rows, and a layer that cannot take it."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 64, 128, torch.bfloat16, seed=1)
    assert "2K = 512" in fused_forms.fused_unsupported(x, qweight, scales, zeros, 128, gated=True)
    two_rows = gate_up_row(512, 2, x.device).view(2, 512)
    assert "one gate_up row" in fused_forms.fused_unsupported(two_rows, qweight, scales, zeros, 128, gated=True)
    with pytest.raises(ValueError, match="2K = 512"):
        fused_forms.fused_gemv(x, qweight, scales, zeros, 128, gated=True)
    with pytest.raises(ValueError, match="scales"):  # the layout checked first: scales in x's dtype
        fused_forms.fused_gemv(torch.cat([x, x], 1), qweight, scales.half(), zeros, 128, gated=True)
    cpu_row = gate_up_row(256, 3, torch.device("cpu"))
    for layer in (QuantLinear(256, 64, 4, 128, bias=False, dtype=torch.bfloat16),
                  RowParallelQuantLinear(256, 64, 4, 128, bias=False, dtype=torch.bfloat16)):  # tensor parallel
        assert not layer.takes_gated(cpu_row)
        with pytest.raises(ValueError, match="cannot run"):  # no TypeError: the row-parallel layer takes gated=
            layer(cpu_row, gated=True)
    int8 = QuantLinear(256, 64, 8, -1, bias=False, dtype=torch.bfloat16)
    assert not int8.takes_gated(cpu_row)
    with pytest.raises(ValueError, match="INT8"):
        int8(cpu_row, gated=True)


def test_unsupported_names_the_reason():
    """On any machine: what the kernel refuses, and hopper=True turning a refusal into a ValueError that says why."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 64, 128, torch.bfloat16, seed=1)
    if not hopper.GLUON_USABLE:
        assert "Gluon" in hopper.unsupported(x, qweight, scales, zeros, 128)
        return
    assert "bf16" in hopper.unsupported(x.half(), qweight, scales.half(), zeros, 128)
    assert "one row" in hopper.unsupported(x.expand(2, -1), qweight, scales, zeros, 128)
    assert "group_size" in hopper.unsupported(x, qweight, scales, zeros, 32)
    x40, q40, s40, z40, _, _ = int4_problem(1, 256, 40, 128, torch.bfloat16)
    assert "multiple of 32" in hopper.unsupported(x40, q40, s40, z40, 128)
    assert "multiple of 32" in hopper.unsupported(x, qweight[:, :0], scales[:, :0], zeros[:, :0], 128)
    padded = torch.zeros(scales.shape[0], 68, dtype=scales.dtype, device=x.device)  # rows 136 bytes apart
    assert "aligned" in hopper.unsupported(x, qweight, padded[:, :64], zeros, 128)
    wide = torch.zeros(1, 258, dtype=torch.bfloat16, device=x.device)
    assert "aligned" in hopper.unsupported(wide[:, 2:], qweight, scales, zeros, 128)
    if not SM90:
        assert "sm_90" in hopper.unsupported(x, qweight, scales, zeros, 128)
        with pytest.raises(ValueError, match="sm_90"):
            w4a16_matmul(x, qweight, scales, zeros, 128, hopper=True)
    with pytest.raises(ValueError, match="bf16"):
        w4a16_matmul(x.half(), qweight, scales.half(), zeros, 128, hopper=True)
    with pytest.raises(ValueError, match="config"):
        w4a16_matmul(x, qweight, scales, zeros, 128, hopper=True, config=dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=1))
    with pytest.raises(ValueError, match="power of two"):
        hopper.w4_gemv(x, qweight, scales, zeros, 128, x, x, x, False, tiles=3)
    with pytest.raises(ValueError, match="path"):
        w4a16_matmul(x, qweight, scales, zeros, 128, hopper=True, path="dot")


@pytest.mark.parametrize("k, n, tiles, splits, splits_one_tile",
                         [(4096, 12288, 4, 8, 32), (11008, 4096, 4, 22, 86), (4096, 22016, 4, 8, 32),
                          (4096, 4096, 1, 32, 32), (128, 256, 1, 1, 1), (64, 256, 1, 1, 1), (136, 11008, 1, 2, 2)])
def test_choose_tiles_and_the_partials_it_needs(k, n, tiles, splits, splits_one_tile):
    """On an H200 (132 SMs) Llama-2-7B's o_proj, 4096 x 4096, is the projection that takes 1 tile a program: 4 make
    128 programs, fewer than 2 an SM; the others keep 4. With one SM (the CPU) nothing is halved."""
    assert hopper.choose_tiles(k, n, 132) == tiles
    assert hopper.splits_needed(k, tiles) == splits and hopper.splits_needed(k, 1) == splits_one_tile
    assert hopper.choose_tiles(k, n, 1) == (1 if k <= 128 else hopper.TILES)
    assert hopper.choose_tiles(4096, 4096, 100) == 2  # 256 programs, where 4 tiles make 128
