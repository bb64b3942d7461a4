"""Quantized checkpoints: safetensors in the GPTQ v1 tensor layout, with a ``quantization_config``.

GPTQ and AWQ take minutes to calibrate; a saved checkpoint loads in a second (``LLM("dir")``). The
format is AutoGPTQ's "v1" layout, which transformers, vLLM and the GPTQ kernels read, so a minillm
checkpoint looks familiar to the ecosystem. Fused projections are split back into Hugging Face's
``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``. For each quantized linear
``<name>`` with K inputs, N outputs, ``bits`` per code and ``groups`` groups:

- ``<name>.qweight`` int32 [K * bits / 32, N]: codes packed along the input dim, 32 / bits per word,
  input channel k = (32 / bits) i + j in bits j*bits.. of row i, in the natural channel order;
- ``<name>.qzeros`` int32 [groups, N * bits / 32]: zero points packed the same way along the output
  dim, each stored **minus one** (v1's offset, which early kernels added back): a zero point of 0 is
  stored as 2^bits - 1;
- ``<name>.scales`` float16 [groups, N];
- ``<name>.g_idx`` int32 [K]: the group of each input channel. Without act-order it is k // G; with
  act-order, groups were formed in the order channels were quantized, so they are scattered here;
- ``<name>.bias`` when the layer has one.

The weight is ``w[k, n] = (q[k, n] - (qzeros[g_idx[k], n] + 1)) * scales[g_idx[k], n]``. Everything
else (embeddings, norms, an untied LM head) is stored as in an ordinary checkpoint, and
``config.json`` gains ``quantization_config = {"quant_method": "gptq", "checkpoint_format": "gptq",
"bits", "group_size", "desc_act", "sym", "lm_head", "minillm_method"}`` (the last names how it was made;
GPTQ ones add ``damp_percent``).

A quantized LM head (``-head``, ``-head8``: ``spec.py``) is stored the same way as ``lm_head.qweight`` and
the rest, with ``"lm_head": true`` (the key AutoGPTQ and GPTQModel write for it) and
``tie_word_embeddings: false``: the file's head is a layer of its own, whatever the embedding it came
from. ``-head8``'s head is 8-bit per output channel where the layers are 4-bit; ``bits`` speaks for the
layers, ``minillm_method`` for both.

Loading undoes the offset, sorts input channels by ``g_idx`` (so each group is contiguous again:
the runtime ``perm`` of ``linear.py``) and fuses the projections; a tensor- or pipeline-parallel
rank reads only its part of each tensor (``read_quantized``). 8-bit checkpoints load when they are
symmetric per output channel (the INT8 runtime layout). FP8 models are not saved: ``fp8``
quantizes on load in about a second.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minillm.model.config import ModelConfig, hf_config_for
from minillm.model.llama import FUSED_PROJECTIONS
from minillm.quant.calibration import LINEARS
from minillm.quant.gptq import DAMP
from minillm.quant.linear import QuantLinear, pack, unpack
from minillm.quant.spec import QuantSpec

QUANTIZED_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def hf_config(config: ModelConfig) -> dict:
    """A ``config.json`` that ``ModelConfig.from_hf`` reads back as ``config``: the transformers config
    the benchmark peers build, with every stop id (that object keeps one) and the sliding window."""
    return hf_config_for(config).to_dict() | {"eos_token_id": config.eos_token_ids,
                                              "sliding_window": config.sliding_window}


def quantization_config(spec: QuantSpec) -> dict:
    config = {"quant_method": "gptq", "checkpoint_format": "gptq", "bits": spec.bits, "group_size": spec.group_size,
              "desc_act": spec.act_order and spec.group_size != -1, "sym": spec.sym, "lm_head": spec.lm_head,
              "minillm_method": spec.name}
    return config | ({"damp_percent": DAMP} if spec.method == "gptq" else {})


def spec_from_config(config: dict) -> QuantSpec:
    """The spec a checkpoint's ``quantization_config`` describes; ValueError for what minillm cannot run."""
    method, fmt = config.get("quant_method"), config.get("checkpoint_format", "gptq")
    if method != "gptq" or fmt != "gptq":
        raise ValueError(f"minillm reads quantized checkpoints in the GPTQ v1 layout (quant_method 'gptq', "
                         f"checkpoint_format 'gptq'); this one has quant_method {method!r}, checkpoint_format {fmt!r}")
    bits, group_size, sym = config.get("bits"), config.get("group_size", -1), config.get("sym", True)
    if bits not in (4, 8) or (bits == 8 and (group_size != -1 or not sym)):
        raise ValueError(f"minillm runs 4-bit GPTQ checkpoints and 8-bit symmetric per-channel ones, "
                         f"not bits={bits}, group_size={group_size}, sym={sym}")
    lm_head = bool(config.get("lm_head", False))
    spec = QuantSpec("gptq", bits, group_size, sym, bool(config.get("desc_act")), lm_head)
    named = config.get("minillm_method")
    if named is not None:
        made = QuantSpec.parse(named)
        if (made.bits, made.group_size, made.sym, made.lm_head) != (bits, group_size, sym, lm_head):
            raise ValueError(f"quantization_config says minillm_method={named!r} but bits={bits}, "
                             f"group_size={group_size}, sym={sym}, lm_head={lm_head}")
        return made
    return spec


