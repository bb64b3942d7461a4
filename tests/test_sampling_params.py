"""The OpenAI-style sampling knobs, without a model: each parameter's validation (a ValueError naming it, with
``.param`` set), and the logits processors (penalties, logit bias, min-p) against their formulas and against
transformers' own repetition-penalty processor, on random logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from minillm import SamplingParams
from minillm.logits_processors import adjust_logits, apply_penalties, token_counts
from minillm.request import Request
from minillm.sampling import min_p_filter

VOCAB = 50


@pytest.mark.parametrize("kwargs, shown", [
    (dict(n=0), "0"), (dict(n=129), "129"), (dict(n=1.5), "1.5"), (dict(n=True), "True"),
    (dict(presence_penalty=2.5), "2.5"), (dict(presence_penalty=float("nan")), "nan"),
    (dict(frequency_penalty=-2.01), "-2.01"), (dict(frequency_penalty="1"), "'1'"),
    (dict(repetition_penalty=0.0), "0.0"), (dict(repetition_penalty=-1), "-1"),
    (dict(repetition_penalty=float("inf")), "inf"),
    (dict(min_p=-0.1), "-0.1"), (dict(min_p=1.5), "1.5"),
    (dict(logit_bias={5: 101.0}), "101.0"), (dict(logit_bias={5: -100.5}), "-100.5"),
    (dict(logit_bias={-1: 1.0}), "-1"), (dict(logit_bias={"5": 1.0}), "'5'"), (dict(logit_bias=[(5, 1.0)]), "5"),
    (dict(logprobs=21), "21"), (dict(logprobs=-1), "-1"), (dict(logprobs=2.0), "2.0"),
    (dict(prompt_logprobs=100), "100"),
])
def test_new_params_are_validated(kwargs, shown):
    (field, _), = kwargs.items()
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message and shown in message, message
    assert info.value.param == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(seed="x"), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
])
def test_existing_params_name_themselves_in_param(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_the_limits_themselves_are_valid():
    params = SamplingParams(n=128, presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=0.01, min_p=1.0,
                            logit_bias={0: -100, 7: 100.0}, logprobs=20, prompt_logprobs=0)
    assert params.adjusts_logits and params.one_token_at_a_time
    plain = SamplingParams(min_p=0.5, logit_bias={})  # min-p alone needs no history: multi-step may run it
    assert not plain.adjusts_logits and not plain.one_token_at_a_time


def request_with(prompt: list[int], output: list[int], **params) -> Request:
    request = Request("r", None, prompt, SamplingParams(**params))
    request.output_token_ids = list(output)
    return request


def random_tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 12, (n,), generator=generator).tolist()  # a small range: tokens repeat


def repeating_batch(seed: int, rows: int, repetition_penalty: float) -> tuple[torch.Tensor, list[Request]]:
    """Random logits and requests whose prompts and outputs repeat tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=generator) * 4
    return logits, [request_with(random_tokens(generator, 7), random_tokens(generator, 5),
                                 repetition_penalty=repetition_penalty) for _ in range(rows)]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers_processor(penalty):
    logits, requests = repeating_batch(1, 3, penalty)
    ours = apply_penalties(logits, requests)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row, request in enumerate(requests):
        theirs = processor(torch.tensor([request.all_token_ids]), logits[row:row + 1].clone())[0]
        torch.testing.assert_close(ours[row], theirs, rtol=0, atol=0)
        seen = set(request.all_token_ids)
        assert seen and all(ours[row, t] != logits[row, t] for t in seen)  # it did something to every seen token


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-40])
def test_a_repetition_penalty_below_fp32_range_keeps_logits_finite(penalty):
    """A valid float > 0 that fp32 rounds to zero (found by fuzzing the server) must not make NaN probabilities."""
    logits, requests = repeating_batch(3, 2, penalty)
    ours = apply_penalties(logits, requests)
    assert torch.isfinite(ours).all()
    assert not torch.isnan(torch.softmax(ours, dim=-1)).any()
    for row, request in enumerate(requests):  # seen tokens with positive logits rise to the top
        rising = [t for t in set(request.all_token_ids) if logits[row, t] > 0]
        assert rising and ours[row].argmax().item() in rising


def test_frequency_and_presence_penalties_are_openai_formula():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=generator) * 4
    settings = [(0.7, 0.0), (0.0, -1.2), (1.5, 0.4)]  # (frequency, presence)
    requests = [request_with(random_tokens(generator, 6), random_tokens(generator, 9), frequency_penalty=f,
                             presence_penalty=p) for f, p in settings]
    ours = apply_penalties(logits, requests)
    for row, (request, (frequency, presence)) in enumerate(zip(requests, settings)):
        expected = logits[row].clone()
        for token, count in Counter(request.output_token_ids).items():  # over generated tokens only
            expected[token] -= count * frequency + presence
        torch.testing.assert_close(ours[row], expected)
        prompt_only = set(request.prompt_token_ids) - set(request.output_token_ids)
        assert all(ours[row, t] == logits[row, t] for t in prompt_only)


def test_logit_bias_adds_to_the_named_tokens():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=generator)
    biases = [{3: 100.0, 17: -2.5}, {0: -100.0}]
    ours = apply_penalties(logits, [request_with([1], [], logit_bias=b) for b in biases])
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            expected[row, token] += value
    torch.testing.assert_close(ours, expected)
    assert ours[0].argmax() == 3 and ours[1].argmin() == 0


def test_adjust_logits_touches_only_the_rows_that_ask():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, VOCAB, generator=generator)
    before = logits.clone()
    requests = [request_with([1, 2], [3], temperature=0.0), request_with([1, 2], [3], presence_penalty=1.0),
                request_with([4], [4, 4], temperature=0.5), request_with([5], [6], logit_bias={9: 3.0})]
    rows = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    assert rows == [1, 3]
    adjusted = adjust_logits(logits, requests, rows)
    assert torch.equal(logits, before)  # the input (perhaps a CUDA graph's buffer) is left alone
    assert torch.equal(adjusted[[0, 2]], before[[0, 2]])
    torch.testing.assert_close(adjusted[[1, 3]], apply_penalties(before[[1, 3]], [requests[1], requests[3]]))
    assert adjusted[1, 3] == before[1, 3] - 1.0 and adjusted[3, 9] == before[3, 9] + 3.0


def test_token_counts():
    counts = token_counts([[1, 1, 4], [], [0, 4, 4, 4]], 6, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 0, 1, 0], [0] * 6, [1, 0, 0, 0, 3, 0]]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    filtered = min_p_filter(logits, min_p)
    probs = logits.softmax(-1)
    for row in range(4):
        keep = probs[row] >= min_p[row] * probs[row].max()
        assert torch.equal(filtered[row][keep], logits[row][keep])
        assert torch.isinf(filtered[row][~keep]).all()
    assert (~torch.isinf(filtered[0])).all() and (~torch.isinf(filtered[3])).sum() == 1
    assert 1 < (~torch.isinf(filtered[1])).sum() < VOCAB
