"""The rule programmatic dependent launch rests on (kernels/hopper/pdl.py), read from the sm_90 machine code that Triton
compiles on this CPU: in both GEMVs launched early, the dense one (also with SiLU-and-multiply on its input) and
W4A16's, the L2 warm-up (CCTL, prefetch.global.L2) comes before the wait for the kernel ahead (ACQBULK,
griddepcontrol.wait) and every global load (LDG) after it, so nothing the kernel ahead writes (x) is read early.
The GPU tests check the outputs; this checks the order, which a GPU run may get right by luck. Compiling needs
Triton's real backend: a subprocess without TRITON_INTERPRET."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

SCRIPT = textwrap.dedent('''
    import json
    from minillm.bench.sass import compile_sm90, pdl_order as order
    from minillm.kernels import gemv, quant_matmul

    w4 = {"X": "*bf16", "Y": "*bf16", "Partials": "*fp32", "Counters": "*i32", "M": "i32", "N": "i32", "K": "i32",
          "stride_xm": "i32", "stride_ym": "i32", "QW": "*i32", "S": "*bf16", "Z": "*i32", "group_size": "i32",
          "one_bits": "i32", "stride_q": "i32", "stride_s": "i32", "stride_z": "i32"}
    aligned = {"X", "Y", "Partials", "Counters", "QW", "S", "Z", "N", "K", "stride_q", "stride_s", "stride_z"}
    result = {}
    for name, body in (("tiles", dict(HFMA2=True, RUN=1, TILES=True)), ("hfma2", dict(HFMA2=True, RUN=2)),
                       ("fp32", {})):
        consts = dict(BLOCK_N=128, BLOCK_KP=8, SPLIT_K=8, PREFETCH=False, HFMA2=False, RUN=2, ONE_GROUP=True,
                      EVEN_N=True, TILES=False, GROUP_TILES=2, PDL=True, PREFETCH_ROWS=4, M=1)
        consts.update(body)
        result["w4_" + name] = order(compile_sm90(quant_matmul._w4_gemv_kernel, w4, consts, aligned, 1, 1))
    dense = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "Partials": "*fp32", "Counters": "*i32", "N": "i32", "K": "i32",
             "stride_wn": "i32"}
    for name, gated in (("dense", False), ("dense_gated", True)):
        result[name] = order(compile_sm90(gemv._gemv_kernel, dense, dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=2, EVEN=True,
                                          PDL=True, PREFETCH_LINES=4, GATED=gated), {"X", "W", "Y", "Partials",
                                          "Counters", "N", "K", "stride_wn"}, 8, 3))
    print(json.dumps(result))
''')


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("pdl"))


@pytest.mark.parametrize("kernel", ["w4_tiles", "w4_hfma2", "w4_fp32", "dense", "dense_gated"])
def test_gemv_warms_l2_then_waits_then_loads(result, kernel):
    code = result[kernel]
    assert code["waits"] == 1 and code["prefetches"] and code["loads"]
    assert max(code["prefetches"]) < code["wait_at"] < min(code["loads"])
