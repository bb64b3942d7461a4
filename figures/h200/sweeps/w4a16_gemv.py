"""The W4A16 GEMV (M=1) on the H200 over a sampled config grid (deep split-K and PREFETCH included), against
bf16 torch.matmul. Writes $OUT/w4_gemv_sweep.json (committed wrapped as figures/h200/sweeps/w4a16_gemv.json)."""
import itertools, json, os, random, time
import torch
from minillm.bench.kernels import time_ms
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device("cuda"); dtype = torch.bfloat16; G = 128
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
grid = [dict(BLOCK_N=bn, BLOCK_KP=kp, SPLIT_K=sk, PREFETCH=pf, num_warps=w, num_stages=st)
        for bn, kp, sk, pf, w, st in itertools.product((64, 128, 256), (4, 8, 16, 32), (4, 8, 16, 32, 64), (False, True),
                                                       (1, 2, 4, 8), (1, 2, 3))
        if 32 * w <= bn * kp // 4]  # at least 4 packed words per thread
random.seed(0); grid = random.sample(grid, min(90, len(grid)))
gen = torch.Generator(device=dev).manual_seed(0)
rows, deadline = [], time.time() + float(os.environ.get("BUDGET_S", "400"))
for k, n in [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]:
    groups = k // G
    copies = max(2, -(-2 * L2 // (k * n // 2)))
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(groups, n, dtype=dtype, device=dev, generator=gen) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen))) for _ in range(copies)]
    dense = [torch.randn(k, n, dtype=dtype, device=dev, generator=gen) for _ in range(max(2, -(-2 * L2 // (2 * k * n))))]
    x = torch.randn(1, k, dtype=dtype, device=dev, generator=gen)
    ref = w4a16_matmul_ref(x, *sets[0], G).float()
    cyc = itertools.cycle(dense); torch_ms = time_ms(lambda: torch.matmul(x, next(cyc)), dev)
    times = []
    for c in grid:
        if time.time() > deadline: break
        try:
            cyc = itertools.cycle(sets)
            t = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="gemv", config=c), dev, iters=10, repeats=3)
            err = (w4a16_matmul(x, *sets[0], G, path="gemv", config=c).float() - ref).abs().max().item() / ref.abs().max().item()
            times.append((t, c, err))
        except Exception as e:
            times.append((float("inf"), {**c, "error": str(e)[:120]}, None))
    times.sort(key=lambda r: r[0])
    rows.append(dict(k=k, n=n, torch_ms=torch_ms, top=times[:8]))
    b = times[0] if times else (float("nan"), {}, None)
    print(f"K={k} N={n}: torch {torch_ms*1e3:.1f}us best gemv {b[0]*1e3:.1f}us = {torch_ms/b[0]:.2f}x {b[1]} err {b[2]}", flush=True)
    json.dump(rows, open(f"{OUT}/w4_gemv_sweep.json", "w"), indent=1)
    del sets, dense; torch.cuda.empty_cache()
