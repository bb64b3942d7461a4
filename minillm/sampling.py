"""Turning the last position's logits into the next token, per request.

Rows whose request asks for penalties or a logit bias are adjusted first (``logits_processors.py``; skipped
when no row asks). Greedy rows then take the argmax (what the correctness tests compare with transformers).
Sampled rows apply temperature, min-p, top-k and top-p, then draw from the request's own generator when it
has a seed, so a seeded request gives the same tokens whatever else is in its batch.

``top_p_filter`` is exercise ex01: a learner's version can replace ``Sampler.top_p_filter`` on a
running engine (see exercises/ex01_top_p.py).
"""

from __future__ import annotations

import torch

from minillm.kv.paged import to_device
from minillm.logits_processors import adjust_logits
from minillm.request import Request


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p sampling (Nguyen et al., 2024): per row, drop the tokens whose probability is below ``min_p[i]``
    times the most likely token's; the rest become -inf. logits: [B, V]; min_p: [B] in [0, 1]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k[i]`` largest logits (0 keeps all); the rest become -inf."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth_largest = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al., 2019): per row, keep the smallest set of most likely
    tokens whose probabilities sum to at least ``top_p[i]``; the rest become -inf.

    logits: [B, V] float; top_p: [B] in (0, 1]. The most likely token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_before >= top_p[:, None]
    remove_sorted &= top_p[:, None] < 1.0  # 1.0 keeps all, even where fp32 rounding let the cumsum reach 1 early
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    # A plain attribute, so a learner's implementation can be swapped into a live engine.
    top_p_filter = staticmethod(top_p_filter)

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # [B, V] -> [B] int64, torch's argmax's answer: the engine puts minillm's kernel (kernels/greedy.py) here
        # on a GPU, where torch's generic reduction is slow for one row.
        self.argmax = lambda logits: logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits: [B, V] fp32, one row per request -> [B] int64 token ids, left on the device: no host
        sync (multi-step decoding feeds them to the next forward pass)."""
        adjusted = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
        if adjusted:
            logits = adjust_logits(logits, requests, adjusted)
        tokens = self.argmax(logits)
        # Finished rows of a static batch take the argmax: drawing for them would advance the
        # shared generator and make unseeded requests depend on when their batch mates finished.
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy and not r.finished]
        if sampled:
            rows = to_device(sampled, torch.long, logits.device)
            picked = self._sample(logits[rows], [requests[i] for i in sampled])
            tokens[rows] = picked
        return tokens

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        # Through to_device (pinned, non-blocking): a plain torch.tensor(..., device="cuda") would wait
        # for the GPU, a host sync in every pass of a multi-step batch.
        temperature = to_device([p.temperature for p in params], torch.float32, logits.device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0.0 for p in params):
            logits = min_p_filter(logits, to_device([p.min_p for p in params], torch.float32, logits.device))
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[-1]  # a top_k beyond the vocabulary keeps all (and would overflow an int64)
            logits = top_k_filter(logits, to_device([min(max(p.top_k, 0), vocab) for p in params], torch.long,
                                                    logits.device))
        if any(p.top_p < 1.0 for p in params):
            logits = self.top_p_filter(logits, to_device([p.top_p for p in params], torch.float32, logits.device))
        probs = logits.softmax(dim=-1)
        picked = []
        for row, request in zip(probs, requests):
            if request.params.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.params.seed)
            generator = request.generator or self.generator
            picked.append(torch.multinomial(row, 1, generator=generator))
        return torch.cat(picked)
