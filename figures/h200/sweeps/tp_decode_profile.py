"""Batch-1 decode on llama2-7b dummy: TPOT from generate, and pure GPU time per decode graph replay
(both ranks replaying back to back), for TP=1, TP=2 NCCL, TP=2 symm_mem. Usage: python tp_decode_profile.py TP OUTFILE"""
import json, os, sys, time
import torch
from minillm import LLM, SamplingParams

def replay_ms(runner, n):
    g = runner.graphs.graphs[runner.graphs.sizes[0]]
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

def profiled(runner, n):
    """torch.profiler's record of n decode-graph replays on this rank, after a few unrecorded ones
    (also tp_timeline.py's)."""
    from torch.profiler import ProfilerActivity, profile
    g = runner.graphs.graphs[runner.graphs.sizes[0]]
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): g.replay()
        torch.cuda.synchronize()
    return prof


def profile_replays(runner, n=20):
    """Kernels of n decode-graph replays on this rank: [(name, calls per replay, us per replay)]."""
    prof = profiled(runner, n)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:120], e.count / n, t / n))
    rows.sort(key=lambda r: -r[2])
    return rows


if __name__ == "__main__":
    tp, out = int(sys.argv[1]), sys.argv[2]
    llm = LLM("llama2-7b", load_format="dummy", batching="continuous", tensor_parallel_size=tp, memory_budget=100 * 2**30, max_model_len=2048)
    p = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    q = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 228))
    llm.generate([prompt], p, use_tqdm=False)
    r = {}
    for name, params in (("t256", p), ("t1", q)):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); llm.generate([prompt], params, use_tqdm=False); ts.append(time.perf_counter() - t0)
        r[name] = min(ts)
    r["tpot_ms"] = (r["t256"] - r["t1"]) / 255 * 1e3
    w = llm.engine.workers
    r["replay_ms"] = replay_ms(llm.engine.runner, 200) if w is None else w.run_everywhere(llm.engine.runner, replay_ms, 200)
    r["allreduce"] = os.environ.get("MINILLM_TP_ALLREDUCE", "default"); r["tp"] = tp
    print(r, flush=True)
    r["kernels"] = profile_replays(llm.engine.runner) if w is None else w.run_everywhere(llm.engine.runner, profile_replays)
    print("total us/replay", sum(k[2] for k in r["kernels"]), "kernels/replay", sum(k[1] for k in r["kernels"]))
    for k in r["kernels"][:14]: print(f"  {k[2]:8.1f} us {k[1]:5.1f}x {k[0]}")
    json.dump(r, open(out, "w"))
    llm.close()
