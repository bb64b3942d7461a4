"""The paged attention context on minillm's Triton kernels: the default backend on CUDA.

Same contract and metadata as the torch reference ``PagedBatch`` (``kv/paged.py``), but no Python
loop over sequences and no gathered copy of the context: decode rows go to the split-K paged
decode kernel, prefill chunks to the paged FlashAttention kernel, both reading K/V in place
through the block tables. Its launch grids depend on the batch's shape only, so a decode step
can be captured in a CUDA graph (``minillm/cuda_graphs.py``).
"""

from __future__ import annotations

import torch

from minillm.kernels.flash_attention import paged_prefill_attention
from minillm.kernels.paged_attention import choose_num_splits, paged_decode_attention
from minillm.kv.paged import PagedKVCache, PagedStep, write_kv


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting gains nothing


class TritonPagedBatch:
    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step
        n = step.num_decode
        _, _, _, kv_heads, _ = cache.k.shape
        # Fixed per step from shapes and host lengths (a graph's host lengths are the longest possible).
        self.num_splits = choose_num_splits(n, kv_heads, max(step.context_lens_host[:n]), _num_sms(cache.k.device)) \
            if n else 1
        self.max_prefill_len = max(step.query_lens[n:], default=0)

    def __call__(self, layer_idx: int, q, k, v):
        pool_k, pool_v = write_kv(self.cache, self.step, layer_idx, k, v)
        step, n = self.step, self.step.num_decode
        q = q[0]
        out = torch.empty_like(q)
        if n:
            paged_decode_attention(q[:n], pool_k, pool_v, step.block_tables[:n], step.context_lens[:n],
                                   num_splits=self.num_splits, out=out[:n])
        if n < len(step.query_lens):
            paged_prefill_attention(q[n:], pool_k, pool_v, step.block_tables[n:], step.cu_prefill_lens,
                                    step.context_lens[n:], self.max_prefill_len, out=out[n:])
        return out[None]
