"""Log-probabilities, n > 1 and penalties through the engine, on a tiny random Llama against transformers.

- logprobs and prompt_logprobs equal transformers' log_softmax of its logits (fp32, 1e-4), with the right
  ranks and top tokens, whatever the batching (continuous with chunked prefill and the prefix cache,
  static left-padded batches) and with preemption;
- n > 1: n outputs that share the prompt's blocks (fewer blocks and prompt tokens than n requests), all
  blocks free after; seeded sequence i is the request with seed + i, whatever its batch mates;
- penalties and logit bias: greedy decoding equals transformers' logits with the formula applied;
- multi-step and async scheduling give the same answers as single steps for such requests.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, RepetitionPenaltyLogitsProcessor

from minillm import LLM, SamplingParams
from minillm.request import Logprob

VOCAB = 300  # tests/conftest.py's tiny shape
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(make_tiny_hf):
    return make_tiny_hf(LlamaConfig, seed=21, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def make_llm(hf_dir):
    """LLM(**kwargs) over the tiny model, one per configuration."""
    made = {}

    def make(**kwargs) -> LLM:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            options = dict(dtype="float32", device="cpu", batching="continuous", block_size=4, num_kv_blocks=96)
            made[key] = LLM(hf_dir, **{**options, **kwargs})
        return made[key]
    return make


def random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: transformers' log_softmax of its logits at every position."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_position(entry: dict[int, Logprob], reference: torch.Tensor, token: int, num_top: int) -> None:
    """One position's {token: Logprob} against transformers' log-probabilities there."""
    assert token in entry and len(entry) in (num_top, num_top + 1)
    assert next(iter(entry)) == token  # the scored token first, as vLLM orders them
    for t, logprob in entry.items():
        assert abs(logprob.logprob - reference[t].item()) <= ATOL, (t, logprob, reference[t].item())
        # rank = 1 + tokens more likely; within the tolerance, as near-ties may order either way
        more_likely = (reference > reference[t] + ATOL).sum().item(), (reference > reference[t] - ATOL).sum().item()
        assert more_likely[0] + 1 <= logprob.rank <= more_likely[1] + 1, (t, logprob.rank, more_likely)
    top = sorted((t for t in entry if t != token or entry[t].rank <= num_top), key=lambda t: entry[t].rank)
    assert [entry[t].rank for t in top] == list(range(1, num_top + 1))
    kth = reference.topk(num_top).values[-1].item() if num_top else float("inf")
    assert all(reference[t].item() >= kth - ATOL for t in top)  # they are the top num_top tokens


def check_against_transformers(hf, prompt: list[int], out, num_top: int | None, num_prompt_top: int | None) -> None:
    completion = out.outputs[0]
    reference = hf_logprobs(hf, prompt + completion.token_ids)
    if num_top is None:
        assert completion.logprobs is None and completion.cumulative_logprob is None
    else:
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(entry, reference[len(prompt) - 1 + j], token, num_top)
        expected = sum(reference[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected, abs=ATOL * len(completion.token_ids))
    if num_prompt_top is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            check_position(out.prompt_logprobs[j], reference[j - 1], prompt[j], num_prompt_top)


ENGINES = {
    "continuous": dict(),
    "chunked+prefix-cache": dict(max_num_batched_tokens=8, enable_prefix_caching=True),
    "static": dict(batching="static", num_kv_blocks=None),
    "multi-step": dict(num_scheduler_steps=4),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_logprobs_equal_transformers_log_softmax(make_llm, hf, engine):
    llm = make_llm(**ENGINES[engine])
    prompts = [random_prompt(1, 9), random_prompt(2, 22), random_prompt(1, 9)[:5] + random_prompt(3, 14), [7]]
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=20),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2)]
    if engine == "chunked+prefix-cache":  # a cached prompt is still scored in full
        llm.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        reference = hf_logprobs(hf, prompt + out.outputs[0].token_ids)
        greedy = reference[len(prompt) - 1:-1].argmax(-1).tolist()
        assert out.outputs[0].token_ids == greedy  # the logprobs path leaves greedy tokens alone
        check_against_transformers(hf, prompt, out, p.logprobs, p.prompt_logprobs)


def test_logprobs_are_raw_and_survive_preemption(make_llm, hf):
    """Sampled tokens with temperature and penalties: their logprobs are the model's raw ones. A KV cache too
    small for all requests preempts and recomputes: no prompt position is scored twice."""
    llm = make_llm(num_kv_blocks=14, max_num_seqs=4)
    prompts = [random_prompt(10 + i, 11 + 3 * i) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, presence_penalty=1.0, seed=5,
                            ignore_eos=True, logprobs=4, prompt_logprobs=2)
    preemptions = llm.engine.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > preemptions
    for prompt, out in zip(prompts, outs):
        check_against_transformers(hf, prompt, out, 4, 2)


def test_decoded_tokens_come_from_the_tokenizer(make_llm, monkeypatch):
    class Letters:  # a stand-in tokenizer: token t reads "<t>"
        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"<{t}>" for t in ids)

        def batch_decode(self, sequences):
            return [self.decode(ids) for ids in sequences]

    llm = make_llm()
    monkeypatch.setattr(llm.engine, "tokenizer", Letters())
    out = llm.generate([random_prompt(4, 6)], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                             logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    entries = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert all(lp.decoded_token == f"<{t}>" for entry in entries for t, lp in entry.items())
    assert out.outputs[0].text == "".join(f"<{t}>" for t in out.outputs[0].token_ids)


# -- n > 1 ---------------------------------------------------------------------------------------------


def run_tracking_blocks(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> tuple[list, int, int]:
    """Run the requests in one engine; (outputs, the most blocks in use at once, tokens computed)."""
    engine = llm.engine
    allocator = engine.block_tables.allocator
    ids = [engine.add_request(prompt, p) for p in params]
    peak, steps_before, finished = 0, len(engine.stats), {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        peak = max(peak, allocator.num_blocks - allocator.num_free)
    assert allocator.num_free == allocator.num_blocks  # every block came back
    computed = sum(s.num_tokens for s in list(engine.stats)[steps_before:])
    return [finished[i] for i in ids], peak, computed


def test_n_sequences_share_the_prompt_blocks(make_llm):
    llm, n, max_tokens = make_llm(), 4, 6
    prompt = random_prompt(6, 18)  # 18 tokens in blocks of 4: 4 whole blocks before the last prompt token's
    params = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    (group,), shared_peak, shared_computed = run_tracking_blocks(llm, prompt, [SamplingParams(n=n, seed=7, **params)])
    solos, solo_peak, solo_computed = run_tracking_blocks(
        llm, prompt, [SamplingParams(seed=7 + i, **params) for i in range(n)])
    per_sequence = -(-(18 + max_tokens - 1) // 4)  # the last token's K/V is never written
    assert solo_peak == n * per_sequence
    assert shared_peak == per_sequence + (n - 1) * (per_sequence - 4)
    # The prompt is computed once; each other sequence computes only its last 2 prompt tokens.
    assert solo_computed == n * (18 + max_tokens - 1)
    assert shared_computed == 18 + (n - 1) * 2 + n * (max_tokens - 1)
    assert [c.index for c in group.outputs] == list(range(n)) and group.finished
    # Sequence i samples with seed + i: the same tokens as the request with that seed alone.
    assert [c.token_ids for c in group.outputs] == [s.outputs[0].token_ids for s in solos]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1


def test_n_seeded_is_reproducible_whatever_the_batch_mates(make_llm):
    llm = make_llm(max_num_seqs=6)
    prompt = random_prompt(7, 13)
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=9, ignore_eos=True, logprobs=1,
                            frequency_penalty=0.5)
    alone = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    mates = [SamplingParams(temperature=1.0, max_tokens=4), params,
             SamplingParams(n=2, temperature=0.7, max_tokens=11, presence_penalty=1.0, ignore_eos=True)]
    outs = llm.generate([random_prompt(8, 5), prompt, random_prompt(9, 30)], mates, use_tqdm=False)
    assert [c.token_ids for c in outs[1].outputs] == alone
    assert [len(c.token_ids) for c in outs[2].outputs] == [11, 11]
    assert len({tuple(t) for t in alone}) == 3


def test_n_greedy_gives_n_copies_of_the_greedy_answer(make_llm, hf):
    llm = make_llm(max_num_batched_tokens=8)  # the prompt in chunks: sequences fork after the last one
    prompt = random_prompt(11, 21)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=1), use_tqdm=False)[0]
    reference = hf_logprobs(hf, prompt + out.outputs[0].token_ids)
    assert out.outputs[0].token_ids == reference[len(prompt) - 1:-1].argmax(-1).tolist()
    assert all(c.token_ids == out.outputs[0].token_ids for c in out.outputs)
    for c in out.outputs:
        check_against_transformers(hf, prompt, type(out)(out.request_id, None, prompt, [c], True, out.metrics,
                                                         out.prompt_logprobs), 2, 1)


@pytest.mark.parametrize("mode", [dict(), dict(enable_prefix_caching=True),
                                  dict(preemption_mode="swap", swap_space=24 * 4 * 512)])  # 24 CPU blocks:
# 4 tokens of 512 bytes (2 layers x K and V x 2 KV heads x 16 x fp32)
def test_n_with_preemption_and_abort_frees_every_block(make_llm, mode):
    """A cache far too small for 3 x 3 sequences: preemption (recompute, with the prefix cache, or swap) takes
    sequences that share blocks; every answer is the one a roomy engine gives, and every block comes back."""
    llm = make_llm(num_kv_blocks=12, max_num_seqs=8, **mode)
    engine, allocator = llm.engine, llm.engine.block_tables.allocator
    prompts = [random_prompt(20 + i, 9 + 4 * i) for i in range(3)]
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0 and (engine.swapper is None or engine.scheduler.num_swap_outs > 0)
    roomy = make_llm().generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in roomy]
    request_id = engine.add_request(prompts[2], SamplingParams(n=4, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    aborted = engine.abort(request_id)
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * 4
    assert not engine.has_unfinished() and not engine.requests and not engine.groups.by_sequence
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset()  # the tree keeps finished prompts' blocks until evicted
    assert allocator.num_free == allocator.num_blocks


def test_n_ids_and_modes_are_checked(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=2), request_id="a")
    for taken in ("a", "a#1", "a#2"):
        with pytest.raises(ValueError, match=f"'{taken}' is already in use"):
            engine.add_request([5], SamplingParams(max_tokens=2), request_id=taken)
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        engine.add_request([5], SamplingParams(n=2, max_tokens=2), request_id="a#1")
    engine.abort("a")
    static = make_llm(batching="static", num_kv_blocks=None)
    with pytest.raises(ValueError, match="n=2 needs batching='continuous'.*'static'") as info:
        static.generate([[5, 6]], SamplingParams(n=2), use_tqdm=False)
    assert info.value.param == "n"
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {VOCAB}\), got \[{VOCAB}\]") as info:
        llm.generate([[5, 6]], SamplingParams(logit_bias={3: 1.0, VOCAB: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias" and not engine.has_unfinished()


# -- penalties and bias: transformers' logits with the formula applied -----------------------------------


def penalised_greedy(hf, prompt: list[int], steps: int, params: SamplingParams) -> list[int]:
    """Greedy decoding by transformers, each step's logits first put through the formulas."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([ids]), logits[None])[0]
        for token in set(ids[len(prompt):]):
            count = ids[len(prompt):].count(token)
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("knobs", [dict(repetition_penalty=1.5), dict(repetition_penalty=0.6),
                                   dict(frequency_penalty=1.2), dict(presence_penalty=2.0),
                                   dict(frequency_penalty=0.8, presence_penalty=-0.5, repetition_penalty=1.2,
                                        logit_bias={7: 3.0, 8: 2.5})])
