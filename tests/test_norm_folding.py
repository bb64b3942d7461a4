"""The model's side of folding the norms into the INT4 GEMVs (minillm/model/norm_folding.py): which layers fold,
and that a folded forward computes what the unfolded one does.

Here on any machine, with ``QuantLinear.folds_norms`` said true: the projections cannot run the Gluon GEMV on a CPU,
so each takes the fallback (``ResidualRow.add``, ``NormedRow.materialize``), which must give the unfolded layer's
values bit for bit, and the counts show the folded flow ran. The kernels themselves: tests/kernels/
test_w4_gemv_norms.py (sm_90).
"""

from __future__ import annotations

from minillm import LLM, SamplingParams
from minillm.model import norm_folding
from minillm.model.llama import LlamaForCausalLM
from minillm.model.config import PRESETS
from minillm.parallel.tp import RowParallelQuantLinear
from minillm.quant.linear import QuantLinear
from test_continuous import DEVICE

PROMPTS = [[5, 6, 7, 8], [9, 10]]
MAX_TOKENS = 6


def generate(monkeypatch, fold: bool) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens of the tiny preset at RTN INT4 on the Triton backend, batch 1, and how often each fallback ran."""
    calls = {"add": 0, "materialize": 0}
    add, materialize = norm_folding.ResidualRow.add.__func__, norm_folding.NormedRow.materialize

    def counted_add(cls, y, residual):
        calls["add"] += 1
        return add(cls, y, residual)

    def counted_materialize(self):
        calls["materialize"] += 1
        return materialize(self)

    monkeypatch.setattr(norm_folding.ResidualRow, "add", classmethod(counted_add))
    monkeypatch.setattr(norm_folding.NormedRow, "materialize", counted_materialize)
    monkeypatch.setattr(QuantLinear, "folds_norms", lambda self: fold)
    budget = {"memory_budget": "2GB"} if DEVICE == "cuda" else {}  # two engines in one process
    llm = LLM("tiny", load_format="dummy", quantization="rtn-int4", dtype="float32", device=DEVICE,
              batching="continuous", attention_backend="triton", max_num_seqs=1, enforce_eager=True, seed=0, **budget)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    llm.close()
    return [o.outputs[0].token_ids for o in out], calls


def test_folded_decode_gives_the_unfolded_tokens(monkeypatch):
    """Each decode step (one row) folds 2L - 1 norms: every layer's post-attention norm, and every input norm but
    the first layer's; prefills (many rows) fold none. The tokens are the unfolded engine's."""
    # On a GPU the Gluon GEMV would fold for real (tests/kernels/test_w4_gemv_norms.py): here every fold falls back.
    monkeypatch.setattr(QuantLinear, "_fused_refusal", lambda self: "falls back (a test)")
    folded, calls = generate(monkeypatch, fold=True)
    unfolded, none = generate(monkeypatch, fold=False)
    layers = PRESETS["tiny"].num_layers
    decode_steps = len(PROMPTS) * (MAX_TOKENS - 1)
    assert calls == {"add": (2 * layers - 1) * decode_steps, "materialize": (2 * layers - 1) * decode_steps}
    assert none == {"add": 0, "materialize": 0}
    assert folded == unfolded


def folds(model: LlamaForCausalLM) -> list[tuple[bool, bool]]:
    return [(layer.fold_attention_norm, layer.fold_mlp_norm) for layer in model.model.layers]


def test_which_norms_fold():
    """Between two projections that fold norms only, and never after the last layer (the final norm and the LM head
    follow it); a row-parallel layer (tensor parallelism) never folds: its residual comes after the all-reduce."""
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.fold_norms()
    assert folds(model) == [(False, False), (False, False)]  # dense

    class Folding(QuantLinear):
        def folds_norms(self) -> bool:
            return True

    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, linear in list(module.named_children()):
                module.set_submodule(name, Folding(linear.in_features, linear.out_features, 4, 64, bias=False))
    model.fold_norms()
    assert folds(model) == [(True, True), (True, False)]
    model.fold_norms(False)
    assert folds(model) == [(False, False), (False, False)]
    first = model.model.layers[0]
    first.self_attn.o_proj = RowParallelQuantLinear(first.self_attn.o_proj.in_features,
                                                    first.self_attn.o_proj.out_features, 4, 64, bias=False)
    model.fold_norms()
    assert folds(model) == [(False, True), (True, False)]
