"""The batch-1 decode attention alone (llama2-7b's 32 heads of 128, bf16 pools, the merge kernel behind it) in tiles
of BLOCK_N tokens with its warps and stages, at the latency workload's contexts and longer: GPU time a call from
``bench.kernels.time_ms`` (20 calls in one CUDA graph, best of 5), against the shipped (64, 4, 3), at the 9 splits
``choose_num_splits`` gives the decode graph's 4096-token table. decode_graph_timeline.py measures the tiles inside
the decode step; this says what they cost where the context is long.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_attention_tiles.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import decode_problem, save_result  # noqa: E402

from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.kernels.paged_attention import paged_decode_attention  # noqa: E402

LAUNCHES = [(64, 4, 3), (32, 4, 1), (32, 4, 3), (32, 2, 1), (16, 4, 1), (16, 2, 1), (64, 4, 1)]
CONTEXTS = [256, 1024, 4096]
SPLITS = 9

runs = {}
for context in CONTEXTS:
    q, k_pool, v_pool, tables, lens = decode_problem(1, context, 32, 32, 128, 16, torch.device("cuda"), torch.bfloat16)
    table = torch.zeros(1, 4096 // 16, dtype=torch.int32, device="cuda")  # the graph's width; padding never read
    table[:, :tables.shape[1]] = tables
    out = torch.empty_like(q)
    want = paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=SPLITS).float()
    row = {}
    for block_n, warps, stages in LAUNCHES:
        def call():
            paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=SPLITS, out=out, block_n=block_n,
                                   num_warps=warps, num_stages=stages)
        us = 1e3 * time_ms(call, q.device)
        out.fill_(float("nan"))
        call()
        row[f"{block_n}_{warps}_{stages}"] = {"us": us, "max_error": (out.float() - want).abs().max().item()}
        print(context, block_n, warps, stages, f"{us:.2f} us", flush=True)
    base = row["64_4_3"]["us"]
    for launch in row.values():
        launch["speedup_over_64_4_3"] = base / launch["us"]
    runs[f"context_{context}"] = row
save_result(os.environ.get("OUT", "/tmp/out"), "decode_attention_tiles", "decode attention, batch 1, 32 heads of 128",
            "GPU us a call (time_ms: 20 calls in a CUDA graph, best of 5), 9 splits and the merge kernel; keys "
            "block_n_warps_stages", runs)
