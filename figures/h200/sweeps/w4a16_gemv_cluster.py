"""Issue 6: the Gluon W4A16 GEMV's split-K fix-up on chip. Each column tile's K splits launched as one thread-block
cluster (``w4_gemv(cluster=True)``): the partials go into the first CTA's shared memory (distributed shared memory) and
it sums them, where the default stores them to L2, fences, counts arrivals with an atomic and has the last program
read them back. M = 1, bf16, group 128, against torch's bf16 matmul in the same rounds; each timed call cycles through
enough weight copies to fill twice the L2; best of three interleaved rounds of 20 calls a CUDA graph, launched with
PDL as in a decode step. Every variant's answer is compared with ``w4a16_matmul_ref`` (y poisoned before).
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/w4a16_gemv_cluster.py``."""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import time_interleaved  # noqa: E402
from minillm.bench.quant_kernels import QuantShape, _copies, bytes_moved  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels import w4_gemv_hopper  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul_ref  # noqa: E402
from minillm.kernels.split_k import tile_counters  # noqa: E402

dev = torch.device("cuda")
bandwidth = measure_bandwidth(dev)
runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
for k, n in ((4096, 11008), (4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096)):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
    nbytes = bytes_moved("w4a16", QuantShape(1, k, n), 2)
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(k // 128, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (k // 128, n), device=dev, generator=gen)))
            for _ in range(_copies(nbytes, dev))]
    dense = [torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=gen) for _ in range(len(sets) * 4)]
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    partials = torch.empty(128 * n, dtype=torch.float32, device=dev)
    want = w4a16_matmul_ref(x, *sets[0], 128).float()

    def gluon(w, cluster):
        w4_gemv_hopper.w4_gemv(x, *w, 128, out, partials, tile_counters(dev), True, cluster=cluster)

    cycles = {name: itertools.cycle(pool) for name, pool in (("d", dense), ("a", sets), ("b", sets))}
    calls = {"torch bf16": lambda: torch.matmul(x, next(cycles["d"]), out=out),
             "gluon split-K": lambda: gluon(next(cycles["a"]), False),
             "gluon cluster": lambda: gluon(next(cycles["b"]), True)}
    times = time_interleaved(calls, dev)
    row = {"k": k, "n": n, "splits": w4_gemv_hopper.splits_needed(k)}
    for name, t in times.items():
        row[name] = {"us": t["ms"] * 1e3, "us_rounds": [ms * 1e3 for ms in t["ms_rounds"]]}
        if name != "torch bf16":
            out.fill_(float("nan"))
            gluon(sets[0], name == "gluon cluster")
            torch.cuda.synchronize()
            row[name]["max_rel_error_vs_ref"] = ((out.float() - want).abs().max() / want.abs().max()).item()
            row[name]["speedup_vs_torch"] = row["torch bf16"]["us"] / row[name]["us"]
            row[name]["fraction_of_bandwidth"] = nbytes / (row[name]["us"] * 1e3) / bandwidth
    print({key: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "us_rounds"})
           for key, v in row.items()}, flush=True)
    runs["shapes"].append(row)
    del sets, dense
    torch.cuda.empty_cache()
save_result(os.environ.get("OUT", "/tmp/out"), "w4a16_gemv_cluster", "W4A16 GEMV, M = 1, bf16, group 128",
            "us per call, best of three interleaved rounds of 20-call CUDA graphs; speed-ups over torch.matmul on the "
            "dense bf16 weight in the same rounds", runs)
