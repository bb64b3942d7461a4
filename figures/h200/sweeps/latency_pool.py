"""The ``latency`` workload on llama2-7b (dummy weights) with bench_latency's KV cache (most of the GPU's memory,
``"default"``) and with 300 blocks (``"small"``: 4800 tokens, more than a request of the workload holds), per
quantization (QUANTS, bf16 last): engines built in the order default, small, small, default in one process after an
uncounted first engine, async scheduling, one pass a step. decode_sustained.json found RTN INT4's decode graph ~3 %
slower with the large cache, bf16's not. NAME names the JSON.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_pool.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
ORDER = ["default", "small", "small", "default"]
POOLS = {"default": {}, "small": {"num_kv_blocks": 300}}


def engine(name):
    return {"num_scheduler_steps": 1, "async_scheduling": True, **POOLS[name]}


runs, mean = {"pools": POOLS}, {}
latency_engines(["default"], lambda name: None, QUANTS[0], engine)  # the uncounted first engine
for quant in QUANTS:
    tok_s = latency_engines(ORDER, lambda name: None, quant, engine)
    runs[quant] = {"order": ORDER, **tok_s}
    for name in POOLS:
        mean[quant, name] = sum(tok_s[name]) / len(tok_s[name])
    runs[f"{quant}_small_over_default"] = mean[quant, "small"] / mean[quant, "default"]
    print(quant, {name: round(mean[quant, name], 1) for name in POOLS}, flush=True)
for quant in QUANTS[:-1]:
    for name in POOLS:
        runs[f"{quant}_over_bf16_{name}"] = mean[quant, name] / mean["bf16", name]
        print(name, f"{quant} / bf16:", round(runs[f"{quant}_over_bf16_{name}"], 4), flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_pool"), "latency, llama2-7b, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
