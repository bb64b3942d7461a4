"""Tests for exercise 01, top-p (nucleus) filtering and sampling.

``impl`` is the module under test (see conftest.py). Each test calls it before it does anything
else, so a stub fails fast with its NotImplementedError.
"""

from __future__ import annotations

import pytest
import torch

NEG_INF = float("-inf")
TOL = 1e-4  # mass tolerance: float32 cumulative sums over 32k tokens are not exact
TOP_PS = [1e-6, 0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0]


def random_case(batch: int, vocab: int, scale: float, seed: int):
    """Seeded logits (larger scale = more peaked rows) and one top_p per row, cycling TOP_PS."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * scale
    pick = torch.randperm(len(TOP_PS), generator=g)
    top_p = torch.tensor([TOP_PS[pick[i % len(TOP_PS)]] for i in range(batch)])
    return logits, top_p


def reference_bounds(row: torch.Tensor, p: float) -> tuple[set[int], set[int]]:
    """Brute force, one row in float64: walk the tokens from most to least likely and keep each
    one while the mass before it is below p. Returns (must keep, may keep). Tokens whose
    mass-before lies within TOL of p may go either way, and -inf tokens are in neither set."""
    probs = torch.softmax(row.double(), dim=-1).tolist()
    finite = [i for i, logit in enumerate(row.tolist()) if logit != NEG_INF]
    must, may, mass_before = set(), set(), 0.0
    for rank, i in enumerate(sorted(finite, key=lambda i: -probs[i])):
        if rank == 0 or p >= 1.0 or mass_before < p - TOL:
            must.add(i)
        if rank == 0 or p >= 1.0 or mass_before < p + TOL:
            may.add(i)
        mass_before += probs[i]
    return must, may


def kept_ids(out_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(out_row != NEG_INF).flatten().tolist())


CASES = [  # (batch, vocab, scale, seed)
    (1, 1, 1.0, 0), (1, 2, 1.0, 1), (4, 10, 1.0, 2), (9, 10, 3.0, 3), (9, 50, 0.3, 4),
    (16, 512, 1.0, 5), (16, 512, 5.0, 6), (9, 512, 20.0, 7), (3, 32000, 1.0, 8), (3, 32000, 4.0, 9),
]


@pytest.mark.parametrize("batch,vocab,scale,seed", CASES)
def test_matches_brute_force(impl, batch, vocab, scale, seed):
    logits, top_p = random_case(batch, vocab, scale, seed)
    out = impl.top_p_filter(logits, top_p)
    assert out.shape == logits.shape and out.dtype == logits.dtype
    for i in range(batch):
        must, may = reference_bounds(logits[i], top_p[i].item())
        kept = kept_ids(out[i])
        assert must <= kept, f"row {i} (top_p={top_p[i].item()}): dropped {sorted(must - kept)[:10]}"
        assert kept <= may, f"row {i} (top_p={top_p[i].item()}): kept extra {sorted(kept - may)[:10]}"


@pytest.mark.parametrize("batch,vocab,scale,seed", CASES)
def test_kept_set_is_the_smallest_most_likely_set(impl, batch, vocab, scale, seed):
    logits, top_p = random_case(batch, vocab, scale, seed)
    out = impl.top_p_filter(logits, top_p)
    probs = torch.softmax(logits.double(), dim=-1)
    for i in range(batch):
        p, keep = top_p[i].item(), out[i] != NEG_INF
        kept_probs, removed_probs = probs[i][keep], probs[i][~keep]
        assert keep.any(), f"row {i}: everything removed"
        mass = kept_probs.sum().item()
        assert mass >= p - TOL, f"row {i}: kept mass {mass:.6f} < top_p {p}"
        if removed_probs.numel():  # the most likely tokens are kept, never a less likely one
            assert kept_probs.min() >= removed_probs.max(), f"row {i}: removed a more likely token than one kept"
        if keep.sum() > 1:  # minimal: without its least likely member the set falls short of top_p
            assert mass - kept_probs.min().item() < p + TOL, f"row {i}: not minimal for top_p {p}"


@pytest.mark.parametrize("batch,vocab,scale,seed", CASES)
def test_masked_exactly_neg_inf_and_kept_unchanged(impl, batch, vocab, scale, seed):
    logits, top_p = random_case(batch, vocab, scale, seed)
    before = logits.clone()
    out = impl.top_p_filter(logits, top_p)
    assert torch.equal(logits, before), "top_p_filter modified its input in place"
    assert out.data_ptr() != logits.data_ptr(), "return a new tensor, not the input"
    keep = out != NEG_INF
    assert torch.equal(out[keep], logits[keep]), "kept logits must be returned unchanged"
    assert torch.isneginf(out[~keep]).all(), "removed logits must be exactly -inf"
    assert not out.isnan().any()


@pytest.mark.parametrize("seed", range(5))
def test_top_token_always_kept(impl, seed):
    logits, _ = random_case(8, 100, 10.0, seed)
    out = impl.top_p_filter(logits, torch.full((8,), 1e-9))
    top = logits.argmax(dim=-1)
    assert (out.gather(-1, top[:, None]) == logits.gather(-1, top[:, None])).all()
    assert ((out != NEG_INF).sum(dim=-1) == 1).all(), "a tiny top_p keeps exactly the top token"


def test_top_p_one_keeps_everything(impl):
    # Peaked rows: float32 cumulative sums reach 1.0 long before the last token.
    logits, _ = random_case(8, 512, 20.0, 11)
    out = impl.top_p_filter(logits, torch.ones(8))
    assert torch.equal(out, logits), "top_p=1.0 must keep every token"


def test_worked_example(impl):
    logits = torch.tensor([[0.50, 0.30, 0.15, 0.05]] * 3).log()[:, [2, 0, 3, 1]]  # shuffled vocab
    out = impl.top_p_filter(logits, torch.tensor([0.7, 0.45, 0.96]))
    kept = (out != NEG_INF).tolist()
    assert kept[0] == [False, True, False, True]  # 0.50 + 0.30
    assert kept[1] == [False, True, False, False]  # 0.50 alone
    assert kept[2] == [True, True, True, True]  # 0.95 < 0.96: the 0.05 is needed too


def test_rows_are_independent(impl):
    logits, _ = random_case(6, 64, 2.0, 12)
    top_p = torch.tensor([0.2, 0.9, 1.0, 0.5, 1e-6, 0.7])
    together = impl.top_p_filter(logits, top_p)
    for i in range(6):
        alone = impl.top_p_filter(logits[i:i + 1], top_p[i:i + 1])
        assert torch.equal(together[i:i + 1], alone), f"row {i} depends on its batch mates"


def test_input_with_neg_inf_after_top_k(impl):
    # minillm applies top-k first, so some logits arrive as -inf already.
    logits, _ = random_case(4, 40, 2.0, 13)
    logits[:, ::3] = NEG_INF
    top_p = torch.tensor([0.3, 0.8, 1.0, 1e-6])
    out = impl.top_p_filter(logits, top_p)
    assert torch.isneginf(out[:, ::3]).all()
    assert not out.isnan().any()
    for i in range(4):
        must, may = reference_bounds(logits[i], top_p[i].item())
        assert must <= kept_ids(out[i]) <= may


def test_ties(impl):
    # Eight equal logits, 1/8 each: 0.3 needs 3 of them (0.375), any 3.
    out = impl.top_p_filter(torch.zeros(2, 8), torch.tensor([0.3, 1.0]))
    assert (out[0] != NEG_INF).sum() == 3 and (out[1] != NEG_INF).sum() == 8
    assert (out[out != NEG_INF] == 0).all()
    # Exactly on the boundary (all sums exact in binary): 0.25 + 0.25 reaches 0.5, so 2 tokens, not 3.
    out = impl.top_p_filter(torch.zeros(1, 4), torch.tensor([0.5]))
    assert (out != NEG_INF).sum() == 2, "'at least top_p': stop as soon as the mass reaches top_p"
    # A clear winner, then three tied: just above the winner's mass needs exactly one of the tied.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0]])
    winner = torch.softmax(logits, dim=-1)[0, 0].item()
    out = impl.top_p_filter(logits, torch.tensor([winner + 0.01]))
    kept = (out[0] != NEG_INF).tolist()
    assert kept[0] and sum(kept[1:4]) == 1 and not kept[4], kept


def test_dtypes(impl):
    logits, top_p = random_case(4, 100, 2.0, 14)
    out = impl.top_p_filter(logits.double(), top_p.double())
    assert out.dtype == torch.float64
    for i in range(4):
        must, may = reference_bounds(logits[i], top_p[i].item())
        assert must <= kept_ids(out[i]) <= may


def test_sample_top_p_draws_from_the_nucleus(impl):
    probs = torch.tensor([0.50, 0.30, 0.15, 0.05])
    n = 4000
    logits = probs.log()[None, :].expand(n, -1)
    g = torch.Generator().manual_seed(0)
    tokens = impl.sample_top_p(logits, torch.full((n,), 0.7), generator=g)
    assert tokens.shape == (n,) and tokens.dtype == torch.int64
    assert set(tokens.tolist()) <= {0, 1}, "drew a token outside the nucleus"
    share = (tokens == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04, f"token 0 drawn {share:.3f} of the time, expected 0.625"


def test_sample_top_p_seeded_and_tiny_top_p_is_greedy(impl):
    logits, _ = random_case(16, 300, 1.0, 15)
    top_p = torch.full((16,), 0.9)
    first = impl.sample_top_p(logits, top_p, generator=torch.Generator().manual_seed(7))
    again = impl.sample_top_p(logits, top_p, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, again), "the same generator seed must give the same tokens"
    greedy = impl.sample_top_p(logits, torch.full((16,), 1e-9), generator=torch.Generator().manual_seed(7))
    assert torch.equal(greedy, logits.argmax(dim=-1))


def test_wired_into_minillm(impl):
    """Swap the implementation into a live engine: the same seeded tokens as minillm's own filter."""
    from minillm import LLM, SamplingParams
    from minillm.sampling import top_p_filter as builtin

    llm = LLM("tiny", load_format="dummy")  # random weights, no tokenizer: token-id prompts
    sampler = llm.engine.runner.sampler
    prompts = [[5, 6, 7], [100, 200, 300, 400], [42]]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=123, ignore_eos=True)

    def generate(top_p_filter=None):
        if top_p_filter is not None:
            # An instance attribute holding a plain function is not bound: called as f(logits, top_p).
            sampler.top_p_filter = top_p_filter
        try:
            return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            sampler.__dict__.pop("top_p_filter", None)  # back to the class's staticmethod

    calls = []

    def counted(logits, top_p):
        calls.append(logits.shape)
        return impl.top_p_filter(logits, top_p)

    theirs = generate(counted)
    assert calls, "the engine never called the swapped-in top_p_filter"
    assert sampler.top_p_filter is builtin, "the engine's filter was not restored"
    ours = generate()
    assert theirs == ours, "different tokens from minillm's own top_p_filter with the same seed"
    # The test can tell filters apart: without any filtering the same seed gives other tokens.
    assert generate(lambda logits, top_p: logits) != ours
