"""Issue 4 on an H200: the prefill kernel (kernels/flash_attention.py) with K/V through TMA descriptors
against its autotuned pointer-load self and SDPA's cuDNN / flash
backends, in TFLOP/s (bf16, B=8, H=32, D=128, causal, S = 512, 1024, 2048, 4096).

Per S: ``minillm.bench.kernels.bench_prefill`` (the autotuned kernel, every SDPA backend, the kernel's error
against fp32 SDPA), then each variant (pointer = the kernel pinned to one config, tma) at each of
GPU_CONFIGS, pinned, with its largest difference from the autotuned kernel's output; the JSON is rewritten
after every row, and a config that fails to compile is recorded with its error. The committed JSON also
holds a third variant, tma_ws (TMA plus Triton's warp specialization of the loop), measured at commit
88e2759: it failed to compile at 4 warps and was no faster at 8, and the kernel lost that switch.
VARIANTS=pointer,tma limits the variants; BUDGET_S (default 210) stops timing new rows. CONFIGS=occupancy
times instead tiles that fit two or more programs on an SM (shared memory at two stages or narrow K/V tiles,
registers capped by ``maxnreg``) next to a few one-program ones, at S=2048 unless SEQ_LENS says otherwise, into
$OUT/prefill_occupancy.json (BUDGET_S=330 timed all of them).
Run: PYTHONPATH=$PWD python figures/h200/sweeps/prefill_tma.py -> $OUT/prefill_tma.json (~3 minutes).
On a CPU (SCALE=cpu, under TRITON_INTERPRET=1) one tiny shape and a 16x16 tile smoke-test the script."""
import json, os, time
if os.environ.get("SCALE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import PrefillShape, bench_prefill, causal_flops, time_ms
from minillm.kernels.flash_attention import GPU_CONFIGS, flash_attention

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
CPU = os.environ.get("SCALE") == "cpu"
dev = torch.device("cpu" if CPU else "cuda")
dtype = torch.float16 if CPU else torch.bfloat16  # the interpreter's bf16 dot is wrong (DESIGN.md)
OCCUPANCY = os.environ.get("CONFIGS") == "occupancy"
NAME = "prefill_occupancy" if OCCUPANCY else "prefill_tma"
SEQ_LENS = [int(s) for s in os.environ.get("SEQ_LENS", "2048" if OCCUPANCY else "512,1024,2048,4096").split(",")]
SHAPES = [PrefillShape(1, 2, 1, 33, 16)] if CPU else [PrefillShape(8, 32, 32, s, 128) for s in SEQ_LENS]
# (BLOCK_M, BLOCK_N, warps, stages, maxnreg): with 228 KB of shared memory and 64 K registers an SM, most rows
# leave room for two programs or more, so one program's softmax can run while another's matrix products do; 64x128
# and the uncapped 8-warp 128x64 / 128x128 rows hold one program an SM and are there to compare with.
OCCUPANCY_TILES = [(64, 64, 4, 3, None), (64, 64, 4, 2, None), (64, 32, 4, 3, None), (64, 32, 4, 2, None),
                   (64, 128, 4, 2, None), (128, 32, 8, 3, None), (128, 32, 8, 4, 128), (128, 64, 8, 2, None),
                   (128, 64, 8, 2, 128), (128, 64, 8, 3, 128), (128, 128, 8, 2, None)]
CONFIGS = [{"BLOCK_M": 16, "BLOCK_N": 16}] if CPU else [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, **({"maxnreg": r} if r else {}))
    for bm, bn, w, s, r in OCCUPANCY_TILES] if OCCUPANCY else [
    dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in GPU_CONFIGS]
VARIANTS = {"pointer": {}, "tma": {"TMA": True}}
chosen = os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",")
deadline = time.time() + float(os.environ.get("BUDGET_S", "210"))
COMMAND = ("CONFIGS=occupancy " if OCCUPANCY else "") + "python figures/h200/sweeps/prefill_tma.py"
result = result_header(NAME, "prefill attention bf16 B=8 H=32 D=128 causal", "-", COMMAND)
result["runs"] = runs = {}


def save():
    json.dump(result, open(f"{OUT}/{NAME}.json", "w"), indent=1, default=str)


def inputs(shape: PrefillShape):
    """bench_prefill's packed layout (same seed), so the outputs can be compared with its kernel's."""
    B, H, Hkv, S, D = shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B * S, h, D, device=dev, dtype=dtype, generator=gen) for h in (H, Hkv, Hkv))
    return q, k, v, torch.arange(0, (B + 1) * S, S, device=dev, dtype=torch.int32)


for shape in SHAPES:
    runs[f"S={shape.seq_len} baseline"] = bench_prefill(shape, dev, dtype)
    save()
for variant in (v for v in VARIANTS if v in chosen):
    for shape in SHAPES:
        q, k, v, cu = inputs(shape)
        tuned = flash_attention(q, k, v, cu, cu, shape.seq_len).float()
        for config in CONFIGS:
            tile = (f"{config['BLOCK_M']}x{config['BLOCK_N']} {config.get('num_warps', 4)}w{config.get('num_stages', 2)}s"
                    + (f" r{config['maxnreg']}" if "maxnreg" in config else ""))
            row = runs[f"S={shape.seq_len} {variant} {tile}"] = dict(shape=vars(shape), variant=variant, config=config)
            if time.time() > deadline:
                row["skipped"] = "BUDGET_S spent"
                continue
            pinned = {**config, **VARIANTS[variant]}
            out = torch.full_like(q, float("nan"))
            call = lambda: flash_attention(q, k, v, cu, cu, shape.seq_len, out=out, config=pinned)  # noqa: E731
            try:
                ms = time_ms(call, dev)
            except Exception as e:  # a variant that does not compile or launch is a result, not the end
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            else:
                call()
                row.update(ms=ms, tflops=causal_flops(shape) / ms / 1e9,
                           max_abs_diff_from_autotuned=(out.float() - tuned).abs().max().item())
            print(f"S={shape.seq_len:5} {variant:8} {tile:16} " + (f"{row['tflops']:6.1f} TFLOP/s  diff "
                  f"{row['max_abs_diff_from_autotuned']:.1e}" if "tflops" in row else row["error"]), flush=True)
            save()

print("\n    S  best SDPA    autotuned  " + "  ".join(f"{'best ' + v:>13}" for v in chosen)
      + "   (TFLOP/s, fraction of best SDPA)")
for shape in SHAPES:
    base = runs[f"S={shape.seq_len} baseline"]
    sdpa = max((base[n]["tflops"] for n in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient") if base.get(n)), default=None)
    best = {v: max((r["tflops"] for r in runs.values() if r.get("variant") == v and r["shape"] == vars(shape)
                    and "tflops" in r), default=None) for v in chosen}
    frac = lambda t: "    -" if t is None or not sdpa else f"{t:6.1f} {t / sdpa:4.0%}"  # noqa: E731
    print(f"{shape.seq_len:5}  {sdpa or 0:9.1f}  {frac(base['triton']['tflops']):>11}  "
          + "  ".join(f"{frac(best[v]):>13}" for v in chosen))
