"""The paged attention context on minillm's Triton kernels: the default backend on CUDA.

Same contract and metadata as the torch reference ``PagedBatch`` (``kv/paged.py``), but no Python
loop over sequences and no gathered copy of the context; new K/V are stored by one kernel (which also applies
RoPE to q and k, for an unquantized cache; in a decode-only step the decode kernel does that itself, one kernel
a layer for all of attention but the merge); decode rows go to the split-K paged
decode kernel, prefill chunks to the paged FlashAttention kernel, both reading K/V in place
through the block tables. Its launch grids depend on the batch's shape only, so a decode step
can be captured in a CUDA graph (``minillm/cuda_graphs.py``).
"""

from __future__ import annotations

import torch

from minillm.kernels.flash_attention import paged_prefill_attention
from minillm.kernels.kv_store import QUANTIZED_POOLS, rope_store_kv, store_kv
from minillm.kernels.paged_attention import paged_decode_attention
from minillm.kernels.fused_layer_ops import Rms
from minillm.kv.paged import PagedKVCache, PagedStep, write_kv


class TritonPagedBatch:
    rope_in_decode_kernel = True  # False: a decode-only step stores K/V with rope_store_kv, then attends (two kernels)

    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step
        self.max_prefill_len = max(step.query_lens[step.num_decode:], default=0)
        # An unquantized cache takes q and k unrotated: RoPE and the K/V store are one kernel (rope_store_kv).
        self.takes_rope = cache.k_scale is None
        # A decode-only step where the decode kernel applies RoPE and stores the new k and v itself (its q tile
        # needs head_dim >= 16; kernels/rope_in_decode.py), and so can apply qkv_proj's pending 1 / rms too.
        self.rope_in_decode = (self.takes_rope and self.rope_in_decode_kernel
                               and step.num_decode == len(step.query_lens) and cache.k.shape[-1] >= 16)
        self.takes_pending_norm = self.rope_in_decode and step.num_decode == 1

    def __call__(self, layer_idx: int, q, k, v, rope=None, pending=None):
        """``pending`` (only where ``takes_pending_norm``; with ``rope``): a ``norm_folding.PendingNorm`` whose fp32
        row q, k and v are views of, its 1 / rms applied by the decode kernel."""
        pools = self.cache.layer(layer_idx)
        step, n = self.step, self.step.num_decode
        new_kv, rms = None, None
        if pending is not None and (rope is None or not self.takes_pending_norm):
            raise ValueError("a pending norm's 1 / rms is applied by the decode kernel, with RoPE, in a one-row "
                             "decode step (takes_pending_norm); this step or call is not one")
        if rope is not None and self.rope_in_decode:
            new_kv = (k[0], v[0], *rope, step.slot_mapping)
            if pending is not None:
                rms = Rms(pending.slot.squares, pending.width, pending.norm.eps)
        elif rope is not None:  # (only when takes_rope): rotate q and k in place, store the rotated k and v
            rope_store_kv(q[0], k[0], v[0], *rope, pools.k, pools.v, self.step.slot_mapping)
        elif pools.k_scale is None or pools.k.dtype in QUANTIZED_POOLS:  # one kernel for K and V (and int8's scales)
            store_kv(k[0], v[0], pools.k, pools.v, self.step.slot_mapping, pools.k_scale, pools.v_scale)
        else:  # fp8 and int4: quantized on the way in by torch ops (write_kv)
            write_kv(self.cache, self.step, layer_idx, k, v)
        scales = dict(k_scale=pools.k_scale, v_scale=pools.v_scale)  # None unless the cache is quantized
        q = q[0]
        out = torch.empty_like(q, dtype=self.cache.dtype if rms is not None else q.dtype)
        if n:
            # Split count from the table's width (a graph's tables are as wide as max_model_len),
            # never from the lengths in it: the launch grid must not change under a CUDA graph.
            paged_decode_attention(q[:n], pools.k, pools.v, step.block_tables[:n], step.context_lens[:n],
                                   out=out[:n], new_kv=new_kv, rms=rms, **scales)
        if n < len(step.query_lens):
            paged_prefill_attention(q[n:], pools.k, pools.v, step.block_tables[n:], step.cu_prefill_lens,
                                    step.context_lens[n:], self.max_prefill_len, out=out[n:], **scales)
        return out[None]
