"""The ``latency`` workload on llama2-7b (dummy weights), RTN INT4 and bf16, with synchronous and async scheduling
(``EngineConfig.async_scheduling``, minillm/multi_step.py's ``chain_steps``: a decode batch's successor is launched
before its tokens are read), one decode pass a scheduler step and eight; engines built in the order ABBA per dtype and
pass count in one process (REPEATS=2: ABBA ABBA; PASSES=1 one pass only; ORDER=async,async: async engines only;
NAME names the JSON; QUANTS: the quantizations, bf16 last, e.g. rtn-int4-head,rtn-int4,bf16). The host's share before it: a one-pass step
paid ~0.15 ms a token in series with the GPU (latency_multi_step.py's docstring).
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_async.py``."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

REPEATS = int(os.environ.get("REPEATS", "1"))
QUANTS = os.environ.get("QUANTS", "rtn-int4,bf16").split(",")
runs, mean = {}, {}
for passes in [int(p) for p in os.environ.get("PASSES", "1,8").split(",")]:
    order = os.environ.get("ORDER", "sync,async,async,sync").split(",") * REPEATS
    for quant in QUANTS:
        tok_s = latency_engines(order, lambda name: None, quant, lambda name: {
            "num_scheduler_steps": passes, "async_scheduling": name == "async"})
        runs[f"{quant}_{passes}_pass"] = {"order": order, **tok_s}
        for name in set(order):
            mean[quant, passes, name] = sum(tok_s[name]) / len(tok_s[name])
        print(quant, passes, {name: round(mean[quant, passes, name], 1) for name in set(order)}, flush=True)
    for name in set(order):
        for quant in QUANTS[:-1]:  # (the int4 key as before for rtn-int4)
            key = f"{'int4' if quant == 'rtn-int4' else quant}_over_bf16_{passes}_pass_{name}"
            runs[key] = mean[quant, passes, name] / mean["bf16", passes, name]
            print(passes, name, f"{quant} / bf16:", runs[key], flush=True)
    for quant in QUANTS if set(order) == {"sync", "async"} else ():
        runs[f"{quant}_{passes}_pass_async_over_sync"] = mean[quant, passes, "async"] / mean[quant, passes, "sync"]
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "latency_async"), "latency, llama2-7b, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given", runs)
