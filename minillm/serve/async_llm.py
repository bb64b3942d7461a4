"""AsyncLLM: one Engine driven by one background thread, with requests added and aborted from async code.

The Engine is not thread-safe and a step blocks for a whole forward pass, so neither may run on an event loop
that is also serving HTTP. Here a single *engine loop* thread owns the Engine: it applies the adds and aborts
queued by async callers, steps while work exists, and sleeps otherwise. A step's outputs travel back to the
event loops that asked for them through ``loop.call_soon_threadsafe``, one call per loop per step; a stream
keeps only the newest cumulative ``RequestOutput`` (each one contains everything before it), so a slow
consumer costs no memory and loses nothing.

The waiting queue is bounded (``max_waiting_requests``): past it ``add_request`` raises ``QueueFullError`` at
once, which a server answers with 503 and ``Retry-After`` instead of building an unbounded backlog. A consumer
that stops reading (a client that disconnected, a cancelled task) aborts its request, which frees its KV
blocks at the next iteration of the loop. ``step_callbacks`` see every step on the loop thread (metrics hang
off them). Usable from a notebook (top-level ``await``) as from the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from minillm.engine import StepStats
from minillm.llm import LLM
from minillm.request import RequestOutput, SamplingParams

logger = logging.getLogger("minillm.serve")

StepCallback = Callable[[StepStats | None, list[RequestOutput]], None]


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already: come back later (HTTP 503)."""

    def __init__(self, num_waiting: int, limit: int):
        super().__init__(f"the server is busy: {num_waiting} requests are waiting (max_waiting_requests={limit}); "
                         f"retry later")
        self.num_waiting, self.limit = num_waiting, limit


class EngineShutdownError(RuntimeError):
    """The AsyncLLM is shutting down or stopped and takes no new requests (HTTP 503)."""