def projections(model: nn.Module, path: str) -> list[tuple[str, int]]:
    """(Hugging Face projection name, output rows) of the linear at ``path`` in a decoder layer."""
    module, _, proj = path.rpartition(".")
    fused = [(name, i) for name, (target, i) in FUSED_PROJECTIONS.items() if target == proj]
    if not fused:
        return [(path, model.model.layers[0].get_submodule(path).out_features)]
    sizes = model.fused_sizes(proj)
    return [(f"{module}.{name}", sizes[i]) for name, i in sorted(fused, key=lambda item: item[1])]


def gptq_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    """One QuantLinear in the v1 layout (whole, before any split into projections)."""
    in_features, bits, group_size = layer.in_features, layer.bits, layer.group_size
    if bits == 4:
        codes, zeros = layer.unpacked()
        scales = layer.scales
    else:
        codes = layer.qweight.to(torch.int32) + 128
        zeros = torch.full((1, layer.out_features), 128, dtype=torch.int32, device=codes.device)
        scales = layer.scales[None]
    order = torch.arange(in_features, device=codes.device)
    g_idx = order // group_size if group_size != -1 else torch.zeros_like(order)
    if layer.perm is not None:  # rows are stored in quantization order: put them back in channel order
        codes = torch.empty_like(codes).index_copy_(0, layer.perm, codes)
        g_idx = torch.empty_like(g_idx).index_copy_(0, layer.perm, g_idx)
    mask = 2 ** bits - 1
    return {"qweight": pack(codes, bits), "qzeros": pack(((zeros - 1) & mask).t(), bits).t().contiguous(),
            "scales": scales.to(torch.float16), "g_idx": g_idx.to(torch.int32)}


