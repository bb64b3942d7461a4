"""Issue 6: where the Gluon W4A16 GEMV's time goes (kernels/w4_gemv_hopper.py), M = 1, bf16, group 128.

The kernel against two probes that share its grid, tiles and TMA copies but do no math: ``copies`` waits for every
tile and writes each program's partial (a word of each tile: nothing is computed) with the kernel's split-K fix-up,
``copies, no fix-up`` writes the partial and ends. An empty kernel (one program) gives the launch's own cost in a
graph. So: kernel - copies = the math the copies do not hide; copies - copies without fix-up = the fix-up's
latency; copies without fix-up = the memory floor of this grid. ``slice copies``: a grid without split-K, each
program copying a whole column slice of 16 to 64 columns (all K), to see what narrow boxes cost in HBM efficiency.
Three interleaved rounds, weights cycled through twice the L2 as the sweep w4a16_gemv_gluon.py does.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/w4a16_gemv_probe.py``.
"""
import itertools
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import time_interleaved  # noqa: E402
from minillm.bench.quant_kernels import QuantShape, _copies, bytes_moved  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels import w4_gemv_hopper as wh  # noqa: E402
from minillm.kernels.flash_attention_hopper import tma_load  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n  # noqa: E402
from minillm.kernels.split_k import tile_counters  # noqa: E402


