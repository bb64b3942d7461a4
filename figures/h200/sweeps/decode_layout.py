"""Does the KV pool's layout set the paged decode kernel's speed? The same kernel (its strides are arguments)
over the engine's token-major pool, [blocks, block_size, kv_heads, head_dim] in memory, and over a head-major
one, [blocks, kv_heads, block_size, head_dim] in memory (vLLM's order), passed as a permuted view of the same
logical shape. Token-major, one KV head's token is a head_dim-wide piece (256 bytes in bf16, 128 in int8), a
whole token's width from the next; head-major, a block's tokens of one head are contiguous (block_size pieces).
The question comes from figures/h200/sweeps/decode_int8_splits.json: bf16 and int8 both take ~125 us at B=64,
2k context, reading the same number of pieces though int8 reads half the bytes.

The per-token scales change with the layout too: token-major, a token's 8 heads' scales are contiguous and load
together (the kernel's SCALE_HEADS = 8); head-major, one head's scales are contiguous along the tokens and load one
head at a time (SCALE_HEADS = 1). For int8 and fp8 the comparison measures both.

B=64, 32 query / 8 KV heads, D=128, block 16, 2048 tokens; bf16, int8 and fp8 caches (int4's scale layout is
per group and left out); the default launch and a few others per case. Writes $OUT/decode_layout.json.
Usage: OUT=/tmp/out python figures/h200/sweeps/decode_layout.py; DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks it on
a CPU (fp16 there: the interpreter mis-reads bf16 tiles)."""
import os, random, time
import torch
from minillm.bench.kernels import time_ms
from minillm.bench.roofline import measure_bandwidth
from minillm.kernels.paged_attention import PagedAttentionWorkspace, paged_decode_attention, paged_decode_attention_ref
from minillm.kv.quant import kv_layout
from launch_sweep import decode_problem, quantized_pools, save_result, time_launches  # beside this script

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
SMALL = bool(os.environ.get("SMALL"))
B, S, H, Hkv, D, bs = (2, 64, 8, 2, 128, 16) if SMALL else (64, 2048, 32, 8, 128, 16)
LAUNCHES = [(16, 4, 3), (32, 2, 2)] if SMALL else [(64, 4, 3), (64, 2, 3), (32, 2, 2), (128, 4, 3), (16, 2, 2)]
SPLITS = (1, 2)


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor whose memory puts dim 2 (KV heads) before dim 1 (slots): a permuted view."""
    order = [0, 2, 1, *range(3, t.dim())]
    return t.permute(order).contiguous().permute(order)


bandwidth = measure_bandwidth(dev, nbytes=2**24 if SMALL else None)
q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
ws = PagedAttentionWorkspace.allocate(B, H, D, max(SPLITS), dev)
out = torch.full_like(q, float("nan"))
random.seed(0)
runs = {}
for kv in ("auto", "int8", "fp8"):
    kq, vq, scales = quantized_pools(k_pool, v_pool, kv)
    ref = paged_decode_attention_ref(q, kq, vq, tables, lens, **scales).float()
    kv_bytes = 2 * B * S * Hkv * kv_layout(kv, D, dtype).bytes_per_token_head()
    for layout in ("token_major", "head_major"):
        if layout == "head_major":
            kq, vq = head_major(kq), head_major(vq)
            scales = {name: head_major(s) for name, s in scales.items()}
        run = lambda **launch: paged_decode_attention(q, kq, vq, tables, lens, out=out, workspace=ws, **launch,  # noqa: E731
                                                      **scales)
        default = time_ms(run, dev)
        out.fill_(float("nan")); run(); err = (out.float() - ref).abs().max().item()
        rows = time_launches(run, ref, out, kv_bytes, LAUNCHES, SPLITS, time.time() + (5 if SMALL else 40), bandwidth)
        runs[f"{kv} {layout}"] = dict(kv=kv, layout=layout, strides=list(kq.stride()), kv_bytes=kv_bytes,
                                      default_ms=default, default_gbs=kv_bytes / default / 1e6, default_err=err,
                                      default_fraction=kv_bytes / default / 1e6 / bandwidth, tried=len(rows), top=rows[:6])
        best = rows[0] if rows else {}
        print(f"{kv:4} {layout:11}: default {default * 1e3:.1f}us {kv_bytes / default / 1e6:.0f} GB/s "
              f"({kv_bytes / default / 1e6 / bandwidth:.0%}) err {err:.2g}; best {best.get('ms', 0) * 1e3:.1f}us "
              f"{ {x: best.get(x) for x in ('splits', 'block_n', 'num_warps', 'num_stages', 'err')} }", flush=True)
save_result(OUT, "decode_layout", "kernel shapes",
            f"B={B}, {H} query / {Hkv} KV heads, D={D}, block {bs}, {S} tokens, {dtype} queries, copy bandwidth "
            f"{bandwidth:.0f} GB/s (this run). The same kernel and values; only the pools' memory order differs "
            "(strides). top: the fastest launches tried, with their error against the torch reference.", runs)
