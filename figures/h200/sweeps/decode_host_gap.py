"""Where a batch-1 decode token's time goes beyond its CUDA graph: llama2-7b (dummy weights), RTN INT4 and bf16, one
pass a scheduler step and eight (``num_scheduler_steps``), a 128-token prompt and 96 tokens decoded under
torch.profiler (CPU and CUDA), after a warm-up request. From the Chrome trace: per decoded token, the wall time, the GPU
time inside graph replays (kernels whose correlation id is a ``cudaGraphLaunch``'s), the GPU time of everything else
(copies, sampling, by name) and the GPU's idle time; and the host's runtime calls per token (count and time by name).
The profiler's own work inflates the host's share: a one-pass INT4 token took 2.59 ms here, 1.92 ms unprofiled
(latency_o_proj_one_tile.json); the GPU's ops and their names are what this is for.

CUDA_ONLY=1 traces the GPU alone (no CPU ops: less of the profiler's own host work), QUANTS (e.g. rtn-int4,bf16)
and PASSES (e.g. 1,8) pick the engines, NAME names the JSON. The engines schedule asynchronously where they would by
default.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_host_gap.py``."""
import collections
import gc
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402

TOKENS, SKIP = 96, 16  # tokens decoded under the profiler; the first SKIP tokens' time is left out


def analyse(trace: dict) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    graph_ids = {e["args"].get("correlation") for e in events
                 if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"}
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    replays = [e for e in gpu if e["args"].get("correlation") in graph_ids]
    # Steady state: from the start of replay SKIP's first kernel to the end of the last replay's last kernel.
    first = {}
    for e in replays:
        first[e["args"]["correlation"]] = min(e["ts"], first.get(e["args"]["correlation"], e["ts"]))
    first_ts = sorted(first.values())
    t0, t1 = first_ts[SKIP], max(e["ts"] + e["dur"] for e in replays)
    tokens = len(first_ts) - SKIP
    inside = [e for e in gpu if t0 <= e["ts"] < t1]
    busy, end = 0.0, t0
    for e in inside:  # union of the GPU ops' intervals
        s, f = max(e["ts"], end), e["ts"] + e["dur"]
        if f > s:
            busy += f - s
            end = f
    in_graph = sum(e["dur"] for e in inside if e["args"].get("correlation") in graph_ids)

    def per(value):
        return round(value / tokens, 2)

    def by_name(selected, most=None, width=None):
        """Calls and time a token per name (cut to ``width`` characters) of ``selected``, most time first."""
        totals = collections.defaultdict(lambda: [0, 0.0])
        for e in selected:
            totals[e["name"][:width]][0] += 1
            totals[e["name"][:width]][1] += e["dur"]
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:most]
        return {name: {"calls": per(count), "us": per(time)} for name, (count, time) in ranked}

    window = [e for e in events if t0 <= e["ts"] < t1]
    return {"tokens": tokens, "wall_us_per_token": per(t1 - t0), "gpu_busy_us_per_token": per(busy),
            "gpu_idle_us_per_token": per(t1 - t0 - busy),
            "graph_kernels_us_per_token (summed durations, overlaps counted twice)": per(in_graph),
            "outside_graph_per_token": by_name((e for e in inside if e["args"].get("correlation") not in graph_ids),
                                               width=70),
            "runtime_calls_per_token": by_name((e for e in window if e.get("cat") == "cuda_runtime"), most=12),
            "cpu_ops_per_token (inclusive)": by_name((e for e in window if e.get("cat") == "cpu_op"), most=15)}


CUDA_ONLY = os.environ.get("CUDA_ONLY") == "1"
ACTIVITIES = [ProfilerActivity.CUDA] if CUDA_ONLY else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
QUANTS = [None if q == "bf16" else q for q in os.environ.get("QUANTS", "rtn-int4,bf16").split(",")]
PASSES = [int(p) for p in os.environ.get("PASSES", "1,8").split(",")]
runs = {}
for quant in QUANTS:
    for steps in PASSES:
        name = f"{quant or 'bf16'}_{steps}_pass{'es' if steps > 1 else ''}"
        llm = LLM("llama2-7b", load_format="dummy", quantization=quant, batching="continuous", max_num_seqs=1,
                  num_kv_blocks=300, seed=0, num_scheduler_steps=steps)
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        llm.generate([list(range(100, 228))], params, use_tqdm=False)
        with profile(activities=ACTIVITIES) as prof:
            llm.generate([list(range(300, 428))], params, use_tqdm=False)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            try:
                runs[name] = analyse(json.load(open(f.name)))
            except (IndexError, ValueError) as e:  # e.g. a trace without the graph launches' correlation ids
                runs[name] = {"error": repr(e)}
        if "error" in runs[name]:
            print(name, "not analysed:", runs[name]["error"], flush=True)
        else:
            print(name, {k: v for k, v in runs[name].items() if "per_token" in k and not isinstance(v, dict)},
                  flush=True)
            print("  outside:", list(runs[name]["outside_graph_per_token"].items())[:6], flush=True)
            print("  runtime:", list(runs[name]["runtime_calls_per_token"].items())[:6], flush=True)
        del llm  # (an engine not analysed is freed too, before the next is built)
        gc.collect()
        torch.cuda.empty_cache()
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "decode_host_gap"), "latency, llama2-7b, batch 1",
            "per decoded token (after the first 16) of one 128 + 96 request under torch.profiler"
            + (" (CUDA activity only)" if CUDA_ONLY else ""), runs)