@gluon.jit
def _copies_kernel(w_desc, s_desc, z_desc, Y, Partials, Counters, N, K_ROWS, TILES: gl.constexpr,
                   FIXUP: gl.constexpr):
    tile_n = gl.program_id(0)
    split = gl.program_id(1)
    n0 = tile_n * 256
    first_row = split * (TILES * 16)
    w_smem = gl.allocate_shared_memory(gl.int32, [TILES, 16, 256], w_desc.layout)
    s_smem = gl.allocate_shared_memory(s_desc.dtype, [TILES, 1, 256], s_desc.layout)
    z_smem = gl.allocate_shared_memory(gl.int8, [TILES, 1, 128], z_desc.layout)
    landed = gl.allocate_shared_memory(gl.int64, [TILES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(TILES):
        mbarrier.init(landed.index(t), count=1)
    fence_async_shared()
    for t in gl.static_range(TILES):
        row = first_row + t * 16
        if row < K_ROWS:
            mbarrier.expect(landed.index(t), w_desc.block_type.nbytes + s_desc.block_type.nbytes
                            + z_desc.block_type.nbytes)
            tma_load(w_desc, [row, n0], landed.index(t), w_smem.index(t))
            tma_load(s_desc, [row // 16, n0], landed.index(t), s_smem.index(t))
            tma_load(z_desc, [row // 16, n0 // 2], landed.index(t), z_smem.index(t))
    tile_l: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 4], [1, 0])
    cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
    out = gl.zeros([256], gl.float32, layout=cols_l)
    for t in gl.static_range(TILES):
        if first_row + t * 16 < K_ROWS:
            mbarrier.wait(landed.index(t), 0)
            out += gl.sum(w_smem.index(t).slice(0, 1).load(tile_l), axis=0).to(gl.float32)
    if FIXUP:
        wh._finish(out, Y, Partials, Counters, tile_n, N, 4)
    else:
        n = n0 + gl.arange(0, 256, layout=cols_l)
        gl.store(Partials + split * N + n, out, mask=n < N)


@gluon.jit
def _slice_copies_kernel(w_desc, Out, K_ROWS, BOXES: gl.constexpr, BOX_ROWS: gl.constexpr, WIDTH: gl.constexpr):
    """No split: a program copies a whole column slice of WIDTH columns (all K) in BOXES boxes of [BOX_ROWS, WIDTH],
    every copy issued first, each landing on a barrier of its own; then waits for all and writes a word a box."""
    n0 = gl.program_id(0) * WIDTH
    w_smem = gl.allocate_shared_memory(gl.int32, [BOXES, BOX_ROWS, WIDTH], w_desc.layout)
    landed = gl.allocate_shared_memory(gl.int64, [BOXES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(BOXES):
        mbarrier.init(landed.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(BOXES):
        mbarrier.expect(landed.index(b), w_desc.block_type.nbytes)
        tma_load(w_desc, [b * BOX_ROWS, n0], landed.index(b), w_smem.index(b))
    tile_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    out = gl.zeros([WIDTH], gl.int32, layout=gl.SliceLayout(0, tile_l))
    for b in gl.static_range(BOXES):
        mbarrier.wait(landed.index(b), 0)
        out += gl.sum(w_smem.index(b).slice(0, 1).load(tile_l), axis=0)
    gl.store(Out + n0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, tile_l)), out)


@gluon.jit
def _empty_kernel(Y):
    gl.store(Y + gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])), 0.0)


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
    counters = tile_counters(dev)
    empty_out = torch.empty(128, dtype=torch.float32, device=dev)
    for k, n in ((4096, 11008), (11008, 4096)):
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        nbytes = bytes_moved("w4a16", QuantShape(1, k, n), 2)
        copies = _copies(nbytes, dev)
        sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
                 torch.rand(k // 128, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
                 pack_int4_along_n(torch.randint(0, 16, (k // 128, n), device=dev, generator=gen)))
                for _ in range(copies)]
        descriptors = [wh._descriptors(*w, 128) for w in sets]
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        partials = torch.empty(128 * n, dtype=torch.float32, device=dev)
        row = {"k": k, "n": n, "weight_copies": copies, "bytes": nbytes}
        calls = {"empty kernel": lambda: _empty_kernel[(1,)](empty_out, num_warps=4)}
        for tiles in (1, 2, 4):
            splits = -(-k // (128 * tiles))
            grid = (-(-n // 256), splits)
            w_cycle, d_cycle = itertools.cycle(sets), itertools.cycle(descriptors)
            calls[f"kernel, {tiles} tiles"] = lambda w_cycle=w_cycle, tiles=tiles: wh.w4_gemv(
                x, *next(w_cycle), 128, out, partials, counters, True, tiles=tiles)
            for fixup in (True, False):
                calls[f"copies, {tiles} tiles" + ("" if fixup else ", no fix-up")] = (
                    lambda d_cycle=d_cycle, grid=grid, tiles=tiles, fixup=fixup: _copies_kernel[grid](
                        *next(d_cycle), out, partials, counters, n, k // 8, TILES=tiles, FIXUP=fixup, num_warps=4))
        slice_out = torch.empty(n, dtype=torch.int32, device=dev)
        for width, box_rows in ((32, 64), (32, 256), (16, 128), (64, 128)):
            boxes = -(-k // 8 // box_rows)
            if boxes * box_rows * width * 4 > 200 * 1024:
                continue
            layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            slice_descs = itertools.cycle([TensorDescriptor(w[0], list(w[0].shape), list(w[0].stride()),
                                                            [box_rows, width], layout) for w in sets])
            calls[f"slice copies, {width} wide, boxes of {box_rows} rows"] = (
                lambda d=slice_descs, width=width, box_rows=box_rows, boxes=boxes: _slice_copies_kernel[
                    (n // width,)](next(d), slice_out, k // 8, BOXES=boxes, BOX_ROWS=box_rows, WIDTH=width,
                                   num_warps=4))
        times = time_interleaved(calls, dev)
        for name in calls:
            best = times[name]["ms"] * 1e3
            row[name] = {"us_rounds": [ms * 1e3 for ms in times[name]["ms_rounds"]], "us": best,
                         "fraction_of_bandwidth": nbytes / best / 1e3 / bandwidth}
        print({key: (v if not isinstance(v, dict) else round(v["us"], 2)) for key, v in row.items()}, flush=True)
        runs["shapes"].append(row)
    save_result(os.environ.get("OUT", "/tmp/out"), "w4a16_gemv_probe", "W4A16 GEMV probes, M = 1, bf16, group 128",
                "kernel: w4_gemv_hopper.w4_gemv; copies: the same grid's TMA copies waited for, no math, with and "
                "without the split-K fix-up; empty kernel: one program, one store. Best of three interleaved rounds, "
                "each the best of 5 graph replays of 20 calls", runs)


if __name__ == "__main__":
    main()
