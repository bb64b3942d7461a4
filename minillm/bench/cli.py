"""``minillm bench ...``: the benchmark subcommands (BENCHMARKS.md), each a thin wrapper that runs one
benchmark of ``minillm.bench``, writes its JSON (and a plot beside it) and prints its table.
"""

from __future__ import annotations

import argparse

from minillm.cli_args import add_model_args, add_parallel_args, engine_kwargs, parallel_kwargs


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
                              variants=tuple(args.variants), think_time=args.think_time,
                              command=args.command_line, **engine_kwargs(args), **parallel_kwargs(args))
    _write_with_plot(result, args.output)
    print(format_table(result))


def cmd_bench_latency(args) -> None:
    from minillm.bench.harness import bench_latency, format_latency_table

    result = bench_latency(model=args.model, scale=args.scale, num_requests=args.num_requests, peers=args.peers,
                           command=args.command_line, **engine_kwargs(args), **parallel_kwargs(args))
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


THROUGHPUT_DESCRIPTION = """\
minillm on one workload end to end (a warm-up first, then one timed run), beside the transformers peers and
minillm's variants, in one process: vLLM's serving metrics, step statistics and prefix-cache hits; JSON and plot.

--workload multi-turn runs chats in a closed loop (minillm.bench.chat_loop): 64 chats (8 at cpu scale) of
4 turns, each turn = the chat's history + the answer the engine really gave + a new 64-token message, sent
only when the last answer has finished (+ --think-time). It reports, per turn and overall, the prefix cache's
hit rate beside the shared-token fraction computed from the chats themselves. minillm alone (--peers with no
names). multi-turn-open is the same chats as one list of requests made in advance, every turn at t = 0, with
stand-in answers.

examples:
  minillm bench throughput --batching continuous --model llama2-7b --load-format dummy --workload mixed \\
      --enable-prefix-caching --variants prefix_cache_off prefix_cache_on --peers --output mixed.json
  minillm bench throughput --batching continuous --model llama2-7b --load-format dummy --workload multi-turn \\
      --enable-prefix-caching --variants prefix_cache_off prefix_cache_on --peers --output multi_turn.json
"""


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
  3 + AWQ INT4 weights               4 + prefix caching (lpm)            5 + 8 decode passes per step