def test_penalised_greedy_equals_the_formula_on_transformers_logits(make_llm, hf, knobs):
    llm = make_llm()
    prompt = random_prompt(30, 6) * 2  # a repeated prompt: repetition penalties have something to act on
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **knobs)
    got = llm.generate([prompt, random_prompt(31, 8)], [params, SamplingParams(max_tokens=12, temperature=0.0)],
                       use_tqdm=False)[0].outputs[0].token_ids
    assert got == penalised_greedy(hf, prompt, 12, params)
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert got != plain  # the knob had an effect the test could catch


def test_huge_logit_bias_forces_a_token_and_min_p_one_is_greedy(make_llm):
    llm = make_llm()
    prompt = random_prompt(40, 7)
    forced = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=1.5, seed=2, logit_bias={123: 100},
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [123] * 5
    greedy = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    only_top = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=2.0, min_p=1.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert only_top == greedy


@pytest.mark.parametrize("steps", [dict(num_scheduler_steps=4), dict(num_scheduler_steps=1, async_scheduling=True)])
def test_multi_step_engines_give_single_step_answers(make_llm, steps):
    """Penalties and logprobs need the host after every token: in a multi-step or async engine such requests
    run one pass at a time, beside plain ones that run ahead, and get the single-step engine's answers."""
    prompts = [random_prompt(50 + i, 5 + 2 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.0, logprobs=1),
              SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True, min_p=0.2, n=2)]

    def answers(llm):
        return [[(c.token_ids, c.logprobs) for c in out.outputs] for out in llm.generate(prompts, params,
                                                                                          use_tqdm=False)]
    single = make_llm(async_scheduling=False)
    assert answers(make_llm(**steps)) == answers(single)
