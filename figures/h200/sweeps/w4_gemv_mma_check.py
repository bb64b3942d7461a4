"""EXPERIMENT (session 23): the tensor-core W4A16 GEMV body (kernels/w4_gemv_mma.py) against the reference and the
HFMA2 body, then both timed cold at Llama-2-7B's shapes. Run on an H200: ``PYTHONPATH=$PWD python3 <this>``."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "kernels"))
from test_quant_matmul import int4_problem  # noqa: E402

from minillm.kernels import split_k, w4_gemv_hopper as hopper, w4_gemv_mma as mma  # noqa: E402
from minillm.kernels.quant_matmul import w4a16_matmul_ref  # noqa: E402

result = {"errors": {}, "times_us": {}}
CASES = [(128, 256, 128, None), (576, 576, 128, None), (4096, 1024, 128, None), (576, 128, 64, 2), (4096, 1024, 128, 1),
         (4096, 1024, 64, 8), (11008, 512, 128, None), (11008, 576, 64, 4), (2048, 4096, 128, 2), (11008, 256, 128, 1),
         (4096, 11008, 128, None), (11008, 4096, 128, None), (4096, 12288, 128, None), (4096, 22016, 64, None)]
for k, n, group, tiles in CASES:
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=k + n + group)
    want = w4a16_matmul_ref(x, qweight, scales, zeros, group).float()
    row = {}
    for name, module in (("mma", mma), ("hfma2", hopper)):
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        t = tiles or hopper.choose_tiles(k, n, 132)
        partials = torch.full((hopper.splits_needed(k, t) * n,), float("nan"), device="cuda")
        try:
            module.w4_gemv(x, qweight, scales, zeros, group, out, partials, split_k.tile_counters(x.device), True,
                           tiles=t)
            torch.cuda.synchronize()
            row[name] = (out.float() - want).abs().max().item() / want.abs().max().item()
            row[name + "_finite"] = bool(torch.isfinite(out).all())
        except Exception as e:  # noqa: BLE001
            row[name] = repr(e)[:300]
    row["counters_clean"] = all(int(c.abs().sum()) == 0 for c in split_k.COUNTERS.values())
    result["errors"][f"{k}x{n} g{group} tiles {tiles}"] = row
    print(k, n, group, tiles, row, flush=True)

# Fused forms: gated, residual added, norm folded, against the HFMA2 body (same inputs).
from minillm.kernels.w4_gemv_norms import Norm  # noqa: E402
k, n, group = 4096, 11008, 128
x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group, torch.bfloat16, seed=5)
gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
fused = {}
for form, kwargs, xin in (("gated", dict(gated=True), gate_up), ("residual", None, x), ("normed", None, x)):
    outs = {}
    for name, module in (("mma", mma), ("hfma2", hopper)):
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kw = dict(kwargs or {})
        if form == "residual":
            kw = dict(residual=residual, sumsq=torch.zeros(-(-n // 256), device="cuda"))
        if form == "normed":
            sumsq = (x.float() ** 2).reshape(-1, 256).sum(1).contiguous()
            kw = dict(norm=Norm(torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, sumsq, 1e-5))
        try:
            module.gemv(xin, qweight, scales, zeros, group, out, **kw)
            torch.cuda.synchronize()
            outs[name] = out.float()
        except Exception as e:  # noqa: BLE001
            outs[name] = repr(e)[:300]
    if all(isinstance(v, torch.Tensor) for v in outs.values()):
        fused[form] = (outs["mma"] - outs["hfma2"]).abs().max().item() / outs["hfma2"].abs().max().item()
    else:
        fused[form] = {k2: v for k2, v in outs.items() if isinstance(v, str)}
    print(form, fused[form], flush=True)
result["fused_vs_hfma2"] = fused

# Cold timing: copies of the weights rotated past the 50 MB L2, interleaved rounds.
for k, n in ((4096, 11008), (11008, 4096), (4096, 4096), (4096, 12288), (4096, 22016)):
    copies = [int4_problem(1, k, n, 128, torch.bfloat16, seed=i) for i in range(4)]
    dense = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")
    fns = {"mma": lambda c: mma.gemv(c[0], c[1], c[2], c[3], 128, out),
           "hfma2": lambda c: hopper.gemv(c[0], c[1], c[2], c[3], 128, out)}
    times = {name: [] for name in (*fns, "bf16")}
    for r in range(6):
        for name in (list(times) if r % 2 == 0 else list(reversed(times))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 40
            start.record()
            for i in range(reps):
                if name == "bf16":
                    torch.matmul(copies[0][0], dense[i % 3])
                else:
                    fns[name](copies[i % 4])
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000 / reps)
    mean = {name: sum(t[1:]) / len(t[1:]) for name, t in times.items()}
    result["times_us"][f"{k}x{n}"] = {"mean": mean, "rounds": times, "mma_over_hfma2": mean["hfma2"] / mean["mma"],
                                      "bf16_over_mma": mean["bf16"] / mean["mma"]}
    print(k, n, {a: round(b, 2) for a, b in mean.items()}, flush=True)
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(result, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "w4_gemv_mma_check.json"), "w"), indent=1)
