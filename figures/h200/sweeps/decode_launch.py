"""Paged decode kernel launch sweep on the H200: split count x block_n x warps x stages, for an INT8 / FP8
KV cache at B=64 ctx 2048 (issue 6: INT8 KV should keep bf16's bandwidth fraction) and bf16 at batch 1
(the TP decode step: graphs pick splits from max_model_len). Writes $OUT/decode_sweep.json (committed wrapped as
figures/h200/sweeps/decode_launch.json). DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks the script on a CPU (fp16 there: the
interpreter mis-reads bf16 tiles)."""
import itertools, json, os, random, time
import torch
from minillm.bench.kernels import time_ms
from launch_sweep import decode_problem, time_launches  # beside this script
from minillm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref, PagedAttentionWorkspace
from minillm.kv.quant import quantize_kv, kv_layout

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
deadline = time.time() + float(os.environ.get("BUDGET_S", "200"))
BW = 4150.0
cases = [("int8", 64, 2048, (1, 2, 4)), ("auto", 1, 256, (1, 2, 4, 8, 16, 32)), ("auto", 1, 2048, (4, 8, 16, 32, 64)),
         ("fp8", 64, 2048, (1, 2, 4)), ("auto", 64, 2048, (1, 2))]
if os.environ.get("SMALL"): cases = [("int8", 2, 64, (1, 2)), ("auto", 1, 64, (1, 2))]
launch = list(itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)))
random.seed(0)
rows = []
for kv, B, S, splits in cases:
    H, Hkv, D, bs = 32, 8, 128, 16
    q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
    scales = {}
    if kv != "auto":
        k_pool, ks = quantize_kv(k_pool, kv); v_pool, vs = quantize_kv(v_pool, kv); scales = dict(k_scale=ks, v_scale=vs)
    if B == 1:  # the engine's graphs: the table is max_model_len wide whatever the context
        tables = torch.cat([tables, torch.zeros(B, 2048 // bs - tables.shape[1], dtype=torch.int32, device=dev)], 1) if tables.shape[1] < 128 else tables
    ref = paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, **scales).float()
    kv_bytes = 2 * B * S * Hkv * kv_layout(kv, D, dtype).bytes_per_token_head()
    ws = PagedAttentionWorkspace.allocate(B, H, D, 64, dev)
    out = torch.full_like(q, float("nan"))
    default = time_ms(lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, workspace=ws, **scales), dev)
    res = time_launches(lambda **launch: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, workspace=ws,
                                                                **launch, **scales),
                        ref, out, kv_bytes, launch, splits, deadline)
    rows.append(dict(kv=kv, batch=B, context=S, kv_bytes=kv_bytes, default_ms=default, default_gbs=kv_bytes / default / 1e6,
                     tried=len(res), top=res[:10]))
    b = res[0] if res else {}
    print(f"{kv} B={B} S={S}: default {default*1e3:.1f}us {kv_bytes/default/1e6:.0f} GB/s ({kv_bytes/default/1e6/BW:.0%}); "
          f"best {b.get('ms',0)*1e3:.1f}us {b.get('gbs',0):.0f} GB/s ({b.get('gbs',0)/BW:.0%}) {({x: b.get(x) for x in ('splits','block_n','num_warps','num_stages','err')})} of {len(res)}", flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(rows, open(f"{OUT}/decode_sweep.json", "w"), indent=1)
