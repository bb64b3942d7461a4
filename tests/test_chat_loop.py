"""The closed-loop multi-turn chats (minillm.bench.chat_loop): every turn holds the answer the engine gave
to the one before and is sent only after it finished; the engine's prefix hits equal the shared-token
fraction computed from the transcript; the cache changes no answer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.bench.chat_loop import (ChatScript, FinishedPrefixes, chat_run_metrics, make_chats, next_turn_prompt,
                                     run_chats)
from minillm.bench.harness import bench_throughput
from test_continuous import VOCAB, tiny_engine

BS = 4


def small_chats(think_time: float = 0.0) -> ChatScript:
    # Messages of 9 tokens and answers of 7: every prompt + answer ends on a block boundary, so the answer's
    # last token (never computed) decides whether the last block is cached.
    return make_chats("cpu", num_chats=3, seed=5, vocab_size=VOCAB, think_time=think_time, num_turns=3,
                      message_tokens=9, max_tokens=7)


def run(enable_prefix_caching: bool, script: ChatScript, **engine_kwargs):
    engine = tiny_engine(batching="continuous", block_size=BS, num_kv_blocks=200,
                         enable_prefix_caching=enable_prefix_caching, **engine_kwargs)
    return engine, run_chats(engine, script, use_tqdm=False)


def test_next_turn_prompt_is_history_then_answer_then_message():
    history, answer, message = [5, 6, 7], [8, 9], [10]
    assert next_turn_prompt(history, answer, message) == [5, 6, 7, 8, 9, 10]
    assert next_turn_prompt([], [], message) == [10]
    assert (history, answer, message) == ([5, 6, 7], [8, 9], [10])  # inputs untouched


def test_each_turn_holds_the_real_answer_and_waits_for_it():
    script = small_chats()
    _, result = run(True, script, max_num_batched_tokens=16)  # prefills take several steps: turns overlap
    assert [(t.chat, t.turn) for t in result.turns] == [(c, k) for c in range(3) for k in range(3)]
    for chat in range(3):
        turns = [t for t in result.turns if t.chat == chat]
        assert turns[0].output.prompt_token_ids == script.messages[chat][0]
        for before, after in zip(turns, turns[1:]):
            answer = before.output.outputs[0].token_ids
            assert len(answer) == script.max_tokens
            assert after.output.prompt_token_ids == (before.output.prompt_token_ids + answer
                                                     + script.messages[chat][after.turn])
            # Sent when the answer was finished, admitted no earlier.
            assert after.output.metrics.arrival_time >= before.output.metrics.finished_time
            assert after.output.metrics.first_scheduled_time >= before.output.metrics.finished_time


def test_think_time_delays_the_next_turn():
    _, result = run(False, make_chats("cpu", num_chats=2, seed=1, vocab_size=VOCAB, think_time=0.05, num_turns=2,
                                      message_tokens=5, max_tokens=3))
    first, second = result.turns[0], result.turns[1]
    assert second.output.metrics.arrival_time >= first.output.metrics.finished_time + 0.05


def test_hit_rate_equals_the_shared_token_fraction_and_answers_do_not_change():
    script = small_chats()
    engine, cached = run(True, script)
    _, uncached = run(False, script)
    assert cached.token_ids() == uncached.token_ids()
    metrics = chat_run_metrics(cached)
    assert metrics["shared_token_fraction"] > 0.3  # later turns share their history
    assert engine.prefix_cache.hit_rate == pytest.approx(metrics["shared_token_fraction"])
    assert [t.output.num_cached_tokens for t in cached.turns] == [t.shared_tokens for t in cached.turns]
    assert [t["cached_token_fraction"] for t in metrics["turns"]] == [t["shared_token_fraction"]
                                                                      for t in metrics["turns"]]
    assert metrics["turns"][0]["shared_token_fraction"] == 0  # first turns share nothing
    # Without the cache: nothing found, though the chats share just as much.
    assert all(t.output.num_cached_tokens == 0 for t in uncached.turns)
    assert chat_run_metrics(uncached)["shared_token_fraction"] == metrics["shared_token_fraction"]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), block_size=st.sampled_from([1, 2, 4]))
def test_finished_prefixes_against_brute_force(seed, block_size):
    """shared_tokens(prompt) = the longest whole-block common prefix with any finished prompt + answer
    (its last token excluded), never the prompt's last token."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(12))] for _ in range(3)]
    prefixes, finished = FinishedPrefixes(block_size), []
    for _ in range(6):
        prompt = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(6))]
        expected = 0
        for sequence in finished:
            common = 0
            while common < min(len(sequence), len(prompt) - 1) and sequence[common] == prompt[common]:
                common += 1
            expected = max(expected, common // block_size * block_size)
        assert prefixes.shared_tokens(prompt) == expected
        answer = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        prefixes.add(prompt, answer)
        finished.append((prompt + answer[:-1])[:len(prompt + answer[:-1]) // block_size * block_size])


def test_bad_chat_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match="num_chats must be a positive integer, got 0"):
        make_chats("cpu", num_chats=0)
    for bad in (-1, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match=f"think_time must be a finite number of seconds >= 0, got {bad!r}"):
            make_chats("cpu", think_time=bad)
    with pytest.raises(ValueError, match="scale must be 'gpu' or 'cpu', got 'tpu'"):
        make_chats("tpu")
    with pytest.raises(ValueError, match="no peers"):
        bench_throughput(model="tiny", load_format="dummy", workload="multi-turn", scale="cpu", num_requests=1,
                         peers=["hf_static"], batching="continuous")


def test_bench_throughput_runs_the_chats_with_the_cache_on_off_and_on_again(tmp_path):
    from minillm.bench.harness import format_table
    from minillm.bench.plots import plot_result

    result = bench_throughput(model="tiny", load_format="dummy", workload="multi-turn", scale="cpu", num_requests=2,
                              peers=[], batching="continuous", dtype="float32", device="cpu",
                              enable_prefix_caching=True, variants=("prefix_cache_off", "prefix_cache_on"))
    runs = result["runs"]
    assert list(runs) == ["minillm", "minillm_prefix_cache_off", "minillm_prefix_cache_on"]
    assert result["num_requests"] == 8 and result["greedy_agreement"] == {"minillm_prefix_cache_off": 1.0,
                                                                          "minillm_prefix_cache_on": 1.0}
    for name in ("minillm", "minillm_prefix_cache_on"):
        assert runs[name]["prefix_cache_hit_rate"] == pytest.approx(runs[name]["shared_token_fraction"])
        assert runs[name]["shared_token_fraction"] > 0.5
    assert runs["minillm_prefix_cache_off"]["cached_token_fraction"] == 0
    assert [t["turn"] for t in runs["minillm"]["turns"]] == [0, 1, 2, 3]
    assert "by turn" in format_table(result) and "prefix cache on / off" in format_table(result)
    assert plot_result(result, tmp_path / "chats.json").stat().st_size > 0
