"""Weight-only quantized matmul: y = x @ W with W stored as 4-bit (W4A16) or 8-bit (W8A16) integers.

Why it exists: a batch-1 decode step reads every weight once and does two FLOPs with it, so its
time is bytes / bandwidth. INT4 weights are a quarter of bf16's bytes and INT8 half, but only if the
matmul reads them packed and dequantizes in registers; unpacking to a bf16 copy first reads more
than the bf16 layer did. So the GEMV and dot kernels never write a dequantized weight; only large M
(prefill), where the matmul is compute-bound, takes the dequantize-then-cuBLAS path.

Layout (GPTQ's "v1" packing, which AutoGPTQ, AutoAWQ's GEMM format and vLLM read too):
- ``qweight`` int32 [K // 8, N]: input index k = 8i + j lives in bits 4j..4j+3 of row i;
- ``scales`` [ceil(K / G), N] in x's dtype, ``zeros`` int32 [ceil(K / G), N // 8] packed the same
  way along N (n = 8c + j in bits 4j..4j+3 of column c), holding the true zero point 0..15;
- w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]. The last group may be short (K % G != 0);
  group_size = K (or -1) is one group per column. G must be a multiple of 8 so that the eight
  weights of a packed row share their group; then every tile row needs only one scale and zero.
W8A16: ``qweight`` int8 [K, N], ``scales`` [N]: y = (x @ q) * s (symmetric, per output channel).

Paths, chosen by M (the number of tokens):
- **GEMV** (decode, M <= GEMV_MAX_M): one program per row of x, so every tensor is 2-d and stays in
  the layout it was loaded in (no trips through shared memory). A tile of packed weights is
  unpacked nibble by nibble; each nibble plane is multiplied into an fp32 accumulator with plain
  FMAs; the group's scale is applied once per packed row, and the reduction over K once, at the end.
  (The weight stays fp32 where the reference rounds it to x's dtype: 16-bit y may differ in a bit.)
  With HFMA2=True the body works in x's 16-bit dtype two weights per instruction (``w4_pairs.py``):
  1.7 to 2.1 instructions per weight in the sm_90 SASS instead of 5.5; the autotuner has both bodies. With
  TILES=True too, that math runs on 2-d tiles with the next tile's load issued ahead (``gemv_pairs_tiles``):
  more bytes in flight a warp and fewer registers, which is what the H200's counters said the GEMV lacked
  (4.9 warps per SM waiting on loads, ``figures/h200/sweeps/ncu_kernels.json``). On Hopper the W4A16 GEMV is
  launched with PDL (``hopper/pdl.py``): its programs start while the kernel ahead finishes and ask L2 for their first
  packed rows before they wait for x. On an H100/H200 one row of bf16 x takes a Gluon GEMV instead
  (``hopper/w4_gemv.py``: TMA copies of every tile issued up front, 1.1-1.4x this one; ``hopper=False`` keeps this).
  At M = 1 a tensor-core dot would be 1/16 useful work plus a shared-memory round trip. The M
  programs of a column tile are neighbours in the grid, so rows after the first find its weights
  in L2; but each dequantizes them again, which is why larger M goes to the dot.
- **dot** (M > GEMV_MAX_M): the tile of BLOCK_K // 8 packed rows is shifted by 0, 4, .., 28 bits
  into a [BLOCK_K // 8, 8, BLOCK_N] block, whose row-major order is k's; it is dequantized to x's
  dtype, reshaped to [BLOCK_K, BLOCK_N] and fed to one ``tl.dot`` with x's contiguous
  [BLOCK_M, BLOCK_K] tile (eight dots of K = BLOCK_K / 8 a tile, one per nibble plane with x read at stride 8,
  would be several times slower than bf16). With SWAP_AB
  the kernel computes y^T = W^T x^T: on Hopper a warpgroup MMA takes its second operand from shared
  memory only, but its first may come from registers, and it wants 64 rows there; swapped, those
  are BLOCK_N weight columns instead of BLOCK_M tokens. With PAIRS=True (16-bit x) the tile is
  dequantized in x's dtype two weights per instruction (``w4_pairs.py``). The autotuner's list has
  the SWAP_AB / PAIRS configs that won an H200 sweep (_W4_DOT).
- **dequant** (W4A16 only, M >= DEQUANT_MIN_M, prefill): one kernel (``int4_dequantize.py``) writes
  the weight in x's dtype to a temporary, then ``torch.matmul`` (cuBLAS). Once M is large the GEMM
  is compute-bound, and cuBLAS's tensor-core pipeline beats a Triton dot whose B operand is
  rebuilt in registers per tile. Decode graphs of DEQUANT_MIN_M rows or more take this path too; their temporary lives in the
  graph's memory pool: one weight in x's dtype (180 MB for llama2-7b's fused gate/up).

The GEMV and the dot are memory-bound at small M, where N / BLOCK_N programs alone would leave
most of an H200's SMs idle: the K dimension is also split over SPLIT_K programs, whose partials the
last one to finish sums (``split_k.py``).

Integer to float without the converter: an int->float conversion issues at 1/8 of the FMA rate, so
the fp32 bodies read a nibble q as the float 1 + q / 16 (``int_float.py``) and the 16-bit
variants as pairs of 16-bit floats (``w4_pairs.py``); an int8 v becomes a
float by an integer add and a float subtract (``int_float.int8_to_float``).

On CUDA the tile sizes and SPLIT_K are autotuned (the lists: ``quant_matmul_configs.py``) per (N, K, bucket
of M) for the dot and per (N, K, M, group size) for the GEMV; under Triton's CPU interpreter one small pinned
config runs (with SPLIT_K = 2, so the fix-up path is what is tested). The GEMV's autotuner may pick the HFMA2 body for 16-bit x: its
error is up to twice the fp32 body's (16-bit sums over short runs; ``w4_pairs.py``), well inside
what 4-bit weights cost, and it needs |x| < 2**27 in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check, check_operand, check_runnable, interpreter_on
from .int4_dequantize import check_int4_layout, w4a16_dequantize
from .int_float import int8_to_float
# The autotuner's lists and the pinned configs (data from H200 sweeps) live in a file of their own.
from .quant_matmul_configs import (_GPU_FP32_DOT, _INTERPRETER, _W4_DOT, _W4_GEMV, _W8_DOT, _W8_GEMV,
                                                  SPLIT_MAX_M, fit_dot_tiles, fit_gemv_variants, hfma2_runs_fit)
from .hopper.pdl import prefetch_pieces, prefetch_to_l2, supported as pdl_supported, wait_for_previous
from .split_k import MAX_TILES, finish, split_range, tile_counters
from .hopper import w4_gemv as w4_gemv_hopper
from .w4_pairs import dequant_tile_pairs
from .w4_pairs import gemv_pairs, gemv_pairs_tiles
from .int_float import ONE_BITS, dequant_tile, int4_tile, nibble
# The layout's helpers live in a Triton-free file; re-exported so that one import serves.
from .quant_pack import (dequantize_int4, pack_int4, pack_int4_along_n,  # noqa: F401
                                        unpack_int4, unpack_int4_along_n)

INTERPRET = interpreter_on()
# M up to this takes the GEMV. Its programs each dequantize their tile for one row, so from M = 2
# on the dot (one dequantization per tile, tensor cores for the rows) does less work.
GEMV_MAX_M = 1
# From this M on, W4A16 dequantizes the weight into a temporary and hands the GEMM to cuBLAS: on an
# H200, writing and re-reading a bf16 copy costs less there than the dot's in-loop dequantization
# (from M = 128 the two are level, at M = 2048 the dot takes 2 to 3 times as long).
DEQUANT_MIN_M = 128


# ----------------------------------------------------------------------------- references (torch)


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """What ``w4a16_matmul`` computes: the weight dequantized to x's dtype (as a dense layer would hold
    it), then x @ w with fp32 accumulation, rounded to x's dtype. x [..., K] -> [..., N]."""
    w = dequantize_int4(qweight, scales, zeros, group_size, x.dtype)
    return (x.float() @ w.float()).to(x.dtype)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``w8a16_matmul`` computes: (x @ q) * s in fp32, rounded to x's dtype. x [..., K] -> [..., N]."""
    return ((x.float() @ qweight.float()) * scales.float()).to(x.dtype)


