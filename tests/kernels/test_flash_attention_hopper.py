"""The Gluon prefill kernel for Hopper (kernels/flash_attention_hopper.py) against the plain-torch reference, and
when ``flash_attention`` picks it.

Gluon has no interpreter, so the numerical tests need an sm_90 GPU; on the CPU the dispatch and its reasons are
tested, and tests/test_hopper_sass.py checks the compiled loops.
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels import flash_attention_hopper as hopper
from minillm.kernels.flash_attention import flash_attention, flash_attention_ref

from test_flash_attention import assert_close, make_varlen, nan_tailed, nans_like

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hopper.gluon is not None
needs_sm90 = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 GPUs only (no interpreter)")

CASES = [
    # q_lens, k_lens, heads, kv_heads, head_dim, causal, dtype
    ([1000, 1, 77, 513], [1000, 300, 1077, 600], 8, 2, 128, True, torch.bfloat16),  # cached prefixes, GQA 4
    ([100, 257, 1000, 1], [100, 257, 1000, 1], 8, 2, 64, True, torch.bfloat16),  # tiles aligned to the end
    ([2048, 191, 193], [2048, 191, 193], 4, 4, 128, True, torch.float16),  # around one 192-row tile
    ([257, 1024], [257, 1500], 4, 4, 64, False, torch.float16),
    ([130, 0, 64], [200, 5, 64], 4, 1, 128, False, torch.bfloat16),  # an empty sequence, GQA 4
    ([5, 65, 129], [5, 65, 129], 32, 8, 128, True, torch.bfloat16),  # shorter than a tile
]


@needs_sm90
@pytest.mark.parametrize("q_lens,k_lens,heads,kv_heads,head_dim,causal,dtype", CASES)
def test_hopper_kernel_matches_ref(q_lens, k_lens, heads, kv_heads, head_dim, causal, dtype, monkeypatch):
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, heads, kv_heads, head_dim, dtype, seed=sum(q_lens))
    # Past the last key the buffer holds NaN: the descriptors must stop at the tensor's end (zeros), not read on.
    k, v = nan_tailed(k, hopper.BLOCK_N), nan_tailed(v, hopper.BLOCK_N)
    calls = []
    launch = hopper.hopper_attention
    monkeypatch.setattr(hopper, "hopper_attention", lambda *args: calls.append(args) or launch(*args))
    scale = 0.3 if head_dim == 64 else None
    out = flash_attention(q, k, v, cu_q, cu_k, max(q_lens), causal=causal, scale=scale, out=nans_like(q))
    assert len(calls) == 1  # the Gluon kernel ran, not the Triton one
    assert_close(out, flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale))


@needs_sm90
def test_hopper_kernel_reads_q_k_v_from_a_fused_projection():
    """q, k, v as views of one [tokens, (H + 2 Hkv) * D] buffer, as a fused QKV projection leaves them: the token
    stride is the fused row, not H * D."""
    heads, kv_heads, dim, lens = 8, 2, 128, [300, 45]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(lens), (heads + 2 * kv_heads) * dim, generator=g).to("cuda", torch.bfloat16)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    assert hopper.unsupported(q, k, v, q) is None
    out = flash_attention(q, k, v, cu, cu, max(lens), out=nans_like(q), config={"HOPPER": True})
    assert_close(out, flash_attention_ref(q, k, v, cu, cu))


def test_unsupported_says_why():
    q, k, v, _, _ = make_varlen([3], [3], 4, 2, 64, torch.float32, seed=0)
    half = lambda *ts: [t.to(torch.bfloat16) for t in ts]  # noqa: E731
    if hopper.gluon is None:
        assert hopper.unsupported(q, k, v, q) == "this Triton has no Gluon"
        return
    assert "not torch.float32" in hopper.unsupported(q, k, v, q)
    q16, k16, v16 = half(q, k, v)
    assert "head_dim in (64, 128), not 32" in hopper.unsupported(q16[..., :32], k16[..., :32], v16[..., :32],
                                                                  q16[..., :32])
    spread = torch.cat([k16, k16], dim=-1)[..., :64]  # heads 128 elements apart, not 64
    assert "k (strides (256, 128, 1)) cannot back a TMA descriptor" in hopper.unsupported(q16, spread, v16, q16)
    if not SM90:
        assert hopper.unsupported(q16, k16, v16, q16) == "it needs an sm_90 GPU (H100/H200)"


def test_asking_for_the_hopper_kernel_where_it_cannot_run_is_an_error():
    q, k, v, cu_q, cu_k = make_varlen([3, 4], [3, 4], 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"config \{'HOPPER': True\} asks for the Hopper kernel, but "):
        flash_attention(q, k, v, cu_q, cu_k, 4, config={"HOPPER": True})
