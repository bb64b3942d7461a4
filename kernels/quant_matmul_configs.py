"""The launch configurations the weight-only quantized matmuls (``quant_matmul.py``) try: the autotuner's lists
per kernel (W4A16 / W8A16, GEMV / dot), the pinned config of Triton's CPU interpreter and of fp32 dots on a GPU,
and which of them fit a call (the autotuner's pruning, also the check of a pinned config).

Why a file of its own: these are data with a history. Each list is small on purpose (every config is compiled and
timed for every new autotuning key) and its rows came from H200 sweeps, which the comments name; the kernels and
their launcher read them, and the tests check every added row computes the reference.
"""

from __future__ import annotations

import torch
import triton


def _configs(rows: list[tuple], names: tuple[str, ...]) -> list[triton.Config]:
    """(meta..., num_warps, num_stages) rows -> triton.Configs."""
    return [triton.Config(dict(zip(names, r[:-2])), num_warps=r[-2], num_stages=r[-1]) for r in rows]


# Small on purpose (each config is compiled and timed for every new key). For Hopper's 132 SMs: the
# GEMV wants a few hundred programs (N / BLOCK_N x SPLIT_K) each streaming 16-byte loads along N.
_W4_GEMV = _configs([(64, 16, 1, 4, 3), (128, 16, 1, 4, 3), (64, 16, 2, 4, 3), (64, 16, 4, 4, 3), (128, 16, 4, 4, 3),
                     (64, 16, 8, 4, 3), (128, 32, 4, 8, 3), (256, 16, 8, 8, 3), (64, 16, 16, 2, 2)],
                    ("BLOCK_N", "BLOCK_KP", "SPLIT_K")) + [
    # The H200 sweeps' winners at M = 1 on Llama-2-7B's projections (figures/h200/sweeps/w4a16_gemv_hfma2.json,
    # w4a16_gemv_split64.json): fp32 with a prefetched tile, and the 16-bit HFMA2 body, up to 1.6x the fp32
    # GEMV where K = 4096 and, with SPLIT_K 64, 1.3x at K = 11008; the autotuner keeps whichever wins per
    # shape (fit_gemv_variants drops HFMA2 where it cannot run).
    triton.Config(dict(BLOCK_N=64, BLOCK_KP=16, SPLIT_K=8, PREFETCH=True), num_warps=2, num_stages=3),
    triton.Config(dict(BLOCK_N=256, BLOCK_KP=8, SPLIT_K=16, HFMA2=True, RUN=2), num_warps=1, num_stages=1),
    triton.Config(dict(BLOCK_N=256, BLOCK_KP=4, SPLIT_K=32, HFMA2=True, RUN=1), num_warps=2, num_stages=1),
    triton.Config(dict(BLOCK_N=128, BLOCK_KP=4, SPLIT_K=32, HFMA2=True, RUN=2), num_warps=1, num_stages=1),
    triton.Config(dict(BLOCK_N=512, BLOCK_KP=8, SPLIT_K=32, HFMA2=True, RUN=2), num_warps=2, num_stages=1),
    triton.Config(dict(BLOCK_N=512, BLOCK_KP=8, SPLIT_K=64, HFMA2=True, RUN=1), num_warps=2, num_stages=1),
    # The HFMA2 math on 2-d tiles, the next tile loaded ahead (TILES, w4_pairs.gemv_pairs_tiles): the H200
    # sweep's winners (figures/h200/sweeps/w4a16_gemv_tiles.json): 11.7 us on 4096 x 11008 and 12.6 us on
    # 11008 x 4096, where the configs above take 11.7 and 13.1 in the same run.
    triton.Config(dict(BLOCK_N=128, BLOCK_KP=8, SPLIT_K=16, HFMA2=True, RUN=1, TILES=True), num_warps=1, num_stages=1),
    triton.Config(dict(BLOCK_N=128, BLOCK_KP=8, SPLIT_K=32, HFMA2=True, RUN=1, TILES=True), num_warps=1, num_stages=1),
    triton.Config(dict(BLOCK_N=128, BLOCK_KP=16, SPLIT_K=32, HFMA2=True, RUN=1, TILES=True), num_warps=1, num_stages=1),
]
_W8_GEMV = _configs([(128, 32, 1, 4, 3), (256, 16, 1, 4, 3), (128, 32, 4, 4, 3), (256, 32, 2, 8, 3),
                     (256, 16, 4, 4, 3), (128, 32, 8, 4, 3), (256, 64, 4, 8, 3),
                     # Narrow tiles, long along K: the H200 sweep's winners at M = 1 (figures/h200/sweeps/
                     # w8_gemv_configs.json), 1.1-1.25x the rows above on Llama-2-7B's head (42.7 against 48.0 us,
                     # what -head8 reads) and its four projections.
                     (64, 128, 1, 4, 3), (32, 256, 1, 4, 3), (32, 128, 1, 4, 3), (64, 128, 2, 4, 3)],
                    ("BLOCK_N", "BLOCK_K", "SPLIT_K"))
