"""The batch-1 decode attention alone (llama2-7b's 32 heads of 128, bf16 pools, the merge kernel behind it) in tiles
of BLOCK_N tokens with its warps and stages, at the latency workload's contexts and longer: GPU time a call from
``bench.kernels.time_ms`` (20 calls in one CUDA graph, best of 5), against the shipped (64, 4, 3), at the 9 splits
``choose_num_splits`` gives the decode graph's 4096-token table. decode_graph_timeline.py measures the tiles inside
the decode step; this says what they cost where the context is long.

Session 33 (the short-context tiles of commit 4cb8cd7, reverted): CONTEXTS=256,384,... and BATCHES=1,4,... choose the
problems (batch B at ``choose_num_splits``'s splits for the 4096-token table, 9 at B = 1), LAUNCHES=64_4_3,32_4_1 the
launches, NAME the JSON.

Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_attention_tiles.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import decode_problem, save_result  # noqa: E402

from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.kernels.checks import num_sms  # noqa: E402
from minillm.kernels.paged_attention import choose_num_splits, paged_decode_attention  # noqa: E402

LAUNCHES = [(64, 4, 3), (32, 4, 1), (32, 4, 3), (32, 2, 1), (16, 4, 1), (16, 2, 1), (64, 4, 1)]
if "LAUNCHES" in os.environ:
    LAUNCHES = [tuple(int(v) for v in launch.split("_")) for launch in os.environ["LAUNCHES"].split(",")]
CONTEXTS = [int(v) for v in os.environ.get("CONTEXTS", "256,1024,4096").split(",")]
BATCHES = [int(v) for v in os.environ.get("BATCHES", "1").split(",")]

runs = {}
for batch in BATCHES:
    splits = choose_num_splits(batch, 32, 4096, num_sms(torch.device("cuda")))
    for context in CONTEXTS:
        q, k_pool, v_pool, tables, lens = decode_problem(batch, context, 32, 32, 128, 16, torch.device("cuda"),
                                                         torch.bfloat16)
        table = torch.zeros(batch, 4096 // 16, dtype=torch.int32, device="cuda")  # the graph's width; padding unread
        table[:, :tables.shape[1]] = tables
        out = torch.empty_like(q)
        want = paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=splits).float()
        row = {"splits": splits}
        for block_n, warps, stages in LAUNCHES:
            def call():
                paged_decode_attention(q, k_pool, v_pool, table, lens, num_splits=splits, out=out, block_n=block_n,
                                       num_warps=warps, num_stages=stages)
            us = 1e3 * time_ms(call, q.device)
            out.fill_(float("nan"))
            call()
            row[f"{block_n}_{warps}_{stages}"] = {"us": us, "max_error": (out.float() - want).abs().max().item()}
            print(batch, context, block_n, warps, stages, f"{us:.2f} us", flush=True)
        base = row["64_4_3"]["us"]
        for launch in row.values():
            if isinstance(launch, dict):
                launch["speedup_over_64_4_3"] = base / launch["us"]
        runs[f"context_{context}" if BATCHES == [1] else f"batch_{batch}_context_{context}"] = row
name = os.environ.get("NAME", "decode_attention_tiles")
save_result(os.environ.get("OUT", "/tmp/out"), name, "decode attention, 32 heads of 128, bf16",
            "GPU us a call (time_ms: 20 calls in a CUDA graph, best of 5), choose_num_splits's splits for a 4096-token "
            "table and the merge kernel; keys block_n_warps_stages", runs)
