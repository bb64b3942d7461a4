"""Tests for exercise 10: a quantile from a Prometheus histogram's cumulative buckets (PromQL's histogram_quantile)."""

from __future__ import annotations

import bisect
import math
import random

import pytest

import minillm.bench.prometheus as prometheus

INF = math.inf
WORKED = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0)]


def bucketed(values: list[float], bounds: list[float]) -> list[tuple[float, float]]:
    """Cumulative (le, count) buckets of ``values``, as a Prometheus histogram exports them."""
    ordered = sorted(values)
    return [(le, float(bisect.bisect_right(ordered, le))) for le in bounds] + [(INF, float(len(values)))]


def test_the_worked_example(impl):
    assert impl.histogram_quantile(0.5, WORKED) == pytest.approx(0.4)
    assert impl.histogram_quantile(0.9, WORKED) == pytest.approx(0.5 + 0.5 * 3 / 4)  # rank 9: 3rd of 4 in (0.5, 1]


def test_the_first_bucket_starts_at_zero(impl):
    assert impl.histogram_quantile(0.1, WORKED) == pytest.approx(0.05)  # rank 1 of the 2 in (0, 0.1]
    assert impl.histogram_quantile(0.2, WORKED) == pytest.approx(0.1)


def test_order_of_the_buckets_does_not_matter(impl):
    shuffled = [WORKED[2], WORKED[3], WORKED[0], WORKED[1]]
    assert impl.histogram_quantile(0.5, shuffled) == pytest.approx(0.4)


def test_the_inf_bucket_answers_the_highest_finite_bound(impl):
    buckets = [(1.0, 5.0), (2.0, 5.0), (INF, 9.0)]  # four observations above 2: no bound to interpolate to
    assert impl.histogram_quantile(0.99, buckets) == 2.0
    assert impl.histogram_quantile(1.0, WORKED) == 1.0


def test_edge_cases_as_promql(impl):
    assert impl.histogram_quantile(-0.5, WORKED) == -INF
    assert impl.histogram_quantile(1.5, WORKED) == INF
    assert math.isnan(impl.histogram_quantile(math.nan, WORKED))
    assert math.isnan(impl.histogram_quantile(0.5, [(1.0, 0.0), (INF, 0.0)]))  # no observations
    assert math.isnan(impl.histogram_quantile(0.5, [(1.0, 3.0), (2.0, 4.0)]))  # no +Inf bucket
    assert math.isnan(impl.histogram_quantile(0.5, [(INF, 4.0)]))  # one bucket
    assert impl.histogram_quantile(0.5, [(-1.0, 3.0), (0.0, 3.0), (INF, 4.0)]) == -1.0  # a bound <= 0 first
    assert math.isnan(impl.histogram_quantile(0.0, [(1.0, 0.0), (2.0, 4.0), (INF, 4.0)]))  # 0 / 0


@pytest.mark.parametrize("seed", range(5))
def test_matches_minillm_on_random_histograms(impl, seed):
    rng = random.Random(seed)
    bounds = sorted({round(rng.uniform(0.001, 10.0), 3) for _ in range(rng.randint(2, 20))})
    values = [rng.expovariate(rng.uniform(0.2, 5.0)) for _ in range(rng.randint(1, 300))]
    buckets = bucketed(values, bounds)
    for q in (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0):
        mine, reference = impl.histogram_quantile(q, buckets), prometheus.histogram_quantile(q, buckets)
        assert mine == pytest.approx(reference, nan_ok=True), f"q={q}"


@pytest.mark.parametrize("seed", range(3))
def test_the_estimate_lies_in_the_true_quantiles_bucket(impl, seed):
    rng = random.Random(100 + seed)
    bounds = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]  # vLLM's TTFT
    values = [rng.lognormvariate(-2.0, 1.0) for _ in range(1000)]
    buckets = bucketed(values, bounds)
    for q in (0.5, 0.95, 0.99):
        truth = sorted(values)[math.ceil(q * len(values)) - 1]
        index = bisect.bisect_left(bounds, truth)
        low, high = (bounds[index - 1] if index else 0.0), (bounds[index] if index < len(bounds) else bounds[-1])
        assert low <= impl.histogram_quantile(q, buckets) <= high


def test_wired_into_minillm(impl, monkeypatch):
    impl.histogram_quantile(0.5, WORKED)
    name = "vllm:time_to_first_token_seconds"

    def scrape(counts):
        return {f"{name}_bucket": [({"le": str(le), "model_name": "m"}, count) for le, count in counts]}
    before = scrape([(0.1, 1.0), (0.5, 2.0), (1.0, 2.0), (INF, 2.0)])
    after = scrape([(0.1, 3.0), (0.5, 8.0), (1.0, 12.0), (INF, 12.0)])  # the run: WORKED's counts
    expected = prometheus.server_quantiles(before, after)
    monkeypatch.setattr(prometheus, "histogram_quantile", impl.histogram_quantile)
    mine = prometheus.server_quantiles(before, after)
    assert mine == pytest.approx(expected) and mine["server_median_ttft_ms"] == pytest.approx(400.0)
