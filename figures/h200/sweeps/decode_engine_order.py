"""Why the first INT4 engine in a process decodes ~3 % faster than a later one (latency_pool.json, decode_sustained.json):
is it the engine (where its weights landed) or the process (a state left once another engine was built)? The RTN INT4
llama2-7b batch-1 decode graph (decode_graph_timeline.py's engine) of engine A replayed alone, then A and a second
engine B in turns while both live, then A again after B is freed; 3 rounds of 200 replays each time. BIG_ALLOC=1: A
also after 100 GB were allocated, written and freed before B is built (the memory another engine maps, alone).

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_engine_order.py``."""
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402
from decode_graph_timeline import build, replay_ms  # noqa: E402

REPLAYS, ROUNDS = 200, 3
runs = {}
a = build("rtn-int4", {})
runs["a_alone"] = [replay_ms(a[1], REPLAYS) for _ in range(ROUNDS)]
print("A alone", runs["a_alone"], flush=True)
if os.environ.get("BIG_ALLOC", "0") != "0":  # is it the memory another engine maps? 100 GB mapped, written, freed
    big = torch.empty(100 * 2**30, dtype=torch.uint8, device="cuda").fill_(1)
    del big
    torch.cuda.empty_cache()
    runs["a_after_big_alloc"] = [replay_ms(a[1], REPLAYS) for _ in range(ROUNDS)]
    print("A after 100 GB allocated and freed", runs["a_after_big_alloc"], flush=True)
b = build("rtn-int4", {})
runs["a_with_b"], runs["b_with_a"] = [], []
for _ in range(ROUNDS):
    runs["a_with_b"].append(replay_ms(a[1], REPLAYS))
    runs["b_with_a"].append(replay_ms(b[1], REPLAYS))
print("A with B", runs["a_with_b"], "B with A", runs["b_with_a"], flush=True)
b[0].close()
del b
gc.collect()
torch.cuda.empty_cache()
runs["a_after_b"] = [replay_ms(a[1], REPLAYS) for _ in range(ROUNDS)]
print("A after B", runs["a_after_b"], flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "decode_engine_order", "latency, llama2-7b, batch 1",
            f"GPU ms a token: engine A's batch-1 decode graph, {REPLAYS} replays back to back, {ROUNDS} rounds, alone, "
            "beside a second engine B, and after B was freed", runs)
