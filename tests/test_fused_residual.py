"""The residual adds live inside the RMSNorm kernels: a fused-kernel forward runs no torch add on the hidden state;
and RoPE lives inside the KV store: with an unquantized cache no RoPE kernel runs of its own.

A decoder layer returns (mlp_out, residual) and leaves the add to the next norm (``DecoderLayer.forward``), so
with ``enable_fused_kernels`` both of a layer's residual adds run inside ``fused_layer_ops.rms_norm`` and a decode
step launches one kernel fewer per layer than with the add at the end of the layer. Counted with a
``TorchDispatchMode`` (it sees every torch op, not the Triton kernels) on the tiny preset under the interpreter;
the torch path, which does every add in torch, shows that the counter sees them: two per layer per forward.
That the outputs are unchanged is checked against transformers elsewhere (tests/test_models.py, test_oracle.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm import LLM, SamplingParams
from test_continuous import DEVICE

MAX_TOKENS = 3  # a prefill and two decode steps: three forward passes


class HiddenStateAdds(TorchDispatchMode):
    """Counts torch adds (out of place or in place) whose result is a hidden state: last dim ``hidden_size``."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size, self.count = hidden_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and out.shape[-1] == self.hidden_size:
            self.count += 1
        return out


@pytest.mark.parametrize("backend, adds_per_layer", [("torch", 2), ("triton", 0)])
def test_residual_adds_are_fused_into_the_norms(backend, adds_per_layer):
    """``attention_backend="triton"`` turns the fused kernels on; "torch" keeps every op in torch."""
    # The Triton kernels run on the GPU where there is one, else under the interpreter (tests/conftest.py);
    # eager, since a CUDA graph replay would hide its ops from the counter.
    device = DEVICE if backend == "triton" else "cpu"
    budget = {"memory_budget": "2GB"} if device == "cuda" else {}  # not 90 % of the GPU for a tiny model
    llm = LLM("tiny", load_format="dummy", dtype="float32", device=device, batching="continuous",
              attention_backend=backend, enforce_eager=True, seed=0, **budget)
    config = llm.engine.model_config
    assert config.hidden_size != config.vocab_size  # the logits must not pass for hidden states
    with HiddenStateAdds(config.hidden_size) as adds:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS  # every forward pass ran inside the mode
    assert adds.count == adds_per_layer * config.num_layers * MAX_TOKENS


@pytest.mark.parametrize("kv_cache_dtype, fused_rope",
                         [("auto", True), ("int8", False), ("fp8", False), ("int4", False)])
def test_rope_runs_inside_the_kv_store_with_an_unquantized_cache(monkeypatch, kv_cache_dtype, fused_rope):
    """The Triton backend's engine: with an unquantized cache every layer of the prefill rotates q and k in the KV
    store's kernel (kv_store.rope_store_kv), every layer of a decode step in the decode kernel itself (new_kv), and
    the RoPE kernel is never called; a quantized cache (whose store quantizes) keeps the RoPE kernel and stores as
    before."""
    from minillm.kernels import fused_layer_ops
    from minillm.kv import paged_triton
    calls = {"rope": 0, "rope_store_kv": 0, "decode_with_new_kv": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            if name != "decode_with_new_kv" or kwargs.get("new_kv") is not None:
                calls[name] += 1
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(fused_layer_ops, "rope", counted("rope", fused_layer_ops.rope))
    monkeypatch.setattr(paged_triton, "rope_store_kv", counted("rope_store_kv", paged_triton.rope_store_kv))
    monkeypatch.setattr(paged_triton, "paged_decode_attention",
                        counted("decode_with_new_kv", paged_triton.paged_decode_attention))
    budget = {"memory_budget": "2GB"} if DEVICE == "cuda" else {}
    llm = LLM("tiny", load_format="dummy", dtype="float32", device=DEVICE, batching="continuous",
              attention_backend="triton", enforce_eager=True, seed=0, kv_cache_dtype=kv_cache_dtype, **budget)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    layers = llm.engine.model_config.num_layers
    # The prefill's layers store with rope_store_kv; each decode step's decode kernel rotates and stores itself.
    assert calls == ({"rope": 0, "rope_store_kv": layers, "decode_with_new_kv": layers * (MAX_TOKENS - 1)}
                     if fused_rope else {"rope": layers * MAX_TOKENS, "rope_store_kv": 0, "decode_with_new_kv": 0})


def test_decode_steps_give_the_same_tokens_with_rope_in_the_decode_kernel(monkeypatch):
    """A decode-only step's two paths (the decode kernel rotating and storing the new token itself, or
    rope_store_kv first) decode the same greedy tokens (one arithmetic: tests/kernels/test_paged_attention.py checks
    the kernel's output and pools bit for bit), and the new path is the one taken."""
    from minillm.kv import paged_triton
    tokens, calls, real = {}, [], paged_triton.paged_decode_attention
    monkeypatch.setattr(paged_triton, "paged_decode_attention",
                        lambda *a, **kw: calls.append(kw.get("new_kv") is not None) or real(*a, **kw))
    budget = {"memory_budget": "2GB"} if DEVICE == "cuda" else {}  # two engines in one process
    for inside in (True, False):
        monkeypatch.setattr(paged_triton.TritonPagedBatch, "rope_in_decode_kernel", inside)
        llm = LLM("tiny", load_format="dummy", dtype="float32", device=DEVICE, batching="continuous",
                  attention_backend="triton", enforce_eager=True, seed=0, **budget)
        out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        tokens[inside] = [o.outputs[0].token_ids for o in out]
        llm.close()
        assert any(calls) == inside
        calls.clear()
    assert tokens[True] == tokens[False]
