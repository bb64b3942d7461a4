"""The paged decode kernel with its block ids loaded a tile ahead (IDS_AHEAD: the ids of tile i + 1 are loaded into
registers during tile i, so the K/V/scale addresses of a tile come from a loop-carried value, not a load in the same
iteration) against the default, for int8, fp8 and bf16 caches at B=64, 2k context, 32/8 heads, D=128, block 16,
over a few launches. Why: compiled for sm_90, the default loop waits for every outstanding async copy at its top
(DEPBAR.LE SB0, 0x0: one tile in flight), with the ids a tile ahead it keeps up to 8 groups in flight.
Writes $OUT/decode_ids_ahead.json. Not adopted (the JSON says why); the commit after the one adding this script removed
IDS_AHEAD from the kernel: check this one out to rerun. DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks it on a CPU."""
import os, time
import torch
from minillm.bench.kernels import time_ms
from minillm.bench.roofline import measure_bandwidth
from minillm.kernels import paged_attention as pa
from minillm.kv.quant import kv_layout
from launch_sweep import decode_problem, quantized_pools, save_result  # beside this script

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
SMALL = bool(os.environ.get("SMALL"))
B, S, H, Hkv, D, bs = (2, 64, 8, 2, 128, 16) if SMALL else (64, 2048, 32, 8, 128, 16)
LAUNCHES = [(16, 2, 2)] if SMALL else [(64, 2, 4), (64, 2, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3),
                                       (32, 2, 4), (128, 8, 3)]
_kernel = pa._split_kernel


class _With:
    """Stands in for the kernel: every launch gets ``extra`` constexprs."""
    def __init__(self, extra):
        self.extra = extra

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _kernel[grid](*args, **kwargs, **self.extra)


bandwidth = measure_bandwidth(dev, nbytes=2**24 if SMALL else None)
q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
out = torch.full_like(q, float("nan"))
runs, deadline = {}, time.time() + (30 if SMALL else 200)
for kv in ("int8", "fp8", "auto"):
    kq, vq, scales = quantized_pools(k_pool, v_pool, kv)
    ref = pa.paged_decode_attention_ref(q, kq, vq, tables, lens, **scales).float()
    nbytes = 2 * B * S * Hkv * kv_layout(kv, D, dtype).bytes_per_token_head()
    run = lambda **l: pa.paged_decode_attention(q, kq, vq, tables, lens, out=out, **scales, **l)  # noqa: E731
    for ahead in (False, True):
        pa._split_kernel = _With(dict(IDS_AHEAD=ahead))
        for launch in [None] + LAUNCHES:
            if time.time() > deadline:
                break
            l = {} if launch is None else dict(block_n=launch[0], num_warps=launch[1], num_stages=launch[2])
            key = f"{kv} ids_ahead={ahead} " + ("default" if launch is None else "{}/{}w/{}s".format(*launch))
            try:
                ms = time_ms(lambda: run(**l), dev, iters=10, repeats=3)
                out.fill_(float("nan")); run(**l); err = (out.float() - ref).abs().max().item()
                runs[key] = dict(kv=kv, ids_ahead=ahead, ms=ms, gbs=nbytes / ms / 1e6,
                                 fraction_of_bandwidth=nbytes / ms / 1e6 / bandwidth, err=err, **l)
            except Exception as e:  # a launch that does not fit is recorded, not fatal
                runs[key] = dict(kv=kv, ids_ahead=ahead, ms=float("inf"), error=str(e)[:200], **l)
            r = runs[key]
            print(f"{key:32} {r['ms'] * 1e3:7.1f} us {r.get('fraction_of_bandwidth', 0):.0%} err {r.get('err')}", flush=True)
pa._split_kernel = _kernel
save_result(OUT, "decode_ids_ahead", "kernel shapes",
            f"B={B}, {H} query / {Hkv} KV heads, D={D}, block {bs}, {S} tokens, {dtype} queries, one split; copy "
            f"bandwidth {bandwidth:.0f} GB/s (this run); int8/fp8 bytes include the per-token scales.", runs)
