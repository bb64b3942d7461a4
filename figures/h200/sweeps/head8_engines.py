"""Why rtn-int4-head8's engines differ (``latency_head8.json``: the first built in a process ran ~650 tok/s, the second
~633): two engines built one after the other in one process, each graph replayed back to back (rounds ABAB...), the
head's W8A16 GEMV timed in each graph by the profiler, and the config the autotuner chose for it, with the time of
each of the autotuner's configs as it measured them (outside a graph).

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/head8_engines.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402
from decode_graph_timeline import build, replay_ms  # noqa: E402  (its own run is under __main__)

from minillm.kernels import quant_matmul  # noqa: E402

ROUNDS, REPLAYS = 6, 100


def head_us(graph):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    times = [e.time_range.end - e.time_range.start for e in prof.events() if "_w8_gemv" in e.name]
    return sum(times) / max(1, len(times))


def autotuner_state():
    tuned = quant_matmul._KERNELS["w8_gemv"][1]
    return {"cache": {str(k): str(v) for k, v in tuned.cache.items()},
            "timings": {str(c): [round(t, 5) for t in (v if isinstance(v, (list, tuple)) else [v])]
                        for c, v in (getattr(tuned, "configs_timings", None) or {}).items()}}


engines, runs = [], {}
for i in range(2):
    llm, graph, tokens = build("rtn-int4-head8", {})
    engines.append((llm, graph))
    runs[f"engine{i}"] = {"autotuner_after_build": autotuner_state(), "tokens_as_engine0": tokens == runs.get(
        "engine0", {}).get("tokens", tokens), "tokens": tokens}
times = [[], []]
for r in range(ROUNDS):
    for i in (range(2) if r % 2 == 0 else reversed(range(2))):
        times[i].append(replay_ms(engines[i][1], REPLAYS))
for i in range(2):
    runs[f"engine{i}"].update(ms_per_token_rounds=times[i], ms_per_token=sum(times[i]) / ROUNDS,
                              head_gemv_us=head_us(engines[i][1]))
    del runs[f"engine{i}"]["tokens"]
    print(i, runs[f"engine{i}"]["ms_per_token"], runs[f"engine{i}"]["head_gemv_us"],
          runs[f"engine{i}"]["autotuner_after_build"]["cache"], flush=True)
for llm, _ in engines:
    llm.close()
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "head8_engines"), "latency, llama2-7b, batch 1",
            "two rtn-int4-head8 engines in one process: GPU ms a token (graph replays, rounds ABAB), the head's GEMV "
            "in each graph, the W8A16 autotuner's choice", runs)
