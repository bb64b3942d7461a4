"""``minillm bench throughput``: minillm and its peers on one workload, in one process, one run.

Each run gets a warm-up first (CUDA context, cuBLAS handles, allocator), then the whole workload
timed end to end. The result is a JSON document with the keys BENCHMARKS.md asks for
(benchmark, workload, model, device, date, command, commit, runs) and a short table, plus
``kv_memory``: how much of a contiguous and of a paged KV cache the requests minillm served would
fill (``minillm.bench.kv_waste``).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minillm import env
from minillm.bench.chat_loop import ChatScript, chat_run_metrics, format_turns, make_chats, run_chats
from minillm.bench.jit_compiles import CompileCounter
from minillm.bench.kv_waste import ServedRequest, kv_memory_summary
from minillm.bench.metrics import RequestTiming, serving_metrics
from minillm.bench.peers import hf_model_sharing_weights, run_hf_continuous, run_hf_static
from minillm.bench.variants import VARIANTS, use_variant
from minillm.bench.workloads import WorkloadRequest, make_workload
from minillm.info import device_description, info_dict
from minillm.llm import LLM
from minillm.request import SamplingParams

PEERS = ("hf_static", "hf_cb")
CLOSED_LOOP = "multi-turn"  # the workload of minillm.bench.chat_loop: each chat's turns sent one after another
LATENCY_PEERS = ("hf_static", "hf_compiled")  # hf_compiled: static cache + torch.compile (CUDA graphs)


def check_choices(kind: str, given, valid) -> None:
    """A clear error for the first of ``given`` that is not one of ``valid``."""
    for value in given:
        if value not in valid:
            raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")


def check_peers_can_share_weights(peers, engine_kwargs: dict) -> None:
    """The transformers peers borrow rank 0's weights, which a parallel engine holds only a shard of:
    refuse before the long run rather than crash at its end."""
    sizes = {name: engine_kwargs.get(name) or 1 for name in ("tensor_parallel_size", "pipeline_parallel_size")}
    sharded = {name: size for name, size in sizes.items() if size > 1}
    if peers and sharded:
        raise ValueError(f"the transformers peers ({', '.join(peers)}) share minillm's weights, and with "
                         f"{', '.join(f'{k}={v}' for k, v in sharded.items())} each rank holds a shard; run with "
                         "--peers (none), or compare sizes with `minillm bench parallel`")


def git_commit() -> str:
    """MINILLM_COMMIT wins (the GPU machine gets a copy of the tree without .git)."""
    if env.COMMIT.is_set():
        return env.COMMIT.get()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_header(benchmark: str, workload: str, model: str, command: str) -> dict:
    """The keys every result file carries (BENCHMARKS.md): what ran, where, when, and from which code."""
    return {"benchmark": benchmark, "workload": workload, "model": model, "device": device_description(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv), "commit": git_commit(), "versions": info_dict()}


def release_engine_memory(engine) -> None:
    """The peers run after minillm, in this process: give back everything minillm's engine holds on
    the device beside the weights (which the peers share), so they get the memory a user of
    transformers would have. The KV pool is referenced by the runner, by the CUDA graphs that
    captured it (whose private memory pool holds their activations too) and by the CPU swap space;
    all three go. Ends minillm's run: the engine cannot step afterwards."""
    runner = engine.runner
    graphs = getattr(runner, "graphs", None)
    if graphs is not None:
        graphs.release()
        runner.graphs = None
    runner.cache = None
    engine.swapper = None
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_minillm(llm: LLM, workload: list[WorkloadRequest],
                use_tqdm: bool = True) -> tuple[list[RequestTiming], list[list[int]], float]:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload]
    _sync(llm.engine.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    duration = time.perf_counter() - start
    timings = [RequestTiming(o.metrics.arrival_time, o.metrics.token_times, len(o.prompt_token_ids))
               for o in outputs]
    return timings, [o.outputs[0].token_ids for o in outputs], duration


def compile_warnings(runs: dict) -> list[str]:
    """A line for each run whose timed part compiled Triton kernels (its time includes them)."""
    return [f"{name}: {m['triton_compiles']} Triton compiles inside the timed run: the warm-up missed them, "
            "and its time includes them" for name, m in runs.items() if m.get("triton_compiles")]


def engine_warmup(requests: list[WorkloadRequest], device: torch.device) -> list[WorkloadRequest]:
    """What minillm runs before a timed run, on the workload's own prompts: the Triton kernels
    compile and autotune on their first calls, and on a GPU the first use of each cuBLAS/Triton
    kernel loads its module (CUDA lazy loading). On CUDA a full batch (the first 64 requests, a few
    tokens each), so the timed run's batched shapes are met too; a CPU has nothing to load."""
    warm = 64 if device.type == "cuda" else 4
    return [WorkloadRequest(r.prompt_token_ids, min(r.max_tokens, 8)) for r in requests[:warm]]


def _timed_run(llm: LLM, requests: list[WorkloadRequest] | ChatScript, warmup,
               use_tqdm: bool = True) -> tuple[dict, list[list[int]], list[RequestTiming]]:
    """Warm up, then run the workload once (``requests``, or chats in a closed loop); serving metrics,
    step statistics, prefix-cache hits."""
    engine = llm.engine
    run_minillm(llm, warmup, use_tqdm)
    engine.stats.clear()
    graphs = getattr(engine.runner, "graphs", None)  # the static runner has none
    if graphs is not None:
        graphs.num_replays = 0
    cache = engine.prefix_cache
    if cache is not None:  # the warm-up's prompts must not count as hits
        cache.reset()
        cache.queries = cache.hits = 0
    with CompileCounter() as compiles:
        if isinstance(requests, ChatScript):
            chats = run_chats(engine, requests, use_tqdm)
            timings, tokens, metrics = chats.timings(), chats.token_ids(), chat_run_metrics(chats)
        else:
            timings, tokens, duration = run_minillm(llm, requests, use_tqdm)
            metrics = serving_metrics(timings, duration)
    metrics |= step_summary(engine.stats)
    metrics["triton_compiles"] = compiles.count  # 0 unless the warm-up missed a kernel variant
    if graphs is not None:
        metrics["cuda_graph_steps"] = graphs.num_replays
    if cache is not None:  # vLLM's names, in tokens
        metrics |= {"prefix_cache_queries": cache.queries, "prefix_cache_hits": cache.hits,
                    "prefix_cache_hit_rate": cache.hit_rate}
    return metrics, tokens, timings


def step_summary(stats) -> dict:
    """Engine statistics over a run: how full the batches and the KV cache were."""
    stats = list(stats)
    return {"num_steps": len(stats),
            "mean_batch_size": sum(s.num_seqs for s in stats) / len(stats),
            "mean_scheduled_tokens": sum(s.num_tokens for s in stats) / len(stats),
            "max_kv_usage": max(s.kv_usage for s in stats),
            "num_preemptions": stats[-1].num_preemptions - stats[0].num_preemptions}


def bench_throughput(*, model: str | None, load_format: str, workload: str, scale: str,
                     num_requests: int | None, peers: list[str], seed: int = 0, command: str = "",
                     peer_batch_size: int | None = None, variants: tuple[str, ...] = (), think_time: float = 0.0,
                     **engine_kwargs) -> dict:
    """``num_requests``: the first N requests, or for ``multi-turn`` (closed loop) N chats; ``think_time``
    (multi-turn only): seconds a chat waits between an answer and its next turn."""
    check_choices("peer", peers, PEERS)
    check_choices("variant", variants, VARIANTS)
    check_peers_can_share_weights(peers, engine_kwargs)
    if variants and engine_kwargs.get("batching") != "continuous":
        raise ValueError("variants switch parts of the paged engine; they need batching='continuous'")
    if workload == CLOSED_LOOP and (peers or engine_kwargs.get("batching") != "continuous"):
        raise ValueError(f"workload {CLOSED_LOOP!r} runs chats in a closed loop through minillm's continuous engine: "
                         f"give batching='continuous' and no peers (--batching continuous --peers), got "
                         f"batching={engine_kwargs.get('batching')!r} and peers {peers}")
    llm = LLM(model, load_format=load_format, seed=seed, **engine_kwargs)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    if workload == CLOSED_LOOP:
        chats = make_chats(scale, num_requests, seed, vocab, think_time)
        requests = chats.first_turns()  # the warm-ups' prompts
    else:
        chats = requests = make_workload(workload, scale, num_requests, seed, vocab)
    warmup = [WorkloadRequest(requests[0].prompt_token_ids[:16], 4)]
    minillm_warmup = engine_warmup(requests, engine.device)
    runs, tokens = {}, {}
    runs["minillm"], tokens["minillm"], timings = _timed_run(llm, chats, minillm_warmup)
    for variant in variants:
        use_variant(engine, variant)
        runs[f"minillm_{variant}"], tokens[f"minillm_{variant}"], _ = _timed_run(llm, chats, minillm_warmup)
    served = [ServedRequest(t.num_input_tokens, t.num_output_tokens) for t in timings if t.token_times]
    if peers:
        release_engine_memory(engine)
    # The static peer runs minillm's static batch size, or 16 (BENCHMARKS.md) against a continuous engine.
    peer_batch_size = peer_batch_size or (16 if engine.config.batching == "continuous" else engine.max_batch)
    # The contiguous layout is the static engine's own, or the static peer's against a continuous engine.
    static_batch_size = peer_batch_size if engine.config.batching == "continuous" else engine.max_batch
    kv_memory = kv_memory_summary(served, max_model_len=engine.max_model_len, block_size=engine.config.block_size,
                                  batch_size=static_batch_size)
    if "hf_static" in peers:
        hf = hf_model_sharing_weights(engine.model, engine.model_config)
        run_hf_static(hf, warmup, peer_batch_size)
        with tqdm(total=len(requests), desc="hf_static", unit="req") as bar:
            timings, tokens["hf_static"], duration = run_hf_static(hf, requests, peer_batch_size, progress=bar)
        runs["hf_static"] = serving_metrics(timings, duration)
    if "hf_cb" in peers:
        hf = hf_model_sharing_weights(engine.model, engine.model_config)
        timings, tokens["hf_cb"], duration = run_hf_continuous(hf, requests)
        runs["hf_cb"] = serving_metrics(timings, duration)
    agreement = {name: sum(a == b for a, b in zip(tokens["minillm"], toks)) / len(toks)
                 for name, toks in tokens.items() if name != "minillm"}
    return {
        **result_header("throughput", workload, engine.model_source, command),
        "scale": scale,
        "num_requests": len(tokens["minillm"]),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "peer_batch_size": peer_batch_size,
        "engine": {"batching": engine.config.batching, "max_batch": engine.max_batch,
                   "attention_backend": engine.attention_backend, "cuda_graphs": engine.cuda_graphs,
                   "enable_prefix_caching": engine.config.enable_prefix_caching,
                   "max_model_len": engine.max_model_len, "memory_budget": engine.config.memory_budget,
                   "kv_cache_dtype": engine.config.kv_cache_dtype, "kv_bytes_per_token": engine.kv_bytes_per_token,
                   "kv_cache_bytes": engine.kv_cache_bytes, "kv_capacity_tokens": engine.kv_capacity_tokens},
        "runs": runs,
        # Fraction of requests whose greedy tokens equal minillm's exactly (same weights).
        "greedy_agreement": agreement,
        "kv_memory": kv_memory,
    }


def _decode_metrics(timings: list[RequestTiming], roofline_tok_s: float) -> dict:
    """Batch-1 decode speed: tokens after the first over the time they took, per run, averaged."""
    rates = [(len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0]) for t in timings]
    mean = sum(rates) / len(rates)
    return {"mean_decode_tok_s": mean, "mean_ttft_ms": 1000 * sum(t.token_times[0] - t.arrival_time
                                                                     for t in timings) / len(timings),
            "roofline_tok_s": roofline_tok_s, "fraction_of_roofline": mean / roofline_tok_s}


