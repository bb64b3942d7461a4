"""Issue 6: the stream-K W4A16 GEMV prototype (kernels/w4_gemv_stream.py) against the split-K Gluon GEMV
(kernels/w4_gemv_hopper.py, "gluon gemv"), ``w4a16_matmul`` as a user calls it (whichever kernel ``gemv`` picks for the
plain form: the column kernel since session 36) and torch's bf16 matmul, M = 1, in one process, three interleaved
rounds.

Timing as w4a16_gemv_gluon.py: 20 calls in a CUDA graph, each on another copy of the weights (twice the L2 in all,
so no call finds its weight in L2), PDL on where the kernel has it. Variants (ALL_VARIANTS; VARIANTS picks): programs
an SM x ring slots, the bf16 y's fix-up (poll: the tile's first program reads the others' partials until all are
stored; counter: the last to arrive sums them), tiles asked into L2 before the wait (l2), when the next kernel may
start (start 0 / 1 / 2), the add form (y added to an fp32 row: no fix-up), the column kernel
(kernels/w4_gemv_columns.py: warps x ring slots, b4: four blocks a warp a band), and two probes: the copies alone (no
math, no fix-up: its answer is wrong) and no fix-up (partials stored, not summed). Every variant that computes y is
checked against ``w4a16_matmul_ref`` (y poisoned first), run twice for bit-equal answers, the split-K counters
checked back at zero and the poll's slots back at EMPTY; odd shapes (a ragged column tile, group 64, one unit a
program) are checked without timing.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/w4a16_gemv_stream.py``
(SHAPES=4096x11008,... to choose; NAME names the JSON).
"""
import itertools
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import time_interleaved  # noqa: E402
from minillm.bench.quant_kernels import QuantShape, _copies, bytes_moved  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels import w4_gemv_columns, w4_gemv_hopper, w4_gemv_stream  # noqa: E402
from minillm.kernels.checks import num_sms  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref  # noqa: E402
from minillm.kernels.split_k import tile_counters  # noqa: E402

