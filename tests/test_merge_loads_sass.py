"""The flash-decoding merge (``split_merge.merge_splits``) issues a chunk of splits' loads before it does any math
with them, when ``_merge_kernel`` is compiled for sm_90 as the engine launches it (one warp, D = 128). Written as a
loop over a run-time split count, one split's loads waited for the previous split's sum: 13 of its 53 global loads
came before the first floating-point instruction, and the kernel took 3-4 us a call at 16 splits on an H200
(figures/h200/latency_tp_launches.json, timelines). Compiled in a subprocess without TRITON_INTERPRET."""

import textwrap

from minillm.bench.sass import run_compile_script

SCRIPT = textwrap.dedent('''
    import json
    from minillm.bench.sass import compile_sm90, opcodes, signature
    from minillm.kernels import split_merge

    fn, consts = split_merge._merge_kernel, dict(HEAD_DIM=128, BLOCK_D=128, PDL=True)
    # Its strides are kept unspecialised (do_not_specialize): none is known to be 16-aligned.
    sig, aligned = signature(fn, {"O_part": "*fp32", "Lse": "*fp32", "Out": "*bf16"}, consts,
                             {name for name in fn.arg_names if name.startswith("stride")})
    ops = opcodes(compile_sm90(fn, sig, consts, aligned, 1, 1))
    first_math = next(i for i, op in enumerate(ops) if op.startswith(("FFMA", "FMUL", "FADD", "MUFU")))
    print(json.dumps(dict(before=sum(op.startswith("LDG") for op in ops[:first_math]),
                          chunk=int(split_merge.MERGE_CHUNK))))
''')


def test_the_merge_loads_a_chunk_of_splits_before_its_math(tmp_path):
    result = run_compile_script(SCRIPT, tmp_path)
    # A split's partial row is 128 fp32 over 32 threads: 4 loads each. At least half a chunk's worth up front.
    assert result["before"] >= 2 * result["chunk"], result
