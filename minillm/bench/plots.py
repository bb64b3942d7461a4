"""Plots of the throughput and latency benchmarks, drawn from their JSON (so a committed JSON can be
redrawn at any time: ``python -m minillm.bench.plots figures/h200/*.json``).

``minillm bench throughput|latency|serve|tuning-path|offload --output x.json`` also writes ``x.png`` beside the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _figure(width: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, 2, figsize=(width, 3.8))


def plot_throughput(result: dict, path: str | Path) -> Path:
    """Output tok/s and mean TTFT of every run (minillm, its variants, the peers) of one workload."""
    runs = {name: m for name, m in result["runs"].items() if "output_throughput" in m}
    if any("turns" in m for m in runs.values()):
        return plot_chat_turns(result, path)
    names = list(runs)
    plt, fig, (left, right) = _figure(4 + 1.3 * len(names))
    colors = ["tab:blue" if n.startswith("minillm") else "tab:gray" for n in names]
    bars = left.bar(names, [runs[n]["output_throughput"] for n in names], color=colors)
    left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.set_ylabel("output tok/s")
    right.bar(names, [runs[n]["mean_ttft_ms"] / 1e3 for n in names], color=colors)
    right.set_ylabel("mean TTFT (s)")
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.suptitle(f"{result['workload']} ({result.get('num_requests', '?')} requests), {result['model']}, "
                 f"{result['device']} · commit {result['commit']}", fontsize=9)
    return _save(plt, fig, path)


def plot_chat_turns(result: dict, path: str | Path) -> Path:
    """Closed-loop chats (``multi-turn``): output tok/s of every run, then mean TTFT and the prefix hit
    rate by turn, the engine's beside the shared-token fraction of the chats themselves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: m for name, m in result["runs"].items() if "turns" in m}
    fig, (bars, ttft, hits) = plt.subplots(1, 3, figsize=(14, 3.8))
    drawn = bars.bar(list(runs), [m["output_throughput"] for m in runs.values()], color="tab:blue")
    bars.bar_label(drawn, fmt="%.0f", fontsize=8)
    bars.set_ylabel("output tok/s")
    bars.tick_params(axis="x", labelrotation=20, labelsize=7)
    for name, m in runs.items():
        turns = [t["turn"] + 1 for t in m["turns"]]
        ttft.plot(turns, [t["mean_ttft_ms"] for t in m["turns"]], "o-", label=name)
        hits.plot(turns, [100 * t["cached_token_fraction"] for t in m["turns"]], "o-", label=f"{name} (engine)")
    first = next(iter(runs.values()))["turns"]
    hits.plot([t["turn"] + 1 for t in first], [100 * t["shared_token_fraction"] for t in first], "k--",
              label="shared tokens (the chats)")
    ttft.set_ylabel("mean TTFT (ms)")
    hits.set_ylabel("prompt tokens cached (%)")
    hits.set_ylim(0, 100)
    for axis in (ttft, hits):
        axis.set_xlabel("turn")
        axis.set_xticks([t["turn"] + 1 for t in first])
        axis.legend(fontsize=7)
    fig.suptitle(f"{result['workload']} ({result.get('num_requests', '?')} turns), {result['model']}, "
                 f"{result['device']} · commit {result['commit']}", fontsize=9)
    return _save(plt, fig, path)


def plot_latency(result: dict, path: str | Path) -> Path:
    """Batch-1 decode tok/s of each run against the bandwidth roofline."""
    runs = {name: m for name, m in result["runs"].items() if "mean_decode_tok_s" in m}
    names = list(runs)
    plt, fig, (left, right) = _figure(9)
    colors = ["tab:blue" if n.startswith("minillm") else "tab:gray" for n in names]
    bars = left.bar(names, [runs[n]["mean_decode_tok_s"] for n in names], color=colors)
    left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.axhline(runs[names[0]]["roofline_tok_s"], color="black", linestyle="--", label="bandwidth roofline")
    left.set_ylabel("decode tok/s (batch 1)")
    left.legend(fontsize=8)
    right.bar(names, [runs[n]["fraction_of_roofline"] * 100 for n in names], color=colors)
    right.set_ylabel("% of roofline")
    right.set_ylim(0, 100)
    fig.suptitle(f"{result['model']}, {result['dtype']}, {result['device']} · commit {result['commit']}", fontsize=9)
    return _save(plt, fig, path)


def plot_serve(result: dict, path: str | Path) -> Path:
    """The online benchmark's curve: TTFT P50/P95/P99 and output tok/s against the offered request rate, one
    colour per server (the runs' label)."""
    runs = result["runs"].values()
    labels = list(dict.fromkeys(m["label"] for m in runs))
    rates = sorted({m["request_rate"] for m in runs}, key=float)  # float("inf") sorts last
    plt, fig, (left, right) = _figure(10)
    for color, label in zip(("tab:blue", "tab:gray", "tab:orange", "tab:green"), labels):
        mine = {m["request_rate"]: m for m in runs if m["label"] == label}
        xs = [i for i, rate in enumerate(rates) if rate in mine]
        at = [mine[rates[i]] for i in xs]
        for q, style in (("median", "-"), ("p95", "--"), ("p99", ":")):
            left.plot(xs, [m[f"{q}_ttft_ms"] for m in at], style, marker="o", color=color,
                      label=f"{label} {'P50' if q == 'median' else q.upper()}")
        right.plot(xs, [m["output_throughput"] for m in at], marker="o", color=color, label=label)
    left.set_yscale("log")
    left.set_ylabel("TTFT (ms)")
    right.set_ylabel("output tok/s")
    for axis in (left, right):
        axis.set_xticks(range(len(rates)), rates)
        axis.set_xlabel("request rate (req/s)")
        axis.legend(fontsize=7)
    fig.suptitle(f"{result['workload']} ({result['num_requests']} requests), {result['model']}, "
                 f"{result['device']} · commit {result['commit']}", fontsize=9)
    return _save(plt, fig, path)


def _save(plt, fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_result(result: dict, json_path: str | Path) -> Path | None:
    """The plot for a benchmark result, beside its JSON; None for benchmarks without one here."""
    from minillm.bench.offload import plot_offload
    from minillm.bench.tuning_path import plot_tuning_path

    plotters = {"throughput": plot_throughput, "latency": plot_latency, "tuning-path": plot_tuning_path,
                "offload": plot_offload, "serve": plot_serve}
    plot = plotters.get(result.get("benchmark"))
    return None if plot is None else plot(result, Path(json_path).with_suffix(".png"))


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit("usage: python -m minillm.bench.plots RESULT.json [...]  (throughput, latency, serve, tuning-path, offload)")
    for path in paths:
        written = plot_result(json.loads(Path(path).read_text()), path)
        print(f"{path}: " + (f"wrote {written}" if written else "no plot for this benchmark"))


if __name__ == "__main__":
    main(sys.argv[1:])