transformers' static generate and continuous batching run on step 0's weights. AWQ calibrates once
(steps 4 and 5 load step 3's weights) on 32 samples at gpu scale, 8 at cpu scale (--calibration-samples).
Prints the table, writes JSON and a plot (speed-up per step beside the seeds' path, median TTFT).

examples:
  minillm bench tuning-path --model llama2-7b --load-format dummy --num-requests 96 \\
      --output figures/h200/tuning_path.json
  minillm bench tuning-path --scale cpu --output figures/cpu/tuning_path.json   # the embedded model, minutes
"""


def cmd_bench_tuning_path(args) -> None:
    from minillm.bench.tuning_path import bench_tuning_path, format_tuning_path

    kwargs = engine_kwargs(args)
    memory_budget = kwargs.pop("memory_budget")
    kwargs.pop("batching")  # the steps set it
    result = bench_tuning_path(model=args.model, scale=args.scale, num_requests=args.num_requests, peers=args.peers,
                               steps=args.steps, memory_budget=memory_budget, command=args.command_line,
                               **kwargs)
    _write_with_plot(result, args.output)
    print(format_tuning_path(result))


def cmd_bench_tour(args) -> None:
    from minillm.bench import tuning_path as tuning

    result = tuning.bench_tuning_path(model=None, load_format="auto", scale="cpu", num_requests=tuning.TOUR_REQUESTS,
                                      peers=args.peers, path=tuning.TOUR, max_model_len=tuning.TOUR_MAX_MODEL_LEN,
                                      max_num_batched_tokens=tuning.TOUR_TOKEN_BUDGET, dtype="float32",
                                      command=args.command_line, progress=False)
    print(tuning.format_tour(result))


def cmd_bench_parallel(args) -> None:
    from minillm.bench.harness import write_result
    from minillm.bench.parallel import bench_parallel, format_parallel_table

    kwargs = engine_kwargs(args)
    kwargs.pop("batching")  # the benchmark sets it: continuous

    def progress(document: dict) -> None:
        print(f"done: {', '.join(document['runs'])}", flush=True)  # skipped sizes are listed too
        if args.output:
            write_result(document, args.output)

    result = bench_parallel(model=args.model, sizes=args.sizes, modes=args.modes, workload=args.workload,
                            scale=args.scale, num_requests=args.num_requests, latency_runs=args.latency_runs,
                            micro_batches=args.micro_batches, command=args.command_line, on_progress=progress,
                            **kwargs)
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    print(format_parallel_table(result))


SERVE_DESCRIPTION = """\
The online benchmark (vLLM's `vllm bench serve`): a workload's requests sent to an OpenAI-compatible server's
/v1/completions by an async client, streaming, arriving as a Poisson process at each --request-rate (inf = all
at once), at most --max-concurrency in flight. Reports TTFT, TPOT, ITL and E2E latency (mean, P50, P95, P99),
throughput and goodput under --goodput SLOs; one run per rate (the latency-throughput curve), JSON and a plot.
Target a running server (--base-url: minillm's, vLLM's, `transformers serve`...) or start minillm's own:
--start-server, last, followed by `minillm serve`'s flags.

examples:
  minillm bench serve --request-rate 1 2 4 inf --goodput ttft:500 tpot:50 --output figures/cpu/serve.json \\
      --start-server --max-num-seqs 16
  minillm bench serve --base-url http://127.0.0.1:8000 --workload mixed --request-rate 4 inf --label vllm
  minillm bench serve --base-url http://127.0.0.1:8001 --tokenizer ./hf-model --no-ignore-eos --label hf_serve
"""


def cmd_bench_serve(args) -> None:
    from minillm.bench.harness import write_result
    from minillm.bench.plots import plot_result
    from minillm.bench.serve import bench_serve_command, format_serve_table

    def progress(document: dict) -> None:
        print(f"done: {', '.join(document['runs'])}", flush=True)
        if args.output:
            write_result(document, args.output)

    result = bench_serve_command(args, on_progress=progress)
    if args.output:
        print(f"wrote {write_result(result, args.output)} and {plot_result(result, args.output)}")
    print(format_serve_table(result))


OFFLOAD_DESCRIPTION = """\
What cpu_offload_gb costs: for each amount (0 GiB always runs first, as the reference), one engine
(continuous batching; CUDA graphs on GPUs, the weight copies captured inside) measures batch-1 decode
tok/s and the throughput of a small workload, beside the bytes that cross PCIe per step, the time
floor they set at the host->device bandwidth measured in the same run, the device's weight bytes and
the KV capacity left under the budget. Greedy tokens must equal the 0 GiB run's (agree = 100 %).

examples:
  minillm bench offload --model llama2-7b --load-format dummy --cpu-offload-gb 0 1 2 4 --memory-budget 24GB \\
      --output figures/h200/offload.json
  minillm bench offload --scale cpu --output figures/cpu/offload.json   # the embedded model, about a minute
"""


def cmd_bench_offload(args) -> None:
    from minillm.bench.offload import bench_offload, format_offload_table

    kwargs = engine_kwargs(args)
    amounts = kwargs.pop("cpu_offload_gb")
    kwargs.pop("batching")  # the benchmark sets it: continuous
    result = bench_offload(model=args.model, amounts=amounts, workload=args.workload, scale=args.scale,
                           num_requests=args.num_requests, latency_runs=args.latency_runs,
                           command=args.command_line, **kwargs)
    _write_with_plot(result, args.output)
    print(format_offload_table(result))


def add_bench_parser(sub) -> None:
    """The ``bench`` command and its subcommands, on ``sub`` (the top-level subparsers)."""
    from minillm.bench.harness import CLOSED_LOOP, LATENCY_PEERS, PEERS, VARIANTS
    from minillm.bench.tuning_path import STEP_NAMES as TUNING_STEPS
    from minillm.bench.workloads import WORKLOADS
    from minillm.model.config import PRESETS

    p = sub.add_parser("bench", help="benchmarks (BENCHMARKS.md): minillm and its peers in one run")
    bench = p.add_subparsers(dest="bench", required=True,
                             metavar="{tour,throughput,latency,serve,kernels,kv-capacity,load,parallel,tuning-path,offload}")
    t = bench.add_parser("tour", help="the embedded model on a CPU-sized run: static batching, continuous "
                                      "batching, prefix caching and transformers, one table (make tour)")
    t.add_argument("--peers", nargs="*", default=["hf_static"], choices=["hf_static", "hf_cb"],
                   help="transformers beside the engine (default: its static generate)")
    t.set_defaults(func=cmd_bench_tour)
    t = bench.add_parser("throughput", help="a whole workload end to end; vLLM's metrics; JSON out",
                         description=THROUGHPUT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--workload", default="mixed", choices=[*WORKLOADS, CLOSED_LOOP],
                   help="BENCHMARKS.md's workloads (default: mixed); multi-turn: chats in a closed loop, see above")
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None,
                   help="the first N requests of the workload (multi-turn: N chats of 4 turns)")
    t.add_argument("--think-time", type=float, default=0.0,
                   help="multi-turn: seconds a chat waits between an answer and its next turn (default 0)")
    t.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                   help="peers run in the same process on the same workload")
    t.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS),
                   help="also run minillm on the same engine with a step of the tuning path undone, in the "
                        "order given (continuous): prefix_cache_off (needs --enable-prefix-caching), "
                        "prefix_cache_on = the cache back on after prefix_cache_off (on, off, on again: neither "
                        "side of the comparison is the first timed run), triton_eager = no CUDA graphs, "
                        "torch_eager = the torch reference attention")
    t.add_argument("--peer-batch-size", type=int, default=None,
                   help="hf_static's batch size (default: minillm's static batch, or 16 against continuous)")
    t.add_argument("--output", default=None, help="write the JSON result here")
    add_model_args(t)
    add_parallel_args(t)
    t.set_defaults(func=cmd_bench)
    t = bench.add_parser("latency", help="batch-1 decode tok/s against the bandwidth roofline; JSON out")
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None, help="runs (default 5 gpu, 3 cpu)")
    t.add_argument("--peers", nargs="*", default=list(LATENCY_PEERS), choices=list(LATENCY_PEERS),
                   help="hf_compiled (static cache + torch.compile) runs on CUDA only")
    t.add_argument("--output", default=None, help="write the JSON result here")
    add_model_args(t)
    add_parallel_args(t)
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
    add_model_args(t)
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
    add_model_args(t)
    # None: the scale's own (tuning_path.CALIBRATION_SAMPLES: 32 on gpu, 8 on cpu).
    t.set_defaults(func=cmd_bench_tuning_path, calibration_samples=None)
    t = bench.add_parser("serve", help="the online benchmark: an async client streams a workload from an "
                                       "OpenAI-compatible server at request rates; vLLM's metrics, JSON and a plot",
                         description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (or --start-server)")
    t.add_argument("--model", default=None, help="the model name requests ask for (default: the server's first)")
    t.add_argument("--label", default=None, help="names the runs LABEL@RATE (default: minillm, or server)")
    t.add_argument("--workload", default="mixed", choices=list(WORKLOADS))
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None, help="the first N requests of the workload")
    t.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="requests per second, one run each; inf = all at once (default: inf)")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier, > 1 steadier")
    t.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so outputs have the workload's lengths (a server that rejects the field: "
                        "--no-ignore-eos)")
    t.add_argument("--tokenizer", default=None,
                   help="send prompts as text decoded with this tokenizer (for servers that take no token ids)")
    t.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this (default 32000)")
    t.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first (default 0)")
    t.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    t.add_argument("--output", default=None, help="write the JSON result here (and a plot beside it)")
    t.add_argument("--start-server", nargs=argparse.REMAINDER, default=None, metavar="SERVE_FLAGS",
                   help="start `minillm serve SERVE_FLAGS` in a subprocess on a free port and benchmark it; last")
    t.set_defaults(func=cmd_bench_serve)
    # "resolve": the sweep's --cpu-offload-gb (several amounts) replaces the model flags' single one.
    t = bench.add_parser("offload", help="cpu_offload_gb swept: batch-1 decode and throughput against the "
                                         "bytes crossing PCIe per step; table, JSON and plot",
                         description=OFFLOAD_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                         conflict_handler="resolve")
    t.add_argument("--workload", default="mixed", choices=list(WORKLOADS), help="the throughput workload")
    t.add_argument("--scale", default=None, choices=["gpu", "cpu"], help="default: gpu on CUDA, else cpu")
    t.add_argument("--num-requests", type=int, default=None,
                   help="requests of the throughput workload (default 32 gpu, 8 cpu)")
    t.add_argument("--latency-runs", type=int, default=None, help="batch-1 requests timed (default 3 gpu, 2 cpu)")
    t.add_argument("--output", default=None, help="write the JSON result here (and a plot beside it)")
    add_model_args(t)
    t.add_argument("--cpu-offload-gb", nargs="+", type=float, default=None, metavar="GIB",
                   help="GiB of weights in CPU memory, one run each (default 0 1 2 4 gpu, 0 0.05 0.1 cpu)")
    t.set_defaults(func=cmd_bench_offload)
