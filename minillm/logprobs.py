"""Log-probabilities for the API: a token's own, its rank, and the most likely alternatives.

The OpenAI API returns, per generated token, its log-probability and the ``top_logprobs`` most likely
tokens' (``SamplingParams.logprobs``); vLLM adds the same for every prompt token (``prompt_logprobs``),
which scores a text under the model. Both are the log-softmax of the model's *raw* logits in fp32 —
before temperature, penalties, logit bias or filters, vLLM's default — so they describe the model, not
the sampler, and equal transformers' ``log_softmax`` of its logits. A token's rank is 1 + the number of
tokens strictly more likely.

The runner computes them only for the requests that ask: sampled tokens' from the rows it samples from,
prompt tokens' from extra rows of the LM head (``prompt_positions``: every prompt position except the
last, which is the sampling row, and except those already scored before a preemption) — a [tokens, vocab]
fp32 tensor per prefill chunk, the price of asking. The engine then ``record``s them into the request, with
each token's text.
"""

from __future__ import annotations

import torch

from minillm.request import Logprob, Request

# One scored position: (token id, log-probability, rank) of the scored token first, then of the top ones.
ScoredPosition = list[tuple[int, float, int]]


def score(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[ScoredPosition]:
    """logits [R, V]; targets [R] int64 (the token each row scores); num_top[r] top tokens for row r."""
    logprobs = logits.float().log_softmax(dim=-1)
    target_logprobs = logprobs.gather(-1, targets[:, None])
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(max(num_top), dim=-1)
    scored = []
    for target, value, rank, k, ids, values in zip(targets.tolist(), target_logprobs[:, 0].tolist(), ranks.tolist(),
                                                   num_top, top_ids.tolist(), top_logprobs.tolist()):
        scored.append([(target, value, rank)] + [(i, v, j + 1) for j, (i, v) in enumerate(zip(ids[:k], values[:k]))])
    return scored


def prompt_positions(request: Request, start: int, end: int) -> range:
    """Positions in [start, end) whose logits score a prompt token not scored yet (position p scores token
    p + 1), of a request that asks for prompt_logprobs."""
    return range(max(start, len(request.prompt_logprobs) - 1), min(end, request.num_prompt_tokens - 1))


class StepLogprobs:
    """One step's log-probabilities, by the index of their request in the batch; empty (false) if nobody asked."""

    def __init__(self):
        self.sampled: dict[int, ScoredPosition] = {}
        self.prompt: dict[int, list[ScoredPosition]] = {}

    def __bool__(self) -> bool:
        return bool(self.sampled or self.prompt)

    def score_sampled(self, logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request],
                      indices: list[int]) -> None:
        """The sampled tokens [S] from logits [S, V], of ``requests`` (at ``indices`` in the batch): scored
        for the requests that ask."""
        asking = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if asking:
            rows = torch.tensor(asking, device=logits.device)
            scored = score(logits[rows], tokens[rows], [requests[row].params.logprobs for row in asking])
            self.sampled.update((indices[row], s) for row, s in zip(asking, scored))

    def score_prompt(self, index: int, request: Request, logits: torch.Tensor, positions: range) -> None:
        """The prompt tokens after ``positions`` (``prompt_positions``), from those positions' logits [P, V]."""
        targets = torch.tensor(request.prompt_token_ids[positions.start + 1:positions.stop + 1], device=logits.device)
        self.prompt[index] = score(logits, targets, [request.params.prompt_logprobs] * len(positions))

    def record(self, index: int, request: Request, tokenizer) -> None:
        """Append the batch's ``index``-th request's log-probabilities to it, with each token's text."""
        if index in self.prompt:
            request.prompt_logprobs += [_as_dict(s, tokenizer) for s in self.prompt[index]]
        if index in self.sampled:
            scored = self.sampled[index]
            request.logprobs.append(_as_dict(scored, tokenizer))
            request.cumulative_logprob += scored[0][1]


def _as_dict(scored: ScoredPosition, tokenizer) -> dict[int, Logprob]:
    """{token id: Logprob}: the scored token first, then the top tokens not already in it."""
    texts = [None] * len(scored) if tokenizer is None else tokenizer.batch_decode([[t] for t, _, _ in scored])
    entries: dict[int, Logprob] = {}
    for (token, value, rank), text in zip(scored, texts):
        entries.setdefault(token, Logprob(value, rank, text))
    return entries
