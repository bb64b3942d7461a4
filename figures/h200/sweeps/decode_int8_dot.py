"""Where the INT8-KV paged decode kernel loses its time: three ways to turn the int8 codes into the dots' fp16
operands, each with a few launches and register caps, next to the bf16 kernel in the same run.

- words: the default. K and V are read as int32 words of four codes and converted where they were loaded
  (``int_float.int8_words_to_fp16``); both converted tiles then pass through shared memory to reach the dots'
  operand layouts (Nsight Compute: 2.1 M load / 2.9 M store bank conflicts, ``ncu_kernels.json``).
- k_direct: V as above; K's codes converted by an elementwise function (``int_float.int8_to_fp16``, four codes
  per register), which lets Triton load them from shared memory straight into the QK^T dot's operand layout
  (4 bytes per load along head_dim) and convert there: no fp16 round trip for K.
- pack4: both K and V through ``int8_to_fp16``; V's operand runs along tokens, 128 bytes apart, so its codes are
  loaded from shared memory a byte at a time.
maxnreg caps the registers per thread (more programs per SM; the int8 kernel ran at 7.7 warps per SM).

B=64, 32 query / 8 KV heads, D=128, block 16, 2048 tokens, bf16 queries. Writes $OUT/decode_int8_dot.json.
Ran at commit aa3ce26, whose decode kernel had the K_DIRECT, PREFETCH_IDS and SCALES_BY_BLOCK switches this script
sets; none paid, and the next commit removed them (check that commit out to rerun). What the runs led to instead:
the per-token scales' aligned loads (kv_dequant.per_token_rows, ncu_decode_int8_source.json).
Usage: OUT=/tmp/out python figures/h200/sweeps/decode_int8_dot.py; DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks it
on a CPU (fp16 there)."""
import json, os, time
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import time_ms
from minillm.bench.roofline import measure_bandwidth
from minillm.kernels import paged_attention as pa
from minillm.kv.quant import kv_layout, quantize_kv
from launch_sweep import decode_problem  # beside this script

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
SMALL = bool(os.environ.get("SMALL"))
B, S, H, Hkv, D, bs = (2, 64, 8, 2, 128, 16) if SMALL else (64, 2048, 32, 8, 128, 16)
LAUNCHES = [(16, 2, 2)] if SMALL else [(64, 2, 4), (64, 4, 3), (32, 2, 3), (64, 2, 3), (32, 4, 3), (128, 4, 3)]
CAPS = [None] if SMALL else [None, 128, 96]
VARIANTS = {"words": dict(words=True), "k_direct": dict(words=True, K_DIRECT=True),
            "pack4": dict(words=False, K_DIRECT=False)}
_kernel, _reads_words = pa._split_kernel, pa.reads_int8_words


class _WithOptions:
    """Stands in for the kernel in paged_attention: every launch gets ``extra`` (constexprs, maxnreg) added."""
    def __init__(self, extra):
        self.extra = extra

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _kernel[grid](*args, **kwargs, **self.extra)


def variant(name, cap):
    options = {k: v for k, v in VARIANTS[name].items() if k != "words"}
    if cap and dev.type == "cuda":
        options["maxnreg"] = cap
    words = VARIANTS[name]["words"]
    pa._split_kernel = _WithOptions(options)
    pa.reads_int8_words = (lambda *a: _reads_words(*a)) if words else (lambda *a: False)


bandwidth = measure_bandwidth(dev, nbytes=2**24 if SMALL else None)
q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
out = torch.full_like(q, float("nan"))
(kq, ks), (vq, vs) = quantize_kv(k_pool, "int8"), quantize_kv(v_pool, "int8")
ref8 = pa.paged_decode_attention_ref(q, kq, vq, tables, lens, k_scale=ks, v_scale=vs).float()
ref16 = pa.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens).float()
bytes8 = 2 * B * S * Hkv * kv_layout("int8", D, dtype).bytes_per_token_head()
bytes16 = 2 * B * S * Hkv * kv_layout("auto", D, dtype).bytes_per_token_head()


