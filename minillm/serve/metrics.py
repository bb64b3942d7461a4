"""Prometheus metrics under vLLM's names, so that dashboards and alerts written for a vLLM server read a
minillm server unchanged (``GET /metrics``).

One ``ServerMetrics`` per server, in a registry of its own (not prometheus_client's global one), so several
servers in one process (tests, a notebook) keep separate counts. It is fed on the engine-loop thread by
``AsyncLLM.step_callbacks``: after every step it reads the step's ``StepStats`` (tokens in the batch, preemptions
so far), each request's cumulative ``RequestOutput`` (new tokens, and ``RequestMetrics``' arrival, first-scheduled,
token and finish times) and the engine's state (requests running and waiting, KV blocks in use, the prefix
cache's query and hit counts, in tokens). The names, types, labels (``model_name``, ``engine``) and histogram
buckets are vLLM's v1 ones (``vllm/v1/metrics/loggers.py``); prometheus_client adds ``_total`` to a counter's
name, as it does for vLLM, so ``vllm:prompt_tokens`` is exported as ``vllm:prompt_tokens_total``.

Definitions: TTFT = arrival -> first token; inter-token latency = every gap between two tokens of a request;
e2e latency = arrival -> finish; queue time = arrival -> first scheduled; iteration tokens = tokens computed by
one engine step (prefill chunks + decodes), the batch-size distribution. KV usage counts the blocks requests
hold: blocks only the prefix cache keeps are free for the taking (evictable), as in vLLM.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minillm.engine import StepStats
from minillm.request import RequestOutput
from minillm.serve.async_llm import AsyncLLM

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, each a `finished_reason` label
LABELS = ("model_name", "engine")


def kv_cache_usage(engine, stats: StepStats | None) -> float:
    """The fraction of the KV cache that requests hold (0-1). Paged: blocks in use, less those only the prefix
    cache keeps (evictable on demand); contiguous: the last step's reserved rows."""
    tables = getattr(engine, "block_tables", None)
    if tables is None:
        return 0.0 if stats is None else stats.kv_usage
    allocator, cache = tables.allocator, engine.prefix_cache
    free = allocator.num_free + (0 if cache is None else cache.num_evictable_blocks)
    return 1.0 - free / allocator.num_blocks


class ServerMetrics:
    """``ServerMetrics(async_llm, model_name)`` registers itself in ``async_llm.step_callbacks``; ``render()``
    is the ``/metrics`` body (``CONTENT_TYPE`` its media type)."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm, self.engine = async_llm, async_llm.engine
        self.registry = CollectorRegistry(auto_describe=True)
        values = {"model_name": model_name, "engine": "0"}

        def make(kind, name: str, documentation: str, **kwargs):
            return kind(name, documentation, LABELS, registry=self.registry, **kwargs).labels(**values)

        self.num_running = make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = make(Counter, "vllm:prefix_cache_queries",
                                         "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = make(Counter, "vllm:prefix_cache_hits",
                                      "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       LABELS + ("finished_reason",), registry=self.registry)
        self._labels = values
        for reason in FINISH_REASONS:  # exported from the start, at 0
            self.request_success.labels(**values, finished_reason=reason)
        self.iteration_tokens = make(Histogram, "vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.", buckets=ITERATION_TOKENS_BUCKETS)
        self.time_to_first_token = make(Histogram, "vllm:time_to_first_token_seconds",
                                        "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.inter_token_latency = make(Histogram, "vllm:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.", buckets=INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = make(Histogram, "vllm:e2e_request_latency_seconds",
                                        "Histogram of e2e request latency in seconds.", buckets=REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = make(Histogram, "vllm:request_queue_time_seconds",
                                       "Histogram of time spent in WAITING phase for request.",
                                       buckets=REQUEST_LATENCY_BUCKETS)
        self._lock = threading.Lock()
        self._counted: dict[str, tuple[int, int]] = {}  # request id -> (tokens counted, token times counted)
        self._preemptions_seen = 0
        cache = self.engine.prefix_cache
        self._cache_seen = (0, 0) if cache is None else (cache.queries, cache.hits)
        async_llm.step_callbacks.append(self.on_step)

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """A step callback (engine-loop thread): count the step's tokens and the requests' progress."""
        with self._lock:
            if stats is not None:
                self.iteration_tokens.observe(stats.num_tokens)
                self.num_preemptions.inc(max(0, stats.num_preemptions - self._preemptions_seen))
                self._preemptions_seen = stats.num_preemptions
            prompt_tokens = generation_tokens = 0
            for output in outputs:
                new_prompt, new_generated = self._record(output)
                prompt_tokens, generation_tokens = prompt_tokens + new_prompt, generation_tokens + new_generated
            self.prompt_tokens.inc(prompt_tokens)  # once a step: each inc takes a lock
            self.generation_tokens.inc(generation_tokens)
            self._record_engine(stats)

    def _record(self, output: RequestOutput) -> tuple[int, int]:
        """Observe one request's latencies; returns its (prompt, generated) tokens not counted before."""
        metrics = output.metrics
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        tokens_counted, times_counted = self._counted.get(output.request_id, (0, 0))
        new_prompt = new_generated = 0
        if num_tokens > tokens_counted:
            if tokens_counted == 0:  # the prompt is done: vLLM counts it with the first token
                new_prompt = len(output.prompt_token_ids)
                if metrics.ttft is not None:
                    self.time_to_first_token.observe(metrics.ttft)
            new_generated = num_tokens - tokens_counted
        times = metrics.token_times
        for k in range(max(1, times_counted), len(times)):
            self.inter_token_latency.observe(times[k] - times[k - 1])
        if not output.finished:
            self._counted[output.request_id] = (num_tokens, len(times))
            return new_prompt, new_generated
        self._counted.pop(output.request_id, None)
        reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
        self.request_success.labels(**self._labels, finished_reason=reason).inc()
        if reason != "abort":  # an aborted request's latency is its client's, not the server's
            if metrics.e2e is not None:
                self.e2e_request_latency.observe(metrics.e2e)
            if metrics.time_in_queue is not None:
                self.request_queue_time.observe(metrics.time_in_queue)
        return new_prompt, new_generated

    def _record_engine(self, stats: StepStats | None) -> None:
        self._record_counts()
        self.kv_cache_usage.set(kv_cache_usage(self.engine, stats))
        cache = self.engine.prefix_cache
        if cache is not None:
            queries, hits = self._cache_seen
            # A cache whose counts were reset starts a new baseline.
            self.prefix_cache_queries.inc(max(0, cache.queries - queries))
            self.prefix_cache_hits.inc(max(0, cache.hits - hits))
            self._cache_seen = (cache.queries, cache.hits)

    def _record_counts(self) -> None:
        self.num_running.set(self.async_llm.num_running)
        self.num_waiting.set(self.async_llm.num_waiting)

    def render(self) -> bytes:
        """The exposition text; the request counts are read now (requests queue between steps too)."""
        self._record_counts()
        return generate_latest(self.registry)
