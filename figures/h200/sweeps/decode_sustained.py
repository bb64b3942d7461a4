"""Whether the batch-1 decode graph runs slower when replayed for as long as ``bench_latency`` decodes: the RTN INT4
llama2-7b graph (decode_graph_timeline.py's engine) replayed 100 times, then 1000 back to back (1.5 s, about a
latency run's five requests), then 100 again, with the SM clock, power and temperature nvidia-smi
reports around each; the same for bf16; then both again with bench_latency's KV cache (most of the GPU's memory)
where the others hold 300 blocks (does a large pool, its blocks far apart, slow the graph?).

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_sustained.py``."""
import gc
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402
from decode_graph_timeline import build, replay_ms  # noqa: E402


def gpu_state():
    """The SM clock, power draw and temperature nvidia-smi reports now."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True).stdout.strip()


runs = {}
for name, quant, pool in (("rtn-int4", "rtn-int4", dict(num_kv_blocks=300)), ("bf16", None, dict(num_kv_blocks=300)),
                          ("rtn-int4_large_pool", "rtn-int4", {}), ("bf16_large_pool", None, {})):
    llm, graph, _ = build(quant, {}, pool)
    row = {"state_before": gpu_state()}
    for label, replays in (("first_100", 100), ("sustained_1000", 1000), ("last_100", 100)):
        row[f"{label}_ms"] = replay_ms(graph, replays)
        row[f"state_after_{label}"] = gpu_state()
    runs[name] = row
    print(name, row, flush=True)
    del llm, graph
    gc.collect()
    torch.cuda.empty_cache()
save_result(os.environ.get("OUT", "/tmp/out"), "decode_sustained", "latency, llama2-7b, batch 1",
            "GPU ms a token over runs of back-to-back replays of the batch-1 decode graph", runs)
