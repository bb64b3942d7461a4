"""The RMSNorm between two batch-1 INT4 GEMVs folded into them (kernels/w4_gemv_norms.py): the GEMV ahead adds the
residual and sums the squares of each column tile, the GEMV behind normalises its input as it reads it.

Gluon has no interpreter: the kernels need an sm_90 GPU. The refusals are checked on any machine, and the model's
side of the fold (what falls back to torch and the norm kernel) in tests/test_norm_folding.py.
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import split_k, w4_gemv_fused as fused_forms, w4_gemv_hopper as hopper
from minillm.kernels.w4_gemv_norms import Norm
from minillm.kernels.quant_matmul import w4a16_matmul
from minillm.model.norm_folding import ResidualRow

from test_quant_matmul import counters_are_clean, int4_problem, poisoned
from test_w4_gemv_hopper import needs_sm90

EPS = 1e-5
# k, n, group: Llama-2-7B's o_proj and down_proj (many splits, 16 column tiles), one tile and no split, SmolLM2's
# width (576: K ending inside a tile, N = 2.25 column tiles: a partial last tile's squares), a group of 64.
CASES = [(4096, 4096, 128), (11008, 4096, 128), (128, 256, 128), (576, 576, 128), (1536, 576, 64)]


def random_row(width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, width, generator=g) * scale).to(torch.bfloat16).to("cuda")


@needs_sm90
@pytest.mark.parametrize("k,n,group", CASES)
def test_residual_add_and_its_squares(k, n, group):
    """out = residual + y bit for bit as the unfolded GEMV and the norm kernel's add compute it (y rounded to bf16,
    then the sum), and sumsq the squares of out summed per 256 columns. Outputs poisoned before the launch."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n)
    residual = random_row(n, seed=n, scale=4.0)
    out, sumsq = poisoned((1, n), torch.bfloat16), torch.full((-(-n // 256),), float("nan"), device="cuda")
    hopper.gemv(x, qweight, scales, zeros, group, out, residual=residual, sumsq=sumsq)
    want = ResidualRow.add(w4a16_matmul(x, qweight, scales, zeros, group, hopper=True), residual)
    assert torch.equal(out, want.total)
    torch.testing.assert_close(sumsq, want.sumsq, rtol=1e-5, atol=0)
    assert counters_are_clean()


@needs_sm90
@pytest.mark.parametrize("k,n,group", [(11008, 4096, 128), (1536, 576, 64)])
def test_gated_input_and_residual_add(k, n, group):
    """down_proj's folded form, SiLU-and-multiply on the way in and the residual added on the way out: bit for bit
    the gated GEMV followed by the add, and the same sums of squares."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + 2)
    gate_up, residual = random_row(2 * k, seed=k, scale=3.0), random_row(n, seed=n + 1, scale=4.0)
    total, sumsq = fused_forms.fused_gemv(gate_up, qweight, scales, zeros, group, gated=True, residual=residual)
    want = ResidualRow.add(fused_forms.fused_gemv(gate_up, qweight, scales, zeros, group, gated=True), residual)
    assert torch.equal(total, want.total)
    torch.testing.assert_close(sumsq, want.sumsq, rtol=1e-5, atol=0)
    assert counters_are_clean()


def rms_normed(s: torch.Tensor, weight: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor:
    """RMSNorm of s from its sums of squares, in transformers' order (fp32, round, times the weight, round)."""
    inv = torch.rsqrt(sumsq.sum() / s.shape[-1] + EPS)
    return ((s.float() * inv).to(torch.bfloat16).float() * weight.float()).to(torch.bfloat16)


@needs_sm90
@pytest.mark.parametrize("k,n,group", CASES)
def test_normed_input(k, n, group):
    """The GEMV of RMSNorm(s) formed as the x tables are built equals the GEMV of the row normalised first: 1 / rms
    is formed by other instructions (an approximate sqrt and division against torch's), so a normalised input may
    round the other way; the products may then differ by that input's share, never more."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + 1)
    s, weight = random_row(k, seed=k, scale=3.0), random_row(k, seed=k + 1)[0] + 1
    sumsq = ResidualRow.add(s, torch.zeros_like(s)).sumsq
    out = poisoned((1, n), torch.bfloat16)
    hopper.gemv(s, qweight, scales, zeros, group, out, norm=Norm(weight, sumsq, EPS))
    want = w4a16_matmul(rms_normed(s, weight, sumsq), qweight, scales, zeros, group, hopper=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-3 * want.float().abs().max().item())
    assert (out == want).float().mean() > 0.9  # the same inputs, nearly everywhere: not merely close
    assert counters_are_clean()


@needs_sm90
def test_both_folds_at_once_in_a_cuda_graph():
    """One launch may normalise its input and add a residual (the model never asks for both, the kernel allows it);
    replayed in a CUDA graph with new inputs it gives what a launch outside the graph gives (the kernel sums in a
    fixed order; the fix-up's counters reset), and that is the GEMV of the normalised row plus the residual."""
    k, n, group = 4096, 4096, 128
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=9)
    weight = random_row(k, seed=10)[0] + 1
    s, residual = random_row(k, seed=11, scale=2.0), random_row(n, seed=12)
    sumsq = ResidualRow.add(s, torch.zeros_like(s)).sumsq

    def run():
        return fused_forms.fused_gemv(s, qweight, scales, zeros, group, residual=residual,
                                      norm=Norm(weight, sumsq, EPS))

    run()  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total, squares = run()
    for seed in (13, 14):
        s.copy_(random_row(k, seed=seed, scale=2.0))
        sumsq.copy_(ResidualRow.add(s, torch.zeros_like(s)).sumsq)
        total.fill_(float("nan"))
        graph.replay()
        eager_total, eager_squares = run()
        assert torch.equal(total, eager_total) and torch.equal(squares, eager_squares)
        y = w4a16_matmul(rms_normed(s, weight, sumsq), qweight, scales, zeros, group, hopper=True)
        # (total is rounded to bf16 once more than y: within 2**-8 of |total|, the tolerance's main part)
        torch.testing.assert_close(total.float() - residual.float(), y.float(), rtol=0,
                                   atol=1e-2 * total.float().abs().max().item())
        torch.testing.assert_close(squares, ResidualRow.add(total, torch.zeros_like(total)).sumsq, rtol=1e-5, atol=0)
    assert counters_are_clean()


def test_fold_refusals_name_the_reason():
    """On any machine: the inputs the folded forms cannot take, and why."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 64, 128, torch.bfloat16, seed=1)
    sumsq = torch.ones(1, device=x.device)
    norm = Norm(torch.ones(256, dtype=torch.bfloat16, device=x.device), sumsq, EPS)
    refusals = {
        "not both": dict(x=torch.cat([x, x], 1), gated=True, norm=norm),
        "residual row of N = 64": dict(residual=torch.ones(1, 32, dtype=torch.bfloat16, device=x.device)),
        "weight as a contiguous": dict(norm=norm._replace(weight=norm.weight[:128])),
        "1 fp32 sums of squares": dict(norm=norm._replace(sumsq=sumsq.double())),
        "1 fp32 sums": dict(norm=norm._replace(sumsq=sumsq[:0])),
    }
    for reason, change in refusals.items():
        args = dict(x=x, residual=None, norm=None, gated=False) | change
        row = args.pop("x")
        assert reason in fused_forms.fused_unsupported(row, qweight, scales, zeros, 128, **args)
        with pytest.raises(ValueError, match=reason):
            fused_forms.fused_gemv(row, qweight, scales, zeros, 128, **args)
    out = poisoned((1, 64), torch.bfloat16)
    launch = (x, qweight, scales, zeros, 128, out, sumsq, split_k.tile_counters(x.device), False)
    with pytest.raises(ValueError, match="come together"):
        hopper.w4_gemv(*launch, residual=torch.ones_like(x[:, :64]))
    with pytest.raises(ValueError, match="1 fp32"):
        hopper.w4_gemv(*launch, residual=torch.ones_like(x[:, :64]), sumsq=sumsq[:0])


@needs_sm90
def test_int4_engine_decodes_the_same_tokens_with_the_norms_folded(monkeypatch):
    """Batch-1 decode of SmolLM2's shapes (dummy weights) at RTN INT4 with MINILLM_NORM_IN_GEMV on and off: the
    folded GEMVs run (o_proj and down_proj adding, gate_up_proj and qkv_proj normalising) and the greedy tokens are
    the norm kernels'."""
    from minillm import LLM, SamplingParams
    from minillm.model import norm_folding

    calls, fused = [], fused_forms.fused_gemv
    monkeypatch.setattr(fused_forms, "fused_gemv", lambda *a, **kw: calls.append(
        (kw.get("residual") is not None, kw.get("norm") is not None)) or fused(*a, **kw))
    prompts = [list(range(5, 40)), list(range(300, 317))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for folded in (True, False):
        monkeypatch.setattr(norm_folding, "ENABLED", folded)
        llm = LLM("smollm2-135m", load_format="dummy", quantization="rtn-int4", batching="continuous", max_num_seqs=1,
                  max_model_len=128, num_kv_blocks=64)  # two engines in one process: a small cache each
        tokens[folded] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
        if folded:
            assert (True, False) in calls and (False, True) in calls, "batch-1 decode never folded a norm"
            calls.clear()
    assert not any(add or norm for add, norm in calls)
    assert tokens[True] == tokens[False]
