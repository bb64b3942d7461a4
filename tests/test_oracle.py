"""The promise: greedy outputs token-for-token identical to transformers.

Twenty varied chat prompts go through minillm in ONE ``generate`` call (so the static scheduler packs
them into left-padded batches of 8, each row with its own max_tokens), and each is compared with
transformers' ``generate`` run on that prompt alone, unpadded, on the same fp32 weights.
"""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams
from minillm.tokenizer import encode_chat

EOS = 2  # SmolLM2's <|im_end|>

# (conversation, max_tokens). The scheduler takes requests 8 at a time in this order and a static
# batch runs until its longest row ends, so the two long requests share the last (smallest) batch.
CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of Australia?"}], 16),
    ([{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}], 32),
    ([{"role": "user", "content": "What is 17 multiplied by 23? Show your working."}], 64),
    ([{"role": "user", "content": "List five fruits that are red."}], 16),
    ([{"role": "user", "content": "Write a haiku about autumn leaves."}], 32),
    ([{"role": "user", "content": "Translate into French: 'The cat is sleeping on the warm windowsill.'"}], 64),
    ([{"role": "system", "content": "You are a pirate. Answer every question in pirate speak."},
      {"role": "user", "content": "How do I boil an egg?"}], 16),
    ([{"role": "user", "content": "hi"}], 32),
    ([{"role": "user", "content": "Who wrote 'Pride and Prejudice', and when was it published?"}], 64),
    ([{"role": "user", "content": "Explain recursion to a ten-year-old in two sentences."}], 16),
    ([{"role": "user", "content": "My name is Ada."},
      {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
      {"role": "user", "content": "What is my name, and how many letters does it have?"}], 32),
    ([{"role": "user", "content": "Give me a SQL query that returns the ten most recent orders from a "
                                  "table called orders with a created_at column."}], 64),
    ([{"role": "user", "content": "Is 91 a prime number? Answer yes or no, then explain."}], 16),
    ([{"role": "system", "content": "You answer only with JSON."},
      {"role": "user", "content": "Describe a book with fields title, author and year."}], 32),
    ([{"role": "user", "content": "Quelle est la couleur du ciel par une journée claire ?"}], 64),
    ([{"role": "user", "content": "Summarise the water cycle as a numbered list of steps."}], 16),
    ([{"role": "user", "content": "Write a short story about a lighthouse keeper who befriends a seagull."}], 256),
    ([{"role": "system", "content": "You are a patient programming tutor."},
      {"role": "user", "content": "How does a hash map work? Include a small Python example."}], 128),
    ([{"role": "user", "content": "Write a limerick about a cat who loves to code."}], 64),
    ([{"role": "user", "content": "What are three differences between TCP and UDP?"}], 32),
]


@pytest.fixture(scope="module")
def minillm_outputs(smollm):
    """All twenty conversations through one generate call, each with its own max_tokens."""
    prompts = [encode_chat(smollm.tokenizer, conversation) for conversation, _ in CONVERSATIONS]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in CONVERSATIONS]
    outputs = smollm.generate(prompts, params, use_tqdm=False)
    return prompts, outputs


def test_workload_shape(smollm, minillm_outputs):
    """The workload really exercises what it claims: 20 prompts, several left-padded batches of the
    engine's default size, and max_tokens from 16 up to 256."""
    prompts, outputs = minillm_outputs
    assert len(prompts) == len(outputs) == 20
    assert smollm.engine.max_batch == 8
    assert len({len(p) for p in prompts[:8]}) > 1  # the first batch holds prompts of different lengths
    budgets = sorted(n for _, n in CONVERSATIONS)
    assert budgets[0] == 16 and budgets[-1] == 256


def test_chat_template_matches_transformers(smollm):
    conversation = CONVERSATIONS[10][0]
    expected = smollm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert encode_chat(smollm.tokenizer, conversation) == list(expected)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_greedy_matches_transformers(index, minillm_outputs, hf_smollm, smollm):
    prompts, outputs = minillm_outputs
    prompt, max_tokens = prompts[index], CONVERSATIONS[index][1]
    out = outputs[index]
    assert out.prompt_token_ids == prompt
    with torch.no_grad():
        hf = hf_smollm.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_tokens, eos_token_id=EOS, pad_token_id=EOS)
    expected = hf[0, len(prompt):].tolist()
    got = out.outputs[0]
    assert got.token_ids == expected, (
        f"prompt {index}: first difference at token "
        f"{next((i for i, (a, b) in enumerate(zip(got.token_ids, expected)) if a != b), min(len(got.token_ids), len(expected)))}"
    )
    if expected[-1] == EOS:
        assert got.finish_reason == "stop"
    else:
        assert len(expected) == max_tokens
        assert got.finish_reason == "length"
    assert got.text == smollm.tokenizer.decode(got.token_ids, skip_special_tokens=True)
    assert out.finished
