"""``minillm bench serve``: the online benchmark, in the shape of vLLM's ``vllm bench serve`` (``benchmark_serving``).

An offline run hands the engine every request at t = 0; a server meets them one by one, as users send them.
Here an async HTTP client (httpx) sends a workload of ``minillm/bench/workloads.py`` to any OpenAI-compatible
server's ``/v1/completions``, streaming (server-sent events), with arrivals at ``request_rate`` per second — a
Poisson process by default (exponential gaps; ``burstiness`` b draws gamma gaps of shape b instead, as vLLM does,
and the gaps are scaled so the last request leaves at n / rate) — or all at once (``inf``), at most
``max_concurrency`` in flight. Prompts are token-id lists (minillm and vLLM accept them), or text decoded with
``tokenizer`` for servers that take text only (``transformers serve``). Output lengths are fixed by ``max_tokens``
and ``ignore_eos``, as offline.

Each request is timed on the client, with vLLM's definitions (``vllm/benchmarks/serve.py``): TTFT = sent ->
first streamed chunk with a choice; ITL = the gap before every later such chunk (a chunk may carry several
tokens); E2E latency = sent -> end of the stream; TPOT = (E2E - TTFT) / (output tokens - 1), output tokens
as the server's ``usage`` reports them. Throughputs divide by the run's wall time; goodput counts the requests
that met every SLO given (``ttft``, ``tpot``, ``e2el`` in ms) per second. A sweep of rates draws the
latency-throughput curve; the result is the JSON envelope of every benchmark (BENCHMARKS.md), one run per rate.
Where the server exports vLLM's histograms on ``/metrics``, each run also carries the server's own TTFT and ITL
quantiles over the run (``server_p95_ttft_ms``...), estimated from two scrapes as PromQL's histogram_quantile does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import random
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import httpx

from minillm.bench.metrics import latency_summary
from minillm.bench.prometheus import scrape, server_quantiles
from minillm.bench.workloads import WorkloadRequest

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds (``time.perf_counter``)."""

    ok: bool = False
    prompt_len: int = 0
    max_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        """(E2E - TTFT) / (output tokens - 1); 0 with a single token (vLLM counts it so for goodput)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_rates(values: list[str]) -> list[float]:
    """``["1", "2.5", "inf"]`` -> request rates per second (``inf``: all at once)."""
    rates = []
    for value in values:
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"request rate must be a number > 0 (requests per second) or 'inf', got {value!r}")
        rates.append(rate)
    return rates


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}``: SLOs in milliseconds."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if name not in SLO_METRICS or not 0 < ms < math.inf:
            raise ValueError(f"goodput SLO must be NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)} and "
                             f"a positive number, got {item!r}")
        slos[name] = ms
    return slos


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def send_times(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson arrivals), got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    scale = n / rate / times[-1]
    return [t * scale for t in times]


def completion_payload(request: WorkloadRequest, model: str | None, ignore_eos: bool, tokenizer=None) -> dict:
    """The ``/v1/completions`` body of one workload request: greedy, streamed, usage in the last chunk."""
    prompt = request.prompt_token_ids if tokenizer is None else tokenizer.decode(request.prompt_token_ids)
    body = {"prompt": prompt, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> RequestResult:
    """Send one streamed completion and time its chunks. A chunk with choices and no ``usage`` is a token
    event (a final usage-only chunk, or one that only closes the choice with its usage, is not)."""
    result = RequestResult(prompt_len=prompt_len, max_tokens=body["max_tokens"], start=time.perf_counter())
    events, last = 0, result.start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error']}"
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_len = usage.get("prompt_tokens", prompt_len)
                elif chunk.get("choices"):
                    if events == 0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    events, last = events + 1, now
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - result.start
    result.output_tokens = result.output_tokens or events
    result.ok = events > 0
    if not result.ok:
        result.error = "the stream ended without a token"
    return result


async def run_requests(base_url: str, requests: list[WorkloadRequest], *, model: str | None = None,
                       request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
                       burstiness: float = 1.0, ignore_eos: bool = True, tokenizer=None,
                       ) -> tuple[list[RequestResult], float]:
    """Send ``requests`` to ``base_url`` (``http://host:port``, with or without ``/v1``) on the arrival
    schedule; return each request's result (in workload order) and the run's wall time."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be None (no limit) or >= 1, got {max_concurrency!r}")
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/completions"
    times = send_times(len(requests), request_rate, seed, burstiness)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=max_concurrency)
                                 ) as client:
        start = time.perf_counter()

        async def one(send_at: float, request: WorkloadRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
            async with limit or nullcontext():
                body = completion_payload(request, model, ignore_eos, tokenizer)
                return await send_request(client, url, body, len(request.prompt_token_ids))

        results = await asyncio.gather(*(one(t, r) for t, r in zip(times, requests)))
        return list(results), time.perf_counter() - start


def online_metrics(results: list[RequestResult], duration: float, goodput: dict[str, float] | None = None) -> dict:
    """vLLM's serving metrics of one run (keys as ``vllm bench serve`` writes them, plus p95)."""
    done = [r for r in results if r.ok]
    total_in, total_out = sum(r.prompt_len for r in done), sum(r.output_tokens for r in done)
    metrics = {"duration": duration, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": total_in, "total_output_tokens": total_out,
               "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
               "total_token_throughput": (total_in + total_out) / duration,
               # requests that came back with another length than asked (ignore_eos off, or a server's limit)
               "outputs_not_max_tokens": sum(r.output_tokens != r.max_tokens for r in done)}
    if goodput:
        def good(r: RequestResult) -> bool:
            seconds = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
            return all(seconds[name] <= ms / 1000 for name, ms in goodput.items())
        metrics["request_goodput"] = sum(map(good, done)) / duration
    metrics |= latency_summary("ttft", [r.ttft for r in done])
    metrics |= latency_summary("tpot", [r.tpot for r in done if r.output_tokens > 1])
    metrics |= latency_summary("itl", [gap for r in done for gap in r.itl])
    metrics |= latency_summary("e2el", [r.latency for r in done])
    errors = [r.error for r in results if not r.ok]
    if errors:
        metrics["errors"] = sorted(set(errors))[:5]
    return metrics


def first_model(base_url: str) -> str:
    """The first model a server lists (``GET /v1/models``), the name requests then ask for."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    response = httpx.get(url, timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url} lists no model; pass --model")
    return models[0]["id"]


def run_sync(coroutine):
    """Run ``coroutine`` to its end from synchronous code, also where an event loop is already running (a
    notebook's cell): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def metrics_page(base_url: str) -> dict | None:
    """The server's ``/metrics`` parsed, or None if it has none (``transformers serve``)."""
    try:
        return scrape(base_url.rstrip("/").removesuffix("/v1") + "/metrics")
    except (httpx.HTTPError, ValueError):
        return None


def bench_serve(*, base_url: str, requests: list[WorkloadRequest], rates: list[float], model: str | None = None,
                label: str = "server", max_concurrency: int | None = None, seed: int = 0, burstiness: float = 1.0,
                goodput: dict[str, float] | None = None, ignore_eos: bool = True, tokenizer=None,
                num_warmups: int = 0, header: dict | None = None, on_progress=None) -> dict:
    """One run per request rate against ``base_url``; the result document (``header`` first: see
    ``harness.result_header``). ``on_progress(document)`` is called after each rate."""
    model = model or first_model(base_url)
    kwargs = dict(model=model, max_concurrency=max_concurrency, seed=seed, burstiness=burstiness,
                  ignore_eos=ignore_eos, tokenizer=tokenizer)
    if num_warmups:  # untimed: kernels compile, caches fill, connections open
        warm = [WorkloadRequest(r.prompt_token_ids, min(r.max_tokens, 8)) for r in requests[:num_warmups]]
        results, _ = run_sync(run_requests(base_url, warm, **kwargs))
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(warm)} warm-up requests failed, e.g. {failed[0]}")
    document = {**(header or {}), "base_url": base_url, "served_model": model, "num_requests": len(requests),
                "max_concurrency": max_concurrency, "burstiness": burstiness, "seed": seed,
                "goodput_slo_ms": goodput or None, "runs": {}}
    document["model"] = document.get("model") or model
    for rate in rates:
        before = metrics_page(base_url)
        results, duration = run_sync(run_requests(base_url, requests, request_rate=rate, **kwargs))
        run = {"label": label, "request_rate": rate_name(rate)} | online_metrics(results, duration, goodput)
        if before is not None:  # the server's own view of the run, from its histograms (vLLM's names)
            run |= server_quantiles(before, metrics_page(base_url) or {})
        document["runs"][f"{label}@{rate_name(rate)}"] = run
        if on_progress is not None:
            on_progress(document)
    return document


def bench_serve_command(args, on_progress=None) -> dict:
    """``minillm bench serve``: the workload and the sweep its flags ask for, against ``--base-url`` or a
    ``minillm serve`` started for the run (``--start-server``); the result document."""
    from minillm.bench.harness import result_header
    from minillm.bench.workloads import make_workload

    if (args.base_url is None) == (args.start_server is None):
        raise ValueError("give the server to benchmark: --base-url URL, or --start-server [minillm serve flags] "
                         "(last on the command line) to start minillm's")
    rates, goodput = parse_rates(args.request_rate), parse_goodput(args.goodput)
    requests = make_workload(args.workload, args.scale, args.num_requests, args.seed, args.vocab_size)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    server = ServerProcess(args.start_server) if args.start_server is not None else None
    try:
        header = result_header("serve", args.workload, args.model or "", args.command_line) | {"scale": args.scale}
        result = bench_serve(base_url=server.url if server else args.base_url, requests=requests, rates=rates,
                             model=args.model, label=args.label or ("minillm" if server else "server"),
                             max_concurrency=args.max_concurrency, seed=args.seed, burstiness=args.burstiness,
                             goodput=goodput, ignore_eos=args.ignore_eos, tokenizer=tokenizer,
                             num_warmups=args.num_warmups, header=header, on_progress=on_progress)
    finally:
        if server is not None:
            server.stop()
    return result


def format_serve_table(document: dict) -> str:
    lines = [f"{document.get('workload', '?')} ({document['num_requests']} requests) -> {document['base_url']} "
             f"({document['served_model']}), max concurrency {document['max_concurrency'] or 'none'}",
             f"{'run':<16}{'req/s':>7}{'tok/s':>9}{'TTFT p50':>10}{'p95':>9}{'p99':>9}{'TPOT p50':>10}"
             f"{'ITL p99':>9}{'E2E p99':>10}{'goodput':>9}{'failed':>7}"]
    for name, m in document["runs"].items():
        goodput = f"{m['request_goodput']:.2f}" if "request_goodput" in m else "-"
        lines.append(f"{name:<16}{m['request_throughput']:>7.2f}{m['output_throughput']:>9.1f}"
                     f"{m['median_ttft_ms']:>10.1f}{m['p95_ttft_ms']:>9.1f}{m['p99_ttft_ms']:>9.1f}"
                     f"{m['median_tpot_ms']:>10.1f}{m['p99_itl_ms']:>9.1f}{m['p99_e2el_ms']:>10.1f}{goodput:>9}"
                     f"{m['failed']:>7}")
        lines += [f"  {name}: {error}" for error in m.get("errors", [])]
    lines.append("latencies in ms; req/s and tok/s over the run's wall time; goodput in req/s within the SLO "
                 f"{document['goodput_slo_ms']}" if document["goodput_slo_ms"] else "latencies in ms")
    return "\n".join(lines)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``minillm serve`` with ``serve_args`` in a subprocess on 127.0.0.1 (a free port), ready when ``/health``
    answers; ``stop()`` ends it gracefully (SIGTERM), killing it after ``grace`` seconds."""

    def __init__(self, serve_args: list[str], timeout: float = 900.0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "minillm.cli", "serve", *serve_args, "--host", "127.0.0.1",
                   "--port", str(port), "--uvicorn-log-level", "warning"]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"`minillm serve {' '.join(serve_args)}` exited with status "
                                   f"{self.process.returncode} before it served; see its log above")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`minillm serve` did not answer {self.url}/health within {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
