"""FlashAttention kernels against their plain-torch references, and the references against SDPA.

On CPU these run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes
are small; on a GPU the same tests add larger shapes and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels.flash_attention import (
    flash_attention,
    flash_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 runs through exact (ieee) dots; 16-bit ones round P to the input dtype before P @ V.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def randn(shape, dtype, generator):
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def nans_like(t):
    """Poisoned output: any row the kernel fails to write stays NaN and fails the comparison."""
    return torch.full_like(t, float("nan"))


def assert_close(actual, expected):
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_varlen(q_lens, k_lens, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = randn((sum(q_lens), heads, head_dim), dtype, g)
    k = randn((sum(k_lens), kv_heads, head_dim), dtype, g)
    v = randn((sum(k_lens), kv_heads, head_dim), dtype, g)
    return q, k, v, cu(q_lens), cu(k_lens)


def make_paged(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Contiguous K/V of each context scattered into a NaN-filled pool through shuffled block tables
    whose padding holds real (other sequences' or NaN) block ids: reading anything a sequence does
    not own poisons its output."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu_q, cu_k = make_varlen(q_lens, ctx_lens, heads, kv_heads, head_dim, dtype, seed)
    pages = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(pages) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.randint(0, num_blocks, (len(ctx_lens), max(pages) + 1), generator=g, dtype=torch.int32)
    for b, n in enumerate(ctx_lens):
        mine, ids = ids[: pages[b]], ids[pages[b]:]
        tables[b, : pages[b]] = torch.tensor(mine, dtype=torch.int32)
        pos = torch.arange(n)
        slots = (torch.tensor(mine)[pos // block_size], pos % block_size)
        k_cache[slots] = k[cu_k[b]: cu_k[b + 1]]
        v_cache[slots] = v[cu_k[b]: cu_k[b + 1]]
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, k_cache, v_cache, tables.to(DEVICE), cu_q, cu_k, ctx


def sdpa_one(q, k, v, causal):
    """Independent check of one sequence: SDPA with an explicit bottom-right causal mask."""
    q_len, k_len = q.shape[0], k.shape[0]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len) if causal else None
    q, k, v = (t.float().transpose(0, 1).cpu() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def test_references_match_sdpa():
    q_lens, k_lens = [3, 9, 1], [11, 9, 6]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, 4, 2, 16, torch.float32, seed=1)
    for causal in (True, False):
        ref = flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
        for b in range(len(q_lens)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            torch.testing.assert_close(ref[qs].cpu(), sdpa_one(q[qs], k[ks], v[ks], causal), atol=1e-5, rtol=1e-5)
    # The paged reference must find the same keys through shuffled tables.
    q, k, v, k_cache, v_cache, tables, cu_q, cu_k, ctx = make_paged(q_lens, k_lens, 4, 2, 16, 4, torch.float32, 2)
    torch.testing.assert_close(paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu_q, ctx),
                               flash_attention_ref(q, k, v, cu_q, cu_k), atol=0, rtol=0)


VARLEN_CASES = [
    # q_lens, k_lens, heads, kv_heads, head_dim, causal, dtype, config
    ([1, 7, 33], [1, 7, 33], 2, 2, 32, True, torch.float32, None),
    ([5, 17, 1], [20, 17, 9], 4, 2, 16, True, torch.float16, None),  # bottom-right causal, q_len < k_len
    ([7, 33], [12, 5], 4, 1, 64, False, torch.float32, None),  # GQA 4, k_len < q_len is fine unmasked
    ([19, 2], [40, 35], 2, 1, 128, True, torch.float16, None),
    ([33, 6], [50, 6], 4, 2, 16, True, torch.float32, {"BLOCK_M": 32, "BLOCK_N": 16}),  # BLOCK_M > BLOCK_N
    ([21, 3], [37, 3], 2, 2, 32, True, torch.float32, {"BLOCK_M": 16, "BLOCK_N": 32}),  # BLOCK_M < BLOCK_N
]
if CUDA:
    VARLEN_CASES += [
        ([1000, 1, 77, 513], [1000, 300, 1077, 600], 8, 2, 128, True, torch.bfloat16, None),
        ([257, 1024], [257, 1500], 4, 4, 64, False, torch.float16, None),
        ([130, 64], [200, 64], 4, 1, 128, True, torch.float32, None),
    ]


@pytest.mark.parametrize("q_lens,k_lens,heads,kv_heads,head_dim,causal,dtype,config", VARLEN_CASES)
def test_flash_attention_matches_ref(q_lens, k_lens, heads, kv_heads, head_dim, causal, dtype, config):
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, heads, kv_heads, head_dim, dtype, seed=len(q_lens) + head_dim)
    scale = 0.3 if head_dim == 64 else None  # an explicit scale once
    out = flash_attention(q, k, v, cu_q, cu_k, max(q_lens), causal=causal, scale=scale, out=nans_like(q), config=config)
    assert out.dtype == dtype
    assert_close(out, flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 / 0, on purpose
def test_a_query_without_keys_is_nan_in_kernel_and_reference():
    """A sequence with no keys at all (and, causally, rows before the first key): NaN on both sides, never a
    silent 0 on one of them."""
    q, k, v, cu_q, cu_k = make_varlen([3, 5, 4], [0, 6, 2], 2, 1, 16, torch.float32, seed=4)
    for causal in (False, True):
        out = flash_attention(q, k, v, cu_q, cu_k, 5, causal=causal, out=nans_like(q).zero_())
        ref = flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
        assert ref[:3].isnan().all() and ref[3:8].isfinite().all()
        assert ref[8:10].isnan().all() == causal  # 4 queries over 2 keys: the first two see none
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, equal_nan=True)


PAGED_CASES = [
    # q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype
    ([1, 9, 1, 20], [37, 9, 5, 50], 4, 2, 32, 16, torch.float32),  # decode rows mixed with prefill chunks
    ([33, 1], [40, 64], 2, 2, 16, 8, torch.float16),
    ([7, 16], [7, 70], 4, 1, 64, 32, torch.float32),  # a page larger than BLOCK_N
    ([5, 3], [13, 3], 2, 1, 16, 1, torch.float32),  # one token per page
]
if CUDA:
    PAGED_CASES += [
        ([512, 1, 1, 300], [2000, 17, 1024, 300], 8, 2, 128, 16, torch.bfloat16),
        ([100, 1000], [1100, 1000], 4, 4, 64, 32, torch.float16),
    ]


@pytest.mark.parametrize("q_lens,ctx_lens,heads,kv_heads,head_dim,block_size,dtype", PAGED_CASES)
def test_paged_prefill_matches_ref(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype):
    q, _, _, k_cache, v_cache, tables, cu_q, _, ctx = make_paged(q_lens, ctx_lens, heads, kv_heads, head_dim,
                                                                 block_size, dtype, seed=block_size)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu_q, ctx, max(q_lens), out=nans_like(q))
    assert_close(out, paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu_q, ctx))


def test_paged_with_explicit_config():
    """A tile spanning several pages (BLOCK_N=32 over 8-token pages) and a taller Q tile."""
    q, _, _, k_cache, v_cache, tables, cu_q, _, ctx = make_paged([40, 1], [45, 9], 2, 1, 16, 8, torch.float32, 3)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu_q, ctx, 40, out=nans_like(q),
                                  config={"BLOCK_M": 32, "BLOCK_N": 32})
    assert_close(out, paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu_q, ctx))


def _varlen_inputs(**changes):
    q, k, v, cu_q, cu_k = make_varlen([3, 4], [3, 4], 4, 2, 16, torch.float32, seed=0)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4)
    return {**args, **{name: make(args) for name, make in changes.items()}}


@pytest.mark.parametrize("changes,message", [
    (dict(q=lambda a: a["q"].double()), "torch.float64"),
    (dict(k=lambda a: a["k"].half()), "k.dtype is torch.float16"),
    (dict(q=lambda a: a["q"][:, :3]), "q has 3 heads, k has 2"),
    (dict(k=lambda a: a["k"].repeat(1, 1, 2), v=lambda a: a["v"].repeat(1, 1, 2)), "head_dim is 32 but q's is 16"),
    (dict(q=lambda a: a["q"][..., :12], k=lambda a: a["k"][..., :12], v=lambda a: a["v"][..., :12]), "head_dim is 12"),
    (dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]),
     r"cu_seqlens_q must be a 1-d int32 tensor, got .* shape \(1, 3\)"),
    (dict(cu_seqlens_k=lambda a: a["cu_seqlens_k"].long()), "cu_seqlens_k must be a 1-d int32 tensor, got torch.int64"),
    (dict(cu_seqlens_k=lambda a: a["cu_seqlens_k"][:2]), r"cu_seqlens_k \(2,\)"),
])
def test_flash_attention_errors_name_the_bad_value(changes, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(**_varlen_inputs(**changes))


def test_paged_errors_name_the_bad_value():
    q, _, _, k_cache, v_cache, tables, cu_q, _, ctx = make_paged([2, 1], [5, 3], 2, 1, 16, 4, torch.float32, 0)
    with pytest.raises(ValueError, match=r"block_tables must be a 2-d int32 tensor, got torch.int64"):
        paged_prefill_attention(q, k_cache, v_cache, tables.long(), cu_q, ctx, 2)
    with pytest.raises(ValueError, match="block_size .* is 3"):
        paged_prefill_attention(q, k_cache[:, :3], v_cache[:, :3], tables, cu_q, ctx, 2)
    with pytest.raises(ValueError, match=r"context_lens \(3,\)"):
        paged_prefill_attention(q, k_cache, v_cache, tables, cu_q, torch.cat([ctx, ctx[:1]]), 2)
    with pytest.raises(ValueError, match="v_cache shape"):
        paged_prefill_attention(q, k_cache, v_cache[:, :, :, :8], tables, cu_q, ctx, 2)
