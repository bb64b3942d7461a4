"""The naive KV cache: one contiguous slab of ``max_model_len`` tokens reserved per sequence.

This is how a first deployment (and transformers' static cache) stores K and V: simple indexing,
but every sequence pays for the longest possible one, so most of the memory holds nothing — the
waste PagedAttention removes (tuning path step 1). Batches are left-padded so that all rows write
their next token into the same column.
"""

from __future__ import annotations

import torch

from minillm.attention import additive_mask, masked_attention
from minillm.model.config import ModelConfig


class ContiguousKVCache:
    """K and V for ``max_batch`` sequences of ``max_len`` tokens: [layers, batch, len, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, max_batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (config.num_layers, max_batch, max_len, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: masked-out slots (padding, the tail of a block) are still read, and
        # their softmax weight of 0 times a NaN left in uninitialised memory would be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class LeftPaddedBatch:
    """Attention context for one step of a left-padded static batch.

    ``key_valid[b, s]`` says whether column s of row b holds a real token (False for padding).
    The step writes ``T`` new tokens into columns [start, start + T) of every row, and each new
    token attends to the valid columns at or before its own.
    """

    def __init__(self, cache: ContiguousKVCache, key_valid: torch.Tensor, start: int, num_new: int):
        batch = key_valid.shape[0]
        end = start + num_new
        self.cache, self.batch, self.start, self.end = cache, batch, start, end
        cols = torch.arange(end, device=key_valid.device)
        query_cols = cols[start:end, None]
        causal = cols[None, :] <= query_cols
        # A padding query sees only itself: its output is ignored, but a row with every key masked
        # would give NaN, and 0 * NaN in later layers would leak into real rows.
        self_only = cols[None, :] == query_cols
        allowed = (key_valid[:, None, None, :end] & causal) | self_only  # [B, 1, T, S]
        self.mask = additive_mask(allowed, cache.k.dtype)

    def __call__(self, layer_idx: int, q, k, v):
        keys = self.cache.k[layer_idx, : self.batch]
        values = self.cache.v[layer_idx, : self.batch]
        keys[:, self.start : self.end] = k
        values[:, self.start : self.end] = v
        return masked_attention(q, keys[:, : self.end], values[:, : self.end], self.mask)

