"""The naive KV cache: one contiguous slab of ``max_model_len`` tokens reserved per sequence.

This is how a first deployment (and transformers' static cache) stores K and V: simple indexing,
but every sequence pays for the longest possible one, so most of the memory holds nothing — the
waste PagedAttention removes (tuning path step 1). Batches are left-padded so that all rows write
their next token into the same column.
"""

from __future__ import annotations

import torch

from minillm.attention import masked_attention
from minillm.model.config import ModelConfig


class ContiguousKVCache:
    """K and V for ``max_batch`` sequences of ``max_len`` tokens: [layers, batch, len, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, max_batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (config.num_layers, max_batch, max_len, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_batch, self.max_len = max_batch, max_len

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
        # Additive form, made once per step: SDPA would otherwise convert a bool mask in every layer.
        self.mask = torch.zeros(allowed.shape, dtype=cache.k.dtype, device=allowed.device)
        self.mask.masked_fill_(~allowed, float("-inf"))

    def __call__(self, layer_idx: int, q, k, v):
        keys = self.cache.k[layer_idx, : self.batch]
        values = self.cache.v[layer_idx, : self.batch]
        keys[:, self.start : self.end] = k
        values[:, self.start : self.end] = v
        return masked_attention(q, keys[:, : self.end], values[:, : self.end], self.mask)


def workspace_bytes(weight_bytes: int) -> int:
    """Memory kept back for activations, logits and the allocator's slack: a rule of thumb (a tenth
    of the weights, at least 256 MiB), not a measurement."""
    return max(256 * 2**20, weight_bytes // 10)


def sequences_that_fit(budget: int | None, weight_bytes: int, bytes_per_sequence: int, max_num_seqs: int) -> int:
    """How many max_model_len-long sequences a contiguous cache can reserve inside ``budget``."""
    if budget is None:
        return max_num_seqs
    kv_budget = budget - weight_bytes - workspace_bytes(weight_bytes)
    fit = kv_budget // bytes_per_sequence
    if fit < 1:
        raise ValueError(
            f"memory budget of {budget:,} bytes ({budget / 1e9:.2f} GB) leaves {max(kv_budget, 0) / 1e9:.2f} GB for the KV cache "
            f"after {weight_bytes / 1e9:.2f} GB of weights and {workspace_bytes(weight_bytes) / 1e9:.2f} GB of "
            f"workspace, but one sequence of max_model_len needs {bytes_per_sequence / 1e9:.3f} GB; "
            f"raise the budget or lower max_model_len"
        )
    return min(max_num_seqs, fit)
