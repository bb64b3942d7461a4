"""The Gluon prefill kernel for Hopper (kernels/hopper/flash_attention.py) against the plain-torch reference, and
when ``flash_attention`` picks it.

Gluon has no interpreter, so the numerical tests need an sm_90 GPU; on the CPU the dispatch and its reasons are
tested, and tests/test_hopper_sass.py checks the compiled loops.
"""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.hopper import flash_attention as hopper
from minillm.kernels.flash_attention import _attention_kernel, flash_attention, flash_attention_ref

from test_flash_attention import assert_close, make_varlen, nans_like

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
    ([300, 70], [100, 10], 8, 2, 64, False, torch.bfloat16),  # fewer keys than queries (unmasked)
]


def nan_tailed(t, rows):
    """``t`` as the head of a buffer whose next ``rows`` rows are NaN: a tile that reads past the last
    sequence's end (rather than getting zeros from the descriptor's bounds) poisons its output."""
    buffer = torch.cat([t, torch.full_like(t[:1], float("nan")).expand(rows, *t.shape[1:])])
    return buffer[: t.shape[0]]


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
    max_q = max(q_lens) + (100 if causal else 0)  # a launch hint above the longest sequence is fine
    out = flash_attention(q, k, v, cu_q, cu_k, max_q, causal=causal, scale=scale, out=nans_like(q))
    assert len(calls) == 1  # the Gluon kernel ran, not the Triton one
    assert_close(out, flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal, scale=scale))


@needs_sm90
def test_hopper_kernel_writes_into_a_strided_out():
    """out as every other row-block of a wider buffer: the kernel stores through its strides."""
    q, k, v, cu_q, cu_k = make_varlen([200, 31], [200, 31], 4, 2, 128, torch.bfloat16, seed=5)
    wide = torch.full((q.shape[0], 2 * q.shape[1], q.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    out = wide[:, ::2]
    assert hopper.unsupported(q, k, v, out) is None and not out.is_contiguous()
    flash_attention(q, k, v, cu_q, cu_k, 200, out=out)
    assert_close(out, flash_attention_ref(q, k, v, cu_q, cu_k))
    assert wide[:, 1::2].isnan().all()  # and nowhere else


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
        assert "it is written in Gluon for Triton >= 3.6" in hopper.unsupported(q, k, v, q)
        return
    assert "not torch.float32" in hopper.unsupported(q, k, v, q)
    q16, k16, v16 = half(q, k, v)
    assert "head_dim in (64, 128), not 32" in hopper.unsupported(q16[..., :32], k16[..., :32], v16[..., :32],
                                                                  q16[..., :32])
    spread = torch.cat([k16, k16], dim=-1)[..., :64]  # heads 128 elements apart, not 64
    assert hopper.unsupported(q16, spread, v16, q16) == "k has strides (256, 128, 1); its heads must be packed"
    odd = torch.randn(3 * 132).to(v16.dtype).as_strided((3, 2, 64), (132, 64, 1))  # tokens 264 bytes apart
    assert "v.stride(0) is 132 elements of 2 bytes; TMA needs a multiple of 16 bytes" in hopper.unsupported(
        q16, k16, odd, q16)
    assert hopper.unsupported(q16, k16[:0], v16[:0], q16) == ("k holds no tokens (a TMA descriptor needs at least "
                                                              "one row)")
    if not SM90:
        assert hopper.unsupported(q16, k16, v16, q16) == "it needs an sm_90 GPU (H100/H200)"


def test_asking_for_the_hopper_kernel_where_it_cannot_run_is_an_error():
    q, k, v, cu_q, cu_k = make_varlen([3, 4], [3, 4], 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="config HOPPER=True asks for the Hopper kernel, but "):
        flash_attention(q, k, v, cu_q, cu_k, 4, config={"HOPPER": True})
    with pytest.raises(ValueError, match=r"config \{'BLOCK_M': 16\} goes with HOPPER=True, whose kernel takes no"):
        flash_attention(q, k, v, cu_q, cu_k, 4, config={"HOPPER": True, "BLOCK_M": 16})


def test_hopper_false_runs_the_triton_kernel_with_the_rest_of_the_config():
    q, k, v, cu_q, cu_k = make_varlen([3, 9], [5, 9], 4, 2, 16, torch.float32, seed=1)
    launches = []
    hook = lambda *args, **kwargs: launches.append(kwargs)  # noqa: E731
    _attention_kernel.add_pre_run_hook(hook)
    try:
        out = flash_attention(q, k, v, cu_q, cu_k, 9, out=nans_like(q),
                              config={"HOPPER": False, "BLOCK_M": 16, "BLOCK_N": 16})
    finally:
        _attention_kernel.pre_run_hooks.remove(hook)
    assert [(launch["BLOCK_M"], launch["BLOCK_N"]) for launch in launches] == [(16, 16)]
    assert_close(out, flash_attention_ref(q, k, v, cu_q, cu_k))
