"""The residual add and RMSNorm between two batch-1 INT4 GEMVs, folded into them: the GEMV ahead adds its output to
the residual stream, the GEMV behind normalises its input.

Why: a batch-1 INT4 Llama-2-7B layer runs two RMSNorm kernels (each with the residual add before it) between its
GEMVs. They do almost no work, but each is a kernel boundary on the token's critical path: 0.23 ms of a 2.30 ms
token (figures/h200/sweeps/latency_what_if.json), where bf16's longer GEMVs hide them (0.04 ms). A norm needs two
things of the row: the sum of the squares of all of it, and each input's own value. So (``w4_gemv.py`` runs
both):

- **The GEMV ahead** (o_proj, down_proj) adds y to the residual stream, kept in fp32 for the step, where each
  program holds its split's part of y: a reduction in L2 (``red.global.add.f32``), no fix-up. The split-K fix-up
  this replaces (store the partial, a fenced atomic, the last program's loads of every partial) cost ~1.9 us a
  GEMV in the decode graph: without it in o_proj and down_proj, 1.668 against 1.785 ms a token
  (figures/h200/sweeps/decode_graph_red_probe.json). The price: the order in which the splits' parts arrive varies,
  so the stream's last bits, and rarely a token, may differ from one run to the next.
- **The GEMV behind** (gate_up_proj, the next layer's qkv_proj) takes the stream's row s, multiplies each input of
  its slice of K by the norm's weight as it builds its x tables (``weighted_word``), and sums the squares of those
  inputs of s. A norm is one factor for the whole row, so it comes after the product:
  RMSNorm(s) @ W = (s * weight) @ W / rms(s). The split-K fix-up sums the splits' squares with their partials and
  scales y by 1 / rms (``inv_rms``). No program reads the whole row, and none waits for another beyond what the
  fix-up already does (a GEMV whose every program read the whole row for its RMS would be slower than the norm
  kernel it replaces: figures/h200/sweeps/normed_gemv.json).

gate_up_proj and qkv_proj go one step further (``fused_gemv(norm=..., residual=..., squares=...)``,
``norm_folding.PendingNorm``): their splits add their unnormalised parts of y to a zeroed fp32 row with reductions
too, and store their sums of squares beside it; the kernel that reads that row whole anyway applies 1 / rms as it
loads it: down_proj's GEMV before SiLU-and-multiply (``Rms``, ``scaled_bf16``), the decode attention kernel before
RoPE (``../rope_in_decode.py``). So no GEMV of the layer has a fix-up: 1.072x a token
(figures/h200/sweeps/decode_graph_deferred_norms.json).

Numerics: the stream holds s in fp32 where the unfolded layer (and transformers) round it to bf16 at every add;
the input is s * weight rounded to bf16 once, where transformers rounds s / rms, then the product with the weight.
So the folded layer is not bit for bit the unfolded one: its errors are of the size of one bf16 rounding (tested
against the norm computed in fp64 in tests/kernels/test_hopper_w4_gemv_norms.py).
"""

from __future__ import annotations

from .gluon import GLUON_USABLE, gluon


if GLUON_USABLE:
    from triton.experimental.gluon import language as gl

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
    def weighted_word(S, NormW, word, ok):
        """(word ``word`` of the product's input: inputs 2 word and 2 word + 1 of the fp32 row S times the norm's
        weight, whose int32 words are at NormW, each rounded to bf16; the sum of their squares in S), zeros where not
        ok."""
        low, high = gl.load(S + 2 * word, mask=ok, other=0.0), gl.load(S + 2 * word + 1, mask=ok, other=0.0)
        weight = gl.load(NormW + word, mask=ok, other=0)
        scaled = bf16_words((low * low_bf16(weight).to(gl.float32)).to(gl.bfloat16),
                            (high * high_bf16(weight).to(gl.float32)).to(gl.bfloat16))
        return scaled, low * low + high * high

    @gluon.jit
    def scaled_bf16(Row, index, ok, inv):
        """Row[index] (fp32) times ``inv``, rounded to bf16 (zeros where not ok): an input of a row whose norm's
        1 / rms its producer left to this GEMV."""
        return (gl.load(Row + index, mask=ok, other=0.0) * inv).to(gl.bfloat16)

    @gluon.jit
    def stored_inv_rms(Squares, slots, SLOTS: gl.constexpr, width, eps, WARPS_: gl.constexpr):
        """1 / rms of a row of ``width`` inputs from the ``slots`` sums of squares at Squares (SLOTS: a power of two
        at least as large), summed in one fixed order."""
        lanes = gl.arange(0, SLOTS, layout=gl.BlockedLayout([1], [32], [WARPS_], [0]))
        return inv_rms(gl.sum(gl.load(Squares + lanes, mask=lanes < slots, other=0.0), axis=0), width, eps)

    @gluon.jit
    def inv_rms(squares, K, eps):
        """1 / sqrt(mean(s**2) + eps) of a row of K inputs whose squares sum to ``squares``, as the norm kernel forms
        it."""
        return 1.0 / gl.sqrt(squares / K + eps)
