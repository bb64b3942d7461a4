"""Batch-1 decode attention at the short contexts of the ``latency`` workload (128-384 tokens, and 1024): how long the
split kernel and its merge take, by split count, tile length and warps, where the table is as wide as a CUDA graph's
(llama2-7b: max_model_len 4096, so ``choose_num_splits`` picks 9 splits whatever the context).
Llama-2-7B's attention (32 heads, MHA, head_dim 128), block size 16, bf16. Each timed call cycles through 32 layers'
K/V pools (cold, as in a decode step), 20 calls a CUDA graph, best of 5 replays.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_batch1_short.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import paged_copy  # noqa: E402
from minillm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from minillm.kernels.split_merge import PagedAttentionWorkspace  # noqa: E402

dev = torch.device("cuda")
H, D, BS, WIDTH, LAYERS, CALLS = 32, 128, 16, 4096 // 16, 32, 20
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def graph_us(body):
    body(0); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            body(i)
    best = float("inf")
    for _ in range(5):
        start.record(); g.replay(); end.record(); torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3)
    return best / CALLS


runs = {"rows": []}
gen = torch.Generator(device=dev).manual_seed(0)
for ctx in (128, 256, 384, 1024):
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    layers = []
    for _ in range(LAYERS):
        k = torch.randn(1, ctx, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, ctx, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
        k_pool, tables = paged_copy(k, BS, torch.Generator().manual_seed(0))
        v_pool = torch.empty_like(k_pool)
        v_pool[tables.view(-1).long()] = v.reshape(-1, BS, H, D)
        wide = torch.zeros(1, WIDTH, dtype=torch.int32, device=dev)
        wide[:, :tables.shape[1]] = tables
        layers.append((k_pool, v_pool, wide))
    lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    ws = PagedAttentionWorkspace.allocate(1, H, D, 16, dev)
    want = paged_decode_attention_ref(q, *layers[0][:2], layers[0][2], lens).float()
    for splits in (None, 1, 2, 3, 4, 6):
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, workspace=ws, out=out)
                try:
                    us = graph_us(lambda i: paged_decode_attention(q, *layers[i % LAYERS][:2], layers[i % LAYERS][2],
                                                                   lens, **kw))
                    out.fill_(float("nan"))
                    paged_decode_attention(q, *layers[0][:2], layers[0][2], lens, **kw)
                    err = (out.float() - want).abs().max().item()
                except Exception as e:  # noqa: BLE001 (a launch that cannot run is recorded)
                    us, err = float("inf"), str(e)[:120]
                runs["rows"].append(dict(context=ctx, splits=splits or "default (9)", block_n=block_n, warps=warps,
                                         us=us, err=err))
    best = min((r for r in runs["rows"] if r["context"] == ctx), key=lambda r: r["us"])
    default = next(r for r in runs["rows"] if r["context"] == ctx and r["splits"] == "default (9)"
                   and r["block_n"] == 64 and r["warps"] == 4)
    print(ctx, "default", default, "best", best, flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "decode_batch1_short", "paged decode attention, batch 1, short contexts",
            "us per call (the split kernel, and the merge kernel where there is more than one split), 20 calls a "
            "graph, 32 layers' pools cycled", runs)
