"""AWQ: protect the weights that meet large activations by scaling them up before rounding.

Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration"
(MLSys 2024, arXiv:2306.00978). A linear's output is W x = (W diag(s)) (diag(s)^-1 x): scaling input
channel k of W by s_k and its input by 1/s_k changes nothing in exact arithmetic, but rounding
``W diag(s)`` on a per-group grid makes the relative error of the scaled-up channels smaller. The
channels worth protecting are those with large activations, so (section 3.2)

    s = s_x^alpha,   s_x = mean over tokens of |x_k|,   alpha on a grid of 20 in [0, 1)

normalised by sqrt(max s * min s), with the alpha that minimises ||Q(W diag(s)) diag(s)^-1 x - W x||^2
on calibration activations (alpha = 0 is plain RTN, so the search never does worse on them). The
1/s is folded into whatever produces x, so inference pays nothing:

- ``qkv_proj`` and ``gate_up_proj`` read an RMSNorm: its weight is divided by s;
- ``down_proj`` reads SiLU(gate) * up: the up rows of ``gate_up_proj`` are divided by s;
- ``o_proj`` reads the attention output, a mix of V rows: the V rows of ``qkv_proj`` are divided by
  s, which needs one V channel per o_proj input, i.e. as many KV heads as query heads (no GQA);
  with GQA (SmolLM2: 9 query heads, 3 KV heads) o_proj is not scaled, as in AutoAWQ.

Then **clipping** (AutoAWQ's ``_search_best_clip``): per output channel and group, the range is
shrunk to ``max|w| * (1 - i/20)`` for i < 10, keeping the shrink with the smallest output error
(q and k rows are not clipped: their errors pass through the softmax; AutoAWQ skips them too).
minillm measures both searches' errors at the linear's own output, where AutoAWQ runs the whole
attention or MLP block for the fused projections: cheaper, and enough to beat RTN (tests).
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.quant import rtn
from minillm.quant.spec import QuantSpec

GRID = 20
MAX_SHRINK = 0.5  # clipping tries ranges down to half the original
SEARCH_TOKENS = 256  # calibration tokens (evenly strided) the scale search measures its error on


def subsample(x: torch.Tensor, n: int = SEARCH_TOKENS) -> torch.Tensor:
    """At most ``n`` rows of ``x``, evenly strided."""
    return x[::max(1, x.shape[0] // n)][:n]


def search_scale(x: torch.Tensor, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The per-input-channel scale s [in] for weight ``w`` [out, in] with inputs ``x`` [tokens, in]."""
    x, w = subsample(x), w.float()
    reference = x @ w.t()
    mean_abs = x.abs().mean(dim=0)
    best_error, best = float("inf"), torch.ones_like(mean_abs)
    for i in range(GRID):
        s = mean_abs.pow(i / GRID).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        quantized = rtn.fake_quantize(w * s, spec.bits, spec.group_size, spec.sym) / s
        error = (x @ quantized.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best = error, s
    return best


def group_output_error(x: torch.Tensor, size: int):
    """A function of weight errors ``delta`` [groups, size, out] -> mean squared output error each
    group's inputs ``x`` [tokens, in] (zero-padded to whole groups) give: [groups, out]. Small groups
    use each group's Gram matrix X_g^T X_g over all tokens (fewer multiplications than the outputs);
    groups larger than SEARCH_TOKENS multiply a subsample of the tokens directly."""
    groups = -(-x.shape[1] // size)
    xg = nn.functional.pad(x, (0, groups * size - x.shape[1])).reshape(x.shape[0], groups, size).transpose(0, 1)
    if size > SEARCH_TOKENS:
        xg = subsample(xg.transpose(0, 1)).transpose(0, 1)
        return lambda delta: torch.bmm(xg, delta).pow(2).mean(dim=1)
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [groups, size, size]
    return lambda delta: (torch.bmm(gram, delta) * delta).sum(dim=1)


def search_clip(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``w`` [out, in] with each (output channel, group) clamped to the range that quantizes best on ``x``."""
    w = w.float()
    out_features, in_features = w.shape
    size = in_features if spec.group_size == -1 else spec.group_size
    groups = -(-in_features // size)
    pad = groups * size - in_features  # a ragged last group: zero-padded inputs contribute nothing
    error_of = group_output_error(x, size)
    wg = nn.functional.pad(w, (0, pad)).reshape(out_features, groups, size)
    original_max = wg.abs().amax(dim=2, keepdim=True)  # [out, groups, 1]
    best_error = torch.full((out_features, groups), float("inf"), device=w.device)
    best_max = original_max.clone()
    for i in range(int(MAX_SHRINK * GRID)):
        max_val = original_max * (1 - i / GRID)
        clipped = torch.maximum(torch.minimum(wg, max_val), -max_val).reshape(out_features, -1)[:, :in_features]
        delta = rtn.fake_quantize(clipped, spec.bits, spec.group_size, spec.sym) - w
        delta = nn.functional.pad(delta, (0, pad)).reshape(out_features, groups, size).permute(1, 2, 0)
        error = error_of(delta).t()  # [out, groups]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_max = torch.where(better[..., None], max_val, best_max)
    clipped = torch.maximum(torch.minimum(wg, best_max), -best_max)
    return clipped.reshape(out_features, -1)[:, :in_features]


def _scale_inputs(weight: torch.Tensor, s: torch.Tensor) -> None:
    weight.mul_(s.to(weight.dtype))


def _divide_rows(weight: torch.Tensor, rows: slice, s: torch.Tensor) -> None:
    weight[rows].div_(s.to(weight.dtype)[:, None] if weight.dim() == 2 else s.to(weight.dtype))


def apply_scales(layer: nn.Module, config, inputs: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Search and fold the scales of one decoder layer (unquantized weights); returns each linear's
    scale, by which its recorded inputs must now be divided."""
    attn, mlp = layer.self_attn, layer.mlp
    q_rows, k_rows, v_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    intermediate = config.intermediate_size
    scales = {}

    s = scales["self_attn.qkv_proj"] = search_scale(inputs["self_attn.qkv_proj"], attn.qkv_proj.weight, spec)
    layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
    _scale_inputs(attn.qkv_proj.weight, s)
    if config.num_heads == config.num_kv_heads:
        s = scales["self_attn.o_proj"] = search_scale(inputs["self_attn.o_proj"], attn.o_proj.weight, spec)
        v = slice(q_rows + k_rows, q_rows + k_rows + v_rows)
        _divide_rows(attn.qkv_proj.weight, v, s)
        if attn.qkv_proj.bias is not None:
            _divide_rows(attn.qkv_proj.bias, v, s)
        _scale_inputs(attn.o_proj.weight, s)

    s = scales["mlp.gate_up_proj"] = search_scale(inputs["mlp.gate_up_proj"], mlp.gate_up_proj.weight, spec)
    layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
    _scale_inputs(mlp.gate_up_proj.weight, s)
    s = scales["mlp.down_proj"] = search_scale(inputs["mlp.down_proj"], mlp.down_proj.weight, spec)
    _divide_rows(mlp.gate_up_proj.weight, slice(intermediate, 2 * intermediate), s)
    _scale_inputs(mlp.down_proj.weight, s)
    return scales


def clipped_weight(name: str, linear: nn.Linear, x: torch.Tensor, config, spec: QuantSpec) -> torch.Tensor:
    """The linear's weight after the clipping search (only V rows of ``qkv_proj``)."""
    w = linear.weight.float()
    if name != "self_attn.qkv_proj":
        return search_clip(w, x, spec)
    v_start = (config.num_heads + config.num_kv_heads) * config.head_dim
    return torch.cat((w[:v_start], search_clip(w[v_start:], x, spec)))