POLL, COUNTER, NONE = w4_gemv_stream.FIXUP_POLL, w4_gemv_stream.FIXUP_COUNTER, w4_gemv_stream.FIXUP_NONE
# name: w4_gemv_stream keywords (start: when the next kernel may start; fixup: how a bf16 y's shared column tiles are
# summed, w4_gemv_stream.py). Session 30's list had the start and L2 variants; NAME=... VARIANTS=name,name picks.
ALL_VARIANTS = {
    "stream 3x2 poll": dict(programs_per_sm=3, stages=2, fixup=POLL),
    "stream 2x3 poll": dict(programs_per_sm=2, stages=3, fixup=POLL),
    "stream 2x2 poll": dict(programs_per_sm=2, stages=2, fixup=POLL),
    "stream 3x2 counter": dict(programs_per_sm=3, stages=2, fixup=COUNTER),
    "stream 2x3 counter": dict(programs_per_sm=2, stages=3, fixup=COUNTER),
    "stream 3x2 start 1": dict(programs_per_sm=3, stages=2, start=1, fixup=COUNTER),
    "stream 3x2 start 1 l2 2": dict(programs_per_sm=3, stages=2, start=1, l2_tiles=2, fixup=COUNTER),
    "stream 3x2 start 2": dict(programs_per_sm=3, stages=2, start=2, fixup=COUNTER),
    "stream 3x2 add": dict(programs_per_sm=3, stages=2, add=True),
    "stream 2x3 add": dict(programs_per_sm=2, stages=3, add=True),
    "stream 3x2 add start 1": dict(programs_per_sm=3, stages=2, add=True, start=1),
    "probe 3x2 no fix-up": dict(programs_per_sm=3, stages=2, fixup=NONE),
    "probe 3x2 copies only": dict(programs_per_sm=3, stages=2, compute=False, fixup=NONE),
    # The column kernel (kernels/w4_gemv_columns.py: a program 32 columns over all of K, no fix-up): warps x slots.
    "columns w8 s2": dict(columns=True, warps=8, stages=2),
    "columns w8 s4": dict(columns=True, warps=8, stages=4),
    "columns w4 s2": dict(columns=True, warps=4, stages=2),
    "columns w4 s4": dict(columns=True, warps=4, stages=4),
    "columns w16 s2": dict(columns=True, warps=16, stages=2),
    "columns w16 s4": dict(columns=True, warps=16, stages=4),
    "columns w16 s4 add": dict(columns=True, warps=16, stages=4, add=True),
    "columns w8 s8 add": dict(columns=True, warps=8, stages=8, add=True),
    # four blocks a warp a band (b4): 32 KB bands at 8 warps, twice the words a thread a band
    "columns w8 s2 b4": dict(columns=True, warps=8, stages=2, blocks=4),
    "columns w8 s4 b4": dict(columns=True, warps=8, stages=4, blocks=4),
    "columns w4 s4 b4": dict(columns=True, warps=4, stages=4, blocks=4),
    "columns w4 s8 b4": dict(columns=True, warps=4, stages=8, blocks=4),
    "columns w16 s2 b4": dict(columns=True, warps=16, stages=2, blocks=4),
    "columns w8 s4 b4 add": dict(columns=True, warps=8, stages=4, blocks=4, add=True),
    "columns w4 s8 b4 add": dict(columns=True, warps=4, stages=8, blocks=4, add=True),
    "probe columns w8 s4 b4 copies only": dict(columns=True, warps=8, stages=4, blocks=4, compute=False),
    "probe columns w8 s2 b4 copies only": dict(columns=True, warps=8, stages=2, blocks=4, compute=False),
    "probe columns w4 s8 b4 copies only": dict(columns=True, warps=4, stages=8, blocks=4, compute=False),
    # the math alone (session 35): every band computed from the ring's first fill, no refills (y is wrong)
    "probe columns w8 s4 b4 math only": dict(columns=True, warps=8, stages=4, blocks=4, probe=("refills",)),
    "probe columns w8 s2 b4 math only": dict(columns=True, warps=8, stages=2, blocks=4, probe=("refills",)),
    "probe columns w8 s4 math only": dict(columns=True, warps=8, stages=4, probe=("refills",)),
    "probe columns w8 s4 b4 math only no pdl": dict(columns=True, warps=8, stages=4, blocks=4, probe=("refills",),
                                                    pdl=False),
    "columns w8 s4 b4 no pdl": dict(columns=True, warps=8, stages=4, blocks=4, pdl=False),
    "columns w8 s8": dict(columns=True, warps=8, stages=8),
    "columns w8 s4 add": dict(columns=True, warps=8, stages=4, add=True),
    "columns w8 s2 add": dict(columns=True, warps=8, stages=2, add=True),
    "columns w4 s4 add": dict(columns=True, warps=4, stages=4, add=True),
    "columns w8 s4 no pdl": dict(columns=True, warps=8, stages=4, pdl=False),
    "columns w8 s8 no pdl": dict(columns=True, warps=8, stages=8, pdl=False),
    "probe columns w8 s4 copies only": dict(columns=True, warps=8, stages=4, compute=False),
    "probe columns w8 s4 copies only no pdl": dict(columns=True, warps=8, stages=4, compute=False, pdl=False),
    "probe columns w8 s4 weights only": dict(columns=True, warps=8, stages=4, compute=False, probe=("scales",)),
    "probe columns w8 s4 copies only no tables": dict(columns=True, warps=8, stages=4, compute=False,
                                                      probe=("tables",)),
    "probe columns w8 s4 weights only no tables no pdl": dict(columns=True, warps=8, stages=4, compute=False,
                                                              probe=("scales", "tables"), pdl=False),
    "probe columns w16 s4 copies only": dict(columns=True, warps=16, stages=4, compute=False),
    "probe columns w8 s8 copies only": dict(columns=True, warps=8, stages=8, compute=False),
    "probe columns w4 s8 copies only": dict(columns=True, warps=4, stages=8, compute=False),
}
DEFAULT_VARIANTS = ("stream 3x2 poll", "stream 2x3 poll", "stream 2x2 poll", "stream 3x2 counter", "stream 2x3 counter",
                    "stream 3x2 add", "stream 2x3 add", "probe 3x2 no fix-up", "probe 3x2 copies only")
