"""The ``latency`` workload on llama2-7b (dummy weights) with the decode attention in 64-token tiles, 4 warps, 3
stages (``"64"``, before session 28) and in 32-token tiles, 4 warps, one stage (``"32"``; ``paged_attention.GPU_LAUNCH``
sets them): per quantization (QUANTS, bf16 last), engines built in the order 64, 32, 32, 64 in one process, async
scheduling, one pass a step; a first engine, built before them all and not counted, takes the first engine in a
process's speed-up (README, session 27) on itself. NAME names the JSON. Run from the repository root on an H200:
``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_attention_tiles.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import compare_latency, save_result  # noqa: E402

from minillm.kernels import paged_attention  # noqa: E402

QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
ORDER = ["64", "32", "32", "64"]
LAUNCHES = {"64": {"block_n": 64, "num_warps": 4, "num_stages": 3},
            "32": {"block_n": 32, "num_warps": 4, "num_stages": 1}}
ENGINE = {"num_scheduler_steps": 1, "async_scheduling": True}


def tiles(name):
    paged_attention.GPU_LAUNCH = LAUNCHES[name]


runs = {"launches": LAUNCHES, **compare_latency(QUANTS, ORDER, tiles, lambda name: ENGINE)}
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_attention_tiles"),
            "latency, llama2-7b, batch 1", "mean decode tok/s of bench_latency per engine, in the order given", runs)
