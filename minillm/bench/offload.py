"""``minillm bench offload``: what keeping weights in CPU memory (``cpu_offload_gb``) costs, and buys.

One engine per offload amount, one at a time (0 GiB always first, the reference), each run as the
engine runs by default (continuous batching; CUDA graphs on GPUs, the copies captured inside):

- **batch-1 decode** (the ``latency`` workload's prompts, outputs capped at 64 tokens on a GPU):
  every step pays the whole copy, so tok/s sits below ``1 / max(weights / HBM bandwidth,
  offloaded bytes / host->device bandwidth)``, both bandwidths measured in the same run;
- **throughput** on a small workload (``mixed``, 32 requests on a GPU), where a batch shares it;
- what crosses PCIe per step (``pcie_bytes_per_step``), the device's weight bytes (resident layers
  plus the staging buffers) and the KV capacity they leave under the budget (``--memory-budget``);
- ratios to the 0 GiB run, and greedy agreement with it on the batch-1 requests (run one at a
  time, so their schedule does not depend on the KV capacity, unlike the workload's): offload
  moves bytes and never changes them, so anything below 1.0 is a bug (a layer computed from a
  buffer before its copy landed).
"""

from __future__ import annotations

import gc

import torch

from minillm.bench.harness import _decode_metrics, _timed_run, engine_warmup, result_header, run_minillm
from minillm.bench.plots import _figure, _save
from minillm.bench.roofline import measure_bandwidth, measure_host_to_device_bandwidth
from minillm.bench.workloads import WorkloadRequest, make_workload
from minillm.llm import LLM
from minillm.model.loader import model_bytes

DEFAULT_AMOUNTS = {"gpu": [0, 1, 2, 4], "cpu": [0, 0.05, 0.1]}  # GiB; cpu: SmolLM2 fp32 (13.5 MiB a layer)
NUM_REQUESTS = {"gpu": 32, "cpu": 8}
LATENCY_RUNS = {"gpu": 3, "cpu": 2}
LATENCY_TOKENS = {"gpu": 64, "cpu": 16}  # output tokens per batch-1 run


def bench_offload(*, model: str | None, load_format: str, amounts: list[float] | None, workload: str, scale: str,
                  num_requests: int | None, latency_runs: int | None, seed: int = 0, command: str = "",
                  **engine_kwargs) -> dict:
    """Run every offload amount in turn and return the result document (BENCHMARKS.md's keys)."""
    amounts = sorted(set(DEFAULT_AMOUNTS[scale] if amounts is None else amounts) | {0})
    runs, reference, facts = {}, None, {}
    for amount in amounts:
        llm = LLM(model, load_format=load_format, seed=seed, batching="continuous", cpu_offload_gb=amount,
                  **engine_kwargs)
        try:
            facts = facts or _facts(llm)  # once, on the 0 GiB engine (no reference to it outlives this LLM)
            run, tokens = _measure(llm, facts, workload, scale, num_requests, latency_runs, seed)
        finally:
            device = llm.engine.device
            del llm  # this engine's weights, pinned buffers and KV cache go before the next one's
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        reference = reference or (run, tokens)
        base, base_tokens = reference
        run["decode_ratio"] = run["latency"]["mean_decode_tok_s"] / base["latency"]["mean_decode_tok_s"]
        run["throughput_ratio"] = run["throughput"]["output_throughput"] / base["throughput"]["output_throughput"]
        run["greedy_agreement"] = sum(a == b for a, b in zip(tokens, base_tokens)) / len(base_tokens)
        runs[f"{amount:g}GiB"] = run
    return {**result_header("offload", workload, facts["model"], command), "scale": scale, "dtype": facts["dtype"],
            "memory_budget": engine_kwargs.get("memory_budget"),
            "hbm_bandwidth_gbs": facts["hbm_bandwidth_gbs"], "h2d_bandwidth_gbs": facts["h2d_bandwidth_gbs"],
            "latency_max_tokens": LATENCY_TOKENS[scale], "runs": runs}


def _facts(llm: LLM) -> dict:
    """The model, and both links the weights cross: HBM (device copy) and PCIe (host to device)."""
    engine = llm.engine
    return {"model": engine.model_source, "dtype": str(engine.dtype).removeprefix("torch."),
            "hbm_bandwidth_gbs": measure_bandwidth(engine.device),
            "h2d_bandwidth_gbs": measure_host_to_device_bandwidth(engine.device)}


