"""PAIRS (kernels/w4_dot_pairs.py: the W4A16 dot's tile dequantized two weights per HFMA2) against the fp32
dequantization, on the configs that won the earlier sweep (figures/h200/sweeps/w4a16_dot.json: its top 6 per shape
and M, M = 16..64), each with PAIRS off and on, next to bf16 torch.matmul; weights rotated past L2.
The SASS says PAIRS issues 15-30 % fewer instructions per weight (figures/cpu/w4a16_dot_sass.json).
Run: BUDGET_S=300 PYTHONPATH=$PWD python figures/h200/sweeps/w4a16_dot_pairs.py -> $OUT/w4a16_dot_pairs.json."""
import itertools, json, os, time
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import time_ms
from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
dev, dtype, G = torch.device("cuda"), torch.bfloat16, 128
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
earlier = json.load(open(os.path.join(os.path.dirname(__file__), "w4a16_dot.json")))["runs"]
gen = torch.Generator(device=dev).manual_seed(0)
runs, deadline = {}, time.time() + float(os.environ.get("BUDGET_S", "300"))
for (k, n), rows in itertools.groupby(earlier.values(), key=lambda r: (r["k"], r["n"])):
    groups = k // G
    sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
             torch.rand(groups, n, dtype=dtype, device=dev, generator=gen) * 0.01,
             pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen)))
            for _ in range(max(2, -(-2 * L2 // (k * n // 2))))]
    dense = [torch.randn(k, n, dtype=dtype, device=dev, generator=gen) for _ in range(max(2, -(-2 * L2 // (2 * k * n))))]
    for row in rows:
        m = row["m"]
        x = torch.randn(m, k, dtype=dtype, device=dev, generator=gen)
        ref = w4a16_matmul_ref(x, *sets[0], G).float()
        cyc = itertools.cycle(dense); torch_ms = time_ms(lambda: torch.matmul(x, next(cyc)), dev)
        results = []
        for _, config, _ in row["top"]:
            for pairs in (False, True):
                if time.time() > deadline: break
                c = {**{key: v for key, v in config.items() if key != "error"}, "PAIRS": pairs}
                try:
                    cyc = itertools.cycle(sets)
                    t = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="dot", config=c), dev, iters=10, repeats=3)
                    y = w4a16_matmul(x, *sets[0], G, path="dot", config=c).float()
                    results.append(dict(ms=t, vs_bf16=torch_ms / t, config=c,
                                        error=(y - ref).abs().max().item() / ref.abs().max().item()))
                except Exception as e:  # a config that does not compile is recorded, not fatal
                    results.append(dict(ms=None, config=c, failed=f"{type(e).__name__}: {str(e)[:200]}"))
        best = {p: max((r for r in results if r["ms"] and r["config"]["PAIRS"] == p), key=lambda r: r["vs_bf16"],
                       default=None) for p in (False, True)}
        runs[f"K={k} N={n} M={m}"] = dict(k=k, n=n, m=m, torch_ms=torch_ms, best_fp32_dequant=best[False],
                                          best_pairs=best[True], results=results)
        show = lambda r: "-" if r is None else f"{r['ms'] * 1e3:.1f}us ({r['vs_bf16']:.2f}x bf16)"
        print(f"K={k} N={n} M={m}: bf16 {torch_ms * 1e3:.1f}us  fp32 dequant {show(best[False])}  "
              f"pairs {show(best[True])}", flush=True)
    del sets, dense; torch.cuda.empty_cache()
doc = result_header("w4a16_dot_pairs", "kernel shapes", "-", "BUDGET_S=300 python figures/h200/sweeps/w4a16_dot_pairs.py")
doc["runs"] = runs
json.dump(doc, open(f"{OUT}/w4a16_dot_pairs.json", "w"), indent=1, default=str)
