"""What the paged attention kernels' main loops issue per KV byte on an H200 (sm_90), read from SASS
compiled on any machine (no GPU): the evidence behind the INT4 KV rewrite (kernels/kv_dequant.py).

For the decode kernel (B=64, 32 query / 8 KV heads, D=128, block 16: one split; and with splits, for
each way of merging them, whose main loop must be the one-split loop plus the fp32 partial's stores) and the paged prefill
kernel (BLOCK_M 128, BLOCK_N 64), for each cache format (bf16, int8, int4): the loop's SASS instruction
count, warp-instructions per K/V byte it consumes (scales included; an H200 issues about 1e12 warp-
instructions/s, so at its 4.2 TB/s copy bandwidth a loop must stay under ~0.25 to be memory-bound),
its global (LDG), async-copy (LDGSTS), shared (LDS/STS) and local-memory (LDL/STL = spills) accesses,
registers, stack and shared memory. The loop is the span of the longest backward branch.
Run: PYTHONPATH=$PWD python figures/h200/sweeps/kv_quant_sass.py -> $OUT/kv_quant_sass.json."""
import json, os
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real backend
from minillm.bench.sass import compile_sm90, main_loop, sass_result, signature
from minillm.kernels import flash_attention as fa, paged_attention as pa
from minillm.kernels.kv_dequant import INT4_GROUPS, NO_QUANT, PER_TOKEN

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
D, BS = 128, 16
FORMATS = {"bf16": (NO_QUANT, "*bf16", D * 2), "int8": (PER_TOKEN, "*i8", D + 2), "int4": (INT4_GROUPS, "*u8", D // 2 + D // 16 * 4)}


# Strides the kernels keep unspecialised (their values change from call to call): never marked 16-aligned.
UNSPECIALISED = ("stride_bt", "stride_table", "stride_os", "stride_lb", "stride_lh", "stride_outb", "stride_outh")


def count(fn, kv_fmt, consts, pointers, warps, stages, tile_tokens):
    mode, kv, width = FORMATS[kv_fmt]
    consts = dict(consts, KV_QUANT=mode, QUANT_GROUP=16)
    if kv_fmt == "int8" and "stride_sh" in fn.arg_names:
        consts["stride_sh"] = 1  # per-token scales [blocks, tokens, heads]: Triton specialises a 1 to a constant
    if "SCALE_HEADS" in fn.arg_names:
        consts["SCALE_HEADS"] = 8  # the 8 KV heads' scales of a token in one 16-byte load
    if "INT8_WORDS" in fn.arg_names:
        consts["INT8_WORDS"] = kv_fmt == "int8"  # what the wrapper picks for a 16-bit q and 4-byte-aligned rows
    scales = "*fp16" if mode != NO_QUANT else kv
    # Pointers and strides of these shapes are 16-aligned, as Triton specialises them at run time (strides of 1 are
    # constexprs, above), but the per-token scales' slot stride: the number of KV heads, 8 (int4's, 8 heads x 8
    # groups x 2, is 128). Until 2026-11-30 this script marked it aligned too, and so hid the 2-byte scale loads the
    # H200 ran (figures/h200/sweeps/ncu_decode_int8_source.json).
    sig, aligned = signature(fn, {**pointers, "K": kv, "V": kv, "KScale": scales, "VScale": scales, "qk_scale": "fp32"},
                             consts, UNSPECIALISED + (("stride_st",) if mode == PER_TOKEN else ()))
    loop = main_loop(compile_sm90(fn, sig, consts, aligned, warps, stages))
    body = loop["opcodes"]
    kv_bytes = 2 * tile_tokens * width  # K and V of one tile, scales included
    return dict(kernel=fn.__name__, kv=kv_fmt, num_warps=warps, num_stages=stages, tile_tokens=tile_tokens,
                loop_instructions=loop["loop_instructions"],
                warp_instructions_per_kv_byte=round(loop["loop_instructions"] * warps / kv_bytes, 3),
                **{key: loop[key] for key in ("registers", "stack", "shared_bytes", "total_instructions")},
                **{op: body.get(op, 0) for op in ("LDG", "LDGSTS", "LDS", "STS", "LDL", "STL", "HMMA", "I2F")},
                top=body.most_common(10))


decode = dict(BLOCK_SIZE=BS, HEAD_DIM=D, BLOCK_D=D, GROUP=4, GROUP_PAD=16, BLOCK_N=64, MERGE=pa.NO_MERGE,
              NEW_KV=False)
decode_ptrs = {"Q": "*bf16", "BlockTables": "*i32", "ContextLens": "*i32", "O": "*bf16", "Lse": "*bf16", "Out": "*bf16",
               "Counters": "*i32"}
# With splits the partials are fp32, and either a second kernel or the last split program merges them:
# the main loop must not change with who merges.
split_ptrs = dict(decode_ptrs, O="*fp32", Lse="*fp32")
# The channel strides are 1 at run time, which Triton turns into constants (contiguous, vectorised loads).
prefill = dict(HEAD_DIM=D, CAUSAL=True, PAGED=True, PAGE_SIZE=BS, BLOCK_M=128, BLOCK_N=64, stride_qd=1, stride_kd=1,
               stride_vd=1, stride_od=1, TMA=False)
prefill_ptrs = {"Q": "*bf16", "Out": "*bf16", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "context_lens": "*i32",
                "block_tables": "*i32"}
rows = []
for kv in FORMATS:
    for warps, stages in ((4, 3), (2, 4)):
        rows.append(count(pa._split_kernel, kv, decode, decode_ptrs, warps, stages, 64))
        for merge in pa.MERGES:
            rows.append(dict(count(pa._split_kernel, kv, dict(decode, MERGE=pa.MERGES[merge]), split_ptrs, warps, stages,
                                   64), merge=merge))
    for warps in (4, 8):
        rows.append(count(fa._attention_kernel, kv, prefill, prefill_ptrs, warps, 3, 64))
for r in rows:
    print(f"{r['kernel']:18} {r.get('merge', '-'):10} {r['kv']:5} {r['num_warps']}w{r['num_stages']}s loop {r['loop_instructions']:5} "
          f"{r['warp_instructions_per_kv_byte']:.3f}/B LDG {r['LDG']:3} LDGSTS {r['LDGSTS']:2} LDS {r['LDS']:3} "
          f"STL/LDL {r['STL']}/{r['LDL']} regs {r['registers']} stack {r['stack']} smem {r['shared_bytes']}")
result = sass_result("kv_quant_sass", "kernel main loops", "python figures/h200/sweeps/kv_quant_sass.py",
                     {" ".join(str(r[k]) for k in ("kernel", "merge", "kv") if k in r) + f" {r['num_warps']}w{r['num_stages']}s": r
                      for r in rows})  # keys "kernel [merge] kv warps/stages": merge only for the split rows
json.dump(result, open(f"{OUT}/kv_quant_sass.json", "w"), indent=1)
