"""The residual add and RMSNorm between two batch-1 INT4 GEMVs, folded into them: the GEMV ahead adds the residual,
the GEMV behind normalises its input as it reads it.

Why: a batch-1 INT4 Llama-2-7B layer runs two RMSNorm kernels (each with the residual add before it) between its
GEMVs. They do almost no work, but each is a kernel boundary on the token's critical path: 0.23 ms of a 2.30 ms
token (figures/h200/sweeps/latency_what_if.json), where bf16's longer GEMVs hide them (0.04 ms). A norm needs two
things of the row: the sum of the squares of all of it, and each input's own value. The first is a sum over the
producing GEMV's column tiles; the second is local to each program of the consuming GEMV, which reads only its own
slice of K. So (``w4_gemv_hopper.py`` runs both):

- **The GEMV ahead** (o_proj, down_proj) adds the residual where it writes y: the program that writes columns
  n0 .. n0 + 255 (the split-K fix-up's last arrival) writes s = residual + y there instead, rounded as the norm
  kernel rounds it (y to bf16, then the sum), and the sum of s**2 over those 256 columns, one fp32 a column tile
  (``store_added``).
- **The GEMV behind** (gate_up_proj, the next layer's qkv_proj) reads those partial sums (16 floats at a width of
  4096), forms 1 / rms (``inv_rms``), and normalises only the inputs of its own slice as it builds its x tables,
  with the norm's weight, rounded in transformers' order as ``fused_layer_ops.rms_norm`` does (``normed_words``).

No program reads the whole row, and none waits for another beyond what the fix-up already does. (Session 20's
normed GEMV had every program read the whole row for its RMS: 2.4 us a GEMV against the norm kernel's 1.4,
figures/h200/sweeps/normed_gemv.json.)

Numerics: s is bit for bit the norm kernel's residual sum. Its squares are summed in another order (per 256-column
tile, then the tiles in order) than the norm kernel's, so 1 / rms may differ from its in the last bits, and with it,
rarely, the rounding of a normalised input.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.kernels.flash_attention_hopper import GLUON_USABLE, gluon

SUMSQ_COLUMNS = 256  # columns a partial sum of squares covers: the GEMV's column tile (w4_gemv_hopper.BLOCK_N)


class Norm(NamedTuple):
    """An RMSNorm the GEMV applies to its input row as it reads it (this module): the norm's ``weight`` [K],
    the row's sums of squares per 256 columns (fp32, ``sumsq``: what a GEMV given a residual wrote), and ``eps``."""
    weight: torch.Tensor
    sumsq: torch.Tensor
    eps: float


if GLUON_USABLE:
    from triton.experimental.gluon import language as gl

    _SUMSQ_COLUMNS = gl.constexpr(SUMSQ_COLUMNS)

    @gluon.jit
    def low_bf16(w):
        """The bf16 in each int32's low 16 bits."""
        return (w << 16).to(gl.float32, bitcast=True).to(gl.bfloat16)

    @gluon.jit
    def high_bf16(w):
        """The bf16 in each int32's high 16 bits."""
        return (w & -65536).to(gl.float32, bitcast=True).to(gl.bfloat16)

    @gluon.jit
    def bf16_words(low, high):
        """bf16 tensors low and high as int32 words, low in the low 16 bits (a bf16 is an fp32's high 16 bits)."""
        low_bits = low.to(gl.float32).to(gl.int32, bitcast=True)
        high_bits = high.to(gl.float32).to(gl.int32, bitcast=True)
        return ((low_bits >> 16) & 0xFFFF) | (high_bits & -65536)

    @gluon.jit
    def inv_rms(SumSq, K, eps, SUMSQ_TILES: gl.constexpr, WARPS_: gl.constexpr):
        """1 / sqrt(mean(s**2) + eps) of a row of K inputs whose sums of squares per 256 columns are at SumSq
        (cdiv(K, 256) of them, SUMSQ_TILES a power of two at least that), as the norm kernel forms it. Every thread
        loads and sums them all itself: the same value everywhere, in a fixed order, without a barrier."""
        layout: gl.constexpr = gl.BlockedLayout([SUMSQ_TILES], [32], [WARPS_], [0])
        i = gl.arange(0, SUMSQ_TILES, layout=layout)
        total = gl.sum(gl.load(SumSq + i, mask=i < gl.cdiv(K, _SUMSQ_COLUMNS), other=0.0), axis=0)
        return 1.0 / gl.sqrt(total / K + eps)

    @gluon.jit
    def _normed(s, weight, inv):
        """One bf16 input of the norm: s / rms rounded to bf16, times the weight, rounded again (transformers)."""
        return ((s.to(gl.float32) * inv).to(gl.bfloat16).to(gl.float32) * weight.to(gl.float32)).to(gl.bfloat16)

    @gluon.jit
    def normed_words(words, weight_words, inv):
        """int32 words of the row s (two bf16 each) normalised with the norm's weight (its words alike) and 1 / rms."""
        return bf16_words(_normed(low_bf16(words), low_bf16(weight_words), inv),
                          _normed(high_bf16(words), high_bf16(weight_words), inv))

    @gluon.jit
    def store_added(y, residual, Y, SumSq, n, N, tile_n):
        """s = residual + y at columns n (one column tile, the residual's loaded; fp32 y rounded to bf16 first, as the
        unfused GEMV stores it, then added as the norm kernel adds) into Y, and sum(s**2) over them into
        SumSq[tile_n]."""
        ok = n < N
        s = (y.to(gl.bfloat16).to(gl.float32) + residual.to(gl.float32)).to(gl.bfloat16)
        gl.store(Y + n, s, mask=ok)
        squares = gl.where(ok, s.to(gl.float32), 0.0)
        gl.store(SumSq + tile_n, gl.sum(squares * squares, axis=0))
