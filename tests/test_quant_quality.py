"""Quantization quality on the embedded SmolLM2-135M: perplexity orderings and budgets, GPTQ's per-layer
output error against RTN's on held-out activations, and a GPTQ checkpoint that reloads to identical outputs.

The baseline is already a dequantized Q4_1 GGUF, so absolute perplexities say little: the tests assert
orderings and relative changes. Every model is quantized once per session (copies of the shared fp32
model) and scored on the same 1536 held-out tokens (3 windows of 512). That is enough because the
comparisons are paired: each method is scored on the very same windows, and every INT4 gap asserted
below holds in each window on its own, not just on average (checked, so a lucky window cannot carry it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import CausalAttention
from minillm.eval.perplexity import calibration_samples, evaluation_tokens, perplexity
from minillm.quant import rtn
from minillm.quant.calibration import LINEARS, sequential_calibration
from minillm.quant.checkpoint import save_quantized
from minillm.quant.quantize import quantize_model

EVAL_TOKENS = 1536
# GPTQ at g64 calibrates on 8 samples of 512 tokens: with 4, layer 3's down_proj fits its calibration tokens
# and lands above RTN on held-out ones (measured GPTQ/RTN output error 1.08); with 8 its ratio is 0.84.
CALIBRATION = {"gptq-int4-g64": 8}
DEFAULT_CALIBRATION = 4


class Quantized:
    """Quantized copies of SmolLM2 and their perplexities, each made once when first asked for."""

    def __init__(self, llm: LLM):
        self.llm, self.base = llm, llm.engine.model
        self.tokens = evaluation_tokens(llm.tokenizer, EVAL_TOKENS)
        self.models, self.results = {}, {"none": perplexity(self.base, self.tokens)}

    def model(self, method: str):
        if method not in self.models:
            model = copy.deepcopy(self.base)
            samples = calibration_samples(self.llm.tokenizer, CALIBRATION.get(method, DEFAULT_CALIBRATION))
            quantize_model(model, method, samples, progress=False)
            self.models[method] = model
        return self.models[method]

    def result(self, method: str):
        if method not in self.results:
            self.results[method] = perplexity(self.model(method), self.tokens)
        return self.results[method]

    def increase(self, method: str) -> float:
        """Relative perplexity increase over the unquantized model."""
        return self.result(method).perplexity / self.results["none"].perplexity - 1


@pytest.fixture(scope="module")
def quantized(smollm):
    return Quantized(smollm)


@pytest.mark.parametrize("method,budget", [("rtn-int8", 0.01), ("fp8", 0.03)])
def test_eight_bit_methods_stay_within_their_perplexity_budget(quantized, method, budget):
    # Measured: rtn-int8 -0.4 % (within noise of zero), fp8 +2.1 % (weights and activations in E4M3).
    assert quantized.increase(method) <= budget


@pytest.mark.parametrize("better,grouping,most", [("gptq-int4", "g64", 0.75), ("gptq-int4", "channel", 0.6),
                                                  ("awq-int4", "g64", 0.6), ("awq-int4", "channel", 0.75)])
def test_calibrated_int4_beats_round_to_nearest(quantized, better, grouping, most):
    """GPTQ (act-order) and AWQ against RTN at the same grouping: lower perplexity in every window, and at
    most ``most`` of RTN's perplexity increase. Measured increases: RTN +34 % (g64) / +89 % (per channel);
    GPTQ +17 % / +32 % (0.48 / 0.36 of RTN's); AWQ +11 % / +50 % (0.32 / 0.56 of RTN's)."""
    method, baseline = f"{better}-{grouping}", f"rtn-int4-{grouping}"
    ours, rtn_result = quantized.result(method), quantized.result(baseline)
    assert all(a < b for a, b in zip(ours.window_nll, rtn_result.window_nll)), \
        f"{method} should beat {baseline} in every window: {ours.window_nll} vs {rtn_result.window_nll}"
    assert quantized.increase(method) < most * quantized.increase(baseline)


def test_gptq_output_error_is_below_rtn_in_every_linear_on_held_out_activations(quantized, smollm):
    """||(W - Q) X||^2 per linear of every layer, X: the unquantized model's activations on 1024 evaluation
    tokens that neither calibration nor the perplexity tests use. Measured GPTQ/RTN ratios: mean 0.41,
    highest 0.84 (layer 3's down_proj, the hardest to calibrate)."""
    gptq_model = quantized.model("gptq-int4-g64")
    held_out = torch.tensor(evaluation_tokens(smollm.tokenizer, EVAL_TOKENS + 1024)[EVAL_TOKENS:]).view(2, 512)
    ratios = {}

    def compare(index, layer, inputs):
        for name in LINEARS:
            w, x = layer.get_submodule(name).weight, inputs[name]
            q_gptq = gptq_model.model.layers[index].get_submodule(name).dequantized_weight()
            q_rtn = rtn.fake_quantize(w, 4, 64, sym=False)
            ratios[index, name] = (x @ (w - q_gptq).t()).pow(2).sum() / (x @ (w - q_rtn).t()).pow(2).sum()

    sequential_calibration(quantized.base, held_out, compare, progress=False)  # observes, changes nothing
    assert len(ratios) == 4 * len(quantized.base.model.layers)
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] < 1.0, f"GPTQ is worse than RTN at {worst}: {ratios[worst]:.3f}"
    assert sum(ratios.values()) / len(ratios) < 0.6


def test_a_saved_gptq_checkpoint_reloads_to_identical_outputs(quantized, smollm, tmp_path):
    model = quantized.model("gptq-int4-g64")  # act-order with groups: the checkpoint's g_idx is scattered
    save_quantized(model, tmp_path, smollm.tokenizer)
    reloaded = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert reloaded.engine.quantization == "gptq-int4-g64"
    prompts = [smollm.tokenizer.encode("def fibonacci(n):"), smollm.tokenizer.encode("The KV cache stores")]
    ids = torch.tensor(prompts[0])[None]
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        want = model.compute_logits(model(ids, positions, CausalAttention()))
        got = reloaded.engine.model.compute_logits(reloaded.engine.model(ids, positions, CausalAttention()))
    assert torch.equal(got, want)
    # Greedy continuations from the reloaded engine equal the in-memory model's, step by step.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, reloaded.generate(prompts, params, use_tqdm=False)):
        tokens = list(prompt)
        for _ in range(8):
            with torch.inference_mode():
                hidden = model(torch.tensor(tokens)[None], torch.arange(len(tokens))[None], CausalAttention())
                tokens.append(int(model.compute_logits(hidden[0, -1]).argmax()))
        assert out.outputs[0].token_ids == tokens[len(prompt):]
