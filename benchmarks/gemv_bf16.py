"""The dense bf16 GEMV (kernels/gemv.py) against cuBLAS (F.linear) at M = 1 on Llama-2-7B's projections, whole
(one GPU) and halved (TP=2's shards), L2-cold: each call reads another copy of the weight. A sampled grid of
configs per shape, within BUDGET_S seconds in all. Writes $OUT/gemv_bf16.json. Without CUDA: a tiny shape under
the interpreter (TRITON_INTERPRET=1), to check the script runs. Usage: BUDGET_S=300 OUT=/tmp/out python
benchmarks/gemv_bf16.py"""
import itertools, json, os, random, time
import torch
import torch.nn.functional as F
from minillm.bench.kernels import time_ms
from minillm.kernels.gemv import gemv, gemv_ref

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
GPU = torch.cuda.is_available(); dev = torch.device("cuda" if GPU else "cpu"); dtype = torch.bfloat16 if GPU else torch.float32
L2 = torch.cuda.get_device_properties(dev).L2_cache_size if GPU else 0
# (name, N, K): one GPU, then TP=2's column shards (qkv, gate_up halve N) and row shards (o, down halve K).
SHAPES = [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008),
          ("tp2 qkv", 6144, 4096), ("tp2 o", 4096, 2048), ("tp2 gate_up", 11008, 4096), ("tp2 down", 4096, 5504),
          ("lm_head", 32000, 4096), ("tp2 lm_head", 16000, 4096)] if GPU else [("tiny", 48, 96)]
grid = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=s)
        for bn, bk, sk, w, s in itertools.product((4, 8, 16, 32, 64), (64, 128, 256, 512, 1024), (1, 2, 4, 8),
                                                  (1, 2, 4, 8), (1, 2, 3, 4))
        if 2048 <= bn * bk <= 16384 and 16 <= bn * bk // (32 * w) <= 128]
random.seed(0)
PICKED = [dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3),
          dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=3),
          dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)]
SAMPLED = PICKED + random.sample(grid, min(int(os.environ.get("SAMPLES", "70")), len(grid)))
if not GPU:
    SAMPLED = [dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)]
budget = float(os.environ.get("BUDGET_S", "300")) / len(SHAPES)
gen = torch.Generator(device=dev).manual_seed(0)
rows = []
for name, n, k in SHAPES:
    deadline = time.time() + budget
    ws = [torch.randn(n, k, device=dev, generator=gen).to(dtype) for _ in range(max(2, -(-3 * L2 // (2 * n * k))))]
    x = torch.randn(1, k, device=dev, generator=gen).to(dtype)
    ref = gemv_ref(x, ws[0]).float()
    cyc = itertools.cycle(ws); torch_ms = time_ms(lambda: F.linear(x, next(cyc)), dev)
    results = []
    for c in SAMPLED:
        programs = -(-n // c["BLOCK_N"]) * c["SPLIT_K"]
        if GPU and not 132 <= programs <= 8192:
            continue
        if time.time() > deadline and results:
            break
        try:
            y = gemv(x, ws[0], config=c).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            cyc = itertools.cycle(ws)
            results.append((time_ms(lambda: gemv(x, next(cyc), config=c), dev, iters=12, repeats=3), err, c))
        except Exception as e:  # a config that does not compile or fit is recorded, not fatal
            results.append((float("inf"), None, {**c, "error": str(e)[:160]}))
    results.sort(key=lambda r: r[0])
    best = results[0]
    tb = lambda ms: 2 * n * k / ms / 1e9  # noqa: E731
    rows.append(dict(name=name, n=n, k=k, torch_ms=torch_ms, torch_tbs=tb(torch_ms), best_ms=best[0],
                     best_tbs=tb(best[0]), torch_over_best=torch_ms / best[0], measured=len(results), top=results[:6]))
    print(f"{name} N={n} K={k}: torch {torch_ms * 1e3:.1f}us {tb(torch_ms):.2f} TB/s; best {best[0] * 1e3:.1f}us "
          f"{tb(best[0]):.2f} TB/s ({torch_ms / best[0]:.2f}x) err {best[1]} {best[2]}", flush=True)
    json.dump(rows, open(f"{OUT}/gemv_bf16.json", "w"), indent=1)
    del ws
