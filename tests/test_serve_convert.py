"""The server's plain stream chunks, spliced into a template, are the bytes pydantic writes for the same chunk.

``convert.PlainChunks`` skips building a model per chunk; these tests hold it to the reference path
(``completion_chunk`` / ``chat_chunk`` dumped by pydantic) on any text: quotes, backslashes, control characters,
non-ASCII, emoji, the placeholder character itself, and model names that contain it.
"""

from __future__ import annotations

from functools import partial

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.serve import convert

TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # no lone surrogates: not valid UTF-8


def reference(chunk, index: int, text: str) -> str:
    return chunk(index, text).model_dump_json(exclude_none=True)


@settings(max_examples=300)
@given(texts=st.lists(TEXT, min_size=1, max_size=6), index=st.integers(0, 3),
       model=st.sampled_from(["SmolLM2-135M-Instruct", "a \"quoted\" \\ name", "has \ue000 the placeholder"]),
       chat=st.booleans())
def test_plain_chunks_are_the_bytes_pydantic_writes(texts, index, model, chat):
    base = dict(id="chatcmpl-0a1b" if chat else "cmpl-0a1b", created=1765000000, model=model)
    chunk = partial(convert.chat_chunk if chat else convert.completion_chunk, base)
    plain = convert.PlainChunks(chunk)
    for text in texts:  # the first builds the template, the rest splice into it
        assert plain.json(index, text) == reference(chunk, index, text)


def test_a_finished_or_logprob_chunk_is_not_plain():
    """What the template cannot hold goes through pydantic: the finish reason, and logprobs when asked for."""
    from minillm.request import CompletionOutput, RequestMetrics, RequestOutput

    base = dict(id="cmpl-0a1b", created=1765000000, model="m")
    plain = convert.PlainChunks(partial(convert.completion_chunk, base))
    running = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "Hello", [5])], False, RequestMetrics(0.0))
    done = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "Hello there", [5, 6], "length")], True,
                         RequestMetrics(0.0))
    deltas = convert.ChoiceDeltas()
    first = convert.completion_chunks(running, deltas, base, None, None, plain)
    last = convert.completion_chunks(done, deltas, base, None, None, plain)
    assert first == [reference(plain.chunk, 0, "Hello")]
    assert last == [convert.completion_chunk(base, 0, " there", None, "length").model_dump_json(exclude_none=True)]
    assert '"finish_reason":"length"' in last[0]
