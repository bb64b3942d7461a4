"""Bad input stops at the door: each argument of the public API is checked where it enters, with an error
naming the argument (``param``), the bad value and what would be valid, before anything is queued; values
at the edge of the valid range run to completion instead of failing inside a step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.validation import InvalidArgument

GREEDY = dict(temperature=0.0)


def random_prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def checked(tiny_llm, monkeypatch):
    """tiny_llm with a step that must not run: every call on it has to fail validation."""
    monkeypatch.setattr(tiny_llm.engine, "step", lambda: pytest.fail("a rejected call reached step()"))
    yield tiny_llm
    assert not tiny_llm.engine.requests and not tiny_llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def text_llm(tiny_text_model_dir):
    return LLM(str(tiny_text_model_dir), dtype="float32", device="cpu", max_model_len=64)


@contextlib.contextmanager
def rejects(error: type[Exception], param: str, *shown: str):
    """pytest.raises for minillm's own validation error about ``param``, whose message shows ``shown``."""
    with pytest.raises(error) as info:
        yield info
    assert isinstance(info.value, InvalidArgument), f"not minillm's validation: {info.value!r}"
    assert info.value.param == param
    for text in (param, *shown):
        assert text in str(info.value), (text, str(info.value))


# -- sampling parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 5e-324, 9.9e-6])
def test_tiny_positive_temperature_samples_greedily_without_losing_the_batch(tiny_llm, temperature):
    prompts = [random_prompt(1, 7), random_prompt(2, 5)]
    greedy, other = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY), SamplingParams(max_tokens=6, seed=3)
    tiny = dataclasses.replace(greedy, temperature=temperature)
    outs = tiny_llm.generate(prompts, [tiny, other], use_tqdm=False)
    expected = tiny_llm.generate(prompts, [greedy, other], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert len(outs[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_seed_outside_the_generator_range_is_rejected_when_built(seed):
    with rejects(ValueError, "seed", repr(seed), "2**64"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63, -1, 0])
def test_seeds_at_the_edge_of_the_range_run(tiny_llm, seed):
    params = SamplingParams(max_tokens=5, seed=seed, ignore_eos=True)
    first, again = (tiny_llm.generate([random_prompt(3, 6)], params, use_tqdm=False)[0] for _ in range(2))
    assert len(first.outputs[0].token_ids) == 5 and first.outputs[0].token_ids == again.outputs[0].token_ids


def test_top_k_beyond_the_vocabulary_keeps_all(tiny_llm):
    runs = [tiny_llm.generate([random_prompt(4, 6)], SamplingParams(max_tokens=6, seed=11, top_k=k, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids for k in (0, 512, 2**70)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 6


@pytest.mark.parametrize("field, value, error, shown", [
    ("stop", 5, TypeError, "5 (int)"), ("stop", [b"x"], TypeError, "b'x'"), ("stop", {"a"}, TypeError, "set"),
    ("stop", "a\ud800", ValueError, "surrogate"), ("stop_token_ids", [1.5], TypeError, "1.5"),
    ("stop_token_ids", [-1], ValueError, "-1"), ("stop_token_ids", 7, TypeError, "7 (int)"),
    ("max_tokens", 2.0, TypeError, "2.0"), ("max_tokens", np.int64(0), ValueError, "0"),
    ("temperature", "0.5", TypeError, "'0.5'"), ("temperature", math.inf, ValueError, "inf"),
    ("top_p", None, TypeError, "None"), ("top_k", 1.0, TypeError, "1.0"), ("ignore_eos", 1, TypeError, "1 (int)"),
    ("skip_special_tokens", None, TypeError, "None"),
])
def test_bad_sampling_fields_name_field_and_value(field, value, error, shown):
    with rejects(error, field, shown):
        SamplingParams(**{field: value})


def test_numpy_numbers_are_taken_as_python_ones():
    params = SamplingParams(max_tokens=np.int32(4), temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(7),
                            stop_token_ids=np.array([3, 4]).tolist())
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)
    assert params == SamplingParams(max_tokens=4, temperature=0.5, top_k=3, seed=7, stop_token_ids=[3, 4])


def test_sampling_params_stay_valid_after_construction():
    params = SamplingParams(max_tokens=4, stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0
    assert params.stop == ("x",) and not hasattr(params.stop, "append")
    assert dataclasses.replace(params, max_tokens=8).max_tokens == 8
    with rejects(ValueError, "max_tokens", "-1"):
        dataclasses.replace(params, max_tokens=-1)


# -- prompts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompts, shown", [
    (b"hi", "bytes"), ({5, 6, 7}, "set"), (range(5, 9), "range"), (None, "None"), (frozenset([5]), "frozenset"),
    ((t for t in [5, 6]), "generator"),
])
def test_prompts_that_are_no_prompts_are_refused(checked, prompts, shown):
    with rejects(TypeError, "prompts", shown):
        checked.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("prompt, shown", [
    ([True, False, True], "position 0 holds True"), ([5, 6.0], "position 1 holds 6.0"), ([[5, 6], [7, b"x"]], "b'x'"),
    ([5, None], "position 1 holds None"), ({"prompt_token_ids": {5, 6}}, "set"), ({"prompt": b"hi"}, "bytes"),
])
def test_bad_token_ids_name_position_and_value(checked, prompt, shown):
    with rejects(TypeError, "prompt", shown):
        checked.generate(prompt, use_tqdm=False)


@pytest.mark.parametrize("prompt, shown", [
    ({"prompt": "a", "prompt_token_ids": [5]}, "exactly one key"), ({"text": "a"}, "'text'"), ([-1, 5], "-1"),
    ("a\ud800b", "surrogate"),
])
def test_bad_prompt_values(checked, text_llm, prompt, shown):
    llm = text_llm if isinstance(prompt, str) else checked
    with rejects(ValueError, "prompt", shown):
        llm.generate(prompt, use_tqdm=False)
    assert not llm.engine.requests


def test_numpy_token_ids_run_as_python_ints(tiny_llm):
    prompt = random_prompt(5, 6)
    params = SamplingParams(max_tokens=4, **GREEDY)
    as_numpy = tiny_llm.generate([np.array(prompt).tolist(), list(np.array(prompt))], params, use_tqdm=False)
    plain = tiny_llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in as_numpy] == [plain.outputs[0].token_ids] * 2
    assert as_numpy[1].prompt_token_ids == prompt and type(as_numpy[1].prompt_token_ids[0]) is int


@pytest.mark.parametrize("priority, error, shown", [
    (["a"], TypeError, "'a'"), ([1.5], TypeError, "1.5"), (5, TypeError, "5"), ([1, 2], ValueError, "2 entries"),
    ([True], TypeError, "True"),
])
def test_bad_priority_is_refused_before_the_scheduler_sees_it(priority, error, shown):
    llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous",
              scheduling_policy="priority")
    with rejects(error, "priority", shown):
        llm.generate([random_prompt(6, 4)], priority=priority, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.mark.parametrize("sampling_params, error, shown", [
    ([], ValueError, "0 entries"), ({"max_tokens": 3}, TypeError, "dict"),
    ([SamplingParams(), None], TypeError, "None"),
])
def test_bad_sampling_params_argument(checked, sampling_params, error, shown):
    with rejects(error, "sampling_params", shown):
        checked.generate([random_prompt(7, 4), random_prompt(8, 4)], sampling_params, use_tqdm=False)


def test_use_tqdm_must_be_a_bool(checked):
    with rejects(TypeError, "use_tqdm", "'yes'"):
        checked.generate([random_prompt(7, 4)], use_tqdm="yes")


# -- chat and stream -------------------------------------------------------------------------------------


def test_chat_takes_openai_text_parts(text_llm):
    params = SamplingParams(max_tokens=6, **GREEDY)
    parts = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]
    with_parts = text_llm.chat([{"role": "user", "content": parts}], params)[0]
    as_string = text_llm.chat([{"role": "user", "content": "Name a color.\nOne word."}], params)[0]
    assert with_parts.prompt_token_ids == as_string.prompt_token_ids
    assert with_parts.outputs[0].token_ids == as_string.outputs[0].token_ids


@pytest.mark.parametrize("messages, error, shown", [
    ([{"role": "user", "content": 5}], TypeError, "5 (int)"),
    ([{"role": "user", "content": None}], TypeError, "None"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ValueError, "image_url"),
    ([{"role": "user", "content": {"text": "hi"}}], TypeError, "dict"),
    ([{"role": 3, "content": "hi"}], ValueError, "3 (int)"),
    ([{"role": "user", "content": "hi", "name": "x"}], ValueError, "'name'"),
    ([], ValueError, "at least one"), ([[]], ValueError, "at least one"), ("hi", TypeError, "'hi'"),
    ([[{"role": "user", "content": "hi"}], "hi"], TypeError, "'hi'"),
])
def test_bad_chat_messages_are_refused_before_the_template(text_llm, monkeypatch, messages, error, shown):
    monkeypatch.setattr(text_llm.tokenizer, "apply_chat_template", lambda *a, **k: pytest.fail("template ran"))
    with rejects(error, "messages", shown):
        text_llm.chat(messages, SamplingParams(max_tokens=3))
    assert not text_llm.engine.requests


def test_stream_checks_its_arguments_when_called_and_queues_when_iterated(text_llm):
    with rejects(ValueError, "prompt", "empty"):
        text_llm.stream("")
    with rejects(TypeError, "prompt", "list"):
        text_llm.stream(["Hello", "there"])
    with rejects(TypeError, "sampling_params", "dict"):
        text_llm.stream("Hello", {"max_tokens": 3})
    stream = text_llm.stream("Hello", SamplingParams(max_tokens=4, **GREEDY))
    assert not text_llm.engine.requests  # nothing queued until the first next()
    text = "".join(stream)
    assert text == text_llm.generate("Hello", SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0].text
    assert not text_llm.engine.requests


# -- LLM(...) and config.json -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, param", [
    (dict(max_num_seqs=True), TypeError, "max_num_seqs"), (dict(device=5), TypeError, "device"),
    (dict(seed=2**64), ValueError, "seed"), (dict(gpu_memory_utilization="0.5"), TypeError, "gpu_memory_utilization"),
    (dict(batch_timeout=math.nan), ValueError, "batch_timeout"), (dict(model=b"tiny"), TypeError, "model"),
    (dict(max_model_len=64.0), TypeError, "max_model_len"),
])
def test_bad_llm_arguments_fail_before_the_model_loads(monkeypatch, kwargs, error, param):
    import minillm.engine

    monkeypatch.setattr(minillm.engine, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with rejects(error, param):
        LLM(**{"model": "tiny", "load_format": "dummy", **kwargs})


@pytest.mark.parametrize("field, value", [("hidden_size", "64"), ("num_hidden_layers", 2.5), ("vocab_size", -3),
                                          ("rms_norm_eps", "tiny"), ("eos_token_id", "2")])
def test_config_json_fields_of_the_wrong_kind_name_the_field(tiny_text_model_dir, tmp_path, field, value):
    for file in tiny_text_model_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=rf"config.json: .*{field}.*{value!r}"):
        LLM(str(tmp_path), dtype="float32", device="cpu")
