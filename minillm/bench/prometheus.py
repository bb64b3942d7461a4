"""Reading a server's metrics the way an operator does: a local Prometheus, PromQL, and the Grafana dashboard.

- ``LocalPrometheus``: Debian's (or any) ``prometheus`` binary started on 127.0.0.1 with a temporary config and
  database, scraping given targets every second; ``query`` / ``query_range`` call its HTTP API. Tests and
  notebook 10 use it to check that what Prometheus computes from the server's ``/metrics`` agrees with what the
  benchmark's client measured.
- ``histogram_quantile``: PromQL's quantile estimate from one histogram's cumulative buckets, in Python, so a
  benchmark can report the server's own view of a run from two scrapes of ``/metrics`` (``server_quantiles``).
- ``promql_names``: the metric and label names a PromQL expression reads (the dashboard test checks that the
  server exports every one); ``dashboard_queries`` / ``plot_dashboard``: the panels of
  ``minillm/serve/grafana_dashboard.json`` and the same panels drawn with matplotlib from Prometheus' data.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "serve" / "grafana_dashboard.json"
INSTALL_HINT = ("the `prometheus` binary is not on PATH: install it (Debian/Ubuntu: `sudo apt-get install -y "
                "prometheus`; elsewhere: a release archive from https://prometheus.io/download/, unpacked onto PATH)")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q``-quantile PromQL's ``histogram_quantile`` estimates from ``buckets``: (upper bound ``le``,
    cumulative count) pairs of one histogram, the last bound +Inf. The quantile's rank ``q * total`` falls in
    the first bucket whose count reaches it, and is interpolated linearly inside it (from 0 for the first bucket);
    in the +Inf bucket, the highest finite bound is the answer. NaN without observations."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start, below = buckets[b - 1]
        count, rank = count - below, rank - below
    return start + (end - start) * rank / count if count else math.nan  # q = 0 in an empty bucket: 0 / 0


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    """``GET url`` (a ``/metrics`` page) parsed: sample name -> [(labels, value)]."""
    response = httpx.get(url, timeout=30)
    response.raise_for_status()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def histogram_buckets(after: dict, name: str, before: dict | None = None) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` (summed over its label sets) in the scrape ``after``, less
    those of an earlier scrape ``before``: the observations between the two."""
    def totals(samples: dict | None) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in (samples or {}).get(f"{name}_bucket", []):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + value
        return out

    now, then = totals(after), totals(before)
    return sorted((le, count - then.get(le, 0.0)) for le, count in now.items())


