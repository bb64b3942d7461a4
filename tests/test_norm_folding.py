"""The model's side of folding the norms into the INT4 GEMVs (minillm/model/norm_folding.py): which layers fold,
and that a folded forward computes what the unfolded one does.

Here on any machine, with ``QuantLinear.folds_norms`` said true: the projections cannot run the Gluon GEMV on a CPU,
so each takes the fallback (``ResidualRow.add``, ``NormedRow.materialize``), which must give the unfolded layer's
values bit for bit, and the counts show the folded flow ran. The kernels themselves: tests/kernels/
test_hopper_w4_gemv_norms.py (sm_90).
"""

from __future__ import annotations

import torch

from minillm import LLM, SamplingParams
from minillm.model import norm_folding
from minillm.model import fused
from minillm.model.fused import FusedLlamaForCausalLM
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
    """Each decode step (one row) folds 2L norms: every layer's post-attention and input norm (the first layer's
    on the embedding); the GEMVs add the residual 2L - 1 times (not the last down_proj: the final norm follows it);
    prefills (many rows) fold none. The tokens are the unfolded engine's."""
    # On a GPU the Gluon GEMV would fold for real (tests/kernels/test_hopper_w4_gemv_norms.py); here every fold
    # falls back.
    monkeypatch.setattr(QuantLinear, "_fused_refusal", lambda self: "falls back (a test)")
    from minillm.kernels import fused_layer_ops as step_start

    starts, start = [], step_start.step_start
    monkeypatch.setattr(step_start, "step_start", lambda *args: starts.append(args) or start(*args))
    folded, calls = generate(monkeypatch, fold=True)
    decode_steps = len(PROMPTS) * (MAX_TOKENS - 1)
    assert len(starts) == decode_steps  # each step's embedding row came from the step's first kernel
    unfolded, none = generate(monkeypatch, fold=False)
    layers = PRESETS["tiny"].num_layers
    assert calls == {"add": (2 * layers - 1) * decode_steps, "materialize": 2 * layers * decode_steps}
    assert none == {"add": 0, "materialize": 0} and len(starts) == decode_steps
    assert folded == unfolded


def folds(model: FusedLlamaForCausalLM) -> list[tuple[bool, bool]]:
    return [(layer.fold_attention_norm, layer.fold_mlp_norm) for layer in model.model.layers]


def test_which_norms_fold():
    """Between two projections that fold norms only, and never after the last layer (the final norm and the LM head
    follow it); a row-parallel layer (tensor parallelism) never folds: its residual comes after the all-reduce. The
    first layer's input norm folds where its qkv_proj and o_proj do."""
    model = LlamaForCausalLM(PRESETS["tiny"])
    fused.enable(model)
    assert folds(model) == [(False, False), (False, False)] and not model.fold_first_norm  # dense

    class Folding(QuantLinear):
        def folds_norms(self) -> bool:
            return True

    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, linear in list(module.named_children()):
                module.set_submodule(name, Folding(linear.in_features, linear.out_features, 4, 64, bias=False))
    model.fold_norms()
    assert folds(model) == [(True, True), (True, False)] and model.fold_first_norm
    model.fold_norms(False)
    assert folds(model) == [(False, False), (False, False)] and not model.fold_first_norm
    first = model.model.layers[0]
    first.self_attn.o_proj = RowParallelQuantLinear(first.self_attn.o_proj.in_features,
                                                    first.self_attn.o_proj.out_features, 4, 64, bias=False)
    model.fold_norms()
    assert folds(model) == [(False, True), (True, False)] and not model.fold_first_norm


def emulated_fused_gemv(x, qweight, scales, zeros, group_size, gated=False, residual=None, norm=None, squares=None,
                        rms=None):
    """What ``w4_gemv_fused.fused_gemv`` computes, in torch on any machine (its split-K aside: the one split stores
    the row's sum of squares), for the model's flow to run through every folded form."""
    from minillm.kernels.quant_pack import dequantize_int4

    dtype = scales.dtype
    w = dequantize_int4(qweight, scales, zeros, group_size, torch.float32)
    if rms is not None:  # a gate_up row whose GEMV left 1 / rms to this one
        x = (x * (1.0 / torch.sqrt(rms.squares.sum() / rms.width + rms.eps))).to(dtype)
    if gated:
        gate, up = x.to(dtype).chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    inv = row_squares = 1.0
    if norm is not None:
        row_squares = x.float().square().sum()
        inv = 1.0 / torch.sqrt(row_squares / x.shape[-1] + norm.eps)
        x = (x * norm.weight.float()).to(dtype)
    y = x.float() @ w
    if squares is not None:  # the norm's 1 / rms left to the reader: one split, its sum of squares in slot 0
        squares[0] = row_squares
    if residual is not None:  # (with a norm only with squares: y without 1 / rms)
        return residual.add_(y.reshape(residual.shape))
    return (y * inv).to(dtype)


