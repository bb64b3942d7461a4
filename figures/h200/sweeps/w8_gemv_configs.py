"""The W8A16 GEMV (``quant_matmul._w8_gemv_kernel``) at M = 1, config by config, on Llama-2-7B's LM head (K = 4096,
N = 32000: what ``-head8`` reads a token) and its four projections, beside bf16 ``torch.matmul`` and minillm's bf16
GEMV on the same shapes: which tiles the autotuner's list (``quant_matmul_configs._W8_GEMV``, SHIPPED as it was) lacked.

Each timing is the median of ``triton.testing.do_bench_cudagraph`` (the launches in a CUDA graph, as in a decode
step); each config's output is checked against the reference first. Run from the repository root on an H200:
``PYTHONPATH=$PWD python3 figures/h200/sweeps/w8_gemv_configs.py``."""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.kernels.gemv import gemv  # noqa: E402
from minillm.kernels.quant_matmul import w8a16_matmul, w8a16_matmul_ref  # noqa: E402

SHAPES = {"head": (4096, 32000), "qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016),
          "down": (11008, 4096)}
# The autotuner's list when this sweep was first run (26ccc35): what "shipped" means in its JSON. Four of the
# candidates below joined it after (a38cb8e).
SHIPPED = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=w, num_stages=st)
           for n, k, s, w, st in [(128, 32, 1, 4, 3), (256, 16, 1, 4, 3), (128, 32, 4, 4, 3), (256, 32, 2, 8, 3),
                                  (256, 16, 4, 4, 3), (128, 32, 8, 4, 3), (256, 64, 4, 8, 3)]]
CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, SPLIT_K=s, num_warps=w, num_stages=st)
              for n, k, s, w, st in [(64, 64, 1, 4, 3), (64, 128, 1, 4, 3), (128, 64, 1, 4, 3), (128, 64, 2, 4, 3),
                                     (128, 128, 1, 8, 3), (128, 128, 2, 8, 3), (256, 64, 1, 8, 3), (256, 64, 2, 8, 4),
                                     (256, 128, 1, 8, 3), (512, 32, 1, 8, 3), (512, 64, 1, 8, 3), (64, 64, 4, 4, 4),
                                     (128, 64, 4, 4, 4), (64, 128, 2, 4, 3), (32, 128, 1, 4, 3), (32, 256, 1, 4, 3)]]


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=200)


runs = {}
torch.manual_seed(0)
for name, (k, n) in SHAPES.items():
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    q = torch.randint(-127, 128, (k, n), dtype=torch.int8, device="cuda")
    s = (torch.rand(n, device="cuda") * 0.01 + 0.001).bfloat16()
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    want = w8a16_matmul_ref(x, q, s).float()
    row = {"bytes": k * n, "torch_matmul_bf16_us": bench(lambda: x @ w.t()) * 1e3,
           "gemv_bf16_us": bench(lambda: gemv(x, w)) * 1e3, "configs": []}
    for config in SHIPPED + CANDIDATES:
        try:
            got = w8a16_matmul(x, q, s, config=config).float()
            error = ((got - want).abs().max() / want.abs().max()).item()
            us = bench(lambda: w8a16_matmul(x, q, s, config=config)) * 1e3
        except Exception as e:  # a config this shape cannot take
            row["configs"].append({**config, "error": repr(e)[:200]})
            continue
        row["configs"].append({**config, "us": us, "tb_s": k * n / us / 1e6, "max_rel_error": error,
                               "shipped": config in SHIPPED})
    row["configs"].sort(key=lambda c: c.get("us", 1e9))
    best = row["configs"][0]
    shipped = min((c for c in row["configs"] if c.get("shipped") and "us" in c), key=lambda c: c["us"])
    row["best"], row["best_shipped"] = best, shipped
    print(name, f"torch {row['torch_matmul_bf16_us']:.1f} us, gemv {row['gemv_bf16_us']:.1f}; w8 best {best['us']:.1f} "
          f"({best['tb_s']:.2f} TB/s) {best}, shipped best {shipped['us']:.1f}", flush=True)
    runs[name] = row
save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "w8_gemv_configs"), "M = 1, Llama-2-7B shapes",
            "us: median of do_bench_cudagraph; bytes: int8 weight bytes (scales aside)", runs)
