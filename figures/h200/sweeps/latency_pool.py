"""The ``latency`` workload on llama2-7b (dummy weights) with bench_latency's KV cache (most of the GPU's memory,
``"default"``) and with 300 blocks (``"small"``: 4800 tokens, more than a request of the workload holds), per
quantization (QUANTS, bf16 last): engines built in the order default, small, small, default in one process after an
uncounted first engine, async scheduling, one pass a step. Written because decode_sustained.json's RTN INT4 graph was
~3 % slower with the large cache (bf16's not); this run found no difference (631.2 against 630.3 tok/s): that engine
was the process's third, and the first engine in a process is the fast one (decode_engine_order.json). NAME names
the JSON.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_pool.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import compare_latency, save_result  # noqa: E402

QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
ORDER = ["default", "small", "small", "default"]
POOLS = {"default": {}, "small": {"num_kv_blocks": 300}}


def engine(name):
    return {"num_scheduler_steps": 1, "async_scheduling": True, **POOLS[name]}


runs = {"pools": POOLS, **compare_latency(QUANTS, ORDER, lambda name: None, engine)}
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_pool"), "latency, llama2-7b, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
