"""Instructions per weight in the main loop of the W4A16 dot (quant_matmul._w4_dot_kernel): the fp32 dequantization
against PAIRS (kernels/w4_dot_pairs.py), from sm_90 SASS that Triton compiles on this CPU (minillm/bench/sass.py).
Weights per thread and iteration are BLOCK_K BLOCK_N / (32 num_warps); "alu" counts the integer-pipe opcodes.
Configs: the fastest of the H200 sweep per M (figures/h200/sweeps/w4a16_dot.json), bf16, group 128.
Usage: python figures/cpu/sweeps/w4a16_dot_sass.py OUT.json"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)  # compile for a GPU, do not interpret
from minillm.bench.sass import compile_sm90, main_loop, sass_result
from minillm.kernels import quant_matmul

ALIGNED = {"X", "Y", "Partials", "Counters", "QW", "S", "Z", "N", "K", "stride_xm", "stride_ym", "stride_q", "stride_s",
           "stride_z", "group_size"}
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, SWAP_AB, num_warps, num_stages): the sweep's winners at M 16 .. 64
    (32, 128, 64, 8, True, 4, 3), (64, 256, 128, 2, False, 8, 3), (64, 128, 64, 2, False, 4, 3),
    (16, 128, 128, 4, True, 4, 3), (64, 256, 128, 1, True, 8, 3), (32, 64, 128, 4, True, 4, 2)]
KEEP = ("HGMMA", "HMMA", "HFMA2", "LDS", "LDSM", "STS", "PRMT", "LOP3", "SHF", "F2FP", "FMUL", "FADD", "FFMA")


def count(block_m, block_n, block_k, split_k, swap, warps, stages, pairs):
    sig = {"X": "*bf16", "Y": "*bf16", "Partials": "*fp32", "Counters": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "QW": "*i32", "S": "*bf16", "Z": "*i32", "group_size": "i32",
           "one_bits": "i32", "stride_q": "i32", "stride_s": "i32", "stride_z": "i32", "M_BUCKET": "i32"}
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, ONE_GROUP=True, SWAP_AB=swap,
                  PAIRS=pairs)
    loop = main_loop(compile_sm90(quant_matmul._w4_dot_kernel, sig, consts, ALIGNED, warps, stages))
    weights = block_k * block_n // (32 * warps)
    ops = loop["opcodes"]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, SWAP_AB=swap, num_warps=warps,
                num_stages=stages, PAIRS=pairs, registers=loop["registers"], stack=loop["stack"],
                shared_bytes=loop["shared_bytes"], loop_instructions=loop["loop_instructions"],
                weights_per_thread=weights, per_weight=round(loop["loop_instructions"] / weights, 2),
                alu_per_weight=round(loop["alu_instructions"] / weights, 2),
                **{op: ops.get(op, 0) for op in KEEP}, top=ops.most_common(12))


rows = [count(*config, pairs) for config in CONFIGS for pairs in (False, True)]
for r in rows:
    print(f"{r['BLOCK_M'], r['BLOCK_N'], r['BLOCK_K'], r['SPLIT_K'], r['SWAP_AB']} PAIRS={r['PAIRS']}: {r['per_weight']} "
          f"instr/weight ({r['alu_per_weight']} ALU), {r['registers']} regs, stack {r['stack']}, top {r['top'][:6]}")
doc = sass_result("w4a16_dot_sass", "main loop of _w4_dot_kernel, sm_90 SASS, bf16, group 128",
                  "python figures/cpu/sweeps/w4a16_dot_sass.py figures/cpu/w4a16_dot_sass.json", rows)
json.dump(doc, open(sys.argv[1], "w"), indent=1)
