"""Engine: the loop. ``add_request`` queues work, ``step`` runs one model forward, ``abort`` cancels.

A step is three moves, as in nano-vllm: the scheduler picks the batch, the runner computes one
token per row, and ``_postprocess`` appends the tokens, detokenizes, and checks stop conditions.
Everything else (which requests, which tensors) lives in the scheduler and the runner.
"""

from __future__ import annotations

import itertools
import time

import torch

from minillm.config import EngineConfig
from minillm.kv.contiguous import sequences_that_fit
from minillm.model.loader import load_model, resolve_dtype
from minillm.request import Request, RequestOutput, SamplingParams
from minillm.runner import ModelRunner
from minillm.scheduler import ScheduledBatch, StaticScheduler
from minillm.tokenizer import detokenize_step, encode_prompt

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device; use 'cpu'")
    return torch.device(device)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, config.load_format, self.dtype, self.device, config.seed)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_source = loaded.source
        model_limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > model_limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_limit}")
        window = self.model_config.sliding_window
        if window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's sliding window ({window}); "
                             f"minillm has no sliding-window attention, so keep max_model_len <= {window}")
        self.weight_bytes = sum(p.nbytes for p in self.model.parameters())
        per_sequence = self.model_config.kv_bytes_per_token(self.dtype.itemsize) * self.max_model_len
        self.max_batch = sequences_that_fit(self._memory_budget(), self.weight_bytes, per_sequence,
                                            config.max_num_seqs)
        self.scheduler = StaticScheduler(self.max_batch, self.max_model_len)
        self.runner = ModelRunner(self.model, self.max_batch, self.max_model_len, self.device, config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    def _memory_budget(self) -> int | None:
        if self.config.memory_budget is not None:
            return self.config.memory_budget
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory * self.config.gpu_memory_utilization)
        return None  # on a CPU, RAM is the user's to manage

    # -- the public API ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue one request; returns its id. Bad input raises ValueError here."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            text, token_ids = prompt, encode_prompt(self.tokenizer, prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token id")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {token_ids[:8]}...")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                             f"(prompt + at least one output token must fit); shorten it or raise max_model_len")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, text, token_ids, params, priority, arrival_time)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the requests that got a token (cumulative outputs)."""
        batch = self.scheduler.schedule(time.perf_counter())
        if batch is None:
            return []
        token_ids = self.runner.run(batch)
        return self._postprocess(batch, token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its slot in a running static batch idles until the batch ends."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return None
        self.scheduler.remove_waiting(request_id)
        request.finish("abort")
        return request.to_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- after the forward pass -------------------------------------------------------------------

    def _postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for request, token in zip(batch.requests, token_ids):
            if request.finished:
                continue  # a finished row of a static batch: computed, ignored
            request.output_token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.token_times.append(now)
            delta = detokenize_step(self.tokenizer, request)
            self._check_stop(request, token, len(request.text) - len(delta), now)
            if request.finished:
                self.requests.pop(request.request_id, None)
            outputs.append(request.to_output())
        return outputs

    def _check_stop(self, request: Request, token: int, old_text_len: int, now: float) -> None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return request.finish("stop", None, now)
        if token in params.stop_token_ids:
            return request.finish("stop", token, now)
        for stop in params.stop:
            # A new match must end inside the new characters, so start just before them.
            at = request.text.find(stop, max(0, old_text_len - len(stop) + 1))
            if at != -1:
                request.text = request.text[:at]
                return request.finish("stop", stop, now)
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish("length", None, now)
