import json, math, os, sys, time, traceback
import torch
sys.path.insert(0, os.path.dirname(__file__))
import triton
from minillm.bench.kernels import PrefillShape, causal_flops, time_ms, _sdpa, SDPA_BACKENDS
from minillm.kernels.flash_attention import flash_attention, flash_attention_ref, LOG2E
from minillm.kernels.flash_attention_tma import use_scratch_allocator
import fa_persistq, fa_persistfa3
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
SMS = torch.cuda.get_device_properties(0).multi_processor_count
OUT = os.environ.get("OUT", "/tmp/out")
res = {}

def desc(t, rows):
    T, H, D = t.shape
    return TensorDescriptor(t, [T, H * D], [t.stride(0), 1], [rows, D], gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16))

def gluon_call(mod, q, k, v, out, cu_q, cu_k, max_q, BM, BN, ST, W, causal=True, regs=None, qreg=False, align=False):
    if mod in (fa_persistq, fa_persistfa3):
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        heads = (cu_q.shape[0] - 1) * H
        n_tiles = triton.cdiv(max_q, BM) * heads
        mod.hopper_attention_kernel[(min(n_tiles, SMS),)](desc(q, 64), desc(k, BN), desc(v, BN), out, cu_q, cu_k,
            out.stride(0), out.stride(1), H, Hkv, heads, n_tiles, LOG2E / math.sqrt(D), HEAD_DIM=D, BLOCK_M=BM,
            BLOCK_N=BN, STAGES=ST, CAUSAL=causal, CONSUMER_REGS=regs, Q_IN_REGS=qreg, ALIGN_END=align, num_warps=W)
        return out
    use_scratch_allocator()
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    grid = (triton.cdiv(max_q, BM), (cu_q.shape[0] - 1) * H)
    mod.hopper_attention_kernel[grid](q, k, v, out, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), H, Hkv, LOG2E / math.sqrt(D),
        HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, STAGES=ST, CAUSAL=causal, num_warps=W, **({} if regs is None else {'CONSUMER_REGS': regs}))
    return out

dev = torch.device("cuda")
# correctness: varlen, GQA, D=64/128, causal and not
gen = torch.Generator(device=dev).manual_seed(1)
for D in (64, 128):
    for causal, extra in ((True, 0), (False, 0), (True, 77)):  # extra: keys before the queries (a cached prefix)
        lens = [100, 257, 1000, 1]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + list(torch.tensor([n + extra for n in lens]).cumsum(0)), dtype=torch.int32, device=dev)
        T, Tk = sum(lens), sum(lens) + extra * len(lens)
        q = torch.randn(T, 8, D, device=dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(Tk, 2, D, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(Tk, 2, D, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = flash_attention_ref(q, k, v, cu, cu_k, causal).float()
        for name, mod, BM, BN, ST, W, R, QR in (("end6", fa_persistq, 192, 64, 4, 4, 160, 6), ("end6", fa_persistq, 128, 64, 3, 4, 240, 6), ("qreg6", fa_persistq, 192, 64, 4, 4, 160, 6)):
                out = torch.full_like(q, float("nan"))
                try:
                    gluon_call(mod, q, k, v, out, cu, cu_k, max(lens), BM, BN, ST, W, causal, R, QR, name.startswith('end'))
                    torch.cuda.synchronize()
                    err = (out.float() - ref).abs().max().item()
                except Exception as e:
                    err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                key = f"check D={D} causal={causal} prefix={extra} {name} {BM}x{BN} {ST}s {W}w"
                res[key] = err
                print(f"{key}: {err}", flush=True)
json.dump(res, open(f"{OUT}/gluon.json", "w"), indent=1)

CONFIGS = [("qreg6", fa_persistq, 192, 64, 4, 4, 160, 6), ("end6", fa_persistq, 192, 64, 4, 4, 160, 6),
           ("end6", fa_persistq, 192, 64, 3, 4, 160, 6)]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
for S in [int(s) for s in os.environ.get("SEQ", "2048").split(",")]:
    B, H, D = 8, 32, 128
    shape = PrefillShape(B, H, H, S, D)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B * S, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu = torch.arange(0, (B + 1) * S, S, device=dev, dtype=torch.int32)
    flops = causal_flops(shape)
    qs, ks, vs = (t.view(B, S, H, D).transpose(1, 2) for t in (q, k, v))
    cud = _sdpa(SDPA_BACKENDS["sdpa_cudnn"], qs, ks, vs, True)
    ref = cud().transpose(1, 2).reshape(B * S, H, D).float()
    out = torch.full_like(q, float("nan"))
    calls = {"sdpa_cudnn": cud, "triton tma 64x64": lambda: flash_attention(q, k, v, cu, cu, S, out=out, config=dict(
        BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True))}
    outs = {}
    for name, mod, BM, BN, ST, W, R, QR in CONFIGS:
        key = f"gluon {name} {BM}x{BN} {ST}s {W}w r{R}"
        outs[key] = torch.full_like(q, float("nan"))
        calls[key] = (lambda mod=mod, BM=BM, BN=BN, ST=ST, W=W, R=R, QR=QR, o=outs[key], name=name:
                      gluon_call(mod, q, k, v, o, cu, cu, S, BM, BN, ST, W, True, R, QR, name.startswith("end")))
    times = {key: [] for key in calls}
    for r in range(ROUNDS):  # interleaved, so that every candidate sees the same clocks
        for key, call in calls.items():
            try:
                times[key].append(time_ms(call, dev))
            except Exception as e:
                times[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
    for key in calls:
        if isinstance(times[key], str):
            res[f"S={S} {key}"] = times[key]
            continue
        row = dict(tflops=flops / min(times[key]) / 1e9, tflops_rounds=[flops / t / 1e9 for t in times[key]])
        if key in outs:
            calls[key](); torch.cuda.synchronize()
            row["err"] = (outs[key].float() - ref).abs().max().item()
        res[f"S={S} {key}"] = row
        print(S, key, row, flush=True)
    json.dump(res, open(f"{OUT}/gluon.json", "w"), indent=1)