# ----------------------------------------------------------------------------- W4A16 kernels


@triton.jit
def _w4_gemv_kernel(X, Y, Partials, Counters, M, N, K, stride_xm, stride_ym,
                    QW, S, Z, group_size, one_bits, stride_q, stride_s, stride_z,
                    BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr, SPLIT_K: tl.constexpr,
                    PREFETCH: tl.constexpr = False, HFMA2: tl.constexpr = False, RUN: tl.constexpr = 2,
                    ONE_GROUP: tl.constexpr = False, EVEN_N: tl.constexpr = False, TILES: tl.constexpr = False,
                    GROUP_TILES: tl.constexpr = 0, PDL: tl.constexpr = False, PREFETCH_ROWS: tl.constexpr = 0):
    """Program (row m and column tile, split): one row of x, BLOCK_N columns, a split of the K // 8 packed rows.
    PREFETCH: the next tile's weight loads are issued in this tile's iteration, masked off past the
    end (Triton's pipeliner leaves this loop's loads alone: plain LDGs in the sm_90 SASS, each
    tile waiting out its own memory latency). HFMA2: the body is ``w4_pairs.gemv_pairs``, two
    weights per instruction in x's 16-bit dtype, summed in 16 bits over runs of RUN packed rows
    (ONE_GROUP, EVEN_N: see there). TILES (with HFMA2): the same math on 2-d tiles,
    the next tile loaded ahead (``gemv_pairs_tiles``). The autotuner's list holds the configs of each that won an
    H200 sweep. PDL: launched early (``hopper/pdl.py``), the program asks L2 for its first PREFETCH_ROWS packed rows,
    then waits for the kernel ahead (which writes x) before it reads anything else."""
    m = tl.program_id(0) % M  # the M programs of a column tile run side by side and share its weights in L2
    n = tl.program_id(0) // M * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = split_range(K // 8, BLOCK_KP, SPLIT_K)
    if PDL:
        if PREFETCH_ROWS > 0:  # one address per 128-byte line (32 columns) of each row, clamped to the weight
            lines = tl.minimum(tl.program_id(0) // M * BLOCK_N + tl.arange(0, triton.cdiv(BLOCK_N, 32)) * 32, N - 1)
            rows = tl.minimum(start + tl.arange(0, PREFETCH_ROWS), tl.maximum(end - 1, 0))
            prefetch_to_l2(QW + rows[:, None] * stride_q + lines[None, :])
        wait_for_previous(PDL)
    if TILES:
        y = gemv_pairs_tiles(X + m * stride_xm, QW, S, Z, start, end, n, N, stride_q, stride_s, stride_z,
                             BLOCK_N, BLOCK_KP, GROUP_TILES, EVEN_N)
    elif HFMA2:
        y = gemv_pairs(X + m * stride_xm, QW, S, Z, start, end, n, N, group_size, stride_q, stride_s, stride_z,
                       BLOCK_N, BLOCK_KP, RUN, ONE_GROUP, EVEN_N)
    else:
        acc = tl.zeros((BLOCK_KP, BLOCK_N), tl.float32)
        if PREFETCH:
            r_next, packed_next, scale_next, zero_next = int4_tile(QW, S, Z, start, end, n, N, group_size, one_bits,
                                                                   stride_q, stride_s, stride_z, BLOCK_KP)
        for r0 in range(start, end, BLOCK_KP):
            if PREFETCH:
                r, packed, scale, zero = r_next, packed_next, scale_next, zero_next
                r_next, packed_next, scale_next, zero_next = int4_tile(QW, S, Z, r0 + BLOCK_KP, end, n, N,
                                                                       group_size, one_bits, stride_q, stride_s,
                                                                       stride_z, BLOCK_KP)
            else:
                r, packed, scale, zero = int4_tile(QW, S, Z, r0, end, n, N, group_size, one_bits,
                                                   stride_q, stride_s, stride_z, BLOCK_KP)
            part = tl.zeros((BLOCK_KP, BLOCK_N), tl.float32)
            x_sum = tl.zeros((BLOCK_KP,), tl.float32)
            for j in tl.static_range(8):  # nibble j of row r is input k = 8r + j
                x = tl.load(X + m * stride_xm + 8 * r + j, mask=r < end, other=0.0).to(tl.float32)
                x_sum += x
                part += x[:, None] * nibble(packed, j, one_bits)  # sum_j x_j (1 + q_j / 16): one FMA per weight
            # sum_j x_j (q_j - z) = 16 (part - (1 + z / 16) sum_j x_j); the 16 waits for the end.
            acc += scale * (part - zero * x_sum[:, None])
        y = 16.0 * tl.sum(acc, axis=0)
    finish(y[None, :], Y, Partials, Counters, m + tl.arange(0, 1), n, (n < N)[None, :],
           M, N, stride_ym, tl.program_id(0), SPLIT_K)


@triton.jit
def _w4_dot_kernel(X, Y, Partials, Counters, M, N, K, stride_xm, stride_ym,
                   QW, S, Z, group_size, one_bits, stride_q, stride_s, stride_z, M_BUCKET,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   ONE_GROUP: tl.constexpr, SWAP_AB: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """Program (column tile, split, row tile): y[m, n] over a split of K, BLOCK_K inputs per dot.
    M_BUCKET is only the autotuner's key; ONE_GROUP: every tile lies inside one group; SWAP_AB:
    compute y^T = W^T x^T (see the module docstring); PAIRS: dequantize in x's 16-bit dtype, two
    weights per instruction (``w4_pairs.py``)."""
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    start, end = split_range(K, BLOCK_K, SPLIT_K)  # whole tiles of BLOCK_K inputs, so tiles start group-aligned
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(start, end, BLOCK_K):
        r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask = (r < end // 8)[:, None] & (n < N)[None, :]
        packed = tl.load(QW + r[:, None] * stride_q + n[None, :], mask=mask, other=0)
        if PAIRS:
            g = (k0 // group_size + tl.zeros((1,), tl.int32)) if ONE_GROUP else (8 * r) // group_size
            g_mask = (n < N)[None, :] if ONE_GROUP else mask
            scale = tl.load(S + g[:, None] * stride_s + n[None, :], mask=g_mask, other=0.0)
            zero = (tl.load(Z + g[:, None] * stride_z + (n // 8)[None, :], mask=g_mask, other=0) >> ((n % 8) * 4)) & 15
            w = dequant_tile_pairs(packed, scale, zero, X.dtype.element_ty, BLOCK_K, BLOCK_N)
        else:
            w = dequant_tile(packed, r, mask, n, N, S, Z, k0, group_size, one_bits, stride_s, stride_z, ONE_GROUP,
                             X.dtype.element_ty, BLOCK_K, BLOCK_N)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < end)[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(tl.trans(w), tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc, input_precision="ieee")  # "ieee": fp32 x gets fp32 products, not TF32
    if SWAP_AB:
        acc = tl.trans(acc)
    finish(acc, Y, Partials, Counters, m.to(tl.int64), n, (m < M)[:, None] & (n < N)[None, :], M, N, stride_ym,
            tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), SPLIT_K)


# ----------------------------------------------------------------------------- W8A16 kernels


@triton.jit
def _w8_gemv_kernel(X, Y, Partials, Counters, M, N, K, stride_xm, stride_ym, QW, S, stride_q,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    m = tl.program_id(0) % M
    n = tl.program_id(0) // M * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = split_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(QW + k[:, None] * stride_q + n[None, :], mask=(k < end)[:, None] & (n < N)[None, :], other=0)
        x = tl.load(X + m * stride_xm + k, mask=k < end, other=0.0).to(tl.float32)
        acc += x[:, None] * int8_to_float(q)
    scale = tl.load(S + n, mask=n < N, other=0.0).to(tl.float32)
    finish((tl.sum(acc, axis=0) * scale)[None, :], Y, Partials, Counters, m + tl.arange(0, 1), n,
            (n < N)[None, :], M, N, stride_ym, tl.program_id(0), SPLIT_K)


@triton.jit
def _w8_dot_kernel(X, Y, Partials, Counters, M, N, K, stride_xm, stride_ym, QW, S, stride_q, M_BUCKET,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = X + m.to(tl.int64)[:, None] * stride_xm
    start, end = split_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(QW + k[:, None] * stride_q + n[None, :], mask=(k < end)[:, None] & (n < N)[None, :], other=0)
        x = tl.load(x_rows + k[None, :], mask=(m < M)[:, None] & (k < end)[None, :], other=0.0)
        # |q| <= 128 is exact in every float dtype: the per-channel scale waits for the end.
        acc = tl.dot(x, int8_to_float(q).to(X.dtype.element_ty), acc, input_precision="ieee")
    scale = tl.load(S + n, mask=n < N, other=0.0).to(tl.float32)
    finish(acc * scale[None, :], Y, Partials, Counters, m.to(tl.int64), n, (m < M)[:, None] & (n < N)[None, :],
            M, N, stride_ym, tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), SPLIT_K)


# ----------------------------------------------------------------------------- launching

# A tile of BLOCK_K inputs starts at a multiple of BLOCK_K, so it lies inside one group when the group
# size is a multiple of BLOCK_K (or the whole column): then it loads one scale and zero per column.
_w4_dot = triton.heuristics({"ONE_GROUP": lambda a: a["group_size"] % a["BLOCK_K"] == 0 or a["group_size"] >= a["K"]})(
    _w4_dot_kernel)


# HFMA2 only: a tile of BLOCK_KP packed rows inside one group loads one scale and zero; N % BLOCK_N == 0, no mask.
def _group_tiles(a: dict) -> int:
    """TILES: tiles per group, or 0 for one group over all of K. A config whose tiles do not divide the group is
    refused here too, not only by ``w4a16_matmul`` and the autotuner's pruning: the kernel would sum across groups."""
    if a["group_size"] >= a["K"]:
        return 0
    if a.get("TILES") and a["group_size"] % (8 * a["BLOCK_KP"]):
        raise ValueError(f"TILES with BLOCK_KP = {a['BLOCK_KP']} needs group_size / 8 = {a['group_size'] // 8} to be a "
                         "multiple of it")
    return a["group_size"] // (8 * a["BLOCK_KP"])


_w4_gemv = triton.heuristics({
    "ONE_GROUP": lambda a: a["group_size"] % (8 * a["BLOCK_KP"]) == 0 or a["group_size"] >= a["K"],
    "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
    "GROUP_TILES": _group_tiles,
    # PDL: packed rows per program to warm L2 with, pdl.PREFETCH_BYTES over the grid (at most a split's rows)
    "PREFETCH_ROWS": lambda a: prefetch_pieces(a["M"] * triton.cdiv(a["N"], a["BLOCK_N"]) * a["SPLIT_K"],
                                               4 * a["BLOCK_N"], triton.cdiv(a["K"] // 8, a["SPLIT_K"]))
    if a.get("PDL") else 0})(_w4_gemv_kernel)


_KERNELS = {  # name -> (the kernel, the kernel autotuned on CUDA)
    "w4_gemv": (_w4_gemv, triton.autotune(_W4_GEMV, key=["N", "K", "M", "group_size"],
                                          prune_configs_by={"early_config_prune": fit_gemv_variants})(_w4_gemv)),
    "w4_dot": (_w4_dot, triton.autotune(_W4_DOT, key=["N", "K", "M_BUCKET"],
                                        prune_configs_by={"early_config_prune": fit_dot_tiles})(_w4_dot)),
    "w8_gemv": (_w8_gemv_kernel, triton.autotune(_W8_GEMV, key=["N", "K", "M"])(_w8_gemv_kernel)),
    "w8_dot": (_w8_dot_kernel, triton.autotune(_W8_DOT, key=["N", "K", "M_BUCKET"],
                                               prune_configs_by={"early_config_prune": fit_dot_tiles})(_w8_dot_kernel)),
}
# The partials an autotuned launch may need: its kernel's largest split.
_MAX_SPLIT_K = {name: max(c.kwargs["SPLIT_K"] for c in configs)
                for name, configs in (("w4_gemv", _W4_GEMV), ("w4_dot", _W4_DOT), ("w8_gemv", _W8_GEMV),
                                      ("w8_dot", _W8_DOT))}


def _launch(fmt: str, x_in: torch.Tensor, k: int, n: int, weights: tuple, path: str | None, config: dict | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> y [..., N] through format ``fmt``'s GEMV or dot kernel; ``weights`` are the
    kernel's arguments after the strides of x and y."""
    x = x_in.reshape(-1, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = x.shape[0]
    path = path or ("gemv" if rows <= GEMV_MAX_M else "dot")
    check(path in ("gemv", "dot"), f"path is {path!r}; expected 'gemv', 'dot' or None (chosen by M)")
    name = f"{fmt}_{path}"
    # The autotuner may pick HFMA2 for a 16-bit x (fit_gemv_variants).
    hfma2 = config.get("HFMA2") if config else (name == "w4_gemv" and not INTERPRET and x.dtype != torch.float32)
    if hfma2 and (x.data_ptr() % 4 or x.stride(0) % 2):
        x = x.clone(memory_format=torch.contiguous_format)  # HFMA2 reads x two inputs per int32
    out = _output(x_in, n, out)
    y = out.view(rows, n)
    if rows == 0 or n == 0:
        return y
    if config is None and INTERPRET:
        config = _INTERPRETER[name]
    elif config is None and x.dtype == torch.float32 and path == "dot":
        config = _GPU_FP32_DOT[name]
    # Autotuned split-K configs exist only for M <= SPLIT_MAX_M (see the pruning): no partials beyond.
    splits = config["SPLIT_K"] if config else (_MAX_SPLIT_K[name] if rows <= SPLIT_MAX_M else 1)
    partials = torch.empty(splits * rows * n if splits > 1 else 1, dtype=torch.float32, device=x.device)
    check(splits == 1 or triton.cdiv(n, 32) * triton.cdiv(rows, 16) <= MAX_TILES,
          f"a split-K launch with N = {n}, M = {rows} needs more than {MAX_TILES} tile counters")
    args = (x, y, partials, tile_counters(x.device), rows, n, x.shape[1], x.stride(0), y.stride(0), *weights)
    if path == "gemv":
        # W4A16's GEMV starts early on Hopper (hopper/pdl.py): it is what the decode step of an INT4 model mostly runs.
        early = fmt == "w4" and pdl_supported(x.device)
        consts = {"PDL": True, "launch_pdl": True} if early else {"PDL": False} if fmt == "w4" else {}
        grid = lambda meta: (rows * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    else:
        # The autotuner's key: tile choices are made per power-of-two bucket of M, not per M, so a
        # prefill of any new length does not start a new round of timing.
        consts = {"M_BUCKET": min(256, triton.next_power_of_2(max(16, rows)))}
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"],  # noqa: E731
                             triton.cdiv(rows, meta["BLOCK_M"]))
    plain, tuned = _KERNELS[name]
    if config is None:
        tuned[grid](*args, **consts)
    else:
        plain[grid(config)](*args, **consts, **config)
    return out


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked to be a contiguous [..., N] of x's dtype on x's device, or a new one."""
    shape = (*x.shape[:-1], n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    check(out.shape == shape and out.dtype == x.dtype and out.device == x.device and out.is_contiguous(),
          f"out is {out.dtype} {tuple(out.shape)} on {out.device}; expected a contiguous {x.dtype} {shape} on {x.device}")
    return out


def autotuned_config(fmt: str, path: str) -> str | None:
    """The config the autotuner chose at the last autotuned call of ``fmt`` ("w4", "w8") on ``path``, for benchmarks."""
    chosen = getattr(_KERNELS[f"{fmt}_{path}"][1], "best_config", None)
    return None if chosen is None else str(chosen)


def _check_x(x: torch.Tensor, k: int) -> None:
    check(x.dtype in FLOAT_DTYPES, f"x.dtype is {x.dtype}; expected one of {FLOAT_DTYPES}")
    check_runnable("x", x)
    check(x.dim() >= 1 and x.shape[-1] == k, f"x has shape {tuple(x.shape)}; its last dim must be K = {k}")


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, path: str | None = None, config: dict | None = None,
                 out: torch.Tensor | None = None, hopper: bool | None = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16, or fp32) @ the INT4 weight (layout in the module docstring) -> [..., N].

    ``path`` forces "gemv", "dot" or "dequant" (default: GEMV for M <= GEMV_MAX_M, the dequantized
    weight and cuBLAS from DEQUANT_MIN_M, the dot between); ``config`` pins a launch
    configuration instead of autotuning, e.g. {"BLOCK_N": 64, "BLOCK_KP": 16, "SPLIT_K": 4,
    "num_warps": 4} for the GEMV (BLOCK_KP: packed rows per tile, 8 inputs each), or BLOCK_M,
    BLOCK_N, BLOCK_K (inputs per tile) and SPLIT_K for the dot (all powers of two, at least 16), and
    optionally SWAP_AB=True (the dot computes y^T = W^T x^T; see the module docstring) and PAIRS=True
    (16-bit x: the tile dequantized two weights per instruction, ``w4_pairs.py``); for the GEMV,
    HFMA2=True with RUN = 1, 2 (default) or 4 (16-bit math; ``w4_pairs.py``), HFMA2=True with TILES=True
    (the same math on 2-d tiles; BLOCK_KP must divide group_size / 8), or PREFETCH=True.
    ``out`` [..., N], contiguous, receives y if given. ``hopper``: one row of bf16 x on an H100/H200 takes the
    Gluon GEMV (``hopper/w4_gemv.py``) unless a ``config`` is pinned; False keeps the Triton GEMV, True demands the
    Gluon one (a ValueError says why where it cannot run).
    """
    check(qweight.dim() == 2, f"qweight must be int32 [K // 8, N], got shape {tuple(qweight.shape)}")
    _check_x(x, 8 * qweight.shape[0])
    k, n, group = check_int4_layout(qweight, scales, zeros, group_size, x)
    if path in (None, "gemv") and (x.numel() == k or hopper):
        x_row = x.reshape(-1, k)
        if w4_gemv_hopper.use_hopper(x_row, qweight, scales, zeros, group, hopper, config):
            out = _output(x, n, out)
            w4_gemv_hopper.gemv(x_row, qweight, scales, zeros, group, out.view(1, n))
            return out
    elif hopper:
        raise ValueError(f"hopper=True runs the Gluon W4A16 GEMV, but path is {path!r}")
    if path == "dequant" or (path is None and x.numel() // k >= DEQUANT_MIN_M):
        check(config is None, f"config {config} was given, but the dequant path runs fixed tiles and cuBLAS")
        out = _output(x, n, out)
        return torch.matmul(x, w4a16_dequantize(qweight, scales, zeros, group, x.dtype), out=out)
    if config and config.get("HFMA2"):
        run, rows = config.get("RUN", 2), x.numel() // k
        check(path == "gemv" or (path is None and rows <= GEMV_MAX_M),
              f"config {config} asks for HFMA2, a GEMV variant, but path {path!r} at M = {rows} is not the GEMV")
        check(x.dtype != torch.float32, "HFMA2 computes in x's 16-bit dtype; x is float32")
        check(hfma2_runs_fit(config, group, k),
              f"with TILES, BLOCK_KP = {config['BLOCK_KP']} must divide group_size / 8 = {group // 8}"
              if config.get("TILES") else
              f"RUN = {run} must be 1, 2 or 4 (longer 16-bit runs lose accuracy) and divide BLOCK_KP and group_size / 8")
    check(not config or not config.get("TILES") or config.get("HFMA2"),
          f"config {config} asks for TILES, a layout of the HFMA2 body: it needs HFMA2=True too")
    if config and config.get("PAIRS"):
        rows = x.numel() // k
        check(path == "dot" or (path is None and GEMV_MAX_M < rows),
              f"config {config} asks for PAIRS, a dot variant, but path {path!r} at M = {rows} is not the dot")
        check(x.dtype != torch.float32, "PAIRS dequantizes in x's 16-bit dtype; x is float32")
    weights = (qweight, scales, zeros, group, ONE_BITS, qweight.stride(0), scales.stride(0), zeros.stride(0))
    return _launch("w4", x, k, n, weights, path, config, out)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, path: str | None = None,
                 config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (int8 qweight [K, N] * scales [N]) -> [..., N]; ``path``, ``config`` and ``out`` as
    in ``w4a16_matmul`` (BLOCK_K in place of BLOCK_KP: rows of qweight per tile)."""
    check(qweight.dim() == 2, f"qweight must be int8 [K, N], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape
    _check_x(x, k)
    check_operand("qweight", qweight, torch.int8, (k, n), x)
    check_operand("scales", scales, x.dtype, (n,), x)
    return _launch("w8", x, k, n, (qweight, scales, qweight.stride(0)), path, config, out)
