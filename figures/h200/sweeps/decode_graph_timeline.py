"""Where a batch-1 decode step's GPU time goes, from its CUDA graph: llama2-7b (dummy weights), one engine per variant
in one process, each after a 128-token prompt and 128 decoded tokens (the ``latency`` workload's mean context).
Variants (VARIANTS, comma-separated, picks some): RTN INT4 as it ships (norms folded into the GEMVs,
``model/norm_folding.py``), with the GEMVs that add to a row on the stream-K kernel (int4_stream, as
MINILLM_GEMV_STREAM=1; int4_stream_o / _normed / _down: only those; _2x3: all, two programs an SM of three slots;
_late: the next kernel let start at the end; _deep: one program an SM of 12 slots, most of a run in flight; and
int4_head_stream_plain / int4_norm_kernels_stream_plain: the plain form, y = x W in bf16, on it), with the LM head
quantized too (rtn-int4-head), with the norm kernels (MINILLM_NORM_IN_GEMV=0), with gate_up_proj applying its norm's
1 / rms itself (MINILLM_DEFER_MLP_NORM=0), qkv_proj (MINILLM_DEFER_ATTENTION_NORM=0) or neither, with the decode
attention's splits merged by their last program instead of a merge kernel (``paged_attention.DEFAULT_MERGE``), with 1, 2, 4 or 8 tiles a W4A16
GEMV program in every projection (2 won on cold standalone calls), or other counts for some of a layer's four
projections (``choose_tiles`` gives o_proj 1 and the others 4; o_proj at 4 as before session 22, down_proj at 2 ...),
with the attention's splits pinned to 1, 2 or 4 (9 by default at batch 1), or in other tiles (``ATTENTION_SHAPES``, bf16
too); with the head in INT8 (rtn-int4-head8); with a KV cache of 3000 or 10000 blocks (24 or 80 GB) where the
others hold 300;
without the RoPE table (MINILLM_ROPE_TABLE=0), with the first layer's input norm a kernel (MINILLM_FOLD_FIRST_NORM=0),
or with neither of these two (int4_session26: as session 26 shipped); bf16, bf16 at 1 split, bf16 merged in the last
split, and bf16 without the RoPE table.

- **GPU time a token:** the engines' batch-1 decode graphs replayed back to back (no host work between replays:
  what the GPU alone takes a token), in interleaved rounds ABC CBA ..., so that a drift weighs on all alike.
- **Timeline:** the kernels of a few replays (torch.profiler), per kernel name: launches a step, mean duration, and
  mean increment, the time from the end of the kernel before to the end of this one (with programmatic dependent
  launch kernels overlap, so durations include waiting; the increments add up to the step), and per place in the
  step (``step_in_order``: each kernel of a step in launch order), which shows where within a layer it goes.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_graph_timeline.py``
(NAME names the JSON: decode_graph_timeline by default)."""
import collections
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.kernels import paged_attention, w4_gemv_hopper, w4_gemv_stream  # noqa: E402
from minillm.model import llama, norm_folding  # noqa: E402

ROUNDS, REPLAYS, PROFILED = 6, 100, 5
# name: (quantization, {module: {setting: value while the engine is built and its graphs captured}})
DEFAULTS = {norm_folding: {"ENABLED": True, "DEFER_MLP_NORM": True, "DEFER_ATTENTION_NORM": True,
                           "FOLD_FIRST_NORM": True},
            llama: {"ROPE_TABLE": True},
            paged_attention: {"DEFAULT_MERGE": "kernel", "choose_num_splits": paged_attention.choose_num_splits,
                              "GPU_LAUNCH": {}},
            w4_gemv_hopper: {"TILES": w4_gemv_hopper.TILES, "choose_tiles": w4_gemv_hopper.choose_tiles,
                             "stream_takes": w4_gemv_hopper.stream_takes},
            w4_gemv_stream: {"choose_shape": w4_gemv_stream.choose_shape, "START": w4_gemv_stream.START}}


def stream_only(*forms, shape=None, start=0):
    """The stream GEMV for these forms ("add": o_proj, "normed": qkv_proj and gate_up_proj, "gated": down_proj,
    "plain": a bf16 y, where norms are not folded, and an INT4 head) only, the split-K kernel for the others;
    ``shape``: (programs an SM, slots) for all; ``start``: its START."""
    stream = {"START": start} | ({"choose_shape": lambda k, n, sms: shape} if shape else {})
    return {w4_gemv_hopper: {"stream_takes": lambda k, n, form: form in forms}, w4_gemv_stream: stream}


LLAMA2_7B_PROJECTIONS = {(4096, 12288): "qkv", (4096, 4096): "o", (4096, 22016): "gate_up", (11008, 4096): "down"}


def tiles_by_projection(**tiles):
    """A W4A16 GEMV's tiles a program by the llama2-7b projection its K x N is (``tiles``: qkv, o, gate_up, down),
    the shipped choice for the others."""
    shipped = w4_gemv_hopper.choose_tiles
    return {"choose_tiles": lambda k, n, sms: tiles.get(LLAMA2_7B_PROJECTIONS.get((k, n)), shipped(k, n, sms))}


