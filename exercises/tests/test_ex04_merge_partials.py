"""Tests for exercise 04, merging partial attention results (flash-decoding's second stage).

``impl`` is the module under test (see conftest.py). Each test calls it before it does anything
else, so a stub fails fast with its NotImplementedError. The expected values come from the
definition: softmax attention over the whole row of scores, in float64.

Without a GPU the last test runs the Triton kernel under Triton's CPU interpreter; conftest.py
switches it on before anything imports triton.
"""

from __future__ import annotations

import math

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one query row: scores [..., N], values [..., N, D] -> (out [..., D], lse [...])."""
    return (torch.einsum("...n,...nd->...d", scores.softmax(dim=-1), values), scores.logsumexp(dim=-1))


def parts(scores: torch.Tensor, values: torch.Tensor, bounds: list[int],
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over each key range [bounds[i], bounds[i + 1]) on its own: out [..., S, D], lse [..., S]
    (float32, as the kernel writes them); an empty range gives out 0 and lse -inf."""
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            outs.append(torch.zeros_like(values[..., 0, :]))
            lses.append(torch.full_like(scores[..., 0], NEG_INF))
        else:
            o, lse = attention(scores[..., lo:hi], values[..., lo:hi, :])
            outs.append(o)
            lses.append(lse)
    return torch.stack(outs, dim=-2).to(dtype), torch.stack(lses, dim=-1).to(dtype)


def random_case(lead: tuple[int, ...], n: int, dim: int, seed: int, scale: float = 3.0, shift: float = 0.0):
    """float64 scores (scale * randn + shift) and values for rows of n keys."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(*lead, n, generator=g, dtype=torch.float64) * scale + shift
    values = torch.randn(*lead, n, dim, generator=g, dtype=torch.float64)
    return scores, values


def check_merge(impl, scores, values, bounds, atol=1e-5, rtol=1e-5, dtype=torch.float32):
    out, lse = parts(scores, values, bounds, dtype)
    out_before, lse_before = out.clone(), lse.clone()
    merged, merged_lse = impl.merge_attention_partials(out, lse)
    want, want_lse = attention(scores, values)
    assert merged.shape == want.shape and merged_lse.shape == want_lse.shape, \
        f"shapes: got out {tuple(merged.shape)}, lse {tuple(merged_lse.shape)}; " \
        f"want {tuple(want.shape)} and {tuple(want_lse.shape)}"
    assert merged.dtype == out.dtype and merged_lse.dtype == lse.dtype, "keep the inputs' dtype"
    assert torch.isfinite(merged).all(), f"non-finite merged output for key ranges {bounds}"
    torch.testing.assert_close(merged.double(), want, atol=atol, rtol=rtol,
                               msg=lambda m: f"merged output, key ranges {bounds}:\n{m}")
    torch.testing.assert_close(merged_lse.double(), want_lse, atol=atol, rtol=rtol,
                               msg=lambda m: f"merged lse, key ranges {bounds}:\n{m}")
    assert torch.equal(out, out_before) and torch.equal(lse, lse_before), "the inputs must not be modified"


def test_worked_example_from_the_docstring(impl):
    out = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    lse = torch.tensor([0.0, math.log(3.0)])
    merged, merged_lse = impl.merge_attention_partials(out, lse)
    torch.testing.assert_close(merged, torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(merged_lse, torch.tensor(math.log(4.0)))


def test_two_parts_make_the_whole(impl):
    scores, values = random_case((3, 4), 50, 16, seed=0)
    check_merge(impl, scores, values, [0, 20, 50])


def test_a_plain_average_is_not_enough(impl):
    # Parts of very different weight: the first holds almost all the softmax mass.
    scores, values = random_case((2,), 12, 8, seed=1)
    scores[:, :6] += 8.0
    check_merge(impl, scores, values, [0, 6, 12])


def test_one_part_is_the_whole(impl):
    scores, values = random_case((5,), 33, 8, seed=2)
    out, lse = parts(scores, values, [0, 33])
    merged, merged_lse = impl.merge_attention_partials(out, lse)
    torch.testing.assert_close(merged, out[..., 0, :])
    torch.testing.assert_close(merged_lse, lse[..., 0])


@pytest.mark.parametrize("seed", range(8))
def test_many_uneven_parts(impl, seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 200, (1,), generator=g))
    num_parts = int(torch.randint(2, 17, (1,), generator=g))
    cuts = sorted(torch.randint(0, n + 1, (num_parts - 1,), generator=g).tolist())  # may repeat: empty parts
    scores, values = random_case((2, 3), n, 16, seed=seed)
    check_merge(impl, scores, values, [0, *cuts, n])


@pytest.mark.parametrize("bounds", [[0, 0, 10], [0, 4, 4, 10], [0, 10, 10], [0, 0, 0, 3, 3, 10, 10]],
                         ids=["first empty", "middle empty", "last empty", "several empty"])
def test_empty_parts_weigh_nothing(impl, bounds):
    scores, values = random_case((4,), 10, 8, seed=3)
    check_merge(impl, scores, values, bounds)


def test_all_parts_empty_give_zero_and_minus_infinity(impl):
    out = torch.zeros(2, 3, 4, 8)
    lse = torch.full((2, 3, 4), NEG_INF)
    lse[1, 2, 1] = 0.5  # one row has a part: it is that part's result
    out[1, 2, 1] = torch.arange(8.0)
    merged, merged_lse = impl.merge_attention_partials(out, lse)
    assert not torch.isnan(merged).any() and not torch.isnan(merged_lse).any(), "NaN where every part is empty"
    want = torch.zeros(2, 3, 8)
    want[1, 2] = torch.arange(8.0)
    want_lse = torch.full((2, 3), NEG_INF)
    want_lse[1, 2] = 0.5
    torch.testing.assert_close(merged, want)
    torch.testing.assert_close(merged_lse, want_lse)


@pytest.mark.parametrize("shift,dtype", [(1e4, torch.float64), (-1e4, torch.float64), (100.0, torch.float32)],
                         ids=["exp overflows", "exp underflows", "float32 overflows"])
def test_large_scores_do_not_overflow(impl, shift, dtype):
    # lse near +-10000: exp(lse) is inf or 0 even in float64 (float64 keeps those lse exact; in float32
    # their rounding alone would move the weights), yet every weight exp(lse_i - max) is in [0, 1].
    # The float32 case: lse near 150, where exp already overflows float32 (above about 88.7).
    scores, values = random_case((3,), 40, 8, seed=4, scale=20.0, shift=shift)
    check_merge(impl, scores, values, [0, 7, 25, 25, 40], atol=1e-4, rtol=1e-5, dtype=dtype)


def test_merged_results_merge_again(impl):
    scores, values = random_case((2, 2), 60, 8, seed=5)
    out, lse = parts(scores, values, [0, 10, 25, 40, 60])
    left = impl.merge_attention_partials(out[..., :2, :], lse[..., :2])
    right = impl.merge_attention_partials(out[..., 2:, :], lse[..., 2:])
    merged, merged_lse = impl.merge_attention_partials(torch.stack([left[0], right[0]], dim=-2),
                                                       torch.stack([left[1], right[1]], dim=-1))
    want, want_lse = attention(scores, values)
    torch.testing.assert_close(merged.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lead", [(), (1,), (2, 3, 4)], ids=["no leading dims", "one", "three"])
def test_any_leading_dims(impl, lead):
    scores, values = random_case(lead, 30, 4, seed=6)
    check_merge(impl, scores, values, [0, 11, 30])


# -- minillm ------------------------------------------------------------------------------------------------


def paged_inputs(context_lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, seed: int):
    """A random q, a shuffled block pool holding each sequence's K/V, and its block tables."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 2
    tables = torch.zeros(len(context_lens), max(needed), dtype=torch.int32)
    ids, start = torch.randperm(num_blocks, generator=g), 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[start:start + n]
        start += n
    q = torch.randn(len(context_lens), heads, dim, generator=g)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    return [t.to(DEVICE) for t in (q, k, v, tables, torch.tensor(context_lens, dtype=torch.int32))]


