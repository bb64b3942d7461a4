"""``minillm bench tuning-path``: the seeds' tuning path, replayed step by step on minillm.

The design documents tell a 7B model's story under a 24 GB card: FP16 + static batching (40 tok/s)
→ continuous batching + PagedAttention (120) → INT8 KV cache, batch 8 → 16 (200) → AWQ INT4 weights
+ offload (280) → prefix caching at a 35 % hit rate (320): 8× in four steps. Here every step is a
configuration of the same engine, each adding its change to the ones before, run one after the
other in one process on the ``tuning-path`` workload (BENCHMARKS.md) under the same emulated card
(``memory_budget``: weights + workspace + KV must fit, so smaller weights and KV buy concurrency
honestly). The step past the seeds' last one takes the host's per-token work off the GPU's critical
path (multi-step decoding). A larger token budget per step (``max_num_batched_tokens`` 8192) was a step
too until the H200 showed it is a latency knob, not a speed-up: +7 % at 64 requests, -2 % at 96;
``--max-num-batched-tokens`` still sets it for every step. The two transformers peers run on the same
requests with step 0's weights.

``minillm bench tour`` (``make tour``) runs the first steps that help on a CPU — static batching,
continuous batching, prefix caching — the same way, on a short CPU-scale run (``TOUR``).

The seeds' tok/s are printed and plotted beside ours as a reference, labelled as theirs: they come
from another engine on other hardware, so only the shape of the path (each step's speed-up) compares.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from minillm.bench.harness import (_timed_run, check_choices, compile_warnings, engine_warmup, release_engine_memory,
                                   result_header, run_hf_continuous, run_hf_static)
from minillm.bench.metrics import serving_metrics
from minillm.bench.peers import hf_model_sharing_weights
from minillm.bench.workloads import WorkloadRequest, make_workload
from minillm.config import EngineConfig, parse_bytes
from minillm.engine import resolve_device
from minillm.kv.budget import workspace_bytes
from minillm.kv.quant import kv_bytes_per_token
from minillm.llm import LLM
from minillm.model.loader import model_bytes_before_loading, read_model_config, resolve_dtype
from minillm.quant.checkpoint import save_quantized
from minillm.quant.spec import QuantSpec


@dataclass(frozen=True)
class Step:
    name: str
    label: str
    changes: dict = field(default_factory=dict)  # engine keywords this step adds to the previous step's
    seeds_tok_s: float | None = None  # the design documents' figure for this step (7B, their hardware)


STEPS = (
    Step("0_static", "static batching, contiguous KV, 16-bit weights", {"batching": "static"}, 40),
    Step("1_paged", "+ continuous batching, paged KV (PagedAttention)", {"batching": "continuous"}, 120),
    Step("2_kv_int8", "+ INT8 KV cache", {"kv_cache_dtype": "int8"}, 200),
    Step("3_awq_int4", "+ AWQ INT4 weights", {"quantization": "awq-int4"}, 280),
    Step("4_prefix_cache", "+ prefix caching, longest prefix first",
         {"enable_prefix_caching": True, "scheduling_policy": "lpm"}, 320),
    Step("5_multi_step", "+ 8 decode passes per scheduler step (beyond the seeds)", {"num_scheduler_steps": 8}),
)
STEP_NAMES = tuple(step.name for step in STEPS)
# The tour: the steps that pay on a CPU, on 16 requests with contexts up to 1024 tokens. Under the
# same card (weights + 4 sequences of 1024 tokens) static batching holds 4 sequences; paged KV holds
# every request at once, since each takes only the blocks its tokens fill. A step's token budget of
# 512 admits the 128-token prompts four at a time, so later ones find earlier system prompts cached.
TOUR = (
    Step("static", "static batching, contiguous KV", {"batching": "static"}),
    Step("continuous", "+ continuous batching, paged KV", {"batching": "continuous"}),
    Step("prefix_cache", "+ prefix caching, longest prefix first",
         {"enable_prefix_caching": True, "scheduling_policy": "lpm"}),
)
TOUR_REQUESTS, TOUR_MAX_MODEL_LEN, TOUR_TOKEN_BUDGET = 16, 1024, 512
PEERS = ("hf_static", "hf_cb")
PEER_LABELS = {"hf_static": "transformers generate (static)", "hf_cb": "transformers continuous batching"}
# The emulated card: BENCHMARKS.md's 24 GB at GPU scale. At CPU scale, the embedded model's weights
# plus its workspace plus KV for 4 sequences of max_model_len: as tight, relative to the model, as
# 8 sequences are for a 7B.
GPU_BUDGET, CPU_STATIC_SEQUENCES = "24GB", 4
MAX_MODEL_LEN = {"gpu": 2048, "cpu": 256}
# AWQ's calibration (step 3) sets the quantized weights' accuracy, not their speed, which is what this
# benchmark measures; on a CPU 32 samples of 512 tokens take minutes, so the CPU scale takes 8.
CALIBRATION_SAMPLES = {"gpu": 32, "cpu": 8}


def cpu_budget(step0: EngineConfig, max_model_len: int) -> int:
    """The CPU scale's card, sized from the model's config before any engine exists: step 0's weights
    plus their workspace plus KV for ``CPU_STATIC_SEQUENCES`` sequences of ``max_model_len``, by the
    engine's own arithmetic (``Engine.weight_bytes``, ``kv/budget.py``, ``kv/quant.py``). Every
    step, and a run of only some steps, gets this same card."""
    config = read_model_config(step0.model, step0.load_format)
    dtype = resolve_dtype(step0.dtype, resolve_device(step0.device))
    weights = model_bytes_before_loading(config, dtype)
    per_token = kv_bytes_per_token(config, step0.kv_cache_dtype, dtype)
    return weights + workspace_bytes(weights) + CPU_STATIC_SEQUENCES * max_model_len * per_token


def bench_tuning_path(*, model: str | None, load_format: str, scale: str, num_requests: int | None,
                      peers: list[str], steps: list[str] | None = None, memory_budget: int | str | None = None,
                      seed: int = 0, command: str = "", progress: bool = True,
                      path: tuple[Step, ...] | None = None, **engine_kwargs) -> dict:
    """Run the chosen steps of ``path`` (all by default, in order, each on top of the ones before) and
    peers; ``progress=False`` hides the progress bars of the timed runs. ``path``: STEPS by default."""
    path = path or STEPS
    names = tuple(step.name for step in path)
    if steps is not None:
        check_choices("step", steps, names)
        if not steps:
            raise ValueError("no step to run: give at least one of " + ", ".join(names))
    chosen = [name for name in names if steps is None or name in steps]  # the path's order
    check_choices("peer", peers, PEERS)
    if peers and names[0] not in chosen:
        raise ValueError(f"the peers {', '.join(peers)} run on step {names[0]}'s weights, which is not among "
                         f"the steps {', '.join(chosen)}: add it, or run no peers (--peers with no names)")
    max_model_len = engine_kwargs.pop("max_model_len", None) or MAX_MODEL_LEN[scale]
    if engine_kwargs.get("calibration_samples") is None:
        engine_kwargs["calibration_samples"] = CALIBRATION_SAMPLES[scale]
    budget = memory_budget if memory_budget is not None else (GPU_BUDGET if scale == "gpu" else None)
    configs, config, checked = {}, dict(engine_kwargs), []
    if config.get("async_scheduling") is None:  # (on by default; the path's steps are measured without it,
        config["async_scheduling"] = False      # figures/*/tuning_path.json: --async-scheduling adds it)
    for step in path:  # every step's configuration is checked before the first one runs
        config = configs[step.name] = config | step.changes
        checked.append(EngineConfig(model=model, load_format=load_format, max_model_len=max_model_len,
                                    memory_budget=budget, seed=seed, **config))
    if budget is None:  # CPU scale
        budget = cpu_budget(checked[0], max_model_len)
    runs, requests, header = {}, None, None
    with tempfile.TemporaryDirectory(prefix="minillm-tuning-path-") as scratch:
        saved: dict[str, tuple[str, str]] = {}  # quantization -> (checkpoint, the step that quantized)
        for index, name in enumerate(chosen):
            step, config = path[names.index(name)], configs[name]
            quantization = config.get("quantization")
            # A later step with the same quantized weights loads the first one's checkpoint instead of
            # calibrating again (minutes for AWQ; the weights are identical, tests/test_quant_checkpoint.py).
            source, source_format = (saved[quantization][0], "auto") if quantization in saved else (model, load_format)
            llm = LLM(source, load_format=source_format, seed=seed, max_model_len=max_model_len,
                      memory_budget=budget, **config)
            engine = llm.engine
            if requests is None:
                requests = make_workload("tuning-path", scale, num_requests, seed, engine.model_config.vocab_size)
                header = result_header("tuning-path", "tuning-path", engine.model_source, command)
            # The throughput bench's warm-up (64 requests on CUDA): a kernel variant or autotuning met
            # first inside a run of seconds would weigh on it (each run records triton_compiles).
            metrics, _, _ = _timed_run(llm, requests, engine_warmup(requests, engine.device), progress)
            runs[name] = {"label": step.label, "changes": dict(step.changes), "seeds_tok_s": step.seeds_tok_s,
                          "max_batch": engine.max_batch, "kv_capacity_tokens": engine.kv_capacity_tokens,
                          "weight_bytes": engine.weight_bytes, **metrics}
            if quantization in saved:
                runs[name]["quantized_weights_from"] = saved[quantization][1]
            elif quantization is not None and QuantSpec.parse(quantization).method != "fp8" and \
                    any(configs[later].get("quantization") == quantization for later in chosen[index + 1:]):
                saved[quantization] = (str(save_quantized(llm, Path(scratch) / name)), name)
            if name == names[0] and peers:
                runs |= _run_peers(engine, requests, peers, progress)
            _free(llm)
    first = runs.get(names[0])
    for name in chosen:
        runs[name]["speedup_over_step0"] = runs[name]["output_throughput"] / first["output_throughput"] \
            if first else None
    return {**header, "scale": scale, "num_requests": len(requests), "memory_budget": parse_bytes(budget),
            "max_model_len": max_model_len, "calibration_samples": engine_kwargs["calibration_samples"],
            "steps": chosen, "runs": runs}


def _run_peers(engine, requests: list[WorkloadRequest], peers: list[str], progress: bool) -> dict:
    """transformers on step 0's weights, after minillm's step 0 gave its KV cache back."""
    release_engine_memory(engine)
    hf, runs = hf_model_sharing_weights(engine.model, engine.model_config), {}
    if "hf_static" in peers:
        run_hf_static(hf, [WorkloadRequest(requests[0].prompt_token_ids[:16], 4)], engine.max_batch)
        with tqdm(total=len(requests), desc="hf_static", unit="req", disable=not progress) as bar:
            timings, _, duration = run_hf_static(hf, requests, engine.max_batch, progress=bar)
        runs["hf_static"] = serving_metrics(timings, duration) | {"batch_size": engine.max_batch}
    if "hf_cb" in peers:
        timings, _, duration = run_hf_continuous(hf, requests)
        runs["hf_cb"] = serving_metrics(timings, duration)
    return runs


def _free(llm: LLM) -> None:
    device = llm.engine.device
    llm.close()
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_tuning_path(result: dict) -> str:
    runs = result["runs"]
    lines = [f"tuning path ({result['num_requests']} requests, {result['memory_budget'] / 1e9:.2f} GB card) on "
             f"{result['device']}, {result['model']}",
             f"{'step':<16}{'tok/s':>9}{'TTFT p50 ms':>13}{'p99 ms':>9}{'batch':>7}{'KV tokens':>11}"
             f"{'hit rate':>10}{'speed-up':>10}{'seeds':>7}"]
    for name in result["steps"]:
        m = runs[name]
        hits = f"{m['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in m else "-"
        speedup = f"{m['speedup_over_step0']:.2f}x" if m["speedup_over_step0"] else "-"
        seeds = f"{m['seeds_tok_s']:.0f}" if m["seeds_tok_s"] else "-"
        lines.append(f"{name:<16}{m['output_throughput']:>9.1f}{m['median_ttft_ms']:>13.0f}{m['p99_ttft_ms']:>9.0f}"
                     f"{m['mean_batch_size']:>7.1f}{m['kv_capacity_tokens']:>11}{hits:>10}{speedup:>10}{seeds:>7}")
    for peer in PEERS:
        if peer in runs:
            m = runs[peer]
            lines.append(f"{peer:<16}{m['output_throughput']:>9.1f}{m['median_ttft_ms']:>13.0f}{m['p99_ttft_ms']:>9.0f}")
    lines.append("seeds = the design documents' tok/s for a 7B on their hardware (a reference, not measured here)")
    lines += compile_warnings(runs)
    return "\n".join(lines)


def format_tour(result: dict) -> str:
    """The tour's table: each step and transformers, with its speed-up over static batching and
    over transformers' static ``generate`` (the peer a first deployment would use)."""
    runs, first = result["runs"], result["steps"][0]
    static, hf = runs[first]["output_throughput"], runs.get("hf_static", {}).get("output_throughput")
    lines = [f"{result['num_requests']} requests of the tuning-path workload on {result['device']}, {result['model']}, "
             f"one {result['memory_budget'] / 1e9:.2f} GB budget for weights + KV",
             f"{'':<40}{'tok/s':>8}{'batch':>7}{'TTFT p50 s':>12}{'vs static':>11}{'vs transformers':>17}"]
    rows = [(runs[name]["label"], runs[name]) for name in result["steps"]]
    rows += [(PEER_LABELS[peer], runs[peer]) for peer in PEERS if peer in runs]
    for label, m in rows:
        batch = f"{m['mean_batch_size']:.1f}" if "mean_batch_size" in m else f"{m.get('batch_size', '-')}"
        versus_hf = f"{m['output_throughput'] / hf:.2f}x" if hf else "-"
        lines.append(f"{label:<40}{m['output_throughput']:>8.1f}{batch:>7}{m['median_ttft_ms'] / 1e3:>12.1f}"
                     f"{m['output_throughput'] / static:>10.2f}x{versus_hf:>17}")
    hits = [m for _, m in rows if "prefix_cache_hit_rate" in m]
    if hits:
        lines.append(f"prefix cache: {hits[-1]['prefix_cache_hit_rate']:.0%} of prompt tokens found cached")
    lines += compile_warnings(runs)
    return "\n".join(lines)


