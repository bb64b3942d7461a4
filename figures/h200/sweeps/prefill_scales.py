"""Paged prefill over an int8 / fp8 KV cache before and after its per-token scales became one aligned load for a
group of KV heads (kv_dequant.per_token_rows / per_token_scales, as the decode kernel's): before, the loop loaded one
head's 2-byte scale per token (48 LDG.E.U16 in the sm_90 loop), outside the software pipeline. The chunked-prefill
shape: B=8 sequences of 512 new tokens after 1536 cached ones (2048 in all), 32 query / 8 KV heads, D=128, block 16,
causal; bf16 in the same run. Pinned tiles (128 x 64, 8 warps, 3 stages: the autotuner's list has it) for both, so no
autotuning runs. "before" is the kernel file of the commit before the change, which the run needs beside this
script as _fa_before.py: git show b3cf1ab:kernels/flash_attention.py > figures/h200/sweeps/_fa_before.py.
Writes $OUT/prefill_scales.json. DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks it on a CPU."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fa_before  # noqa: E402  (the previous kernels/flash_attention.py)
from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.kernels import flash_attention as fa  # noqa: E402
from launch_sweep import decode_problem, quantized_pools, save_result  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
SMALL = bool(os.environ.get("SMALL"))
B, Q, S, H, Hkv, D, bs = (2, 16, 48, 4, 2, 32, 16) if SMALL else (8, 512, 2048, 32, 8, 128, 16)
CONFIG = None if SMALL else dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
_, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
gen = torch.Generator(device=dev).manual_seed(1)
q = torch.randn(B * Q, H, D, device=dev, dtype=dtype, generator=gen)
cu = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=dev)
flops = 4 * B * H * D * (Q * S - Q * (Q - 1) / 2)  # causal: new token i sees S - Q + i + 1 keys
runs = {}
for kv in ("int8", "fp8", "auto"):
    kq, vq, scales = quantized_pools(k_pool, v_pool, kv)
    ref = fa.paged_prefill_attention_ref(q, kq, vq, tables, cu, lens, **scales).float()
    for name, module in (("before", _fa_before), ("after", fa)):
        if kv == "auto" and name == "before":
            continue
        out = torch.full_like(q, float("nan"))
        call = lambda: module.paged_prefill_attention(q, kq, vq, tables, cu, lens, Q, out=out, config=CONFIG, **scales)  # noqa
        ms = time_ms(call, dev, iters=5, repeats=3)
        out.fill_(float("nan")); call()
        runs[f"{kv} {name}"] = dict(ms=ms, tflops=flops / ms / 1e9, err=(out.float() - ref).abs().max().item())
        print(kv, name, runs[f"{kv} {name}"], flush=True)
save_result(OUT, "prefill_scales", "paged prefill, chunked",
            f"B={B} x {Q} new tokens, {S} in context, {H} query / {Hkv} KV heads, D={D}, block {bs}, causal, {dtype}; "
            f"tiles {CONFIG}; tflops counts the causal products (4 B H D (Q S - Q (Q - 1) / 2)).", runs)
