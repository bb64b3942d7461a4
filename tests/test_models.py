"""Every supported architecture against transformers, on tiny random-weight models.

Each case is a transformers config (Llama, Mistral, Qwen2, Qwen3, Llama with llama3 RoPE scaling;
tied and untied embeddings; GQA and MHA) with seeded random weights, saved with ``save_pretrained``
and loaded by minillm from the directory. transformers' forward and ``generate`` are the oracle.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from minillm import LLM, SamplingParams
from minillm.attention import CausalAttention

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

CASES = {
    "llama-gqa-untied": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied-3layers": (LlamaConfig, dict(tie_word_embeddings=True, num_hidden_layers=3)),
    "llama-mha": (LlamaConfig, dict(num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 500.0})),
    "llama3-rope-scaling": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=4096)),
    "qwen2-bias": (Qwen2Config, dict(tie_word_embeddings=False, num_hidden_layers=3)),
    "qwen2-tied": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": (Qwen3Config, dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3-untied-mha": (Qwen3Config, dict(tie_word_embeddings=False, num_key_value_heads=4)),
}

SEQ_LEN = 100  # past llama3's original_max_position_embeddings (64): every RoPE band is exercised


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, make_tiny_hf):
    """(name, transformers model, minillm LLM loaded from the model's save_pretrained directory)."""
    config_cls, overrides = CASES[request.param]
    seed = list(CASES).index(request.param)
    hf = make_tiny_hf(config_cls, seed=seed, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=4)
    return request.param, hf, llm, path


def random_ids(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, length), generator=generator)  # no bos/eos inside


def minillm_logits(llm: LLM, ids: torch.Tensor) -> torch.Tensor:
    model = llm.engine.model
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, CausalAttention()))


def test_config_is_read_as_transformers_builds_it(case):
    name, hf, llm, _ = case
    cfg = llm.engine.model_config
    assert cfg.num_layers == hf.config.num_hidden_layers
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (cfg.rope_scaling is not None) == (name == "llama3-rope-scaling")
    # The parameter-count formula against the real module tree (embeddings counted once when tied).
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in llm.engine.model.parameters()) == cfg.num_params


def test_weights_are_loaded_exactly(case):
    _, hf, llm, _ = case
    model = llm.engine.model  # q/k/v and gate/up are fused: compare through the checkpoint views
    ours = {n: model.checkpoint_tensor(n) for n in model.checkpoint_names()}
    theirs = dict(hf.named_parameters())
    assert set(ours) == set(theirs)
    for name, param in theirs.items():
        torch.testing.assert_close(ours[name], param, rtol=0, atol=0, msg=name)
    if hf.config.tie_word_embeddings:
        model = llm.engine.model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_full_sequence_logits_match_transformers(case):
    name, hf, llm, _ = case
    generator = torch.Generator().manual_seed(1234)
    ids = random_ids(generator, 2, SEQ_LEN, hf.config.vocab_size)
    ours = minillm_logits(llm, ids)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits.float()
    assert ours.shape == theirs.shape == (2, SEQ_LEN, hf.config.vocab_size)
    assert theirs.std() > 0.5, "logits too flat for the comparison to mean anything"
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"{name}: max |logit diff| {diff:.3g}"


def test_fused_kernels_give_the_same_logits(case):
    """RMSNorm (+ residual), RoPE and SiLU-and-mul as Triton kernels (the interpreter on a CPU):
    every architecture's logits as with the torch ops."""
    name, hf, llm, _ = case
    ids = random_ids(torch.Generator().manual_seed(7), 1, 24, hf.config.vocab_size)
    model = llm.engine.model
    expected = minillm_logits(llm, ids)
    model.enable_fused_kernels()
    try:
        fused = minillm_logits(llm, ids)
    finally:
        model.enable_fused_kernels(False)
    diff = (fused - expected).abs().max().item()
    assert diff < 1e-4, f"{name}: max |logit diff| {diff:.3g}"


def test_rope_inside_the_kv_store_gives_the_same_logits(case):
    """The Triton paged context with an unquantized cache takes q and k unrotated and applies RoPE in the kernel
    that stores K and V (``kv_store.rope_store_kv``): a prefill and two decode steps give the logits, bit for bit,
    of the RoPE kernel followed by the store (``takes_rope`` off), for every architecture (q/k norms, llama3
    scaling, GQA and MHA)."""
    from minillm.kv.paged import PagedKVCache, PagedStep
    from minillm.kv.paged_triton import TritonPagedBatch
    _, hf, llm, _ = case
    model, config = llm.engine.model, llm.engine.model_config
    ids = random_ids(torch.Generator().manual_seed(11), 1, 14, hf.config.vocab_size)
    block_size, blocks = 4, [3, 0, 5, 1, 4]  # scattered blocks, in the table's order
    model.enable_fused_kernels()
    runs = {}
    try:
        for fused in (True, False):
            cache = PagedKVCache(config, num_blocks=6, block_size=block_size, dtype=torch.float32, device="cpu")
            slot = lambda p: blocks[p // block_size] * block_size + p % block_size  # noqa: E731
            logits = []
            for start, end in ((0, 12), (12, 13), (13, 14)):  # the prompt, then one token at a time
                step = PagedStep.from_host([slot(p) for p in range(start, end)], [blocks], [end - start], [end],
                                           torch.device("cpu"))
                attention = TritonPagedBatch(cache, step)
                attention.takes_rope = fused
                with torch.inference_mode():
                    hidden = model(ids[:, start:end], torch.arange(start, end)[None], attention)
                    logits.append(model.compute_logits(hidden))
            runs[fused] = torch.cat(logits, dim=1)
    finally:
        model.enable_fused_kernels(False)
    assert runs[True].shape == (1, 14, hf.config.vocab_size)
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=0)
    torch.testing.assert_close(runs[True], minillm_logits(llm, ids), rtol=1e-4, atol=1e-4)  # and right


