"""Shared fixtures: the embedded SmolLM2 (minillm and the transformers oracle) and tiny random HF models.

Everything is fp32 on the CPU, so minillm and transformers can be compared token for token.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernels run under Triton's CPU interpreter. The switch is read when a
# kernel is defined, so it must be set before anything imports minillm.kernels (make test sets it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_speedup import patch_language_once_per_launch  # (tests/ is on sys.path: rootdir conftest)

    patch_language_once_per_launch()

from minillm import env  # noqa: E402 (after the interpreter switch)

# The CI box has 2 cores shared with other jobs; OpenMP threads fighting over them make every matmul
# an order of magnitude slower than one thread. Override with MINILLM_TEST_THREADS.
torch.set_num_threads(env.TEST_THREADS.get())

# HYPOTHESIS_PROFILE=ci (make test): every run draws the same examples (derandomized, so a failure in CI
# reproduces anywhere and no example database is needed), with no per-example deadline: on a shared CPU
# one example of an engine test can take seconds. Each test's own @settings keeps its example count.
settings.register_profile("ci", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The files that keep one worker busy longest (seconds of one worker on the 2-core CI machine, from make test's
# --durations), started first: with --dist loadfile a file is one unit of work, and a long one started last
# would leave one worker running alone at the end. The notebooks run in the same pool under make test.
LONGEST_FIRST = (
    "test_quant_quality.py", "09_tuning_path.ipynb", "test_quant_matmul.py", "07_weight_quantization.ipynb",
    "test_oracle.py", "03_continuous_batching.ipynb", "06_kv_quantization.ipynb", "05_prefix_caching.ipynb",
    "test_bench.py", "test_kv_quant.py", "08_parallelism.ipynb", "test_continuous.py", "test_parallel.py",
    "10_serving.ipynb",
)


def pytest_collection_modifyitems(config, items):
    """Longest files first (LONGEST_FIRST), the rest in collection order; a file's tests stay in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Seeded random weights that make every parameter matter: norms (and q/k norms) are 1 + noise
    rather than all ones, biases are non-zero, and matrices are large enough that logits spread over
    several units (so a wrong op moves them by far more than the test's tolerance)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(std * noise)
    return model


def build_tiny_hf(config_cls, seed: int = 0, **overrides):
    """A tiny transformers model of ``config_cls`` (LlamaConfig, Qwen3Config, ...) with random weights."""
    from transformers import AutoModelForCausalLM

    config = config_cls(**{**TINY_SHAPE, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomize_(model, seed).eval()


@pytest.fixture(scope="session")
def make_tiny_hf():
    """Factory fixture: ``make_tiny_hf(LlamaConfig, seed=1, tie_word_embeddings=True)``."""
    return build_tiny_hf


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct in minillm, fp32 on CPU (shared by every test)."""
    from minillm import LLM

    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm_dir():
    """The cached Hugging Face-format directory the GGUF was converted into."""
    from minillm.model.loader import embedded_model_path, gguf_cache_dir

    path = gguf_cache_dir(embedded_model_path())
    assert (path / "config.json").is_file(), f"no converted cache at {path}"
    return path


@pytest.fixture(scope="session")
def hf_smollm(smollm, smollm_dir):
    """The transformers oracle: the same weights through AutoModelForCausalLM, fp32, eval mode.
    Depends on ``smollm`` so the GGUF cache exists before it is read."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llm():
    """minillm's 'tiny' preset with random weights: fast, token ids only (no tokenizer)."""
    from minillm import LLM

    return LLM("tiny", load_format="dummy", dtype="float32", device="cpu", max_num_seqs=4)


# ChatML, the format SmolLM2's template writes.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory):
    """A tiny random Llama with a real tokenizer and chat template, for tests of text, streams and chat
    that need no real model: a byte-level BPE trained in milliseconds on a few sentences (every string
    encodes, through its 256 byte tokens), its vocabulary the model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["The capital of France is Paris.", "def fibonacci(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
         "Name a color. Red, green and blue are colors.", "Once upon a time, a small model learned to talk."] * 8,
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tiny_text_model")
    model = build_tiny_hf(LlamaConfig, seed=7, vocab_size=len(tokenizer), bos_token_id=0,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
