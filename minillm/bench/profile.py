"""Where a decode step's time goes: ``python -m minillm.bench.profile --model llama2-7b --load-format dummy``.

"Measure first, then optimise": this profiles a few decode steps of minillm (static batching, or
the continuous engine with its kernels and CUDA graphs: ``--batching continuous``) and of
transformers' ``generate`` (same weights, same batch) with ``torch.profiler`` and prints, per step,
the wall time, the number of kernels launched and the GPU time they took. When wall time is far
above GPU time, the step is bound by launch overhead on the CPU, not by the GPU.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.harness import result_header, write_result
from minillm.bench.peers import hf_model_sharing_weights
from minillm.llm import LLM
from minillm.request import SamplingParams


def _summarise(prof, steps: int) -> dict:
    events = prof.key_averages()
    device_events = [e for e in events if getattr(e, "device_type", None) is not None
                     and str(e.device_type).endswith("CUDA")]
    kernels = sum(e.count for e in device_events)
    gpu_us = sum(e.self_device_time_total for e in device_events)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    # The heaviest kernels by GPU time, per step: where a decode step's microseconds go.
    heaviest = sorted(device_events, key=lambda e: -e.self_device_time_total)[:15]
    return {"kernels_per_step": kernels / steps, "gpu_ms_per_step": gpu_us / 1000 / steps,
            "aten_calls_per_step": aten / steps,
            "heaviest_kernels": [{"name": e.key[:100], "calls_per_step": e.count / steps,
                                  "gpu_us_per_step": e.self_device_time_total / steps} for e in heaviest],
            "top": prof.key_averages().table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total",
                                             row_limit=12)}


def profile_minillm(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict:
    engine = llm.engine
    for i in range(batch):
        engine.add_request(list(range(100 + i, 100 + i + prompt_len)),
                           SamplingParams(max_tokens=steps * 3 + 4, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    for _ in range(steps):  # warm decode
        engine.step()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    wall = (time.perf_counter() - start) / steps
    while engine.has_unfinished():
        engine.step()
    return {"wall_ms_per_step": wall * 1000, **_summarise(prof, steps)}


def profile_hf(llm: LLM, batch: int, prompt_len: int, steps: int) -> dict:
    from transformers import GenerationConfig

    engine = llm.engine
    hf = hf_model_sharing_weights(engine.model, engine.model_config)
    ids = torch.stack([torch.arange(100 + i, 100 + i + prompt_len) for i in range(batch)]).to(engine.device)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    state = {"n": 0}

    class Streamer:  # profiles the decode steps between the warm-up steps and the tail
        def put(self, _):
            state["n"] += 1
            if state["n"] == steps + 2:
                sync()
                state["t0"] = time.perf_counter()
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["prof"].__enter__()
            elif state["n"] == 2 * steps + 2:
                sync()
                state["prof"].__exit__(None, None, None)
                state["wall"] = (time.perf_counter() - state["t0"]) / steps

        def end(self):
            pass

    config = GenerationConfig(max_new_tokens=3 * steps + 4, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=Streamer())
    return {"wall_ms_per_step": state["wall"] * 1000, **_summarise(state["prof"], steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batching", default="static", choices=["static", "continuous"],
                        help="continuous: the paged engine (Triton kernels and CUDA-graph decode on CUDA)")
    parser.add_argument("--enforce-eager", action="store_true", help="continuous without CUDA graphs")
    parser.add_argument("--quantization", default=None,
                        help="quantize the weights on load, as LLM(quantization=...): rtn-int8, rtn-int4, awq-int4, "
                        "...")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-hf", action="store_true", help="profile minillm only")
    parser.add_argument("--output", default=None, help="write the per-step figures as JSON here")
    args = parser.parse_args()
    if args.quantization and not args.no_hf:
        parser.error("--quantization profiles minillm only (transformers' generate runs unquantized weights): "
                     "add --no-hf")
    llm = LLM(args.model, load_format=args.load_format, max_num_seqs=args.batch, batching=args.batching,
              enforce_eager=args.enforce_eager, quantization=args.quantization,
              max_model_len=args.prompt_len + 3 * args.steps + 8)
    results = {"minillm": profile_minillm(llm, args.batch, args.prompt_len, args.steps)}
    if not args.no_hf:
        results["hf_generate"] = profile_hf(llm, args.batch, args.prompt_len, args.steps)
    for name, r in results.items():
        print(f"== {name}\n{r.pop('top')}")
    for name, r in results.items():
        print(f"{name:<12} " + "  ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "heaviest_kernels"))
    if args.output:
        workload = f"{args.batching} batch {args.batch}, {args.prompt_len}-token prompts, {args.steps} profiled decode steps"
        command = shlex.join(["python", "-m", "minillm.bench.profile", *sys.argv[1:]])
        result = {**result_header("profile-decode-step", workload, llm.engine.model_source, command), "runs": results,
                  "note": "wall time is under torch.profiler (inflated); compare kernels and GPU time per step"}
        print(f"wrote {write_result(result, args.output)}")


if __name__ == "__main__":
    main()
