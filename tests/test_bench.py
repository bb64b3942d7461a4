"""The benchmark harness: workloads as BENCHMARKS.md defines them, vLLM's metric formulas, the KV
memory-waste counts, the CLI's JSON, and the transformers peer that shares minillm's weights."""

import json
import statistics

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.bench.harness import bench_latency, bench_throughput
from minillm.bench.kv_waste import (ServedRequest, contiguous_at_peak, contiguous_over_time, kv_memory_summary,
                                    paged_at_peak, paged_over_time)
from minillm.bench.metrics import RequestTiming, serving_metrics
from minillm.bench.peers import hf_model_sharing_weights, run_hf_continuous, run_hf_static
from minillm.bench.workloads import WORKLOADS, make_workload
from minillm.cli import main


@pytest.mark.parametrize("scale", ["gpu", "cpu"])
def test_mixed_and_tuning_path_sizes_follow_benchmarks_md(scale):
    mixed = make_workload("mixed", scale)
    lo_in, hi_in, lo_out, hi_out = (128, 1024, 32, 256) if scale == "gpu" else (16, 128, 16, 128)
    assert len(mixed) == (128 if scale == "gpu" else 32)
    assert all(lo_in <= len(r.prompt_token_ids) <= hi_in and lo_out <= r.max_tokens <= hi_out for r in mixed)
    assert all(100 <= t < 30000 for r in mixed for t in r.prompt_token_ids)
    path = make_workload("tuning-path", scale)
    shared, total = (192, 512) if scale == "gpu" else (48, 128)
    assert all(len(r.prompt_token_ids) == total for r in path)
    prefixes = {tuple(r.prompt_token_ids[:shared]) for r in path}
    assert 1 < len(prefixes) <= 8  # one of 8 shared system prompts
    assert len({tuple(r.prompt_token_ids[shared:]) for r in path}) == len(path)  # unique tails


def test_workloads_are_seeded_and_prefix_stable():
    for name in WORKLOADS:
        a = make_workload(name, "cpu", seed=3)
        assert a == make_workload(name, "cpu", seed=3)
        assert a != make_workload(name, "cpu", seed=4)
        head = make_workload(name, "cpu", num_requests=2, seed=3)
        if name == "multi-turn-open":  # the first 2 chats, listed turn by turn: the head of each turn's block
            per_turn = len(a) // 4
            assert head == [r for turn in range(4) for r in a[turn * per_turn: turn * per_turn + 2]]
        else:
            assert head == a[: len(head)]


def test_multi_turn_open_resends_the_whole_history():
    chat = make_workload("multi-turn-open", "cpu", num_requests=1)
    assert len(chat) == 4
    for earlier, later in zip(chat, chat[1:]):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
        assert len(later.prompt_token_ids) == len(earlier.prompt_token_ids) + 128


def test_multi_turn_open_lets_each_turn_reuse_the_previous_turns_prompt():
    """Every chat's first turn is listed first, then every second turn, ...: a turn is admitted
    after the previous turn's prompt was computed and cached. Listed chat by chat, the two were
    mostly admitted in one step: 14 % of the prompt tokens hit here (4.8 % at GPU scale)."""
    requests = make_workload("multi-turn-open", "cpu", vocab_size=512)
    llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous",
              enable_prefix_caching=True)
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                           [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [r.max_tokens for r in requests]
    # Turn k can reuse turn k-1's prompt: 0 + 64 + 192 + 320 of a chat's 1024 prompt tokens (56 %).
    # A 2048-token step admits the 8 second turns with the 8 first ones, which leaves 44 %.
    assert llm.engine.prefix_cache.hit_rate > 0.4


def test_workload_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="'nope'"):
        make_workload("nope")
    with pytest.raises(ValueError, match="'multi-turn' is closed-loop"):
        make_workload("multi-turn")
    with pytest.raises(ValueError, match="'tpu'"):
        make_workload("mixed", "tpu")


