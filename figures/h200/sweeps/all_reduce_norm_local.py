"""What the fused all-reduce + norm kernel costs on one GPU with no peer to wait for (world = 1: its loads,
the norm, the stores and the epoch, but no push and no poll), next to the plain fused RMSNorm kernel, at
batch 1 and 64, hidden 4096, bf16, over grids of 16 and 64 programs; CUDA-graph timing (minillm.bench.kernels.time_ms).
The difference from the 4.85 us a call that two H200s measured (figures/h200/latency_tp_fused.json) is what
the NVLink round trip and the wait for the peer cost. Writes $OUT/all_reduce_norm_local.json.
Usage: OUT=/tmp/out PYTHONPATH=$PWD python figures/h200/sweeps/all_reduce_norm_local.py"""
import json, os
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import time_ms
from minillm.kernels.all_reduce_norm import Workspace, all_reduce_rms_norm
from minillm.kernels.fused_layer_ops import rms_norm

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device("cuda"); dtype = torch.bfloat16; hidden = 4096
g = torch.Generator(device=dev).manual_seed(0)
buffer = torch.zeros(Workspace.buffer_shape(1, 256, hidden, dtype), dtype=torch.int64, device=dev)
w = torch.randn(hidden, device=dev, generator=g).to(dtype)
runs = {}
for programs in (16, 64):  # the kernel's grid: rows are dealt out over it
    ws = Workspace(0, 1, dtype, buffer, Workspace.zeroed_epochs(programs, dev),
                   torch.tensor([buffer.data_ptr()], dtype=torch.int64, device=dev))
    for rows in (1, 64):
        x, r = (torch.randn(1, rows, hidden, device=dev, generator=g).to(dtype) for _ in range(2))
        fused = time_ms(lambda: all_reduce_rms_norm(x, w, 1e-5, r, ws), dev, iters=50) * 1e3
        plain = time_ms(lambda: rms_norm(x, w, 1e-5, residual=r), dev, iters=50) * 1e3
        y, s = all_reduce_rms_norm(x, w, 1e-5, r, ws)
        y_ref, s_ref = rms_norm(x, w, 1e-5, residual=r)
        runs[f"programs={programs} rows={rows}"] = dict(all_reduce_rms_norm_world1_us=fused, rms_norm_us=plain,
                                                        same_sum=bool(torch.equal(s, s_ref)),
                                                        max_norm_diff=(y - y_ref).abs().max().item())
        print(programs, rows, runs[f"programs={programs} rows={rows}"], flush=True)
result = result_header("all_reduce_norm_local", "kernel shapes", "-",
                       "PYTHONPATH=$PWD python figures/h200/sweeps/all_reduce_norm_local.py")
result["note"] = ("One H200, bf16, hidden 4096; microseconds a call in CUDA graphs of 50 calls. world=1: the fused "
                  "kernel's own work with no peer, over grids of 16 and 64 programs.")
result["runs"] = runs
os.makedirs(OUT, exist_ok=True)
json.dump(result, open(f"{OUT}/all_reduce_norm_local.json", "w"), indent=1)
