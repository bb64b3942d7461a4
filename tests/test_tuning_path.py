"""``minillm bench tuning-path`` on a tiny random model: the CPU card is sized from the config alone
(exactly CPU_STATIC_SEQUENCES static sequences, the same card whichever steps run), every step's
configuration is checked before the first one runs, and bad step or peer choices fail clearly."""

from __future__ import annotations

import json

import pytest
import torch

from minillm import LLM
from minillm.bench import tuning_path
from minillm.bench.tuning_path import (CALIBRATION_SAMPLES, CPU_STATIC_SEQUENCES, STEP_NAMES, Step,
                                       bench_tuning_path, cpu_budget, format_tuning_path)
from minillm.bench.workloads import make_workload
from minillm.cli import main
from minillm.config import EngineConfig
from minillm.model.loader import model_bytes_before_loading, read_model_config

TINY = dict(model="tiny", load_format="dummy", device="cpu", dtype="float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_before_loading_equal_the_engines(dtype):
    llm = LLM(**{**TINY, "dtype": dtype})
    assert model_bytes_before_loading(read_model_config("tiny", "dummy"), dtype) == llm.engine.weight_bytes


def test_embedded_model_weight_bytes_before_loading(smollm):
    assert model_bytes_before_loading(smollm.engine.model_config, torch.float32) == smollm.engine.weight_bytes


def test_cpu_card_holds_exactly_the_static_sequences_it_was_sized_for():
    budget = cpu_budget(EngineConfig(**TINY, batching="static"), max_model_len=256)
    # Built only now: the card was sized before any engine existed. One byte less must lose a sequence.
    for card, sequences in ((budget, CPU_STATIC_SEQUENCES), (budget - 1, CPU_STATIC_SEQUENCES - 1)):
        engine = LLM(**TINY, batching="static", max_model_len=256, memory_budget=card).engine
        assert engine.max_batch == sequences


def test_steps_run_on_one_card_and_report_capacity(tmp_path, capsys):
    out = tmp_path / "tuning_path.json"
    main(["bench", "tuning-path", "--model", "tiny", "--load-format", "dummy", "--device", "cpu",
          "--dtype", "float32", "--scale", "cpu", "--num-requests", "3", "--steps", "0_static", "1_paged",
          "2_kv_int8", "--peers", "--output", str(out)])
    result = json.loads(out.read_text())
    for key in ("benchmark", "workload", "model", "device", "date", "command", "commit", "runs"):
        assert key in result, key
    assert result["memory_budget"] == cpu_budget(EngineConfig(**TINY, batching="static"), 256)
    assert result["calibration_samples"] == CALIBRATION_SAMPLES["cpu"]  # the CLI leaves it to the scale
    assert result["steps"] == ["0_static", "1_paged", "2_kv_int8"] and set(result["runs"]) == set(result["steps"])
    runs = result["runs"]
    expected_tokens = sum(r.max_tokens for r in make_workload("tuning-path", "cpu", 3, vocab_size=512))
    for run in runs.values():  # ignore_eos: every step does exactly the workload's work
        assert run["completed"] == 3 and run["total_output_tokens"] == expected_tokens
    assert runs["0_static"]["max_batch"] == CPU_STATIC_SEQUENCES and runs["0_static"]["speedup_over_step0"] == 1.0
    # By hand: tiny's K and V are 2 layers x 2 KV heads x 16 values, 512 bytes a token in fp32, 144 in
    # int8 (16 codes + a 2-byte scale per head). The card's KV room is 4 x 256 fp32 tokens; paging
    # spends it on the same tokens, int8 on whole 16-token blocks of 144-byte tokens.
    room = CPU_STATIC_SEQUENCES * 256 * 512
    assert runs["0_static"]["kv_capacity_tokens"] == runs["1_paged"]["kv_capacity_tokens"] == room // 512
    assert runs["2_kv_int8"]["kv_capacity_tokens"] == room // (144 * 16) * 16
    printed = capsys.readouterr().out
    assert all(name in printed for name in result["steps"]) and format_tuning_path(result) in printed
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_later_step_alone_gets_the_same_card():
    result = bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=[], steps=["2_kv_int8"], progress=False)
    assert result["memory_budget"] == cpu_budget(EngineConfig(**TINY, batching="static"), 256)
    assert result["runs"]["2_kv_int8"]["speedup_over_step0"] is None  # no step 0 to compare with


