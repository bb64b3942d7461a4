"""The small ops of a decoder layer, fused: RMSNorm (optionally with the residual add before it),
rotary embeddings on q and k, and SiLU-and-multiply.

Why it exists: at batch 1 a decode step is a chain of GEMVs plus ~15 tiny elementwise kernels per
layer (RMSNorm alone is a cast, the norm, a cast back and a multiply; RoPE is two multiplies, a
negation, a concatenation and an add). Each costs little work but a launch, and even inside a CUDA
graph a launch costs microseconds: 32 layers × 15 kernels is ~1 ms of a ~5 ms llama2-7b token
(figures/h200/profile_decode_step.json counts 910 kernels in an eager step). Fusing each group into
one kernel reads and writes each activation once. vLLM fuses the same groups (``fused_add_rms_norm``,
``rotary_embedding``, ``silu_and_mul``).

Numerics follow the torch path of ``minillm/model/llama.py``, which follows transformers: RMSNorm
normalises in fp32, rounds to the input dtype, then multiplies by the weight (rounded again); the
residual sum is rounded to the input dtype before it is normalised. RoPE here rounds once at the
end, where the torch path rounds after each of its ops, so bf16 results may differ in the last bit.

Each op: a plain-torch ``*_ref``, the kernel, and a wrapper that checks its inputs. One program per
row (token); rows are short (hidden size ≤ 8192), so a row fits in one tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES as DTYPES
from .checks import check
from .checks import check_runnable, interpreter_on
from .hopper.pdl import let_next_start, supported as pdl_supported

INTERPRET = interpreter_on()


def _check_tensor(name: str, t: torch.Tensor) -> None:
    check(t.dtype in DTYPES, f"{name}.dtype is {t.dtype}; expected one of {DTYPES}")
    check_runnable(name, t)
    check(t.stride(-1) == 1, f"{name} needs a contiguous last dim, got strides {t.stride()}")


# ----------------------------------------------------------------------------- RMSNorm (+ residual)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """weight * (s / sqrt(mean(s²) + eps)) with s = x (+ residual); returns y, or (y, s) with a residual."""
    s = x if residual is None else x + residual
    y = weight * torch.nn.functional.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype)
    return y if residual is None else (y, s)


@triton.jit
def _rms_norm_kernel(X, R, W, Y, S, stride_x, stride_r, stride_y, stride_s, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    let_next_start(PDL)  # the GEMV after a norm may start warming L2 now (hopper/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # An fp32 residual (the folded norms' stream) is rounded to x's dtype first, as residual.to(x.dtype) would be;
        # the sum is rounded to the dtype, as in torch.
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(X.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(X.dtype.element_ty)  # round, then multiply by the weight: transformers' order
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Fused ``rms_norm_ref``: x (and residual) [..., hidden]; one kernel, one read of each input. The residual may be
    fp32 where x is 16-bit (the folded norms' residual stream, ``model/norm_folding.py``): it is rounded to x's dtype
    as it is loaded, the result ``rms_norm_ref(x, weight, eps, residual.to(x.dtype))``'s bit for bit."""
    _check_tensor("x", x)
    check(weight.shape == (x.shape[-1],), f"weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},)")
    check(weight.dtype == x.dtype, f"weight.dtype is {weight.dtype} but x.dtype is {x.dtype}; they must match")
    rows = x.reshape(-1, x.shape[-1])  # a view for the model's [1, tokens, hidden] activations
    y = torch.empty_like(rows)
    s = r = rows
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype in (x.dtype, torch.float32),
               f"residual is {residual.dtype} {tuple(residual.shape)}; expected {x.dtype} (or float32) "
               f"{tuple(x.shape)}")
        r = residual.reshape(-1, x.shape[-1])
        s = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, r, weight, y, s, rows.stride(0), r.stride(0), y.stride(0), s.stride(0),
                                       rows.shape[1], eps, HAS_RESIDUAL=residual is not None,
                                       BLOCK=triton.next_power_of_2(rows.shape[1]), PDL=pdl_supported(x.device))
    y = y.view(x.shape)
    return y if residual is None else (y, s.view(x.shape))


# ----------------------------------------------------------------------------- rotary embeddings


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D]; cos/sin [tokens, D] (halves duplicated, the HF layout) -> rotated x."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos[:, None].float() + rotated.float() * sin[:, None].float()).to(x.dtype)


