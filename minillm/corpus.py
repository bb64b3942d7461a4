"""The built-in text corpus: CPython's reference manual, cut into a calibration and an evaluation part.

Why a module of its own: quantization calibrates on one part (``minillm.quant``) and perplexity scores
the other (``minillm.eval.perplexity``); both read it from here, below either of them.

**The corpus** is ``pydoc_data.topics.topics``, the reference manual's topics that ship with every
CPython (nothing to download; the text changes a little between Python versions, so results record
the Python version). Topics are sorted by name and cut, at a topic boundary, into two parts of about
half the characters each: the first is the *calibration* part (GPTQ and AWQ calibrate on it), the
second the *evaluation* part. A topic lies in exactly one part, so the two are disjoint by
construction. Each part is joined with blank lines and tokenized on its own, without special tokens.
"""

from __future__ import annotations

import functools

import torch

SEQ_LEN = 512
NUM_TOKENS = 16384
CORPUS = "pydoc_data.topics"


@functools.cache
def corpus_parts() -> dict[str, list[str]]:
    """{"calibration": topic names, "evaluation": topic names}: sorted topics cut at half the characters."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = sum(len(topics[name]) for name in names) / 2
    seen, cut = 0, len(names)
    for i, name in enumerate(names):
        if seen >= half:
            cut = i
            break
        seen += len(topics[name])
    return {"calibration": names[:cut], "evaluation": names[cut:]}


def corpus_text(part: str) -> str:
    """The text of one part ("calibration" | "evaluation"): its topics joined by blank lines."""
    from pydoc_data.topics import topics

    parts = corpus_parts()
    if part not in parts:
        raise ValueError(f"corpus part {part!r} does not exist; valid: {', '.join(parts)}")
    return "\n\n".join(topics[name] for name in parts[part])


@functools.lru_cache(maxsize=8)
def corpus_tokens(tokenizer, part: str) -> tuple[int, ...]:
    """One part, tokenized once per tokenizer (cached: quantizing and scoring both need it)."""
    if tokenizer is None:
        raise ValueError("perplexity and calibration need a tokenizer, and this model has none (dummy weights)")
    return tuple(tokenizer.encode(corpus_text(part), add_special_tokens=False))


def evaluation_tokens(tokenizer, num_tokens: int = NUM_TOKENS) -> list[int]:
    """The first ``num_tokens`` tokens of the evaluation part."""
    tokens = corpus_tokens(tokenizer, "evaluation")
    if not 2 <= num_tokens <= len(tokens):
        raise ValueError(f"num_tokens={num_tokens} is out of range: the evaluation part holds "
                         f"{len(tokens)} tokens with this tokenizer (and at least 2 are needed)")
    return list(tokens[:num_tokens])


def calibration_samples(tokenizer, num_samples: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """[num_samples, seq_len] token ids: disjoint windows spread evenly over the calibration part."""
    tokens = corpus_tokens(tokenizer, "calibration")
    if num_samples < 1 or seq_len < 1 or num_samples * seq_len > len(tokens):
        raise ValueError(f"{num_samples} calibration samples of {seq_len} tokens do not fit: the calibration "
                         f"part holds {len(tokens)} tokens with this tokenizer")
    step = len(tokens) // num_samples
    return torch.tensor([tokens[i * step:i * step + seq_len] for i in range(num_samples)])
