"""Between OpenAI's shapes and minillm's: an API request becomes ``SamplingParams``; a ``RequestOutput``
becomes choices, usage and logprobs, whole or as the stream of deltas a client reads chunk by chunk.

Engine outputs are cumulative (each holds all text and tokens so far), so a stream remembers, per choice, how
much text and how many tokens it has sent, and sends the rest. Logprobs arrive from the engine as, per
generated token, a dict of token id -> ``Logprob(logprob, rank, decoded_token)`` holding the top-k and the
sampled token; both OpenAI formats (completions' parallel lists, chat's list of objects) are drawn from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from minillm.request import CompletionOutput, RequestOutput, SamplingParams
from minillm.serve.protocol import (COMPLETION_MAX_TOKENS, AssistantMessage, ChatChoice, ChatChunkChoice,
                                    ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatLogprobs, ChatMessage,
                                    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest,
                                    PromptLogprob, PromptLogprobs, SamplingFields, TokenLogprob, TopLogprob, Usage)


class InvalidRequest(ValueError):
    """A request the API rejects with 400; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# Request fields that SamplingParams takes under the same name, when the client set them.
SAME_NAME_FIELDS = ("temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "prompt_logprobs")


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for an API request; fields the client left out keep the engine's defaults.
    ``max_tokens`` and ``logprobs`` come resolved by the caller (their names differ between the endpoints)."""
    kwargs = {name: getattr(request, name) for name in SAME_NAME_FIELDS if getattr(request, name) is not None}
    if request.logit_bias is not None:  # the schema holds its keys to digits
        kwargs["logit_bias"] = {int(token): bias for token, bias in request.logit_bias.items()}
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return SamplingParams(max_tokens=max_tokens, **kwargs)


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    max_tokens = COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    return sampling_params(request, max_tokens, request.logprobs)


def chat_sampling_params(request: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Chat's ``max_completion_tokens`` (or the older ``max_tokens``) defaults to what the context leaves;
    ``logprobs=true`` with ``top_logprobs=k`` asks the engine for k alternatives per token."""
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = request.max_completion_tokens or request.max_tokens or max(1, max_model_len - num_prompt_tokens)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return sampling_params(request, max_tokens, logprobs)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: role and content as one string."""
    def text(content) -> str:
        return content if isinstance(content, str) else "".join(part.text for part in content)
    return [{"role": m.role, "content": text(m.content)} for m in messages]


def usage(output: RequestOutput) -> Usage:
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- logprobs -------------------------------------------------------------------------------------


def _token_text(tokenizer, token_id: int, logprob) -> str:
    if getattr(logprob, "decoded_token", None) is not None:
        return logprob.decoded_token
    return "" if tokenizer is None else tokenizer.decode([token_id])


def _ranked(position: dict, top: int) -> list[tuple[int, object]]:
    """The top ``top`` entries of one position, most likely first (the sampled token may rank below them)."""
    return sorted(((token, lp) for token, lp in position.items() if lp.rank <= top), key=lambda item: item[1].rank)


def completion_logprobs(tokenizer, token_ids: list[int], positions: list[dict], top: int,
                        text_offset: int) -> CompletionLogprobs:
    """Completions' format for the tokens ``token_ids`` (their logprob dicts ``positions``); offsets count
    from ``text_offset``, the characters that came before them."""
    result = CompletionLogprobs()
    for token, position in zip(token_ids, positions):
        text = _token_text(tokenizer, token, position.get(token))
        result.tokens.append(text)
        result.token_logprobs.append(position[token].logprob if token in position else None)
        result.top_logprobs.append({_token_text(tokenizer, t, lp): lp.logprob for t, lp in _ranked(position, top)})
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def chat_logprobs(tokenizer, token_ids: list[int], positions: list[dict], top: int) -> ChatLogprobs:
    def entry(token: int, lp) -> TopLogprob:
        text = _token_text(tokenizer, token, lp)
        return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")))

    content = []
    for token, position in zip(token_ids, positions):
        sampled = entry(token, position[token])
        content.append(TokenLogprob(**sampled.model_dump(),
                                    top_logprobs=[entry(t, lp) for t, lp in _ranked(position, top)]))
    return ChatLogprobs(content=content)


def prompt_logprobs(output: RequestOutput) -> PromptLogprobs | None:
    positions = getattr(output, "prompt_logprobs", None)
    if positions is None:
        return None
    return [None if p is None else {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                          decoded_token=lp.decoded_token) for t, lp in p.items()}
            for p in positions]


# -- whole responses ------------------------------------------------------------------------------


def completion_choices(output: RequestOutput, tokenizer, top_logprobs: int | None) -> list[CompletionChoice]:
    prompts = prompt_logprobs(output)
    return [CompletionChoice(
        index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason, prompt_logprobs=prompts,
        logprobs=None if top_logprobs is None or c.logprobs is None else
        completion_logprobs(tokenizer, c.token_ids, c.logprobs, top_logprobs, 0)) for c in output.outputs]


def chat_choices(output: RequestOutput, tokenizer, top_logprobs: int | None) -> list[ChatChoice]:
    prompts = prompt_logprobs(output)
    return [ChatChoice(
        index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
        stop_reason=c.stop_reason, prompt_logprobs=prompts,
        logprobs=None if top_logprobs is None or c.logprobs is None else
        chat_logprobs(tokenizer, c.token_ids, c.logprobs, top_logprobs)) for c in output.outputs]


# -- streams --------------------------------------------------------------------------------------


class ChoiceDeltas:
    """What each choice of one request has sent so far, and the pieces that are new in a cumulative output."""

    def __init__(self):
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.finished: set[int] = set()

    def new_pieces(self, output: RequestOutput) -> Iterator[tuple[CompletionOutput, str, int]]:
        """(choice, new text, index of its first unsent token) for every choice with something to send:
        new text, new tokens, or its finish."""
        for choice in output.outputs:
            if choice.index in self.finished:
                continue
            text_sent, tokens_sent = self.text_sent.get(choice.index, 0), self.tokens_sent.get(choice.index, 0)
            delta = choice.text[text_sent:]
            if not delta and len(choice.token_ids) == tokens_sent and choice.finish_reason is None:
                continue
            self.text_sent[choice.index], self.tokens_sent[choice.index] = len(choice.text), len(choice.token_ids)
            if choice.finish_reason is not None:
                self.finished.add(choice.index)
            yield choice, delta, tokens_sent


class PlainChunks:
    """The JSON of a stream's plain chunks (one choice's new text: no finish, no logprobs), the most common
    event by far, without building a pydantic model for each: ``chunk(index, text)`` (the builder the other
    chunks use) is serialized once per choice with a placeholder for the text, and each later chunk splices its
    text, escaped as JSON, into that template: the same bytes (tests/test_serve_convert.py) for a tenth of the
    work. A server streaming to a hundred clients writes a hundred chunks a step, on the thread it shares with
    the engine loop."""

    PLACEHOLDER = "\ue000"  # a private-use character, which JSON leaves as it is

    def __init__(self, chunk: Callable[[int, str], object]):
        self.chunk, self.templates = chunk, {}

    def json(self, index: int, text: str) -> str:
        if index not in self.templates:
            dumped = self.chunk(index, self.PLACEHOLDER).model_dump_json(exclude_none=True)
            parts = dumped.split(self.PLACEHOLDER)
            self.templates[index] = tuple(parts) if len(parts) == 2 else None  # (the placeholder in the model name)
        template = self.templates[index]
        if template is None:
            return self.chunk(index, text).model_dump_json(exclude_none=True)
        return template[0] + json.dumps(text, ensure_ascii=False)[1:-1] + template[1]


def completion_chunk(base: dict, index: int, text: str, logprobs: CompletionLogprobs | None = None,
                     finish_reason: str | None = None, stop_reason: int | str | None = None) -> CompletionChunk:
    return CompletionChunk(**base, choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                             finish_reason=finish_reason, stop_reason=stop_reason)])


def chat_chunk(base: dict, index: int, text: str, logprobs: ChatLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(**base, choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text),
                                                                logprobs=logprobs, finish_reason=finish_reason,
                                                                stop_reason=stop_reason)])


def completion_chunks(output: RequestOutput, deltas: ChoiceDeltas, base: dict, tokenizer,
                      top_logprobs: int | None, plain: PlainChunks | None = None) -> list[str]:
    """The JSON of one chunk per choice with news (``base``: id, created, model); ``plain`` writes the plain ones."""
    chunks = []
    for choice, text, first in deltas.new_pieces(output):
        if plain is not None and top_logprobs is None and choice.finish_reason is None:
            chunks.append(plain.json(choice.index, text))
            continue
        logprobs = None
        if top_logprobs is not None and choice.logprobs is not None:
            offset = deltas.text_sent[choice.index] - len(text)
            logprobs = completion_logprobs(tokenizer, choice.token_ids[first:], choice.logprobs[first:],
                                           top_logprobs, offset)
        chunk = completion_chunk(base, choice.index, text, logprobs, choice.finish_reason, choice.stop_reason)
        chunks.append(chunk.model_dump_json(exclude_none=True))
    return chunks


def chat_chunks(output: RequestOutput, deltas: ChoiceDeltas, base: dict, tokenizer,
                top_logprobs: int | None, plain: PlainChunks | None = None) -> list[str]:
    chunks = []
    for choice, text, first in deltas.new_pieces(output):
        if plain is not None and top_logprobs is None and choice.finish_reason is None:
            chunks.append(plain.json(choice.index, text))
            continue
        logprobs = None
        if top_logprobs is not None and choice.logprobs is not None:
            logprobs = chat_logprobs(tokenizer, choice.token_ids[first:], choice.logprobs[first:], top_logprobs)
        chunk = chat_chunk(base, choice.index, text, logprobs, choice.finish_reason, choice.stop_reason)
        chunks.append(chunk.model_dump_json(exclude_none=True))
    return chunks


def chat_role_chunk(base: dict, n: int) -> ChatCompletionChunk:
    """The first chunk of a chat stream: each choice's role, before any content (as OpenAI sends it)."""
    return ChatCompletionChunk(**base, choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                                                for i in range(n)])
