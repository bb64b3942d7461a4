"""The ``minillm`` command: generate, chat, info, bench, eval.

Thin wrappers over the Python API, so every number the course shows can be rerun from a shell.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from minillm.kv.quant import KV_CACHE_DTYPES

EXAMPLES = """examples:
  minillm generate "What is a KV cache?" --max-tokens 64
  minillm chat                                   # talk to the embedded SmolLM2-135M-Instruct
  minillm info --model llama2-7b --load-format dummy
  minillm bench throughput --workload mixed --scale cpu --peers hf_static --output figures/cpu/static.json
  minillm generate --batching continuous -pp 2 "Hello"   # the layers split over 2 processes
  minillm eval ppl --quantization none rtn-int8 gptq-int4-g64 --output figures/cpu/perplexity.json
"""


def _add_model_args(p: argparse.ArgumentParser, several_quantizations: bool = False) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or a preset with --load-format dummy (default: embedded SmolLM2)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy' = a preset's shape with random weights (benchmarks without downloads)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float16, bfloat16, float32")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    g.add_argument("--batching", default="static", choices=["static", "dynamic", "continuous"],
                   help="static: fixed padded batches, contiguous KV; dynamic: static batches grouped by length "
                        "after a short wait; continuous: paged KV, iteration-level scheduling")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (default 8 static, 256 continuous)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (continuous)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV capacity in blocks (continuous)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "lpm"],
                   help="continuous: fcfs = arrival order; priority = per-request priority, then arrival; "
                        "lpm = longest cached prefix first (with --enable-prefix-caching)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto = the model's dtype; int8 / fp8 with a scale per token and KV head, "
                        "int4 with a scale per 16 channels (continuous)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="a preempted request recomputes its prefill when readmitted, or swaps its KV blocks "
                        "to CPU memory and back (continuous)")
    g.add_argument("--swap-space", default="4GiB",
                   help="CPU memory for swapped-out KV blocks, e.g. 4GiB (--preemption-mode swap)")
    g.add_argument("--memory-budget", default=None, help="emulate a smaller card, e.g. 24GB")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="paged attention (continuous): auto = triton kernels on CUDA, torch reference elsewhere")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (continuous)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV of shared prompt prefixes through a radix tree (continuous)")
    g.add_argument("--seed", type=int, default=0)
    if several_quantizations:
        g.add_argument("--quantization", nargs="+", default=["none"], metavar="METHOD",
                       help="one run per method, 'none' = unquantized: rtn-int8, rtn-int4, gptq-int4, awq-int4, fp8; "
                            "INT4 with -g64 / -channel / -sym (e.g. gptq-int4-g64)")
    else:
        g.add_argument("--quantization", default=None,
                       help="quantize the weights on load: rtn-int8, rtn-int4, gptq-int4, awq-int4, fp8; INT4 with "
                            "-g64 / -channel / -sym (e.g. gptq-int4-g64); a quantized checkpoint needs none")
    g.add_argument("--calibration-samples", type=int, default=32,
                   help="gptq / awq: 512-token calibration samples from the corpus (default %(default)s)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (one kind at a time; needs --batching continuous)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (GPUs) each layer is split over")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="processes (GPUs) the layers are split over, in stages")
    g.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches a step's sequences flow through the stages in (default: the stage count)")


def _parallel_kwargs(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                pipeline_micro_batches=args.pipeline_micro_batches)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def _engine_kwargs(args) -> dict:
    return dict(load_format=args.load_format, dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, batching=args.batching,
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                scheduling_policy=args.scheduling_policy, kv_cache_dtype=args.kv_cache_dtype,
                memory_budget=args.memory_budget, attention_backend=args.attention_backend,
                preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                quantization=args.quantization, calibration_samples=args.calibration_samples)


def _sampling(args):
    from minillm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> None:
    from minillm import LLM

    params = _sampling(args)  # bad sampling values fail before the model loads
    llm = LLM(args.model, **_engine_kwargs(args), **_parallel_kwargs(args))
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}, TTFT {out.metrics.ttft * 1000:.0f} ms]\n")


def cmd_chat(args) -> None:
    from minillm import LLM
    from minillm.tokenizer import encode_chat

    params = _sampling(args)
    llm = LLM(args.model, **_engine_kwargs(args), **_parallel_kwargs(args))
    history = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.message] if args.message else None
    print("minillm chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if turns is not None:
            if not turns:
                return
            user = turns.pop(0)
        else:
            try:
                user = input("you> ").strip()
            except EOFError:
                return
            if not user:
                return
        history.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        reply = []
        for delta in llm.stream(encode_chat(llm.tokenizer, history), params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_info(args) -> None:
    from minillm import info

    info()
    if args.no_model:
        return
    from minillm.engine import Engine
    from minillm.config import EngineConfig

    engine = Engine(EngineConfig(model=args.model, **_engine_kwargs(args), **_parallel_kwargs(args)))
    c = engine.model_config
    kv_dtype = engine.config.kv_cache_dtype
    kv_format = str(engine.dtype).removeprefix("torch.") if kv_dtype == "auto" else f"{kv_dtype} + fp16 scales"
    rows = {}
    if engine.workers is not None:
        stage, size = engine.stage, engine.workers.part.size
        held = f"pipeline stage 0 of {size}, layers 0-{stage.end - 1}" if stage is not None else \
            f"tensor-parallel rank 0 of {size}, 1/{size} of every layer"
        rows["parallel"] = f"{held}; the rows below are this rank's share"
    rows |= {
        "model": engine.model_source,
        "architecture": f"{c.model_type}: {c.num_layers} layers, hidden {c.hidden_size}, "
                        f"{c.num_heads} heads / {c.num_kv_heads} KV heads of {c.head_dim}",
        "parameters": f"{c.num_params / 1e6:.1f} M",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weights": f"{engine.weight_bytes / 2**20:.1f} MiB" + (f", {engine.quantization}" if engine.quantization else ""),
        "KV per token": f"{engine.kv_bytes_per_token / 2**10:.1f} KiB ({kv_format})",
        "max_model_len": engine.max_model_len,
        "batching": f"{engine.config.batching}, up to {engine.max_batch} sequences",
        "attention": "contiguous KV, torch SDPA" if engine.attention_backend is None else
                     f"paged KV, {engine.attention_backend} backend, CUDA graphs {'on' if engine.cuda_graphs else 'off'}",
        "KV cache": f"{engine.kv_cache_bytes / 2**20:.1f} MiB for {engine.kv_capacity_tokens} tokens",
    }
    if engine.swapper is not None:
        swapper = engine.swapper
        rows["swap space"] = f"{swapper.nbytes / 2**20:.1f} MiB of CPU memory for {swapper.num_blocks} blocks"
    for key, value in rows.items():
        print(f"{key:>13}: {value}")
    engine.close()


def _write_with_plot(result: dict, output: str | None) -> None:
    """The JSON at ``output`` and its plot beside it (``.png``)."""
    from minillm.bench.harness import write_result
    from minillm.bench.plots import plot_result

    if output:
        print(f"wrote {write_result(result, output)} and {plot_result(result, output)}")


def cmd_bench(args) -> None:
    from minillm.bench.harness import bench_throughput, format_table

    result = bench_throughput(model=args.model, workload=args.workload, scale=args.scale,
                              num_requests=args.num_requests, peers=args.peers, peer_batch_size=args.peer_batch_size,
                              variants=tuple(args.variants),
                              command=args.command_line, **_engine_kwargs(args), **_parallel_kwargs(args))
    _write_with_plot(result, args.output)
    print(format_table(result))


def cmd_bench_latency(args) -> None:
    from minillm.bench.harness import bench_latency, format_latency_table

    result = bench_latency(model=args.model, scale=args.scale, num_requests=args.num_requests, peers=args.peers,
                           command=args.command_line, **_engine_kwargs(args), **_parallel_kwargs(args))
    _write_with_plot(result, args.output)
    print(format_latency_table(result))


def cmd_bench_kernels(args) -> None:
    import torch

    from minillm.bench.harness import result_header, write_result
    from minillm.bench.kernels import SECTIONS, bench_kernels, format_kernel_table, plot_kernels
    from minillm.kernels.checks import interpreter_on

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not interpreter_on():
        raise ValueError("bench kernels needs a CUDA device; on a CPU, TRITON_INTERPRET=1 runs a tiny sweep "
                         "through Triton's interpreter (a check that it works, not a measurement)")
    chosen = args.only or list(SECTIONS)
    result = result_header("kernels", " + ".join(chosen) + " sweep", "-", args.command_line)
    result["runs"] = bench_kernels(device, **{name: None if name in chosen else [] for name in SECTIONS})
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
        print(f"wrote {plot_kernels(result, args.output.removesuffix('.json') + '.png')}")
    print(format_kernel_table(result))


def cmd_bench_kv_capacity(args) -> None:
    import torch

    from minillm.bench.harness import result_header, write_result
    from minillm.bench.kv_quant import format_capacity_table, kv_capacity
    from minillm.bench.workloads import make_workload
    from minillm.config import parse_bytes
    from minillm.model.config import PRESETS

    config, dtype, budget = PRESETS[args.model], getattr(torch, args.dtype), parse_bytes(args.memory_budget)
    requests = make_workload(args.workload, "gpu", vocab_size=config.vocab_size)
    lens = {f"of_{args.max_model_len}_tokens": [args.max_model_len],
            args.workload: [min(len(r.prompt_token_ids) + r.max_tokens, args.max_model_len) for r in requests]}
    result = result_header("kv_capacity", args.workload, args.model, args.command_line)
    result |= {"dtype": args.dtype, "memory_budget": budget, "block_size": args.block_size,
               "max_model_len": args.max_model_len, "runs": kv_capacity(config, budget, dtype, args.block_size, lens)}
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    print(f"{args.model} ({args.dtype} weights) in {budget / 1e9:.0f} GB: sequences held at once, each with "
          f"blocks for its whole length")
    print(format_capacity_table(result["runs"]))


def cmd_bench_load(args) -> None:
    from minillm.bench.harness import bench_gguf_load, write_result

    result = bench_gguf_load(args.gguf, command=args.command_line)
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    first, second = result["runs"]["first_load"]["seconds"], result["runs"]["second_load"]["seconds"]
    print(f"{result['model']}: first load {first:.1f} s (convert + cache), second {second:.2f} s "
          f"({result['speedup']:.0f}x faster)")


PARALLEL_DESCRIPTION = """\
One process, then each size N > 1 split each way (tensor parallel: every layer over N ranks;
pipeline parallel: the layers in N stages), one at a time: batch-1 decode latency, throughput on a
workload (greedy tokens compared with one process's), all-reduce and send/recv times on the
process group the layers use, and for pipelines the bubble measured against (S-1)/(M+S-1).
All sizes run with continuous batching, as the engine runs by default (CUDA graphs on GPUs for one
process and tensor parallel; pipelines eagerly; --enforce-eager for all). One GPU per rank (NCCL);
on a CPU, processes over gloo. A size the model cannot split into is recorded as skipped, with why.

examples:
  minillm bench parallel --model llama2-7b --load-format dummy --sizes 1 2 --output figures/h200/parallel.json
  minillm bench parallel --model tiny --load-format dummy --dtype float32 --num-requests 8   # a CPU check
"""


TUNING_PATH_DESCRIPTION = """\
The design documents' tuning path for a 7B model under a 24 GB card, replayed on minillm: each step
is a configuration of the same engine that adds one change to the steps before it, run one after
the other on the tuning-path workload under the same memory budget (weights + KV must fit):
  0 static batching, contiguous KV   1 + continuous batching, paged KV   2 + INT8 KV cache
  3 + AWQ INT4 weights               4 + prefix caching (lpm)            5 + token budget 8192
transformers' static generate and continuous batching run on step 0's weights. AWQ calibrates once
(steps 4 and 5 load step 3's weights) on 32 samples at gpu scale, 8 at cpu scale (--calibration-samples).
Prints the table, writes JSON and a plot (speed-up per step beside the seeds' path, median TTFT).

examples:
  minillm bench tuning-path --model llama2-7b --load-format dummy --num-requests 64 --output figures/h200/tuning_path.json
  minillm bench tuning-path --scale cpu --output figures/cpu/tuning_path.json   # the embedded model, minutes
"""


def cmd_bench_tuning_path(args) -> None:
    from minillm.bench.tuning_path import bench_tuning_path, format_tuning_path

    engine_kwargs = _engine_kwargs(args)
    memory_budget = engine_kwargs.pop("memory_budget")
    engine_kwargs.pop("batching")  # the steps set it
    result = bench_tuning_path(model=args.model, scale=args.scale, num_requests=args.num_requests, peers=args.peers,
                               steps=args.steps, memory_budget=memory_budget, command=args.command_line,
                               **engine_kwargs)
    _write_with_plot(result, args.output)
    print(format_tuning_path(result))


def cmd_bench_parallel(args) -> None:
    from minillm.bench.harness import write_result
    from minillm.bench.parallel import bench_parallel, format_parallel_table

    engine_kwargs = _engine_kwargs(args)
    engine_kwargs.pop("batching")  # the benchmark sets it: continuous
    result = bench_parallel(model=args.model, sizes=args.sizes, modes=args.modes, workload=args.workload,
                            scale=args.scale, num_requests=args.num_requests, latency_runs=args.latency_runs,
                            micro_batches=args.micro_batches, command=args.command_line, **engine_kwargs)
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    print(format_parallel_table(result))


def cmd_eval_ppl(args) -> None:
    from minillm.bench.harness import write_result
    from minillm.eval.perplexity import evaluate_perplexity, format_perplexity_table

    engine_kwargs = _engine_kwargs(args)
    methods = engine_kwargs.pop("quantization")
    result = evaluate_perplexity(model=args.model, quantizations=methods, num_tokens=args.num_tokens,
                                 seq_len=args.seq_len, stride=args.stride, chunk_size=args.chunk_size,
                                 command=args.command_line, **engine_kwargs)
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    print(format_perplexity_table(result))


def build_parser() -> argparse.ArgumentParser:
    from minillm.bench.harness import LATENCY_PEERS, PEERS, VARIANTS
    from minillm.bench.tuning_path import STEP_NAMES as TUNING_STEPS
    from minillm.bench.workloads import WORKLOADS
    from minillm.model.config import PRESETS

    parser = argparse.ArgumentParser(prog="minillm", description="A compact, readable LLM inference engine.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,info,bench,eval}")

    p = sub.add_parser("generate", help="complete prompts (arguments, or one per line on stdin)")
    p.add_argument("prompts", nargs="*", help="prompts; read from stdin when none are given")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_model_args(p)
    _add_parallel_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="talk to the model; replies stream as they are generated")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--message", action="append", default=None, help="send these turns and exit (repeatable)")
    _add_model_args(p)
    _add_parallel_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("info", help="versions, device, and the model's size and memory")
    p.add_argument("--no-model", action="store_true", help="only versions and device")
    _add_model_args(p)
    _add_parallel_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="benchmarks (BENCHMARKS.md): minillm and its peers in one run")
    bench = p.add_subparsers(dest="bench", required=True,
                             metavar="{throughput,latency,kernels,kv-capacity,load,parallel,tuning-path}")
    t = bench.add_parser("throughput", help="a whole workload end to end; vLLM's metrics; JSON out")
    t.add_argument("--workload", default="mixed", choices=list(WORKLOADS))
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None, help="the first N requests of the workload")
    t.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                   help="peers run in the same process on the same workload")
    t.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                   help="also run minillm on the same engine with a step of the tuning path undone, in the "
                        "order given (continuous): prefix_cache_off (needs --enable-prefix-caching), "
                        "triton_eager = no CUDA graphs, torch_eager = the torch reference attention")
    t.add_argument("--peer-batch-size", type=int, default=None,
                   help="hf_static's batch size (default: minillm's static batch, or 16 against continuous)")
    t.add_argument("--output", default=None, help="write the JSON result here")
    _add_model_args(t)
    _add_parallel_args(t)
    t.set_defaults(func=cmd_bench)
    t = bench.add_parser("latency", help="batch-1 decode tok/s against the bandwidth roofline; JSON out")
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None, help="runs (default 5 gpu, 3 cpu)")
    t.add_argument("--peers", nargs="*", default=list(LATENCY_PEERS), choices=list(LATENCY_PEERS),
                   help="hf_compiled (static cache + torch.compile) runs on CUDA only")
    t.add_argument("--output", default=None, help="write the JSON result here")
    _add_model_args(t)
    _add_parallel_args(t)
    t.set_defaults(func=cmd_bench_latency)
    t = bench.add_parser("kernels", help="Triton kernels (attention, quantized matmul) vs torch and the measured ceilings")
    t.add_argument("--only", nargs="+", default=None, choices=["prefill", "decode", "quant"],
                   help="run only these sweeps (default: all)")
    t.add_argument("--output", default=None, help="write the JSON result here (and a plot beside it)")
    t.set_defaults(func=cmd_bench_kernels)
    t = bench.add_parser("kv-capacity", help="KV blocks and concurrent sequences a memory budget holds per "
                                             "kv_cache_dtype (computed, no model is loaded); JSON out")
    t.add_argument("--model", default="llama2-7b", choices=list(PRESETS), help="a preset's shape")
    t.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"], help="weights' dtype")
    t.add_argument("--memory-budget", default="24GB", help="weights + workspace + KV must fit (BENCHMARKS.md: 24GB)")
    t.add_argument("--max-model-len", type=int, default=2048)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--workload", default="tuning-path", choices=list(WORKLOADS),
                   help="also count sequences of this workload's lengths (prompt + max_tokens, gpu scale)")
    t.add_argument("--output", default=None, help="write the JSON result here")
    t.set_defaults(func=cmd_bench_kv_capacity)
    t = bench.add_parser("load", help="GGUF load time: first (convert and cache) vs second (from cache)")
    t.add_argument("--gguf", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    t.add_argument("--output", default=None, help="write the JSON result here")
    t.set_defaults(func=cmd_bench_load)
    t = bench.add_parser("parallel", help="tensor vs pipeline parallel over 1..N processes: latency, throughput, "
                                          "collectives, pipeline bubble; JSON out",
                         description=PARALLEL_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--sizes", nargs="+", type=int, default=[1, 2],
                   help="process (GPU) counts; 1 always runs, as the reference (default: 1 2)")
    t.add_argument("--modes", nargs="+", default=["tp", "pp"], choices=["tp", "pp"],
                   help="tp = tensor parallel, pp = pipeline parallel (default: both)")
    t.add_argument("--workload", default="mixed", choices=list(WORKLOADS), help="the throughput workload")
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None, help="the first N requests of the workload")
    t.add_argument("--latency-runs", type=int, default=None, help="batch-1 requests timed (default 5 gpu, 3 cpu)")
    t.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4, 8],
                   help="pipeline micro-batch counts of the bubble sweep (default: 1 2 4 8)")
    t.add_argument("--output", default=None, help="write the JSON result here")
    _add_model_args(t)
    t.set_defaults(func=cmd_bench_parallel)
    t = bench.add_parser("tuning-path", help="the seeds' tuning path, step by step on one engine, with the "
                                             "transformers peers; table, JSON and plot",
                         description=TUNING_PATH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"],
                   help="gpu: the full workload on a 24 GB card (default on CUDA); cpu: 32 requests on a card "
                        "sized from the model (weights + 4 sequences of KV)")
    t.add_argument("--num-requests", type=int, default=None, help="the first N requests of the workload")
    t.add_argument("--steps", nargs="+", default=None, choices=list(TUNING_STEPS),
                   help="run only these steps (each still on top of the ones before it; default: all)")
    t.add_argument("--peers", nargs="*", default=["hf_static", "hf_cb"], choices=["hf_static", "hf_cb"],
                   help="transformers on step 0's weights (default: both; none: --peers)")
    t.add_argument("--output", default=None, help="write the JSON result here (and a plot beside it)")
    _add_model_args(t)
    # None: the scale's own (tuning_path.CALIBRATION_SAMPLES: 32 on gpu, 8 on cpu).
    t.set_defaults(func=cmd_bench_tuning_path, calibration_samples=None)

    from minillm.eval import perplexity as ppl

    p = sub.add_parser("eval", help="quality of lossy steps: perplexity on the built-in corpus")
    evals = p.add_subparsers(dest="eval", required=True, metavar="{ppl}")
    t = evals.add_parser("ppl", help="perplexity on the held-out part of pydoc_data.topics; JSON out",
                         description=ppl.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--num-tokens", type=int, default=ppl.NUM_TOKENS,
                   help="evaluation tokens read from the start of the held-out part (default %(default)s)")
    t.add_argument("--seq-len", type=int, default=ppl.SEQ_LEN, help="tokens per window (default %(default)s)")
    t.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: seq_len, disjoint windows)")
    t.add_argument("--chunk-size", type=int, default=None,
                   help="prefill each window this many tokens at a time through the paged KV cache "
                        "(needs --batching continuous); default: one forward per window, no cache")
    t.add_argument("--output", default=None, help="write the JSON result here")
    _add_model_args(t, several_quantizations=True)
    t.set_defaults(func=cmd_eval_ppl)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["minillm", *argv])  # recorded in benchmark JSON
    if getattr(args, "scale", "x") is None:
        import torch

        args.scale = "gpu" if torch.cuda.is_available() else "cpu"
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"minillm: error: {e}")


if __name__ == "__main__":
    main()
