"""``minillm bench serve``: arrivals, argument checks, vLLM's metric definitions on hand-made timings,
``histogram_quantile`` as PromQL computes it, and whole runs against a live server (in this process, and
``--start-server`` in a subprocess), over the tiny random model."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from minillm.bench.prometheus import histogram_quantile
from minillm.bench.serve import (RequestResult, bench_serve, online_metrics, parse_goodput, parse_rates,
                                 send_times)
from minillm.bench.workloads import make_workload
from minillm.cli import main
from minillm.serve import AsyncLLM, ServerThread

VOCAB = 512  # the tiny model's


def test_rates_and_slos_are_checked():
    assert parse_rates(["1", "2.5", "inf"]) == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_rates([bad])
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:abc"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_goodput([bad])


def test_arrivals_are_poisson_at_the_rate_and_seeded():
    times = send_times(4000, rate=8.0, seed=3)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert times == sorted(times) and times[-1] == pytest.approx(4000 / 8.0)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=1e-6)
    # exponential gaps: the standard deviation equals the mean, and P(gap > mean) = 1/e
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.08)
    assert sum(g > 1 / 8.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert send_times(50, 8.0, seed=3) == send_times(50, 8.0, seed=3) != send_times(50, 8.0, seed=4)
    steady = send_times(4000, 8.0, seed=3, burstiness=50.0)
    assert statistics.pstdev([b - a for a, b in zip(steady, steady[1:])]) < 0.2 / 8.0
    assert send_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="burstiness"):
        send_times(5, 1.0, burstiness=0)


def test_metrics_follow_vllms_definitions():
    results = [RequestResult(ok=True, prompt_len=10, max_tokens=5, output_tokens=5, ttft=0.1, latency=0.5,
                             itl=[0.1, 0.1, 0.1, 0.1]),
               RequestResult(ok=True, prompt_len=20, max_tokens=3, output_tokens=3, ttft=0.3, latency=0.9,
                             itl=[0.2, 0.4]),
               RequestResult(ok=False, prompt_len=7, max_tokens=3, error="HTTP 503")]
    m = online_metrics(results, duration=2.0, goodput={"ttft": 200, "tpot": 150})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0 and m["total_token_throughput"] == 19.0
    # TPOT = (E2E - TTFT) / (output - 1): 0.1 s and 0.3 s
    assert m["mean_tpot_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * 1.0 / 6) and m["p99_e2el_ms"] == pytest.approx(896.0)
    assert m["request_goodput"] == 0.5  # the second request misses both SLOs
    assert m["errors"] == ["HTTP 503"] and m["outputs_not_max_tokens"] == 0


def test_histogram_quantile_as_promql():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)  # rank 5: 3 of the 4 in (0.1, 0.5]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(1.0, buckets) == 1.0
    assert histogram_quantile(0.99, [(1.0, 5.0), (2.0, 5.0), (math.inf, 9.0)]) == 2.0  # +Inf: the last finite bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))
    assert math.isnan(histogram_quantile(0.5, [(1.0, 3.0)]))  # no +Inf bucket
    assert histogram_quantile(-0.1, buckets) == -math.inf and histogram_quantile(1.5, buckets) == math.inf


@pytest.fixture(scope="module")
def server():
    llm = AsyncLLM("tiny", load_format="dummy", dtype="float32", device="cpu", max_num_seqs=4)
    thread = ServerThread(llm)
    yield thread
    thread.stop()
    llm.shutdown()


def test_a_sweep_against_a_live_server(server):
    requests = make_workload("mixed", "cpu", num_requests=12, seed=0, vocab_size=VOCAB)
    document = bench_serve(base_url=server.url, requests=requests, rates=[20.0, math.inf], label="tiny",
                           goodput={"ttft": 60_000}, num_warmups=2, header={"benchmark": "serve"})
    assert list(document["runs"]) == ["tiny@20", "tiny@inf"] and document["served_model"] == "tiny"
    for run in document["runs"].values():
        assert run["completed"] == 12 and run["failed"] == 0 and run["outputs_not_max_tokens"] == 0
        assert run["total_output_tokens"] == sum(r.max_tokens for r in requests)
        assert run["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # a 60 s SLO: all are good
        assert 0 < run["median_ttft_ms"] <= run["p95_ttft_ms"] <= run["p99_ttft_ms"]
        # the server's view, from its histograms: the same requests, timed from a later start
        assert 0 < run["server_median_ttft_ms"] <= run["server_p95_ttft_ms"] <= run["server_p99_ttft_ms"]
    assert json.loads(json.dumps(document)) == document  # plain JSON (no Infinity)


def test_bad_token_ids_fail_the_requests_with_the_servers_reason(server):
    requests = make_workload("mixed", "cpu", num_requests=2, seed=0, vocab_size=32000)  # ids past the vocabulary
    run = bench_serve(base_url=server.url, requests=requests, rates=[math.inf])["runs"]["server@inf"]
    assert run["completed"] == 0 and run["failed"] == 2
    assert "HTTP 400" in run["errors"][0] and "[0, 512)" in run["errors"][0]


def test_cli_starts_a_server_and_writes_json_and_plot(tmp_path, capsys):
    output = tmp_path / "serve.json"
    main(["bench", "serve", "--num-requests", "6", "--vocab-size", str(VOCAB), "--request-rate", "30", "inf",
          "--goodput", "ttft:60000", "--output", str(output),
          "--start-server", "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--max-num-seqs", "4"])
    document = json.loads(output.read_text())
    assert output.with_suffix(".png").stat().st_size > 0
    assert document["benchmark"] == "serve" and document["model"] == "tiny" and document["workload"] == "mixed"
    assert list(document["runs"]) == ["minillm@30", "minillm@inf"]
    assert all(run["completed"] == 6 for run in document["runs"].values())
    assert "minillm@inf" in capsys.readouterr().out


def test_cli_needs_one_server():
    with pytest.raises(SystemExit, match="--base-url"):
        main(["bench", "serve"])


def test_the_transformers_serve_checkpoint_loads_with_random_weights_and_no_eos(tmp_path):
    """The peer's checkpoint: a preset's shape in several shards, loaded by transformers as it would be served."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm.bench.peers import write_hf_checkpoint
    from minillm.model.config import PRESETS

    path = write_hf_checkpoint("tiny", tmp_path / "hf", dtype="float32", shard_bytes=1 << 16)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(path)
    config = PRESETS["tiny"]
    assert model.config.num_hidden_layers == config.num_layers and model.config.vocab_size == config.vocab_size
    assert model.config.eos_token_id is None and model.generation_config.eos_token_id is None
    weights = dict(model.named_parameters())
    attention = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.5 * model.config.initializer_range < attention.std() < 2 * model.config.initializer_range
    assert torch.equal(weights["model.norm.weight"], torch.ones_like(weights["model.norm.weight"]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("t5 t17 t511")["input_ids"] == [5, 17, 511]
    assert tokenizer.decode([5, 17]) == "t5 t17"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 17, 511]])).logits).all()
