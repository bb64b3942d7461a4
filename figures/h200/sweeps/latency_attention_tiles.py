"""The ``latency`` workload on llama2-7b (dummy weights) with the decode attention in 64-token tiles, 4 warps, 3
stages (``"64"``, before session 28) and in 32-token tiles, 4 warps, one stage (``"32"``; ``paged_attention.GPU_LAUNCH``
sets them): per quantization (QUANTS, bf16 last), engines built in the order 64, 32, 32, 64 in one process, async
scheduling, one pass a step; a first engine, built before them all and not counted, takes the first engine in a
process's speed-up (README, session 27) on itself. NAME names the JSON. Run from the repository root on an H200:
``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_attention_tiles.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

from minillm.kernels import paged_attention  # noqa: E402

QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
ORDER = ["64", "32", "32", "64"]
LAUNCHES = {"64": {"block_n": 64, "num_warps": 4, "num_stages": 3},
            "32": {"block_n": 32, "num_warps": 4, "num_stages": 1}}
ENGINE = {"num_scheduler_steps": 1, "async_scheduling": True}


def tiles(name):
    paged_attention.GPU_LAUNCH = LAUNCHES[name]


runs, mean = {"launches": LAUNCHES}, {}
latency_engines(["64"], tiles, QUANTS[0], lambda name: ENGINE)  # the uncounted first engine
for quant in QUANTS:
    tok_s = latency_engines(ORDER, tiles, quant, lambda name: ENGINE)
    runs[quant] = {"order": ORDER, **tok_s}
    for name in LAUNCHES:
        mean[quant, name] = sum(tok_s[name]) / len(tok_s[name])
    runs[f"{quant}_32_over_64"] = mean[quant, "32"] / mean[quant, "64"]
    print(quant, {name: round(mean[quant, name], 1) for name in LAUNCHES}, flush=True)
for quant in QUANTS[:-1]:
    for name in LAUNCHES:
        runs[f"{quant}_over_bf16_{name}"] = mean[quant, name] / mean["bf16", name]
        print(name, f"{quant} / bf16:", round(runs[f"{quant}_over_bf16_{name}"], 4), flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_attention_tiles"),
            "latency, llama2-7b, batch 1", "mean decode tok/s of bench_latency per engine, in the order given", runs)
