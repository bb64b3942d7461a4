"""The Hopper prefill kernel (kernels/hopper/flash_attention.py) compiled for sm_90 on the CPU: its wgmma loops are
pipelined (not one wait per product, ptxas's fallback when registers run short), and the register operand it keeps
across a loop's trips, Q, is not overwritten inside the loop. The second property is what threading Q through
``warpgroup_mma_wait``'s deps buys: with Triton 3.6's toolchain (the H200's) the kernel without it reused Q's
registers for P at head_dim 64 and was wrong (figures/h200/sweeps/prefill_gluon/README.md, run 15). The CPU's Triton
(3.9) compiles the safe form even without the deps, so here the test guards the kernel as this toolchain builds it
(on the H200 it runs against 3.6's); the checker itself is shown to catch the 3.6 pattern, on an abridged listing.
The kernel is compiled in a subprocess without TRITON_INTERPRET."""

import textwrap

import pytest

from minillm.bench.sass import parse_sass, run_compile_script, wgmma_loops

pytest.importorskip("triton.experimental.gluon")

SCRIPT = textwrap.dedent('''
    import json
    from triton.experimental.gluon import language as gl
    from minillm.bench.sass import compile_gluon_sm90, wgmma_loops
    from minillm.kernels.hopper import flash_attention as fh

    def loops(head_dim, causal):
        layout = lambda rows: repr(gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16))
        desc = lambda rows: f"tensordesc<bf16[{rows},{head_dim}],{layout(rows)}>"
        types = {"q_desc": desc(fh.PART_M), "k_desc": desc(fh.BLOCK_N), "v_desc": desc(fh.BLOCK_N), "Out": "*bf16",
                 "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32"}
        consts = dict(HEAD_DIM=head_dim, CAUSAL=causal)
        fn = fh._hopper_attention_kernel
        signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
        return wgmma_loops(compile_gluon_sm90(fn, signature, consts, num_warps=4))

    print(json.dumps({f"{d} {c}": loops(d, c) for d in (64, 128) for c in (True, False)}))
''')


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("hopper_sass"))


@pytest.mark.parametrize("case", ["128 True", "128 False", "64 True", "64 False"])
def test_wgmma_loops_are_pipelined_and_keep_q(compiled, case):
    loops = compiled[case]
    assert len(loops) == 3, loops  # one inner loop per consumer warpgroup
    for loop in loops:
        products = (int(case.split()[0]) + 64) // 16  # QK: head_dim / 16 products; PV: 64 keys / 16
        assert loop["hgmma"] == products and loop["waits"] == 2, loop  # one wait per matrix product, not per wgmma
        assert loop["clobbers"] == [], loop


# The consumer loop's shape as Triton 3.6 compiled it without Q in the waits' deps (head_dim 64, abridged to the
# instructions that matter): Q sits in R88..R95 across trips, and the softmax and P reuse those registers.
WITHOUT_DEPS = """
        /*0d90*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0e60*/                   WARPGROUP.ARRIVE ;
        /*0ed0*/                   HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR8], RZ, !UPT ;
        /*0f10*/                   HGMMA.64x64x16.F32.BF16 R24, R92, gdesc[UR8], R24, gsb0 ;
        /*0f50*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0f70*/                   LEA R88, R3, UR6, 0x1 ;
        /*1d30*/                   F2FP.BF16.F32.PACK_AB R92, R25, R88 ;
        /*23d0*/                   WARPGROUP.ARRIVE ;
        /*2420*/                   HGMMA.64x64x16.F32.BF16 R56, R92, gdesc[UR8].tnspB, R56, gsb0 ;
        /*24e0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*25a0*/               @P1 BRA 0xd90 ;
"""
# With the deps: Q stays in R108..R115 and is copied into the operand registers before each product.
WITH_DEPS = WITHOUT_DEPS.replace("""        /*0e60*/                   WARPGROUP.ARRIVE ;""", """        /*0e40*/                   IMAD.MOV.U32 R88, RZ, RZ, R108 ;
        /*0e44*/                   MOV R89, R109 ;
        /*0e48*/                   MOV R90, R110 ;
        /*0e4c*/                   MOV R91, R111 ;
        /*0e50*/                   MOV R92, R112 ;
        /*0e54*/                   MOV R93, R113 ;
        /*0e58*/                   MOV R94, R114 ;
        /*0e5c*/                   MOV R95, R115 ;
        /*0e60*/                   WARPGROUP.ARRIVE ;""")


def test_the_clobber_check_finds_q_overwritten():
    """The checker, not the compiler: on the hand-abridged listings above."""
    (loop,) = wgmma_loops(parse_sass(WITHOUT_DEPS))
    assert loop["hgmma"] == 3 and loop["waits"] == 2
    assert loop["clobbers"] == [[88], [92]]  # LEA writes R88, P's pack R92; the PV operand (written first) is fine
    assert wgmma_loops(parse_sass(WITH_DEPS))[0]["clobbers"] == []
