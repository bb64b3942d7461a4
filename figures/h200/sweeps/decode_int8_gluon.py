"""Issue 6: the Gluon INT8 decode kernel (kernels/paged_decode_hopper.py) against the Triton kernel on the same int8
pools and on bf16 pools, and the copy bandwidth, in one process, three interleaved rounds (H200 clocks sag under
load, so rounds interleave rather than run one candidate after another).

Shapes, all 32/8 heads, D=128, 16-token pages: the bench's B=64 with 2048 tokens (``minillm bench kernels``' decode
rows, where variants of the Gluon kernel's launch are timed too), B=1 with 16384 and B=8 with 4096 (split-K), and
B=128 with 1024. Fractions are of the copy bandwidth measured here. The history of runs is in
decode_int8_gluon_run*.json (their "commit" says which code).
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_int8_gluon.py``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import decode_problem, quantized_pools, save_result  # noqa: E402

from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from minillm.kernels.paged_decode_hopper import int8_decode  # noqa: E402

# (pages a slot, stages, registers per thread at launch, consumer warps) of the Gluon kernel timed at B=64 besides its
# defaults (kernels/paged_decode_hopper.py says what fits how many programs an SM).
VARIANTS = ((4, 2, 128, 4), (2, 6, 128, 4), (2, 4, 128, 4))


def main():
    dev = torch.device("cuda")
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "shapes": []}
    for B, S in ((64, 2048), (1, 16384), (8, 4096), (128, 1024)):
        H, Hkv, D = 32, 8, 128
        q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, 16, dev, torch.bfloat16)
        kq, vq, scales = quantized_pools(k_pool, v_pool, "int8")
        int8_bytes = 2 * B * S * Hkv * (D + 2)  # codes and fp16 scales
        bf16_bytes = 2 * B * S * Hkv * D * 2
        out = torch.empty_like(q)
        want = paged_decode_attention_ref(q, kq, vq, tables, lens, **scales)
        got = paged_decode_attention(q, kq, vq, tables, lens, hopper=True, **scales)
        row = {"batch": B, "context": S, "heads": H, "kv_heads": Hkv, "head_dim": D,
               "max_abs_error_gluon_vs_ref": (got.float() - want.float()).abs().max().item()}
        calls = {
            "gluon int8": (lambda: paged_decode_attention(q, kq, vq, tables, lens, out=out, hopper=True, **scales),
                           int8_bytes),
            "triton int8": (lambda: paged_decode_attention(q, kq, vq, tables, lens, out=out, hopper=False, **scales),
                            int8_bytes),
            "triton bf16": (lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out), bf16_bytes),
        }
        if B == 64:
            log2e = 1.4426950408889634
            for pages, stages, regs, warps in VARIANTS:
                calls[f"gluon int8, {pages}-page slots, {stages} stages, maxnreg {regs}, {warps} warps"] = (
                    lambda pages=pages, stages=stages, regs=regs, warps=warps: int8_decode(
                        q, kq, vq, tables, lens, scales["k_scale"], scales["v_scale"], out, out,
                        (out.stride(0), out.stride(1), 0), (0, 0), 1, D ** -0.5 * log2e, stages=stages,
                        max_registers=regs, warps=warps, slot_pages=pages), int8_bytes)
        for name in calls:
            row[name] = {"us_rounds": []}
        for _ in range(3):
            for name, (call, nbytes) in calls.items():
                row[name]["us_rounds"].append(time_ms(call, dev) * 1e3)
        for name, (call, nbytes) in calls.items():
            if "int8" in name:  # every int8 candidate's answer, against the reference
                out.fill_(float("nan"))
                call()
                row[name]["max_abs_error_vs_ref"] = (out.float() - want.float()).abs().max().item()
            best = min(row[name]["us_rounds"])
            row[name] |= {"us": best, "gbs": nbytes / best / 1e3, "fraction_of_bandwidth": nbytes / best / 1e3 / bandwidth}
        print(row, flush=True)
        runs["shapes"].append(row)
    save_result(os.environ.get("OUT", "/tmp/out"), "decode_int8_gluon", "paged decode on int8 and bf16 pools",
                "bytes: K/V codes and scales read (int8) or K/V (bf16); fraction of the copy bandwidth measured in the "
                "same process; best of three interleaved rounds, each the best of 5 graph replays of 20 calls", runs)


if __name__ == "__main__":
    main()
