"""The W4A16 dot at decode batches (M = 16..64, where the tuning path's AWQ step runs at
batch ~37) over a config grid with and without SWAP_AB, against bf16 torch.matmul. Writes $OUT/w4_dot_sweep.json."""
import itertools, json, os, random, time
import torch
from minillm.bench.kernels import time_ms
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device("cuda"); dtype = torch.bfloat16; G = 128
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
grid = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, SWAP_AB=sw, num_warps=w, num_stages=st)
        for bm, bn, bk, sk, sw, w, st in itertools.product((16, 32, 64), (64, 128, 256), (64, 128, 256), (1, 2, 4, 8),
                                                            (False, True), (4, 8), (2, 3, 4))
        if bn * bk <= 128 * 128 * (2 if w == 8 else 1)]
random.seed(0); grid = random.sample(grid, min(int(os.environ.get("CONFIGS", "80")), len(grid)))
gen = torch.Generator(device=dev).manual_seed(0)
rows, deadline = [], time.time() + float(os.environ.get("BUDGET_S", "420"))
for k, n in [(4096, 12288), (4096, 22016), (11008, 4096), (4096, 4096)]:
    groups = k // G
    copies = max(2, -(-2 * L2 // (k * n // 2)))
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(groups, n, dtype=dtype, device=dev, generator=gen) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen))) for _ in range(copies)]
    dense = [torch.randn(k, n, dtype=dtype, device=dev, generator=gen) for _ in range(max(2, -(-2 * L2 // (2 * k * n))))]
    for m in (16, 32, 48, 64):
        x = torch.randn(m, k, dtype=dtype, device=dev, generator=gen)
        ref = w4a16_matmul_ref(x, *sets[0], G).float()
        cyc = itertools.cycle(dense); torch_ms = time_ms(lambda: torch.matmul(x, next(cyc)), dev)
        cyc = itertools.cycle(sets); tuned_ms = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="dot"), dev)
        times = []
        for c in grid:
            if time.time() > deadline: break
            try:
                cyc = itertools.cycle(sets)
                t = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="dot", config=c), dev, iters=10, repeats=3)
                y = w4a16_matmul(x, *sets[0], G, path="dot", config=c).float()
                times.append((t, c, (y - ref).abs().max().item() / ref.abs().max().item()))
            except Exception as e:
                times.append((float("inf"), {**c, "error": str(e)[:160]}, None))
        times.sort(key=lambda r: r[0])
        best = {sw: next((r for r in times if r[1].get("SWAP_AB") == sw and r[0] < float("inf")), None) for sw in (False, True)}
        rows.append(dict(k=k, n=n, m=m, torch_ms=torch_ms, tuned_ms=tuned_ms, top=times[:6],
                         best_plain=best[False], best_swap=best[True], errors=[r[1] for r in times if r[0] == float("inf")][:3]))
        f = lambda r: "-" if r is None else f"{r[0]*1e3:.1f}us ({torch_ms / r[0]:.2f}x) err {r[2]:.1e}"
        print(f"K={k} N={n} M={m}: bf16 {torch_ms*1e3:.1f}us tuned {tuned_ms*1e3:.1f}us ({torch_ms/tuned_ms:.2f}x) "
              f"plain {f(best[False])} swap {f(best[True])}", flush=True)
        json.dump(rows, open(f"{OUT}/w4_dot_sweep.json", "w"), indent=1, default=str)
    del sets, dense; torch.cuda.empty_cache()