COLUMN_PROBES = {"copies only": dict(compute=False), "math only": dict(probe=("refills",)),
                 "x early": dict(probe=("x early",))}


def variant(name):
    """A variant's keywords: ALL_VARIANTS', or for a column kernel named "[probe ]columns wW sS[ bB][ lL][ add][ no
    pdl][ probe]" (L: slots filled after x's loads; probe: a COLUMN_PROBES name), those words' (blocks 2 unless
    named)."""
    if name in ALL_VARIANTS:
        return ALL_VARIANTS[name]
    m = re.fullmatch(r"(probe )?columns w(\d+) s(\d+)(?: b(\d+))?(?: l(\d+))?( add)?( no pdl)?(?: (.+))?", name)
    if m is None or bool(m[1]) != bool(m[8]) or (m[8] and m[8] not in COLUMN_PROBES):
        raise ValueError(f"variant {name!r}: not in ALL_VARIANTS, nor 'columns wW sS[ bB][ lL][ add][ no pdl]', nor "
                         f"'probe columns ... ' and one of {sorted(COLUMN_PROBES)}")
    return dict(columns=True, warps=int(m[2]), stages=int(m[3]), blocks=int(m[4] or 2), late=int(m[5] or 0),
                add=bool(m[6]), pdl=not m[7], **COLUMN_PROBES.get(m[8], {}))


VARIANTS = {name: variant(name) for name in os.environ.get("VARIANTS", ",".join(DEFAULT_VARIANTS)).split(",")}


def pinned_split_k(call):
    """``call`` with ``w4a16_matmul``'s plain form on the split-K kernel whatever MINILLM_GEMV_STREAM and
    MINILLM_GEMV_COLUMNS say."""
    saved = w4_gemv_hopper.STREAM, w4_gemv_hopper.COLUMNS
    w4_gemv_hopper.STREAM = w4_gemv_hopper.COLUMNS = ()
    try:
        return call()
    finally:
        w4_gemv_hopper.STREAM, w4_gemv_hopper.COLUMNS = saved


def run_variant(x, w, group, out, partials, counters, kw):
    """One call of a variant: the column kernel's (``columns``) or the stream kernel's."""
    if kw.get("columns"):
        w4_gemv_columns.w4_gemv_columns(x, *w, group, out, warps=kw["warps"], stages=kw["stages"],
                                        compute=kw.get("compute", True), add=kw.get("add", False),
                                        pdl=kw.get("pdl", True), probe=kw.get("probe", ()),
                                        blocks=kw.get("blocks", 2), late=kw.get("late", 0))
    else:
        w4_gemv_stream.w4_gemv_stream(x, *w, group, out, partials, counters, **kw)


def weights(k, n, group, dev, gen):
    groups = -(-k // group)
    return (pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
            torch.rand(groups, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
            pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen)))


