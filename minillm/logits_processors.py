"""Penalties and a logit bias: changes to a request's logits before any token is picked, greedy or sampled.

The OpenAI API and vLLM let a request push its own distribution around, and each knob has a formula:

- ``logit_bias`` {token: b}: ``logit[token] += b``, so b = +100 all but forces the token and -100 bans it;
- ``repetition_penalty`` r (Keskar et al., "CTRL", 2019, as transformers' ``RepetitionPenaltyLogitsProcessor``
  applies it): every token of the prompt or the output so far has its logit divided by r where positive and
  multiplied by r where negative, so r > 1 makes any token already seen less likely;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definition, over generated tokens only):
  ``logit[token] -= f * count[token] + p * (count[token] > 0)``.

They apply in that order, as vLLM applies them, to the rows that ask (``SamplingParams.adjusts_logits``);
the sampler calls ``adjust_logits`` only when one does, so a batch of plain requests pays nothing. The counts
are rebuilt from the token lists every step: simple, and a cost only the requests that use them pay.
"""

from __future__ import annotations

import torch

from minillm.kv.paged import to_device
from minillm.request import Request


def adjust_logits(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> torch.Tensor:
    """``logits`` [B, V] with the rows ``rows`` (whose requests ask for it) biased and penalised; a new tensor,
    the other rows unchanged (the input may be a CUDA graph's output buffer, read again next step)."""
    index = to_device(rows, torch.long, logits.device)
    adjusted = apply_penalties(logits[index], [requests[i] for i in rows])
    return logits.index_copy(0, index, adjusted)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` [R, V] fp32, one row per request -> the rows with each request's bias and penalties applied."""
    params = [r.params for r in requests]
    device, vocab = logits.device, logits.shape[-1]
    if any(p.logit_bias for p in params):
        rows, tokens, biases = [], [], []
        for row, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                rows.append(row)
                tokens.append(token)
                biases.append(float(bias))
        logits = logits.index_put((to_device(rows, torch.long, device), to_device(tokens, torch.long, device)),
                                  to_device(biases, torch.float32, device), accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = token_counts([r.all_token_ids for r in requests], vocab, device) > 0
        penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        # A penalty below fp32's range (5e-324 is a valid float > 0) divides by zero: keep the logits finite.
        largest = torch.finfo(logits.dtype).max
        penalised = torch.where(logits > 0, (logits / penalty).clamp(max=largest), logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = token_counts([r.output_token_ids for r in requests], vocab, device)
        frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
        presence = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] fp32: how often each token occurs in each list."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    tokens = [token for tokens in token_lists for token in tokens]
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    if tokens:
        counts.index_put_((to_device(rows, torch.long, device), to_device(tokens, torch.long, device)),
                          torch.ones(len(tokens), dtype=torch.float32, device=device), accumulate=True)
    return counts