def save_quantized(target, path: str | Path, tokenizer=None) -> Path:
    """Write a quantized model (an ``LLM``, or a model with ``quant_spec`` and optionally its tokenizer)
    as a safetensors directory: config.json, model.safetensors, and the tokenizer's files."""
    from safetensors.torch import save_file

    engine = getattr(target, "engine", None)
    model, tokenizer = (target, tokenizer) if engine is None else (engine.model, engine.tokenizer)
    spec = getattr(model, "quant_spec", None)
    if spec is None or spec.method == "fp8":
        raise ValueError(f"save_quantized writes GPTQ-layout INT4 / INT8 models; this model is "
                         f"{'not quantized' if spec is None else 'fp8, which quantizes on load in a second'}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: model.checkpoint_tensor(name) for name in model.checkpoint_names()}
    for i, layer in enumerate(model.model.layers):
        for linear_path in LINEARS:
            tensors, start = gptq_tensors(layer.get_submodule(linear_path)), 0
            for name, rows in projections(model, linear_path):
                per_word = 32 // spec.bits
                for kind, tensor in tensors.items():
                    if kind == "g_idx":
                        part = tensor.clone()  # each projection stores its own copy
                    elif kind == "qzeros":
                        part = tensor[:, start // per_word:(start + rows) // per_word]
                    else:
                        part = tensor[:, start:start + rows]
                    state[f"model.layers.{i}.{name}.{kind}"] = part
                start += rows
    if spec.lm_head:
        state |= {f"lm_head.{kind}": tensor for kind, tensor in gptq_tensors(model.lm_head).items()}
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    config = hf_config(model.config) | {"quantization_config": quantization_config(spec)}
    if spec.lm_head:
        config["tie_word_embeddings"] = False  # the head is stored as a layer of its own
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def install_quant_linears(model: nn.Module, spec: QuantSpec) -> None:
    """Swap empty QuantLinear shells for the dense linears (before the weights are read): the layers', and the
    LM head's with ``-head`` (a pipeline stage without the head has none to swap)."""
    def shell(dense: nn.Linear, spec: QuantSpec) -> QuantLinear:
        return QuantLinear(dense.in_features, dense.out_features, spec.bits, spec.group_size, dense.bias is not None,
                           act_order=spec.act_order and spec.group_size != -1)

    for layer in model.model.layers:
        for linear_path in LINEARS:
            layer.set_submodule(linear_path, shell(layer.get_submodule(linear_path), spec))
    if spec.lm_head and model.lm_head is not None:
        # minillm's heads are never act-ordered, but AutoGPTQ's desc_act orders a quantized head's channels too: an
        # act-order shell takes either (``_fill`` drops a permutation that leaves the channels in order).
        head = spec.head_spec() if spec.head_int8 else replace(spec.head_spec(), act_order=spec.act_order)
        model.lm_head = shell(model.lm_head, head)
    model.quant_spec = spec


def is_quantized_tensor(name: str) -> bool:
    return name.rpartition(".")[2] in QUANTIZED_TENSORS


def packed_index(kind: str, index: tuple[slice, ...], bits: int, group_size: int) -> tuple[slice, ...]:
    """Where part ``index`` of a linear's weight [out, in] lies in the linear's v1 tensor ``kind``.

    ``index`` is a tensor-parallel rank's part (``minillm.parallel.tp.checkpoint_slice``): output
    rows ``(rows,)`` of a column-parallel linear, input columns ``(everything, columns)`` of a
    row-parallel one. The v1 tensors are [K, N]-shaped, so output rows are their columns; input
    channels are packed ``32 / bits`` to a ``qweight`` row and grouped in ``scales`` / ``qzeros``
    rows (one row for every channel with ``group_size=-1``), zero points packed along the outputs.
    """
    outputs, inputs = (*index, slice(None))[:2]
    per_word = 32 // bits
    if kind == "g_idx":
        return (inputs,)
    if kind == "qweight":
        return _whole_units(inputs, per_word, f"input channels ({per_word} codes per int32)"), outputs
    groups = slice(None) if group_size == -1 else \
        _whole_units(inputs, group_size, f"input channels (groups of {group_size})")
    if kind == "scales":
        return groups, outputs
    if kind == "qzeros":
        return groups, _whole_units(outputs, per_word, f"output channels ({per_word} zero points per int32)")
    raise ValueError(f"{kind!r} is not a quantized tensor; valid: {', '.join(QUANTIZED_TENSORS)}")


def _whole_units(part: slice, unit: int, what: str) -> slice:
    """``part`` counted in units of ``unit``: both of its ends must fall on a unit's boundary."""
    if any(end is not None and end % unit for end in (part.start, part.stop)):
        raise ValueError(f"{what} [{part.start}, {part.stop}) do not split into whole units of {unit}")
    return slice(*(None if end is None else end // unit for end in (part.start, part.stop)))


def read_quantized(weights, name: str, spec: QuantSpec, config: ModelConfig,
                   part=None) -> tuple[str, torch.Tensor] | None:
    """Quantized checkpoint tensor ``name`` from safetensors file ``weights``: its name in this
    process's model and the part of it that ``part`` (a ``ModelPart`` of the loader) holds, read
    without the rest; None if another pipeline stage holds it. Whole tensors without a part.

    The part is asked where the linear's weight would go; ``g_idx`` is renumbered from the part's
    first group (a row-parallel rank's first input channel starts a group: ``tp.check_layout``)."""
    linear, _, kind = name.rpartition(".")
    if part is None:
        return name, weights.get_tensor(name)
    where = part.locate(f"{linear}.weight", config)
    if where is None:
        return None
    local_linear, index = where[0].rpartition(".")[0], where[1]
    tensor = weights.get_slice(name)[packed_index(kind, index, spec.bits, spec.group_size)]
    inputs = (*index, slice(None))[1]
    if kind == "g_idx" and spec.group_size != -1 and inputs.start:
        tensor = tensor - inputs.start // spec.group_size
    return f"{local_linear}.{kind}", tensor


def load_quantized_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the QuantLinear shells from a checkpoint's v1 tensors (``tensors``: name -> tensor)."""
    for i, layer in enumerate(model.model.layers):
        for linear_path in LINEARS:
            module = layer.get_submodule(linear_path)
            codes, zeros, scales, g_idx = zip(*(_read_v1(tensors, f"model.layers.{i}.{name}", module.bits)
                                                for name, _ in projections(model, linear_path)))
            if any(not torch.equal(g, g_idx[0]) for g in g_idx):
                raise ValueError(f"model.layers.{i}: the projections minillm fuses into {linear_path} have "
                                 f"different g_idx; they must share one (they read the same input)")
            _fill(module, torch.cat(codes, dim=1), torch.cat(zeros, dim=1), torch.cat(scales, dim=1), g_idx[0],
                  f"model.layers.{i}.{linear_path}")
    if isinstance(model.lm_head, QuantLinear):
        _fill(model.lm_head, *_read_v1(tensors, "lm_head", model.lm_head.bits), "lm_head")
    if tensors:
        raise ValueError(f"the checkpoint holds quantized tensors minillm has no place for: {sorted(tensors)[:3]}")


def _read_v1(tensors: dict[str, torch.Tensor], linear: str, bits: int):
    """Linear ``linear``'s v1 tensors, taken out of ``tensors`` and unpacked: codes [K, N], zero points [groups, N]
    (v1's offset undone), scales, g_idx."""
    found = [tensors.pop(f"{linear}.{kind}", None) for kind in QUANTIZED_TENSORS]
    if any(t is None for t in found):
        missing = [kind for kind, t in zip(QUANTIZED_TENSORS, found) if t is None]
        raise ValueError(f"the checkpoint lacks {linear}.{missing[0]} ({len(missing)} of its quantized tensors "
                         f"missing)")
    qweight, qzeros, scales, g_idx = found
    return unpack(qweight, bits), (unpack(qzeros.t(), bits).t() + 1) & (2 ** bits - 1), scales, g_idx.long()


def _fill(module: QuantLinear, codes, zeros, scales, g_idx, where: str) -> None:
    if module.group_size == -1:
        perm = None
    else:
        perm = torch.argsort(g_idx, stable=True)  # channels grouped: each group's rows contiguous
        expected = torch.arange(len(g_idx), device=g_idx.device) // module.group_size
        if not torch.equal(g_idx[perm], expected):
            raise ValueError(f"{where}: g_idx does not form groups of {module.group_size} channels")
        in_order = torch.equal(perm, torch.arange(len(perm), device=perm.device))
        if module.perm is None and not in_order:
            raise ValueError(f"{where}: g_idx reorders channels but the config says desc_act=false")
        if in_order:
            module.perm = perm = None  # (an act-order shell whose channels stayed in order: nothing to permute)
        else:
            codes = codes[perm]
    module.set_codes(codes, zeros, scales, perm)