def test_gate_up_and_qkv_leave_their_norms_to_the_next_kernel(monkeypatch):
    """With every fused form emulated in torch (``emulated_fused_gemv``), so that the model's flow runs on any
    machine: each decode step, every layer's gate_up_proj and every folded qkv_proj add their unnormalised outputs
    to their slots of the model's ``PendingRows`` (zeroed at the step's start), and down_proj and the decode attention
    kernel (``paged_decode_attention(rms=...)``, here under the interpreter) apply the norm's 1 / rms; the tokens are
    those of the unfolded engine."""
    from minillm.kernels.hopper import w4_gemv_fused

    calls = []

    def emulated(*args, **kwargs):
        calls.append(tuple(sorted(k for k, v in kwargs.items() if v is not None and v is not False)))
        return emulated_fused_gemv(*args, **kwargs)

    # (one row only, as the kernel: on a GPU, takes_gated asks it about the prefills' rows too)
    monkeypatch.setattr(w4_gemv_fused, "fused_unsupported", lambda x, *a, **kw: None if x.numel() == x.shape[-1]
                        else "one row only")
    monkeypatch.setattr(w4_gemv_fused, "fused_gemv", emulated)
    from minillm.kv import paged_triton

    scaled, decode = [], paged_triton.paged_decode_attention
    monkeypatch.setattr(paged_triton, "paged_decode_attention", lambda *a, **kw: scaled.append(
        kw.get("rms") is not None) or decode(*a, **kw))
    deferred, _ = generate(monkeypatch, fold=True)
    layers, decode_steps = PRESETS["tiny"].num_layers, len(PROMPTS) * (MAX_TOKENS - 1)
    forms = {form: calls.count(form) for form in set(calls)}
    assert forms == {("norm", "residual", "squares"): 2 * layers * decode_steps,  # gate_up, qkv (layer 0's too)
                     ("gated", "residual", "rms"): (layers - 1) * decode_steps,  # down_proj, adding the residual
                     ("gated", "rms"): decode_steps,  # the last layer's (the final norm follows it)
                     ("residual",): layers * decode_steps}, forms  # o_proj
    assert scaled.count(True) == layers * decode_steps
    unfolded, _ = generate(monkeypatch, fold=False)
    assert deferred == unfolded


def test_pending_rows_and_their_fallback():
    """Each layer's slots are their own parts of one buffer, their rows 16-byte aligned; ``materialize`` is the norm's
    output as the GEMV that deferred it would have written it: y / rms(s), rounded to the norm's dtype."""
    torch.manual_seed(0)
    rows = norm_folding.PendingRows(3, {"gate_up": (10, 3), "qkv": (6, 2)}, device=torch.device("cpu"))
    slots = [rows.slot(i, "gate_up") for i in range(3)]
    others = [rows.slot(i, "qkv") for i in range(3)]
    assert all(slot.total.data_ptr() % 16 == 0 for slot in slots + others)
    assert [slot.total.numel() for slot in slots] == [10] * 3 and slots[1].squares.numel() == 3
    assert [slot.total.numel() for slot in others] == [6] * 3 and others[1].squares.numel() == 2
    views = [t for slot in slots + others for t in (slot.total, slot.squares)]
    ranges = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in views)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # no two overlap
    for slot in slots:
        slot.total.copy_(torch.randn(10))
        slot.squares.copy_(torch.rand(3) * 50)
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), 1e-5
    pending = norm_folding.PendingNorm(slots[1], norm, width=64, shape=torch.Size((1, 1, 10)))
    want = (slots[1].total.view(1, 1, 10).double() / torch.sqrt(slots[1].squares.double().sum() / 64 + 1e-5)).bfloat16()
    assert pending.materialize().dtype == torch.bfloat16 and torch.equal(pending.materialize(), want)
    rows.clear()
    assert not rows.buffer.any()
