"""Pipeline parallelism on the CPU: gloo, two (and three) processes.

The promise: greedy outputs with ``pipeline_parallel_size=N`` are token for token those of one
process, whatever the number of micro-batches a step is split into. Checked on a tiny random
Hugging Face model with tied embeddings and an uneven layer split (3 layers over 2 and over 3
stages), on the embedded SmolLM2 and on a dummy preset. Each spawned LLM serves several
micro-batch counts (rank 0 decides the split per step). Plus the stage arithmetic, the micro-batch
split, the bubble formula against a schedule simulated step by step, and the errors.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.kv.budget import workspace_bytes
from minillm.model.config import PRESETS
from minillm.model.llama import LlamaForCausalLM
from minillm.parallel.pp import (ResidualSum, Stage, bubble_fraction, layer_ranges, split_micro_batches,
                                 stage_footprints)

CONTINUOUS = dict(dtype="float32", device="cpu", batching="continuous", attention_backend="torch", max_model_len=128)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 7], [3], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263], [8, 9],
           [40, 41, 42], [77, 78, 79, 80, 81, 82]]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def one_process(model: str | None, **kwargs) -> list[list[int]]:
    with LLM(model, **CONTINUOUS, **kwargs) as llm:
        return tokens(llm)


def outputs_per_micro_batch_count(llm: LLM, counts) -> dict[int, list[list[int]]]:
    outputs = {}
    for count in counts:
        llm.engine.runner.micro_batches = count  # rank 0 splits each step and sends the split along
        outputs[count] = tokens(llm)
    return outputs


# -- outputs: a pipeline == one process ----------------------------------------------------------


def test_pp_matches_one_process_on_a_tied_llama_with_an_uneven_split(tmp_path, make_tiny_hf):
    from transformers import LlamaConfig

    make_tiny_hf(LlamaConfig, seed=5, num_hidden_layers=3, tie_word_embeddings=True).save_pretrained(tmp_path)
    model = str(tmp_path)
    # A small token budget prefills the long prompt in chunks: steps where no row samples.
    expected = one_process(model, max_num_batched_tokens=8)
    with LLM(model, **CONTINUOUS, max_num_batched_tokens=8, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        # Rank 0 is stage 0: layers 0-1 (the extra layer goes first), the embedding, no norm (the
        # residual add in its place) or head, and a KV cache of its two layers only.
        assert (engine.stage.start, engine.stage.end) == (0, 2)
        assert len(engine.model.model.layers) == 2 and engine.runner.cache.k.shape[0] == 2
        assert isinstance(engine.model.model.embed_tokens, nn.Embedding)
        assert engine.model.lm_head is None and isinstance(engine.model.model.norm, ResidualSum)
        engine.runner.bubble_report()  # drop the timings of earlier steps
        outputs = outputs_per_micro_batch_count(llm, (1, 2, 3, 6))
        report = engine.runner.bubble_report()
    assert outputs == {count: expected for count in (1, 2, 3, 6)}
    # Every step ran on both stages with min(count, sequences) micro-batches; the share measured
    # idle is a fraction, set beside GPipe's formula (timings themselves are not asserted).
    assert report["stages"] == 2
    assert {int(m) for m in report["by_micro_batches"]} <= {1, 2, 3, 4, 5, 6}
    for m, group in report["by_micro_batches"].items():
        assert group["formula_bubble"] == 1 / (int(m) + 1)
        assert 0 <= group["measured_bubble"] < 1 and all(0 < busy <= 1 for busy in group["stage_busy"])
    last_step = report["last_step"]  # each stage's micro-batches in the final step: the same number
    assert len(last_step[0]) == len(last_step[1]) >= 1


def test_pp3_runs_a_middle_stage(tmp_path, make_tiny_hf):
    from transformers import Qwen2Config

    # Qwen2: qkv biases; untied head; one layer per stage, so stage 1 receives and sends.
    make_tiny_hf(Qwen2Config, seed=6, num_hidden_layers=3).save_pretrained(tmp_path)
    expected = one_process(str(tmp_path))
    with LLM(str(tmp_path), **CONTINUOUS, pipeline_parallel_size=3, pipeline_micro_batches=3) as llm:
        assert len(llm.engine.workers.processes) == 2
        assert tokens(llm) == expected


def test_pp2_embedded_model_is_the_one_process_model():
    expected = one_process(None)
    with LLM(**CONTINUOUS, pipeline_parallel_size=2) as llm:  # SmolLM2-135M: 30 layers, 15 per stage
        assert llm.engine.runner.cache.k.shape[0] == 15
        assert outputs_per_micro_batch_count(llm, (2, 4)) == {2: expected, 4: expected}


def test_pp2_dummy_weights_under_a_memory_budget_use_the_fullest_stages_block_count():
    expected = one_process("tiny", load_format="dummy")
    # Stage 1 holds the norm and the LM head, 64 parameters more than stage 0's embedding: a budget
    # that leaves stage 1 room for 6 KV blocks and stage 0 for 7 must give every rank 6.
    (first, _), (last, kv_per_token) = stage_footprints(PRESETS["tiny"], 2, torch.float32)
    block = kv_per_token * 16
    assert last > first
    budget = workspace_bytes(last) + last + 7 * block - 1
    with LLM("tiny", load_format="dummy", **CONTINUOUS, pipeline_parallel_size=2, memory_budget=budget) as llm:
        assert llm.engine.block_tables.allocator.num_blocks == 6
        assert tokens(llm) == expected  # the requests need 7 blocks of 16 tokens: preemption, too
        assert llm.engine.scheduler.num_preemptions > 0


# -- the stage arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize("layers, size", [(30, 2), (32, 4), (3, 2), (7, 3), (5, 5), (9, 1)])
def test_layer_ranges_tile_the_layers_evenly_extra_layers_first(layers, size):
    ranges = layer_ranges(layers, size)
    assert [start for start, _ in ranges] == [0] + [end for _, end in ranges[:-1]]  # contiguous
    assert ranges[-1][1] == layers
    counts = [end - start for start, end in ranges]
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_each_stage_locates_only_its_own_tensors():
    config = PRESETS["smollm2-135m"]  # tied embeddings, 30 layers
    first, last = Stage.of(config, 0, 2), Stage.of(config, 1, 2)
    layer = "model.layers.{}.self_attn.q_proj.weight"
    assert first.locate(layer.format(14), config) == (layer.format(14), (slice(None),))
    assert first.locate(layer.format(15), config) is None
    assert last.locate(layer.format(15), config) == (layer.format(0), (slice(None),))
    assert last.locate(layer.format(14), config) is None
    embedding = "model.embed_tokens.weight"
    assert first.locate(embedding, config)[0] == embedding
    assert last.locate(embedding, config)[0] == "lm_head.weight"  # the tied head, loaded on the last stage
    assert first.locate("model.norm.weight", config) is None
    assert last.locate("model.norm.weight", config)[0] == "model.norm.weight"
    untied = PRESETS["llama2-7b"]
    middle = Stage.of(untied, 1, 4)
    assert middle.locate(embedding, untied) is None and middle.locate("lm_head.weight", untied) is None
    assert Stage.of(untied, 3, 4).locate(embedding, untied) is None  # untied: the head has its own tensor


@pytest.mark.parametrize("preset", ["llama2-7b", "smollm2-135m"])
def test_stage_footprints_add_up_to_the_whole_model(preset):
    config, dtype = PRESETS[preset], torch.bfloat16
    with torch.device("meta"):
        whole = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) * dtype.itemsize
    footprints = stage_footprints(config, 4, dtype)
    # A tied embedding is stored twice: by stage 0 (embedding) and by the last stage (its LM head).
    tied_copy = config.vocab_size * config.hidden_size * dtype.itemsize if config.tie_word_embeddings else 0
    assert sum(weights for weights, _ in footprints) == whole + tied_copy
    assert sum(kv for _, kv in footprints) == config.kv_bytes_per_token(dtype.itemsize)


def test_micro_batches_are_contiguous_non_empty_and_balanced():
    rng = random.Random(0)
    for _ in range(500):
        query_lens = [rng.choice([1, 1, 1, rng.randint(2, 300)]) for _ in range(rng.randint(1, 20))]
        count = rng.randint(1, 10)
        groups = split_micro_batches(query_lens, count)
        assert len(groups) == min(count, len(query_lens))
        assert [first for first, _ in groups] == [0] + [end for _, end in groups[:-1]]
        assert groups[-1][1] == len(query_lens) and all(end > first for first, end in groups)
    assert split_micro_batches([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_micro_batches([1, 1, 1, 1, 12], 2) == [(0, 4), (4, 5)]  # 4 decodes, then a 12-token prefill
    assert split_micro_batches([6, 1, 1, 6], 2) == [(0, 2), (2, 4)]


def simulated_idle_share(stages: int, micro_batches: int) -> float:
    """A GPipe step simulated slot by slot: a stage computes micro-batch m (one slot) once it has
    finished m - 1 and the stage before has finished m."""
    done = [[0] * micro_batches for _ in range(stages)]
    for s in range(stages):
        for m in range(micro_batches):
            done[s][m] = max(done[s][m - 1] if m else 0, done[s - 1][m] if s else 0) + 1
    length = done[-1][-1]
    return (stages * length - stages * micro_batches) / (stages * length)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 7, 32])
def test_bubble_formula_is_the_simulated_schedule(stages, micro_batches):
    assert bubble_fraction(stages, micro_batches) == pytest.approx(simulated_idle_share(stages, micro_batches))


# -- errors --------------------------------------------------------------------------------------


def test_more_stages_than_layers_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 .* has 2; valid sizes for it: 1 to 2"):
        LLM("tiny", load_format="dummy", pipeline_parallel_size=3, **CONTINUOUS)  # 'tiny' has 2 layers


@pytest.mark.parametrize("kwargs, message", [
    (dict(batching="static"), r"pipeline_parallel_size > 1 needs batching='continuous'"),
    (dict(batching="continuous", preemption_mode="swap"), r"pipeline_parallel_size > 1 needs preemption_mode='recompute'"),
    (dict(batching="continuous", tensor_parallel_size=2), r"one way at a time; set one of them to 1"),
    (dict(batching="continuous", pipeline_micro_batches=0), r"pipeline_micro_batches must be a positive integer"),
])
def test_pipeline_config_errors_say_what_is_valid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(pipeline_parallel_size=2, **kwargs)


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True])
def test_pipeline_parallel_size_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        EngineConfig(pipeline_parallel_size=value)


def test_micro_batches_need_a_pipeline():
    with pytest.raises(ValueError, match=r"pipeline_micro_batches=4 needs pipeline_parallel_size > 1"):
        EngineConfig(batching="continuous", pipeline_micro_batches=4)
    assert EngineConfig(batching="continuous", pipeline_parallel_size=3).pipeline_micro_batches == 3


def test_cli_info_with_two_stages(capsys):
    from minillm.cli import main

    main(["info", "--model", "tiny", "--load-format", "dummy", "--device", "cpu", "--batching", "continuous",
          "-pp", "2"])
    printed = capsys.readouterr().out
    assert "pipeline stage 0 of 2, layers 0-0; the rows below are this rank's share" in printed
    assert "2 layers" not in printed and "1 layers" in printed  # rank 0's model: its one layer


def test_the_boundary_sum_is_in_the_hidden_states_dtype():
    """What crosses a stage boundary has the hidden states' dtype, the receiver's buffer: with the norms folded at
    one row the residual is the fp32 stream (model/norm_folding.py), and the sum is rounded to x's dtype once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, generator=g).to(torch.bfloat16)
    stream = torch.randn(1, 1, 64, generator=g)
    hidden, same = ResidualSum()(x, stream)
    assert hidden is same and hidden.dtype == torch.bfloat16
    assert torch.equal(hidden, (x.float() + stream).to(torch.bfloat16))
    assert torch.equal(ResidualSum()(x, stream.to(torch.bfloat16))[0], x + stream.to(torch.bfloat16))
