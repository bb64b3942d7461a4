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
    """Rows of several chunks with a stride beyond the vocabulary (a slice of wider logits), and an empty batch."""
    wide = random_logits(3, 2 * CHUNK + 700, seed=3)
    logits = wide[:, :2 * CHUNK + 650]
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    assert greedy_argmax(wide[:0]).shape == (0,)


def test_the_arrival_counters_are_left_at_zero():
    """The last program of each row resets its counter: the next launch (or a CUDA graph's replay) finds them clean."""
    from minillm.kernels.split_k import tile_counters
    logits = random_logits(6, 3 * CHUNK + 5, seed=4)
    for _ in range(3):
        assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
        assert not tile_counters(logits.device)[:6].any()


@pytest.mark.skipif(DEVICE != "cuda",
                    reason="programs racing to the last arrival need a GPU (the interpreter runs them one by one)")
def test_many_rows_many_chunks_eagerly_and_in_a_graph():
    """64 rows of a 128k vocabulary (126 programs a row racing to the last arrival), ties and NaN across chunks, many
    launches, eagerly and replayed from a CUDA graph."""
    logits = random_logits(64, 128256, seed=5)
    top = logits.max() + 1
    logits[::2, [90000, 5000, 70000]] = top
    logits[1::4, [100000, 3000]] = float("nan")
    want = logits.argmax(dim=-1)
    for _ in range(20):
        assert torch.equal(greedy_argmax(logits), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_argmax(logits)
    for _ in range(20):
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, want)
    from minillm.kernels.split_k import tile_counters
    assert not tile_counters(logits.device)[:64].any()


@pytest.mark.parametrize("bad, message", [
    (lambda: random_logits(2, 8)[0], r"\[rows, vocab\]"),
    (lambda: torch.ones(2, 8, dtype=torch.long, device=DEVICE), "torch.int64"),
    (lambda: random_logits(2, 8, torch.float64), "torch.float64"),
    (lambda: random_logits(8, 2).t(), "contiguous last dim"),
    (lambda: random_logits(2, 0), "non-empty"),
])
def test_bad_logits_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        greedy_argmax(bad())