def measure(run, ref, nbytes, **launch):
    try:
        ms = time_ms(lambda: run(**launch), dev, iters=10, repeats=3)
        out.fill_(float("nan")); run(**launch); err = (out.float() - ref).abs().max().item()
        return dict(ms=ms, gbs=nbytes / ms / 1e6, fraction_of_bandwidth=nbytes / ms / 1e6 / bandwidth, err=err, **launch)
    except Exception as e:  # a launch that does not fit (registers, shared memory) is recorded, not fatal
        return dict(ms=float("inf"), error=str(e)[:200], **launch)


runs = {}
bf16 = lambda **l: pa.paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, **l)  # noqa: E731
runs["bf16 default"] = measure(bf16, ref16, bytes16)
print("bf16 default", runs["bf16 default"], flush=True)
int8 = lambda **l: pa.paged_decode_attention(q, kq, vq, tables, lens, out=out, k_scale=ks, v_scale=vs, **l)  # noqa: E731
deadline = time.time() + (20 if SMALL else 300)
for name in ([] if os.environ.get("OCCUPANCY_ONLY") or os.environ.get("LAYOUT_ONLY") or os.environ.get("PREFETCH_ONLY")
             else VARIANTS):
    for cap in CAPS:
        variant(name, cap)
        for bn, w, st in LAUNCHES:
            if time.time() > deadline:
                break
            key = f"{name} maxnreg={cap} {bn}/{w}w/{st}s"
            runs[key] = dict(measure(int8, ref8, bytes8, block_n=bn, num_warps=w, num_stages=st), variant=name, maxnreg=cap)
            r = runs[key]
            print(f"{key:36} {r['ms'] * 1e3:7.1f} us {r.get('fraction_of_bandwidth', 0):.0%} err {r.get('err')} "
                  f"{r.get('error', '')}", flush=True)
# Occupancy: with 2-warp programs an SM holds at most 4 of them at ~232 registers (Triton 3.6) or ~40-55 KB of shared
# memory, and one split makes 512 programs, 3.9 per SM: all three limits must move at once to reach 16 warps per SM.
for name in ([] if os.environ.get("LAYOUT_ONLY") or os.environ.get("PREFETCH_ONLY") else ("words", "k_direct")):  # LAYOUT_ONLY=1: the layout table only
    for cap in ([None] if SMALL else [None, 128, 168]):
        variant(name, cap)
        for (bn, w, st), splits in ([((16, 2, 2), 2)] if SMALL else
                                    [((32, 2, 2), 2), ((32, 2, 2), 4), ((64, 2, 2), 2), ((32, 2, 3), 2),
                                     ((32, 1, 2), 2), ((32, 1, 2), 4), ((64, 1, 2), 2), ((16, 1, 2), 4)]):
            if time.time() > deadline + (0 if SMALL else 200):
                break
            key = f"{name} maxnreg={cap} splits={splits} {bn}/{w}w/{st}s"
            runs[key] = dict(measure(int8, ref8, bytes8, block_n=bn, num_warps=w, num_stages=st, num_splits=splits),
                             variant=name, maxnreg=cap)
            r = runs[key]
            print(f"{key:45} {r['ms'] * 1e3:7.1f} us {r.get('fraction_of_bandwidth', 0):.0%} err {r.get('err')} "
                  f"{r.get('error', '')}", flush=True)
