"""The paged attention kernels over an int8 KV cache load their per-token scales by async copy, not by global loads in
the loop, when compiled for sm_90 the way they are at run time: the scale pool's slot stride is the number of KV
heads, 8 in the 32/8-head shape, which Triton does not specialise as 16-aligned. Before ``kv_dequant.per_token_rows``
the H200 ran 16 (decode) and 48 (prefill) two-byte LDGs in these loops, outside the software pipeline
(figures/h200/sweeps/ncu_decode_int8_source.json). Compiled in a subprocess without TRITON_INTERPRET."""

import textwrap

import pytest

from minillm.bench.sass import run_compile_script

SCRIPT = textwrap.dedent('''
    import json
    from minillm.bench.sass import compile_sm90, main_loop, signature
    from minillm.kernels import flash_attention as fa, paged_attention as pa
    from minillm.kernels.kv_dequant import PER_TOKEN

    # 16-aligned at run time: every pointer and stride of the B=64, 32/8-head, D=128, block-16 shapes but the scales'
    # slot stride (8) and the arguments the kernels keep unspecialised; strides of 1 are constants.
    UNALIGNED = {"stride_st", "stride_bt", "stride_table", "stride_os", "stride_lb", "stride_lh", "stride_outb",
                 "stride_outh"}

    def loop_loads(fn, consts, pointers, warps, stages):
        consts = dict(consts, KV_QUANT=PER_TOKEN, QUANT_GROUP=16, SCALE_HEADS=8, stride_sh=1)
        types = {**pointers, "K": "*i8", "V": "*i8", "KScale": "*fp16", "VScale": "*fp16", "qk_scale": "fp32"}
        sig, aligned = signature(fn, types, consts, UNALIGNED)
        ops = main_loop(compile_sm90(fn, sig, consts, aligned, warps, stages))["opcodes"]
        return dict(LDG=ops.get("LDG", 0), LDGSTS=ops.get("LDGSTS", 0))

    decode = loop_loads(pa._split_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, GROUP=4, GROUP_PAD=16,
                                               BLOCK_N=64, MERGE=pa.NO_MERGE, INT8_WORDS=True, NEW_KV=False),
                        {"Q": "*bf16", "BlockTables": "*i32", "ContextLens": "*i32", "O": "*bf16", "Lse": "*bf16",
                         "Out": "*bf16", "Counters": "*i32"}, 2, 4)
    prefill = loop_loads(fa._attention_kernel, dict(HEAD_DIM=128, CAUSAL=True, PAGED=True, PAGE_SIZE=16, BLOCK_M=128,
                                                    BLOCK_N=64, stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1),
                         {"Q": "*bf16", "Out": "*bf16", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32",
                          "context_lens": "*i32", "block_tables": "*i32"}, 8, 3)
    print(json.dumps(dict(decode=decode, prefill=prefill)))
''')


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    return run_compile_script(SCRIPT, tmp_path_factory.mktemp("scale_sass"))


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_int8_scales_come_by_async_copy_not_by_loads_in_the_loop(loads, kernel):
    assert loads[kernel]["LDG"] == 0, loads
    assert loads[kernel]["LDGSTS"] > 0, loads  # the loop's K/V (and scale) copies are there
