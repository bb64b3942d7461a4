"""What the prefill kernel's KV loops issue on an H200 (sm_90), pointer loads against TMA descriptors,
read from SASS compiled on a CPU (no GPU): the evidence for issue 4's TMA variant (kernels/flash_attention_tma.py).

For each autotuned config (kernels/flash_attention.py GPU_CONFIGS), bf16, D=128, causal, non-paged, and
each variant (pointer loads, TMA=True): both KV loops (the unmasked
one that does most tiles, then the masked diagonal/tail one), each as SASS instructions per KV tile per
warp (one iteration = one tile), integer-pipe (ALU) instructions among them, K/V copies (LDGSTS = cp.async,
UTMALDG = TMA), mbarrier operations (SYNCS), wgmma (HGMMA), exp2 (MUFU), address arithmetic (IMAD, LEA),
local-memory traffic (LDL/STL = spills); per kernel registers, stack and shared memory. The committed
JSON also holds a third variant, tma_ws (TMA plus Triton's warp specialization of the loop), measured
at commit 88e2759; the kernel lost that switch after the H200 showed it failing to compile at 4 warps
and no faster at 8 (figures/h200/prefill_tma.json). Run: PYTHONPATH=$PWD python figures/cpu/sweeps/prefill_sass.py -> $OUT/prefill_sass.json
(about 2 minutes)."""
import json, os
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real backend
import triton
from minillm.bench.sass import compile_sm90, inner_loops, sass_result
from minillm.kernels import flash_attention as fa

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "KScale": "*bf16", "VScale": "*bf16",
            "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "context_lens": "*i32", "block_tables": "*i32"}
# Channel strides are 1 at run time: Triton makes them constants (contiguous loads; TMA needs it too).
BASE = dict(HEAD_DIM=128, CAUSAL=True, PAGED=False, PAGE_SIZE=1, KV_QUANT=0, QUANT_GROUP=32, TMA=False,
            stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)
VARIANTS = {"pointer": {}, "tma": {"TMA": True}}
OPS = ("LDGSTS", "UTMALDG", "LDG", "SYNCS", "HGMMA", "MUFU", "IMAD", "LEA", "LDL", "STL")


def compile_variant(config: triton.Config, variant: dict):
    consts = {**BASE, **config.kwargs, **variant}
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in fa._attention_kernel.arg_names}
    # Pointers and strides of a [tokens, heads, 128] bf16 tensor are multiples of 16 (stride_table, a
    # per-step argument, is never specialised).
    aligned = {n for n in sig if sig[n].startswith("*") or (n.startswith("stride") and n != "stride_table")}
    return compile_sm90(fa._attention_kernel, sig, consts, aligned, config.num_warps, config.num_stages)


def describe(kernel) -> dict:
    loops = inner_loops(kernel)
    names = ["unmasked", "masked"] if len(loops) == 2 else [f"loop{i}" for i in range(len(loops))]
    first = loops[0]
    return dict(registers=first["registers"], stack=first["stack"], shared_bytes=first["shared_bytes"],
                total_instructions=first["total_instructions"],
                loops={name: dict(instructions_per_tile_per_warp=lp["loop_instructions"],
                                  alu_instructions=lp["alu_instructions"],
                                  **{op: lp["opcodes"].get(op, 0) for op in OPS}, top=lp["opcodes"].most_common(8))
                       for name, lp in zip(names, loops)})


rows = {}
for config in fa.GPU_CONFIGS:
    tile = f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} {config.num_warps}w{config.num_stages}s"
    for name, variant in VARIANTS.items():
        row = rows[f"{tile} {name}"] = dict(config=dict(config.kwargs, num_warps=config.num_warps,
                                                        num_stages=config.num_stages), variant=name)
        try:
            kernel = compile_variant(config, variant)
        except Exception as e:  # a config that does not compile is a result, not the end
            row["compile_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
            print(f"{tile:16} {name:8} does not compile: {row['compile_error']}")
            continue
        row.update(describe(kernel))
        loops = "  ".join(f"{n} {lp['instructions_per_tile_per_warp']:4} (ALU {lp['alu_instructions']:3}, IMAD "
                          f"{lp['IMAD']:3}, LEA {lp['LEA']:2}, LDGSTS {lp['LDGSTS']:2}, UTMALDG {lp['UTMALDG']})"
                          for n, lp in row["loops"].items())
        print(f"{tile:16} {name:8} regs {row['registers']:3} stack {row['stack']} smem {row['shared_bytes']:6}  {loops}")
result = sass_result("prefill_sass", "flash_attention KV loops, bf16 D=128 causal",
                     "python figures/cpu/sweeps/prefill_sass.py", rows)
json.dump(result, open(f"{OUT}/prefill_sass.json", "w"), indent=1)
