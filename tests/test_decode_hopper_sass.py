"""The Gluon INT8 decode kernel (kernels/hopper/paged_decode.py) compiled for sm_90 on the CPU: what makes it keep up
with HBM is visible in its loops, so they are checked here (Gluon has no interpreter; the numbers are tested on an
H200, tests/kernels/test_hopper_paged_decode.py).

The consumer loop: every product is an mma.sync (HMMA) of the expected count; K's codes and V's pairs come from the
ring by ldmatrix straight into the products' operand layouts (no store back to shared memory: V is not converted
through a scratch tile); codes become fp16 by PRMT, never I2F; no spills at the launch's
register limit; at most two barriers a step (the slot's release, and the one the compiler puts before the wait). The
producer loop issues two TMA copies a page and computes nothing else. Compiled in a subprocess without
TRITON_INTERPRET."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = textwrap.dedent('''
    import json
    from triton.experimental.gluon import language as gl
    from minillm.bench.sass import compile_gluon_sm90, inner_loops
    from minillm.kernels.hopper import paged_decode as ph

    def loops(head_dim, group, split):
        box = [ph.PAGE, ph.HEADS_PER_PROGRAM, head_dim]
        layout = gl.NVMMASharedLayout.get_default_for(box, gl.int8)
        desc = f"tensordesc<i8[{ph.PAGE},{ph.HEADS_PER_PROGRAM},{head_dim}],{layout!r}>"
        types = {"Q": "*bf16", "k_desc": desc, "v_desc": desc, "KScale": "*fp16", "VScale": "*fp16",
                 "O": "*fp32" if split else "*bf16", "Lse": "*fp32", "block_tables": "*i32", "context_lens": "*i32",
                 "qk_scale": "fp32"}
        consts = dict(GROUP=group, NCOL=ph.columns(group), HEAD_DIM=head_dim, WRITE_LSE=split, STAGES=ph.STAGES,
                      SLOT_PAGES=ph.SLOT_PAGES)
        fn = ph._int8_decode_kernel
        signature = {name: types.get(name, "i32") for name in fn.arg_names if name not in consts}
        kernel = compile_gluon_sm90(fn, signature, consts, num_warps=ph.CONSUMER_WARPS, maxnreg=ph.MAX_REGISTERS)
        return [dict(loop, opcodes=dict(loop["opcodes"])) for loop in inner_loops(kernel)]

    print(json.dumps({f"{d} {g} {s}": loops(d, g, s) for d, g, s in ((128, 4, False), (64, 8, True), (128, 1, False))}))
''')
CASES = ["128 4 False", "64 8 True", "128 1 False"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("decode_hopper_sass"))


def _split(loops):
    consumer = [loop for loop in loops if loop["opcodes"].get("HMMA")]
    producer = [loop for loop in loops if loop["opcodes"].get("UTMALDG")]
    assert len(consumer) == 1 and len(producer) == 1, loops
    return consumer[0], producer[0]


@pytest.mark.parametrize("case", CASES)
def test_consumer_loop_products_come_straight_from_the_ring(compiled, case):
    from minillm.kernels.hopper import paged_decode as ph
    head_dim, group = map(int, case.split()[:2])
    consumer, _ = _split(compiled[case])
    ops = consumer["opcodes"]
    rows = 2 * ph.PAGE  # a warp's rows a step: one page, both heads
    n_tiles = ph.columns(group) // 8
    scores = rows // 16 * head_dim // 16 * n_tiles  # m16n8k16 over the page's rows x head_dim
    values = 2 * (head_dim // 2 // 16) * (rows // 16) * n_tiles  # even and odd channels, the rows as the reduction
    assert ops.get("HMMA") == scores + values, ops
    assert ops.get("LDSM") == 2 * rows * head_dim // 512, ops  # K and V, 512 bytes a warp's ldmatrix.x4
    assert "STS" not in ops and "I2F" not in ops and "LDS" not in ops, ops
    assert ops.get("BAR", 0) <= 2, ops
    assert consumer["stack"] == 0, consumer


@pytest.mark.parametrize("case", CASES)
def test_producer_loop_only_issues_copies(compiled, case):
    from minillm.kernels.hopper import paged_decode as ph
    _, producer = _split(compiled[case])
    ops = producer["opcodes"]
    assert ops.get("UTMALDG") == 2 * ph.ID_CHUNK, ops  # K and V of each of a chunk's pages
    assert not any(op in ops for op in ("HMMA", "LDSM", "BAR", "PRMT")), ops
