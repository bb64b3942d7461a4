"""The stream-K W4A16 GEMV (kernels/w4_gemv_stream.py) compiled for sm_90 on the CPU, in each form the decode step or
``w4a16_matmul`` may run (Gluon has no interpreter; the numbers are tested on an H200,
tests/kernels/test_w4_gemv_stream.py).

What is checked: the TMA copies (weights, scales, zero points) at the ring's first fill, slot by slot, and at its
refill, the split-K kernel's HFMA2 body (``add_tile``), no spills, resources that let the programs an SM its launch
asks for be resident together (``programs_that_fit``'s arithmetic: the poll's fix-up waits for every program), and
each fix-up's instructions: the poll has neither fence nor atomic and strong (st.relaxed.gpu) stores, the counter its
one fenced atomic (at 16 and 32 slots), the add form REDs."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = textwrap.dedent('''
    import json
    from triton.experimental.gluon import language as gl
    from minillm.bench.sass import compile_gluon_sm90, whole_kernel
    from minillm.kernels import w4_gemv_hopper_kernel as wh, w4_gemv_stream as ws

    def counts(stages, units, fixup=ws.FIXUP_POLL, add=False, gated=False, normed=False, scaled=False, slots=16):
        layout = lambda bits: gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
        groups = wh.TILE_ROWS * 8 // 128
        types = {"XW": "*fp32" if normed or scaled else "*i32", "WP": "*i32",
                 "w_desc": f"tensordesc<i32[{wh.TILE_ROWS},{wh.BLOCK_N}],{layout(32)!r}>",
                 "s_desc": f"tensordesc<bf16[{groups},{wh.BLOCK_N}],{layout(16)!r}>",
                 "z_desc": f"tensordesc<i8[{groups},{wh.BLOCK_N // 2}],{layout(8)!r}>",
                 "Y": "*fp32" if add else "*bf16", "Partials": "*fp32", "Counters": "*i32", "NormW": "*i32",
                 "eps": "fp32", "Squares": "*fp32"}
        consts = dict(STAGES=stages, UNITS=units, GROUP_ROWS=16, MAX_SLOTS=slots, PDL=True, L2_TILES=0, COMPUTE=True,
                      FIXUP=fixup, START=0, ADD=add, GATED=gated, NORMED=normed, SCALED=scaled, SQUARE_SLOTS=32)
        fn = ws._w4_gemv_stream_kernel
        signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
        span = whole_kernel(compile_gluon_sm90(fn, signature, consts, num_warps=ws.WARPS))
        return dict(span, opcodes=dict(span["opcodes"]))

    cases = {"3x2 poll": counts(2, 8), "2x3 poll": counts(3, 8), "3x2 counter": counts(2, 8, ws.FIXUP_COUNTER),
             "3x2 counter 32 slots": counts(2, 8, ws.FIXUP_COUNTER, slots=32),
             "3x2 add": counts(2, 8, add=True), "3x2 gated add": counts(2, 8, add=True, gated=True),
             "3x2 normed add": counts(2, 8, add=True, normed=True),
             "3x2 gated scaled add": counts(2, 8, add=True, gated=True, scaled=True)}
    print(json.dumps(cases))
''')
CASES = ["3x2 poll", "2x3 poll", "3x2 counter", "3x2 counter 32 slots", "3x2 add", "3x2 gated add", "3x2 normed add",
         "3x2 gated scaled add"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("w4_gemv_stream_sass"))


@pytest.mark.parametrize("case", CASES)
def test_copies_body_and_resources(compiled, case):
    from minillm.kernels import w4_gemv_hopper_kernel as wh
    from minillm.kernels.w4_gemv_stream import programs_that_fit
    kernel = compiled[case]
    ops = kernel["opcodes"]
    stages = int(case[2])
    assert ops.get("UTMALDG") == 3 * (stages + 1), ops  # three copies a unit: the ring's fill, slot by slot, and refill
    packed_a_thread = wh.TILE_ROWS * wh.BLOCK_N // (32 * wh.WARPS)  # int32s of 8 weights a unit
    assert ops.get("HFMA2", 0) >= 4 * packed_a_thread, ops
    assert not any(op.startswith(("LDL", "STL")) for op in kernel["memory_opcodes"]), kernel["memory_opcodes"]
    assert kernel["stack"] == 0, kernel

    class H200:  # (programs_that_fit reads the device's limits from torch; an sm_90 SM's)
        shared_memory_per_multiprocessor, regs_per_multiprocessor = 228 * 1024, 65536

    import torch
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device: H200
    try:
        fit = programs_that_fit(kernel["shared_bytes"], kernel["registers"], wh.WARPS, "sm_90")
    finally:
        torch.cuda.get_device_properties = real
    assert fit >= int(case[0]), (kernel["shared_bytes"], kernel["registers"])


def test_each_fix_up_has_its_own_instructions(compiled):
    """The poll: volatile loads (LDG.STRONG.SYS, from L2), a partial's two words a thread stored with st.relaxed.gpu
    (STG.STRONG.GPU: strong, as the loads that read them while they are written must meet), no atomic and no fence
    beyond the ones every form has (the ring's barriers); the counter: its atomic after a fence, at 16 and 32 slots;
    the add form: a RED for each of a thread's two columns."""
    poll, add = compiled["3x2 poll"], compiled["3x2 add"]
    fences = add["opcodes"].get("MEMBAR", 0)
    assert "ATOMG" not in poll["opcodes"] and "REDG" not in poll["opcodes"], poll["opcodes"]
    assert poll["opcodes"].get("MEMBAR", 0) == fences, poll["opcodes"]
    assert any(op.startswith("LDG.E.STRONG.SYS") for op in poll["memory_opcodes"]), poll["memory_opcodes"]
    assert poll["memory_opcodes"].get("STG.E.STRONG.GPU") == 2, poll["memory_opcodes"]
    for counter in (compiled["3x2 counter"], compiled["3x2 counter 32 slots"]):
        assert counter["opcodes"].get("ATOMG") == 1 and counter["opcodes"].get("MEMBAR", 0) > fences, counter["opcodes"]
        assert "STG.E.STRONG.GPU" not in counter["memory_opcodes"], counter["memory_opcodes"]
    assert add["opcodes"].get("REDG") == 2 and "ATOMG" not in add["opcodes"], add["opcodes"]
