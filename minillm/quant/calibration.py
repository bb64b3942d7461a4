"""Sequential, block-by-block calibration: what GPTQ and AWQ learn from, one decoder layer at a time.

Both methods fit a layer's quantized weights to the inputs that layer really sees. Running the
whole model once and recording every layer's inputs would show each layer the *unquantized*
model's activations; instead (GPTQ's reference does the same) the calibration tokens go through the
model one layer at a time: record the inputs of the layer's four linears (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``), let the method quantize the layer, then run the *quantized* layer
to make the next layer's inputs. So each layer is fitted to the errors of the layers before it, and
only one layer's activations are held at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from minillm.attention import CausalAttention

# The linears of a decoder layer that quantization replaces (paths inside a DecoderLayer).
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

LayerQuantizer = Callable[[int, nn.Module, dict[str, torch.Tensor]], None]


def layer_output(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The hidden state after decoder ``layer`` for hidden state ``x`` (a causal batch): its MLP output
    plus its residual, the add the model leaves to the next layer's norm (``DecoderLayer.forward``).
    The next layer, started from this sum, computes what it computes inside the model."""
    out, residual = layer(x, cos, sin, CausalAttention())
    return out + residual


def capture_inputs(layer: nn.Module, hidden: list[torch.Tensor], rope: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Run ``layer`` over each batch of ``hidden``; return its linears' inputs (name -> [tokens, in],
    float32) and the layer's outputs."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in LINEARS}

    def record(name):
        def hook(module, args, output):
            captured[name].append(args[0].reshape(-1, args[0].shape[-1]).float())
        return hook

    hooks = [layer.get_submodule(name).register_forward_hook(record(name)) for name in LINEARS]
    try:
        outputs = [layer_output(layer, x, cos, sin) for x, (cos, sin) in zip(hidden, rope)]
    finally:
        for handle in hooks:
            handle.remove()
    return {name: torch.cat(parts) for name, parts in captured.items()}, outputs


@torch.no_grad()
def sequential_calibration(model: nn.Module, samples: torch.Tensor, quantize_layer: LayerQuantizer, *,
                           batch_size: int = 8, progress: bool = True, desc: str = "calibrate") -> None:
    """Feed ``samples`` [n, seq_len] (token ids) through ``model`` layer by layer; ``quantize_layer(i,
    layer, inputs)`` quantizes layer i in place given its linears' inputs, before the layer's outputs
    (now quantized) are computed for layer i + 1. A no-op ``quantize_layer`` just observes the
    unquantized model's activations."""
    device = model.model.embed_tokens.weight.device
    batches = samples.to(device).split(batch_size)
    hidden = [model.model.embed_tokens(ids) for ids in batches]
    positions = [torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1) for ids in batches]
    rope = [model.rope(p, hidden[0].dtype) for p in positions]
    for i, layer in enumerate(tqdm(model.model.layers, desc=desc, unit="layer", disable=not progress)):
        inputs, _ = capture_inputs(layer, hidden, rope)
        quantize_layer(i, layer, inputs)
        del inputs
        hidden = [layer_output(layer, x, cos, sin) for x, (cos, sin) in zip(hidden, rope)]