# The dot's rows come from an H200 sweep of 54 configs over Llama-2-7B's four projections (M = 2 .. 128).
_W4_DOT = _configs([(16, 64, 128, 2, 4, 3), (16, 64, 128, 4, 4, 3), (16, 64, 128, 8, 4, 3), (16, 128, 128, 8, 4, 3),
                    (32, 64, 128, 4, 4, 3), (32, 128, 64, 2, 4, 3), (32, 128, 64, 4, 4, 3),
                    (64, 64, 128, 1, 4, 3), (64, 64, 128, 2, 4, 3), (128, 128, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3)],
                   ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")) + [
    # The PAIRS body (16-bit dequantization, two weights per instruction), mostly with SWAP_AB, won every
    # shape of the H200 sweep at M = 16..64 but three, by up to 1.4x over the fp32 dequantization's best
    # (figures/h200/sweeps/w4a16_dot_pairs.json): its winning configs. x is 16-bit on this autotuned path
    # (fp32 on a GPU takes _GPU_FP32_DOT).
    triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, SPLIT_K=split, SWAP_AB=swap, PAIRS=True),
                  num_warps=warps, num_stages=stages)
    for m, n, k, split, swap, warps, stages in [(16, 128, 128, 4, True, 4, 3), (32, 64, 64, 4, True, 4, 2),
                                                 (32, 64, 128, 4, True, 4, 2), (32, 128, 64, 8, True, 4, 3),
                                                 (64, 128, 64, 2, False, 4, 3), (64, 128, 128, 8, True, 8, 4)]]
_W8_DOT = _configs([(16, 64, 64, 1, 4, 3), (16, 128, 64, 1, 4, 3), (16, 64, 64, 4, 4, 3), (16, 128, 128, 4, 4, 3),
                    (32, 64, 64, 2, 4, 3), (64, 64, 64, 1, 4, 3), (64, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 3)],
                   ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))
_INTERPRETER = {"w4_gemv": dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=2), "w8_gemv": dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
                "w4_dot": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
                "w8_dot": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)}
# fp32 dots are exact ("ieee") and compile slowly in big tiles; fp32 on a GPU is for checks only.
_GPU_FP32_DOT = {"w4_dot": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2),
                 "w8_dot": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)}


# ----------------------------------------------------------------------------- which configs fit a call

SPLIT_MAX_M = 64  # above this, enough programs come from M tiles alone: no split-K, no partials


def fit_dot_tiles(configs, named_args, **kwargs):
    """Row tiles between a quarter of M's bucket and the bucket; split-K only where M is small."""
    bucket = {**named_args, **kwargs}["M_BUCKET"]
    kept = [c for c in configs if bucket // 4 <= c.kwargs["BLOCK_M"] <= max(16, bucket)
            and (c.kwargs["SPLIT_K"] == 1 or bucket <= SPLIT_MAX_M)]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


def hfma2_runs_fit(config: dict, group: int, k: int) -> bool:
    """HFMA2's runs of RUN packed rows: 1, 2 or 4 of them (longer 16-bit sums lose accuracy), dividing the
    tile and staying inside a group; with TILES (which sums one row in 16 bits and ignores RUN), whole tiles inside
    a group (their scale is loaded once)."""
    if config.get("TILES"):
        return group % (8 * config["BLOCK_KP"]) == 0 or group >= k
    run = config.get("RUN", 2)
    return run in (1, 2, 4) and config["BLOCK_KP"] % run == 0 and (group % (8 * run) == 0 or group >= k)


def fit_gemv_variants(configs, named_args, **kwargs):
    """HFMA2 configs only where they run: 16-bit x, and runs of RUN packed rows (TILES: whole tiles) that divide
    the tile and stay inside a group (``w4a16_matmul`` checks the same of a pinned config). Split-K only up to
    SPLIT_MAX_M rows, the most ``_launch`` sizes partials for (path="gemv" can be forced at any M)."""
    args = {**named_args, **kwargs}
    hfma2_runs = args["X"].dtype != torch.float32
    return [c for c in configs
            if (not c.kwargs.get("HFMA2") or hfma2_runs and hfma2_runs_fit(c.kwargs, args["group_size"], args["K"]))
            and (c.kwargs["SPLIT_K"] == 1 or args["M"] <= SPLIT_MAX_M)]
