"""The decode attention's merge folded into o_proj's W4A16 GEMV (kernels/w4_gemv_merge.py): the GEMV builds its
input from the splits' partials and log-sum-exps, where the merge kernel would have written the row.

Gluon has no interpreter: the numerics need an sm_90 GPU. On any machine: the refusals, and the attention's side
(``paged_decode_attention(defer_merge=True)`` hands back the partials that ``UnmergedAttention.materialize`` merges
into what the attention returns by itself). The engine's side: tests/test_norm_folding.py.
"""

from __future__ import annotations

import pytest
import torch

from minillm.attention import UnmergedAttention
from minillm.kernels import w4_gemv_fused as fused_forms
from minillm.kernels.paged_attention import merge_attention_partials, paged_decode_attention
from minillm.kernels.quant_matmul import w4a16_matmul_ref
from minillm.kernels.split_merge import merge_by_kernel
from minillm.kernels.w4_gemv_merge import MAX_SPLITS, Merge, merge_unsupported

from test_paged_attention import make_inputs, poisoned as poisoned_workspace
from test_quant_matmul import assert_matches, counters_are_clean, int4_problem, poisoned
from test_w4_gemv_hopper import needs_sm90


def unmerged(heads: int, dim: int, splits: int, seed: int, device: str = "cuda") -> Merge:
    """Random partials [1, H, S, D] and log-sum-exps [1, H, S] in a workspace wider than S (its strides are the
    engine's); the last split of every other head is empty (lse -inf, partial 0), as short contexts leave them."""
    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(1, heads, splits + 2, dim, generator=g)[:, :, :splits]
    lse = (torch.randn(1, heads, splits + 2, generator=g) * 3)[:, :, :splits]
    if splits > 1:
        lse[0, ::2, -1], partial[0, ::2, -1] = float("-inf"), 0.0
    return Merge(partial.to(device), lse.to(device))


def merged_row(merge: Merge) -> torch.Tensor:
    """What the merge kernel writes: the row [1, H * D] in bf16."""
    partial, lse = merge
    out = torch.empty(1, partial.shape[1], partial.shape[3], dtype=torch.bfloat16, device=partial.device)
    merge_by_kernel(partial, lse, out, partial.shape[2], partial.stride()[:3], lse.stride()[:2], partial.shape[3],
                    max(16, partial.shape[3]))
    return out.view(1, -1)


# heads, head_dim, splits, n: Llama-2-7B's o_proj at batch 1 (9 splits); heads of 64 (two heads a program's tile of
# 128 inputs); one split; splits past a warp's 32 lanes (two a lane); N not a multiple of 256.
CASES = [(32, 128, 9, 4096), (8, 64, 3, 256), (9, 64, 1, 576), (4, 128, 40, 512)]


@needs_sm90
@pytest.mark.parametrize("heads,dim,splits,n", CASES)
def test_merged_input_and_residual_add(heads, dim, splits, n):
    """o_proj's folded form: the input merged from the partials, the residual added. Against the merge kernel's row
    through the same GEMV (a merged input may differ from the kernel's in its last bit: its sums over splits run in
    another order) and against the fp32 reference; the row's buffer is left unread and unwritten."""
    k = heads * dim
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, 128, torch.bfloat16, seed=k + n)
    merge = unmerged(heads, dim, splits, seed=splits)
    residual = (torch.randn(1, n, generator=torch.Generator().manual_seed(n)) * 4).to(torch.bfloat16).cuda()
    buffer = poisoned((1, k), torch.bfloat16)
    total, sumsq = fused_forms.fused_gemv(buffer, qweight, scales, zeros, 128, residual=residual, merge=merge)
    assert buffer.isnan().all()
    want, want_sumsq = fused_forms.fused_gemv(merged_row(merge), qweight, scales, zeros, 128, residual=residual)
    assert_matches(total, want, torch.bfloat16)
    torch.testing.assert_close(sumsq, want_sumsq, rtol=2e-2, atol=0)
    exact = merge_attention_partials(merge.partial[0], merge.lse[0])[0].reshape(1, k).to(torch.bfloat16)
    assert_matches(total, w4a16_matmul_ref(exact, qweight, scales, zeros, 128) + residual, torch.bfloat16)
    assert counters_are_clean()


def test_merge_refusals_name_the_reason():
    """Each input the merge cannot take, with what was wrong; a merge the GEMV takes is refused only for the device
    (here a CPU)."""
    merge = unmerged(4, 64, 3, seed=0, device="cpu")
    assert merge_unsupported(merge, 256, torch.device("cpu")) is None
    refusals = {
        "[1, H, S, D]": merge._replace(partial=merge.partial[0]),
        "K = 512": merge,
        "multiple of 8": Merge(torch.zeros(1, 64, 3, 4), torch.zeros(1, 64, 3)),
        f"1 to {MAX_SPLITS} splits": Merge(torch.zeros(1, 4, MAX_SPLITS + 1, 64), torch.zeros(1, 4, MAX_SPLITS + 1)),
        "fp32": merge._replace(lse=merge.lse.half()),
        "unit last strides": merge._replace(partial=merge.partial.transpose(2, 3).contiguous().transpose(2, 3)),
    }
    for reason, bad in refusals.items():
        k = 512 if reason == "K = 512" else 256
        assert reason in merge_unsupported(bad, k, torch.device("cpu")), reason
    _, qweight, scales, zeros, _, _ = int4_problem(1, 256, 256, 128, torch.bfloat16, seed=1)
    row = torch.zeros(1, 256, dtype=torch.bfloat16, device=qweight.device)
    merge = unmerged(4, 64, 3, seed=0, device=qweight.device)
    assert "not more" in fused_forms.fused_unsupported(torch.cat([row, row], 1), qweight, scales, zeros, 128,
                                                       gated=True, merge=merge)
    reason = fused_forms.fused_unsupported(row, qweight, scales, zeros, 128, merge=merge)
    assert ("sm_90" in reason or "Gluon" in reason) if qweight.device.type == "cpu" else reason is None


def test_paged_decode_defers_the_merge_it_would_have_done():
    """With splits to merge, ``defer_merge`` returns the workspace's partials and launches no merge (the output left
    as it was); merged by ``UnmergedAttention.materialize`` they give what the attention returns by itself, bit for
    bit. With one split there is nothing to defer: the output comes back written."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, tables, ctx = make_inputs([37], heads=4, kv_heads=2, dim=32, block_size=16, device=device)
    want = paged_decode_attention(q, k, v, tables, ctx, num_splits=3)
    out, workspace = poisoned_workspace(q, (1, 3))
    merge = paged_decode_attention(q, k, v, tables, ctx, num_splits=3, out=out, workspace=workspace,
                                   defer_merge=True)
    assert isinstance(merge, Merge) and merge.partial.shape == (1, 4, 3, 32) and out.isnan().all()
    assert torch.equal(UnmergedAttention(merge, out).materialize(), want.view(1, 1, -1))
    single = paged_decode_attention(q, k, v, tables, ctx, num_splits=1, defer_merge=True)
    assert torch.equal(single, paged_decode_attention(q, k, v, tables, ctx, num_splits=1))
    last = paged_decode_attention(q, k, v, tables, ctx, num_splits=3, merge="last_split", defer_merge=True)
    assert torch.equal(last, want)  # the last split merges in stage 1: nothing left to defer
