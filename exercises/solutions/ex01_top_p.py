"""Exercise 01: top-p (nucleus) sampling.

A language model gives a score (a *logit*) to every token of its vocabulary; softmax turns the scores
into probabilities. Sampling from the full distribution now and then picks a token from the long,
unreliable tail. Greedy decoding (always the argmax) never does, but it tends to repeat itself.
Nucleus sampling (Holtzman et al., 2019, "The Curious Case of Neural Text Degeneration") is the
usual middle way. Per request, keep the smallest set of most likely tokens whose probabilities add
up to at least ``top_p``, throw the rest away, and sample from what is left.

Worked example with the probabilities of four tokens, already sorted::

    probs      0.50  0.30  0.15  0.05
    top_p=0.7  keep  keep   -     -      0.50 < 0.7 but 0.50 + 0.30 = 0.80 >= 0.7
    top_p=0.5  keep   -     -     -      0.50 >= 0.5 already
    top_p=1.0  keep  keep  keep  keep    nothing is thrown away

Where it lives in minillm: ``minillm/sampling.py``. ``Sampler._sample`` divides by the temperature,
applies top-k, then ``self.top_p_filter``, then softmax and ``torch.multinomial``.
``Sampler.top_p_filter`` is a plain attribute, so you can put your version into a running engine::

    from minillm import LLM, SamplingParams
    from exercises.ex01_top_p import top_p_filter          # yours (run from the repo root)

    llm = LLM("tiny", load_format="dummy")                  # random weights, token-id prompts
    llm.engine.runner.sampler.top_p_filter = top_p_filter   # the engine now samples with your code
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.9, top_p=0.8, seed=123))

Test your version (from the repository root)::

    pytest exercises/tests/test_ex01_top_p.py --impl=mine
"""

from __future__ import annotations

import torch


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering. For each row, keep the smallest set of most likely tokens whose
    probabilities sum to at least ``top_p[i]``; every other logit becomes ``-inf``.

    Args:
        logits: ``[B, V]`` float tensor, one row per request. It may already contain ``-inf``
            (top-k runs first in minillm); those tokens have probability 0.
        top_p: ``[B]`` float tensor, each value in ``(0, 1]``.

    Returns:
        A new ``[B, V]`` tensor of the same dtype and device. Kept entries equal the input
        exactly, removed entries are ``-inf``. ``logits`` itself is not modified.

    Rules:
        - The most likely token is always kept, however small ``top_p`` is.
        - ``top_p = 1.0`` keeps every token.
        - With ties at the boundary, keep just enough of the tied tokens. Which of them you keep
          does not matter.

    Hints:
        - ``Tensor.sort(dim=-1, descending=True)`` returns the sorted values *and* the indices
          they came from. You need the indices to put your decision back in vocabulary order,
          with ``Tensor.scatter``.
        - A token is needed exactly when the probability mass of the tokens *before* it in sorted
          order is still below ``top_p``. The mass before each token is ``cumsum - probs``.
        - Pitfall: in float32 the cumulative sum can reach 1.0 before the last token, because
          tail probabilities of 1e-9 vanish in rounding. Make ``top_p = 1.0`` keep everything
          on purpose, not by luck.
    """
    # BEGIN SOLUTION: sort descending, softmax, mass before each token, mask, scatter back
    # 1. Sort every row, most likely token first. `order[i, j]` is the vocabulary id of the
    #    j-th most likely token of row i.
    sorted_logits, order = logits.sort(dim=-1, descending=True)

    # 2. Probabilities in that sorted order. Softmax is monotonic, so they are sorted too.
    #    Entries that are already -inf get probability 0.
    sorted_probs = sorted_logits.softmax(dim=-1)

    # 3. For each position, the mass of all the tokens before it (an "exclusive" cumulative sum).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs

    # 4. A token is needed while the tokens before it have not reached top_p yet.
    keep_sorted = mass_before < top_p[:, None]
    keep_sorted[:, 0] = True                  # the most likely token always stays
    keep_sorted |= (top_p >= 1.0)[:, None]    # 1.0 keeps all, whatever rounding did to the sum

    # 5. Back to vocabulary order: position j of the sorted row belongs to token order[i, j].
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)

    # 6. Out-of-place masked_fill returns a new tensor and leaves `logits` as it was.
    return logits.masked_fill(~keep, float("-inf"))
    # END SOLUTION


def sample_top_p(logits: torch.Tensor, top_p: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row from the nucleus of ``logits``.

    Args:
        logits: ``[B, V]`` float tensor. Temperature, if any, has already been applied
            (``logits / temperature``).
        top_p: ``[B]`` float tensor, each value in ``(0, 1]``.
        generator: a ``torch.Generator`` for reproducible draws. ``None`` uses torch's global one.

    Returns:
        ``[B]`` int64 tensor of token ids. Each id is one that ``top_p_filter`` keeps, drawn with
        probability proportional to its softmax probability.

    Hint: the ``-inf`` from ``top_p_filter`` become exact zeros after softmax, and
    ``torch.multinomial`` renormalises the rest for you.
    """
    # BEGIN SOLUTION: top_p_filter, softmax, torch.multinomial(..., generator=generator)
    probs = top_p_filter(logits, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    # END SOLUTION