@triton.jit
def rotated_halves(x_ptr, mask, cos, sin, HALF: tl.constexpr):
    """The rows at ``x_ptr`` (first halves; the second halves HALF further) rotated by RoPE in fp32 with the
    token's ``cos``/``sin`` [1, HALF] (fp32), each rounded once to x's dtype: (first halves, second halves).
    The one definition for this module's RoPE kernel and ``kv_store.rope_store_kv``: they agree bit for bit."""
    return rotated(tl.load(x_ptr, mask=mask, other=0.0), tl.load(x_ptr + HALF, mask=mask, other=0.0), cos, sin)


@triton.jit
def rotated(x1, x2, cos, sin):
    """``rotated_halves``'s arithmetic on halves already loaded (``rope_in_decode.py`` scales some first)."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos - f2 * sin).to(x1.dtype), (f2 * cos + f1 * sin).to(x1.dtype)


@triton.jit
def _rope_kernel(X, Cos, Sin, Y, stride_xt, stride_xh, stride_yt, stride_yh, stride_c, num_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    cos = tl.load(Cos + t * stride_c + dims).to(tl.float32)
    sin = tl.load(Sin + t * stride_c + dims).to(tl.float32)
    y1, y2 = rotated_halves(X + t * stride_xt + heads * stride_xh + dims, mask, cos, sin, HALF)
    y_ptr = Y + t * stride_yt + heads * stride_yh + dims
    tl.store(y_ptr, y1, mask=mask)
    tl.store(y_ptr + HALF, y2, mask=mask)


def check_rope_inputs(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [tokens, heads, head_dim] (head_dim twice a power of two, contiguous along it) and its cos/sin
    [tokens, head_dim], as ``rope`` and ``kv_store.rope_store_kv`` take them."""
    _check_tensor(name, x)
    check(x.dim() == 3, f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    check(dim % 2 == 0 and (dim // 2) & (dim // 2 - 1) == 0,
           f"head_dim is {dim}; expected twice a power of two")
    check(cos.shape == sin.shape == (tokens, dim), f"cos/sin have shapes {tuple(cos.shape)}, {tuple(sin.shape)}; "
           f"expected ({tokens}, {dim})")
    check(cos.stride() == sin.stride() and cos.stride(-1) == 1, "cos and sin need equal strides ending in 1")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused ``rope_ref`` for all heads of each token in one program; ``out=x`` rotates in place."""
    check_rope_inputs("x", x, cos, sin)
    tokens, heads, dim = x.shape
    out = torch.empty_like(x) if out is None else out
    check(out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1,
           f"out is {out.dtype} {tuple(out.shape)}; expected {x.dtype} {tuple(x.shape)} with a contiguous last dim")
    _rope_kernel[(tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
                            heads, HALF=dim // 2, BLOCK_H=triton.next_power_of_2(heads))
    return out


# ----------------------------------------------------------------------------- SiLU and multiply


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I] (gate first, as in the fused gate_up projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    let_next_start(PDL)  # down_proj's GEMV may start warming L2 now
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, silu_mul(gate, up), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, rounded as torch rounds it: silu(gate) to the dtype first, then the
    product. The one definition for this kernel and the GEMV that takes gate_up as its input (gemv.py)."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _check_tensor("gate_up", gate_up)
    check(gate_up.shape[-1] % 2 == 0, f"gate_up's last dim is {gate_up.shape[-1]}; expected an even size")
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 64 if INTERPRET else 1024
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n,
                                                                 BLOCK=block, PDL=pdl_supported(gate_up.device))
    return out.view(*gate_up.shape[:-1], n)


# ----------------------------------------------------------------------------- a norm folded into its neighbours
# (the Hopper INT4 GEMVs, ``hopper/w4_gemv_norms.py``, and the decode attention kernel, ``rope_in_decode.py``)


class Norm(NamedTuple):
    """An RMSNorm the GEMV applies to its input row as it reads it (``hopper/w4_gemv_norms.py``): the norm's
    ``weight`` [K] and ``eps``; the row is the residual stream's fp32 row."""
    weight: torch.Tensor
    eps: float


class Rms(NamedTuple):
    """The 1 / rms of a norm whose GEMV left it to the kernel behind it (gate_up_proj's to down_proj, qkv_proj's to
    the decode attention kernel: ``hopper/w4_gemv_norms.py``): ``squares``, fp32, the sums of squares the
    producer's splits stored (zeros in the slots it did not use), the norm's input ``width`` and ``eps``."""
    squares: torch.Tensor
    width: int
    eps: float


def holds_squares(slots: torch.Tensor, device: torch.device, at_least: int = 1) -> bool:
    """Whether ``slots`` can hold (or give) a GEMV's sums of squares: a contiguous fp32 vector on ``device`` of at
    least ``at_least`` slots (the checks of ``w4_gemv_fused`` and ``rope_in_decode``)."""
    return (slots.dtype == torch.float32 and slots.device == device and slots.dim() == 1 and slots.is_contiguous()
            and slots.numel() >= at_least)


# ----------------------------------------------------------------------------- the step's first kernel
# The first kernel of a batch-1 decode step with the norms folded: the token's embedding row gathered into the
# residual stream's fp32 row, and the model's pending rows zeroed, in one launch.
#
# Why it exists: with the norms folded (``minillm/model/norm_folding.py``) a one-row step would otherwise start with
# the memset of the rows gate_up_proj and qkv_proj add to, the embedding's gather and layer 0's input norm, and copy
# the embedding to the fp32 stream after it for o_proj to add to. Each kernel is ~2-3 us of an INT4 llama2-7b token's ~1.57 ms on an
# H200, where each launch, not its bytes, is the cost (figures/h200/sweeps/decode_graph_deferred_norms.json's
# step_in_order). Here the memset, the gather and the copy are one kernel; layer 0's qkv_proj GEMV normalises the row
# itself, as every later layer's does, and starts its weight copies while this kernel runs (PDL, ``hopper/pdl.py``).


STEP_START_BLOCK = 2048  # elements a program of step_start zeroes (and gathers, for the programs the row spans)


@triton.jit
def _step_start_kernel(Ids, Table, Row, ToZero, stride_table, hidden, zero_numel, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    let_next_start(PDL)  # the GEMV behind waits for this kernel's writes before it reads them
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ToZero + offsets, tl.zeros([BLOCK], tl.float32), mask=offsets < zero_numel)
    token = tl.load(Ids).to(tl.int64)
    in_row = offsets < hidden
    values = tl.load(Table + token * stride_table + offsets, mask=in_row, other=0.0)
    tl.store(Row + offsets, values.to(tl.float32), mask=in_row)


def step_start_ref(token_id: torch.Tensor, table: torch.Tensor, to_zero: torch.Tensor) -> torch.Tensor:
    """The three ops this kernel replaces, in torch: zero ``to_zero``, return the embedding row [1, 1, hidden] in
    fp32."""
    to_zero.zero_()
    return torch.nn.functional.embedding(token_id.reshape(1, 1), table).float()


def step_start(token_id: torch.Tensor, table: torch.Tensor, to_zero: torch.Tensor | None) -> torch.Tensor:
    """``step_start_ref`` in one kernel: the embedding ``table``'s row [vocab, hidden] for the one ``token_id`` (an
    integer tensor of one element, on the device) as a new fp32 row [1, 1, hidden], and the fp32 buffer ``to_zero``
    (contiguous; None: nothing to zero) set to zeros. The id is not range-checked on the device (as torch's
    embedding asserts): the engine's tokenizer and sampler produce ids below the vocabulary size."""
    check(token_id.numel() == 1 and not token_id.is_floating_point(),
          f"token_id must be one integer id, got {token_id.dtype} {tuple(token_id.shape)}")
    check(table.dim() == 2 and table.stride(1) == 1, f"table must be [vocab, hidden] with contiguous rows, got "
          f"shape {tuple(table.shape)} strides {table.stride()}")
    others = (("to_zero", to_zero),) if to_zero is not None else ()
    for name, t in (("token_id", token_id), ("table", table)) + others:
        check_runnable(name, t)
        check(t.device == table.device, f"{name} is on {t.device}, the table on {table.device}")
    if to_zero is None:
        to_zero = torch.empty(0, dtype=torch.float32, device=table.device)
    check(to_zero.dtype == torch.float32 and to_zero.is_contiguous(),
          f"to_zero must be a contiguous fp32 buffer, got {to_zero.dtype} strides {to_zero.stride()}")
    hidden = table.shape[1]
    row = torch.empty(1, 1, hidden, dtype=torch.float32, device=table.device)
    grid = (triton.cdiv(max(hidden, to_zero.numel()), STEP_START_BLOCK),)
    _step_start_kernel[grid](token_id, table, row, to_zero, table.stride(0), hidden, to_zero.numel(),
                             BLOCK=STEP_START_BLOCK,
                             PDL=pdl_supported(table.device))
    return row
