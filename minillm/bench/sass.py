"""What a Triton kernel's main loop issues on an H200, read from sm_90 SASS compiled on any machine.

Why it exists: device time is scarce, and whether a kernel can keep up with HBM is often decided by
its instruction count before any timing. Triton compiles for a GPU target without one being present
(``triton.compile`` with a ``GPUTarget``), and its wheel ships ptxas and cuobjdump, so the machine
code of a kernel's hot loop can be counted on a CPU. An H200 issues about 132 SMs x 4 schedulers x
1.98 GHz ~ 1.0e12 warp-instructions a second; a loop that consumes B bytes of HBM data per W warp-
instructions is memory-bound at 4.2 TB/s only while W / B stays below ~0.25. The integer pipe (shifts,
LOP3, PRMT, ...) issues at half the FMA rate (CUDA C Programming Guide, arithmetic instruction
throughput, cc 9.0), so ``ALU`` opcodes count twice against that budget.

``main_loop`` is the span of the longest backward branch, which for the pointer-load kernels here is
the K (or KV) loop; ``inner_loops`` lists every innermost loop, as kernels that wait on mbarriers (TMA)
need and as a kernel with two KV loops (masked and unmasked) wants. The scripts
``figures/*/sweeps/*_sass.py`` use this module; their JSON is the evidence.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

ALU = {"LOP3", "SHF", "PRMT", "IADD3", "LEA", "ISETP", "SEL", "IABS", "VIADD", "MOV", "PLOP3"}


def _tools() -> str:
    import triton.backends.nvidia
    return os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, aligned: set[str], num_warps: int,
                 num_stages: int):
    """``fn`` (a @triton.jit function) compiled for sm_90: the compiled kernel (``.asm["cubin"]``,
    ``.metadata.shared``). ``signature`` maps every argument to a Triton type ("*bf16", "i32", ...; the
    constexprs' entries are filled in); ``aligned`` names the arguments Triton would see as multiples of
    16 at run time (pointers and strides of the shapes in question). An integer argument that is 1 at run
    time belongs in ``constexprs``: Triton specialises it to a constant (a channel stride of 1 is what makes
    loads contiguous and vectorised)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it before importing triton to compile SASS")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if name in aligned and name not in constexprs}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def signature(fn, types: dict[str, str], constexprs: dict, unaligned=()) -> tuple[dict[str, str], set[str]]:
    """``compile_sm90``'s ``signature`` and ``aligned`` for ``fn`` as it runs: every argument typed from ``types``
    (name -> Triton type, "i32" when absent; the constexprs' names as such), and as 16-aligned every pointer and
    every stride but those in ``unaligned`` (strides a kernel keeps unspecialised, or whose run-time value is not a
    multiple of 16)."""
    sig = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    aligned = {name for name, kind in sig.items()
               if kind.startswith("*") or (name.startswith("stride") and name not in unaligned)}
    return sig, aligned


def opcodes(kernel) -> list[str]:
    """Every SASS instruction's opcode (with its modifiers), in code order."""
    return [op for _, op, _ in _disassemble(kernel)[0]]


def pdl_order(kernel) -> dict:
    """Where a kernel launched early (PDL) puts its work around its wait for the kernel ahead (ACQBULK,
    griddepcontrol.wait), as positions in its SASS: "waits" (how many), "wait_at" (the first), "prefetches" (L2
    warm-ups, CCTL ... PF), "loads" (global loads, LDG) and "copies" (TMA copies, UTMALDG)."""
    ops = opcodes(kernel)
    waits = [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]
    return dict(waits=len(waits), wait_at=waits[0] if waits else None,
                prefetches=[i for i, op in enumerate(ops) if op.startswith("CCTL") and ".PF" in op],
                loads=[i for i, op in enumerate(ops) if op.startswith("LDG")],
                copies=[i for i, op in enumerate(ops) if op.startswith("UTMALDG")])


def run_compile_script(source: str, directory) -> dict:
    """Run ``source`` (a script that compiles kernels with this module and prints JSON as its last line) in a new
    Python without TRITON_INTERPRET, which the kernel tests set and ``compile_sm90`` refuses; returns that JSON. The
    script goes to a file in ``directory``: @triton.jit needs its functions' source in one."""
    import json
    import pathlib
    import sys
    script = pathlib.Path(directory) / "compile_kernels.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disassemble(kernel):
    """(address, opcode, operands) of every SASS instruction of ``kernel``, and its resource usage line."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        dump = lambda *flags: subprocess.run([f"{_tools()}/cuobjdump", *flags, cubin.name], capture_output=True,  # noqa: E731
                                             text=True, check=True).stdout
        sass, usage = dump("-sass"), dump("-res-usage")
    return parse_sass(sass), usage


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction in cuobjdump's SASS listing (predicates dropped)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)([^;]*);", sass)  # HGMMA.64x64x16
    return [(int(a, 16), op, rest) for a, op, rest in lines]


def _back_branches(lines) -> list[tuple[int, int]]:
    """(target, source) of every branch to an earlier address."""
    return [(int(m.group(1), 16), a) for a, op, rest in lines
            if op.startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", rest)) and int(m.group(1), 16) < a]


def _span(kernel, lines, usage, lo: int, hi: int) -> dict:
    body = collections.Counter(op.split(".")[0] for a, op, _ in lines if lo <= a <= hi)
    return dict(loop_instructions=sum(body.values()), alu_instructions=sum(n for op, n in body.items() if op in ALU),
                opcodes=body, registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack=int(re.search(r"STACK:(\d+)", usage).group(1)), shared_bytes=kernel.metadata.shared,
                total_instructions=len(lines))


def main_loop(kernel) -> dict:
    """The compiled kernel's main loop: {"loop_instructions", "alu_instructions", "opcodes" (Counter of the
    loop's opcodes without modifiers), "registers", "stack", "shared_bytes", "total_instructions"}."""
    lines, usage = _disassemble(kernel)
    back_branches = _back_branches(lines)
    if not back_branches:
        raise ValueError("the kernel's SASS has no backward branch: no loop to count")
    lo, hi = max(back_branches, key=lambda span: span[1] - span[0])
    return _span(kernel, lines, usage, lo, hi)


def whole_kernel(kernel) -> dict:
    """``main_loop``'s fields over the whole kernel, for kernels whose loops are unrolled, and "memory_opcodes": the
    loads and stores with their modifiers (LDS.64, STG.E.128, ...), whose widths matter."""
    lines, usage = _disassemble(kernel)
    span = _span(kernel, lines, usage, 0, lines[-1][0])
    span["memory_opcodes"] = dict(collections.Counter(op for _, op, _ in lines if op.startswith(("LD", "ST"))))
    return span


def _innermost(lines) -> list[tuple[int, int]]:
    """(start, end) of every innermost loop: no other backward branch leaves from inside it. The retries of
    mbarrier waits sit after the kernel's end and jump back into a loop, spanning it: innermost drops them."""
    spans = _back_branches(lines)
    return sorted((lo, hi) for lo, hi in spans if not any(lo <= src < hi for _, src in spans if src != hi))


def inner_loops(kernel, min_instructions: int = 32) -> list[dict]:
    """Every innermost loop of at least ``min_instructions``, in code order, each as ``main_loop``
    describes it plus its "start" address. The longest backward branch is no loop in kernels that
    wait on mbarriers (TMA): the retry of a failed wait sits after the kernel's end and jumps back
    into the loop, spanning it all. Innermost (no other backward branch leaves from inside) drops
    those, and the size floor drops the retries' own one-instruction spin loops."""
    lines, usage = _disassemble(kernel)
    loops = [dict(_span(kernel, lines, usage, lo, hi), start=lo) for lo, hi in _innermost(lines)]
    return [loop for loop in loops if loop["loop_instructions"] >= min_instructions]


def _written(op: str, rest: str) -> set[int]:
    """The general registers an instruction writes (its first operand), by its width."""
    m = re.match(r"\s*R(\d+)\b", rest)
    if not m or op.startswith(("HGMMA", "ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "WARPGROUP")):
        return set()
    width = 4 if op.endswith((".128", "M88.4")) else 2 if op.endswith((".64", "M88.2")) or ".WIDE" in op else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_loops(kernel) -> list[dict]:
    """Every innermost loop that issues wgmma (HGMMA): its "start", the number of "hgmma" and of waits for them
    ("waits", WARPGROUP.DEPBAR), and its "clobbers": register operands (A, four registers each) that the loop
    overwrites after the product reads them and does not write again before it, so that the next trip's
    product reads what was written there instead. A value kept in registers across trips (hopper/flash_attention.py's
    Q) must show none. A loop whose every product waits alone (waits == hgmma) is what ptxas makes of wgmma it
    cannot pipeline (warning C7512, e.g. too few registers). ``kernel`` may also be a parsed listing
    (``parse_sass``)."""
    lines = kernel if isinstance(kernel, list) else _disassemble(kernel)[0]
    loops = []
    for lo, hi in _innermost(lines):
        body = [(op, rest) for a, op, rest in lines if lo <= a <= hi]
        mmas = [i for i, (op, _) in enumerate(body) if op.startswith("HGMMA")]
        if not mmas:
            continue
        clobbers = []
        for i in mmas:
            operand = re.match(r"\s*R\d+, R(\d+)", body[i][1])
            if operand is None:  # both operands in shared memory
                continue
            regs = set(range(int(operand.group(1)), int(operand.group(1)) + 4))
            before = set().union(*(_written(*ins) for ins in body[:i]))
            after = set().union(*(_written(*ins) for ins in body[i + 1:]))
            if (regs & after) - before:
                clobbers.append(sorted((regs & after) - before))
        loops.append(dict(start=lo, hgmma=len(mmas), clobbers=clobbers,
                          waits=sum(op.startswith("WARPGROUP.DEPBAR") for op, _ in body)))
    return loops


def compile_gluon_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, maxnreg: int | None = None,
                       aligned: tuple[str, ...] = ()):
    """``compile_sm90`` for a @gluon.jit kernel (layouts are explicit: no stages). A tensor descriptor's type is
    "tensordesc<bf16[64,128],NVMMASharedLayout(...)>": dtype, block shape, layout repr. ``maxnreg``: registers per
    thread at launch, as the kernel's launch passes it. ``aligned``: pointer arguments known 16-byte aligned, as
    Triton's launcher finds torch's allocations (what lets loads be vectorized)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it before importing triton to compile SASS")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps,
                                                                               "maxnreg": maxnreg})


def sass_result(benchmark: str, workload: str, command: str, runs) -> dict:
    """A SASS figure's JSON: the common header (``result_header``), a device line that says nothing ran, and
    ``runs``."""
    import triton
    from minillm.bench.harness import result_header
    result = result_header(benchmark, workload, "-", command)
    result["device"] = f"sm_90 (H200) code from Triton {triton.__version__}, compiled on a CPU: nothing ran"
    result["runs"] = runs
    return result
