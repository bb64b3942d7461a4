"""Issue 6: can a GEMV whose programs own their columns copy its weight as fast as the stream kernel does?

Session 32's column GEMV (commit d11bda5, reverted) owned 32 columns a program over all of K, so a bf16 y needed no
fix-up, but its copies alone took 7.58 / 11.20 us at 4096 x 11008 / 11008 x 4096 against the stream kernel's
6.13 / 6.01 (w4a16_gemv_columns_probe.json). It fetched a band in eight TMA copies of [16, 32] boxes, each 16 packed
rows 8 apart (2 KB). Session 19's probe had whole 32-column slices copied in boxes of 256 rows, every copy issued at
once: 6.56 / 6.89 us (w4a16_gemv_probe.json, "slice copies"). So the box, not the layout, may be what was slow.

This probe copies the packed weight [K / 8, N] as the column kernel would own it: program p takes the WIDTH columns
of strip p // SPLIT and the (p % SPLIT)-th of SPLIT runs of its rows, in boxes of [BOX_ROWS, WIDTH] through a ring of
STAGES slots, waiting for each box and refilling its slot (no math; a word of each box summed so the copies are
used). Against it, in the same interleaved rounds: torch's bf16 matmul and the stream kernel's copies-only probe
(3 x 2; that one also copies the scales and zero points, ~3 % more bytes). 20 calls in a CUDA graph, each on another
copy of the weights (L2-cold). Run from the repository root on an H200:
``PYTHONPATH=$PWD python3 figures/h200/sweeps/w4a16_strip_copies.py`` (NAME names the JSON).
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
from minillm.kernels import w4_gemv_stream  # noqa: E402
from minillm.kernels.flash_attention_hopper import tma_load, warps_barrier  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n  # noqa: E402
from minillm.kernels.split_k import tile_counters  # noqa: E402

# (box rows, columns a strip, ring slots, runs a strip); boxes of 16 rows are the column kernel's size
VARIANTS = [(16, 32, 8, 1), (64, 32, 8, 1), (128, 32, 4, 1), (128, 32, 6, 1), (256, 32, 2, 1), (256, 32, 3, 1),
            (256, 32, 6, 1), (128, 32, 4, 2), (128, 64, 3, 1), (64, 64, 6, 1)]


@gluon.jit
def _strip_copies_kernel(w_desc, Out, K_ROWS, ROWS_PER_RUN, BOX_ROWS: gl.constexpr, WIDTH: gl.constexpr,
                         STAGES: gl.constexpr, SPLIT: gl.constexpr):
    p = gl.program_id(0)
    n0 = (p // SPLIT) * WIDTH
    first = (p % SPLIT) * ROWS_PER_RUN
    n_boxes = (gl.minimum(ROWS_PER_RUN, K_ROWS - first) + BOX_ROWS - 1) // BOX_ROWS
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BOX_ROWS, WIDTH], w_desc.layout)
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(landed.index(t), count=1)
    fence_async_shared()
    for t in gl.static_range(STAGES):
        if t < n_boxes:
            mbarrier.expect(landed.index(t), w_desc.block_type.nbytes)
            tma_load(w_desc, [first + t * BOX_ROWS, n0], landed.index(t), w_smem.index(t))
    row_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    out = gl.zeros([WIDTH], gl.int32, layout=gl.SliceLayout(0, row_l))
    for i in range(n_boxes):
        s = i % STAGES
        mbarrier.wait(landed.index(s), (i // STAGES) & 1)
        out += gl.sum(w_smem.index(s).slice(0, 1).load(row_l), axis=0)
        warps_barrier()  # every warp done with slot s
        if i + STAGES < n_boxes:
            mbarrier.expect(landed.index(s), w_desc.block_type.nbytes)
            tma_load(w_desc, [first + (i + STAGES) * BOX_ROWS, n0], landed.index(s), w_smem.index(s))
    gl.store(Out + p * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, row_l)), out)


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    for k, n in ((4096, 11008), (11008, 4096)):
        gen = torch.Generator(device=dev).manual_seed(0)
        group = 128
        nbytes = bytes_moved("w4a16", QuantShape(1, k, n), 2)
        copies = _copies(nbytes, dev)
        sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
                 torch.rand(k // group, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
                 pack_int4_along_n(torch.randint(0, 16, (k // group, n), device=dev, generator=gen)))
                for _ in range(copies)]
        dense = [torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=gen) for _ in range(copies)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        partials = torch.empty(w4_gemv_stream.partials_needed(k, n, 3 * 132), dtype=torch.float32, device=dev)
        counters = tile_counters(dev)
        strip_out = torch.empty(4 * n, dtype=torch.int32, device=dev)
        w_bytes = sets[0][0].numel() * 4
        dense_cycle, set_cycle = itertools.cycle(dense), itertools.cycle(sets)
        calls = {"torch bf16": (lambda: torch.matmul(x, next(dense_cycle), out=out), 2 * k * n),
                 "stream 3x2 copies only": (lambda: w4_gemv_stream.w4_gemv_stream(
                     x, *next(set_cycle), group, out, partials, counters, programs_per_sm=3, stages=2, compute=False,
                     fixup=w4_gemv_stream.FIXUP_NONE), nbytes)}
        k_rows = k // 8
        for box_rows, width, stages, split in VARIANTS:
            rows_per_run = -(-k_rows // split // box_rows) * box_rows
            descs = itertools.cycle([TensorDescriptor(w[0], list(w[0].shape), list(w[0].stride()), [box_rows, width],
                                                      layout) for w in sets])
            grid = (n // width * split,)
            calls[f"strips {width} wide, boxes of {box_rows} rows, {stages} slots, {split} run(s)"] = (
                lambda descs=descs, grid=grid, box_rows=box_rows, width=width, stages=stages, split=split,
                rows_per_run=rows_per_run: _strip_copies_kernel[grid](
                    next(descs), strip_out, k_rows, rows_per_run, BOX_ROWS=box_rows, WIDTH=width, STAGES=stages,
                    SPLIT=split, num_warps=4), w_bytes)
        times = time_interleaved({name: call for name, (call, _) in calls.items()}, dev)
        row = {"k": k, "n": n, "weight_copies": copies}
        for name, (_, moved) in calls.items():
            best = times[name]["ms"] * 1e3
            row[name] = {"us_rounds": [ms * 1e3 for ms in times[name]["ms_rounds"]], "us": best, "bytes": moved,
                         "fraction_of_bandwidth": moved / best / 1e3 / bandwidth,
                         "speedup_vs_torch": times["torch bf16"]["ms"] / times[name]["ms"]}
        print({key: (round(v["us"], 2) if isinstance(v, dict) else v) for key, v in row.items()}, flush=True)
        runs["shapes"].append(row)
    save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "w4a16_strip_copies"),
                "W4A16 weight copies as a column-owning GEMV would make them, M = 1, group 128",
                "us per call, best of three interleaved rounds, each the best of 5 graph replays of 20 calls, each "
                "call on another copy of the weights (L2-cold); strips: the packed weight only; the stream probe also "
                "its scales and zero points", runs)


if __name__ == "__main__":
    main()
