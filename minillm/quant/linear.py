"""``QuantLinear``: the module a quantized ``nn.Linear`` is swapped for, and the packed layout it holds.

Quantization replaces modules and never forks the model file (DESIGN.md): ``qkv_proj``, ``o_proj``,
``gate_up_proj`` and ``down_proj`` of every decoder layer become ``QuantLinear`` (or ``FP8Linear``,
``fp8.py``); embeddings, norms and the LM head stay as they are.

The runtime layout is fixed, because the W4A16 / W8A16 kernels (``kernels/quant_matmul.py``) read
exactly this. With K input and N output features and groups of G input channels:

- **INT4** (GPTQ v1 packing, eight codes per int32):
  ``qweight`` int32 [K // 8, N]: input channel k = 8 i + j of column n sits in bits 4j..4j+3 of
  ``qweight[i, n]``; ``scales`` [ceil(K / G), N] in the activation dtype; ``zeros`` int32
  [ceil(K / G), N // 8], packed the same way along N, holding the **true** zero point 0..15
  (symmetric: 8; a checkpoint stores it minus one, see ``checkpoint.py``). The weight is
  ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``; the last group may be short (K % G != 0).
  With act-order, ``perm`` [K] (int64) lists input channels in the order they were quantized; rows
  of ``qweight`` are stored in that order so each group stays contiguous, and the forward pass reads
  ``x[..., perm]``.
- **INT8** (weight only, symmetric per output channel): ``qweight`` int8 [K, N], ``scales`` [N];
  ``w[k, n] = q[k, n] * s[n]``.

On CUDA (fp16/bf16 activations) the forward pass runs those kernels on the packed codes; on a CPU
(and as their reference) it dequantizes the weight with torch and multiplies.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.kernels.quant_pack import pack_codes, unpack_codes, unpack_int4_bytes
from minillm.model.norm_folding import NormedRow, PendingNorm, PendingSlot, ResidualRow
from minillm.quant.rtn import num_groups


# The packing is defined once, beside the kernels that read it; ``pack`` stays this module's name
# for it, the seam where exercise ex06 swaps in a learner's INT4 packing.
pack, unpack = pack_codes, unpack_codes


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as INT4 (packed, grouped) or INT8 (per channel) codes; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 act_order: bool = False, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if bits not in (4, 8) or (bits == 8 and group_size != -1):
            raise ValueError(f"QuantLinear holds INT4 (any group size) or INT8 per channel, got bits={bits}, "
                             f"group_size={group_size}")
        if bits == 4 and (in_features % 8 or out_features % 8):
            raise ValueError(f"INT4 packs 8 codes per int32: in_features ({in_features}) and out_features "
                             f"({out_features}) must be multiples of 8")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        dtype = dtype or torch.get_default_dtype()
        if bits == 4:
            groups = num_groups(in_features, group_size)
            self.register_buffer("qweight", torch.empty(in_features // 8, out_features, dtype=torch.int32, device=device))
            self.register_buffer("scales", torch.empty(groups, out_features, dtype=dtype, device=device))
            self.register_buffer("zeros", torch.empty(groups, out_features // 8, dtype=torch.int32, device=device))
        else:
            self.register_buffer("qweight", torch.empty(in_features, out_features, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))
        self.register_buffer("perm", torch.empty(in_features, dtype=torch.int64, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> "QuantLinear":
        """Build from a quantizer's output: ``codes`` [out, in] (columns in ``perm`` order when given),
        ``scales`` / ``zeros`` [out, groups] as ``rtn.quantize_groupwise`` returns them."""
        out_features, in_features = codes.shape
        dtype = dtype or scales.dtype
        layer = cls(in_features, out_features, bits, group_size, bias is not None, perm is not None, dtype, codes.device)
        layer.set_codes(codes.t(), zeros.t(), scales.t(), perm)
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    def set_codes(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  perm: torch.Tensor | None = None) -> None:
        """Store ``codes`` [in, out] (rows in ``perm`` order) with zero points and scales [groups, out]
        (INT8: codes 0..255 with every zero point 128, i.e. symmetric)."""
        if (perm is None) != (self.perm is None):
            raise ValueError(f"this layer was built {'with' if self.perm is not None else 'without'} an input "
                             f"permutation (act-order), and the codes come {'with' if perm is not None else 'without'} one")
        if tuple(codes.shape) != (self.in_features, self.out_features):
            raise ValueError(f"codes of shape {tuple(codes.shape)} do not fit a {self.in_features} -> "
                             f"{self.out_features} layer")
        if self.bits == 4:
            self.qweight.copy_(pack(codes, 4))
            self.zeros.copy_(pack(zeros.t(), 4).t())  # [groups, out // 8]: packed along out
            self.scales.copy_(scales)
        else:
            if not torch.all(zeros == 128):
                raise ValueError("INT8 weights must be symmetric (every zero point 128)")
            self.qweight.copy_((codes.to(torch.int16) - 128).to(torch.int8))
            self.scales.copy_(scales.reshape(-1))
        if perm is not None:
            self.perm.copy_(perm)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """INT4 codes [K, N] (rows in ``perm`` order) and true zero points [groups, N], as int32."""
        return unpack(self.qweight, 4), unpack(self.zeros.t(), 4).t()

    def dequantized_kn(self) -> torch.Tensor:
        """The weight [K, N] in the activation dtype, rows in ``perm`` order (what the kernels compute with)."""
        if self.bits == 8:
            return self.qweight.to(self.scales.dtype) * self.scales
        codes = unpack_int4_bytes(self.qweight).view(torch.int8)  # 0..15, one byte each
        zeros = unpack(self.zeros.t(), 4).t().to(torch.int8, memory_format=torch.contiguous_format)
        rows, groups = self.in_features, self.scales.shape[0]
        size = rows if self.group_size == -1 else self.group_size
        if groups * size != rows:  # a short last group: pad, then cut
            codes = nn.functional.pad(codes, (0, 0, 0, groups * size - rows))
        # Each group's zero point and scale broadcast over its rows. q - z (-15..15) is exact in int8 and in the
        # float dtype, so one rounding, in the multiply, as (q - z) * s computed in float: byte-sized passes
        # until the last one.
        w = (codes.view(groups, size, -1) - zeros[:, None]).to(self.scales.dtype).mul_(self.scales[:, None])
        return w.view(groups * size, -1)[:rows]

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as an ``nn.Linear`` holds it: [out, in], input channels in their original order."""
        w = self.dequantized_kn().t()
        if self.perm is None:
            return w
        original = torch.empty_like(w)
        original[:, self.perm] = w
        return original

    def forward(self, x: torch.Tensor | NormedRow | PendingNorm, gated: bool = False,
                add_to: torch.Tensor | None = None,
                into: PendingSlot | None = None) -> torch.Tensor | ResidualRow | PendingNorm:
        """``gated``: x is the MLP's gate_up row and the product's input is silu(gate) * up, applied by the kernel
        as it loads x (``gated_matmul``); only where ``takes_gated`` said so. With the norms folded
        (``model/norm_folding.py``): x may be a ``NormedRow``, and ``add_to`` the residual stream's fp32 row, to which
        the product is added in place, then returned as a ``ResidualRow``; the GEMV does both where it can, torch and
        the norm's kernel elsewhere. ``into`` (gate_up_proj, x a ``NormedRow``): the GEMV leaves its norm's 1 / rms to
        the next one, returning a ``PendingNorm`` in that slot, where it can (a plain y where not); a gated x may
        be a ``PendingNorm``."""
        if isinstance(x, (NormedRow, PendingNorm)) or add_to is not None:
            return self._folded(x, gated, add_to, into)
        if gated:
            return self.gated_matmul(x)
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def _folded(self, x: torch.Tensor | NormedRow | PendingNorm, gated: bool, add_to: torch.Tensor | None,
                into: PendingSlot | None) -> torch.Tensor | ResidualRow | PendingNorm:
        """``forward`` with a NormedRow or PendingNorm x or a residual to add: in the Gluon GEMV where it takes them,
        else as the unfolded layer computes them (``materialize``, ``ResidualRow.add``)."""
        normed, pending = isinstance(x, NormedRow), isinstance(x, PendingNorm)
        defer = normed and into is not None and add_to is None
        row = x.row.total if normed else x.row if pending else x
        if self._fused_refusal() is None:  # (fused_unsupported says where the device is why not)
            from minillm.kernels.hopper.w4_gemv_fused import fused_gemv, fused_unsupported
            from minillm.kernels.fused_layer_ops import Norm, Rms

            fused = dict(gated=gated, residual=into.total if defer else add_to,
                         norm=Norm(x.norm.weight, x.norm.eps) if normed else None,
                         squares=into.squares if defer else None,
                         rms=Rms(x.slot.squares, x.width, x.norm.eps) if pending else None)
            if fused_unsupported(row, self.qweight, self.scales, self.zeros, self.group_size, **fused) is None:
                out = fused_gemv(row, self.qweight, self.scales, self.zeros, self.group_size, **fused)
                if defer:
                    return PendingNorm(into, x.norm, self.in_features, torch.Size((*x.shape[:-1], self.out_features)))
                return out if add_to is None else ResidualRow(out)
        y = self.forward(x.materialize() if normed or pending else x, gated)
        return y if add_to is None else ResidualRow.add(y, add_to)

    def folds_norms(self) -> bool:
        """Whether a decoder layer should hand this layer ``NormedRow`` inputs and residuals to add
        (``norm_folding.folds_norms`` asks): INT4 codes the Gluon GEMV takes (``weight_unsupported`` in
        ``kernels/hopper/w4_gemv.py``: bf16, groups of 64 or 128, ...), on an sm_90 GPU. A layer it cannot take would fall back on every step."""
        if self._fused_refusal() or not self.qweight.is_cuda:
            return False
        from minillm.kernels.int4_dequantize import check_int4_layout
        from minillm.kernels.hopper.w4_gemv import weight_unsupported

        group = check_int4_layout(self.qweight, self.scales, self.zeros, self.group_size, self.scales)[2]
        return (weight_unsupported(self.qweight, self.scales, group) is None
                and torch.cuda.get_device_capability(self.qweight.device) == (9, 0))

    def takes_gated(self, gate_up: torch.Tensor) -> bool:
        """Whether ``forward(gate_up, gated=True)`` works (``model.dense.takes_gated`` asks): INT4 codes in their
        original order, no bias, and one gate_up row the Gluon GEMV takes (``w4_gemv_fused.fused_unsupported``)."""
        if self._fused_refusal() or not gate_up.is_cuda:
            return False
        from minillm.kernels.hopper.w4_gemv_fused import fused_unsupported

        return fused_unsupported(gate_up, self.qweight, self.scales, self.zeros, self.group_size, gated=True) is None

    def gated_matmul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up @ W^T for the MLP's one gate_up row, by ``w4_gemv_fused.fused_gemv`` (no bias: a layer
        with one refuses). A ValueError names what this layer or row lacks."""
        reason = self._fused_refusal()
        if reason:
            raise ValueError(f"gated=True needs an INT4 layer without act-order or bias (see takes_gated); this one "
                             f"{reason}")
        from minillm.kernels.hopper.w4_gemv_fused import fused_gemv

        return fused_gemv(gate_up, self.qweight, self.scales, self.zeros, self.group_size, gated=True)

    def _fused_refusal(self) -> str | None:
        """What keeps this layer from the Gluon GEMV's fused forms (gated, norms folded), whatever the row: None if
        nothing."""
        if self.bits != 4:
            return f"holds INT{self.bits} codes"
        if self.perm is not None:
            return "has act-order codes (x would need permuting)"
        if self.bias is not None:
            return "has a bias"
        return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias (a row-parallel layer adds the bias once, after summing the ranks')."""
        if self.perm is not None:
            x = x[..., self.perm]
        if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
            # The Triton kernels read the packed codes directly: no dequantized weight in memory.
            from minillm.kernels.quant_matmul import w4a16_matmul, w8a16_matmul

            if self.bits == 4:
                return w4a16_matmul(x, self.qweight, self.scales, self.zeros, self.group_size)
            return w8a16_matmul(x, self.qweight, self.scales)
        return x @ self.dequantized_kn()

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, {group}, "
                f"act_order={self.perm is not None}, bias={self.bias is not None}")
