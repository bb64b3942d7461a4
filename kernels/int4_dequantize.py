"""W4A16 weights back to a dense matrix, in one pass: the first half of quant_matmul's "dequant" path.

Why it exists: from DEQUANT_MIN_M tokens on (prefill), a matmul is compute-bound, and cuBLAS's
tensor-core pipeline beats a Triton dot that rebuilds its weight tile in registers; so the packed
weight is expanded once into a temporary in x's dtype and handed to ``torch.matmul``. The layout
(GPTQ v1: ``qweight``, ``scales``, ``zeros``) is ``quant_matmul.py``'s; its check lives here so that
both entry points share it. Each weight is rounded once to the target dtype, as
``quant_pack.dequantize_int4`` (the reference) does, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check, check_operand, interpreter_on

INTERPRET = interpreter_on()


@triton.jit
def _w4_dequantize_kernel(QW, S, Z, W, K, N, group_size, stride_q, stride_s, stride_z,
                          BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (packed row tile, column tile): W[k, n] = (q - z) s for k in 8 BLOCK_KP rows, in W's dtype."""
    r = tl.program_id(0) * BLOCK_KP + tl.arange(0, BLOCK_KP)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r < K // 8)[:, None] & (n < N)[None, :]
    packed = tl.load(QW + r[:, None] * stride_q + n[None, :], mask=mask, other=0)
    g = (8 * r) // group_size
    scale = tl.load(S + g[:, None] * stride_s + n[None, :], mask=mask, other=0.0).to(tl.float32)
    zero = (tl.load(Z + g[:, None] * stride_z + (n // 8)[None, :], mask=mask, other=0) >> ((n % 8) * 4)[None, :]) & 15
    j = tl.arange(0, 8)
    q = (packed[:, None, :] >> (4 * j)[None, :, None]) & 15
    w = ((q - zero[:, None, :]).to(tl.float32) * scale[:, None, :]).to(W.dtype.element_ty)  # rounded once, as in the ref
    k = 8 * r[:, None, None] + j[None, :, None]
    tl.store(W + k.to(tl.int64) * N + n[None, None, :], w, mask=mask[:, None, :])


def check_int4_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      like: torch.Tensor) -> tuple[int, int, int]:
    """The packed weight's (K, N, group) after checking the layout; scales must have ``like``'s dtype."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    group = k if group_size in (-1, k) else group_size
    check(isinstance(group, int) and group > 0 and group % 8 == 0,
          f"group_size is {group_size!r}; expected a positive multiple of 8 (e.g. 32, 64, 128), or -1 or K = {k} "
          "for one group per column")
    check(n % 8 == 0, f"N = {n} (qweight.shape[1]) must be a multiple of 8: zeros pack eight columns per int32")
    groups = -(-k // group)
    check_operand("qweight", qweight, torch.int32, (k // 8, n), like)
    check_operand("scales", scales, like.dtype, (groups, n), like)
    check_operand("zeros", zeros, torch.int32, (groups, n // 8), like)
    return k, n, group


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The dense weight [K, N] in ``dtype``, by one Triton kernel: what ``dequantize_int4`` computes."""
    check(qweight.dim() == 2, f"qweight must be int32 [K // 8, N], got shape {tuple(qweight.shape)}")
    k, n, group = check_int4_layout(qweight, scales, zeros, group_size, scales)
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_kp, block_n = (4, 32) if INTERPRET else (16, 128)
    grid = (triton.cdiv(k // 8, block_kp), triton.cdiv(n, block_n))
    _w4_dequantize_kernel[grid](qweight, scales, zeros, w, k, n, group, qweight.stride(0), scales.stride(0),
                                zeros.stride(0), BLOCK_KP=block_kp, BLOCK_N=block_n)
    return w
