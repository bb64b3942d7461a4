"""Quantized checkpoints (GPTQ v1 layout) and quantize-on-load through the engine, on tiny models: the
saved tensors follow the layout by hand, and a saved model reloads to identical buffers and tokens."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from minillm import LLM, SamplingParams
from minillm.model.config import PRESETS, ModelConfig
from minillm.quant.checkpoint import hf_config, save_quantized
from minillm.quant.linear import unpack

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 250, 42, 9], [100, 101, 102]]  # in both vocabularies (300 and 512)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, make_tiny_hf):
    """A tiny Qwen2 (q/k/v biases, untied head) saved by transformers."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen2")
    make_tiny_hf(Qwen2Config, seed=3, tie_word_embeddings=False).save_pretrained(path)
    return path


@pytest.mark.parametrize("config", [*PRESETS.values(), replace(PRESETS["tiny"], model_type="mistral", sliding_window=512),
                                    replace(PRESETS["tiny"], model_type="qwen2", attention_bias=True)],
                         ids=[*PRESETS, "mistral-window", "qwen2-bias"])
def test_saved_config_reads_back_as_the_same_model_config(config):
    assert ModelConfig.from_hf(json.loads(json.dumps(hf_config(config)))) == config


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, make_tiny_hf):
    """A tiny Llama whose LM head is its embedding (a vocabulary INT4 can pack), saved by transformers."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama_tied")
    make_tiny_hf(LlamaConfig, seed=4, tie_word_embeddings=True, vocab_size=512).save_pretrained(path)
    return path


@pytest.mark.parametrize("method, source", [("gptq-int4-g32", "qwen2"), ("awq-int4-g32", "qwen2"),
                                            ("rtn-int4-channel", "qwen2"), ("rtn-int8", "qwen2"),
                                            ("awq-int4-g32-head8", "qwen2"), ("rtn-int4-g32-head", "tied_llama"),
                                            ("rtn-int8-head", "tied_llama")])
def test_saved_checkpoint_reloads_to_identical_weights_and_tokens(method, source, request, tmp_path):
    """Every layer's buffers, every parameter and the greedy tokens; a quantized head (-head, -head8) too, from an
    untied head and from one tied to the embedding (which stays dense, and untied, in the file)."""
    llm = LLM(str(request.getfixturevalue(f"{source}_dir")), dtype="float32", device="cpu", quantization=method,
              calibration_samples=2)
    assert llm.engine.quantization == method
    save_quantized(llm, tmp_path)
    reloaded = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert reloaded.engine.quantization == method
    original, loaded = dict(llm.engine.model.named_buffers()), dict(reloaded.engine.model.named_buffers())
    assert original.keys() == loaded.keys()
    for name in original:
        assert torch.equal(original[name], loaded[name]), name
    for name, param in llm.engine.model.named_parameters():
        assert torch.equal(param, reloaded.engine.model.get_parameter(name)), name
    assert greedy(reloaded) == greedy(llm)
    head = method.endswith(("head", "head8"))
    assert (type(reloaded.engine.model.lm_head).__name__ == "QuantLinear") == head
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        stored = {name for name in f.keys() if name.startswith("lm_head.")}  # (an untied dense head: its weight)
    assert stored == {"lm_head.qweight", "lm_head.qzeros", "lm_head.scales", "lm_head.g_idx"} if head else \
        "lm_head.qweight" not in stored
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"]["lm_head"] == head
    if head:
        assert saved["tie_word_embeddings"] is False
        assert reloaded.engine.model.lm_head.bits == (8 if method.endswith(("head8", "int8-head")) else 4)


@pytest.mark.parametrize("head_order", ["in_order", "act_order"])
def test_a_desc_act_checkpoint_with_a_quantized_head_loads(head_order, tied_llama_dir, tmp_path):
    """AutoGPTQ's config for a quantized head: "lm_head": true, desc_act true, no minillm_method. The head gets an
    act-order shell: it takes a head quantized in act-order (g_idx scattering its groups), and runs one whose g_idx
    keeps the channels in order without a permutation."""
    from minillm.quant.quantize import gptq_linear
    from minillm.quant.spec import QuantSpec

    if head_order == "in_order":
        llm = LLM(str(tied_llama_dir), dtype="float32", device="cpu", quantization="rtn-int4-g32-head")
    else:  # GPTQ layers, and a head by GPTQ with act-order (minillm quantizes heads by RTN: made here by hand)
        llm = LLM(str(tied_llama_dir), dtype="float32", device="cpu", quantization="gptq-int4-g32",
                  calibration_samples=2)
        model, spec = llm.engine.model, QuantSpec.parse("gptq-int4-g32-head")
        calibration = torch.randn(256, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
        model.lm_head, model.quant_spec = gptq_linear(model.lm_head, calibration, spec), spec
        assert model.lm_head.perm is not None
    save_quantized(llm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["minillm_method"]
    config["quantization_config"]["desc_act"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    foreign = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert foreign.engine.quantization == "gptq-int4-g32-head"
    assert (foreign.engine.model.lm_head.perm is None) == (head_order == "in_order")
    assert greedy(foreign) == greedy(llm)


def test_the_files_follow_the_gptq_v1_layout(qwen2_dir, tmp_path):
    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", quantization="gptq-int4-g32", calibration_samples=2)
    save_quantized(llm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gptq", "checkpoint_format": "gptq", "bits": 4,
                                             "group_size": 32, "desc_act": True, "sym": False, "lm_head": False,
                                             "minillm_method": "gptq-int4-g32", "damp_percent": 0.1}
    qkv = llm.engine.model.model.layers[1].self_attn.qkv_proj
    codes, zeros = qkv.unpacked()  # runtime: rows in act-order, true zero points
    c = llm.engine.model.config
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "model.layers.1.self_attn.qkv_proj.qweight" not in names, "fused projections are split"
        k_start, k_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        prefix = "model.layers.1.self_attn.k_proj"
        qweight, qzeros = f.get_tensor(f"{prefix}.qweight"), f.get_tensor(f"{prefix}.qzeros")
        scales, g_idx = f.get_tensor(f"{prefix}.scales"), f.get_tensor(f"{prefix}.g_idx")
        assert f.get_tensor(f"{prefix}.bias").shape == (k_rows,)
    assert qweight.dtype == torch.int32 and qweight.shape == (c.hidden_size // 8, k_rows)
    assert scales.dtype == torch.float16 and scales.shape == (c.hidden_size // 32, k_rows)
    assert g_idx.dtype == torch.int32 and g_idx.shape == (c.hidden_size,)
    # g_idx: input channel k belongs to the group of its position in the quantization order.
    position = torch.empty_like(qkv.perm).index_copy_(0, qkv.perm, torch.arange(c.hidden_size))
    assert torch.equal(g_idx.long(), position // 32)
    assert not torch.equal(g_idx.long(), torch.arange(c.hidden_size) // 32), "act-order scatters the groups"
    # qweight in natural channel order; qzeros hold the zero point minus one, in 4 bits.
    assert torch.equal(unpack(qweight, 4)[qkv.perm], codes[:, k_start:k_start + k_rows])
    stored = unpack(qzeros.t(), 4).t()
    assert torch.equal(stored, (zeros[:, k_start:k_start + k_rows] - 1) & 15)
    assert torch.equal(scales.float(), qkv.scales[:, k_start:k_start + k_rows])


def test_quantize_on_load_shrinks_the_weights_and_serves_every_batching(tmp_path):
    dense = LLM("tiny", load_format="dummy", dtype="float32", device="cpu")
    quantized = {mode: LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching=mode,
                           quantization="rtn-int4-g32") for mode in ("static", "continuous")}
    assert quantized["static"].engine.weight_bytes < 0.75 * dense.engine.weight_bytes
    assert greedy(quantized["static"]) == greedy(quantized["continuous"])
    gptq = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", quantization="gptq-int4-g32",
               calibration_samples=2)  # no tokenizer: calibrates on random token ids
    assert gptq.engine.quantization == "gptq-int4-g32" and len(greedy(gptq)[0]) == 16


def test_loading_errors_name_the_problem(qwen2_dir, tmp_path):
    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", quantization="rtn-int4-g32")
    save_quantized(llm, tmp_path / "rtn")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(tmp_path / "rtn"), dtype="float32", device="cpu", quantization="gptq-int4")
    assert LLM(str(tmp_path / "rtn"), quantization="rtn-int4-g32", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="fp8"):
        save_quantized(LLM(str(qwen2_dir), dtype="float32", device="cpu", quantization="fp8"), tmp_path / "fp8")
    with pytest.raises(ValueError, match="not quantized"):
        save_quantized(LLM(str(qwen2_dir), dtype="float32", device="cpu"), tmp_path / "dense")
    config = json.loads((tmp_path / "rtn" / "config.json").read_text())
    for change, message in (({"quant_method": "awq"}, "GPTQ v1 layout"), ({"bits": 3}, "bits=3"),
                            ({"minillm_method": "rtn-int4-g64"}, "group_size=32")):
        broken = tmp_path / f"broken-{len(message)}"
        broken.mkdir()
        (broken / "model.safetensors").symlink_to(tmp_path / "rtn" / "model.safetensors")
        bad = config | {"quantization_config": config["quantization_config"] | change}
        (broken / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            LLM(str(broken), dtype="float32", device="cpu")


def test_cli_quantization_flag_and_the_peers_guard(capsys):
    from minillm.bench.peers import hf_model_sharing_weights
    from minillm.cli import main

    main(["info", "--model", "tiny", "--load-format", "dummy", "--device", "cpu", "--quantization", "rtn-int4-g32"])
    assert "rtn-int4-g32" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="gptq-int4, awq-int4, fp8"):
        main(["info", "--model", "tiny", "--load-format", "dummy", "--quantization", "int3"])
    llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="quantized"):
        hf_model_sharing_weights(llm.engine.model, llm.engine.model_config)
