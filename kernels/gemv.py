"""Dense GEMV: y = x @ W^T for one row of x and an ``nn.Linear`` weight W [N, K], in Triton.

Why it exists: at batch-1 decode every linear is a GEMV, and its time is the weight's bytes over the
bandwidth the kernel keeps in flight. cuBLAS picks tiles 64 outputs wide for these shapes, which
leaves SMs idle where N is small: with tensor parallelism over two GPUs, Llama-2-7B's o_proj
(N = 4096, K = 2048) is 64 tiles on 132 SMs, and its qkv_proj (N = 6144) 96; the H200 profile of
TP=2 decode shows those GEMVs at ~3.0 TB/s where the whole-model ones run at 3.6-4.0
(``figures/h200/latency_tp_fused.json``). This kernel splits both N and K so that every shape gets a
few hundred programs, each streaming contiguous runs of its weight rows; the last program of a
column tile sums the K-splits' partials (``split_k.py``). ``minillm/model/dense.py`` sends the model's
one-row products here on every GPU.

The tiles are a fixed function of the shape (``default_config``), not a timing: the tiles set the
summation order, so a config picked by an autotuner could round differently from one run, or one
rank's new worker process, to the next, and flip near-tied greedy tokens. The rule keeps the H200
sweep's winner, or a config within 3 % of it, for each of Llama-2-7B's projections, whole and halved.

The MLP's SiLU-and-multiply rides along (``gated=True``): down_proj's input is silu(gate) * up of the
gate_up row, and each program computes its slice of it from gate_up as it loads x, with the very
arithmetic of ``fused_layer_ops.silu_and_mul`` (``silu_mul``), so a batch-1 layer launches one kernel
fewer for the same bits. Every program recomputes its K-split's slice: a few thousand exponentials, nothing
next to the weight's bytes.

One program: BLOCK_N rows of W and one K-split; it loads [BLOCK_N, BLOCK_K] tiles (each row's
BLOCK_K inputs are contiguous: 16-byte loads), multiplies by x's tile in fp32 and sums over K once,
after the loop. fp32 accumulation, as cuBLAS; the result may differ from it in the last bit of a
16-bit y (another summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check, check_runnable, interpreter_on
from .fused_layer_ops import silu_and_mul_ref, silu_mul
from .hopper.pdl import prefetch_pieces, prefetch_to_l2, supported as pdl_supported, wait_for_previous
from .split_k import MAX_TILES, finish, split_range, tile_counters

INTERPRET = interpreter_on()
_INTERPRETER = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)
_MIN_PROGRAMS = 132  # one per SM of an H200: with fewer, K is split too (a small N's few rows would idle the GPU)


def default_config(n: int, k: int) -> dict:
    """The tiles for an N x K weight on a GPU: from the H200 sweep (figures/h200/sweeps/gemv_bf16.json), 16 rows a
    program and 8 warps up to N = 12288 (qkv, o, down; TP=2's shards), 4 rows and one warp above (gate_up, the LM
    head), 512 inputs a tile; K split in two, four or eight where the rows alone make too few programs."""
    config = dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=8, num_stages=3) if n <= 12288 else \
        dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=1, num_stages=2)
    while (triton.cdiv(n, config["BLOCK_N"]) * config["SPLIT_K"] < _MIN_PROGRAMS and config["SPLIT_K"] < 8
           and k >= 2 * config["SPLIT_K"] * config["BLOCK_K"]):
        config["SPLIT_K"] *= 2
    return config


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in fp32, rounded to x's dtype. ``gated``: x is [..., 2K], gate then up,
    and the product's input is silu(gate) * up (``fused_layer_ops.silu_and_mul_ref``)."""
    if gated:
        x = silu_and_mul_ref(x)
    return (x.float() @ weight.float().t()).to(x.dtype)


