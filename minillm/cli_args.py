"""The command line's shared options: the model and engine flags every command that builds an engine
takes, and the parallelism flags; each mirrors an ``EngineConfig`` field (vLLM's names).

Its own module because both ``minillm/cli.py`` (generate, chat, info, eval) and
``minillm/bench/cli.py`` (the benchmarks) build their parsers from it.
"""

from __future__ import annotations

import argparse

from minillm.kv.quant import KV_CACHE_DTYPES


def add_model_args(p: argparse.ArgumentParser, several_quantizations: bool = False) -> None:
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
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (continuous; default %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory minillm may use, without --memory-budget (default %(default)s)")
    g.add_argument("--batch-timeout", type=float, default=0.05,
                   help="dynamic: seconds the oldest request waits for a full batch (default %(default)s)")
    g.add_argument("--bucket-width", type=int, default=128,
                   help="dynamic: prompts within the same multiple of this many tokens batch together "
                        "(default %(default)s)")
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
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="continuous: decode passes per scheduler step, each fed the previous one's tokens on "
                        "the device, with one host sync at the end (default 1)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="continuous: launch a decode batch's successor before reading its tokens, so the host's "
                        "step overlaps the GPU's (default: on for continuous batching in one process)")
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
    g.add_argument("--cpu-offload-gb", type=float, default=0,
                   help="GiB of weights kept in CPU memory (whole decoder layers, the last ones), copied to the "
                        "device in every forward pass (default 0)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (one kind at a time; needs --batching continuous)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (GPUs) each layer is split over")
    g.add_argument("--tp-all-reduce", default="auto", choices=["auto", "nccl", "symm_mem", "fused"],
                   help="tensor parallelism's all-reduce (auto: fused into the next norm on GPUs that are peers)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="processes (GPUs) the layers are split over, in stages")
    g.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches a step's sequences flow through the stages in (default: the stage count)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0 = all)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model argument, or SmolLM2-135M-Instruct)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests that may wait for a slot; past it, new ones get 503 + Retry-After "
                        "(default: no bound)")
    g.add_argument("--shutdown-timeout", type=float, default=None,
                   help="seconds the requests in flight get to finish at shutdown before they are aborted "
                        "(default: as long as they need)")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def parallel_kwargs(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                pipeline_micro_batches=args.pipeline_micro_batches, tp_all_reduce=args.tp_all_reduce)


def engine_kwargs(args) -> dict:
    return dict(load_format=args.load_format, dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, batching=args.batching,
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                batch_timeout=args.batch_timeout, bucket_width=args.bucket_width,
                scheduling_policy=args.scheduling_policy, kv_cache_dtype=args.kv_cache_dtype,
                memory_budget=args.memory_budget, attention_backend=args.attention_backend,
                preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                enforce_eager=args.enforce_eager, num_scheduler_steps=args.num_scheduler_steps,
                async_scheduling=args.async_scheduling,
                enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                quantization=args.quantization, calibration_samples=args.calibration_samples,
                cpu_offload_gb=args.cpu_offload_gb)
