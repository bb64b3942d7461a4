"""What the paged-attention sweeps share (decode_launch.py, decode_int4.py, decode_layout.py, prefill_scales.py):
their problem (``decode_problem``), its pools in a cache format (``quantized_pools``), writing the
result (``save_result``) and their loop (``time_launches``), which tries each
(block_n, warps, stages) x split count in random order until the deadline, timed, then run once more
on a poisoned output and compared with the reference; a launch that fails (e.g. too much shared
memory) is recorded, not fatal. Returns the rows fastest first. The batch-1 latency A/B sweeps
(latency_gated_ab.py, latency_rope_in_decode.py, latency_what_if.py, latency_norm_in_gemv.py,
latency_multi_step.py) share ``latency_engines``, and the A/B ones after an uncounted first engine (latency_pool.py,
latency_greedy.py, latency_attention_tiles.py) ``compare_latency``."""
import itertools, json, os, random, time
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import paged_copy, time_ms
from minillm.kv.quant import quantize_kv


def decode_problem(B, S, H, Hkv, D, bs, dev, dtype):
    """Seeded q [B, H, D] and B sequences of S tokens of K/V in pools of shuffled blocks of bs tokens (``paged_copy``):
    (q, k_pool, v_pool, block tables, context lengths)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=gen)
    k_pool, tables = paged_copy(k, bs, torch.Generator().manual_seed(0))
    v_pool = torch.empty_like(k_pool)
    v_pool[tables.view(-1).long()] = v.reshape(-1, bs, Hkv, D)
    return q, k_pool, v_pool, tables, torch.full((B,), S, dtype=torch.int32, device=dev)


def quantized_pools(k_pool, v_pool, kv):
    """The pools in cache format ``kv`` ("auto": as they are): (k codes, v codes, the kernels' scale keywords)."""
    if kv == "auto":
        return k_pool, v_pool, {}
    (kq, ks), (vq, vs) = quantize_kv(k_pool, kv), quantize_kv(v_pool, kv)
    return kq, vq, dict(k_scale=ks, v_scale=vs)


def save_result(out_dir, name, workload, note, runs):
    """$OUT/<name>.json: the common header (``result_header``), ``note`` and ``runs``."""
    result = result_header(name, workload, "-", f"python figures/h200/sweeps/{name}.py")
    result["note"], result["runs"] = note, runs
    os.makedirs(out_dir, exist_ok=True)
    with open(f"{out_dir}/{name}.json", "w") as f:
        json.dump(result, f, indent=1)


def latency_engines(order, switch, quantization, engine_kwargs=lambda name: {}):
    """Batch-1 ``latency`` engines of llama2-7b (dummy weights), one per name of ``order``, built in that order in
    this process after ``switch(name)`` set up its variant (an ABBA order lets a drift of the GPU's speed weigh on
    the variants alike), with ``engine_kwargs(name)`` more: {name: [mean decode tok/s of each of its engines]}.
    ``quantization`` "bf16": none."""
    import gc
    from minillm.bench.harness import bench_latency
    tok_s = {name: [] for name in order}
    for name in order:
        switch(name)
        result = bench_latency(model="llama2-7b", load_format="dummy", scale="gpu", num_requests=None, peers=[],
                               batching="continuous", quantization=None if quantization == "bf16" else quantization,
                               **engine_kwargs(name))
        tok_s[name].append(result["runs"]["minillm"]["mean_decode_tok_s"])
        print(quantization, name, f"{tok_s[name][-1]:.1f} tok/s", flush=True)
        gc.collect(); torch.cuda.empty_cache()
    return tok_s


def compare_latency(quants, order, switch, engine_kwargs=lambda name: {}):
    """Two variants A and B (``order``: A, B, B, A) of the batch-1 ``latency`` engines per quantization (``quants``,
    bf16 last), after one uncounted engine (A, the first quantization): a process's first engine decodes faster than
    the ones after it (latency_pool.json), which would favour whichever variant came first. Returns the runs to save:
    each quantization's tok/s by variant, ``<quant>_<B>_over_<A>``, and ``<quant>_over_bf16_<variant>``."""
    names, runs, mean = list(dict.fromkeys(order)), {}, {}
    latency_engines(names[:1], switch, quants[0], engine_kwargs)
    for quant in quants:
        tok_s = latency_engines(order, switch, quant, engine_kwargs)
        runs[quant] = {"order": order, **tok_s}
        for name in names:
            mean[quant, name] = sum(tok_s[name]) / len(tok_s[name])
        runs[f"{quant}_{names[1]}_over_{names[0]}"] = mean[quant, names[1]] / mean[quant, names[0]]
        print(quant, {name: round(mean[quant, name], 1) for name in names}, flush=True)
    for quant in quants[:-1]:
        for name in names:
            runs[f"{quant}_over_bf16_{name}"] = mean[quant, name] / mean["bf16", name]
            print(name, f"{quant} / bf16:", round(runs[f"{quant}_over_bf16_{name}"], 4), flush=True)
    return runs


def time_launches(run, ref, out, kv_bytes, launches, splits, deadline, bandwidth=None):
    """``run(num_splits=, block_n=, num_warps=, num_stages=)`` writes ``out``; ``ref`` is its fp32 answer."""
    rows = []
    for (bn, w, st), ns in itertools.product(random.sample(launches, len(launches)), splits):
        if time.time() > deadline:
            break
        launch = dict(splits=ns, block_n=bn, num_warps=w, num_stages=st)
        call = lambda: run(num_splits=ns, block_n=bn, num_warps=w, num_stages=st)
        try:
            ms = time_ms(call, out.device, iters=10, repeats=3)
            out.fill_(float("nan")); call(); err = (out.float() - ref).abs().max().item()
            row = dict(ms=ms, gbs=kv_bytes / ms / 1e6, **launch, err=err)
            if bandwidth:
                row["fraction_of_bandwidth"] = row["gbs"] / bandwidth
            rows.append(row)
        except Exception as e:
            rows.append(dict(ms=float("inf"), **launch, error=str(e)[:150]))
    return sorted(rows, key=lambda r: r["ms"])