@triton.jit
def _gemv_kernel(X, W, Y, Partials, Counters, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, GATED: tl.constexpr = False):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = split_range(K, BLOCK_K, SPLIT_K)
    rows = W + n.to(tl.int64)[:, None] * stride_wn
    if PDL:  # launched early (hopper/pdl.py): warm L2 with the first lines of this program's rows, then wait for x
        if PREFETCH_LINES > 0:
            line = tl.arange(0, PREFETCH_LINES) * (1024 // W.dtype.element_ty.primitive_bitwidth)  # 128 B apart
            first = W + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn  # clamped: never past the weight
            prefetch_to_l2(first + tl.minimum(start + line, end - 1)[None, :])
        wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # every tile whole: no masks (the common case, and the fast one)
            w = tl.load(rows + k[None, :], eviction_policy="evict_first")
            x = tl.load(X + k)
            if GATED:  # X is gate_up: K gates, then K ups
                x = silu_mul(x, tl.load(X + K + k))
        else:
            w = tl.load(rows + k[None, :], mask=(n < N)[:, None] & (k < end)[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + k, mask=k < end, other=0.0)
            if GATED:
                x = silu_mul(x, tl.load(X + K + k, mask=k < end, other=0.0))
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    m = tl.arange(0, 1)
    finish(tl.sum(acc, axis=1)[None, :], Y, Partials, Counters, m, n, (n < N)[None, :], 1, N, 0,
           tl.program_id(0), SPLIT_K)


def _prefetch_lines(a: dict) -> int:
    """128-byte lines per weight row to bring into L2 before the wait: pdl.PREFETCH_BYTES over the grid's
    rows (a power of two, at most a K-split's length)."""
    if not a["PDL"]:
        return 0
    split_lines = triton.cdiv(triton.cdiv(a["K"], a["SPLIT_K"]) * a["W"].element_size(), 128)
    return prefetch_pieces(a["N"] * a["SPLIT_K"], 128, split_lines)


_plain = triton.heuristics({
    "EVEN": lambda a: a["N"] % a["BLOCK_N"] == 0 and a["K"] % (a["BLOCK_K"] * a["SPLIT_K"]) == 0,
    "PREFETCH_LINES": _prefetch_lines})(_gemv_kernel)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges (start to one past their last element) intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    span = lambda t: sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1  # noqa: E731
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + span(b) * b.element_size() and b0 < a0 + span(a) * a.element_size()


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None,
         out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [1, K] or [K] @ weight[N, K]^T -> [1, N] or [N] in x's dtype, written to ``out`` if given.
    ``config`` pins the tiles (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); None takes
    ``default_config`` (a small pinned one under the interpreter). ``gated``: x is a gate_up row of 2K
    (gate first) and the input is silu(gate) * up, computed as each program loads it: the MLP's
    SiLU-and-multiply without a kernel of its own (one launch fewer per layer at batch-1 decode), bit
    for bit what ``fused_layer_ops.silu_and_mul`` followed by this GEMV gives."""
    check(x.dtype in FLOAT_DTYPES, f"x.dtype is {x.dtype}; expected one of {FLOAT_DTYPES}")
    check(weight.dtype == x.dtype, f"weight.dtype is {weight.dtype}; expected x's dtype {x.dtype}")
    check(weight.dim() == 2 and weight.stride(1) == 1,
          f"weight must be a 2-d [N, K] tensor contiguous along K; got shape {tuple(weight.shape)}, "
          f"strides {weight.stride()}")
    n, k = weight.shape
    width = 2 * k if gated else k
    check(k > 0 and x.shape[-1] == width and x.numel() == width,
          f"x has shape {tuple(x.shape)}; expected one row of {'2K' if gated else 'K'} = {width} inputs "
          f"([{width}] or [1, {width}]), K > 0")
    check(x.device == weight.device, f"x is on {x.device} but weight is on {weight.device}")
    check_runnable("x", x)
    xs = x.reshape(width).contiguous()
    shape = (*x.shape[:-1], n)
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    check(y.shape == shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous(),
          f"out is {y.dtype} {tuple(y.shape)} on {y.device}; expected contiguous {x.dtype} {shape} on {x.device}")
    check(out is None or not (_overlap(y, x) or _overlap(y, weight)), "out overlaps x or weight; the kernel reads "
          "them while it writes out")
    if n == 0:
        return y
    config = config or (_INTERPRETER if INTERPRET else default_config(n, k))
    splits = config["SPLIT_K"]
    check(splits == 1 or triton.cdiv(n, config["BLOCK_N"]) <= MAX_TILES,
          f"N = {n} in tiles of {config['BLOCK_N']} rows needs more than {MAX_TILES} split-K tile counters")
    partials = torch.empty(splits * n if splits > 1 else 1, dtype=torch.float32, device=x.device)
    args = (xs, weight, y, partials, tile_counters(x.device), n, k, weight.stride(0))
    early = {"PDL": True, "launch_pdl": True} if pdl_supported(x.device) else {"PDL": False}
    _plain[(triton.cdiv(n, config["BLOCK_N"]), splits)](*args, **config, **early, GATED=gated)
    return y
