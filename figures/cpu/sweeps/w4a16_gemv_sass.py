"""Instructions per weight in the main loop of the W4A16 GEMV (quant_matmul._w4_gemv_kernel), fp32 body against the
HFMA2 variant, from the sm_90 SASS that Triton compiles on this CPU (no GPU needed: ptxas and cuobjdump ship with
Triton). The main loop is the longest backward branch; weights per thread and iteration are
8 BLOCK_KP BLOCK_N / (32 num_warps). "alu" counts the integer-pipe opcodes (LOP3, SHF, PRMT, IADD3, LEA, ISETP, ...),
which issue at half the FMA rate on sm_90. Usage: python figures/cpu/sweeps/w4a16_gemv_sass.py OUT.json"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)  # compile for a GPU, do not interpret
from minillm.bench.sass import compile_sm90, main_loop, sass_result
from minillm.kernels import quant_matmul

ALIGNED = {"X", "Y", "Partials", "Counters", "QW", "S", "Z", "N", "K", "stride_xm", "stride_ym", "stride_q", "stride_s",
           "stride_z", "group_size"}  # what Triton's divisibility-by-16 specialization sees on Llama's shapes
CONFIGS = [  # (dtype, BLOCK_N, BLOCK_KP, SPLIT_K, num_warps, extra constexprs)
    ("bf16", 64, 16, 8, 2, dict(PREFETCH=True)), ("bf16", 64, 16, 8, 2, {}), ("bf16", 256, 4, 32, 2, {}),
    ("bf16", 128, 8, 16, 1, {}), ("fp16", 64, 16, 8, 2, {}),
    ("bf16", 256, 16, 8, 1, dict(HFMA2=True, RUN=1)), ("bf16", 256, 16, 8, 1, dict(HFMA2=True, RUN=2)),
    ("bf16", 256, 16, 8, 1, dict(HFMA2=True, RUN=4)), ("bf16", 256, 8, 16, 1, dict(HFMA2=True, RUN=2)),
    ("bf16", 512, 8, 16, 2, dict(HFMA2=True, RUN=2)), ("bf16", 128, 16, 8, 1, dict(HFMA2=True, RUN=2)),
    ("fp16", 256, 16, 8, 1, dict(HFMA2=True, RUN=2))]


def count(dtype, block_n, block_kp, split_k, warps, extra):
    sig = {"X": f"*{dtype}", "Y": f"*{dtype}", "Partials": "*fp32", "Counters": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "QW": "*i32", "S": f"*{dtype}", "Z": "*i32",
           "group_size": "i32", "one_bits": "i32", "stride_q": "i32", "stride_s": "i32", "stride_z": "i32"}
    consts = {**dict(BLOCK_N=block_n, BLOCK_KP=block_kp, SPLIT_K=split_k, PREFETCH=False, HFMA2=False, RUN=2,
                     ONE_GROUP=True, EVEN_N=True), **extra, "M": 1}  # ONE_GROUP, EVEN_N: group 128, N % BLOCK_N == 0;
    # M = 1: Triton specialises an integer argument of 1 to a constant
    loop = main_loop(compile_sm90(quant_matmul._w4_gemv_kernel, sig, consts, ALIGNED, warps, 3))
    weights = 8 * block_kp * block_n // (32 * warps)
    return dict(dtype=dtype, BLOCK_N=block_n, BLOCK_KP=block_kp, SPLIT_K=split_k, num_warps=warps, **extra,
                registers=loop["registers"], loop_instructions=loop["loop_instructions"], weights_per_thread=weights,
                per_weight=round(loop["loop_instructions"] / weights, 2),
                alu_per_weight=round(loop["alu_instructions"] / weights, 2), opcodes=dict(loop["opcodes"].most_common(14)))


rows = []
for config in CONFIGS:
    rows.append(count(*config))
    r = rows[-1]
    print(f"{r['dtype']} {config[1:5]} {config[5]}: {r['per_weight']} instr/weight ({r['alu_per_weight']} ALU), "
          f"{r['registers']} regs", flush=True)
doc = sass_result("w4a16_gemv_sass", "main loop of _w4_gemv_kernel, sm_90 SASS, group 128",
                  "python figures/cpu/sweeps/w4a16_gemv_sass.py figures/cpu/w4a16_gemv_sass.json", rows)
json.dump(doc, open(sys.argv[1], "w"), indent=1)
