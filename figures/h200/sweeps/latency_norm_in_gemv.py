"""A/B of the RMSNorms between a batch-1 INT4 layer's GEMVs folded into them (``model/norm_folding.py``,
``kernels/w4_gemv_norms.py``) against the norm kernels (MINILLM_NORM_IN_GEMV=0): ``latency`` on llama2-7b (dummy
weights) at RTN INT4, engines built in the order ABBA ABBA in one process (A: the norm kernels), so that a drift of the
GPU's speed weighs on both alike; then two bf16 engines (which fold nothing) for the INT4 / bf16 ratio of this run.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_norm_in_gemv.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

from minillm.model import norm_folding  # noqa: E402


def switch(name):
    norm_folding.ENABLED = name != "norm_kernels"


order = ["norm_kernels", "folded", "folded", "norm_kernels"] * 2
int4 = {"order": order, **latency_engines(order, switch, "rtn-int4")}
mean = {name: sum(int4[name]) / len(int4[name]) for name in ("folded", "norm_kernels")}
int4["folded_over_norm_kernels"] = mean["folded"] / mean["norm_kernels"]
print("folded / norm kernels (means):", int4["folded_over_norm_kernels"], flush=True)
norm_folding.ENABLED = True
bf16 = {"order": ["bf16", "bf16"], **latency_engines(["bf16", "bf16"], switch, "bf16")}
mean["bf16"] = sum(bf16["bf16"]) / 2
runs = {"rtn-int4": int4, "bf16": bf16, "int4_folded_over_bf16": mean["folded"] / mean["bf16"],
        "int4_norm_kernels_over_bf16": mean["norm_kernels"] / mean["bf16"]}
print("INT4 folded / bf16:", runs["int4_folded_over_bf16"], flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "latency_norm_in_gemv", "latency, llama2-7b, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