def check(k, n, group, kw, dev, gen):
    """{max_rel_error_vs_ref, bit_equal_twice, counters_zero} of a variant on fresh random inputs."""
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
    w = weights(k, n, group, dev, gen)
    want = w4a16_matmul_ref(x, *w, group).float()
    partials = torch.empty(w4_gemv_stream.partials_needed(k, n, 4 * num_sms(dev)), dtype=torch.float32, device=dev)
    counters = tile_counters(dev)
    answers = []
    for _ in range(2):
        if kw.get("add"):  # y added to a zeroed fp32 row
            out = torch.zeros((1, n), dtype=torch.float32, device=dev)
        else:
            out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=dev)
        run_variant(x, w, group, out, partials, counters, kw)
        answers.append(out)
    torch.cuda.synchronize()
    return {"max_rel_error_vs_ref": ((answers[0].float() - want).abs().max() / want.abs().max()).item(),
            "bit_equal_twice": bool(torch.equal(answers[0], answers[1])),
            "counters_zero": bool((counters[:64] == 0).all()),
            "poll_slots_empty": bool((w4_gemv_stream.POLL_SLOTS[x.device] == w4_gemv_stream.EMPTY).all())
            if x.device in w4_gemv_stream.POLL_SLOTS else None}


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "sms": num_sms(dev), "checks": {}, "shapes": []}
    gen = torch.Generator(device=dev).manual_seed(1)
    for k, n, group in ((4096, 11008, 64), (4096, 4128, 128), (11008, 256, 128), (512, 96, 64), (4096, 11008, 128)):
        for name, kw in VARIANTS.items():
            if "probe" not in name:
                runs["checks"][f"{k}x{n} g{group} {name}"] = result = check(k, n, group, kw, dev, gen)
                print(k, n, group, name, result, flush=True)
    shapes = os.environ.get("SHAPES", "4096x11008,11008x4096,4096x4096")
    for k, n in (tuple(int(v) for v in s.split("x")) for s in shapes.split(",")):
        group = 128
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        w4_bytes = bytes_moved("w4a16", QuantShape(1, k, n), 2)
        copies = _copies(w4_bytes, dev)
        sets = [weights(k, n, group, dev, gen) for _ in range(copies)]
        dense = [torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=gen) for _ in range(copies)]
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        out32 = torch.zeros(1, n, dtype=torch.float32, device=dev)  # (the add variants' row: sums, never read)
        partials = torch.empty(w4_gemv_stream.partials_needed(k, n, 4 * num_sms(dev)), dtype=torch.float32,
                               device=dev)
        counters = tile_counters(dev)

        def cycled(fn, pool):
            cycle = itertools.cycle(pool)
            return lambda: fn(next(cycle))

        def split_k_only(w):
            return pinned_split_k(lambda: w4a16_matmul(x, *w, group, out=out, hopper=True))

        calls = {"torch bf16": (cycled(lambda w: torch.matmul(x, w, out=out), dense), 2 * k * n + 2 * (k + n)),
                 "gluon gemv": (cycled(split_k_only, sets), w4_bytes),
                 "w4a16_matmul": (cycled(lambda w: w4a16_matmul(x, *w, group, out=out, hopper=True), sets), w4_bytes)}
        for name, kw in VARIANTS.items():
            def call(w, kw=kw):
                run_variant(x, w, group, out32 if kw.get("add") else out, partials, counters, kw)
            calls[name] = (cycled(call, sets), w4_bytes)
        times = time_interleaved({name: call for name, (call, _) in calls.items()}, dev)
        row = {"k": k, "n": n, "group": group, "weight_copies": copies,
               "plan_2_per_sm": w4_gemv_stream.plan(k, n, 2 * num_sms(dev))}
        for name, (call, nbytes) in calls.items():
            best = times[name]["ms"] * 1e3
            row[name] = {"us_rounds": [ms * 1e3 for ms in times[name]["ms_rounds"]], "us": best,
                         "gbs": nbytes / best / 1e3, "fraction_of_bandwidth": nbytes / best / 1e3 / bandwidth}
        for name in calls:
            row[name]["speedup_vs_torch"] = row["torch bf16"]["us"] / row[name]["us"]
        print({key: (round(v["us"], 2), round(v["speedup_vs_torch"], 3)) if isinstance(v, dict) and "us" in v else v
               for key, v in row.items()}, flush=True)
        runs["shapes"].append(row)
    save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "w4a16_gemv_stream"),
                "W4A16 GEMV, M = 1, bf16, stream-K prototype",
                "us per call, best of three interleaved rounds, each the best of 5 graph replays of 20 calls, each "
                "call on another copy of the weights (L2-cold); speed-ups over torch.matmul on the dense bf16 weight "
                "in the same rounds; checks: answers against w4a16_matmul_ref on fresh inputs", runs)


if __name__ == "__main__":
    main()
