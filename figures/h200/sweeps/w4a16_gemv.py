"""The W4A16 GEMV (M=1, bf16, group 128) on the H200: the fp32 body's best configs and the autotuner's choice against
the HFMA2 variant (kernels/w4_gemv_pairs.py) over a sampled grid, and bf16 torch.matmul, on Llama-2-7B's shapes.
Each shape gets BUDGET_S / 4 seconds (compiles included), hand-picked configs first; FAMILIES=fp32,hfma2,tiles (the
default: all) picks the bodies, TILES being the HFMA2 math on 2-d tiles, the next loaded ahead. Writes $OUT/w4_gemv_sweep.json
(committed wrapped as figures/h200/sweeps/w4a16_gemv.json). Without CUDA: a tiny shape under the interpreter, to
check the script runs (TRITON_INTERPRET=1). Usage: BUDGET_S=480 OUT=/tmp/out python figures/h200/sweeps/w4a16_gemv.py;
SHAPES=4096x11008,11008x4096 limits the shapes (K x N); SAMPLES (default 40): HFMA2 configs drawn from the grid."""
import itertools, json, os, random, time
import torch
from minillm.bench.kernels import time_ms
from minillm.kernels.gemv import gemv
from minillm.kernels.quant_matmul import autotuned_config, pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True); G = 128
GPU = torch.cuda.is_available(); dev = torch.device("cuda" if GPU else "cpu"); dtype = torch.bfloat16
L2 = torch.cuda.get_device_properties(dev).L2_cache_size if GPU else 0
SHAPES = [(4096, 11008), (11008, 4096), (4096, 12288), (4096, 4096)] if GPU else [(256, 64)]  # (K, N)
if GPU and os.environ.get("SHAPES"):
    SHAPES = [tuple(int(d) for d in shape.split("x")) for shape in os.environ["SHAPES"].split(",")]
# The fp32 body: the best four of the last H200 sweep (figures/h200/sweeps/w4a16_gemv.json at fdfd4b9).
FP32 = [dict(BLOCK_N=64, BLOCK_KP=16, SPLIT_K=8, PREFETCH=True, num_warps=2, num_stages=3),
        dict(BLOCK_N=256, BLOCK_KP=4, SPLIT_K=32, num_warps=2, num_stages=3),
        dict(BLOCK_N=64, BLOCK_KP=16, SPLIT_K=16, num_warps=2, num_stages=2),
        dict(BLOCK_N=128, BLOCK_KP=8, SPLIT_K=16, num_warps=1, num_stages=3)]
# HFMA2: 4 to 16 columns a thread (BLOCK_N / (32 num_warps)); RUN packed rows summed in 16 bits.
PICKED = [dict(BLOCK_N=bn, BLOCK_KP=kp, SPLIT_K=sk, RUN=run, num_warps=w) for bn, kp, sk, run, w in [
    (256, 16, 8, 2, 1), (256, 8, 16, 2, 1), (512, 8, 16, 2, 2), (256, 16, 8, 4, 1), (256, 16, 8, 1, 1),
    (128, 16, 8, 2, 1)]]
grid = [dict(BLOCK_N=bn, BLOCK_KP=kp, SPLIT_K=sk, RUN=run, num_warps=w)
        for bn, kp, sk, run, w in itertools.product((128, 256, 512), (4, 8, 16), (4, 8, 16, 32, 64), (1, 2, 4),
                                                    (1, 2, 4))
        if 4 <= bn // (32 * w) <= 16 and run <= kp]
samples = int(os.environ.get("SAMPLES", "40"))
random.seed(0); HFMA2 = PICKED + [c for c in random.sample(grid, min(samples, len(grid))) if c not in PICKED]
HFMA2 = [dict(c, HFMA2=True, num_stages=1) for c in HFMA2]
# TILES: the HFMA2 math on 2-d tiles, the next tile loaded ahead (gemv_pairs_tiles). BLOCK_N =
# 128 num_warps puts every warp along N (4 columns a thread), the layout the per-column scales load in.
TILES = [dict(BLOCK_N=bn, BLOCK_KP=kp, SPLIT_K=sk, num_warps=w, HFMA2=True, RUN=1, TILES=True, num_stages=1)
         for (bn, kp, w), sk in itertools.product([(128, 8, 1), (256, 8, 2), (512, 8, 4), (128, 16, 1), (64, 8, 1),
                                                   (512, 16, 4), (1024, 8, 8)], (8, 12, 16, 24, 32))]
FAMILIES = os.environ.get("FAMILIES", "fp32,hfma2,tiles").split(",")
if not set(FAMILIES) <= {"fp32", "hfma2", "tiles"}:
    raise SystemExit(f"FAMILIES={','.join(FAMILIES)}: each must be one of fp32, hfma2, tiles")
if not GPU:
    FP32 = [dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=2)]
    HFMA2 = [dict(FP32[0], HFMA2=True, RUN=2)]
    TILES = [dict(FP32[0], HFMA2=True, RUN=1, TILES=True)]
