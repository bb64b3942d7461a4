"""``quantize_model``: turn a loaded model's linears into quantized ones, by any of the methods.

RTN and FP8 look at each weight alone, so they swap every linear in one pass. GPTQ and AWQ learn
from activations: they run ``calibration.sequential_calibration`` over token ids from the corpus's
calibration part (``minillm.eval.perplexity.calibration_samples``), one decoder layer at a time.
The model is changed in place; ``model.quant_spec`` records what was done (saving reads it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from minillm.corpus import SEQ_LEN, calibration_samples
from minillm.quant import awq, gptq, rtn
from minillm.quant.calibration import LINEARS, LayerQuantizer, sequential_calibration
from minillm.quant.fp8 import FP8Linear
from minillm.quant.linear import QuantLinear
from minillm.quant.spec import QuantSpec


def rtn_linear(weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec) -> QuantLinear:
    """Round-to-nearest of one weight [out, in] into a ``QuantLinear`` (scales in the weight's dtype)."""
    codes, scales, zeros = rtn.quantize_groupwise(weight, spec.bits, spec.group_size, spec.sym)
    return QuantLinear.from_codes(codes, scales, zeros, spec.bits, spec.group_size, bias, dtype=weight.dtype)


def quantize_linear(linear: nn.Linear, spec: QuantSpec) -> nn.Module:
    """RTN or FP8 of one linear by itself, no calibration: what replaces it in one process."""
    return FP8Linear.from_linear(linear) if spec.method == "fp8" else rtn_linear(linear.weight, linear.bias, spec)


LinearQuantizer = Callable[[nn.Module, QuantSpec], nn.Module]


def gptq_linear(linear: nn.Linear, x: torch.Tensor, spec: QuantSpec) -> QuantLinear:
    """GPTQ of one linear given its calibration inputs ``x`` [tokens, in]."""
    result = gptq.gptq_quantize(linear.weight, gptq.hessian(x), spec.bits, spec.group_size, spec.sym, spec.act_order)
    codes, perm = result.codes, result.perm
    if perm is not None:
        # Within a group the order only mattered while quantizing: sort each group's channels (one
        # group per row: all of them), the order a checkpoint's g_idx gives back on load.
        size = codes.shape[1] if spec.group_size == -1 else spec.group_size
        group = torch.arange(len(perm), device=perm.device) // size
        order = torch.argsort(group * len(perm) + perm)
        codes, perm = codes[:, order], perm[order]
        if spec.group_size == -1:
            perm = None  # sorted: the natural order
    return QuantLinear.from_codes(codes, result.scales, result.zeros, spec.bits, spec.group_size, linear.bias, perm,
                                  dtype=linear.weight.dtype)


def gptq_layer(spec: QuantSpec) -> LayerQuantizer:
    def quantize_layer(index: int, layer: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        for name in LINEARS:
            layer.set_submodule(name, gptq_linear(layer.get_submodule(name), inputs[name], spec))
    return quantize_layer


def awq_layer(spec: QuantSpec, config) -> LayerQuantizer:
    def quantize_layer(index: int, layer: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        scales = awq.apply_scales(layer, config, inputs, spec)
        for name in LINEARS:
            linear = layer.get_submodule(name)
            x = inputs[name] / scales[name] if name in scales else inputs[name]
            weight = awq.clipped_weight(name, linear, x, config, spec).to(linear.weight.dtype)
            layer.set_submodule(name, rtn_linear(weight, linear.bias, spec))
    return quantize_layer


def calibration_for(spec: QuantSpec | str, loaded, num_samples: int, seed: int = 0) -> torch.Tensor | None:
    """What ``spec`` calibrates on when a model is quantized on load: ``num_samples`` 512-token
    windows of the corpus's calibration part, random token ids for a model without a tokenizer
    (dummy weights, where only speed matters), or None for RTN and FP8."""
    if QuantSpec.parse(spec).method not in ("gptq", "awq"):
        return None
    if loaded.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, loaded.config.vocab_size, (num_samples, SEQ_LEN), generator=generator)
    return calibration_samples(loaded.tokenizer, num_samples, SEQ_LEN)


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantSpec | str, calibration: torch.Tensor | None = None, *,
                   progress: bool = True, linear_quantizer: LinearQuantizer = quantize_linear) -> QuantSpec:
    """Quantize ``model`` (a ``LlamaForCausalLM``) in place; GPTQ and AWQ need ``calibration`` token
    ids [samples, seq_len]. RTN and FP8 swap each linear for ``linear_quantizer(linear, spec)``: a
    tensor-parallel rank passes its own (``minillm.parallel.tp``), for the layers it splits by rows.
    Returns the parsed spec."""
    spec = QuantSpec.parse(spec)
    if getattr(model, "quant_spec", None) is not None:
        raise ValueError(f"this model is already quantized ({model.quant_spec.name}); load it unquantized first")
    if spec.method in ("gptq", "awq"):
        if calibration is None:
            raise ValueError(f"{spec.name} calibrates on activations: pass calibration token ids [samples, seq_len]")
        quantize_layer = gptq_layer(spec) if spec.method == "gptq" else awq_layer(spec, model.config)
        sequential_calibration(model, calibration, quantize_layer, progress=progress, desc=spec.name)
    else:
        for layer in tqdm(model.model.layers, desc=spec.name, unit="layer", disable=not progress):
            for name in LINEARS:
                layer.set_submodule(name, linear_quantizer(layer.get_submodule(name), spec))
    if spec.lm_head:
        quantize_head(model, spec)
    model.quant_spec = spec
    return spec


def quantize_head(model: nn.Module, spec: QuantSpec) -> None:
    """``-head``: the LM head by round-to-nearest on ``spec``'s grid (FP8: FP8; ``-head8``: INT8), whatever the
    method, into a layer of its own (a head tied to the embedding no longer is; the embedding stays dense). A
    pipeline stage without the head has nothing to do; a vocabulary-parallel head (tensor parallelism) is refused."""
    head = model.lm_head
    if head is None:
        return
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{spec.name} quantizes the LM head, but this model's head is a {type(head).__name__} "
                         "(tensor parallelism splits it by vocabulary); drop -head")
    model.lm_head = quantize_linear(head, spec.head_spec())
