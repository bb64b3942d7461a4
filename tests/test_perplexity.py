"""Perplexity: the corpus split, the window protocol, the scorer against transformers' loss, chunked
scoring through the paged KV cache, and the CLI's JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import randomize_
from minillm import LLM
from minillm.cli import main
from minillm.eval.perplexity import (calibration_samples, corpus_parts, corpus_text, corpus_tokens,
                                     evaluation_tokens, perplexity, windows)


def test_calibration_and_evaluation_parts_are_disjoint_and_cover_the_corpus():
    from pydoc_data.topics import topics

    parts = corpus_parts()
    calibration, evaluation = set(parts["calibration"]), set(parts["evaluation"])
    assert calibration and evaluation and not calibration & evaluation
    assert calibration | evaluation == set(topics)
    assert max(calibration) < min(evaluation), "the cut is one point in the sorted topics"
    sizes = {part: len(corpus_text(part)) for part in parts}
    assert 0.4 < sizes["calibration"] / sum(sizes.values()) < 0.6
    held_out = corpus_text("evaluation")
    assert not any(topics[name] in held_out for name in calibration)


def test_calibration_samples_come_from_the_calibration_part_only(smollm):
    tokenizer = smollm.tokenizer
    samples = calibration_samples(tokenizer, 8, 256)
    assert samples.shape == (8, 256)
    calibration = corpus_tokens(tokenizer, "calibration")
    step = len(calibration) // 8
    for i, sample in enumerate(samples.tolist()):  # disjoint windows, spread over the part
        assert sample == list(calibration[i * step:i * step + 256])
    text = tokenizer.decode(samples[3])
    assert text in corpus_text("calibration") and text not in corpus_text("evaluation")
    with pytest.raises(ValueError, match="calibration part holds"):
        calibration_samples(tokenizer, 1000, 512)


@pytest.mark.parametrize("num_tokens,seq_len,stride", [(2048, 512, None), (1000, 512, 512), (1000, 256, 100),
                                                       (300, 512, None), (97, 10, 1)])
def test_every_token_is_scored_at_most_once_and_only_with_context(num_tokens, seq_len, stride):
    spans = windows(num_tokens, seq_len, stride)
    scored = [t for start, end, first in spans for t in range(first, end)]
    assert sorted(scored) == scored and len(set(scored)) == len(scored)
    # Unscored: only a window's first token, when no earlier window reached it (it has no context).
    covered = spans[-1][1]
    unscored = set(range(covered)) - set(scored)
    assert unscored == {start for i, (start, _, _) in enumerate(spans) if i == 0 or spans[i - 1][1] <= start}
    assert covered > num_tokens - (stride or seq_len), "as many windows as fit"
    assert all(end - start == min(seq_len, num_tokens) and first > start for start, end, first in spans)


def test_protocol_errors_name_the_bad_value(smollm, tiny_llm):
    with pytest.raises(ValueError, match="stride=600"):
        windows(1000, 512, 600)
    with pytest.raises(ValueError, match="num_tokens=10000000"):
        evaluation_tokens(smollm.tokenizer, 10_000_000)
    with pytest.raises(ValueError, match="batching='continuous'"):
        perplexity(tiny_llm, list(range(2, 40)), seq_len=16, chunk_size=4)
    with pytest.raises(ValueError, match="tokenizer"):
        evaluation_tokens(None, 100)


def test_one_window_matches_the_transformers_loss(smollm, hf_smollm):
    tokens = evaluation_tokens(smollm.tokenizer, 512)
    ours = perplexity(smollm, tokens)
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        loss = hf_smollm(ids, labels=ids).loss.item()  # mean NLL of tokens 1..511 given the ones before
    assert ours.num_scored_tokens == 511
    assert ours.nll == pytest.approx(loss, rel=1e-5)
    assert ours.perplexity == pytest.approx(math.exp(loss), rel=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_scoring_through_the_paged_cache_matches_whole_windows(chunk_size):
    llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous",
              block_size=8, num_kv_blocks=16)
    randomize_(llm.engine.model, seed=chunk_size)  # weights that make attention matter
    tokens = torch.randint(2, 512, (200,), generator=torch.Generator().manual_seed(chunk_size)).tolist()
    whole = perplexity(llm.engine.model, tokens, seq_len=96, stride=40)
    free = llm.engine.block_tables.allocator.num_free
    chunked = perplexity(llm, tokens, seq_len=96, stride=40, chunk_size=chunk_size)
    assert chunked.num_scored_tokens == whole.num_scored_tokens == 175  # windows at 0, 40, 80: tokens 1..175
    assert chunked.window_nll == pytest.approx(whole.window_nll, rel=1e-5)
    assert llm.engine.block_tables.allocator.num_free == free, "the window's KV blocks were not given back"
    # The paged path really reads the cache: flip the cached values after every chunk and the result moves.
    original = llm.engine.runner.forward

    def spoil_then_forward(*args):
        out = original(*args)
        llm.engine.runner.cache.v.mul_(-1.0)
        return out

    llm.engine.runner.forward = spoil_then_forward
    spoiled = perplexity(llm, tokens, seq_len=96, stride=40, chunk_size=chunk_size)
    assert abs(spoiled.nll - whole.nll) > 1e-3


def test_cli_eval_ppl_writes_the_result_header(smollm, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    main(["eval", "ppl", "--num-tokens", "600", "--seq-len", "300", "--dtype", "float32", "--device", "cpu",
          "--output", str(out)])
    result = json.loads(out.read_text())
    for key in ("benchmark", "workload", "model", "device", "date", "command", "commit", "runs", "protocol"):
        assert key in result, key
    assert result["protocol"] | {"num_tokens": 600, "seq_len": 300, "stride": 300} == result["protocol"]
    run = result["runs"]["none"]
    assert run["num_scored_tokens"] == 598 and run["num_windows"] == 2
    tokens = evaluation_tokens(smollm.tokenizer, 600)
    assert run["perplexity"] == pytest.approx(perplexity(smollm, tokens, seq_len=300).perplexity, rel=1e-6)
    assert "perplexity" in capsys.readouterr().out
