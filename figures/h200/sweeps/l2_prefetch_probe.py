"""Probe of ``kernels/l2_prefetch.py``: does a GEMV whose weights were asked into L2 a few microseconds earlier run
faster? For each shape, a pool of weight copies larger than L2 is cycled (each call finds its weights cold). A CUDA
graph holds 20 calls, each: [prefetch_l2 of this call's weights, or nothing] -> a GPU sleep of S us (the gap a
prefetch would fill, standing in for attention) -> the GEMV. Per call: (graph time - the same graph's sleeps alone) / 20,
best of 5 replays; "side" prefetches from a second stream forked before the sleep (as ``weight_prefetch.py``).
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/l2_prefetch_probe.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.kernels import gemv  # noqa: E402
from minillm.kernels.l2_prefetch import prefetch_l2  # noqa: E402
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul  # noqa: E402

dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda._sleep(1000); torch.cuda.synchronize()
start.record(); torch.cuda._sleep(1_000_000); end.record(); torch.cuda.synchronize()
cycles_per_us = 1_000_000 / (start.elapsed_time(end) * 1e3)
CALLS = 20
side = torch.cuda.Stream()


def int4_set(k, n):
    return (pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
            torch.rand(k // 128, n, dtype=torch.bfloat16, device=dev, generator=gen) * 0.01,
            pack_int4_along_n(torch.randint(0, 16, (k // 128, n), device=dev, generator=gen)))


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
    del g
    return best / CALLS


def step(call, tensors_of, pool, mode, sleep_us, gemv_on=True):
    def body(i):
        w = pool[i % len(pool)]
        main = torch.cuda.current_stream()
        how = int(mode[-1]) if mode[-1].isdigit() else 0
        if mode.startswith("same"):
            for t in tensors_of(w):
                prefetch_l2(t, mode=how)
        elif mode.startswith("side"):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for t in tensors_of(w):
                    prefetch_l2(t, mode=how)
        torch.cuda._sleep(int(sleep_us * cycles_per_us))
        if gemv_on:
            call(w)
        if mode.startswith("side"):
            main.wait_stream(side)
    return body


runs = {"cycles_per_us": cycles_per_us, "rows": []}
x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev, generator=gen)
x11 = torch.randn(1, 11008, dtype=torch.bfloat16, device=dev, generator=gen)
cases = []
for k, n in ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288), (4096, 22016)):
    xx = x if k == 4096 else x11
    pool = [int4_set(k, n) for _ in range(max(2, int(200e6 // (k * n // 2)) + 1))]
    cases.append((f"int4 {k}x{n}", lambda w, xx=xx: w4a16_matmul(xx, *w, 128), lambda w: w, pool))
for k, n in ((4096, 4096), (4096, 11008)):
    pool = [torch.randn(n, k, dtype=torch.bfloat16, device=dev, generator=gen) for _ in range(max(2, int(200e6 // (k * n * 2)) + 1))]
    cases.append((f"bf16 {k}x{n}", lambda w: gemv.gemv(x, w), lambda w: (w,), pool))
for name, call, tensors_of, pool in cases:
    row = {"case": name, "bytes": sum(t.nbytes for t in tensors_of(pool[0]))}
    for sleep_us in (10,):
        sleeps = graph_us(step(call, tensors_of, pool, "none", sleep_us, gemv_on=False))
        row[f"sleep{sleep_us}_alone_us"] = sleeps
        for mode in ("none", "same", "side", "same1", "side1", "same2", "side2"):
            row[f"sleep{sleep_us}_{mode}_gemv_us"] = graph_us(step(call, tensors_of, pool, mode, sleep_us)) - sleeps
    print(row, flush=True)
    runs["rows"].append(row)
save_result(os.environ.get("OUT", "/tmp/out"), "l2_prefetch_probe", "one GEMV after a GPU sleep, weights cold or prefetched",
            "per call: graph of 20 (prefetch?, sleep, GEMV) minus the graph of the sleeps alone, best of 5 replays; "
            "weights cycled through a pool > L2", runs)
