"""Can a ring of TMA copies feed paged INT8 decode at the copy bandwidth? (issue 6: the INT8-KV decode kernel should
keep the bf16 kernel's utilisation, 102 %, where it reaches 54 %.)

A skeleton, not attention. One program per (sequence, group of HB KV heads): a producer warp copies every page of
the sequence's K and V for its heads into a ring of STAGES shared-memory slots, with TMA, one [16, 128 * HB] box per
page and tensor on the int8 pool seen as [blocks * 16, Hkv * 128]; a consumer warpgroup only waits for each slot
and releases it. The block ids come 32 at a time, in one vector load. If this cannot read the benchmark's pools
(B=64, 2048 tokens, 8 KV heads, D=128, 16-token pages) near the copy bandwidth, no kernel built on it can; if it
can, the next step is the attention math in its consumers (session 16's design memo, in its closing note).

Same process: the copy bandwidth, and the paged decode kernel as it is on the bf16 and the int8 pools.
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/decode_tma_skeleton.py``.
"""
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import decode_problem, quantized_pools, save_result  # noqa: E402

from minillm.bench.kernels import time_ms  # noqa: E402
from minillm.bench.roofline import measure_bandwidth  # noqa: E402
from minillm.kernels.flash_attention_hopper import tma_load  # noqa: E402  (the name differs across Triton versions)
from minillm.kernels.paged_attention import paged_decode_attention  # noqa: E402
from minillm.kernels.paged_decode_hopper import kv_ring  # noqa: E402  (the kernel's ring, the same instructions)
PAGE = 16
ID_CHUNK = gl.constexpr(32)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, full, empty, tables, stride_t, n_pages, STAGES: gl.constexpr,
              HB: gl.constexpr, HEAD_DIM: gl.constexpr):
    b = gl.program_id(0)
    col = gl.program_id(1) * HB * HEAD_DIM
    lanes = gl.arange(0, ID_CHUNK, layout=gl.BlockedLayout([1], [32], [1], [0]))
    for first in range(0, n_pages, ID_CHUNK):
        ids = gl.load(tables + b * stride_t + first + lanes, mask=first + lanes < n_pages, other=0)
        for jj in gl.static_range(ID_CHUNK):
            j = first + jj
            if j < n_pages:
                page = gl.sum(gl.where(lanes == jj, ids, 0), axis=0)
                slot = j % STAGES
                mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(slot), 2 * k_desc.block_type.nbytes)
                tma_load(k_desc, [page * 16, col], full.index(slot), k_smem.index(slot))
                tma_load(v_desc, [page * 16, col], full.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer(full, empty, n_pages, STAGES: gl.constexpr):
    for j in range(n_pages):
        slot = j % STAGES
        mbarrier.wait(full.index(slot), (j // STAGES) & 1)
        mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def skeleton_kernel(k_desc, v_desc, tables, stride_t, context_lens, STAGES: gl.constexpr, HB: gl.constexpr,
                    HEAD_DIM: gl.constexpr):
    n_pages = gl.cdiv(gl.load(context_lens + gl.program_id(0)), 16)
    k_smem, v_smem, full, empty = kv_ring(k_desc, v_desc, [STAGES, 16, HB * HEAD_DIM])
    gl.warp_specialize([
        (_consumer, (full, empty, n_pages, STAGES)),
        (_producer, (k_desc, v_desc, k_smem, v_smem, full, empty, tables, stride_t, n_pages, STAGES, HB, HEAD_DIM)),
    ], [1], [40])


def descriptor(pool: torch.Tensor, heads: int) -> TensorDescriptor:
    """The pool [blocks, 16, Hkv, D] int8 seen as [blocks * 16, Hkv * D], loaded [16, heads * D] at a time."""
    blocks, page, kv_heads, dim = pool.shape
    box = [page, heads * dim]
    return TensorDescriptor(pool, [blocks * page, kv_heads * dim], [kv_heads * dim, 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, gl.int8))


def main():
    dev = torch.device("cuda")
    B, S, H, Hkv, D = 64, 2048, 32, 8, 128
    q, k_pool, v_pool, tables, lens = decode_problem(B, S, H, Hkv, D, PAGE, dev, torch.bfloat16)
    kq, vq, scales = quantized_pools(k_pool, v_pool, "int8")
    codes = 2 * B * S * Hkv * D
    bandwidth = measure_bandwidth(dev)
    runs = {"copy_bandwidth_gbs": bandwidth, "int8_code_bytes": codes}
    out = torch.empty_like(q)
    for name, call, nbytes in (
            ("decode kernel, bf16 pools", lambda: paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out),
             2 * codes),
            ("decode kernel, int8 pools", lambda: paged_decode_attention(q, kq, vq, tables, lens, out=out, **scales),
             codes)):
        ms = time_ms(call, dev)
        runs[name] = dict(us=ms * 1e3, gbs=nbytes / ms / 1e6, fraction_of_bandwidth=nbytes / ms / 1e6 / bandwidth)
        print(name, runs[name], flush=True)
    for hb in (1, 2):
        k_desc, v_desc = descriptor(kq, hb), descriptor(vq, hb)
        for stages in (4, 8, 12):
            name = f"TMA skeleton, {hb} head(s) a program, {stages} stages"
            grid = (B, Hkv // hb)
            call = lambda: skeleton_kernel[grid](k_desc, v_desc, tables, tables.stride(0), lens, STAGES=stages,  # noqa
                                                 HB=hb, HEAD_DIM=D, num_warps=4)
            try:
                ms = time_ms(call, dev)
                runs[name] = dict(us=ms * 1e3, gbs=codes / ms / 1e6, fraction_of_bandwidth=codes / ms / 1e6 / bandwidth)
            except Exception as e:  # noqa: BLE001 (a launch that does not fit is a result)
                runs[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
            print(name, runs[name], flush=True)
    save_result(os.environ.get("OUT", "/tmp/out"), "decode_tma_skeleton", "paged int8 K/V read through a TMA ring",
                "int8 code bytes only (the scales' 4 MB are not copied by the skeleton); fraction of the copy bandwidth "
                "measured in the same process", runs)


if __name__ == "__main__":
    main()