def test_serving_metrics_against_hand_computed_values():
    generator = torch.Generator().manual_seed(0)
    timings = []
    for _ in range(5):
        arrival = torch.rand(1, generator=generator).item()
        gaps = (torch.rand(6, generator=generator) + 0.1).tolist()
        times = [arrival + sum(gaps[: i + 1]) for i in range(6)]
        timings.append(RequestTiming(arrival, times, 10))
    m = serving_metrics(timings, duration=4.0)
    assert m["completed"] == 5 and m["total_output_tokens"] == 30 and m["total_input_tokens"] == 50
    assert m["output_throughput"] == pytest.approx(30 / 4.0)
    ttfts = [(t.token_times[0] - t.arrival_time) * 1000 for t in timings]
    assert m["mean_ttft_ms"] == pytest.approx(statistics.fmean(ttfts))
    assert m["median_ttft_ms"] == pytest.approx(statistics.median(ttfts))
    tpots = [(t.token_times[-1] - t.token_times[0]) / 5 * 1000 for t in timings]
    assert m["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots))
    itls = sorted((b - a) * 1000 for t in timings for a, b in zip(t.token_times, t.token_times[1:]))
    assert m["mean_itl_ms"] == pytest.approx(statistics.fmean(itls))
    assert itls[-2] <= m["p99_itl_ms"] <= itls[-1]


def test_hf_peer_shares_weights_and_matches_greedy(tiny_llm):
    model = tiny_llm.engine.model
    hf = hf_model_sharing_weights(model, tiny_llm.engine.model_config)
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == model.model.layers[0].self_attn.qkv_proj.weight.untyped_storage().data_ptr()
    requests = make_workload("mixed", "cpu", num_requests=3, vocab_size=tiny_llm.engine.model_config.vocab_size)
    for r in requests:
        r.max_tokens = 6
    timings, tokens, _ = run_hf_static(hf, requests, batch_size=2)
    outs = tiny_llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                             SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert all(len(t.token_times) == 6 for t in timings)


def test_cli_bench_writes_the_keys_benchmarks_md_asks_for(tmp_path, capsys):
    out = tmp_path / "result.json"
    main(["bench", "throughput", "--model", "tiny", "--load-format", "dummy", "--workload", "mixed",
          "--scale", "cpu", "--num-requests", "3", "--max-num-seqs", "2", "--peers", "hf_static",
          "--output", str(out)])
    result = json.loads(out.read_text())
    for key in ("benchmark", "workload", "model", "device", "date", "command", "commit", "runs"):
        assert key in result, key
    assert set(result["runs"]) == {"minillm", "hf_static"}
    expected_tokens = sum(r.max_tokens for r in make_workload("mixed", "cpu", num_requests=3, vocab_size=512))
    for run in result["runs"].values():  # ignore_eos: both do exactly the workload's work
        assert run["completed"] == 3 and run["total_output_tokens"] == expected_tokens
    assert 0.0 <= result["greedy_agreement"]["hf_static"] <= 1.0
    assert result["runs"]["minillm"]["triton_compiles"] == 0  # the static engine runs no Triton kernel
    kv = result["kv_memory"]  # the static engine's own contiguous cache: batches of --max-num-seqs
    assert kv["static_batch_size"] == 2 and kv["num_requests"] == 3
    assert 0 < kv["contiguous_utilisation"] < kv["paged_utilisation"] <= 1
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "KV memory used / reserved" in printed
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot beside the JSON


def test_cli_generate_and_info(smollm, capsys):
    main(["generate", "The capital of France is", "--max-tokens", "4"])
    expected = smollm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0),
                               use_tqdm=False)[0].outputs[0].text
    assert expected and expected in capsys.readouterr().out
    main(["info", "--model", "tiny", "--load-format", "dummy"])
    printed = capsys.readouterr().out
    assert "torch" in printed and "2 layers" in printed and "KV per token" in printed
    with pytest.raises(SystemExit, match="max_tokens"):
        main(["generate", "hello", "--max-tokens", "0"])
    with pytest.raises(SystemExit, match="unknown dummy preset 'nope'"):
        main(["info", "--model", "nope", "--load-format", "dummy"])


