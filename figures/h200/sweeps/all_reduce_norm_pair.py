"""What the fused all-reduce + RMSNorm costs between two H200s in lockstep, with and without a GEMV before it.

In a TP=2 decode step the kernel takes ~4.7 us a call (latency_tp_launches.json's timelines), where one GPU
without a peer takes 2.25 (all_reduce_norm_local.json). This separates the kernel's own NVLink round trip
from what the engine adds (the ranks drifting apart between calls): CUDA graphs of ITERS calls replayed on
both GPUs at once, timed with minillm.bench.kernels.time_ms on each rank:
  arnorm:        the fused kernel alone, back to back;
  gemv+arnorm:   o_proj's TP=2 GEMV (4096 x 2048, bf16) then the fused kernel on its output, as in a layer;
  gemv:          the GEMV alone;  gemv+norm: the GEMV then the one-GPU fused RMSNorm (what TP=1 pays there).
Writes $OUT/all_reduce_norm_pair.json.
Usage (two GPUs): PYTHONPATH=$PWD python figures/h200/sweeps/all_reduce_norm_pair.py"""
import json, os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERS = 64


def rank_main(rank, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    from minillm.bench.kernels import time_ms
    from minillm.kernels.fused_layer_ops import rms_norm
    from minillm.kernels.gemv import gemv
    from minillm.parallel.all_reduce import FusedAllReduceNorm
    op = FusedAllReduceNorm(dev, 256, 4096, torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(rank)
    x, r, a = (torch.randn(1, n, device=dev, generator=g).to(torch.bfloat16) for n in (4096, 4096, 2048))
    w = torch.randn(4096, device=dev, generator=g).to(torch.bfloat16)
    W = (torch.randn(4096, 2048, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    cases = {"arnorm": lambda: op(x, w, 1e-5, r),
             "gemv+arnorm": lambda: op(gemv(a, W), w, 1e-5, r),
             "gemv": lambda: gemv(a, W),
             "gemv+norm": lambda: rms_norm(gemv(a, W), w, 1e-5, residual=r)}
    result = {}
    for name, fn in cases.items():
        dist.barrier(); torch.cuda.synchronize(dev)
        result[name + "_us"] = time_ms(fn, dev, iters=ITERS, repeats=7) * 1e3
    y, s = op(x, w, 1e-5, r)
    total = torch.empty_like(x); dist.all_reduce(total.copy_(x))
    result["same_sum_as_nccl"] = bool(torch.equal(s, total + r))
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        json.dump(gathered, open(out, "w"), indent=1)
        print(json.dumps(gathered, indent=1), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = os.environ.get("OUT", "/tmp/out"); os.makedirs(out_dir, exist_ok=True)
    mp.spawn(rank_main, args=(f"{out_dir}/all_reduce_norm_pair.json",), nprocs=2)