def _measure(llm: LLM, facts: dict, workload: str, scale: str, num_requests: int | None, latency_runs: int | None,
             seed: int) -> tuple[dict, list[list[int]]]:
    engine, offloader = llm.engine, llm.engine.offloader
    vocab = engine.model_config.vocab_size
    pcie_bytes = 0 if offloader is None else offloader.bytes_per_step
    run = {"cpu_offload_gb": engine.config.cpu_offload_gb,
           "offloaded_layers": [] if offloader is None else offloader.indices,
           "offloaded_weight_bytes": engine.offloaded_weight_bytes, "pcie_bytes_per_step": pcie_bytes,
           "device_weight_bytes": engine.weight_bytes,
           "staging_bytes": 0 if offloader is None else offloader.staging_bytes,
           "kv_capacity_tokens": engine.kv_capacity_tokens, "cuda_graphs": engine.cuda_graphs,
           # Time floors of one step: every weight read from HBM once; the offloaded bytes over the link.
           "hbm_ms_per_step": 1e3 * model_bytes(engine.model) / (facts["hbm_bandwidth_gbs"] * 1e9),
           "pcie_ms_per_step": 1e3 * pcie_bytes / (facts["h2d_bandwidth_gbs"] * 1e9)}

    requests = [WorkloadRequest(r.prompt_token_ids, min(r.max_tokens, LATENCY_TOKENS[scale]))
                for r in make_workload("latency", scale, latency_runs or LATENCY_RUNS[scale], seed, vocab)]
    run_minillm(llm, requests[:1], use_tqdm=False)  # warm-up
    runs = [run_minillm(llm, [r], use_tqdm=False) for r in requests]
    timings, tokens = [t[0] for t, _, _ in runs], [k[0] for _, k, _ in runs]
    run["latency"] = _decode_metrics(timings, 1e3 / max(run["hbm_ms_per_step"], run["pcie_ms_per_step"]))

    requests = make_workload(workload, scale, num_requests or NUM_REQUESTS[scale], seed, vocab)
    run["throughput"], _, _ = _timed_run(llm, requests, engine_warmup(requests, engine.device), use_tqdm=False)
    return run, tokens  # the batch-1 tokens: their schedule is the same whatever the KV capacity


def format_offload_table(result: dict) -> str:
    lines = [f"offload on {result['device']}, {result['model']} {result['dtype']}: host->device "
             f"{result['h2d_bandwidth_gbs']:.1f} GB/s, device copy {result['hbm_bandwidth_gbs']:.0f} GB/s",
             f"{'offload':<9}{'layers':>7}{'PCIe MB/step':>14}{'floor ms':>10}{'decode tok/s':>14}{'vs 0':>7}"
             f"{'output tok/s':>14}{'vs 0':>7}{'KV tokens':>11}{'agree':>7}"]
    for name, m in result["runs"].items():
        floor = max(m["hbm_ms_per_step"], m["pcie_ms_per_step"])
        lines.append(f"{name:<9}{len(m['offloaded_layers']):>7}{m['pcie_bytes_per_step'] / 1e6:>14.1f}{floor:>10.2f}"
                     f"{m['latency']['mean_decode_tok_s']:>14.1f}{m['decode_ratio']:>6.2f}x"
                     f"{m['throughput']['output_throughput']:>14.1f}{m['throughput_ratio']:>6.2f}x"
                     f"{m['kv_capacity_tokens']:>11}{m['greedy_agreement']:>7.0%}")
    return "\n".join(lines)


def plot_offload(result: dict, path) -> object:
    """Batch-1 decode tok/s (with each run's floor) and workload throughput, per offload amount."""
    names, runs = list(result["runs"]), list(result["runs"].values())
    plt, fig, (left, right) = _figure(10)
    bars = left.bar(names, [m["latency"]["mean_decode_tok_s"] for m in runs], color="tab:blue")
    left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.plot(names, [m["latency"]["roofline_tok_s"] for m in runs], "k_", markersize=30,
              label="ceiling: 1 / max(HBM, PCIe time per step)")
    left.set_ylabel("decode tok/s (batch 1)")
    left.legend(fontsize=8)
    bars = right.bar(names, [m["throughput"]["output_throughput"] for m in runs], color="tab:blue")
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_ylabel(f"output tok/s ({result['workload']})")
    for axis in (left, right):
        axis.set_xlabel("cpu_offload_gb")
    fig.suptitle(f"weight offload, {result['model']} {result['dtype']}, {result['device']} · host->device "
                 f"{result['h2d_bandwidth_gbs']:.0f} GB/s · commit {result['commit']}", fontsize=9)
    return _save(plt, fig, path)
