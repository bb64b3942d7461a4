"""Do Hopper's tensor cores take bf16 subnormals as they are? A question for the W4A16 GEMVs: their HFMA2 body reads
a packed int32's nibbles as bf16 subnormals (w4_gemv_hopper_kernel.py's docstring); fed to mma.sync / wgmma instead,
the products would be summed in fp32 by the tensor cores, where that body spends ~6 of its ~15 instructions a packed
word on 16-bit sums and their conversion. A answers the question: A's bf16 bit patterns 0..255 (v * 2**-133: v < 128
subnormal, 128..255 the smallest normals), B random bf16 times 2**100; each path's result against the fp64 product.
A path that flushes subnormals to zero loses about half of A. Run on an H200 from the repository root:
``python3 figures/h200/sweeps/subnormal_mma.py`` (NAME names the JSON)."""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402


@triton.jit
def _dot(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    tl.store(C + m[:, None] * N + n[None, :], tl.dot(a, b, out_dtype=tl.float32))


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    runs = {}
    for name, (m, n, k, warps) in {"mma.sync (16 x 16 x 16, 1 warp)": (16, 16, 16, 1),
                                   "wgmma (64 x 64 x 64, 4 warps)": (64, 64, 64, 4)}.items():
        bits = torch.randint(0, 256, (m, k), device=dev, generator=gen, dtype=torch.int16)
        a = bits.view(torch.bfloat16)
        b = (torch.randn(k, n, device=dev, generator=gen) * 2.0 ** 100).to(torch.bfloat16)
        c = torch.full((m, n), float("nan"), device=dev)
        compiled = _dot[(1,)](a, b, c, m, n, k, num_warps=warps)
        want = a.double() @ b.double()
        err = ((c.double() - want).abs().max() / want.abs().max()).item()
        asm = compiled.asm.get("ptx", "")
        runs[name] = {"max_rel_error": err, "subnormals_kept": err < 1e-3,
                      "ptx_has": [op for op in ("mma.sync", "wgmma.mma_async") if op in asm]}
        print(name, runs[name], flush=True)
    a = torch.randint(0, 256, (256, 256), device=dev, generator=gen, dtype=torch.int16).view(torch.bfloat16)
    b = (torch.randn(256, 256, device=dev, generator=gen) * 2.0 ** 100).to(torch.bfloat16)
    want = a.double() @ b.double()
    got = (a @ b).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    runs["torch.matmul (cuBLAS, bf16 out)"] = {"max_rel_error": err, "subnormals_kept": err < 2e-2}
    print(runs, flush=True)
    save_result(os.environ.get("OUT", "/tmp/out"), os.environ.get("NAME", "subnormal_mma"),
                "bf16 subnormal A operands on the tensor cores", "max |C - fp64 A B| / max |fp64 A B|; A's bit "
                "patterns 0..255 (half subnormal), B random times 2**100", runs)


if __name__ == "__main__":
    main()
