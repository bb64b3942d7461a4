"""Where a batch-1 decode step's GPU time goes, kernel by kernel, on llama2-7b dummy at TP=1 or TP=2.

tp_decode_profile.py sums each kernel's duration, but with programmatic dependent launch a GEMV starts
while the kernel ahead of it runs and waits, so durations overlap and their sum overstates the step.
This script takes one decode-graph replay's kernels on rank 0 from a torch.profiler trace and charges each
kernel only the time from the later of its start and the previous kernel's end to its own end (its share
of the step's critical path), plus the idle gap before it. Usage: python tp_timeline.py TP OUTFILE"""
import json, os, sys, tempfile
import torch
from minillm import LLM, SamplingParams
from tp_decode_profile import profiled  # this folder: the script's own


def timeline(runner, replays=5):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiled(runner, replays).export_chrome_trace(path)
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    per = len(events) // replays
    one = events[-per:]  # the last replay
    t0, prev_end, rows = one[0]["ts"], one[0]["ts"], []
    for e in one:
        start, end = e["ts"], e["ts"] + e["dur"]
        rows.append(dict(name=e["name"][:60], start=round(start - t0, 2), dur=round(e["dur"], 2),
                         gap=round(max(0.0, start - prev_end), 2),
                         charged=round(max(0.0, end - max(start, prev_end)), 2)))
        prev_end = max(prev_end, end)
    return dict(kernels_per_replay=per, replay_us=round(prev_end - t0, 1), rows=rows)


def summary(tl):
    by = {}
    for r in tl["rows"]:
        k = r["name"].split("(")[0][:40]
        s = by.setdefault(k, dict(calls=0, charged=0.0, gap=0.0, dur=0.0))
        s["calls"] += 1; s["charged"] += r["charged"]; s["gap"] += r["gap"]; s["dur"] += r["dur"]
    ranked = sorted(by.items(), key=lambda kv: -kv[1]["charged"] - kv[1]["gap"])
    return {k: {a: round(b, 1) for a, b in v.items()} for k, v in ranked}


if __name__ == "__main__":
    tp, out = int(sys.argv[1]), sys.argv[2]
    llm = LLM("llama2-7b", load_format="dummy", batching="continuous", tensor_parallel_size=tp,
              memory_budget=100 * 2**30, max_model_len=2048)
    llm.generate([list(range(100, 228))], SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    w = llm.engine.workers
    tl = timeline(llm.engine.runner) if w is None else w.run_everywhere(llm.engine.runner, timeline)
    tl["summary"] = summary(tl)
    tl["tp"], tl["env"] = tp, {k: v for k, v in os.environ.items() if k.startswith("MINILLM_")}
    print("tp", tp, "replay us", tl["replay_us"], "kernels", tl["kernels_per_replay"])
    for k, v in tl["summary"].items(): print(f"  {k:42s} {v}")
    json.dump(tl, open(out, "w"), indent=0)
    llm.close()
