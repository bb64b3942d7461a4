"""Issue 6: the Gluon W4A16 GEMV (kernels/w4_gemv_hopper.py) against the Triton GEMV (autotuned, hopper=False) and
torch's bf16 matmul on the dense weight, M = 1, in one process, three interleaved rounds (H200 clocks sag under load).

Shapes: Llama-2-7B's projections (4096 x 11008, 11008 x 4096, 4096 x 4096), group 128, and 4096 x 11008 at group 64.
Each timed call cycles through enough copies of its weights to fill twice the L2 (as ``bench/quant_kernels.py``),
so no call finds its weight in L2. The Gluon kernel is timed at its default and at 1, 2 and 4 tiles a program, at
2 tiles with runs of one packed row a 16-bit sum (``run=1``; the default is 2), and gated: x a gate_up row of 2K and
silu(gate) * up applied as it is loaded, against ``silu_and_mul`` and the GEMV as two kernels.
(w4a16_gemv_gluon_slice.json: a run with a second Gluon kernel, since removed, that split no K.)
Every candidate's answer is compared with ``w4a16_matmul_ref`` (y poisoned before): ``max_rel_error_vs_ref``. Bytes: ``bytes_moved``.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/w4a16_gemv_gluon.py``
(NAME names the JSON: w4a16_gemv_gluon by default).
"""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import time_interleaved  # noqa: E402
from minillm.bench.quant_kernels import QuantShape, _copies, bytes_moved  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels import w4_gemv_fused, w4_gemv_hopper  # noqa: E402
from minillm.kernels.checks import num_sms  # noqa: E402
from minillm.kernels.fused_layer_ops import silu_and_mul  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref  # noqa: E402
from minillm.kernels.split_k import tile_counters  # noqa: E402


def weights(k, n, group, dev, gen):
    groups = -(-k // group)
    return (pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
            torch.rand(groups, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
            pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen)))


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
    for k, n, group in ((4096, 11008, 128), (11008, 4096, 128), (4096, 4096, 128), (4096, 11008, 64)):
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        gate_up = torch.randn(1, 2 * k, dtype=torch.bfloat16, device=dev, generator=gen) * 3
        shape = QuantShape(1, k, n)
        w4_bytes = bytes_moved("w4a16", shape, 2) + (-(-k // group) - -(-k // 128)) * n * 5 // 2  # (group 64: more)
        copies = _copies(w4_bytes, dev)
        sets = [weights(k, n, group, dev, gen) for _ in range(copies)]
        dense = [torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=gen) for _ in range(copies)]
        want = w4a16_matmul_ref(x, *sets[0], group).float()
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        default_tiles = w4_gemv_hopper.choose_tiles(k, n, num_sms(dev))
        partials = torch.empty(128 * n, dtype=torch.float32, device=dev)
        row = {"k": k, "n": n, "group": group, "weight_copies": copies, "default_tiles": default_tiles}

        def cycled(fn, pool):
            cycle = itertools.cycle(pool)
            return lambda: fn(next(cycle))

        calls = {"torch bf16": (cycled(lambda w: torch.matmul(x, w, out=out), dense), 2 * k * n + 2 * (k + n)),
                 "triton gemv": (cycled(lambda w: w4a16_matmul(x, *w, group, path="gemv", out=out, hopper=False),
                                        sets), w4_bytes),
                 "gluon gemv": (cycled(lambda w: w4a16_matmul(x, *w, group, out=out, hopper=True), sets), w4_bytes)}
        variants = {f"gluon split-K, {tiles} tiles": (w4_gemv_hopper.w4_gemv, dict(
            partials=partials, counters=tile_counters(dev), tiles=tiles)) for tiles in (1, 2, 4)}
        variants["gluon split-K, 2 tiles, run 1"] = (w4_gemv_hopper.w4_gemv, dict(
            partials=partials, counters=tile_counters(dev), tiles=2, run=1))
        for name, (fn, kw) in variants.items():
            calls[name] = (cycled(lambda w, fn=fn, kw=kw: fn(x, *w, group, out, pdl=True, **kw), sets), w4_bytes)
        calls["gluon gated"] = (cycled(lambda w: w4_gemv_fused.fused_gemv(gate_up, *w, group, gated=True), sets),
                                w4_bytes + 2 * k)
        calls["silu_and_mul + gluon"] = (cycled(lambda w: w4a16_matmul(silu_and_mul(gate_up), *w, group, out=out,
                                                                       hopper=True), sets), w4_bytes + 2 * k)
        times = time_interleaved({name: call for name, (call, _) in calls.items()}, dev)
        for name, (call, nbytes) in calls.items():
            best = times[name]["ms"] * 1e3
            row[name] = {"us_rounds": [ms * 1e3 for ms in times[name]["ms_rounds"]], "us": best,
                         "gbs": nbytes / best / 1e3, "fraction_of_bandwidth": nbytes / best / 1e3 / bandwidth}
            if name in ("gluon gated", "silu_and_mul + gluon"):  # the same answer, bit for bit
                row[name]["speedup_vs_torch"] = row["torch bf16"]["us"] / best
                row[name]["equal_to_two_kernels"] = bool(torch.equal(
                    w4_gemv_fused.fused_gemv(gate_up, *sets[0], group, gated=True),
                    w4a16_matmul(silu_and_mul(gate_up), *sets[0], group, hopper=True)))
            elif name != "torch bf16":  # each candidate's answer on the first set of weights
                out.fill_(float("nan"))
                if name == "triton gemv":
                    w4a16_matmul(x, *sets[0], group, path="gemv", out=out, hopper=False)
                elif name == "gluon gemv":
                    w4a16_matmul(x, *sets[0], group, out=out, hopper=True)
                else:
                    fn, kw = variants[name]
                    fn(x, *sets[0], group, out, pdl=True, **kw)
                torch.cuda.synchronize()
                row[name]["max_rel_error_vs_ref"] = ((out.float() - want).abs().max() / want.abs().max()).item()
                row[name]["speedup_vs_torch"] = row["torch bf16"]["us"] / best
        print({key: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "us_rounds"})
               for key, v in row.items()}, flush=True)
        runs["shapes"].append(row)
    save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "w4a16_gemv_gluon"),
                "W4A16 GEMV, M = 1, bf16",
                "bytes: bytes_moved (weights, scales, zeros, x, y); speed-ups over torch.matmul on the dense bf16 "
                "weight in the same rounds; best of three interleaved rounds, each the best of 5 graph replays of 20 "
                "calls", runs)


if __name__ == "__main__":
    main()
