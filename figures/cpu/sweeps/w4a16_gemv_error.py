"""Error of the W4A16 GEMV (M=1, group 128) on random problems at Llama-2-7B's K, fp32 body against the HFMA2 variant
(16-bit pairs summed over runs of RUN packed rows), under Triton's interpreter on the CPU: max |y - ref| / max |ref|
against w4a16_matmul_ref (the weight rounded to x's dtype, fp32 sums), and against the exact float64 product.
Worst of two seeds, N = 128. The interpreter rounds the bf16 output toward zero (both bodies alike).
Usage: TRITON_INTERPRET=1 python figures/cpu/sweeps/w4a16_gemv_error.py OUT.json"""
import json, os, platform, sys
import torch
from minillm.bench.harness import result_header
from minillm.kernels.quant_matmul import dequantize_int4, pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref

N, G = 128, 128
BASE = dict(BLOCK_N=128, BLOCK_KP=16, SPLIT_K=1)
BODIES = [("fp32", BASE)] + [(f"hfma2 RUN={run}", dict(BASE, HFMA2=True, RUN=run)) for run in (1, 2, 4)]
rows = []
for dtype in (torch.bfloat16, torch.float16):
    for k in (4096, 11008):
        errors = {name: {"vs_ref": 0.0, "vs_exact": 0.0} for name, _ in BODIES}
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            q, z = torch.randint(0, 16, (k, N), generator=g), torch.randint(0, 16, (k // G, N), generator=g)
            scales = (torch.rand(k // G, N, generator=g) * 0.09 + 0.01).to(dtype)
            x = torch.randn(1, k, generator=g).to(dtype)
            weights = (pack_int4(q), scales, pack_int4_along_n(z))
            ref = w4a16_matmul_ref(x, *weights, G).double()
            exact = x.double() @ dequantize_int4(*weights, G, torch.float64)
            for name, config in BODIES:
                y = w4a16_matmul(x, *weights, G, path="gemv", config=config).double()
                for key, target in (("vs_ref", ref), ("vs_exact", exact)):
                    err = ((y - target).abs().max() / target.abs().max()).item()
                    errors[name][key] = max(errors[name][key], err)
        rows.append(dict(dtype=str(dtype).removeprefix("torch."), k=k, n=N, errors=errors))
        print(rows[-1]["dtype"], f"K={k}:", ", ".join(f"{name} {e['vs_ref']:.1e}" for name, e in errors.items()), flush=True)
doc = result_header("w4a16_gemv_error", f"M=1, N={N}, group {G}, worst of 2 seeds", "-",
                    "TRITON_INTERPRET=1 python figures/cpu/sweeps/w4a16_gemv_error.py figures/cpu/w4a16_gemv_error.json")
doc |= dict(device=f"CPU ({platform.machine()}), Triton interpreter", runs=rows)
json.dump(doc, open(sys.argv[1], "w"), indent=1)
