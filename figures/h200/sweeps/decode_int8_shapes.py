"""Issue 6's INT8-KV criterion at more sizes: the paged decode kernel over an INT8 cache against the same kernel
over the same K/V in bf16, timed in the same interleaved rounds (``bench_decode``, as ``minillm bench kernels``),
at B = 32, 64 and 128 sequences and 2k to 16k tokens, GQA 32:8, D = 128. ``utilisation_vs_unquantized``: the INT8
kernel's bytes a second over the bf16 kernel's, best round against best round. Where the cache is small, a fixed
cost (launch, the last wave, the merge) weighs twice as much on the kernel that reads half the bytes: the sizes
show how the ratio moves with the bytes read.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_int8_shapes.py``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.kernels import DecodeShape, bench_decode  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402

SIZES = [(64, 2048), (32, 8192), (64, 4096), (128, 2048), (64, 8192), (128, 4096), (32, 16384)]


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
    for batch, context in SIZES:
        row = bench_decode(DecodeShape(batch, 32, 8, context, 128, kv_cache_dtype="int8"), dev, torch.bfloat16,
                           bandwidth)
        runs["shapes"].append(row)
        print(batch, context, row["kernel"], f"int8 {row['triton']['ms'] * 1e3:.1f} us {row['triton']['gbs']:.0f} GB/s,",
              f"bf16 {row['unquantized']['ms'] * 1e3:.1f} us {row['unquantized']['gbs']:.0f} GB/s,",
              f"utilisation ratio {row['utilisation_vs_unquantized']:.3f}", flush=True)
        torch.cuda.empty_cache()
    save_result(os.environ.get("OUT", "/tmp/out"), "decode_int8_shapes", "paged decode, INT8 KV against bf16 KV",
                "bench_decode rows (minillm/bench/kernels.py): best of three interleaved rounds each", runs)


if __name__ == "__main__":
    main()
