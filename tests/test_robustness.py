"""Bad input never breaks the engine for later calls, interleaved consumers never hang, and the final
text always equals the decoded tokens."""

import json
import math
import re

import pytest

from minillm import LLM, SamplingParams


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=None), dict(seed="abc"),
                                 dict(max_tokens=True), dict(stop_token_ids=["x"]), dict(top_p=math.nan)])
def test_bad_sampling_values_are_rejected_with_their_value(bad):
    with pytest.raises(ValueError, match=re.escape(repr(next(iter(bad.values()))))):
        SamplingParams(**bad)


def test_engine_keeps_working_after_rejected_input(tiny_llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        tiny_llm.generate([[5, 6, 7]], {"max_tokens": 3})
    with pytest.raises(ValueError, match="position 3 holds 999999"):
        tiny_llm.generate([[5, 6, 7, 999999]])
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        tiny_llm.generate([[5, 6, 7]], priority=[1])
    params = (SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=5, temperature=0))
    outs = tiny_llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)  # a tuple of params works
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    assert not tiny_llm.engine.has_unfinished()


def test_interleaved_streams_and_generate_all_finish(smollm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a, b = smollm.stream("One, two,", params), smollm.stream("Red, green,", params)
    first = next(a)
    middle = smollm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    texts = [first + "".join(a), "".join(b)]
    expected = smollm.generate(["One, two,", "Red, green,"], params, use_tqdm=False)
    assert texts == [o.outputs[0].text for o in expected]
    assert middle[0].finished and not smollm.engine.has_unfinished()


def test_stream_needs_a_tokenizer(tiny_llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        next(tiny_llm.stream([5, 6, 7]))


@pytest.mark.parametrize("max_tokens", range(1, 9))
def test_final_text_is_the_decoded_tokens_even_when_cut_mid_character(smollm, max_tokens):
    prompt = smollm.tokenizer.encode("Emoji party: 🎉🥳🎊🎈 and café, naïve, 日本語:")
    out = smollm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert out.text == smollm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_corrupt_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config.json lacks the field '\w+'"):
        LLM(str(tmp_path))
