"""The column W4A16 GEMV (kernels/hopper/w4_gemv_columns.py) compiled for sm_90 on the CPU at the warps, ring slots and
groups it takes (Gluon has no interpreter; its numbers are tested on an H200,
tests/kernels/test_hopper_w4_gemv_columns.py).

What is checked: a band is three TMA copies (its weights in one box, its scales, its zero points), issued slot by slot
at the ring's first fill (the late slots' after x's loads) and once more at each refill; x is read in 16-byte loads,
and its tables four rows a load; the HFMA2 body covers every packed word a thread holds of a band; no spills, no
stack, and shared memory within an SM's. (That parting a band's halves in registers moves no data is the kernel's
own check: its ``convert_layout(assert_trivial=True)`` would not compile otherwise.)"""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = textwrap.dedent('''
    import json
    from triton.experimental.gluon import language as gl
    from minillm.bench.sass import compile_gluon_sm90, pdl_order, whole_kernel
    from minillm.kernels.hopper import w4_gemv_columns as wc

    def compiled(warps, stages, group_blocks, blocks, bands, late):
        layout = lambda bits: gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
        groups = blocks * warps // group_blocks
        types = {"XW": "*i32", "w_desc": f"tensordesc<i32[{8 * blocks * warps},{wc.COLS}],{layout(32)!r}>",
                 "s_desc": f"tensordesc<bf16[{groups},{wc.COLS}],{layout(16)!r}>",
                 "z_desc": f"tensordesc<i8[{groups},{wc.COLS // 2}],{layout(8)!r}>", "Y": "*bf16"}
        consts = dict(STAGES=stages, BANDS=bands, GROUP_BLOCKS=group_blocks, PDL=True, H=blocks, LATE=late)
        fn = wc._w4_gemv_columns_kernel
        signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
        return compile_gluon_sm90(fn, signature, consts, num_warps=warps, aligned=("XW",))

    def counts(warps, stages, group_blocks, blocks, bands=8, late=0):
        span = whole_kernel(compiled(warps, stages, group_blocks, blocks, bands, late))
        return dict(span, opcodes=dict(span["opcodes"]))

    cases = {f"{w}x{s}x{b} g{64 * g}": counts(w, s, g, b) for w, s, g, b in (
        (8, 4, 2, 2), (8, 2, 1, 2), (4, 8, 2, 2), (16, 2, 2, 2), (8, 4, 2, 4), (8, 2, 1, 4), (2, 2, 1, 4))}
    cases["8x2x4 g128 K=4096"] = counts(8, 2, 2, 4, bands=2)
    # choose_shape's: 4 x 8 x 4 (11008 x 4096, 4096 x 4096) and 4 x 4 x 4 (4096 x 11008), every slot but one late
    cases["order"] = {f"{s} late {late}": pdl_order(compiled(4, s, 2, 4, bands, late))
                      for s, bands in ((8, 8), (4, 4)) for late in (0, s - 1)}
    print(json.dumps(cases))
''')
CASES = ["8x4x2 g128", "8x2x2 g64", "4x8x2 g128", "16x2x2 g128", "8x4x4 g128", "8x2x4 g64", "2x2x4 g64"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("w4_gemv_columns_sass"))


@pytest.mark.parametrize("case", CASES)
def test_copies_body_and_resources(compiled, case):
    from minillm.kernels.hopper import w4_gemv_columns as wc
    kernel = compiled[case]
    ops = kernel["opcodes"]
    warps, stages, blocks = (int(v) for v in case.split()[0].split("x"))
    assert ops.get("UTMALDG") == 3 * (stages + 1), ops  # (three boxes a band: weights, scales, zero points)
    packed_a_thread = 8 * blocks * warps * wc.COLS // (32 * warps)  # int32s of 8 weights a band
    assert ops.get("HFMA2", 0) >= 4 * packed_a_thread, ops
    assert not any(op.startswith(("LDL", "STL")) for op in kernel["memory_opcodes"]), kernel["memory_opcodes"]
    # x read in row order, 16 bytes a load: 8 bands of 8 ``blocks`` ``warps`` packed rows over 32 ``warps`` threads
    global_loads = {op: count for op, count in kernel["memory_opcodes"].items() if op.startswith("LDG")}
    assert global_loads == {"LDG.E.128": 8 * 8 * blocks // 32}, kernel["memory_opcodes"]
    # x's pair tables stored r fastest (``_shared``): a band reads a thread's four rows r of a table in one 16-byte
    # load, four tables x two halves x blocks / 2 of them
    assert kernel["memory_opcodes"].get("LDS.128") == 4 * blocks, kernel["memory_opcodes"]
    assert kernel["stack"] == 0, kernel
    assert kernel["shared_bytes"] <= 227 * 1024, kernel["shared_bytes"]


def test_three_programs_an_sm_at_4096_inputs(compiled):
    """At K = 4096 (Llama-2-7B's gate/up, 344 programs) three 8 x 2 x 4 programs share an SM, so that all are
    resident at once: an sm_90 SM's 228 KB of shared memory (1 KB reserved a program, the rest counted in the
    128-byte units it is allocated in) and 64K registers (allocated 256 a warp at a time)."""
    kernel = compiled["8x2x4 g128 K=4096"]
    shared = -(-kernel["shared_bytes"] // 128) * 128
    per_warp = -(-kernel["registers"] * 32 // 256) * 256
    fit = min(228 * 1024 // (shared + 1024), 65536 // (per_warp * 8))
    assert fit >= 3, (kernel["shared_bytes"], kernel["registers"])


@pytest.mark.parametrize("stages", [8, 4])
def test_late_slots_are_copied_after_xs_loads(compiled, stages):
    """With ``late`` slots (``choose_shape``: all but one), the first fill copies 3 x (stages - late) boxes before the
    wait for the kernel ahead and the rest once every load of x has been issued, so that x's loads do not queue behind
    them (figures/h200/sweeps/w4a16_gemv_columns_late.json). With none
    late, every copy of the first fill comes before the wait. x is read after the wait either way."""
    for late in (0, stages - 1):
        code = compiled["order"][f"{stages} late {late}"]
        copies, loads, wait = code["copies"], code["loads"], code["wait_at"]
        assert code["waits"] == 1 and loads and min(loads) > wait, code
        early = 3 * (stages - late)
        assert sum(at < wait for at in copies) == early, code
        assert all(at > max(loads) for at in copies[early:]), code  # the late fill's and the refills'
        assert len(copies) == 3 * (stages + 1), code
