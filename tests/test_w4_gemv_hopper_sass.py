"""The Gluon W4A16 GEMV (kernels/hopper/w4_gemv_split_k.py) compiled for sm_90 on the CPU: what lets it keep up with HBM
is visible in its instructions, so they are counted here (Gluon has no interpreter; the numbers are tested on an
H200, tests/kernels/test_hopper_w4_gemv.py).

Per program: three TMA copies a tile (weights, scales, zero points), issued before the wait for the kernel ahead,
but for the late tiles' (after x's loads); the HFMA2 body's
four products a packed int32 (two columns x 16 rows a thread a tile) and four more per thread for x's pairs; the
weights read from shared memory 8 bytes (two columns) a row; integers become floats only for the zero points (two a
group, a thread's two columns); no spills; shared memory for six programs an SM at two tiles, three at the default
four (and registers to match). Compiled in a subprocess without TRITON_INTERPRET."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = textwrap.dedent('''
    import json
    from triton.experimental.gluon import language as gl
    from minillm.bench.sass import compile_gluon_sm90, pdl_order, whole_kernel
    from minillm.kernels.hopper import w4_gemv_split_k as wh

    def compiled(tiles, group, gated=False, run=wh.RUN, add=False, normed=False, scaled=False, late=0):
        layout = lambda bits: gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
        groups = wh.TILE_ROWS * 8 // group
        types = {"XW": "*fp32" if normed or scaled else "*i32",  # (the residual stream's or gate_up's fp32 row)
                 "w_desc": f"tensordesc<i32[{wh.TILE_ROWS},{wh.BLOCK_N}],{layout(32)!r}>",
                 "s_desc": f"tensordesc<bf16[{groups},{wh.BLOCK_N}],{layout(16)!r}>",
                 "z_desc": f"tensordesc<i8[{groups},{wh.BLOCK_N // 2}],{layout(8)!r}>",
                 "Y": "*fp32" if add else "*bf16", "Partials": "*fp32", "Counters": "*i32", "NormW": "*i32",
                 "eps": "fp32", "Squares": "*fp32"}
        consts = dict(TILES=tiles, GROUP_ROWS=group // 8, PDL=True, GATED=gated, RUN=run, ADD=add, NORMED=normed,
                      SCALED=scaled, SQUARE_SLOTS=32, LATE=late)
        fn = wh._w4_gemv_kernel
        signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
        return compile_gluon_sm90(fn, signature, consts, num_warps=wh.WARPS)

    def counts(*args, **kw):
        span = whole_kernel(compiled(*args, **kw))
        return dict(span, opcodes=dict(span["opcodes"]))

    cases = {f"{t} {g}": counts(t, g) for t, g in ((2, 128), (2, 64), (1, 128))}
    cases["2 128 gated"] = counts(2, 128, gated=True)
    cases["2 128 gated add"] = counts(2, 128, gated=True, add=True)  # down_proj, norms folded
    cases["2 128 normed"] = counts(2, 128, normed=True)  # qkv_proj and gate_up_proj, norms folded
    cases["2 128 run 1"] = counts(2, 128, run=1)
    cases["4 128"] = counts(4, 128)  # the default tiles: every form a decode step runs
    cases["4 128 gated add"] = counts(4, 128, gated=True, add=True)
    cases["4 128 normed"] = counts(4, 128, normed=True)
    cases["4 128 add"] = counts(4, 128, add=True)  # o_proj
    cases["4 128 normed add"] = counts(4, 128, normed=True, add=True)  # gate_up_proj leaving 1 / rms to down_proj
    cases["4 128 gated scaled add"] = counts(4, 128, gated=True, scaled=True, add=True)  # that down_proj
    # the decode step's forms with the last tile copied after x's tables (``w4_gemv.LATE_TILES``, one), and not
    cases["order"] = {f"{form} late {late}": pdl_order(compiled(4, 128, add=True, late=late, **kw))
                      for form, kw in (("add", {}), ("normed add", dict(normed=True)),
                                       ("gated scaled add", dict(gated=True, scaled=True))) for late in (0, 1, 3)}
    print(json.dumps(cases))
''')
CASES = ["2 128", "2 64", "1 128", "2 128 gated", "2 128 gated add", "2 128 normed", "4 128", "4 128 gated add",
         "4 128 normed", "4 128 add", "4 128 normed add", "4 128 gated scaled add"]
SHARED_PER_SM = 228 * 1024  # an sm_90 SM's shared memory, 1 KB of it reserved per program


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("w4_gemv_hopper_sass"))


@pytest.mark.parametrize("case", CASES)
def test_copies_and_products(compiled, case):
    from minillm.kernels.hopper import w4_gemv_split_k as wh
    tiles = int(case.split()[0])
    kernel = compiled[case]
    ops = kernel["opcodes"]
    packed_a_thread = tiles * wh.TILE_ROWS * wh.BLOCK_N // (32 * wh.WARPS)  # int32s of 8 weights
    assert ops.get("UTMALDG") == 3 * tiles, ops
    if "gated" in case:  # silu(gate) * up as x is loaded: exp and reciprocal (MUFU) once per input, a few products more
        assert ops.get("MUFU", 0) >= 2 and 4 * packed_a_thread + 4 <= ops.get("HFMA2") <= 4 * packed_a_thread + 8, ops
    elif "normed add" in case:  # no 1 / rms here: the reader applies it
        assert "MUFU" not in ops and 4 * packed_a_thread + 4 <= ops.get("HFMA2") <= 4 * packed_a_thread + 8, ops
    elif "normed" in case:  # the norm's 1 / rms where y is written (a square root and reciprocals, in the one-split
        assert 1 <= ops.get("MUFU", 0) <= 6, ops  # path and in the fix-up), a few moves more
        assert 4 * packed_a_thread + 4 <= ops.get("HFMA2") <= 4 * packed_a_thread + 8, ops
    else:
        moves = 4 if "add" in case else 0  # (the residual's add: ptxas may build a constant with an HFMA2)
        assert 4 * packed_a_thread + 4 <= ops.get("HFMA2") <= 4 * packed_a_thread + 4 + moves, ops  # + x's pairs, once
        assert "MUFU" not in ops, ops
    assert kernel["memory_opcodes"].get("LDS.64") == packed_a_thread // 2, kernel["memory_opcodes"]  # 2 columns a row
    groups = tiles * wh.TILE_ROWS * 8 // int(case.split()[1])
    # A zero point a column and group, no weight (and the normed row's width for its mean square, in both paths, or
    # once where the reader applies its 1 / rms).
    assert ops.get("I2F", 0) + ops.get("I2FP", 0) <= 2 * groups + 2 * ("normed" in case) + ("scaled" in case), ops
    assert not any(op.startswith(("LDL", "STL")) for op in kernel["memory_opcodes"]), kernel["memory_opcodes"]
    if "add" in case:  # y added to the stream where each program holds its part: reductions, no fix-up's atomic
        assert ops.get("REDG") == 2 and "ATOMG" not in ops, ops  # (a thread's two columns)
    else:  # the fix-up's arrival counter
        assert ops.get("ATOMG") == 1 and "REDG" not in ops, ops


def test_runs_of_two_rows_halve_the_conversions_to_fp32(compiled):
    """RUN = 2: two packed rows share a 16-bit sum, so a thread's 64 int32s a program make 32 conversions to fp32 (an
    FADD of the halves) and 32 fewer fp32 additions than at RUN = 1: 64 FADDs fewer."""
    from minillm.kernels.hopper import w4_gemv_split_k as wh
    assert wh.RUN == 2
    packed_a_thread = 2 * wh.TILE_ROWS * wh.BLOCK_N // (32 * wh.WARPS)
    run1, run2 = compiled["2 128 run 1"]["opcodes"], compiled["2 128"]["opcodes"]
    assert run1["FADD"] - run2["FADD"] >= 0.9 * packed_a_thread, (run1["FADD"], run2["FADD"])
    assert run1["HFMA2"] == run2["HFMA2"]


@pytest.mark.parametrize("case", CASES)
def test_resources_fit_the_programs_an_sm_its_tiles_allow(compiled, case):
    """Six programs an SM at up to two tiles (35 KB of shared memory each), three at four (68 KB): no fold may cost
    one of them in registers."""
    kernel = compiled[case]
    programs = 6 if int(case.split()[0]) <= 2 else 3
    assert kernel["stack"] == 0, kernel
    assert programs * (kernel["shared_bytes"] + 1024) <= SHARED_PER_SM, kernel["shared_bytes"]
    assert 6 * 4 * 32 * -(-kernel["registers"] // 8) * 8 <= 65536, kernel["registers"]  # (allocated 8 at a time)


@pytest.mark.parametrize("form", ["add", "normed add", "gated scaled add"])
def test_late_tiles_are_copied_after_xs_loads(compiled, form):
    """The split-K program's last ``late`` tiles are copied once x's loads (and its tables) are done, the others
    before the wait for the kernel ahead: in the batch-1 decode of llama2-7b, one tile late took rtn-int4 from 648 to
    704 tok/s (figures/h200/sweeps/latency_late_default.json). These forms (o_proj, gate_up_proj, down_proj) load
    nothing from global memory but x, its norm's weight and sums of squares, all before the late copies."""
    for late in (0, 1, 3):
        code = compiled["order"][f"{form} late {late}"]
        copies, loads, wait = code["copies"], code["loads"], code["wait_at"]
        assert code["waits"] == 1 and loads and min(loads) > wait and len(copies) == 12, code
        assert sum(at < wait for at in copies) == 3 * (4 - late), code
        assert all(at > max(loads) for at in copies[3 * (4 - late):]), code