def test_positions_matter(case):
    """Positions reach attention: stretching the distances between the same tokens changes the logits
    (a uniform shift would not: RoPE only sees relative positions)."""
    _, hf, llm, _ = case
    ids = random_ids(torch.Generator().manual_seed(7), 1, 20, hf.config.vocab_size)
    model = llm.engine.model
    with torch.inference_mode():
        base = model.compute_logits(model(ids, torch.arange(20)[None], CausalAttention()))
        stretched = model.compute_logits(model(ids, torch.arange(20)[None] * 3, CausalAttention()))
    assert (base[:, 1:] - stretched[:, 1:]).abs().max() > 1e-2


def hf_greedy_batch(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate on a left-padded batch; each row cut after its first EOS."""
    longest = max(map(len, prompts))
    pad = hf.config.pad_token_id
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          min_new_tokens=0, pad_token_id=pad, eos_token_id=hf.config.eos_token_id)
    rows = []
    for row in out[:, longest:].tolist():
        if hf.config.eos_token_id in row:
            row = row[: row.index(hf.config.eos_token_id) + 1]
        rows.append(row)
    return rows


def test_greedy_padded_batch_matches_transformers(case):
    name, hf, llm, _ = case
    generator = torch.Generator().manual_seed(99)
    lengths = [5, 23, 11, 40]  # one static batch (max_num_seqs=4), three rows left-padded
    prompts = [random_ids(generator, 1, n, hf.config.vocab_size)[0].tolist() for n in lengths]
    max_new = 10
    expected = hf_greedy_batch(hf, prompts, max_new)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
    for prompt, out, want in zip(prompts, outs, expected):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == want, f"{name}: prompt of {len(prompt)} tokens"
        hit_eos = want[-1] == hf.config.eos_token_id
        assert got.finish_reason == ("stop" if hit_eos else "length")


def test_greedy_alone_equals_greedy_in_batch(case):
    """Left padding must not change a row's tokens: each prompt alone gives what it gave batched."""
    _, hf, llm, _ = case
    generator = torch.Generator().manual_seed(5)
    prompts = [random_ids(generator, 1, n, hf.config.vocab_size)[0].tolist() for n in (3, 30, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(alone.outputs[0].token_ids) == 6


def test_sharded_checkpoint_loads_identically(tmp_path, make_tiny_hf):
    hf = make_tiny_hf(Qwen2Config, seed=42, tie_word_embeddings=False)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and len(list(sharded.glob("*.safetensors"))) == len(shards)
    a = LLM(str(single), dtype="float32", device="cpu", max_num_seqs=1)
    b = LLM(str(sharded), dtype="float32", device="cpu", max_num_seqs=1)
    pa, pb = dict(a.engine.model.named_parameters()), dict(b.engine.model.named_parameters())
    assert set(pa) == set(pb)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    ids = random_ids(torch.Generator().manual_seed(3), 1, 30, hf.config.vocab_size)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (minillm_logits(b, ids) - theirs).abs().max() < 1e-4


def test_rows_stopping_early_match_transformers(case):
    """Rows of a static batch that stop early (here on an extra stop token) keep their tokens equal to
    transformers', and the rows still running are not disturbed by the finished ones."""
    name, hf, llm, _ = case
    generator = torch.Generator().manual_seed(2024)
    prompts = [random_ids(generator, 1, n, hf.config.vocab_size)[0].tolist() for n in (8, 19, 4)]
    free_run = hf_greedy_batch(hf, prompts, 12)
    stop_token = free_run[1][2]  # row 1 stops after 3 tokens; other rows stop if they produce it too
    eos = hf.config.eos_token_id
    expected = []
    for row in free_run:
        cut = [i for i, t in enumerate(row) if t in (stop_token, eos)]
        expected.append(row[: cut[0] + 1] if cut else row)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),
                        use_tqdm=False)
    assert len(expected[1]) <= 3
    for out, want in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == want, name
        if want[-1] == stop_token and stop_token != eos:
            assert (got.finish_reason, got.stop_reason) == ("stop", stop_token)
        elif want[-1] == eos:
            assert got.finish_reason == "stop"
        else:
            assert got.finish_reason == "length" and len(got.token_ids) == 12
