"""The ``minillm`` command: generate, chat, serve, info, bench, eval.

Thin wrappers over the Python API, so every number the course shows can be rerun from a shell.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from minillm.cli_args import add_model_args, add_parallel_args, add_server_args, engine_kwargs, parallel_kwargs

EXAMPLES = """examples:
  minillm generate "What is a KV cache?" --max-tokens 64
  minillm chat                                   # talk to the embedded SmolLM2-135M-Instruct
  minillm serve --port 8000                      # the OpenAI API at http://127.0.0.1:8000/v1
  minillm info --model llama2-7b --load-format dummy
  minillm bench throughput --workload mixed --scale cpu --peers hf_static --output figures/cpu/static.json
  minillm generate --batching continuous -pp 2 "Hello"   # the layers split over 2 processes
  minillm eval ppl --quantization none rtn-int8 gptq-int4-g64 --output figures/cpu/perplexity.json
"""


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def _sampling(args):
    from minillm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> None:
    from minillm import LLM

    params = _sampling(args)  # bad sampling values and a missing prompt fail before the model loads
    prompts = args.prompts or _stdin_prompts()
    llm = LLM(args.model, **engine_kwargs(args), **parallel_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}, TTFT {out.metrics.ttft * 1000:.0f} ms]\n")


def _stdin_prompts() -> list[str]:
    if sys.stdin.isatty():
        raise ValueError("no prompt given: pass prompts as arguments, or pipe them in on stdin, one per line")
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: stdin held no non-empty line, and no prompt was passed as an argument")
    return prompts


def cmd_chat(args) -> None:
    from minillm import LLM
    from minillm.tokenizer import encode_chat

    params = _sampling(args)
    llm = LLM(args.model, **engine_kwargs(args), **parallel_kwargs(args))
    history = [{"role": "system", "content": args.system}] if args.system else []
    turns = list(args.message) if args.message else None  # --message is repeatable: one turn each
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


def cmd_serve(args) -> None:
    from minillm.serve import AsyncLLM, run_server

    if args.model_tag is not None and args.model not in (None, args.model_tag):
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
    llm = AsyncLLM(args.model_tag or args.model, max_waiting_requests=args.max_waiting_requests,
                   **engine_kwargs(args), **parallel_kwargs(args))
    run_server(llm, host=args.host, port=args.port, served_model_name=args.served_model_name,
               shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level)


def cmd_info(args) -> None:
    from minillm import info

    info()
    if args.no_model:
        return
    from minillm.engine import Engine
    from minillm.config import EngineConfig

    engine = Engine(EngineConfig(model=args.model, **engine_kwargs(args), **parallel_kwargs(args)))
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
    if engine.offloader is not None:  # "weights" above are the device's: resident layers + the staging buffers
        layers = engine.offloader.indices
        rows["CPU offload"] = (f"layers {layers[0]}-{layers[-1]}, {engine.offloaded_weight_bytes / 2**20:.1f} MiB in "
                               f"CPU memory, copied in every forward pass")
    if engine.swapper is not None:
        swapper = engine.swapper
        rows["swap space"] = f"{swapper.nbytes / 2**20:.1f} MiB of CPU memory for {swapper.num_blocks} blocks"
    for key, value in rows.items():
        print(f"{key:>13}: {value}")
    engine.close()


def cmd_eval_ppl(args) -> None:
    from minillm.bench.harness import write_result
    from minillm.eval.perplexity import evaluate_perplexity, format_perplexity_table

    kwargs = engine_kwargs(args)
    methods = kwargs.pop("quantization")
    result = evaluate_perplexity(model=args.model, quantizations=methods, num_tokens=args.num_tokens,
                                 seq_len=args.seq_len, stride=args.stride, chunk_size=args.chunk_size,
                                 command=args.command_line, **kwargs)
    if args.output:
        print(f"wrote {write_result(result, args.output)}")
    print(format_perplexity_table(result))


def build_parser() -> argparse.ArgumentParser:
    from minillm.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="minillm", description="A compact, readable LLM inference engine.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve,info,bench,eval}")

    p = sub.add_parser("generate", help="complete prompts (arguments, or one per line on stdin)")
    p.add_argument("prompts", nargs="*", help="prompts; read from stdin when none are given")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_model_args(p)
    add_parallel_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="talk to the model; replies stream as they are generated")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--message", action="append", default=None, help="send these turns and exit (repeatable)")
    add_model_args(p)
    add_parallel_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP API (completions, chat, streaming) on the model")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (as --model)")
    add_model_args(p)
    add_parallel_args(p)
    p.set_defaults(batching="continuous")  # requests arrive while others run
    add_server_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="versions, device, and the model's size and memory")
    p.add_argument("--no-model", action="store_true", help="only versions and device")
    add_model_args(p)
    add_parallel_args(p)
    p.set_defaults(func=cmd_info)

    add_bench_parser(sub)

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
    add_model_args(t, several_quantizations=True)
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
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, no traceback
        print("\nminillm: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
