"""FP8 E4M3 with dynamic scales: weights per output channel, activations per token at run time.

E4M3 (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433) is 1 sign, 4 exponent
(bias 7) and 3 mantissa bits; the "fn" variant has no infinities, so its largest value is
1.75 * 2^8 = 448, and below 2^-6 it is subnormal with a fixed spacing of 2^-9. A tensor is scaled
so its largest magnitude lands on 448, rounded to the nearest E4M3 value (ties to even), and the
scale is kept in float32:

- weights: one scale per output channel, computed once (``torch.float8_e4m3fn`` storage, 1 byte);
- activations: one scale per token (row), computed on every forward pass ("dynamic"): no
  calibration, and an outlier token does not flatten the others' resolution.

On Hopper (compute capability 9.0+) the product runs in the tensor cores' FP8 path,
``torch._scaled_mm`` with row-wise scales. Elsewhere it is emulated exactly: both operands are
rounded to E4M3 values (held in float32, which represents every one of them and their products
exactly) and multiplied in float32, as the tensor core accumulates. ``round_to_e4m3`` spells the
rounding out in arithmetic; the tests check it against torch's own float8 cast bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6  # 2^-6 is the smallest normal; below it the spacing stays 2^-9
MANTISSA_BITS = 3


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (|x| <= 448) rounded to the nearest E4M3 value, ties to even, as float32."""
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent with m in [0.5, 1)
    binade = (exponent - 1).clamp(min=E4M3_MIN_NORMAL_EXP)  # floor(log2 |x|), subnormals share 2^-6's
    spacing = torch.pow(2.0, (binade - MANTISSA_BITS).float())
    return torch.copysign(torch.round(magnitude / spacing) * spacing, x)  # round() is half-to-even


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row so the row's largest magnitude maps to 448 (rows of zeros: scale 1)."""
    amax = x.abs().amax(dim=-1).float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale) rounded to E4M3 as ``torch.float8_e4m3fn``, and the scales [rows]."""
    scale = row_scales(x)
    return (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class FP8Linear(nn.Module):
    """y = x W^T + b in FP8 E4M3: ``weight`` [out, in] float8_e4m3fn with ``weight_scale`` [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        layer.weight, layer.weight_scale = quantize_rows(w)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if has_fp8_tensor_cores(x.device) and x.dtype == torch.bfloat16:
            x_q, x_scale = quantize_rows(rows)
            y = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale[:, None], scale_b=self.weight_scale[None, :],
                                 out_dtype=x.dtype)
        else:
            x_scale = row_scales(rows)
            x_q = round_to_e4m3((rows.float() / x_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX))
            y = ((x_q @ self.weight.float().t()) * x_scale[:, None] * self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]
