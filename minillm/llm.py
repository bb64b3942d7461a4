"""LLM: the offline API, shaped like vLLM's (``LLM(...).generate(prompts, SamplingParams(...))``).

It only translates between users and the Engine: prompts in, RequestOutputs out, in the order the
prompts were given. ``stream`` yields text as it is produced; ``chat`` applies the chat template.
With ``tensor_parallel_size=N`` or ``pipeline_parallel_size=N`` it starts N - 1 worker processes;
``close()`` (or ``with LLM(...)``) stops them, as does the end of the program.

Arguments are checked where they enter (``minillm/validation.py``), before any request is queued.

Threads: one ``LLM`` may be shared by several threads. A lock serialises their calls: a ``generate``
or ``chat`` call holds it while it queues and runs its requests, so no other ``generate`` or ``chat``
shares its steps and each gets exactly the outputs it would get alone. A ``stream`` takes the lock for
each step only (held while its consumer is suspended, it would stall every other thread, and an
abandoned stream would hold it for good): other threads' calls run between its yields, and its
request is stepped along with theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from minillm.config import EngineConfig
from minillm.engine import Engine
from minillm.request import Request, RequestOutput, SamplingParams
from minillm.tokenizer import encode_chat
from minillm.validation import (InvalidArgument, InvalidArgumentType, as_prompt_list, check_bool, check_conversations,
                                describe, is_single_prompt, per_prompt, prompt_value)

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self._lock = threading.RLock()  # re-entrant: chat() calls generate(); a stream may be read inside a call
        if self.config.tensor_parallel_size * self.config.pipeline_parallel_size > 1:
            from minillm.parallel.workers import build_engine  # starts worker processes: only when asked for

            self.engine = build_engine(Engine, self.config)
        else:
            self.engine = Engine(self.config)
        if self.engine.workers is not None and self.engine.workers.rank != 0:
            # Under torchrun every rank runs the script: ranks > 0 follow rank 0's steps, and the
            # rest of the script runs on rank 0 only.
            self.engine.workers.serve(self.engine.runner)
            raise SystemExit(0)

    def close(self) -> None:
        """Stop the worker processes of a parallel LLM, if any. The LLM cannot generate afterwards."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs come in the prompts' order.

        A prompt is a string, a list or tuple of token ids (Python or numpy integers), or a dict
        ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``; ``prompts`` is one of them or a list of
        them. ``sampling_params`` and ``priority`` give one value per prompt (``sampling_params`` may
        also be one for all). Every prompt is checked before any is queued: a bad one raises
        ``validation.InvalidArgument`` (a ValueError) and leaves nothing behind."""
        check_bool("use_tqdm", use_tqdm)
        prompts = as_prompt_list(prompts)
        params = per_prompt("sampling_params", SamplingParams() if sampling_params is None else sampling_params,
                            len(prompts))
        for index, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InvalidArgumentType("sampling_params", f"sampling_params[{index}] must be a SamplingParams, "
                                                             f"got {describe(p)}")
        priorities = [0] * len(prompts) if priority is None else per_prompt("priority", priority, len(prompts),
                                                                            entry_is_list=True)
        with self._lock:
            requests = [self.engine.make_request(prompt_value(prompt), p, priority=prio)
                        for prompt, p, prio in zip(prompts, params, priorities)]
            return self._run([self.engine.queue(r) for r in requests], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them. ``role`` is one
        of "system", "user", "assistant", "tool"; ``content`` a string or OpenAI-style text parts
        (``[{"type": "text", "text": "..."}]``)."""
        conversations = check_conversations(messages)
        with self._lock:
            prompts = [encode_chat(self.tokenizer, conversation) for conversation in conversations]
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text after every step until the request finishes. The prompt and the
        parameters are checked here, when ``stream`` is called; the request is queued when the
        iteration starts, and aborted when it stops early."""
        if self.tokenizer is None:
            raise InvalidArgument("prompt", "stream() yields text, and this model has no tokenizer (dummy weights); "
                                            "use generate() with token ids")
        if not is_single_prompt(prompt):
            raise InvalidArgumentType("prompt", f"stream() takes one prompt (a string, token ids or a dict), "
                                                f"got {describe(prompt)}")
        with self._lock:
            request = self.engine.make_request(prompt_value(prompt), sampling_params)
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[str]:
        with self._lock:
            self.engine.queue(request)
        sent = 0
        try:
            while True:  # other callers may step the engine between our yields: read the request's state
                with self._lock:  # a consistent snapshot: no other thread is halfway through a step
                    done = request.finished
                    text = request.to_output().outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if done:
                    return
                with self._lock:
                    if not request.finished:
                        self._step_or_fail()
        finally:
            with self._lock:
                self.engine.abort(request.request_id)  # the consumer stopped early: free the slot

    def _step_or_fail(self) -> None:
        if not self.engine.has_unfinished():
            raise RuntimeError("the engine has no work left but a request is unfinished (engine bug)")
        self.engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        # Hold the Request objects: their state is the truth, whoever else calls step() meanwhile.
        requests = [self.engine.requests[i] for i in ids]
        done = 0
        try:
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while done < len(requests):
                    self._step_or_fail()
                    finished = sum(r.finished for r in requests)
                    bar.update(finished - done)
                    done = finished
        except BaseException:
            for request_id in ids:  # never leave this call's requests behind in the engine
                self.engine.abort(request_id)
            raise
        return [r.to_output() for r in requests]
