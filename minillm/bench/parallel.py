"""``minillm bench parallel``: what splitting a model over N processes (GPUs) buys, and what it costs.

For one process (the reference) and for each size N > 1 and each way of splitting — tensor parallel
(``tp``: every layer split, two all-reduces per layer) and pipeline parallel (``pp``: the layers
split into stages, hidden states sent between them) — one LLM runs:

- **batch-1 decode latency** (the ``latency`` workload, one request at a time). TP's promise: each
  rank reads 1/N of the weights per token. A pipeline cannot make one sequence faster.
- **throughput** on a workload (``mixed`` by default), its greedy tokens compared with N = 1's.
- **per-collective times** on the process group the layers use (NCCL on GPUs, gloo on a CPU):
  all-reduce of a [tokens, hidden] tensor at decode and prefill token counts, with the bus
  bandwidth as nccl-tests defines it (bytes x 2(N-1)/N / time, NVIDIA nccl-tests,
  doc/PERFORMANCE.md), and a send/recv ping-pong between ranks 0 and 1 (one stage boundary).
- **the pipeline bubble** (pp): a batch of equal requests run with several micro-batch counts M,
  the measured idle share beside GPipe's (S-1)/(M+S-1) (``minillm.parallel.pp``).

Each configuration runs as the engine runs by default: on GPUs one process and tensor parallelism
replay CUDA graphs for decode (every TP rank captures the same graphs, NCCL all-reduces inside), a
pipeline runs eagerly (its micro-batches cross processes mid-step). ``cuda_graphs`` in each run says
which; ``--enforce-eager`` makes every configuration eager.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
import torch.distributed as dist

from minillm.bench.harness import _sync, check_choices, result_header, run_minillm
from minillm.bench.metrics import serving_metrics
from minillm.bench.workloads import WorkloadRequest, make_workload
from minillm.llm import LLM

MODES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
# Token counts of the collectives: a decode step of 1, 16 and 256 sequences, and prefill chunks.
COLLECTIVE_TOKENS = {"gpu": (1, 16, 256, 2048, 8192), "cpu": (1, 16, 256, 2048)}
COLLECTIVE_REPEATS = {"gpu": 50, "cpu": 10}
BUBBLE_BATCH = {"gpu": 32, "cpu": 8}  # equal requests (the latency workload's prompts) run together ...
BUBBLE_OUTPUT = {"gpu": 64, "cpu": 16}  # ... for this many tokens each, once per micro-batch count


def bench_parallel(*, model: str | None, load_format: str, sizes: list[int], modes: list[str], workload: str,
                   scale: str, num_requests: int | None, latency_runs: int | None, micro_batches: list[int],
                   seed: int = 0, command: str = "", on_progress=None, **engine_kwargs) -> dict:
    """Run every configuration in turn (one LLM alive at a time) and return the result document.
    ``on_progress(document)`` gets the document so far after each configuration (the CLI writes it:
    a run cut short by a time limit keeps what it measured)."""
    check_choices("mode", modes, MODES)
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be positive integers, got {sizes}")
    if any(m < 1 or m > BUBBLE_BATCH[scale] for m in micro_batches):
        raise ValueError(f"micro-batch counts must be in 1..{BUBBLE_BATCH[scale]} (the bubble batch at "
                         f"{scale} scale), got {micro_batches}")
    configurations = [("1", {})] + [(f"{mode}{n}", {MODES[mode]: n}) for mode in modes
                                    for n in sorted(set(sizes)) if n > 1]
    runs, reference, facts = {}, None, {}

    def document() -> dict:
        return {**result_header("parallel", workload, facts.get("model", str(model)), command), "scale": scale,
                "dtype": facts.get("dtype"), "sizes": sorted(set(sizes) | {1}), "modes": list(modes), "runs": runs}

    for name, parallel in configurations:
        # Rank 0's GPU as the configuration finds it: the one before it should have given everything back.
        free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
        try:
            llm = LLM(model, load_format=load_format, seed=seed, batching="continuous", **parallel, **engine_kwargs)
        except ValueError as e:
            if not parallel:
                raise
            runs[name] = {"skipped": str(e)}  # a size this model does not split into: say why, go on
            continue
        except Exception as e:  # e.g. out of memory: recorded, and the other configurations still run
            if not parallel:
                raise
            runs[name] = {"failed": f"{type(e).__name__}: {e}", "free_bytes_before": free}
            print(f"{name}: failed to build: {runs[name]['failed']}", file=sys.stderr)
            continue
        try:
            facts = facts or {"model": llm.engine.model_source, "dtype": str(llm.engine.dtype).removeprefix("torch.")}
            runs[name], tokens = _measure(llm, workload, scale, num_requests, latency_runs, micro_batches, seed)
            runs[name]["free_bytes_before"] = free
        finally:
            device = llm.engine.device
            llm.close()
            del llm  # rank 0's weights and KV cache go before the next configuration takes the GPU
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        reference = reference or tokens
        runs[name]["greedy_agreement"] = sum(a == b for a, b in zip(tokens, reference)) / len(reference)
        if on_progress is not None:
            on_progress(document())
    return document()


def _measure(llm: LLM, workload: str, scale: str, num_requests: int | None, latency_runs: int | None,
             micro_batches: list[int], seed: int) -> tuple[dict, list[list[int]]]:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    size = 1 if engine.workers is None else engine.workers.part.size
    run = {"ranks": size, "cuda_graphs": engine.cuda_graphs, "weight_bytes_rank0": engine.weight_bytes,
           "kv_cache_bytes_rank0": engine.kv_cache_bytes}

    latency_requests = make_workload("latency", scale, latency_runs, seed, vocab)
    run_minillm(llm, latency_requests[:1], use_tqdm=False)  # warm-up
    timings = [run_minillm(llm, [r], use_tqdm=False)[0][0] for r in latency_requests]
    latency = serving_metrics(timings, 1.0)  # only the per-token times are used
    run["latency"] = {"mean_ttft_ms": latency["mean_ttft_ms"], "mean_tpot_ms": latency["mean_tpot_ms"],
                      "decode_tok_s": 1e3 / latency["mean_tpot_ms"]}

    requests = make_workload(workload, scale, num_requests, seed, vocab)
    run_minillm(llm, [WorkloadRequest(r.prompt_token_ids, min(r.max_tokens, 8)) for r in requests[:4]],
                use_tqdm=False)  # warm-up on the workload's own lengths
    if engine.stage is not None:
        engine.runner.bubble_report()  # forget the warm-up's steps
    timings, tokens, duration = run_minillm(llm, requests, use_tqdm=False)
    run["throughput"] = serving_metrics(timings, duration)
    if engine.stage is not None:
        run["throughput"]["bubble"] = engine.runner.bubble_report()["by_micro_batches"]

    if engine.workers is not None:
        run["collectives"] = engine.workers.run_everywhere(engine.runner, time_collectives, COLLECTIVE_TOKENS[scale],
                                                           COLLECTIVE_REPEATS[scale])
    if engine.stage is not None:
        batch = [WorkloadRequest(r.prompt_token_ids, BUBBLE_OUTPUT[scale])
                 for r in make_workload("latency", scale, BUBBLE_BATCH[scale], seed, vocab)]
        run["bubble"] = bubble_sweep(llm, batch, micro_batches)
    return run, tokens


def bubble_sweep(llm: LLM, batch: list[WorkloadRequest], micro_batches: list[int]) -> dict:
    """The same batch once per micro-batch count: measured bubble, formula, and the last step's
    compute intervals on every stage (to draw its timeline)."""
    runner, results = llm.engine.runner, {}
    default = runner.micro_batches
    try:
        for count in micro_batches:
            runner.micro_batches = count
            runner.bubble_report()  # start from no recorded steps
            run_minillm(llm, batch, use_tqdm=False)
            report = runner.bubble_report()
            results[str(count)] = {**report["by_micro_batches"][str(count)], "last_step": report["last_step"]}
    finally:
        runner.micro_batches = default
    return results


def time_collectives(runner, token_counts: tuple[int, ...], repeats: int) -> list[dict] | None:
    """Every rank: all-reduce [tokens, hidden] tensors of the model's dtype on the default group (the
    one the tensor-parallel layers use), then ranks 0 and 1 pass the same tensor back and forth
    (what one pipeline stage sends the next). Returns rank 0's timings; None on the other ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    device, dtype = runner.device, runner.cache.k.dtype
    generator = torch.Generator(device=device).manual_seed(rank)
    results = []
    for tokens in token_counts:
        # The sums grow with every repeat (and may overflow at many ranks): only the time matters.
        x = torch.randn(tokens, runner.model.config.hidden_size, generator=generator, device=device).to(dtype)
        all_reduce = _seconds_per_call(lambda: dist.all_reduce(x), repeats, device)
        one_way = _seconds_per_call(lambda: _ping_pong(x, rank), repeats, device) / 2
        if rank == 0:  # ranks > 1 sat out the ping-pong: their times mean nothing
            results.append({"tokens": tokens, "bytes": x.nbytes, "all_reduce_ms": all_reduce * 1e3,
                            "all_reduce_bus_gbs": x.nbytes * 2 * (size - 1) / size / all_reduce / 1e9,
                            "send_recv_ms": one_way * 1e3, "send_recv_gbs": x.nbytes / one_way / 1e9})
    return results if rank == 0 else None


