"""The ``latency`` workload on llama2-7b (dummy weights), RTN INT4 and bf16, with one decode pass per scheduler step
and with eight (``num_scheduler_steps=8``, minillm/multi_step.py: the host's work per token off the GPU's critical
path), engines built in the order ABBA ABBA per dtype in one process (A: one pass a step; REPEATS=1: ABBA once;
NAME names the JSON). The host's share: at session 22's code the batch-1 graph's GPU time alone is 1.785 ms a token at
INT4 and 3.770 at bf16 (figures/h200/sweeps/decode_graph_o_proj_one_tile.json), where a one-pass step's tok/s here say
1.92 and 3.93 ms (latency_o_proj_one_tile.json): ~0.15 ms a token.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_multi_step.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

REPEATS = int(os.environ.get("REPEATS", "2"))
order = ["one_pass", "eight_passes", "eight_passes", "one_pass"] * REPEATS
runs, mean = {}, {}
for quant in ("rtn-int4", "bf16"):
    runs[quant] = {"order": order, **latency_engines(order, lambda name: None, quant,
                                                     lambda name: {"num_scheduler_steps": 8 if "eight" in name else 1})}
    for name in ("one_pass", "eight_passes"):
        mean[quant, name] = sum(runs[quant][name]) / len(runs[quant][name])
    print(quant, {name: round(mean[quant, name], 1) for name in ("one_pass", "eight_passes")}, flush=True)
for name in ("one_pass", "eight_passes"):
    runs[f"int4_over_bf16_{name}"] = mean["rtn-int4", name] / mean["bf16", name]
    print(name, "INT4 / bf16:", runs[f"int4_over_bf16_{name}"], flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_multi_step"),
            "latency, llama2-7b, batch 1", "mean decode tok/s of bench_latency per engine, in the order given", runs)
