"""Hardware counters for the kernels whose issue bars are not met, read by Nsight Compute (ncu) on the H200.

Why: the launch sweeps time variants and guess at the cause from differences; ncu reads what each
kernel spends its cycles on (warp stall reasons, achieved occupancy, DRAM and shared-memory traffic,
bank conflicts, issued instructions). Each case is warmed up (compiled, autotuned) outside the
profiler, then run once between cudaProfilerStart/Stop, so with ``--profile-from-start off`` ncu sees
only that launch (ncu flushes the caches before it: L2-cold, as the benches' weight copies are).

Cases (CASES=name,name to pick): prefill at B=8, H=32, S=2048, D=128 causal, bf16 (issue 4: 85 % of
SDPA): the autotuned kernel, the TMA 64x64 tile, the 128x128 tile, and SDPA's cuDNN backend; paged
decode at B=64, 2k context, 32/8 heads, block 16 over bf16 and int8 caches (issue 6: int8 should
keep bf16's bandwidth utilisation); W4A16 GEMV at M=1 on 4096x11008 and 11008x4096 (issue 6: 3x bf16
matmul), autotuned and with pinned configs (the HFMA2 body, the 2-d TILES body at 1 and 4 warps), next to minillm's
bf16 GEMV on the same shapes and on 2048x4096 (about the INT4 weight's bytes); and the Gluon GEMVs (sm_90 only): the
column kernel at its chosen shapes and its math alone, the stream kernel with its poll and its counter. Condense the
CSV with ncu_summary.py.

Usage on the H200: ncu --clock-control none --profile-from-start off --set full python3 ncu_kernels.py
(figures/h200/sweeps/ncu_kernels.sh does that and keeps the text). On a CPU, DEV=cpu runs every case once at
small sizes under the interpreter (TRITON_INTERPRET=1), to check the script.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_sweep import decode_problem  # noqa: E402  (beside this script)

from minillm.bench.quant_kernels import GROUP_SIZE, QuantShape, _weights  # noqa: E402
from minillm.kernels.flash_attention import flash_attention  # noqa: E402
from minillm.kernels.gemv import gemv  # noqa: E402
from minillm.kernels.paged_attention import PagedAttentionWorkspace, paged_decode_attention  # noqa: E402
from minillm.kernels.quant_matmul import w4a16_matmul  # noqa: E402
from minillm.kv.quant import quantize_kv  # noqa: E402

dev = torch.device(os.environ.get("DEV", "cuda"))
GPU = dev.type == "cuda"
dtype = torch.bfloat16 if GPU else torch.float16
gen = torch.Generator(device=dev).manual_seed(0)


def prefill(config=None, backend=None):
    B, H, S, D = (8, 32, 2048, 128) if GPU else (1, 2, 64, 16)
    q, k, v = (torch.randn(B * S, H, D, device=dev, dtype=dtype, generator=gen) for _ in range(3))
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=dev)
    if backend is not None:
        qt, kt, vt = (t.view(B, S, H, D).transpose(1, 2) for t in (q, k, v))

        def sdpa():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return sdpa
    out = torch.empty_like(q)
    return lambda: flash_attention(q, k, v, cu, cu, S, out=out, config=config if GPU else None)


def decode(kv):
    B, S, H, Hkv, D, bs = (64, 2048, 32, 8, 128, 16) if GPU else (2, 64, 8, 2, 16, 16)
    q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, bs, dev, dtype)
    scales = {}
    if kv != "auto":
        k_pool, ks = quantize_kv(k_pool, kv)
        v_pool, vs = quantize_kv(v_pool, kv)
        scales = dict(k_scale=ks, v_scale=vs)
    ws = PagedAttentionWorkspace.allocate(B, H, D, 64, dev)
    out = torch.empty_like(q)
    return lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, workspace=ws, **scales)


def w4_gemv(k, n, config=None):
    if not GPU:
        k, n, config = 256, 64, None
    x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
    q, s, z = _weights(QuantShape(1, k, n), dtype, dev, gen)["w4a16"]
    return lambda: w4a16_matmul(x, q, s, z, GROUP_SIZE, path="gemv", config=config, hopper=False)


def gluon_gemv(k, n, kernel, **kw):
    """The Gluon W4A16 GEMVs, called directly at a pinned shape: the column kernel (``kernel="columns"``, kw its
    warps, stages, blocks) and the stream kernel (kw its programs_per_sm, stages, fixup: "poll" or "counter")."""
    from minillm.kernels import w4_gemv_columns, w4_gemv_stream
    from minillm.kernels.checks import num_sms
    from minillm.kernels.split_k import tile_counters
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=gen)
    q, s, z = _weights(QuantShape(1, k, n), torch.bfloat16, dev, gen)["w4a16"]
    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    if kernel == "columns":
        return lambda: w4_gemv_columns.w4_gemv_columns(x, q, s, z, GROUP_SIZE, out, **kw)
    partials = torch.empty(w4_gemv_stream.partials_needed(k, n, 4 * num_sms(dev)), dtype=torch.float32, device=dev)
    counters = tile_counters(dev)
    kw["fixup"] = {"poll": w4_gemv_stream.FIXUP_POLL, "counter": w4_gemv_stream.FIXUP_COUNTER}[kw["fixup"]]
    return lambda: w4_gemv_stream.w4_gemv_stream(x, q, s, z, GROUP_SIZE, out, partials, counters, **kw)


def _tiles(block_n, block_kp, split_k, warps):
    return dict(BLOCK_N=block_n, BLOCK_KP=block_kp, SPLIT_K=split_k, num_warps=warps, HFMA2=True, RUN=1, TILES=True,
                num_stages=1)


def bf16_gemv(k, n):
    if not GPU:
        k, n = 256, 64
    x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
    w = torch.randn(n, k, device=dev, dtype=dtype, generator=gen)
    return lambda: gemv(x, w)


CASES = {
    "prefill_autotuned": lambda: prefill(),
    "prefill_tma_64x64": lambda: prefill(dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=True)),
    "prefill_128x128": lambda: prefill(dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)),
    "prefill_sdpa_cudnn": lambda: prefill(backend=SDPBackend.CUDNN_ATTENTION),
    "decode_bf16": lambda: decode("auto"),
    "decode_int8": lambda: decode("int8"),
    "w4_gemv_4096x11008": lambda: w4_gemv(4096, 11008),
    "w4_gemv_11008x4096": lambda: w4_gemv(11008, 4096),
    # Pinned configs (no autotuning under ncu, whose launch interception skews its timings): the HFMA2 body's
    # sweep winner and the 2-d tile body (TILES) with 1 and 4 warps a program.
    "w4_gemv_4096x11008_hfma2": lambda: w4_gemv(4096, 11008, dict(BLOCK_N=256, BLOCK_KP=8, SPLIT_K=16, HFMA2=True,
                                                                  RUN=2, num_warps=1, num_stages=1)),
    "w4_gemv_4096x11008_tiles_1w": lambda: w4_gemv(4096, 11008, _tiles(128, 8, 16, 1)),
    "w4_gemv_4096x11008_tiles_4w": lambda: w4_gemv(4096, 11008, _tiles(512, 8, 24, 4)),
    # The Gluon GEMVs (sm_90 only; session 35): the column kernel at choose_shape's shapes, its math alone (the ring
    # filled once), and the stream kernel with the fix-up choose_fixup picks.
    "columns_11008x4096_8x4x4": lambda: gluon_gemv(11008, 4096, "columns", warps=8, stages=4, blocks=4),
    "columns_4096x11008_8x2x4": lambda: gluon_gemv(4096, 11008, "columns", warps=8, stages=2, blocks=4),
    "columns_11008x4096_8x4x4_math": lambda: gluon_gemv(11008, 4096, "columns", warps=8, stages=4, blocks=4,
                                                        probe=("refills",)),
    "stream_4096x11008_poll": lambda: gluon_gemv(4096, 11008, "stream", programs_per_sm=3, stages=2, fixup="poll"),
    "stream_11008x4096_counter": lambda: gluon_gemv(11008, 4096, "stream", programs_per_sm=3, stages=2,
                                                    fixup="counter"),
    "bf16_gemv_4096x11008": lambda: bf16_gemv(4096, 11008),
    "bf16_gemv_4096x2048": lambda: bf16_gemv(2048, 4096),
    "bf16_gemv_11008x4096": lambda: bf16_gemv(11008, 4096),
}

picked = os.environ.get("CASES", ",".join(CASES)).split(",")
for name in picked:
    if not GPU and name == "prefill_sdpa_cudnn":
        continue
    try:
        call = CASES[name]()
        for _ in range(3):  # compile, autotune
            call()
        if GPU:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(name)
            torch.cuda.cudart().cudaProfilerStart()
        call()
        if GPU:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            torch.cuda.nvtx.range_pop()
        print(f"== case {name}: profiled", flush=True)
    except Exception as e:  # one case that fails is a result, not the end of the run
        print(f"== case {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