gen = torch.Generator(device=dev).manual_seed(0)
rows, budget = [], float(os.environ.get("BUDGET_S", "480")) / len(SHAPES)
for k, n in SHAPES:
    deadline, groups = time.time() + budget, k // G
    copies = max(2, -(-2 * L2 // (k * n // 2)))  # rotate weight copies over twice the L2, so each call reads HBM
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(groups, n, device=dev, generator=gen).to(dtype) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen))) for _ in range(copies)]
    dense = [torch.randn(k, n, device=dev, generator=gen).to(dtype) for _ in range(max(2, -(-2 * L2 // (2 * k * n))))]
    x = torch.randn(1, k, device=dev, generator=gen).to(dtype)
    ref = w4a16_matmul_ref(x, *sets[0], G).float()
    cyc = itertools.cycle(dense); torch_ms = time_ms(lambda: torch.matmul(x, next(cyc)), dev)
    # The same bytes as the INT4 weight, read by a bf16 GEMV (N / 4 rows): how fast this GPU reads that much in one
    # GEMV, minillm's (kernels/gemv.py) and cuBLAS's: the floor a W4A16 kernel of this size can hope for.
    same = [torch.randn(n // 4, k, device=dev, generator=gen).to(dtype) for _ in range(copies)]
    cyc = itertools.cycle(same); same_gemv_ms = time_ms(lambda: gemv(x, next(cyc)), dev)
    cyc = itertools.cycle(same); same_cublas_ms = time_ms(lambda: torch.nn.functional.linear(x, next(cyc)), dev)
    del same

    def measure(config):
        cyc = itertools.cycle(sets)
        t = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="gemv", config=config), dev, iters=10, repeats=3)
        y = w4a16_matmul(x, *sets[0], G, path="gemv", config=config).float()
        return t, ((y - ref).abs().max() / ref.abs().max()).item()
    tuned_ms, tuned_err = measure(None) if GPU else (float("nan"), None)
    results = {name: [] for name in FAMILIES}
    for name, configs in [(name, {"fp32": FP32, "hfma2": HFMA2, "tiles": TILES}[name]) for name in FAMILIES]:
        for c in configs:
            if time.time() > deadline and results[name]:
                break
            try:
                results[name].append((*measure(c), c))
            except Exception as e:  # a config that does not compile or fit is recorded, not fatal
                results[name].append((float("inf"), None, {**c, "error": str(e)[:160]}))
        results[name].sort(key=lambda r: r[0])
    weight_bytes = k * n // 2 + groups * n * 2 + groups * n // 2
    best = {name: r[0] for name, r in results.items() if r}
    rows.append(dict(k=k, n=n, torch_ms=torch_ms, same_bytes_bf16=dict(shape=[n // 4, k], gemv_ms=same_gemv_ms,
                                                                     cublas_ms=same_cublas_ms), autotuned=dict(ms=tuned_ms, err=tuned_err,
                                                                 config=autotuned_config("w4", "gemv")),
                     weight_bytes=weight_bytes, measured={name: len(r) for name, r in results.items()},
                     **{f"{name}_top": r[:8] for name, r in results.items()}))
    print(f"K={k} N={n}: torch {torch_ms * 1e3:.1f}us, same bytes in bf16: gemv {same_gemv_ms * 1e3:.1f}us cuBLAS "
          f"{same_cublas_ms * 1e3:.1f}us; autotuned {tuned_ms * 1e3:.1f}us; " + "; ".join(
        f"best {name} {b[0] * 1e3:.1f}us = {torch_ms / b[0]:.2f}x torch, {weight_bytes / b[0] / 1e9:.2f} TB/s, "
        f"err {b[1]}, {b[2]}" for name, b in best.items()), flush=True)
    json.dump(rows, open(f"{OUT}/w4_gemv_sweep.json", "w"), indent=1)
    del sets, dense
    if GPU:
        torch.cuda.empty_cache()
