"""``minillm bench parallel`` on the CPU (gloo), end to end through the CLI, at the smallest scale:
the result file has the keys BENCHMARKS.md asks for, every parallel run's greedy tokens are one
process's, sizes the model cannot split into are recorded as skipped with the reason, and the
collective and bubble sections cover what was asked. No timing is asserted."""

from __future__ import annotations

import json

from minillm.bench.parallel import COLLECTIVE_TOKENS, format_parallel_table
from minillm.cli import main


def test_bench_parallel_cpu(tmp_path, capsys):
    out = tmp_path / "parallel.json"
    main(["bench", "parallel", "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--device", "cpu",
          "--sizes", "2", "3", "--num-requests", "4", "--latency-runs", "1", "--micro-batches", "1", "3",
          "--output", str(out)])
    result = json.loads(out.read_text())
    for key in ("benchmark", "workload", "model", "device", "date", "command", "commit", "runs"):
        assert key in result, key
    runs = result["runs"]
    assert list(runs) == ["1", "tp2", "tp3", "pp2", "pp3"]
    # 'tiny' has 4 heads and 2 layers: neither 3-way split exists.
    assert "4 attention heads do not split into 3" in runs["tp3"]["skipped"]
    assert "has 2; valid sizes for it: 1 to 2" in runs["pp3"]["skipped"]
    for name in ("1", "tp2", "pp2"):
        run = runs[name]
        assert run["greedy_agreement"] == 1.0, name
        assert run["throughput"]["completed"] == 4 and run["latency"]["decode_tok_s"] > 0
    for name in ("tp2", "pp2"):
        collectives = runs[name]["collectives"]
        assert [c["tokens"] for c in collectives] == list(COLLECTIVE_TOKENS["cpu"])
        assert all(c["bytes"] == c["tokens"] * 64 * 4 for c in collectives)  # hidden 64, float32
    bubble = runs["pp2"]["bubble"]
    assert list(bubble) == ["1", "3"]
    assert (bubble["1"]["formula_bubble"], bubble["3"]["formula_bubble"]) == (1 / 2, 1 / 4)
    assert [len(stage) for stage in bubble["3"]["last_step"]] == [3, 3]  # both stages ran 3 micro-batches
    assert "tp1" not in runs and runs["1"]["ranks"] == 1 and runs["pp2"]["ranks"] == 2
    table = capsys.readouterr().out
    assert "skipped: pipeline_parallel_size=3" in table and format_parallel_table(result) in table
    # The file is rewritten after each measured configuration: a run cut short keeps what it measured.
    assert "done: 1\n" in table and "done: 1, tp2\n" in table and "done: 1, tp2, tp3, pp2\n" in table
