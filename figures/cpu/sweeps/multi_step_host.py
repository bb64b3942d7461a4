"""Host work per token that multi-step decoding saves (minillm/multi_step.py): batch-1 greedy decode of the
tiny dummy model on the CPU, k = num_scheduler_steps 1 and 8, 256 tokens per run, best of 3 alternated rounds.
Each token's wall time is split into the forward passes (the model, timed around PagedRunner.forward_here) and
the rest: scheduling, the runner's lists, sampling's fetch, detokenizing and stop checks. On a CPU nothing
overlaps, so only the rest shows what k saves; on a GPU the saved host time is what no longer runs in series
with the device (the GPU figure is `minillm bench latency --num-scheduler-steps`).
Usage: python figures/cpu/sweeps/multi_step_host.py OUT.json"""
import json, sys, time
import torch
from minillm import LLM, SamplingParams
from minillm.bench.harness import result_header
torch.set_num_threads(1)
TOKENS, PROMPT = 256, list(range(2, 18))
def one_run(llm):
    runner, spent = llm.engine.runner, [0.0]
    forward = runner.forward_here
    def timed(*args):
        t0 = time.perf_counter(); out = forward(*args); spent[0] += time.perf_counter() - t0; return out
    runner.forward_here = timed
    steps = len(llm.engine.stats)
    t0 = time.perf_counter()
    llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t0
    del runner.forward_here
    return {"s_per_token": total / TOKENS, "forward_s_per_token": spent[0] / TOKENS,
            "other_host_s_per_token": (total - spent[0]) / TOKENS,
            "scheduler_steps": len(llm.engine.stats) - steps}
llms = {k: LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous",
               attention_backend="torch", max_model_len=512, num_scheduler_steps=k) for k in (1, 8)}
rounds = {k: [] for k in llms}
for _ in range(3):
    for k, llm in llms.items():
        one_run(llm)  # warm-up of this round
        rounds[k].append(one_run(llm))
runs = {f"k={k}": min(r, key=lambda x: x["s_per_token"]) | {"rounds_s_per_token": [x["s_per_token"] for x in r]}
        for k, r in rounds.items()}
doc = result_header("multi_step_host", f"batch 1, prompt {len(PROMPT)}, output {TOKENS}, greedy", "tiny (dummy)",
                    "python figures/cpu/sweeps/multi_step_host.py figures/cpu/multi_step_host.json")
doc |= {"note": "CPU: forward passes and host work run in series; only other_host_s_per_token is what k saves",
        "runs": runs}
json.dump(doc, open(sys.argv[1], "w"), indent=1)
short = {"s_per_token": "total", "forward_s_per_token": "forward", "other_host_s_per_token": "other_host"}
print("microseconds per token:", json.dumps({k: {short[m]: round(r[m] * 1e6, 1) for m in short} for k, r in runs.items()}))