def test_wired_into_minillm(impl, monkeypatch):
    """Swap your merge into minillm's paged decode reference, then merge the Triton kernel's partials."""
    impl.merge_attention_partials(torch.zeros(1, 2, 4), torch.zeros(1, 2))  # before anything else: the stub raises here
    import minillm.kernels.paged_attention as pa

    # Sequences of 1 to 45 tokens, 8 query heads sharing 2 KV heads (GQA); the short ones leave parts empty.
    q, k, v, tables, lens = paged_inputs([1, 7, 45], heads=8, kv_heads=2, dim=16, block_size=8, seed=7)
    calls = []

    def counted(out, lse):
        calls.append(out.shape)
        return impl.merge_attention_partials(out, lse)

    whole = pa.paged_decode_attention_ref(q, k, v, tables, lens)  # no parts, no merge
    monkeypatch.setattr(pa, "merge_attention_partials", counted)
    for num_splits in (2, 3, 8, 64):
        got = pa.paged_decode_attention_ref(q, k, v, tables, lens, num_splits=num_splits)
        torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"paged_decode_attention_ref(num_splits={num_splits}):\n{m}")
    assert len(calls) == 4, "paged_decode_attention_ref did not call the swapped-in merge_attention_partials"

    # The Triton kernel: stage 1 leaves each part's (out, lse) in the workspace, stage 2 merges them.
    num_splits = 4
    workspace = pa.PagedAttentionWorkspace.allocate(len(lens), q.shape[1], q.shape[2], num_splits, q.device)
    kernel_out = pa.paged_decode_attention(q, k, v, tables, lens, num_splits=num_splits, workspace=workspace,
                                           block_n=16)
    assert torch.isinf(workspace.lse).any(), "the short sequences should leave some parts empty"
    merged, merged_lse = impl.merge_attention_partials(workspace.out, workspace.lse)
    torch.testing.assert_close(merged, kernel_out, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"your merge of the kernel's partials vs the kernel's own merge:\n{m}")
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    whole_lse = pa.split_partials_ref(q, k, v, tables, lens, 1)[1][:, :, 0]
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=1e-5)
