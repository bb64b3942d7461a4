"""The subset of OpenAI's HTTP API that minillm serves, as pydantic models: requests, responses, streaming
chunks, usage and the error envelope.

The models are the contract: FastAPI validates requests against them and publishes them as ``/openapi.json``
(which the schema-driven tests fuzz). Field names and defaults are OpenAI's; vLLM's extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``prompt_logprobs``, ``stop_reason``) keep vLLM's names.
Unknown fields are rejected rather than ignored, so a parameter minillm does not implement never silently
changes nothing. Ranges here are the API's; the engine's ``SamplingParams`` checks its own on top.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- errors ---------------------------------------------------------------------------------------


class ErrorInfo(APIModel):
    message: str
    type: str  # "invalid_request_error" | "not_found_error" | "server_busy" | "internal_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(APIModel):
    error: ErrorInfo


# -- requests -------------------------------------------------------------------------------------


class StreamOptions(APIModel):
    include_usage: bool = False  # a last chunk carries the usage, with no choices


TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # JSON keys are strings: a token id written out


class SamplingFields(APIModel):
    """What completions and chat share. ``None`` = the engine's default; the sampling parameters go to
    ``SamplingParams`` under the same names (``request_to_sampling_params``)."""

    model: str | None = None  # the served model's name; None = the one being served
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)  # completions per prompt, sharing the prompt's KV blocks
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token id -> added to its logit
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user identifier; accepted, not used
    # vLLM's extensions
    priority: int = 0  # with scheduling_policy="priority": lower runs first
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    #       text, or token ids
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=1)  # null: the default
    logprobs: int | None = Field(None, ge=0, le=20)  # the k most likely tokens at each position, with the sampled one


class TextContent(APIModel):
    type: Literal["text"]
    text: str


class ChatMessage(APIModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextContent]
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)  # None = as many as max_model_len leaves
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # needs logprobs=true


# -- responses ------------------------------------------------------------------------------------


class Usage(APIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(APIModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


FinishReason = Literal["stop", "length", "abort"]
PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt position: token id -> its logprob


class CompletionLogprobs(APIModel):
    """The legacy completions format: parallel lists over the generated tokens."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(APIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM's extension)
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(APIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on a whole response; streams send it last, if asked for


class TopLogprob(APIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(APIModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(APIModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(APIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionResponse(APIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(APIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(APIModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(APIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(APIModel):
    """A streamed piece of a completion: the same shape as the whole response, with text deltas."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(APIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minillm"
    root: str | None = None  # where the weights came from
    max_model_len: int | None = None


class ModelList(APIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(APIModel):
    status: Literal["ok"] = "ok"


class Version(APIModel):
    version: str