def test_cli_bench_latency_reports_fraction_of_the_roofline(tmp_path):
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", "tiny", "--load-format", "dummy", "--scale", "cpu", "--num-requests", "1",
          "--peers", "hf_static", "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "latency" and set(result["runs"]) == {"minillm", "hf_static"}
    for run in result["runs"].values():
        assert 0 < run["fraction_of_roofline"] < 1  # below the limit, or the limit is miscounted
        assert run["mean_decode_tok_s"] == pytest.approx(run["fraction_of_roofline"] * run["roofline_tok_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_roofline_counts_the_bytes_the_engine_stores(monkeypatch):
    """INT8 weights and KV: the roofline reads the engine's bytes, not every parameter at the dtype's size.
    Fixed ceilings: two measurements of this shared CPU's bandwidth would differ by more than the margin."""
    from minillm.bench import roofline

    monkeypatch.setattr(roofline, "measure_ceilings",
                        lambda device, dtype=None: roofline.Ceilings("cpu", "float32", 10.0, 0.1))
    common = dict(model="tiny", load_format="dummy", scale="cpu", num_requests=1, peers=[], device="cpu",
                  dtype="float32", batching="continuous", attention_backend="torch")
    dense = bench_latency(**common)
    quantized = bench_latency(**common, quantization="rtn-int8", kv_cache_dtype="int8")
    assert quantized["ceilings"]["roofline_bytes"] == dense["ceilings"]["roofline_bytes"] == "as stored"
    # Its linears drop from 4 bytes a weight to 1 (plus scales); the rest, embeddings and norms (about
    # half the fp32 bytes of this tiny model), stays.
    assert quantized["runs"]["minillm"]["roofline_tok_s"] > 1.5 * dense["runs"]["minillm"]["roofline_tok_s"]


@pytest.mark.parametrize("flag", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_peers_are_refused_for_a_sharded_engine_before_the_run(flag):
    for bench, peers in ((bench_latency, ["hf_static"]), (bench_throughput, ["hf_cb"])):
        extra = {} if bench is bench_latency else {"workload": "mixed"}
        with pytest.raises(ValueError, match=f"{flag}=2 each rank holds a shard.*--peers"):
            bench(model="tiny", load_format="dummy", scale="cpu", num_requests=1, peers=peers, **extra, **{flag: 2})


def test_hf_continuous_batching_peer_matches_greedy():
    llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous")
    llm.engine.model.lm_head.weight.mul_(30)  # decisive argmaxes (see test_continuous.sharpen)
    requests = make_workload("mixed", "cpu", num_requests=3, vocab_size=llm.engine.model_config.vocab_size)
    for r, n in zip(requests, (4, 9, 6)):
        r.max_tokens = n
    # A cache of 8 blocks (one each would do) instead of one sized from free memory, filled for half a minute.
    timings, tokens, duration = run_hf_continuous(hf_model_sharing_weights(llm.engine.model, llm.engine.model_config),
                                                  requests, num_blocks=8)
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                        [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests],
                        use_tqdm=False)
    assert tokens == [o.outputs[0].token_ids for o in outs]
    assert [len(t.token_times) for t in timings] == [4, 9, 6]
    assert all(t.arrival_time <= t.token_times[0] for t in timings) and duration > 0


# A hand-built mix (max_model_len 16, blocks of 4 tokens), counted from first principles. Lengths are
# prompt + outputs so far, step by step:
#   A: prompt 3, 1 output  -> 4
#   B: prompt 6, 3 outputs -> 7, 8, 9
#   C: prompt 1, 1 output  -> 2
# used over time: 4 + (7 + 8 + 9) + 2 = 30 token-steps; at peak: 4 + 9 + 2 = 15 tokens.
HAND_MIX = [ServedRequest(3, 1), ServedRequest(6, 3), ServedRequest(1, 1)]


def test_kv_waste_at_peak_by_hand():
    contiguous = contiguous_at_peak(HAND_MIX, max_model_len=16)
    assert (contiguous.used, contiguous.reserved) == (15, 3 * 16)
    paged = paged_at_peak(HAND_MIX, block_size=4)
    assert (paged.used, paged.reserved) == (15, 4 + 12 + 4)  # 1, 3 and 1 blocks
    assert paged.fraction == pytest.approx(0.75)


def test_kv_waste_over_time_by_hand():
    # Paged, per step: A 4 of 4; B 7 of 8, 8 of 8, 9 of 12; C 2 of 4 -> 30 of 36.
    paged = paged_over_time(HAND_MIX, block_size=4)
    assert (paged.used, paged.reserved) == (30, 36)
    # Contiguous, batches of 2: [A, B] lives 3 steps, 2 rows of 16 each (A's row idles after step 1);
    # [C] lives 1 step, 1 row -> 30 of 2*16*3 + 16 = 112.
    assert contiguous_over_time(HAND_MIX, max_model_len=16, batch_size=2).reserved == 112
    # One at a time nothing idles: 16 * (1 + 3 + 1) = 80; all three in one batch: 3 rows * 16 * 3 steps = 144.
    assert contiguous_over_time(HAND_MIX, max_model_len=16, batch_size=1).reserved == 80
    assert contiguous_over_time(HAND_MIX, max_model_len=16, batch_size=3).reserved == 144
    assert contiguous_over_time(HAND_MIX, max_model_len=16, batch_size=3).used == 30
    summary = kv_memory_summary(HAND_MIX, max_model_len=16, block_size=4, batch_size=2)
    assert summary["contiguous_utilisation"] == pytest.approx(30 / 112)
    assert summary["paged_utilisation"] == pytest.approx(30 / 36)
    assert summary["contiguous_utilisation_at_peak"] == pytest.approx(15 / 48)
    assert summary["paged_reserved_tokens_at_peak"] == 20
    # A request that fills its blocks and its row exactly wastes nothing in either layout.
    exact = [ServedRequest(7, 1)]
    assert paged_over_time(exact, block_size=4).fraction == 1.0
    assert contiguous_over_time(exact, max_model_len=8, batch_size=4).fraction == 1.0


def test_kv_waste_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="no requests"):
        paged_over_time([], block_size=4)
    with pytest.raises(ValueError, match="request 1 has 20 tokens, more than max_model_len=16"):
        contiguous_over_time([ServedRequest(2, 2), ServedRequest(15, 5)], max_model_len=16, batch_size=2)
    with pytest.raises(ValueError, match="request 0 has 3 prompt and 0 output"):
        paged_at_peak([ServedRequest(3, 0)], block_size=4)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        paged_at_peak(HAND_MIX, block_size=0)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got -1"):
        contiguous_over_time(HAND_MIX, max_model_len=16, batch_size=-1)


def test_bench_reports_kv_memory_of_the_requests_it_served():
    result = bench_throughput(model="tiny", load_format="dummy", workload="mixed", scale="cpu", num_requests=5,
                              peers=[], batching="continuous", dtype="float32", device="cpu", block_size=16)
    kv = result["kv_memory"]
    assert (kv["max_model_len"], kv["block_size"], kv["static_batch_size"]) == (1024, 16, 16)
    # ignore_eos: every request generated exactly its max_tokens, so the counts follow from the workload.
    served = [ServedRequest(len(r.prompt_token_ids), r.max_tokens)
              for r in make_workload("mixed", "cpu", num_requests=5, vocab_size=512)]
    assert kv == kv_memory_summary(served, max_model_len=1024, block_size=16, batch_size=16)
    assert kv["used_tokens_at_peak"] == result["runs"]["minillm"]["total_input_tokens"] + \
        result["runs"]["minillm"]["total_output_tokens"]
    # Short requests in 1024-token rows against 16-token blocks: paged wastes under a block per request.
    assert kv["contiguous_utilisation"] < 0.25 < 0.85 < kv["paged_utilisation"] <= 1


def test_kernel_bench_runs_and_checks_its_kernels(tmp_path):
    """The sweep's code path on the interpreter's tiny shapes: every row carries its error against
    SDPA, so a wrong kernel shows up in the JSON next to its speed."""
    from minillm.bench.kernels import bench_kernels, format_kernel_table, plot_kernels

    runs = bench_kernels(torch.device("cpu"), progress=False)
    assert runs["prefill"] and runs["decode"] and runs["quant"]
    for row in runs["prefill"] + runs["decode"]:
        if row["shape"].get("kv_cache_dtype", "auto") == "auto":
            assert row["max_abs_error"] < 1e-4
        else:  # the kernel is exact on its quantized cache; the quantization's own error shows against SDPA
            assert row["max_abs_error_vs_ref"] < 1e-4 < row["max_abs_error"] < 0.05
        assert row["triton"]["ms"] > 0
    for row in runs["quant"]:  # each format on its default path, and on the GEMV and the dot where both are timed
        for fmt in ("w8a16", "w4a16"):
            timed = [row[fmt][path] for path in ("gemv", "dot") if path in row[fmt]]
            assert row[fmt]["auto_path"] in row[fmt] and timed
            assert all(run["max_rel_error"] < 1e-5 and run["ms"] > 0 and run["speedup"] > 0 for run in timed)
    decode_bytes = {row["shape"]["kv_cache_dtype"]: row["kv_bytes"] for row in runs["decode"]}
    assert decode_bytes["int8"] == decode_bytes["auto"] // 4 + 2 * 2 * 40 * 2 * 2  # fp32 -> int8, + fp16 scales
    result = {"runs": runs, "device": "cpu", "commit": "test"}
    assert "prefill" in format_kernel_table(result) and "w4a16" in format_kernel_table(result)
    plot_kernels(result, str(tmp_path / "k.png"))
    assert (tmp_path / "k.png").stat().st_size > 0


class _CapturedGraphs:
    """What the CUDA decode graphs keep on a GPU, played on the CPU: the KV pool they captured."""

    def __init__(self, cache):
        self.cache, self.num_replays = cache, 0

    def fits(self, batch: int) -> bool:
        return False  # every step runs eagerly

    def release(self) -> None:
        pass


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_the_engine_gives_its_kv_pool_back_before_a_peer_runs(monkeypatch, command):
    """The peers run in minillm's process after it: every reference to the KV pool (the runner's, the
    CUDA graphs', the swap space's) must be gone by then, or on a GPU the pool (90 % of the card)
    leaves the peer out of memory."""
    import weakref

    import minillm.bench.harness as harness

    pools = []

    class WatchedLLM(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runner = self.engine.runner
            runner.graphs = _CapturedGraphs(runner.cache)
            pools.extend(weakref.ref(t) for t in (runner.cache, runner.cache.k, runner.cache.v))

    def peer(*args, **kwargs):
        assert pools and all(ref() is None for ref in pools), "minillm's KV pool is alive while a peer runs"
        return run_hf_static(*args, **kwargs)

    monkeypatch.setattr(harness, "LLM", WatchedLLM)
    monkeypatch.setattr(harness, "run_hf_static", peer)
    common = dict(model="tiny", load_format="dummy", scale="cpu", num_requests=2, peers=["hf_static"],
                  dtype="float32", device="cpu", batching="continuous", preemption_mode="swap", swap_space="1MiB")
    if command == "throughput":
        result = bench_throughput(workload="mixed", **common)
    else:
        result = bench_latency(**common)
    assert "hf_static" in result["runs"]
