"""EXPERIMENT (session 23): the W4A16 GEMV's HFMA2 body (w4_gemv_hopper) and tensor-core body (w4_gemv_mma), once each
at Llama-2-7B's 4096 x 11008 and 11008 x 4096 between cudaProfilerStart/Stop, for ncu (``--profile-from-start off``);
without ncu (TIME=1), both timed in CUDA graphs of 20 calls over 4 weight copies (cold: 92 MB > the 50 MB L2)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "kernels"))
from test_quant_matmul import int4_problem  # noqa: E402

from minillm.kernels import w4_gemv_hopper as hopper, w4_gemv_mma as mma  # noqa: E402

bodies = {"hfma2": hopper.gemv, "mma": mma.gemv}
for k, n in ((4096, 11008), (11008, 4096), (4096, 22016), (4096, 4096)):
    copies = [int4_problem(1, k, n, 128, torch.bfloat16, seed=i)[:4] for i in range(4)]
    out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
    for fn in bodies.values():
        fn(*copies[0], 128, out)
    torch.cuda.synchronize()
    if not os.environ.get("TIME"):
        for fn in bodies.values():
            torch.cuda.cudart().cudaProfilerStart()
            fn(*copies[1], 128, out)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        continue
    graphs = {}
    for name, fn in bodies.items():
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for i in range(20):
                fn(*copies[i % 4], 128, out)
    times = {name: [] for name in bodies}
    for r in range(10):
        for name in (list(bodies) if r % 2 == 0 else list(reversed(bodies))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000 / 20)
    mean = {name: sum(t[2:]) / len(t[2:]) for name, t in times.items()}
    print(f"{k}x{n}", {name: round(v, 2) for name, v in mean.items()}, "hfma2/mma", round(mean["hfma2"] / mean["mma"], 3),
          flush=True)