def bench_latency(*, model: str | None, load_format: str, scale: str, num_requests: int | None,
                  peers: list[str], seed: int = 0, command: str = "", **engine_kwargs) -> dict:
    """The ``latency`` workload: one request at a time; decode tok/s against the bandwidth roofline."""
    from minillm.bench import roofline

    check_choices("latency peer", peers, LATENCY_PEERS)
    check_peers_can_share_weights(peers, engine_kwargs)
    engine_kwargs["max_num_seqs"] = 1
    llm = LLM(model, load_format=load_format, seed=seed, **engine_kwargs)
    engine = llm.engine
    requests = make_workload("latency", scale, num_requests, seed, engine.model_config.vocab_size)
    first = requests[0]
    context = len(first.prompt_token_ids) + first.max_tokens // 2  # the mean context while decoding
    ceilings = roofline.measure_ceilings(engine.device, engine.dtype)
    # The bytes this engine's weights and KV cache really take: INT4 weights or an INT8 cache lower the
    # floor. A parallel engine's rank holds only a shard, and offloaded layers are not in weight_bytes:
    # those keep the whole model's count at the dtype's size, one device's floor.
    one_device = engine.workers is None and not engine.offloaded_weight_bytes
    stored = dict(weights=engine.weight_bytes, kv_per_token=engine.kv_bytes_per_token) if one_device else {}
    limit = roofline.decode_roofline_tok_s(engine.model_config, engine.dtype.itemsize, 1, context, ceilings, **stored)
    run_minillm(llm, requests[:1])  # warm-up
    timings = [run_minillm(llm, [r], use_tqdm=False)[0][0] for r in tqdm(requests, desc="minillm", unit="run")]
    runs = {"minillm": _decode_metrics(timings, limit)}
    if peers:
        release_engine_memory(engine)
    for peer in peers:
        if peer == "hf_compiled" and engine.device.type != "cuda":
            runs[peer] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        hf = hf_model_sharing_weights(engine.model, engine.model_config)
        if peer == "hf_compiled":
            from transformers import CompileConfig

            hf.generation_config.cache_implementation = "static"
            hf.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        for _ in range(2):  # warm-up (compilation and graph capture for hf_compiled)
            run_hf_static(hf, requests[:1], 1)
        timings = [run_hf_static(hf, [r], 1)[0][0] for r in tqdm(requests, desc=peer, unit="run")]
        runs[peer] = _decode_metrics(timings, limit)
    return {
        **result_header("latency", "latency", engine.model_source, command),
        "scale": scale, "num_requests": len(requests), "dtype": str(engine.dtype).removeprefix("torch."),
        "engine": {"batching": engine.config.batching, "max_model_len": engine.max_model_len,
                   "tensor_parallel_size": engine.config.tensor_parallel_size,
                   "num_scheduler_steps": engine.config.num_scheduler_steps,
                   "async_scheduling": engine.config.async_scheduling},
        "ceilings": {"bandwidth_gbs": ceilings.bandwidth_gbs, "peak_tflops": ceilings.peak_tflops,
                     "decode_context": context,
                     "roofline_bytes": "as stored" if one_device else "every parameter at the dtype's size"},
        "runs": runs,
    }


