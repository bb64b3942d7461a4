"""A/B of RoPE and the K/V store done by the decode attention kernel itself (``paged_decode_attention(new_kv=...)``,
``kv/paged_triton.py``) against ``rope_store_kv`` followed by the decode kernel (MINILLM_ROPE_IN_DECODE=0): batch-1
``latency`` on llama2-7b (dummy weights), RTN INT4 and bf16, engines built in the order ABBA ABBA in one process per
dtype (A: two kernels), so that a drift of the GPU's speed weighs on both alike.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_rope_in_decode.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

from minillm.kv import paged_triton  # noqa: E402


def switch(name):
    paged_triton.ROPE_IN_DECODE = name == "in_decode"


runs = {}
for quant in os.environ.get("QUANTS", "rtn-int4,bf16").split(","):
    order = ["two_kernels", "in_decode", "in_decode", "two_kernels"] * 2
    row = runs[quant] = {"order": order, **latency_engines(order, switch, quant)}
    row["in_decode_over_two_kernels"] = sum(row["in_decode"]) / sum(row["two_kernels"])
    print(quant, "in decode / two kernels (means):", row["in_decode_over_two_kernels"], flush=True)
paged_triton.ROPE_IN_DECODE = True
save_result(os.environ.get("OUT", "/tmp/out"), "latency_rope_in_decode", "latency, llama2-7b, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
