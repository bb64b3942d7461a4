"""The OpenAI-compatible HTTP API over an ``AsyncLLM``: ``build_app`` returns a FastAPI application.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole responses, or
server-sent events: ``data: {chunk}`` lines ending with ``data: [DONE]``), ``GET /health``, ``GET /version``,
``GET /metrics`` (Prometheus' text format, vLLM's metric names: ``minillm/serve/metrics.py``).

Every error leaves as OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
parameter (schema violations and malformed JSON included, where FastAPI would say 422), 404 for an unknown
model or route, 503 with ``Retry-After`` when the waiting queue is full or the server is stopping, and 500,
logged with the request's id, for a bug, which costs that request only. A client that goes away, streaming or
not, aborts its request, so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

import minillm
from minillm.request import RequestOutput
from minillm.serve import convert
from minillm.serve.async_llm import AsyncLLM, EngineShutdownError, QueueFullError, RequestStream
from minillm.serve.convert import InvalidRequest
from minillm.serve.metrics import ServerMetrics
from minillm.serve.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorInfo, ErrorResponse, Health, ModelCard, ModelList,
                                    Version)
from minillm.tokenizer import encode_chat

logger = logging.getLogger("minillm.serve")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 500, 503)}
STREAMING = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.info, self.headers = status, ErrorInfo(message=message, type=type, param=param,
                                                                   code=code), headers


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=error.info).model_dump(), status_code=error.status, headers=error.headers)


def internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug: logged with the request's id, answered with 500."""
    request_id = getattr(request.state, "request_id", None)
    logger.error("request %s failed: %s %s", request_id, request.method, request.url.path, exc_info=error)
    return error_response(APIError(500, f"internal server error ({type(error).__name__})", "internal_error"))


class ContainedErrorRoute(APIRoute):
    """A route whose unexpected exceptions end inside it, as a logged 500. Left to propagate, one would reach
    uvicorn after the 500 went out, and uvicorn closes the connection then: the client's next request on that
    keep-alive connection would fail too."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def contained(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError, QueueFullError, EngineShutdownError):
                raise  # the app's exception handlers answer these
            except Exception as error:
                return internal_error(request, error)

        return contained


def invalid(error: Exception, param: str | None = None) -> APIError:
    """A ValueError / TypeError from validating a request: 400, naming ``param``, else the error's own."""
    return APIError(400, str(error), "invalid_request_error", param or getattr(error, "param", None))


