"""minillm.bench.sass: kernels compiled for sm_90 on this CPU, and their loops read back from the SASS.
Compiling needs Triton's real backend, so this runs in a subprocess without TRITON_INTERPRET (tests/conftest.py
sets it for the kernel tests)."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

SCRIPT = textwrap.dedent('''
    import json, sys
    import triton, triton.language as tl
    from minillm.bench.sass import compile_sm90, inner_loops, main_loop

    @triton.jit
    def axpy_loop(X, Y, n, a, STEPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, n, BLOCK):  # the loop: one load and one FMA per element and step
            acc = a * tl.load(X + i + offs) + acc
        tl.store(Y + offs, acc)

    @triton.jit
    def no_loop(X, Y, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs) * 2.0)

    @triton.jit
    def two_tma_loops(X, Y, n, BLOCK: tl.constexpr):
        desc = tl.make_tensor_descriptor(X, shape=[n, 64], strides=[64, 1], block_shape=[BLOCK, 64])
        acc = tl.zeros((BLOCK, 64), tl.float32)
        for i in range(0, n, BLOCK):  # first loop: adds
            acc += desc.load([i, 0])
        for i in range(0, n, BLOCK):  # second loop: multiplies
            acc *= desc.load([i, 0])
        offs = tl.arange(0, BLOCK)[:, None] * 64 + tl.arange(0, 64)[None, :]
        tl.store(Y + offs, acc)

    sig = {"X": "*fp32", "Y": "*fp32", "n": "i32", "a": "fp32"}
    tma = compile_sm90(two_tma_loops, {"X": "*fp32", "Y": "*fp32", "n": "i32"}, dict(BLOCK=64), {"X", "Y", "n"}, 4, 3)
    tma_loops = [dict(opcodes=dict(lp["opcodes"]), n=lp["loop_instructions"]) for lp in inner_loops(tma)]
    longest = dict(main_loop(tma)["opcodes"])
    loop = main_loop(compile_sm90(axpy_loop, sig, dict(STEPS=1, BLOCK=1024), {"X", "Y", "n"}, 4, 1))
    try:
        main_loop(compile_sm90(no_loop, {"X": "*fp32", "Y": "*fp32"}, dict(BLOCK=128), {"X", "Y"}, 4, 1))
        refused = None
    except ValueError as e:
        refused = str(e)
    print(json.dumps(dict(loop, opcodes=dict(loop["opcodes"]), refused=refused, tma_loops=tma_loops,
                          tma_longest=longest)))
''')


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("sass"))


def test_main_loop_holds_the_loops_fmas_and_loads(result):
    # 1024 elements over 128 threads: 8 FFMAs per thread and step, times however often ptxas unrolls the loop.
    ops = result["opcodes"]
    assert ops.get("FFMA", 0) > 0 and ops["FFMA"] % 8 == 0, ops
    assert any(op.startswith("LDG") for op in ops), ops
    assert "STG" not in ops, "the store after the loop was counted as part of it"
    assert result["loop_instructions"] == sum(ops.values()) < result["total_instructions"]
    assert result["registers"] > 0 and result["stack"] == 0


def test_a_kernel_without_a_loop_is_refused(result):
    assert result["refused"] and "no backward branch" in result["refused"]


def test_inner_loops_finds_each_loop_of_a_tma_kernel(result):
    """Two TMA loops: each is one inner loop with its own arithmetic and TMA loads, and neither holds the
    store; the longest backward branch (an mbarrier wait's retry jumping back from the kernel's end)
    spans both loops and the store, which is why ``inner_loops`` exists."""
    loops = result["tma_loops"]
    assert len(loops) == 2, loops
    (first, second) = (loop["opcodes"] for loop in loops)
    assert first.get("FADD", 0) > 0 and "FMUL" not in first, first
    assert second.get("FMUL", 0) > 0 and "FADD" not in second, second
    assert all(loop.get("UTMALDG", 0) > 0 and "STG" not in loop for loop in (first, second))
    longest = result["tma_longest"]  # both loops and the store after them
    assert longest.get("FADD") and longest.get("FMUL") and longest.get("STG"), longest
