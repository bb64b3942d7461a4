"""LLM: the offline API, shaped like vLLM's (``LLM(...).generate(prompts, SamplingParams(...))``).

It only translates between users and the Engine: prompts in, RequestOutputs out, in the order the
prompts were given. ``stream`` yields text as it is produced; ``chat`` applies the chat template.
With ``tensor_parallel_size=N`` or ``pipeline_parallel_size=N`` it starts N - 1 worker processes;
``close()`` (or ``with LLM(...)``) stops them, as does the end of the program.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from minillm.config import EngineConfig
from minillm.engine import Engine
from minillm.request import RequestOutput, SamplingParams
from minillm.tokenizer import encode_chat

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
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
        """Run prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``) to completion."""
        prompts = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _broadcast(0 if priority is None else list(priority), len(prompts), "priority")
        # Validate everything before queueing anything, so bad input never leaves half a batch behind.
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(self.engine.add_request(_prompt_value(prompt), p, priority=prio))
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("chat() needs at least one conversation")
        prompts = [encode_chat(self.tokenizer, conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text after every step until the request finishes."""
        if self.tokenizer is None:
            raise ValueError("stream() yields text, and this model has no tokenizer (dummy weights); "
                             "use generate() with token ids")
        request_id = self.engine.add_request(_prompt_value(prompt), sampling_params)
        request = self.engine.requests[request_id]
        sent = 0
        try:
            while True:  # other callers may step the engine between our yields: read the request's state
                done = request.finished  # read before the text, so its last piece is never skipped
                text = request.to_output().outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if done:
                    return
                if not request.finished:
                    self._step_or_fail()
        finally:
            self.engine.abort(request_id)  # the consumer stopped early: free the slot

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


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
