# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex10_histogram_quantile.py by exercises/make_stubs.py.
"""Exercise 10: a quantile from a Prometheus histogram, as PromQL's ``histogram_quantile`` computes it.

A server cannot keep every request's latency, so it counts them in **buckets**: a Prometheus histogram such as
``vllm:time_to_first_token_seconds`` exports, for each upper bound ``le``, how many observations were ``<= le``
(the counts are *cumulative*), the last bound being ``+Inf`` (every observation). Prometheus then estimates a
quantile from those counts alone, and what it does is simple:

1. the rank of the ``q``-quantile is ``q * total``, with ``total`` the ``+Inf`` bucket's count;
2. the quantile lies in the first bucket whose cumulative count reaches that rank;
3. inside that bucket, PromQL assumes the observations are spread evenly, and interpolates linearly between the
   bucket's lower bound (the previous ``le``, or 0 for the first bucket) and its upper bound;
4. if the rank falls in the ``+Inf`` bucket, there is no upper bound to interpolate to: the answer is the highest
   finite bound.

Worked example: bounds 0.1, 0.5, 1 and +Inf with cumulative counts 2, 6, 10, 10 (10 observations). The median's
rank is 5; the first bucket reaching 5 is ``(0.1, 0.5]``, which holds 6 - 2 = 4 observations, and the rank is the
3rd of them (5 - 2), so the estimate is 0.1 + (0.5 - 0.1) * 3 / 4 = 0.4. The estimate is only as good as the
buckets: the true median could be anywhere in (0.1, 0.5].

Edge cases as PromQL: ``q < 0`` gives -inf, ``q > 1`` +inf, a NaN ``q`` NaN; no ``+Inf`` bucket, fewer than two
buckets, or no observations give NaN; a first bucket whose bound is <= 0 answers that bound (no interpolation
below it); and ``q = 0`` when the first bucket is empty is 0 / 0 there, NaN.

Where it lives in minillm: ``histogram_quantile`` in ``minillm/bench/prometheus.py``. ``minillm bench serve``
scrapes the server's ``/metrics`` before and after each run and reports the server's own P50/P95/P99 TTFT and
inter-token latency from the bucket differences with it (``server_quantiles``); notebook 10 compares those with
what Prometheus answers. ``test_wired_into_minillm`` swaps yours in there.

Test your version (from the repository root)::

    .venv/bin/pytest exercises/tests/test_ex10_histogram_quantile.py
"""

from __future__ import annotations

import math


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q``-quantile (0 <= q <= 1) estimated from ``buckets``: a list of (upper bound ``le``, cumulative
    count) pairs of one histogram, in any order, one of them with ``le = math.inf``.

    Hints:
        - Sort the buckets by their bound first; ``math.inf`` sorts last.
        - Find the first bucket whose count is >= the rank; remember the bucket before it.
        - The count *in* a bucket is its cumulative count minus the previous bucket's.
    """
    raise NotImplementedError("ex10: rank = q * total; the first bucket reaching it; interpolate inside it (the +Inf bucket: its lower bound)")
