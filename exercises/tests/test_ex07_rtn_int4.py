"""Tests for exercise 07 (part 1), group-wise RTN and INT4 packing: worked examples, minillm's quantizer as the
reference (ragged groups included), the packed bit layout, and a model quantized by the learner's code.

Run from the repository root: ``pytest exercises/tests/test_ex07_rtn_int4.py --impl=mine``.
"""

from __future__ import annotations

import pytest
import torch
from drive import run_requests  # exercises/tests is on sys.path (pytest)

from minillm.quant import rtn
from minillm.quant.linear import unpack


def weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, 3] = 0.7  # an outlier, so groups differ
    return w


def test_worked_example_from_the_docstring(impl):
    codes, scales, zeros = impl.quantize_groupwise(torch.tensor([[0.0, 0.3, -0.45, 0.15]]), 4, 4, False)
    assert codes.tolist() == [[9, 15, 0, 12]]
    assert zeros.tolist() == [[9]]
    assert scales.shape == (1, 1) and abs(scales.item() - 0.05) < 1e-4


@pytest.mark.parametrize("in_features,group_size,sym", [(256, 64, False), (576, 128, False), (576, 128, True),
                                                        (96, -1, False), (40, 16, True)],
                         ids=["g64", "g128-ragged", "g128-ragged-sym", "per-channel", "g16-ragged-sym"])
def test_same_codes_scales_and_zeros_as_minillm(impl, in_features, group_size, sym):
    w = weights(24, in_features, seed=in_features + group_size)
    before = w.clone()
    codes, scales, zeros = impl.quantize_groupwise(w, 4, group_size, sym)
    want = rtn.quantize_groupwise(w, 4, group_size, sym)
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    assert codes.dtype == torch.uint8 and codes.shape == (24, in_features)
    assert scales.dtype == torch.float32 and scales.shape == (24, groups)
    assert zeros.dtype == torch.int32 and zeros.shape == (24, groups)
    assert torch.equal(codes, want[0]), "codes differ from minillm's"
    assert torch.equal(scales, want[1]) and torch.equal(zeros, want[2]), "scales or zero points differ"
    assert torch.equal(w, before), "the weight was modified"


def test_eight_bits_work_too(impl):
    w = weights(8, 64, seed=1)
    codes, scales, zeros = impl.quantize_groupwise(w, 8, 32, False)
    assert int(codes.max()) > 15, "8-bit codes use the range 0..255"
    assert all(torch.equal(a, b) for a, b in zip((codes, scales, zeros), rtn.quantize_groupwise(w, 8, 32, False)))


def test_dequantized_error_is_at_most_half_a_step(impl):
    w = weights(16, 200, seed=2)
    codes, scales, zeros = impl.quantize_groupwise(w, 4, 64, False)
    step = rtn.expand_groups(scales, 64, 200)
    dequantized = (codes.float() - rtn.expand_groups(zeros, 64, 200)) * step
    assert ((dequantized - w).abs() <= step / 2 * (1 + 1e-5)).all()


def test_pack_worked_example(impl):
    codes = torch.arange(1, 9, dtype=torch.uint8)[:, None]  # one column: rows 0..7 hold 1..8
    packed = impl.pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() & 0xFFFFFFFF == 0x87654321


def test_pack_round_trips_through_minillms_unpack(impl):
    codes = torch.randint(0, 16, (576, 40), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    codes[7::8, 0] = 15  # the top code of each word sets the int32 sign bit
    packed = impl.pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (72, 40)
    assert torch.equal(unpack(packed, 4), codes.to(torch.int32))


def test_pack_rejects_rows_that_are_not_a_multiple_of_8(impl):
    with pytest.raises(ValueError, match="12"):
        impl.pack_int4(torch.zeros(12, 4, dtype=torch.uint8))


def test_wired_into_minillm(impl, monkeypatch):
    """Quantize a model with the learner's functions: the same packed buffers and greedy tokens as minillm's."""
    impl.pack_int4(torch.zeros(8, 1, dtype=torch.uint8))  # before anything else: the stub raises here
    from minillm import LLM, SamplingParams
    import minillm.quant.linear as linear

    def quantized_llm():
        return LLM("tiny", load_format="dummy", dtype="float32", device="cpu", quantization="rtn-int4-g32")

    ours = quantized_llm()
    calls = []
    original_pack = linear.pack

    def learner_pack(codes, bits):
        calls.append(bits)
        return impl.pack_int4(codes) if bits == 4 else original_pack(codes, bits)

    monkeypatch.setattr(rtn, "quantize_groupwise", impl.quantize_groupwise)
    monkeypatch.setattr(linear, "pack", learner_pack)
    theirs = quantized_llm()
    assert calls and set(calls) == {4}, "minillm did not pack through the swapped-in function"
    for (name, a), (_, b) in zip(ours.engine.model.named_buffers(), theirs.engine.model.named_buffers()):
        assert torch.equal(a, b), f"{name} differs from minillm's own"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [100, 200, 300, 400]]
    assert run_requests(theirs.engine, prompts, params) == run_requests(ours.engine, prompts, params)
