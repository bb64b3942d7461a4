"""The API's boundary, fuzzed: arbitrary values (wrong types, NaN and infinities, extreme integers, empty and
huge containers, unicode with lone surrogates, numpy scalars) at every public argument of ``SamplingParams``,
``generate``, ``chat`` and ``stream``, mixed with valid requests in the same call, on static and continuous
batching. Whatever comes in, a call either

- fails with minillm's own validation error (a ValueError or TypeError naming the argument in ``param``) before
  anything is queued or any step runs, after which its valid requests run as they run alone, or
- completes, every request finished, its valid requests with the outputs they have alone,

and afterwards the engine holds no request and no KV block, and no exception ever came out of ``step()``.

``SamplingParams``' fields are enumerated from the dataclass, so a field added later is fuzzed too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.validation import is_single_prompt

# A valid request may run up to max_model_len tokens: no deadline an example.
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID_PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
VALID_PROMPTS = ["The capital of France is", [5, 9, 40, 41], (12, 13, 14), {"prompt": "def fibonacci(n):"},
                 {"prompt_token_ids": [30, 31, 32, 33, 34]}]
VALID_CONVERSATIONS = [[{"role": "user", "content": "Name a color."}],
                       [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]]
EXTREME_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**40]
EXTREME_FLOATS = [0.0, -0.0, 1e-5, 9.9e-6, 1e-40, 5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf]

plausible_text = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12)
unicode_text = st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                       max_size=12)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(EXTREME_INTS), st.floats(),
    st.sampled_from(EXTREME_FLOATS), unicode_text, st.binary(max_size=6), st.integers(-2**63, 2**63 - 1).map(np.int64),
    st.floats(width=32).map(np.float32), st.just(np.bool_(True)), st.just(object()), st.just(range(3)),
)
junk = st.one_of(
    st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.sets(st.integers(-3, 400), max_size=4),
        st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "role", "content", "type", "text", "x"]),
                        inner, max_size=3)), max_leaves=8),
    st.sampled_from([[], (), {}, "", [7] * 5000, "x" * 20000, [[]], [{}]]),  # empty and huge
)


def edge(default) -> st.SearchStrategy:
    """The edges of a field's valid range and beyond, by the kind of its default (None or an empty tuple says
    little of the kind: seeds, counts and token ids are integers)."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, float):
        return st.sampled_from(EXTREME_FLOATS)
    return st.sampled_from(EXTREME_INTS)