def build_app(async_llm: AsyncLLM, *, served_model_name: str | None = None, retry_after: int = 1) -> FastAPI:
    """The API over ``async_llm``. ``served_model_name`` is the name clients pass as ``model`` (default: the
    model argument the engine was built from); a full queue answers ``Retry-After: retry_after`` seconds."""
    config = async_llm.engine.config
    model_name = served_model_name or config.model or EMBEDDED_MODEL_NAME
    app = FastAPI(title="minillm", version=minillm.__version__,
                  description="An OpenAI-compatible server over minillm's engine")
    app.router.route_class = ContainedErrorRoute
    app.state.async_llm = async_llm
    app.state.metrics = metrics = ServerMetrics(async_llm, model_name)
    install_error_handlers(app, retry_after)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health", response_model=Health, responses=ERRORS)
    async def health():
        if not async_llm.is_running:
            raise APIError(503, "the engine loop has stopped", "server_unavailable")
        return Health()

    @app.get("/version", response_model=Version)
    async def version():
        return Version(version=minillm.__version__)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=ServerMetrics.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=model_name, root=async_llm.engine.model_source,
                                         max_model_len=async_llm.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS | STREAMING)
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        request_id = raw.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            params = convert.completion_sampling_params(body)
        except (ValueError, TypeError) as error:
            raise invalid(error) from None
        stream = await submit(async_llm, body.prompt, params, request_id, body.priority, "prompt")
        base = dict(id=request_id, created=int(time.time()), model=model_name)
        tokenizer, top = async_llm.tokenizer, body.logprobs
        if body.stream:
            deltas, plain = convert.ChoiceDeltas(), convert.PlainChunks(partial(convert.completion_chunk, base))
            return event_stream(stream, lambda out: convert.completion_chunks(out, deltas, base, tokenizer, top, plain),
                                None, body, base)
        output = await last_output(stream, raw)
        if output is None:
            return client_gone()
        return CompletionResponse(**base, choices=convert.completion_choices(output, tokenizer, top),
                                  usage=convert.usage(output))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS | STREAMING)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        request_id = raw.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            prompt = encode_chat(async_llm.tokenizer, convert.chat_messages(body.messages))
        except (ValueError, TypeError) as error:
            raise invalid(error, "messages") from None
        try:
            params = convert.chat_sampling_params(body, len(prompt), async_llm.max_model_len)
        except (ValueError, TypeError) as error:
            raise invalid(error) from None
        stream = await submit(async_llm, prompt, params, request_id, body.priority, "messages")
        base = dict(id=request_id, created=int(time.time()), model=model_name)
        tokenizer, top = async_llm.tokenizer, (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            deltas, plain = convert.ChoiceDeltas(), convert.PlainChunks(partial(convert.chat_chunk, base))
            return event_stream(stream, lambda out: convert.chat_chunks(out, deltas, base, tokenizer, top, plain),
                                convert.chat_role_chunk(base, body.n or 1), body, base)
        output = await last_output(stream, raw)
        if output is None:
            return client_gone()
        return ChatCompletionResponse(**base, choices=convert.chat_choices(output, tokenizer, top),
                                      usage=convert.usage(output))

    return app


def install_error_handlers(app: FastAPI, retry_after: int) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        problems = error.errors()
        if any(problem.get("type") == "json_invalid" for problem in problems):
            message = f"the request body is not valid JSON ({problems[0].get('ctx', {}).get('error', 'malformed')})"
            return error_response(APIError(400, message, "invalid_request_error"))
        fields = [".".join(str(part) for part in problem.get("loc", ()) if part != "body") for problem in problems]
        message = "; ".join(f"{field or 'body'}: {problem.get('msg')}, got {problem.get('input')!r}"
                            for field, problem in zip(fields, problems[:5]))
        return error_response(APIError(400, message or "invalid request", "invalid_request_error",
                                       fields[0] if fields and fields[0] else None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(APIError(error.status_code, str(error.detail), kind, headers=error.headers))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, error: QueueFullError):
        return error_response(APIError(503, str(error), "server_busy", headers={"Retry-After": str(retry_after)}))

    @app.exception_handler(EngineShutdownError)
    async def shutting_down(request: Request, error: EngineShutdownError):
        return error_response(APIError(503, str(error), "server_unavailable",
                                       headers={"Retry-After": str(retry_after)}))

    @app.exception_handler(Exception)  # outside a route (middleware)
    async def unexpected(request: Request, error: Exception):
        return internal_error(request, error)


async def submit(async_llm: AsyncLLM, prompt, params, request_id: str, priority: int,
                 prompt_param: str) -> RequestStream:
    """Queue the request; the engine's verdict on bad input (a prompt past max_model_len, a token id out
    of the vocabulary) becomes a 400 naming the parameter, where the engine's "prompt" is the API's
    ``prompt_param`` (chat's is ``messages``)."""
    try:
        return await async_llm.add_request(prompt, params, request_id=request_id, priority=priority)
    except (ValueError, TypeError) as error:
        param = getattr(error, "param", None)
        raise invalid(error, prompt_param if param in (None, "prompt") else param) from None


async def last_output(stream: RequestStream, raw: Request) -> RequestOutput | None:
    """The finished output, or None when the client disconnected first (then the request is aborted)."""
    async def finished() -> RequestOutput:
        output = None
        async for output in stream:
            pass
        return output

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(finished()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # the stream aborts its request when cancelled
            stream.abort()
    return work.result() if work in done else None


def client_gone() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def event_stream(stream: RequestStream, chunks_of: Callable[[RequestOutput], list[str]], first, body, base: dict
                 ) -> StreamingResponse:
    """Server-sent events: ``first`` (if any), the chunks of every output, the usage if
    ``stream_options.include_usage``, then ``[DONE]``. An error mid-stream is sent as an error event."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    response_class = type(first) if first is not None else convert.CompletionChunk

    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield f"data: {first.model_dump_json(exclude_none=True)}\n\n"
            output = None
            async for output in stream:
                for chunk in chunks_of(output):
                    yield f"data: {chunk}\n\n"
            if include_usage and output is not None:
                usage = response_class(**base, choices=[], usage=convert.usage(output))
                yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
        except Exception as error:  # the status line has gone: report the failure inside the stream
            logger.error("request %s failed while streaming", stream.request_id, exc_info=error)
            info = ErrorInfo(message=f"internal server error ({type(error).__name__})", type="internal_error")
            yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
