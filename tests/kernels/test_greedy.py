"""Greedy sampling's argmax kernel (kernels/greedy.py) against torch.argmax, index for index: ties, NaN, rows of
-inf, vocabularies of many chunks. Under TRITON_INTERPRET=1 on CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.greedy import CHUNK, greedy_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_logits(rows, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("rows, vocab", [(1, 32000), (3, 49152), (2, 70001), (2, 2 * CHUNK + 77), (4, 50), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_matches_torch_argmax(rows, vocab, dtype):
    logits = random_logits(rows, vocab, dtype)
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_column_across_chunks():
    """Equal maxima in one chunk, in several chunks and in different lanes of one chunk: the first column wins, as
    torch's argmax picks it."""
    vocab = 2 * CHUNK + 500
    logits = random_logits(5, vocab, seed=1)
    top = logits.max() + 1
    logits[0, [CHUNK + 9, 2 * CHUNK + 3, 7]] = top  # lane 7 of chunk 0 comes first
    logits[1, [CHUNK + 400, 2 * CHUNK + 100]] = top  # first in the second chunk, a lower lane later
    logits[2, [300, 299]] = top  # neighbours in one chunk
    logits[3, [vocab - 1, vocab - 2]] = top  # at the row's end, in the ragged last chunk
    logits[4, [2 * CHUNK + 5, CHUNK + 5]] = top  # one lane, two chunks: the earlier chunk's column
    got, want = greedy_argmax(logits), logits.argmax(dim=-1)
    assert torch.equal(got, want) and got.tolist() == [7, CHUNK + 400, 299, vocab - 2, CHUNK + 5]


def test_nan_and_minus_infinity_rows():
    """A row holding NaN gives its first NaN (torch orders NaN above every number, +inf too); a row of -inf gives
    0; a row of +inf and -inf its first +inf."""
    vocab = CHUNK + 1000
    logits = random_logits(4, vocab, seed=2)
    logits[0, [CHUNK + 5, 40]] = float("nan")
    logits[0, 3] = float("inf")
    logits[1] = float("-inf")
    logits[2, [CHUNK + 900, 12]] = float("inf")
    logits[3, [CHUNK + 1, CHUNK + 2]] = float("nan")
    got, want = greedy_argmax(logits), logits.argmax(dim=-1)
    assert torch.equal(got, want) and got.tolist() == [40, 0, 12, CHUNK + 1]


def test_rows_of_a_wider_tensor_and_no_rows():
    """Rows with a stride beyond the vocabulary (a slice of wider logits), and an empty batch."""
    wide = random_logits(3, 700, seed=3)
    logits = wide[:, :650]
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert greedy_argmax(wide[:0]).shape == (0,)


@pytest.mark.parametrize("bad, message", [
    (lambda: random_logits(2, 8)[0], r"\[rows, vocab\]"),
    (lambda: torch.ones(2, 8, dtype=torch.long, device=DEVICE), "floating point"),
    (lambda: random_logits(8, 2).t(), "contiguous last dim"),
    (lambda: random_logits(2, 0), "non-empty"),
])
def test_bad_logits_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        greedy_argmax(bad())
