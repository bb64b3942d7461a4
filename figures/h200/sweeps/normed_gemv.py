"""Issue 6: the residual add and RMSNorm done by the INT4 GEMV after them (``w4_gemv_hopper.normed_gemv``) against
``fused_layer_ops.rms_norm`` then the GEMV, on the H200.

1. Kernels: Llama-2-7B's qkv_proj (4096 x 12288) and gate_up_proj (4096 x 22016), group 128, one row; each timed call
   cycles through enough weight copies to fill twice the L2 (``bench/quant_kernels.py``), 20 calls a CUDA graph,
   three interleaved rounds (``time_interleaved``).
2. Engines: ``bench_latency`` on llama2-7b (dummy weights, RTN INT4, the ``latency`` workload), built in the order
   ABBA ABBA in one process (A: the norm's own kernel, ``QuantLinear.takes_normed`` off), so that a drift of the GPU's
   speed weighs on both alike.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/normed_gemv.py``."""
import gc
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.harness import bench_latency  # noqa: E402
from minillm.bench.kernels import time_interleaved  # noqa: E402
from minillm.bench.quant_kernels import QuantShape, _copies, bytes_moved  # noqa: E402
from minillm.kernels import w4_gemv_hopper  # noqa: E402
from minillm.kernels.fused_layer_ops import rms_norm  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul  # noqa: E402
from minillm.quant.linear import QuantLinear  # noqa: E402

dev = torch.device("cuda")
runs = {"kernels": [], "engines": {}}
for k, n in ((4096, 12288), (4096, 22016)):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
    residual = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen) * 4
    weight = 1 + 0.3 * torch.randn(k, dtype=torch.bfloat16, device=dev, generator=gen)
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(k // 128, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (k // 128, n), device=dev, generator=gen)))
            for _ in range(_copies(bytes_moved("w4a16", QuantShape(1, k, n), 2), dev))]
    cycle = itertools.cycle(sets)

    def two_kernels():
        normed, _ = rms_norm(x, weight, 1e-5, residual)
        return w4a16_matmul(normed, *next(cycle), 128, hopper=True)

    calls = {"rms_norm + gemv": two_kernels,
             "normed gemv": lambda: w4_gemv_hopper.normed_gemv(x, residual, weight, 1e-5, *next(cycle), 128)[0],
             "gemv alone": lambda: w4a16_matmul(x, *next(cycle), 128, hopper=True)}
    times = time_interleaved(calls, dev)
    row = {"k": k, "n": n, **{name: {"us": t["ms"] * 1e3, "us_rounds": [ms * 1e3 for ms in t["ms_rounds"]]}
                              for name, t in times.items()}}
    row["normed_over_two_kernels"] = row["rms_norm + gemv"]["us"] / row["normed gemv"]["us"]
    print({key: v["us"] if isinstance(v, dict) else v for key, v in row.items()}, flush=True)
    runs["kernels"].append(row)
    del sets, cycle
    gc.collect(); torch.cuda.empty_cache()

takes_normed = QuantLinear.takes_normed
order = ["norm_kernel", "normed", "normed", "norm_kernel"] * 2
engines = runs["engines"] = {"order": order, "norm_kernel": [], "normed": []}
for name in order:
    QuantLinear.takes_normed = takes_normed if name == "normed" else (lambda self, x, residual, weight: False)
    result = bench_latency(model="llama2-7b", load_format="dummy", scale="gpu", num_requests=None, peers=[],
                           batching="continuous", quantization="rtn-int4")
    engines[name].append(result["runs"]["minillm"]["mean_decode_tok_s"])
    print(name, f"{engines[name][-1]:.1f} tok/s", flush=True)
    gc.collect(); torch.cuda.empty_cache()
QuantLinear.takes_normed = takes_normed
engines["normed_over_norm_kernel"] = sum(engines["normed"]) / sum(engines["norm_kernel"])
print("normed / norm kernel (means):", engines["normed_over_norm_kernel"])
save_result(os.environ.get("OUT", "/tmp/out"), "normed_gemv", "INT4 GEMV with the residual add and RMSNorm, batch 1",
            "kernels: us per call, best of three interleaved rounds, weights cycled through twice the L2; engines: "
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
