"""The bit-trick conversions of ``kernels/int_float.py`` against torch's, on every int8 value: under the
interpreter their tl fallbacks, on a GPU the inline PTX the kernels run."""

import torch
import triton
import triton.language as tl

from minillm.kernels.int_float import int8_to_float, int8_words_to_fp16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _convert(Words, Halves, Floats, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows, words = tl.arange(0, ROWS)[:, None], tl.arange(0, WORDS)[None, :]
    packed = tl.load(Words + rows * WORDS + words)
    tl.store(Halves + rows * 4 * WORDS + tl.arange(0, 4 * WORDS)[None, :], int8_words_to_fp16(packed))
    codes = tl.load(Words.to(tl.pointer_type(tl.int8), bitcast=True) + rows * 4 * WORDS + tl.arange(0, 4 * WORDS)[None, :])
    tl.store(Floats + rows * 4 * WORDS + tl.arange(0, 4 * WORDS)[None, :], int8_to_float(codes))


def test_int8_conversions_are_exact_for_every_value_in_every_byte_position():
    g = torch.Generator().manual_seed(0)
    # 256 words whose byte i runs over all 256 values, in a different random order for each i.
    codes = torch.stack([torch.randperm(256, generator=g) - 128 for _ in range(4)], dim=1)
    codes = codes.reshape(16, 64).to(torch.int8).to(DEVICE)
    halves = torch.full((16, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    floats = torch.full((16, 64), float("nan"), dtype=torch.float32, device=DEVICE)
    _convert[(1,)](codes.view(torch.int32), halves, floats, ROWS=16, WORDS=16)
    assert torch.equal(halves, codes.to(torch.float16)) and torch.equal(floats, codes.float())
    every = codes.view(16, 16, 4).to(torch.int16).cpu()
    assert all(len(every[..., byte].unique()) == 256 for byte in range(4))  # the test covers what it says