def format_latency_table(result: dict) -> str:
    lines = [f"latency ({result['num_requests']} runs, batch 1) on {result['device']}, {result['model']} "
             f"{result['dtype']}; roofline {result['runs']['minillm']['roofline_tok_s']:.1f} tok/s",
             f"{'run':<12}{'decode tok/s':>14}{'of roofline':>13}{'mean TTFT ms':>14}"]
    for name, m in result["runs"].items():
        if "skipped" in m:
            lines.append(f"{name:<12}  skipped: {m['skipped']}")
            continue
        lines.append(f"{name:<12}{m['mean_decode_tok_s']:>14.1f}{m['fraction_of_roofline']:>12.0%}"
                     f"{m['mean_ttft_ms']:>14.1f}")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    runs = result["runs"]
    base = runs.get("hf_static")
    width = max(12, *(len(name) + 2 for name in runs))
    lines = [f"{result['workload']} ({result['num_requests']} requests) on {result['device']}, "
             f"{result['model']} {result['dtype']}",
             f"{'run':<{width}}{'output tok/s':>14}{'req/s':>9}{'mean TTFT ms':>14}{'mean TPOT ms':>14}{'vs hf_static':>14}"]
    for name, m in runs.items():
        ratio = f"{m['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
        lines.append(f"{name:<{width}}{m['output_throughput']:>14.1f}{m['request_throughput']:>9.2f}"
                     f"{m['mean_ttft_ms']:>14.1f}{m['mean_tpot_ms']:>14.1f}{ratio:>14}")
    for name, m in runs.items():
        if "prefix_cache_hit_rate" in m:
            shared = f"; shared-token fraction of the chats {m['shared_token_fraction']:.1%}" if "turns" in m else ""
            lines.append(f"{name}: prefix cache hit rate {m['prefix_cache_hit_rate']:.1%} "
                         f"({m['prefix_cache_hits']} of {m['prefix_cache_queries']} prompt tokens){shared}")
    chats = {name: m for name, m in runs.items() if "turns" in m}
    if chats:
        lines.append(format_turns(chats))
    off = runs.get("minillm_prefix_cache_off")
    on = runs.get("minillm_prefix_cache_on", runs["minillm"])
    if off:
        lines.append(f"prefix cache on / off: output tok/s {on['output_throughput'] / off['output_throughput']:.3f}x, "
                     f"mean TPOT {on['mean_tpot_ms'] / off['mean_tpot_ms']:.3f}x, "
                     f"mean TTFT {on['mean_ttft_ms'] / off['mean_ttft_ms']:.3f}x")
    lines += compile_warnings(runs)
    kv = result.get("kv_memory")
    if kv:
        lines.append(f"KV memory used / reserved over the run: contiguous (max_model_len={kv['max_model_len']}, "
                     f"batches of {kv['static_batch_size']}) {kv['contiguous_utilisation']:.1%}, "
                     f"paged (block_size={kv['block_size']}) {kv['paged_utilisation']:.1%}")
    return "\n".join(lines)


def write_result(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(path)  # atomic: a run killed mid-write keeps the previous complete file
    return path


def bench_gguf_load(gguf: str | None = None, command: str = "") -> dict:
    """First load of a GGUF (dequantize + write the safetensors cache) against the second (read the
    cache), each in a fresh cache directory so earlier runs cannot help the first."""
    import tempfile

    from minillm.model.loader import embedded_model_path, load_gguf

    path = Path(gguf) if gguf else embedded_model_path()
    previous = os.environ.get("MINILLM_CACHE")
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MINILLM_CACHE"] = cache
        try:
            for name in ("first_load", "second_load"):
                start = time.perf_counter()
                load_gguf(path, torch.float32, torch.device("cpu"))
                runs[name] = {"seconds": time.perf_counter() - start}
        finally:
            if previous is None:
                os.environ.pop("MINILLM_CACHE")
            else:
                os.environ["MINILLM_CACHE"] = previous
    return {**result_header("gguf-load", "load", path.name, command), "runs": runs,
            "speedup": runs["first_load"]["seconds"] / runs["second_load"]["seconds"]}
