"""Tests for exercise 07, one GPTQ column update: the worked example, the formula on random blocks, what
it leaves unchanged, and GPTQ inside minillm running the learner's update.

Run from the repository root: ``pytest exercises/tests/test_ex07_gptq_column.py --impl=mine``.
"""

from __future__ import annotations

import pytest
import torch

from minillm.quant import gptq, rtn


def random_block(out_features: int, width: int, seed: int):
    """A block of weights and the upper Cholesky factor of a real inverse Hessian."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, width, generator=g) @ torch.randn(width, width, generator=g)
    return torch.randn(out_features, width, generator=g), gptq.inverse_hessian_factor(gptq.hessian(x), 0.01)


def test_worked_example(impl):
    block = torch.tensor([[1.0, 2.0]])
    err = impl.update_column(block, torch.tensor([[2.0, 1.0], [0.0, 4.0]]), 0, torch.tensor([0.5]))
    assert err.tolist() == [0.25]
    assert block.tolist() == [[0.5, 1.75]]


@pytest.mark.parametrize("i", [0, 5, 15])
def test_the_update_is_the_obs_formula(impl, i):
    block, hinv = random_block(12, 16, seed=i)
    before = block.clone()
    q = torch.round(before[:, i] * 4) / 4
    err = impl.update_column(block, hinv, i, q)
    want_err = (before[:, i] - q) / hinv[i, i]
    torch.testing.assert_close(err, want_err)
    torch.testing.assert_close(block[:, i:], before[:, i:] - want_err[:, None] * hinv[i, i:][None, :])
    assert torch.equal(block[:, :i], before[:, :i]), "columns before i must not change"
    torch.testing.assert_close(block[:, i], q, rtol=1e-5, atol=1e-6)  # column i becomes q


def test_hinv_and_q_are_not_modified(impl):
    block, hinv = random_block(4, 8, seed=3)
    q = torch.zeros(4)
    hinv_before = hinv.clone()
    impl.update_column(block, hinv, 2, q)
    assert torch.equal(hinv, hinv_before) and torch.equal(q, torch.zeros(4))


def test_wired_into_minillm(impl, monkeypatch):
    """GPTQ with the learner's update: minillm's exact codes, and a lower held-out error than RTN."""
    block, hinv = random_block(2, 4, seed=4)
    impl.update_column(block, hinv, 0, torch.zeros(2))  # before anything else: the stub raises here
    g = torch.Generator().manual_seed(5)
    basis = torch.randn(32, 256, generator=g)
    x = torch.randn(2048, 32, generator=g) @ basis + 0.3 * torch.randn(2048, 256, generator=g)
    held_out = torch.randn(512, 32, generator=g) @ basis + 0.3 * torch.randn(512, 256, generator=g)
    w = torch.randn(64, 256, generator=g) * 0.05
    h = gptq.hessian(x)
    ours = gptq.gptq_quantize(w, h, 4, 64, False, act_order=True)
    calls = []

    def counted(*args):
        calls.append(args[2])
        return impl.update_column(*args)

    monkeypatch.setattr(gptq, "update_column", counted)
    theirs = gptq.gptq_quantize(w, h, 4, 64, False, act_order=True)
    assert len(calls) == 256, "GPTQ did not call the swapped-in update for every column"
    assert torch.equal(theirs.codes, ours.codes) and torch.equal(theirs.scales, ours.scales)
    deq = rtn.dequantize(theirs.codes.float(), rtn.expand_groups(theirs.scales, 64, 256),
                         rtn.expand_groups(theirs.zeros.float(), 64, 256))
    q = torch.empty_like(deq).index_copy_(1, theirs.perm, deq)
    error = (held_out @ (w - q).t()).pow(2).sum()
    rtn_error = (held_out @ (w - rtn.fake_quantize(w, 4, 64, False)).t()).pow(2).sum()
    assert error < 0.5 * rtn_error
