"""The server's /metrics: vLLM's names, types, labels and buckets; counters and histograms that agree with the
requests served and the engine's own counts; aborts; a registry per server; the Grafana dashboard reads only
what the server exports. A live server on 127.0.0.1 over the tiny random model."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from minillm.bench.prometheus import dashboard_queries, promql_names, scrape
from minillm.bench.serve import run_requests
from minillm.bench.workloads import WorkloadRequest
from minillm.serve import AsyncLLM, ServerThread
from minillm.serve.metrics import ServerMetrics

MODEL = "tiny"
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions", "vllm:request_success",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total")


@pytest.fixture(scope="module")
def server():
    # 12 blocks of 16 tokens for 4 sequences of up to 100 tokens (32 shared): the requests below must preempt.
    llm = AsyncLLM(MODEL, load_format="dummy", dtype="float32", device="cpu", max_num_seqs=4, num_kv_blocks=12,
                   enable_prefix_caching=True)
    thread = ServerThread(llm)
    yield thread, llm
    thread.stop()
    llm.shutdown()


def metrics_url(thread) -> str:
    return f"http://{thread.host}:{thread.port}/metrics"


def value(samples: dict, name: str, **labels) -> float:
    matches = [v for found, v in samples.get(name, []) if all(found.get(k) == w for k, w in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} series in {samples.get(name)}"
    return matches[0]


def workload(seed: int, n: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(32)]  # two whole blocks every prompt starts with
    return [WorkloadRequest(shared + [rng.randrange(2, 512) for _ in range(rng.randint(1, 20))], rng.randint(24, 48))
            for _ in range(n)]


def test_names_types_labels_and_buckets_are_vllms(server):
    thread, _ = server
    response = httpx.get(metrics_url(thread))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = scrape(metrics_url(thread))
    for name in COUNTERS:
        assert f"{name}_total" in samples, f"counter {name} is not exported as {name}_total"
    for name in GAUGES:
        assert name in samples
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert f"{name}{suffix}" in samples
    for name in GAUGES:
        (labels, _), = samples[name]
        assert labels == {"model_name": MODEL, "engine": "0"}
    reasons = {labels["finished_reason"] for labels, _ in samples["vllm:request_success_total"]}
    assert reasons == {"stop", "length", "abort"}

    def bounds(name):
        return sorted(float(labels["le"]) for labels, _ in samples[f"{name}_bucket"])[:-1]  # less +Inf
    ttft, itl = bounds("vllm:time_to_first_token_seconds"), bounds("vllm:inter_token_latency_seconds")
    assert (len(ttft), ttft[0], ttft[-1]) == (22, 0.001, 2560.0)
    assert (len(itl), itl[0], itl[-1]) == (19, 0.01, 80.0)
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        latency = bounds(name)
        assert (len(latency), latency[0], latency[-1]) == (21, 0.3, 7680.0)
    steps = bounds("vllm:iteration_tokens_total")
    assert steps == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def test_counts_agree_with_the_requests_and_the_engine(server):
    thread, llm = server
    engine = llm.engine
    requests = workload(seed=1, n=10)
    before = scrape(metrics_url(thread))
    steps_before = sum(step.num_tokens for step in engine.stats)
    results, _ = asyncio.run(run_requests(thread.url, requests, seed=1))
    assert all(r.ok and r.output_tokens == q.max_tokens for r, q in zip(results, requests))
    after = scrape(metrics_url(thread))

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    n = len(requests)
    assert grew("vllm:prompt_tokens_total") == sum(len(q.prompt_token_ids) for q in requests)
    assert grew("vllm:generation_tokens_total") == sum(q.max_tokens for q in requests)
    assert grew("vllm:request_success_total", finished_reason="length") == n
    assert grew("vllm:request_success_total", finished_reason="abort") == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert grew(f"{name}_count") == n, name
    assert grew("vllm:inter_token_latency_seconds_count") == sum(q.max_tokens - 1 for q in requests)
    # The server's clock starts after the client sends and stops before the client reads: its TTFTs are shorter.
    assert 0 < grew("vllm:time_to_first_token_seconds_sum") <= sum(r.ttft for r in results)
    assert grew("vllm:iteration_tokens_total_sum") == sum(step.num_tokens for step in engine.stats) - steps_before
    assert value(after, "vllm:num_preemptions_total") == engine.scheduler.num_preemptions > 0
    cache = engine.prefix_cache
    assert value(after, "vllm:prefix_cache_queries_total") == cache.queries
    assert value(after, "vllm:prefix_cache_hits_total") == cache.hits > 0
    for name in GAUGES:  # idle again; blocks only the prefix cache keeps count as free
        assert value(after, name) == 0, name


def test_an_aborted_request_counts_as_abort_and_its_gauges_move(server):
    thread, _ = server
    before = scrape(metrics_url(thread))
    body = {"prompt": [5] * 16, "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", thread.url + "/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            during = scrape(metrics_url(thread))
        # leaving the block closes the connection mid-stream: the server aborts the request
    assert value(during, "vllm:num_requests_running") == 1
    assert value(during, "vllm:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = scrape(metrics_url(thread))
        if value(after, "vllm:request_success_total", finished_reason="abort") > 0:
            break
        time.sleep(0.05)
    assert value(after, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(after, "vllm:e2e_request_latency_seconds_count") == value(before, "vllm:e2e_request_latency_seconds_count")
    assert value(after, "vllm:num_requests_running") == 0


def test_each_server_has_a_registry_of_its_own(server):
    _, llm = server
    other = ServerMetrics(llm, "another-name")  # a second server's metrics in this process: no clash
    try:
        text = other.render().decode()
        assert 'model_name="another-name"' in text and 'model_name="tiny"' not in text
        assert 'vllm:generation_tokens_total{engine="0",model_name="another-name"} 0.0' in text
    finally:
        llm.step_callbacks.remove(other.on_step)


def test_promql_names():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket'
            '{model_name="$model_name", engine=~"0|1"}[$__rate_interval]))) / clamp_min(1e-9 + up offset 5m, 1)')
    assert promql_names(expr) == ({"vllm:time_to_first_token_seconds_bucket", "up"}, {"le", "model_name", "engine"})
    assert promql_names("label_values(vllm:num_requests_running, model_name)") == (
        {"vllm:num_requests_running"}, {"model_name"})
    assert promql_names('sum without (engine) (a_total{x!="y"}) and on (x) b') == ({"a_total", "b"}, {"engine", "x"})


def test_every_dashboard_query_reads_only_what_the_server_exports(server):
    thread, _ = server
    samples = scrape(metrics_url(thread))
    exported = set(samples)
    label_names = {name for series in samples.values() for labels, _ in series for name in labels}

    def unknown(expr: str) -> set[str]:
        names, labels = promql_names(expr)
        return (names - exported) | (labels - label_names)

    panels = dashboard_queries()
    titles = " ".join(title.lower() for title, _ in panels)
    for topic in ("first token", "tokens per second", "kv cache", "prefix cache hit", "queue", "batch", "preemption"):
        assert topic in titles, f"the dashboard has no panel on {topic!r}"
    exprs = [expr for _, targets in panels for _, expr in targets]
    assert len(exprs) >= 10
    for expr in exprs:
        assert not unknown(expr), f"{expr!r} reads {unknown(expr)}, which the server does not export"
    read = set().union(*(promql_names(expr)[0] for expr in exprs))
    for name in HISTOGRAMS:
        assert f"{name}_bucket" in read, f"no panel shows {name}"
    assert unknown('rate(vllm:time_to_first_token_seconds_buckets{model_name="x"}[1m])') == {
        "vllm:time_to_first_token_seconds_buckets"}  # the check can fail
    assert unknown('sum by (finish_reason) (vllm:request_success_total)') == {"finish_reason"}