class RequestStream:
    """The outputs of one request as an async iterator of cumulative ``RequestOutput``s, ending with the
    finished one. Closing it (``aclose`` or leaving an ``async for`` early) aborts the request if unfinished."""

    def __init__(self, request_id: str, owner: "AsyncLLM", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner, self._loop = owner, loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the finished output (or an error) has been delivered to the consumer

    # Called on the event loop (scheduled there by the engine thread).
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self.abort()
            raise
        self._ready.clear()
        if self._error is not None:
            self.finished = True
            raise self._error
        output, self._latest = self._latest, None
        self.finished = output.finished
        return output

    def abort(self) -> None:
        """Cancel the request (nothing happens if it has finished)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class AsyncLLM:
    """``AsyncLLM(model, max_waiting_requests=..., **engine_kwargs)``: the engine keywords are ``LLM``'s
    (``EngineConfig``'s); ``batching`` defaults to "continuous" here, since requests arrive while others run.
    Or wrap an existing ``LLM`` with ``AsyncLLM.from_llm(llm)``."""

    def __init__(self, model: str | None = None, *, max_waiting_requests: int | None = None, **engine_kwargs):
        engine_kwargs.setdefault("batching", "continuous")
        self._start(LLM(model, **engine_kwargs), max_waiting_requests)

    @classmethod
    def from_llm(cls, llm: LLM, *, max_waiting_requests: int | None = None) -> "AsyncLLM":
        """Serve an ``LLM`` that is already loaded; nothing else may call its engine meanwhile."""
        self = cls.__new__(cls)
        self._start(llm, max_waiting_requests)
        return self

    def _start(self, llm: LLM, max_waiting_requests: int | None) -> None:
        if max_waiting_requests is not None and (not isinstance(max_waiting_requests, int)
                                                 or isinstance(max_waiting_requests, bool) or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be None (unbounded) or an integer >= 1, "
                             f"got {max_waiting_requests!r}")
        self.llm, self.engine = llm, llm.engine
        self.max_waiting_requests = max_waiting_requests
        # Called on the engine thread after every step: (the step's StepStats, or None when the step ran no
        # batch, the RequestOutputs it produced, aborted requests' included). Keep them quick.
        self.step_callbacks: list[StepCallback] = []
        self._wakeup = threading.Condition()
        self._commands: deque = deque()  # ("add", ...) / ("abort", id), applied in order by the engine thread
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_pending_adds = 0
        self._num_waiting = 0  # the scheduler's waiting queue, refreshed by the engine thread
        self._num_running = 0
        self._accepting, self._stop = True, False
        self._thread = threading.Thread(target=self._run, name="minillm-engine-loop", daemon=True)
        self._thread.start()

    # -- the async API ---------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and taking requests."""
        return self._accepting and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running: queued for the engine thread or in the scheduler's waiting queue."""
        return self._num_pending_adds + self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                          request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Validate and queue one request; return its stream. Raises ``QueueFullError`` when the waiting
        queue is full, ``EngineShutdownError`` after ``shutdown()``, and the engine's ``ValueError`` for bad input."""
        loop = asyncio.get_running_loop()
        added: concurrent.futures.Future = concurrent.futures.Future()
        arrival_time = time.perf_counter()  # TTFT and queue time count from here, not from the engine thread's turn
        with self._wakeup:  # under the lock shutdown() takes: an accepted add is applied before the thread ends
            if not self._accepting:
                raise EngineShutdownError("the engine is shutting down and accepts no new requests")
            limit = self.max_waiting_requests
            if limit is not None and self.num_waiting >= limit:
                raise QueueFullError(self.num_waiting, limit)
            self._num_pending_adds += 1
            self._commands.append(("add", prompt, params, request_id, priority, arrival_time, loop, added))
            self._wakeup.notify_all()
        try:
            return await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # the caller gave up while the add was queued: undo it if it lands
            added.add_done_callback(self._abort_if_added)
            raise

    def _abort_if_added(self, added: concurrent.futures.Future) -> None:
        if not added.cancelled() and added.exception() is None:
            self.abort(added.result().request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as it runs; the last one is finished. Leaving the loop early
        aborts the request."""
        stream = await self.add_request(prompt, params, request_id=request_id, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its KV blocks are freed at the engine loop's next iteration."""
        with self._wakeup:
            self._commands.append(("abort", request_id))
            self._wakeup.notify_all()

    def shutdown(self, timeout: float | None = 0.0) -> None:
        """Stop taking requests, let the running ones finish for up to ``timeout`` seconds (None: until they
        are all done), abort the rest, stop the engine thread and the engine. Blocking; call it from a
        thread (``await asyncio.to_thread(llm.shutdown, 30)``) when an event loop still has to deliver."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wakeup:
            if self._stop:
                return  # shut down already
            self._accepting = False
            while self._commands or self._num_pending_adds or self._num_waiting or self._num_running:
                left = math.inf if deadline is None else deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    break
                self._wakeup.wait(min(left, 0.05))
            self._stop = True
            self._wakeup.notify_all()
        self._thread.join()
        self.llm.close()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """Apply the queued adds and aborts, step, tell the callbacks, deliver; sleep while there is no work.
        The callbacks run before the outputs are delivered, so whoever sees a finished output sees its
        step accounted for."""
        while True:
            with self._wakeup:
                while not (self._commands or self._stop or self.engine.has_unfinished()):
                    self._wakeup.wait()
                commands, self._commands = self._commands, deque()
                stopping = self._stop
            outputs = self._apply(commands)
            stats = None
            if stopping:
                outputs += self._abort(list(self.engine.requests))
            elif self.engine.has_unfinished():
                stats, stepped = self._step()
                outputs += stepped
            self._refresh_counts()
            self._notify_callbacks(stats, outputs)
            self._deliver(outputs)
            if stopping:
                return

    def _apply(self, commands: deque) -> list[RequestOutput]:
        """The adds and aborts in the order they came; returns the aborted requests' outputs."""
        aborted = []
        for kind, *args in commands:
            if kind == "add":
                self._add(*args)
                continue
            output = self.engine.abort(args[0])
            if output is not None:
                aborted.append(output)
            else:
                self._streams.pop(args[0], None)  # finished already, or never added
        self._refresh_counts()  # the new arrivals count as waiting while the step runs
        return aborted

    def _add(self, prompt, params, request_id, priority, arrival_time, loop, added: concurrent.futures.Future) -> None:
        try:
            if not added.set_running_or_notify_cancel():
                return  # the caller was cancelled before the engine thread got to its request
            request_id = self.engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                                 arrival_time=arrival_time)
            stream = RequestStream(request_id, self, loop)
            self._streams[request_id] = stream
            added.set_result(stream)
        except BaseException as error:  # bad input: the caller's ValueError, raised where it awaits
            added.set_exception(error)
        finally:
            with self._wakeup:
                self._num_pending_adds -= 1

    def _step(self) -> tuple[StepStats | None, list[RequestOutput]]:
        stats = self.engine.stats
        num_stats, latest = len(stats), stats[-1] if stats else None
        try:
            outputs = self.engine.step()
        except Exception as error:  # an engine bug: fail the batch it broke on, keep the waiting and new requests
            batch = [r.request_id for r in self.engine.scheduler.running if not r.finished]
            batch = batch or list(self.engine.requests)  # it broke before a batch formed: nothing may spin on
            logger.exception("engine step failed; failing requests %s", batch)
            for request_id in batch:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._loop.call_soon_threadsafe(stream._fail, error)
            return None, self._abort(batch)
        stepped = stats and (len(stats) != num_stats or stats[-1] is not latest)  # the deque may be full
        return (stats[-1] if stepped else None), outputs

    def _abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = [self.engine.abort(request_id) for request_id in request_ids]
        return [output for output in outputs if output is not None]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop per step (a wake-up is a write to
        the loop's self-pipe; one per output would be hundreds a step), however many requests it serves."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream._loop, []).append((stream, output))
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, deliveries)
            except RuntimeError:  # the consumers' event loop is closed: nobody is listening any more
                for stream, output in deliveries:
                    self._streams.pop(output.request_id, None)
                    self.engine.abort(output.request_id)

    def _refresh_counts(self) -> None:
        scheduler = self.engine.scheduler
        self._num_waiting = len(scheduler.waiting)
        self._num_running = sum(not r.finished for r in scheduler.running)
        with self._wakeup:
            self._wakeup.notify_all()  # shutdown() waits on the same condition

    def _notify_callbacks(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        for callback in self.step_callbacks:
            try:
                callback(stats, outputs)
            except Exception:
                logger.exception("step callback %r failed", callback)


def _put_all(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the consumers' event loop: each stream gets its newest output."""
    for stream, output in deliveries:
        stream._put(output)