def splits(count, block_n=None, warps=None, stages=None):
    """The decode attention's splits a sequence pinned to ``count`` (``choose_num_splits`` gives 9 at batch 1: two
    waves of its 32 KV heads' programs, for the graph's 4096-token table), and its kernel's tiles of ``block_n``
    tokens, warps and stages where given (64, 4, 3 by default)."""
    launch = {key: value for key, value in (("block_n", block_n), ("num_warps", warps), ("num_stages", stages))
              if value is not None}
    return {"choose_num_splits": lambda *args, **kwargs: count, "GPU_LAUNCH": launch}


# The decode attention at the latency workload's context (255 tokens in the graph): one program a KV head with its
# whole context in one or two tiles (no merge), two programs of a 128-token tile, or 9 splits of 32-token tiles.
ATTENTION_SHAPES = {"one_split_256": (1, 256, 8, 1), "one_split_128": (1, 128, 8, 2), "two_splits_128": (2, 128, 4, 1),
                    "splits9_32": (9, 32, 4, 1), "splits9_32_s3": (9, 32, 4, 3), "splits9_32_w2": (9, 32, 2, 1),
                    "splits9_16": (9, 16, 4, 1), "splits16_16": (16, 16, 2, 1), "splits9_64_s1": (9, 64, 4, 1)}


ALL = {"int4_folded": ("rtn-int4", {}), "int4_head": ("rtn-int4-head", {}), "int4_norm_kernels": ("rtn-int4", {norm_folding: {"ENABLED": False}}),
       "int4_gate_up_norm": ("rtn-int4", {norm_folding: {"DEFER_MLP_NORM": False}}),
       "int4_qkv_norm": ("rtn-int4", {norm_folding: {"DEFER_ATTENTION_NORM": False}}),
       "int4_no_deferred_norm": ("rtn-int4", {norm_folding: {"DEFER_MLP_NORM": False, "DEFER_ATTENTION_NORM": False}}),
       "int4_last_split": ("rtn-int4", {paged_attention: {"DEFAULT_MERGE": "last_split"}}),
       **{f"int4_tiles{t}": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(qkv=t, o=t, gate_up=t, down=t)})
          for t in (1, 2, 4, 8)},  # (every projection at t tiles a program)
       "int4_tiles_4_down_2": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(o=4, down=2)}),
       "int4_tiles_2_down_4": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(qkv=2, o=2, gate_up=2, down=4)}),
       "int4_o_4": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(o=4)}),
       "int4_o_2": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(o=2)}),
       "int4_qkv_2": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(qkv=2)}),
       "int4_o_2_gate_up_2": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(o=2, gate_up=2)}),
       **{f"int4_{name}_{t}": ("rtn-int4", {w4_gemv_hopper: tiles_by_projection(**{name: t})})
          for name in ("gate_up", "down") for t in (2, 8)},
       **{f"int4_splits{s}": ("rtn-int4", {paged_attention: splits(s)}) for s in (1, 2, 4)},
       **{f"int4_{name}": ("rtn-int4", {paged_attention: splits(*shape)}) for name, shape in ATTENTION_SHAPES.items()},
       "int4_head8": ("rtn-int4-head8", {}),
       **{f"int4_pool{blocks}": ("rtn-int4", {}, {"num_kv_blocks": blocks}) for blocks in (3000, 10000)},
       "int4_no_rope_table": ("rtn-int4", {llama: {"ROPE_TABLE": False}}),
       "int4_first_norm_kernel": ("rtn-int4", {norm_folding: {"FOLD_FIRST_NORM": False}}),
       "int4_session26": ("rtn-int4", {llama: {"ROPE_TABLE": False}, norm_folding: {"FOLD_FIRST_NORM": False}}),
       "int4_stream": ("rtn-int4", stream_only("add", "normed", "gated")),
       "int4_stream_o": ("rtn-int4", stream_only("add")),
       "int4_stream_normed": ("rtn-int4", stream_only("normed")), "int4_stream_down": ("rtn-int4", stream_only("gated")),
       "int4_stream_2x3": ("rtn-int4", stream_only("add", "normed", "gated", shape=(2, 3))),
       "int4_stream_late": ("rtn-int4", stream_only("add", "normed", "gated", start=2)),
       "int4_stream_deep": ("rtn-int4", stream_only("add", "normed", "gated", shape=(1, 12))),
       "int4_head_stream_plain": ("rtn-int4-head", stream_only("plain")),  # (the INT4 head's GEMV: the plain form)
       "int4_norm_kernels_stream_plain": ("rtn-int4", {norm_folding: {"ENABLED": False}} | stream_only("plain")),
       "bf16": (None, {}), "bf16_splits1": (None, {paged_attention: splits(1)}),
       "bf16_no_rope_table": (None, {llama: {"ROPE_TABLE": False}}),
       "bf16_last_split": (None, {paged_attention: {"DEFAULT_MERGE": "last_split"}}),
       **{f"bf16_{name}": (None, {paged_attention: splits(*shape)}) for name, shape in ATTENTION_SHAPES.items()}}
