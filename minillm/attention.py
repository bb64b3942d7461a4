"""Attention math shared by every KV-cache layout, in plain torch (the reference backend).

The model hands q/k/v of the new tokens to an attention context; the context (see ``kv/``) stores
K/V and calls ``masked_attention`` here over everything the new tokens may see. Faster backends
(the Triton kernels) implement the same contract and are checked against this file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Not cuDNN: its SDPA builds an execution plan for every new sequence length, which cost 1.4 ms of
# CPU per call on the H200 (torch 2.11, measured with minillm.bench.profile) — in every layer of
# every decode step, since the key length grows by one each step. Flash / memory-efficient kernels
# have no such cost; on CPU this list changes nothing.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool "may attend" -> 0 / -inf in ``dtype``. Built once per step and shared by every layer:
    SDPA would otherwise convert a bool mask in each of them."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    q: [B, T, H, D]; k, v: [B, S, Hkv, D] with H a multiple of Hkv; mask: additive [B, 1, T, S]
    (0 = may attend, -inf = may not) or None for plain causal attention with T == S.
    Returns [B, T, H, D].
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(SDPA_BACKENDS):
        # GQA: each group of H/Hkv query heads reads the same K/V head, without copying K/V.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


class CausalAttention:
    """No cache at all: every call sees the whole sequence. Used to score text (perplexity,
    logit checks against transformers) with one forward pass."""

    def __call__(self, layer_idx: int, q, k, v):
        return masked_attention(q, k, v, None)