def test_every_step_is_checked_before_the_first_one_runs(monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before every step's configuration was checked")

    monkeypatch.setattr(tuning_path, "STEPS", tuning_path.STEPS + (Step("6_bad", "bad", {"kv_cache_dtype": "int3"}),))
    monkeypatch.setattr(tuning_path, "LLM", no_engine)
    with pytest.raises(ValueError, match="int3"):
        bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=[])


def test_bad_choices_name_the_value_and_what_is_valid(capsys):
    with pytest.raises(ValueError, match=r"unknown step '3_awq'; valid: 0_static, 1_paged"):
        bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=[], steps=["3_awq"])
    with pytest.raises(ValueError, match="no step to run"):
        bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=[], steps=[])
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=["vllm"])
    with pytest.raises(ValueError, match="run on step 0_static's weights"):
        bench_tuning_path(**TINY, scale="cpu", num_requests=1, peers=["hf_static"], steps=["1_paged"])
    with pytest.raises(SystemExit):
        main(["bench", "tuning-path", "--steps", "1_paged", "3_awq"])
    err = capsys.readouterr().err
    assert "invalid choice: '3_awq'" in err and all(name in err for name in STEP_NAMES)


def test_later_steps_reuse_the_quantized_weights_instead_of_calibrating_again(monkeypatch):
    import minillm.quant.quantize as quantize

    calls = []
    original = quantize.quantize_model
    monkeypatch.setattr(quantize, "quantize_model", lambda *a, **k: calls.append(a[1]) or original(*a, **k))
    result = bench_tuning_path(**TINY, scale="cpu", num_requests=2, peers=[], calibration_samples=1,
                               steps=["3_awq_int4", "4_prefix_cache", "5_multi_step"])
    runs = result["runs"]
    assert calls == ["awq-int4"]  # step 3 calibrated; steps 4 and 5 loaded its checkpoint
    assert "quantized_weights_from" not in runs["3_awq_int4"]
    for name in ("4_prefix_cache", "5_multi_step"):
        assert runs[name]["quantized_weights_from"] == "3_awq_int4"
        assert runs[name]["weight_bytes"] == runs["3_awq_int4"]["weight_bytes"]
        assert runs[name]["prefix_cache_queries"] > 0


def test_the_tour_runs_its_steps_on_one_card_beside_transformers():
    """The tour's path on the tiny model: static batching holds the card's 4 sequences, paged KV the same
    bytes as tokens; the table lists every step and the peer once, each with its ratios."""
    result = bench_tuning_path(**TINY, scale="cpu", num_requests=16, peers=["hf_static"], path=tuning_path.TOUR,
                               max_model_len=tuning_path.TOUR_MAX_MODEL_LEN,
                               max_num_batched_tokens=tuning_path.TOUR_TOKEN_BUDGET, progress=False)
    runs = result["runs"]
    assert result["steps"] == [step.name for step in tuning_path.TOUR]
    assert set(runs) == {*result["steps"], "hf_static"}
    assert runs["static"]["max_batch"] == CPU_STATIC_SEQUENCES
    assert runs["continuous"]["kv_capacity_tokens"] == CPU_STATIC_SEQUENCES * tuning_path.TOUR_MAX_MODEL_LEN
    assert runs["continuous"]["mean_batch_size"] > runs["static"]["mean_batch_size"]  # the card holds all 16 at once
    assert runs["prefix_cache"]["prefix_cache_hits"] > 0
    table = tuning_path.format_tour(result)
    for step in tuning_path.TOUR:
        assert table.count(step.label) == 1
    assert table.count("transformers generate (static)") == 1 and "1.00x" in table