ENGINES = {name: ALL[name] for name in os.environ.get("VARIANTS", ",".join(ALL)).split(",")}


def build(quantization, settings, pool=dict(num_kv_blocks=300)):
    """``pool``: the KV cache's size ({}: bench_latency's, most of the GPU's memory)."""
    for module, defaults in DEFAULTS.items():
        for key, value in {**defaults, **settings.get(module, {})}.items():
            setattr(module, key, value)
    llm = LLM("llama2-7b", load_format="dummy", quantization=quantization, batching="continuous", max_num_seqs=1,
              seed=0, **pool)  # bench_latency's graph (max_model_len 2048, the default), a small cache by default
    done = llm.generate([list(range(100, 228))], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
                        use_tqdm=False)  # the graph's buffers now hold a real step: 255 tokens of context (latency's)
    return llm, llm.engine.runner.graphs.graphs[1], list(done[0].outputs[0].token_ids)


def replay_ms(graph, replays):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def timeline(graph):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "Memcpy" not in e.name and "Memset" not in e.name), key=lambda e: e.time_range.start)
    per_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    per_position = collections.defaultdict(lambda: [0.0, 0.0])  # a kernel's place in the step: (duration, increment)
    steps = len(kernels) // PROFILED
    previous_end = None
    for i, e in enumerate(kernels):
        row = per_name[e.name[:60]]
        increment = 0.0 if previous_end is None else max(0.0, e.time_range.end - previous_end)
        row[0] += 1
        row[1] += e.time_range.end - e.time_range.start
        row[2] += increment
        previous_end = max(previous_end or 0, e.time_range.end)
        if steps and i // steps < PROFILED:
            place = per_position[(i % steps, e.name[:40])]
            place[0] += (e.time_range.end - e.time_range.start) / PROFILED
            place[1] += increment / PROFILED
    rows = {name: {"per_step": n / PROFILED, "mean_us": dur / n, "increment_us_per_step": inc / PROFILED}
            for name, (n, dur, inc) in per_name.items()}
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1]["increment_us_per_step"]))
    # Every kernel of a step in launch order (duration and increment, us, averaged over the replays): where within
    # a layer the time goes, e.g. which of its four GEMVs (the replay's first kernel's increment includes the gap).
    return rows, [[name, round(dur, 2), round(inc, 2)] for (_, name), (dur, inc) in sorted(per_position.items())]


def main():
    engines = {name: build(*args) for name, args in ENGINES.items()}
    for module, defaults in DEFAULTS.items():
        for key, value in defaults.items():
            setattr(module, key, value)
    times = {name: [] for name in engines}
    for r in range(ROUNDS):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            times[name].append(replay_ms(engines[name][1], REPLAYS))
    mean = {name: sum(t) / len(t) for name, t in times.items()}
    for name in engines:
        print(f"{name}: {mean[name]:.4f} ms a token ({min(times[name]):.4f}-{max(times[name]):.4f})", flush=True)
    runs = {name: {"ms_per_token_rounds": times[name], "ms_per_token": mean[name]} for name in engines}
    for name, (_, _, tokens) in engines.items():  # the first engine's greedy tokens? (expected where only the launch
        # order changes; another split-K or split order rounds differently and may change them on dummy weights)
        same_quant = next(other for other in engines if ENGINES[other][0] == ENGINES[name][0])
        runs[name]["tokens_as_" + same_quant] = tokens == engines[same_quant][2]
    for name in engines:  # speed-ups: ms a token of the bf16 engine (or the shipped INT4 one) over this one's
        if name.startswith("int4") and "bf16" in mean:
            runs[f"{name}_over_bf16"] = mean["bf16"] / mean[name]
        if name.startswith("int4_") and name != "int4_folded" and "int4_folded" in mean:
            runs[f"{name}_over_int4_folded"] = mean["int4_folded"] / mean[name]
    if "bf16_last_split" in mean and "bf16" in mean:
        runs["bf16_last_split_over_bf16"] = mean["bf16"] / mean["bf16_last_split"]
    print({k: round(v, 4) for k, v in runs.items() if k.count("_over_")}, flush=True)
    for name in engines:
        try:
            runs[name]["timeline"], runs[name]["step_in_order"] = timeline(engines[name][1])
            for kernel, row in list(runs[name]["timeline"].items())[:6]:
                print(name, f"{row['increment_us_per_step']:8.1f} us/step {row['per_step']:5.0f}x "
                      f"{row['mean_us']:6.2f} us", kernel, flush=True)
        except Exception as error:  # the replay times stand without it
            runs[name]["timeline_error"] = repr(error)[:300]
            print(name, "timeline failed:", repr(error)[:300], flush=True)
    for llm, _, _ in engines.values():
        llm.close()
    gc.collect()
    save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "decode_graph_timeline"),
                "latency, llama2-7b, batch 1",
                f"GPU ms a token: the batch-1 decode graph replayed {REPLAYS} times back to back, {ROUNDS} interleaved "
                f"rounds (ABC CBA ...); timeline from {PROFILED} profiled replays", runs)


if __name__ == "__main__":  # (head8_engines.py imports build and replay_ms)
    main()