def server_quantiles(before: dict, after: dict, quantiles=(0.5, 0.95, 0.99)) -> dict[str, float]:
    """The server's own TTFT and inter-token latency quantiles (ms) between two scrapes of its ``/metrics``,
    estimated from vLLM's histograms as PromQL would: ``server_p95_ttft_ms``... Empty if it exports neither."""
    out = {}
    for short, name in (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds")):
        buckets = histogram_buckets(after, name, before)
        if buckets and buckets[-1][1] > 0:
            for q in quantiles:
                key = "median" if q == 0.5 else f"p{round(q * 100)}"
                out[f"server_{key}_{short}_ms"] = 1000 * histogram_quantile(q, buckets)
    return out


# -- PromQL names ------------------------------------------------------------------------------------

# Functions, aggregations and keywords a metric name cannot be (calls are recognised by their parenthesis).
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                   "unless", "inf", "nan", "atan2"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) that a PromQL expression reads. Grafana's ``$variables`` may stand in
    label values and range durations; Grafana's ``label_values(metric, label)`` is read too."""
    labels = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in grouping.split(",") if name.strip()}
    match = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", expr)
    if match:
        names, more_labels = promql_names(match[1])
        return names, labels | more_labels | {match[2]}
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = set()
    for found in re.finditer(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*", bare):
        if found[0].lower() in PROMQL_KEYWORDS or bare[found.end():].lstrip().startswith("("):
            continue
        names.add(found[0])
    return names, labels


def dashboard_queries(path: str | Path = DASHBOARD) -> list[tuple[str, list[tuple[str, str]]]]:
    """The Grafana dashboard's panels: (title, [(legend, PromQL expression)]) in order."""
    dashboard = json.loads(Path(path).read_text())
    return [(panel["title"], [(target.get("legendFormat", ""), target["expr"]) for target in panel["targets"]])
            for panel in dashboard["panels"] if panel.get("targets")]


class LocalPrometheus:
    """``LocalPrometheus(["127.0.0.1:8000"])``: a Prometheus scraping ``targets`` (host:port, path /metrics)
    every ``scrape_interval`` seconds, its database in a temporary directory; ``stop()`` ends it and deletes it."""

    def __init__(self, targets: list[str], *, scrape_interval: float = 1.0, port: int = 0, timeout: float = 60.0):
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        from minillm.bench.serve import free_port

        self.directory = Path(tempfile.mkdtemp(prefix="minillm-prometheus-"))
        interval = f"{max(1, round(scrape_interval * 1000))}ms"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                  "scrape_configs": [{"job_name": "minillm", "static_configs": [{"targets": list(targets)}]}]}
        (self.directory / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.directory / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={self.directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.time()
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "prometheus.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"prometheus did not start on {self.url}:\n{log}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _api(self, path: str, **params) -> dict:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"Prometheus rejected {params.get('query')!r}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict, float]]:
        """An instant query (at ``at``, a Unix time, or now): [(labels, value)]."""
        params = {"query": expr} | ({} if at is None else {"time": at})
        return [(r["metric"], float(r["value"][1])) for r in self._api("query", **params)["result"]]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The value of an expression that yields one series, or None if it yields none."""
        result = self.query(expr, at)
        if len(result) > 1:
            raise ValueError(f"{expr!r} yields {len(result)} series; aggregate it to one")
        return result[0][1] if result else None

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[tuple[dict, list]]:
        """[(labels, [(unix time, value)])] of every series the expression yields over [start, end]."""
        data = self._api("query_range", query=expr, start=start, end=end, step=step)
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]

    def wait_until(self, expr: str, check, timeout: float = 30.0) -> float:
        """Poll ``expr`` (one series) until ``check(value)`` holds; its value then. Scrapes take a moment."""
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            value = self.value(expr)
            if value is not None and check(value):
                return value
            time.sleep(0.25)
        raise TimeoutError(f"{expr!r} is {value} after {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "LocalPrometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def plot_dashboard(prometheus: LocalPrometheus, start: float, end: float, *, model_name: str,
                   rate_interval: str = "5s", step: float = 1.0, path: str | Path | None = None):
    """The dashboard's panels drawn with matplotlib from ``prometheus``'s data over [start, end] (Unix times),
    Grafana's ``$model_name`` and ``$__rate_interval`` filled in; the figure (saved to ``path`` if given)."""
    import matplotlib.pyplot as plt

    panels = dashboard_queries()
    columns = 3
    fig, axes = plt.subplots(-(-len(panels) // columns), columns, figsize=(4.2 * columns, 2.7 * -(-len(panels) // 3)),
                             squeeze=False)
    for axis, (title, targets) in zip(axes.flat, panels):
        for legend, expr in targets:
            expr = expr.replace("$model_name", model_name).replace("$__rate_interval", rate_interval)
            for labels, points in prometheus.query_range(expr, start, end, step):
                xs = [t - start for t, v in points if math.isfinite(v)]
                ys = [v for t, v in points if math.isfinite(v)]
                name = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), legend) or expr[:30]
                axis.plot(xs, ys, label=name)
        axis.set_title(title, fontsize=8)
        axis.tick_params(labelsize=7)
        if axis.lines:
            axis.legend(fontsize=6)
    for axis in axes.flat[len(panels):]:
        axis.axis("off")
    for axis in axes[-1]:
        axis.set_xlabel("seconds", fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
