"""Paged decode over an INT4 KV cache on the H200, after the rewrite that reads each packed byte once and
each (scale, minimum) pair once (kernels/kv_dequant.py; figures/h200/sweeps/kv_quant_sass.py counts its SASS):
B=64, 32 query / 8 KV heads, D=128, block 16, 2048 tokens, over block_n x warps x stages x splits, with the
int8 and bf16 caches at the same shape (default launch and a few configs) for reference. At 1b86659 the
INT4 kernel took 3.78 ms here (53 GB/s, 1 % of copy bandwidth; figures/h200/kernels_decode.json).
Writes $OUT/decode_int4.json (result-file keys of BENCHMARKS.md; commit it as figures/h200/sweeps/decode_int4.json).
FULL_GRID=int8 gives the int8 cache the full grid instead (with bf16 for reference); FULL_GRID=int8_splits small
tiles with 2 to 8 splits, for both.
DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks the script on a CPU (fp16 there: the interpreter mis-reads bf16 tiles)."""
import itertools, json, os, random, time
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import time_ms
from launch_sweep import decode_problem, time_launches  # beside this script
from minillm.bench.roofline import measure_bandwidth
from minillm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref, PagedAttentionWorkspace
from minillm.kv.quant import quantize_kv, kv_layout

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
budget = float(os.environ.get("BUDGET_S", "300"))
SMALL = bool(os.environ.get("SMALL"))
B, S, H, Hkv, D, bs = (2, 64, 8, 2, 128, 16) if SMALL else (64, 2048, 32, 8, 128, 16)
# (kv, launch configs: block_n x warps x stages, split counts, share of the time budget); int4 gets the full
# grid, the others a few points.
grid = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))
few = [(64, 4, 3), (64, 2, 4), (32, 2, 2), (128, 4, 2)]
cases = [("int4", grid, (1, 2), 0.7), ("int8", few, (1,), 0.15), ("auto", few, (1,), 0.15)]
if os.environ.get("FULL_GRID") == "int8":  # the int8 path on its own grid (after the word-wise reads, session 9)
    cases = [("int8", grid, (1, 2), 0.8), ("auto", few, (1,), 0.2)]
if os.environ.get("FULL_GRID") == "int8_splits":  # small tiles, many splits: more programs resident per SM
    small = list(itertools.product((16, 32, 64), (1, 2, 4), (2, 3)))
    cases = [("int8", small, (2, 4, 8), 0.75), ("auto", small, (2, 4), 0.25)]
if SMALL: cases = [(kv, [(16, 4, 3), (32, 2, 4)], (1, 2), 1 / 3) for kv in ("int4", "int8", "auto")]
bandwidth = measure_bandwidth(dev, nbytes=2**24 if SMALL else None)
random.seed(0)
runs = {}
q, pools, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
ws = PagedAttentionWorkspace.allocate(B, H, D, 8, dev)
out = torch.full_like(q, float("nan"))
for kv, launches, splits, share in cases:
    deadline = time.time() + budget * share
    k_pool, vp, scales = pools, v_pool, {}
    if kv != "auto":
        k_pool, ks = quantize_kv(pools, kv); vp, vs = quantize_kv(v_pool, kv); scales = dict(k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(q, k_pool, vp, tables, lens, **scales).float()
    kv_bytes = 2 * B * S * Hkv * kv_layout(kv, D, dtype).bytes_per_token_head()
    default = time_ms(lambda: paged_decode_attention(q, k_pool, vp, tables, lens, out=out, workspace=ws, **scales), dev)
    out.fill_(float("nan")); paged_decode_attention(q, k_pool, vp, tables, lens, out=out, workspace=ws, **scales)
    default_err = (out.float() - ref).abs().max().item()
    res = time_launches(lambda **launch: paged_decode_attention(q, k_pool, vp, tables, lens, out=out, workspace=ws,
                                                                **launch, **scales),
                        ref, out, kv_bytes, launches, splits, deadline, bandwidth)
    runs[f"{kv} B={B} ctx={S}"] = dict(kv=kv, batch=B, context=S, kv_bytes=kv_bytes, default_ms=default,
                                       default_gbs=kv_bytes / default / 1e6, default_err=default_err,
                                       default_fraction=kv_bytes / default / 1e6 / bandwidth, tried=len(res), top=res[:10])
    b = res[0] if res else {}
    print(f"{kv:4} B={B} S={S}: default {default*1e3:.1f}us {kv_bytes/default/1e6:.0f} GB/s ({kv_bytes/default/1e6/bandwidth:.0%}) "
          f"err {default_err:.2g}; best {b.get('ms', 0)*1e3:.1f}us {b.get('gbs', 0):.0f} GB/s ({b.get('gbs', 0)/bandwidth:.0%}) "
          f"{ {x: b.get(x) for x in ('splits', 'block_n', 'num_warps', 'num_stages', 'err')} } of {len(res)}", flush=True)
    env = " ".join(f"{name}={os.environ[name]}" for name in ("FULL_GRID", "BUDGET_S") if name in os.environ)
    result = result_header("decode_int4_sweep", "kernel shapes", "-", f"{env} python figures/h200/sweeps/decode_int4.py".strip())
    result["note"] = (f"{H} query / {Hkv} KV heads, D={D}, block {bs}, {dtype} queries, copy bandwidth {bandwidth:.0f} GB/s "
                      "(measured in this run). kv_bytes: K/V plus scales. top: the 10 fastest launches tried (random "
                      "order, time budget), each with its max error against the torch reference.")
    result["runs"] = runs
    os.makedirs(OUT, exist_ok=True)
    json.dump(result, open(f"{OUT}/decode_int4.json", "w"), indent=1)
