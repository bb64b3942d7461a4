"""A real Prometheus scrapes a live server while ``bench serve``'s client loads it, and PromQL's
``histogram_quantile`` over the scraped TTFT histogram agrees with the P95 TTFT the client measured.

The tolerance is the histogram's resolution: a histogram knows only how many observations fell in each bucket,
and PromQL interpolates linearly inside the bucket the quantile's rank falls in. So the estimate must lie in the
bucket that holds the client's P95, or at most one of that bucket's widths beyond either of its bounds (the
server's clock starts a little after the client's, which can move the rank across a bound). The counts must agree
exactly: every request's first token, every generated token, every prompt token.

Needs the ``prometheus`` binary (Debian: ``apt-get install -y prometheus``; CI's ``.ci/run`` installs it). Without
it this test fails, saying so: it is part of what the project promises, not an optional extra.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import shutil
import time

import pytest

from minillm.bench.prometheus import INSTALL_HINT, LocalPrometheus
from minillm.bench.serve import online_metrics, run_requests
from minillm.bench.workloads import WorkloadRequest, make_workload
from minillm.serve import AsyncLLM, ServerThread
from minillm.serve.metrics import TTFT_BUCKETS


def test_promql_p95_ttft_agrees_with_the_benchmark():
    if shutil.which("prometheus") is None:
        pytest.fail(INSTALL_HINT)
    # Four sequences at a time: requests queue, so their TTFTs spread over several buckets.
    llm = AsyncLLM("tiny", load_format="dummy", dtype="float32", device="cpu", max_num_seqs=4)
    server = ServerThread(llm)
    prometheus = LocalPrometheus([f"{server.host}:{server.port}"], scrape_interval=1.0)
    try:
        model = 'model_name="tiny"'
        prometheus.wait_until(f'up{{job="minillm"}}', lambda up: up == 1)  # a first scrape, before any request
        # short outputs (4-16 tokens): TTFTs in the fine buckets below a second
        requests = [WorkloadRequest(r.prompt_token_ids, 4 + r.max_tokens % 13)
                    for r in make_workload("mixed", "cpu", num_requests=32, seed=0, vocab_size=512)]
        results, duration = asyncio.run(run_requests(server.url, requests, request_rate=40.0, seed=0))
        bench = online_metrics(results, duration)
        assert bench["completed"] == len(requests)
        # a scrape after the last request finished (its tokens are counted before its e2e latency is observed)
        prometheus.wait_until(f"sum(vllm:e2e_request_latency_seconds_count{{{model}}})", lambda n: n == len(requests))
        window = math.ceil(time.time() - prometheus.started) + 2  # since Prometheus started: from zero
        p95 = prometheus.value(f"histogram_quantile(0.95, sum by (le) "
                               f"(rate(vllm:time_to_first_token_seconds_bucket{{{model}}}[{window}s])))")
        tokens = prometheus.value(f"sum(vllm:generation_tokens_total{{{model}}})")
        prompt_tokens = prometheus.value(f"sum(vllm:prompt_tokens_total{{{model}}})")
    finally:
        prometheus.stop()
        server.stop()
        llm.shutdown()
    assert (tokens, prompt_tokens) == (bench["total_output_tokens"], bench["total_input_tokens"])
    print(f"P95 TTFT: client {bench['p95_ttft_ms']:.1f} ms, PromQL {1000 * p95:.1f} ms")
    truth = bench["p95_ttft_ms"] / 1000
    bounds = (0.0,) + TTFT_BUCKETS
    b = bisect.bisect_left(bounds, truth)  # the client's P95 lies in (bounds[b - 1], bounds[b]]
    low, high = bounds[b - 1], bounds[b]
    width = high - low
    assert low - width <= p95 <= high + width, (
        f"PromQL's P95 TTFT {p95:.4f} s is more than a bucket from the client's {truth:.4f} s (bucket {low}-{high})")
