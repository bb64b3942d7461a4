"""A/B of decode-step weight prefetch into L2 (``minillm/weight_prefetch.py``, MINILLM_L2_AHEAD_MB) at batch 1:
llama2-7b, dummy weights, the ``latency`` workload, RTN INT4 (g128; the same kernels as AWQ) and bf16. Engines are
built one after another in one process in the order ABBA per dtype (A without prefetch), so that a drift of the
GPU's speed weighs on both alike (``latency_gated_ab.json``: one engine per path can mislead by 8 %).
BUDGETS (MB, comma-separated; default 40) adds an ABBA block per budget. QUANTS: "rtn-int4,bf16" by default.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_l2_ahead.py``."""
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.harness import bench_latency  # noqa: E402

budgets = [float(b) for b in os.environ.get("BUDGETS", "40").split(",")]
quants = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
runs = {"budgets_mb": budgets}
for quant in quants:
    for budget in budgets:
        key = f"{quant}, {budget:g} MB"
        order = ["off", "on", "on", "off"]
        row = runs[key] = {"order": order, "off": [], "on": []}
        for name in order:
            os.environ["MINILLM_L2_AHEAD_MB"] = str(budget if name == "on" else 0)
            result = bench_latency(model="llama2-7b", load_format="dummy", scale="gpu", num_requests=None, peers=[],
                                   batching="continuous", quantization=None if quant == "bf16" else quant)
            row[name].append(result["runs"]["minillm"]["mean_decode_tok_s"])
            print(key, name, f"{row[name][-1]:.1f} tok/s", flush=True)
            gc.collect(); torch.cuda.empty_cache()
        row["on_over_off"] = sum(row["on"]) / sum(row["off"])
        print(key, "on / off (means):", row["on_over_off"], flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "latency_l2_ahead", "latency, llama2-7b, batch 1, L2 weight prefetch",
            "mean decode tok/s of bench_latency per engine, in the order given; on = MINILLM_L2_AHEAD_MB at the "
            "budget, off = 0", runs)