pa._split_kernel, pa.reads_int8_words = _kernel, _reads_words


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor whose memory puts dim 2 (KV heads) before dim 1 (slots): a permuted view."""
    order = [0, 2, 1, *range(3, t.dim())]
    return t.permute(order).contiguous().permute(order)


# Layout: the pools head-major ([blocks, kv_heads, slots, head_dim] in memory, vLLM's order: a block's tokens of
# one head are one contiguous 2 KB (int8) piece instead of 16 pieces 1 KB apart), and the per-token scales too,
# loaded a block row at a time (kv_dequant.per_token_scales_by_block).
hk, hv, hks, hvs = head_major(kq), head_major(vq), head_major(ks), head_major(vs)
hk16, hv16 = head_major(k_pool), head_major(v_pool)
int8_hm = lambda **l: pa.paged_decode_attention(q, hk, hv, tables, lens, out=out, k_scale=hks, v_scale=hvs, **l)  # noqa
bf16_hm = lambda **l: pa.paged_decode_attention(q, hk16, hv16, tables, lens, out=out, **l)  # noqa: E731
for label, run, ref, nbytes in ([] if os.environ.get("PREFETCH_ONLY") else
                                (("int8 head_major", int8_hm, ref8, bytes8), ("bf16 head_major", bf16_hm, ref16, bytes16))):
    for (bn, w, st), splits in ([((16, 2, 2), 1)] if SMALL else
                                [((64, 2, 4), 1), ((64, 2, 3), 1), ((64, 4, 3), 1), ((32, 2, 3), 1), ((128, 4, 3), 1),
                                 ((64, 2, 3), 2), ((32, 1, 2), 2), ((64, 4, 3), 2)]):
        key = f"{label} splits={splits} {bn}/{w}w/{st}s"
        runs[key] = dict(measure(run, ref, nbytes, block_n=bn, num_warps=w, num_stages=st, num_splits=splits),
                         variant=label)
        r = runs[key]
        print(f"{key:45} {r['ms'] * 1e3:7.1f} us {r.get('fraction_of_bandwidth', 0):.0%} err {r.get('err')} "
              f"{r.get('error', '')}", flush=True)
# Block ids one tile ahead (PREFETCH_IDS): K/V addresses from a loop-carried value instead of a load in the same
# iteration, so that Triton's pipeliner keeps several tiles' copies in flight (sm_90 SASS: DEPBAR.LE SB0, 0x0 at the
# loop's top without it, i.e. each tile's copy waited for right after it was issued).
for label, run, ref, nbytes, launches in (
        ("int8", int8, ref8, bytes8, [(64, 2, 4), (64, 2, 3), (64, 4, 3), (64, 4, 4), (32, 2, 3), (128, 4, 3), (32, 4, 4)]),
        ("bf16", bf16, ref16, bytes16, [(64, 4, 3), (64, 2, 4), (64, 4, 4), (32, 4, 4)])):
    for prefetch in (False, True):
        pa._split_kernel = _WithOptions(dict(PREFETCH_IDS=prefetch))
        for bn, w, st in ([(16, 2, 2)] if SMALL else launches):
            key = f"{label} prefetch_ids={prefetch} {bn}/{w}w/{st}s"
            runs[key] = dict(measure(run, ref, nbytes, block_n=bn, num_warps=w, num_stages=st), variant=label,
                             prefetch_ids=prefetch)
            r = runs[key]
            print(f"{key:45} {r['ms'] * 1e3:7.1f} us {r.get('fraction_of_bandwidth', 0):.0%} err {r.get('err')} "
                  f"{r.get('error', '')}", flush=True)
pa._split_kernel = _kernel
best = min((r for k, r in runs.items() if not k.startswith("bf16")), key=lambda r: r["ms"])
result = result_header("decode_int8_dot", "kernel shapes", "-", "python figures/h200/sweeps/decode_int8_dot.py")
result["note"] = (f"B={B}, {H} query / {Hkv} KV heads, D={D}, block {bs}, {S} tokens, {dtype} queries, one split; "
                  f"copy bandwidth {bandwidth:.0f} GB/s (this run). int8 bytes include the per-token scales.")
result["best_int8"] = best
result["runs"] = runs
os.makedirs(OUT, exist_ok=True)
json.dump(result, open(f"{OUT}/decode_int8_dot.json", "w"), indent=1)
print("best int8:", best)