def near(default) -> st.SearchStrategy:
    """Ordinary values of the default's kind."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-1, 40)
    if isinstance(default, float):
        return st.floats(0.0, 2.0)
    return st.one_of(st.none(), st.integers(-2, 40), st.lists(st.integers(0, 400), max_size=3),
                     st.lists(plausible_text, max_size=3), st.dictionaries(st.integers(0, 400), st.floats(-5.0, 5.0),
                                                                           max_size=2))


@st.composite
def sampling_kwargs(draw, kind: str) -> dict:
    """A few of SamplingParams' fields (whatever fields it has), each an ordinary value of its kind
    (``near``), an edge value (``edge``), or any of those or anything at all (``wild``)."""
    defaults = SamplingParams()
    names = draw(st.lists(st.sampled_from([f.name for f in dataclasses.fields(SamplingParams)]), max_size=2,
                          unique=True))
    values = {"near": lambda d: near(d), "edge": lambda d: st.one_of(edge(d), near(d)),
              "wild": lambda d: st.one_of(near(d), edge(d), junk)}[kind]
    return {name: draw(values(getattr(defaults, name))) for name in names}


def own_validation(error: BaseException) -> bool:
    """minillm's own rejection: a ValueError or TypeError naming the argument in ``param``
    (``validation.InvalidArgument`` and its TypeError twin are such errors)."""
    return isinstance(error, (ValueError, TypeError)) and isinstance(getattr(error, "param", None), str)


def build_params(kwargs: dict):
    """SamplingParams(**kwargs) when valid; else the property of its own boundary is checked, and the kwargs
    dict itself goes on as a (bad) sampling_params value."""
    try:
        return SamplingParams(**kwargs)
    except Exception as e:
        assert own_validation(e) and e.param in kwargs, f"SamplingParams(**{kwargs!r}) raised {e!r}"
        return kwargs


# Plausible values are of the right kind, at and beyond the edges of the valid range: many such calls
# complete, so the edge values reach step(). Wild values are anything at all.
plausible_ids = st.lists(st.integers(0, 357), min_size=1, max_size=6)
plausible_params = st.one_of(sampling_kwargs("near"), sampling_kwargs("edge"), sampling_kwargs("edge")).map(
    build_params)
wild_params = st.one_of(sampling_kwargs("wild").map(build_params), junk)
plausible_prompt = st.one_of(plausible_text, plausible_ids, plausible_ids.map(lambda ids: tuple(map(np.int64, ids))),
                             st.fixed_dictionaries({"prompt": plausible_text}),
                             st.fixed_dictionaries({"prompt_token_ids": plausible_ids}))
wild_prompt = st.one_of(
    junk, st.lists(st.integers(-3, 400), max_size=6), unicode_text,
    st.fixed_dictionaries({"prompt": st.one_of(unicode_text, junk)}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(st.lists(st.integers(-3, 400), max_size=5), junk)}),
)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plausible_text}), min_size=1, max_size=2)
plausible_conversation = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                         "content": st.one_of(plausible_text, text_parts)}),
                                  min_size=1, max_size=3)
wild_message = st.one_of(junk, st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "User", ""]), junk),
    "content": st.one_of(unicode_text, junk, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.one_of(unicode_text, junk)}), max_size=2))}))
wild_conversation = st.one_of(junk, st.lists(wild_message, max_size=3))


class Watched:
    """An LLM whose engine counts its steps and records anything raised from inside one."""

    def __init__(self, llm: LLM):
        self.llm, self.steps, self.step_errors, self.solo = llm, 0, [], {}
        step = llm.engine.step

        def watched_step():
            self.steps += 1
            try:
                return step()
            except BaseException as e:
                self.step_errors.append(e)
                raise
        llm.engine.step = watched_step

    def assert_clean(self) -> None:
        engine = self.llm.engine
        assert not self.step_errors, f"step() raised: {self.step_errors[0]!r}"
        assert not engine.requests and not engine.has_unfinished()
        if engine.config.batching == "continuous":
            allocator = engine.block_tables.allocator
            assert allocator.num_free == allocator.num_blocks, "a KV block was left behind"

    def solo_tokens(self, key: str, run) -> list[int]:
        """What a valid request gives alone (cached): the reference its runs in mixed calls must equal."""
        if key not in self.solo:
            self.solo[key] = run()
        return self.solo[key]


@pytest.fixture(scope="module")
def llms(tiny_text_model_dir):
    built = {}
    for batching, policy in (("static", "fcfs"), ("continuous", "priority")):
        llm = LLM(str(tiny_text_model_dir), dtype="float32", device="cpu", batching=batching, max_model_len=96,
                  max_num_seqs=4, scheduling_policy=policy)
        llm.engine.model.lm_head.weight.mul_(30)  # decisive argmaxes: batch mates cannot flip a greedy choice
        built[batching] = Watched(llm)
    return built


@st.composite
def entries(draw, valid: st.SearchStrategy, plausible: st.SearchStrategy, wild: st.SearchStrategy) -> list:
    """A call's requests, (prompt, params, is_valid): valid ones (a valid prompt, VALID_PARAMS) mixed with
    plausible ones, or (in a wild call) with anything at all."""
    if draw(st.booleans()):
        prompts, params = st.one_of(valid, plausible), st.one_of(st.just(VALID_PARAMS), plausible_params,
                                                                 plausible_params)
    else:
        prompts, params = st.one_of(valid, plausible, wild), st.one_of(st.just(VALID_PARAMS), plausible_params,
                                                                      wild_params)
    fuzzed = st.tuples(prompts, params, st.just(False))
    entry = st.one_of(valid.map(lambda p: (p, VALID_PARAMS, True)), fuzzed, fuzzed)
    return draw(st.lists(entry, min_size=1, max_size=5))


def check_call(watched: Watched, call, requests, solo_run, one_per_entry: bool) -> None:
    """Run ``call``: it fails at the door or completes. Its valid requests (``requests`` entries marked valid)
    give their solo outputs either way: in the call's outputs when ``one_per_entry`` (the call's prompts are
    the entries, one output each), or when re-run after a failure."""
    steps = watched.steps
    solo = lambda prompt: watched.solo_tokens(repr(prompt), lambda: solo_run([prompt])[0].outputs[0].token_ids)
    try:
        outputs = call()
    except Exception as e:
        assert own_validation(e), f"not minillm's validation: {e!r}"
        assert watched.steps == steps, "a call that failed validation ran a step"
        event(f"rejected: {e.param}")  # --hypothesis-show-statistics shows the mix
        watched.assert_clean()
        valid = [prompt for prompt, _, ok in requests if ok]
        if valid:  # not lost: they run, as they run alone
            assert [o.outputs[0].token_ids for o in solo_run(valid)] == [solo(p) for p in valid]
            watched.assert_clean()
        return
    event("completed")
    watched.assert_clean()
    assert outputs and all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    if one_per_entry:
        assert len(outputs) == len(requests)
        for output, (prompt, params, ok) in zip(outputs, requests):
            assert len(output.outputs[0].token_ids) <= params.max_tokens
            if ok:
                assert output.outputs[0].token_ids == solo(prompt)


@settings(FUZZ, max_examples=400)
@given(batching=st.sampled_from(["static", "continuous"]),
       requests=entries(st.sampled_from(VALID_PROMPTS), plausible_prompt, wild_prompt),
       shape=st.sampled_from(["entries"] * 5 + ["prompts", "sampling_params", "priority", "use_tqdm"]), extra=junk)
def test_generate_fails_at_the_door_or_completes(llms, batching, requests, shape, extra):
    watched = llms[batching]
    arguments = dict(prompts=[p for p, _, _ in requests], sampling_params=[sp for _, sp, _ in requests],
                     use_tqdm=False)
    if shape != "entries":
        arguments[shape] = extra  # one argument anything at all
    # A list of scalars is one prompt's token ids: then the entries are not one prompt each.
    one_per_entry = shape in ("entries", "priority", "use_tqdm") and not is_single_prompt(arguments["prompts"])
    check_call(watched, lambda: watched.llm.generate(**arguments), requests,
               lambda valid: watched.llm.generate(valid, VALID_PARAMS, use_tqdm=False), one_per_entry)


@settings(FUZZ, max_examples=200)
@given(batching=st.sampled_from(["static", "continuous"]),
       requests=entries(st.sampled_from(VALID_CONVERSATIONS), plausible_conversation, wild_conversation),
       junk_messages=st.one_of(st.none(), st.none(), junk))
def test_chat_fails_at_the_door_or_completes(llms, batching, requests, junk_messages):
    watched = llms[batching]
    messages = [c for c, _, _ in requests] if junk_messages is None else junk_messages
    # Entries that are all dicts would read as the messages of one conversation: not one output each.
    one_per_entry = junk_messages is None and not isinstance(messages[0], dict)
    check_call(watched, lambda: watched.llm.chat(messages, [sp for _, sp, _ in requests]), requests,
               lambda valid: watched.llm.chat(valid, VALID_PARAMS), one_per_entry)


@settings(FUZZ, max_examples=200)
@given(batching=st.sampled_from(["static", "continuous"]),
       prompt=st.one_of(st.sampled_from(VALID_PROMPTS), plausible_prompt, wild_prompt),
       params=st.one_of(st.none(), st.just(VALID_PARAMS), plausible_params, wild_params), stop_after=st.integers(0, 4))
def test_stream_fails_at_the_door_or_completes(llms, batching, prompt, params, stop_after):
    watched = llms[batching]
    steps = watched.steps
    try:
        stream = watched.llm.stream(prompt, params)
    except Exception as e:
        assert own_validation(e), f"not minillm's validation: {e!r}"
        assert watched.steps == steps, "a stream that failed validation ran a step"
        event(f"rejected: {e.param}")
        watched.assert_clean()
        return
    event("streamed")
    pieces, completed = [], True
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == stop_after:
            stream.close()  # a consumer that stops early
            completed = False
            break
    watched.assert_clean()
    if completed and params is VALID_PARAMS:
        assert "".join(pieces) == watched.llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        watched.assert_clean()
