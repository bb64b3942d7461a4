"""Greedy sampling's argmax by minillm's kernel (``kernels/greedy.py``, ``"kernel"``) against torch's
(``MINILLM_GREEDY_KERNEL=0``, ``"torch"``): first each alone on one row of llama2-7b's 32000 fp32 logits (time_ms:
20 calls in a CUDA graph, best of 5, the two interleaved three times), then the ``latency`` workload on llama2-7b
(dummy weights) per quantization (QUANTS, bf16 last), engines built in the order torch, kernel, kernel, torch in one
process after an uncounted first engine, async scheduling, one pass a step (BENCH=0: the kernels alone). NAME names
the JSON.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_greedy.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import compare_latency, save_result  # noqa: E402

from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.kernels.greedy import greedy_argmax  # noqa: E402

QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
ORDER = ["torch", "kernel", "kernel", "torch"]
ENGINE = {"num_scheduler_steps": 1, "async_scheduling": True}


def argmax_by(name):
    os.environ["MINILLM_GREEDY_KERNEL"] = "1" if name == "kernel" else "0"


device = torch.device("cuda")
logits = torch.randn(1, 32000, device=device) * 4
assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
alone = {"torch": [], "kernel": []}
for _ in range(3):
    alone["torch"].append(1000 * time_ms(lambda: logits.argmax(dim=-1), device))
    alone["kernel"].append(1000 * time_ms(lambda: greedy_argmax(logits), device))
print("alone, us:", alone, flush=True)
runs = {"alone_us": alone}
if os.environ.get("BENCH", "1") != "0":
    runs |= compare_latency(QUANTS, ORDER, argmax_by, lambda name: ENGINE)
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_greedy"), "latency, llama2-7b, batch 1",
            "argmax alone (us a call) and mean decode tok/s of bench_latency per engine, in the order given", runs)