def plot_tuning_path(result: dict, path) -> str:
    """Bars: each step's speed-up over step 0, ours beside the seeds'; line: median TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, names = result["runs"], result["steps"]
    xs = range(len(names))
    fig, axis = plt.subplots(figsize=(2 + 1.4 * len(names), 4.2))
    ours = [runs[n]["speedup_over_step0"] or 0 for n in names]
    seeds0 = STEPS[0].seeds_tok_s
    seeds = [runs[n]["seeds_tok_s"] / seeds0 if runs[n]["seeds_tok_s"] else 0 for n in names]
    bars = axis.bar([x - 0.2 for x in xs], ours, width=0.4, label="minillm, measured")
    axis.bar_label(bars, labels=[f"{runs[n]['output_throughput']:.0f} tok/s" for n in names], fontsize=7)
    axis.bar([x + 0.2 for x in xs], seeds, width=0.4, color="lightgray", label="the seeds' path (reference)")
    axis.set_xticks(list(xs), names, rotation=15, fontsize=8)
    axis.set_ylabel("output throughput / step 0")
    ttft = axis.twinx()
    ttft.plot(list(xs), [runs[n]["median_ttft_ms"] / 1e3 for n in names], "o-", color="tab:red", label="median TTFT")
    ttft.set_ylabel("median TTFT (s)", color="tab:red")
    ttft.set_ylim(bottom=0)
    handles = axis.get_legend_handles_labels()[0] + ttft.get_legend_handles_labels()[0]
    axis.legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle(f"tuning path, {result['model']}, {result['memory_budget'] / 1e9:.2f} GB card, "
                 f"{result['device']} · commit {result['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
