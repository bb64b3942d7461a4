"""Instructions per weight in the main loop of the W4A16 GEMV (quant_matmul._w4_gemv_kernel), fp32 body against the
HFMA2 variant, from the sm_90 SASS that Triton compiles on this CPU (no GPU needed: ptxas and cuobjdump ship with
Triton). The main loop is the longest backward branch; weights per thread and iteration are
8 BLOCK_KP BLOCK_N / (32 num_warps). "alu" counts the integer-pipe opcodes (LOP3, SHF, PRMT, IADD3, LEA, ISETP, ...),
which issue at half the FMA rate on sm_90. Usage: python figures/cpu/sweeps/w4a16_gemv_sass.py OUT.json"""
import collections, json, os, platform, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)  # compile for a GPU, do not interpret
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minillm.bench.harness import result_header
from minillm.kernels import quant_matmul

TOOLS = os.path.join(os.path.dirname(__import__("triton.backends.nvidia", fromlist=["x"]).__file__), "bin")
ALU = {"LOP3", "SHF", "PRMT", "IADD3", "LEA", "ISETP", "SEL", "IABS", "VIADD", "MOV", "PLOP3"}
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
                     ONE_GROUP=True, EVEN_N=True), **extra}  # ONE_GROUP, EVEN_N: group 128, N % BLOCK_N == 0
    sig.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in ALIGNED}
    kernel = triton.compile(ASTSource(fn=quant_matmul._w4_gemv_kernel, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": 3})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        sass = subprocess.run([f"{TOOLS}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        regs = int(re.search(r"REG:(\d+)", subprocess.run([f"{TOOLS}/cuobjdump", "-res-usage", f.name],
                                                           capture_output=True, text=True).stdout).group(1))
    lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", l).group(1), 16) for l in lines]
    ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", l).split()[0].split(".")[0] for l in lines]
    loop = max(((int(m.group(1), 16), a) for l, a in zip(lines, addr)
                if (m := re.search(r"BRA.*?0x([0-9a-f]+)", l)) and int(m.group(1), 16) < a), key=lambda r: r[1] - r[0])
    body = [o for a, o in zip(addr, ops) if loop[0] <= a <= loop[1]]
    weights = 8 * block_kp * block_n // (32 * warps)
    return dict(dtype=dtype, BLOCK_N=block_n, BLOCK_KP=block_kp, SPLIT_K=split_k, num_warps=warps, **extra,
                registers=regs, loop_instructions=len(body), weights_per_thread=weights,
                per_weight=round(len(body) / weights, 2), alu_per_weight=round(sum(o in ALU for o in body) / weights, 2),
                opcodes=dict(collections.Counter(body).most_common(14)))


rows = []
for config in CONFIGS:
    rows.append(count(*config))
    r = rows[-1]
    print(f"{r['dtype']} {config[1:5]} {config[5]}: {r['per_weight']} instr/weight ({r['alu_per_weight']} ALU), "
          f"{r['registers']} regs", flush=True)
doc = result_header("w4a16_gemv_sass", "main loop of _w4_gemv_kernel, sm_90 SASS, group 128", "-",
                    "python figures/cpu/sweeps/w4a16_gemv_sass.py figures/cpu/w4a16_gemv_sass.json")
doc |= dict(device=f"CPU ({platform.machine()}), Triton {triton.__version__} compiling for sm_90", runs=rows)
json.dump(doc, open(sys.argv[1], "w"), indent=1)