def _ping_pong(x: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    elif rank == 1:
        dist.recv(x, 0)
        dist.send(x, 0)


def _seconds_per_call(call, repeats: int, device: torch.device) -> float:
    for _ in range(3):  # warm-up: connections, NCCL communicators; and the ranks line up
        call()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def format_parallel_table(result: dict) -> str:
    runs = result["runs"]
    base = runs["1"]
    lines = [f"parallel on {result['device']}, {result['model']} {result['dtype']}; "
             f"throughput on {result['workload']}",
             f"{'run':<6}{'decode tok/s (b=1)':>20}{'vs 1':>7}{'output tok/s':>14}{'vs 1':>7}{'greedy = 1':>12}"]
    for name, run in runs.items():
        if "skipped" in run or "failed" in run:
            lines.append(f"{name:<6}  " + (f"skipped: {run['skipped']}" if "skipped" in run else f"failed: {run['failed']}"))
            continue
        decode, output = run["latency"]["decode_tok_s"], run["throughput"]["output_throughput"]
        lines.append(f"{name:<6}{decode:>20.1f}{decode / base['latency']['decode_tok_s']:>6.2f}x"
                     f"{output:>14.1f}{output / base['throughput']['output_throughput']:>6.2f}x"
                     f"{run['greedy_agreement']:>12.0%}")
    for name, run in runs.items():
        if "collectives" in run:
            lines.append(f"{name} collectives: " + "; ".join(
                f"{c['tokens']} tok all-reduce {c['all_reduce_ms']:.3f} ms, send {c['send_recv_ms']:.3f} ms"
                for c in run["collectives"]))
        if "bubble" in run:
            lines.append(f"{name} bubble (measured / formula): " + "; ".join(
                f"M={m} {b['measured_bubble']:.0%} / {b['formula_bubble']:.0%}" for m, b in run["bubble"].items()))
    return "\n".join(lines)
