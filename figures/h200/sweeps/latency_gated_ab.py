"""A/B of the gated down_proj at batch 1 (``w4_gemv_fused.fused_gemv(gated=True)``) against SiLU-and-multiply as a
kernel of its own (``QuantLinear.takes_gated`` off), engines built one after another in one process in the order
ABBA ABBA (A the SiLU kernel), so that a drift of the GPU's speed over the run weighs on both paths alike (a first
run of four engines, ABAB, went 465, 444, 423, 434 tok/s): llama2-7b, dummy weights, RTN INT4 (g128; the same
kernels as AWQ), the ``latency`` workload.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_gated_ab.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

from minillm.quant.linear import QuantLinear  # noqa: E402

gated_check = QuantLinear.takes_gated


def switch(name):
    QuantLinear.takes_gated = gated_check if name == "gated" else (lambda self, gate_up: False)


ORDER = ["silu_kernel", "gated", "gated", "silu_kernel"] * 2
runs = {"order": ORDER, **latency_engines(ORDER, switch, "rtn-int4")}
runs["gated_over_silu_kernel"] = sum(runs["gated"]) / sum(runs["silu_kernel"])
print("gated / silu kernel (means):", runs["gated_over_silu_kernel"])
save_result(os.environ.get("OUT", "/tmp/out"), "latency_gated_ab", "latency, llama2-7b RTN INT4, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
