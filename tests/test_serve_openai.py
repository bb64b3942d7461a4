"""The server through the official ``openai`` client on 127.0.0.1: completions and chat equal the offline engine,
streams reassemble to the whole response, stop strings, seeds, usage, n > 1 and logprobs (against transformers'
log-softmax), and every error as OpenAI's envelope with the right status."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import httpx
import openai
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.serve import convert
from minillm.tokenizer import encode_chat
from serving import (ENGINE_KWARGS, MODEL_NAME, async_llm, engine_paused, make_async_llm, server,  # noqa: F401
                     tiny_chat_model_dir, wait_for_empty_engine, wait_until)

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
# Extensions the openai client passes through extra_body: no EOS, so every answer has exactly max_tokens tokens.
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), **ENGINE_KWARGS)


def greedy_text(offline, prompt, max_tokens: int) -> tuple[str, list[int]]:
    out = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


def test_models_health_version(client, server, async_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME] and models[0].max_model_len == async_llm.max_model_len
    assert httpx.get(f"http://{server.host}:{server.port}/health").json() == {"status": "ok"}
    import minillm
    assert httpx.get(f"http://{server.host}:{server.port}/version").json() == {"version": minillm.__version__}


def test_completion_equals_the_offline_engine_and_counts_tokens(client, offline):
    text, token_ids = greedy_text(offline, PROMPT, 20)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                         extra_body=NO_EOS)
    choice = response.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    prompt_tokens = len(offline.tokenizer.encode(PROMPT))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, len(token_ids))
    assert response.usage.total_tokens == prompt_tokens + 20


def test_token_id_prompt(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    text, _ = greedy_text(offline, ids, 8)
    response = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert response.choices[0].text == text and response.usage.prompt_tokens == len(ids)


def test_chat_applies_the_template(client, offline):
    prompt = encode_chat(offline.tokenizer, MESSAGES)
    text, token_ids = greedy_text(offline, prompt, 16)
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=16,
                                              temperature=0, extra_body=NO_EOS)
    assert response.choices[0].message.content == text and response.choices[0].message.role == "assistant"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), len(token_ids))


def test_chat_without_a_limit_stops_at_max_model_len(client, async_llm):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, extra_body=NO_EOS)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == async_llm.max_model_len


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_reassembles_to_the_whole_response(client, endpoint):
    common = dict(model=MODEL_NAME, max_tokens=24, temperature=0, extra_body=NO_EOS)
    if endpoint == "completions":
        whole = client.completions.create(prompt=PROMPT, **common)
        chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                                **common))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        expected = whole.choices[0].text
    else:
        whole = client.chat.completions.create(messages=MESSAGES, **common)
        chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True,
                                                     stream_options={"include_usage": True}, **common))
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        expected = whole.choices[0].message.content
    assert len(pieces) > 5 and "".join(pieces) == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_sends_none(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_stop_string_cuts_the_text(client, offline):
    full, _ = greedy_text(offline, PROMPT, 40)
    at = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip())
    stop = full[at:at + 3]
    for stream in (False, True):
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                             stop=[stop, "\x00never"], stream=stream, extra_body=NO_EOS)
        if stream:
            chunks = list(response)
            text, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
        else:
            text, last = response.choices[0].text, response.choices[0]
        assert text == full[:at] and last.finish_reason == "stop" and last.stop_reason == stop


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body=NO_EOS).choices[0].text
    first = sample(1234)
    assert sample(1234) == first
    assert sample(1235) != first


def test_n_choices_each_with_their_tokens(client):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0,
                                         seed=7, extra_body=NO_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1
    assert response.usage.completion_tokens == 3 * 6
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0,
                                            seed=7, stream=True, extra_body=NO_EOS))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert streamed == {c.index: c.text for c in response.choices}


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position that predicts an output token: [len(output), vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]


def test_completion_logprobs_match_transformers(client, offline, hf_model):
    prompt_ids = offline.tokenizer.encode(PROMPT)
    _, output_ids = greedy_text(offline, PROMPT, 8)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                         extra_body=NO_EOS)
    logprobs = response.choices[0].logprobs
    reference = reference_logprobs(hf_model, prompt_ids, output_ids)
    assert len(logprobs.token_logprobs) == 8
    expected = reference[torch.arange(8), torch.tensor(output_ids)]
    assert torch.allclose(torch.tensor(logprobs.token_logprobs), expected, atol=1e-4)
    for position, top in enumerate(logprobs.top_logprobs):
        values = sorted(top.values(), reverse=True)
        assert len(values) == 3
        assert torch.allclose(torch.tensor(values), reference[position].topk(3).values, atol=1e-4)
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(8)]


def test_chat_logprobs_streamed_and_whole(client, offline, hf_model):
    prompt_ids = encode_chat(offline.tokenizer, MESSAGES)
    _, output_ids = greedy_text(offline, prompt_ids, 6)
    common = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body=NO_EOS)
    content = client.chat.completions.create(**common).choices[0].logprobs.content
    reference = reference_logprobs(hf_model, prompt_ids, output_ids)
    assert len(content) == 6
    for position, entry in enumerate(content):
        assert abs(entry.logprob - reference[position, output_ids[position]].item()) < 1e-4
        assert [t.token for t in entry.top_logprobs][0] == entry.token  # greedy: the sampled token ranks first
        assert len(entry.top_logprobs) == 2 and bytes(entry.bytes).decode() == entry.token
    streamed = [e for c in client.chat.completions.create(stream=True, **common) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_prompt_logprobs(client, offline, hf_model):
    prompt_ids = offline.tokenizer.encode(PROMPT)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    positions = response.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    got = [positions[i][str(prompt_ids[i])]["logprob"] for i in range(1, len(prompt_ids))]
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4)


# -- errors ----------------------------------------------------------------------------------------


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(extra_body={"best_of": 2}), "best_of"),
    (dict(extra_body={"top_k": -7}), "top_k"),
])
def test_bad_parameter_is_400_naming_it(client, kwargs, param):
    error = error_of(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, **kwargs))
    assert error.status_code == 400 and error.body["param"] == param and error.body["type"] == "invalid_request_error"
    assert param in error.body["message"]


def test_unknown_model_is_404(client):
    error = error_of(lambda: client.completions.create(model="gpt-4", prompt=PROMPT))
    assert error.status_code == 404 and error.body["code"] == "model_not_found" and MODEL_NAME in error.body["message"]


def test_prompt_past_max_model_len_is_400(client, async_llm):
    long_prompt = list(range(10, 10 + async_llm.max_model_len))
    error = error_of(lambda: client.completions.create(model=MODEL_NAME, prompt=long_prompt))
    assert error.status_code == 400 and error.body["param"] == "prompt" and "max_model_len" in error.body["message"]
    error = error_of(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "word " * async_llm.max_model_len}]))
    assert error.status_code == 400 and error.body["param"] == "messages"


def test_priority_needs_the_priority_policy(client):
    error = error_of(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"priority": 3}))
    assert error.status_code == 400 and error.body["param"] == "priority"
    assert "scheduling_policy" in error.body["message"]


def test_chat_top_logprobs_needs_logprobs(client):
    error = error_of(lambda: client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, top_logprobs=2))
    assert error.status_code == 400 and error.body["param"] == "top_logprobs"


@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": 5}', b"[]", b'{"prompt": "x", "max_tokens": 1e999}'])
def test_malformed_bodies_are_400_envelopes(server, body):
    response = httpx.post(f"{server.url}/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_route_is_404_envelope(server):
    response = httpx.get(f"{server.url}/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_full_queue_is_503_with_retry_after_and_loses_nothing(client, async_llm):
    async_llm.max_waiting_requests = 1
    results = []
    first = threading.Thread(target=lambda: results.append(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, extra_body=NO_EOS)))
    try:
        with engine_paused(async_llm):
            first.start()
            wait_until(lambda: async_llm.num_waiting == 1)
            error = error_of(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5))
        first.join(60)
    finally:
        async_llm.max_waiting_requests = None
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert error.body["type"] == "server_busy"
    assert results[0].usage.completion_tokens == 5
    wait_for_empty_engine(async_llm)


def test_internal_error_is_500_and_the_server_goes_on(client, async_llm, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(convert, "completion_choices", broken)
    with caplog.at_level(logging.ERROR, logger="minillm.serve"):
        error = error_of(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3))
    assert error.status_code == 500 and error.body["type"] == "internal_error"
    assert any("cmpl-" in record.getMessage() for record in caplog.records)
    monkeypatch.setattr(convert, "completion_chunks", broken)
    with pytest.raises(openai.APIError, match="internal server error"):
        list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, stream=True))
    monkeypatch.undo()
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, extra_body=NO_EOS)
    assert response.usage.completion_tokens == 3
    wait_for_empty_engine(async_llm)


def test_every_engine_argument_is_a_serve_flag():
    from minillm.cli import build_parser
    from minillm.cli_args import engine_kwargs, parallel_kwargs

    args = build_parser().parse_args(["serve", "some/model", "--port", "9", "--max-waiting-requests", "4"])
    passed = set(engine_kwargs(args)) | set(parallel_kwargs(args)) | {"model"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= passed
    assert (args.model_tag, args.port, args.max_waiting_requests, args.batching) == ("some/model", 9, 4, "continuous")
    assert json.loads(json.dumps(vars(args), default=str))  # every value prints (recorded by benchmarks)
