"""Exercise 04: merge partial attention results (the last step of flash-decoding).

A decode step brings one query per sequence, and that query must attend to the whole cached
context. With few sequences a GPU has too little to do, so Flash-Decoding (Dao, Haziza, Massa,
Sizov 2023) cuts each context into ``S`` parts and lets a separate program attend to each part.
Every program returns the attention over *its* part only: an output ``o_i``, normalised by its own
softmax denominator ``l_i = sum_j exp(score_j)`` over the part, and ``lse_i = log l_i`` (the
log-sum-exp of its scores). Your function merges them into attention over the whole context.

Softmax over the union divides by the union's denominator ``l = l_1 + ... + l_S``, so part i
contributes its output with weight ``l_i / l``::

    lse = log(exp(lse_1) + ... + exp(lse_S))        o = sum_i exp(lse_i - lse) * o_i

That is the online-softmax rescaling (Milakov & Gimelshein 2018) applied to whole parts instead of
single scores; FlashAttention (Dao et al. 2022) uses it between tiles of keys.

Worked example, two parts of one key each, value vectors of two dims::

    part 1: score 0      -> lse_1 = 0,      o_1 = [1, 0]
    part 2: score log 3  -> lse_2 = log 3,  o_2 = [0, 1]
    merged: lse = log(1 + 3) = log 4,  weights 1/4 and 3/4,  o = [0.25, 0.75]

Two things make it robust, and the tests check both:

- **Large scores.** ``exp(lse_i)`` overflows float32 once ``lse_i > 88``, and underflows to 0 below
  about -103. Subtract the largest ``lse_i`` first: every weight ``exp(lse_i - max)`` is then in
  [0, 1], and the largest is exactly 1.
- **Empty parts.** A short sequence cut into many parts leaves some parts with no key at all: their
  ``lse`` is ``-inf`` and their ``o`` is 0. ``exp(-inf) = 0`` gives them weight 0, as it should,
  but ``-inf - (-inf)`` is NaN: if *every* part is empty, return ``o = 0`` and ``lse = -inf``.

Where it lives in minillm: ``kernels/paged_attention.py``. The Triton kernel
``paged_decode_attention`` runs stage 1 (one program per sequence, KV head and part) and stage 2,
``_merge_kernel`` (or, with ``merge="last_split"``, the last stage-1 program of each sequence and KV
head to finish), both merging with this arithmetic (``merge_splits`` in ``kernels/split_merge.py``).
Its plain-torch reference, ``paged_decode_attention_ref(..., num_splits=S)``, computes the parts with
``split_partials_ref`` and merges them with the module's ``merge_attention_partials``, looked up at every
call, so you can swap yours in::

    import minillm.kernels.paged_attention as pa
    from exercises.ex04_merge_partials import merge_attention_partials   # yours (run from the repo root)

    pa.merge_attention_partials = merge_attention_partials   # the reference now merges with your code
    pa.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, num_splits=4)

``test_wired_into_minillm`` does that, and also merges the Triton kernel's own partials (read from
its ``PagedAttentionWorkspace``) with your function.

Test your version (from the repository root)::

    pytest exercises/tests/test_ex04_merge_partials.py --impl=mine
"""

from __future__ import annotations

import torch


def merge_attention_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint parts of one context into the result over all of it.

    Args:
        out: ``[..., S, D]`` float tensor: ``out[..., i, :]`` is part i's attention output, already
            divided by its own softmax denominator. Any number of leading dims (batch, heads, ...).
        lse: ``[..., S]``, same dtype: ``lse[..., i]`` is the natural log of part i's softmax
            denominator, ``-inf`` for an empty part (whose ``out`` is 0).

    Returns:
        ``(merged_out [..., D], merged_lse [...])`` in the inputs' dtype: the attention over all
        the parts, and the log of its denominator, so merged results can be merged again. Where
        every part is empty: ``merged_out`` 0 and ``merged_lse`` ``-inf``, never NaN. The inputs
        are not modified.

    Hints:
        - ``lse.amax(dim=-1, keepdim=True)`` is the largest lse of each row; replace a ``-inf``
          maximum (every part empty) with 0 before subtracting it, e.g. with ``torch.where``.
        - The weights ``exp(lse - max)`` broadcast against ``out`` as ``weights.unsqueeze(-1)``.
        - Divide by the sum of the weights, guarding the all-empty rows where it is 0;
          ``merged_lse = max + log(sum of weights)`` (``log(0) = -inf`` is right there).
    """
    # BEGIN SOLUTION: subtract the largest lse, weight each part by exp(lse_i - max), divide by the weights' sum
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # every part empty: no -inf - -inf
    weights = torch.exp(lse - top)  # [..., S], in [0, 1]; 0 for an empty part
    total = weights.sum(dim=-1)  # [...], >= 1 unless every part is empty
    merged = torch.einsum("...s,...sd->...d", weights, out)
    merged = merged / total.clamp(min=torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return merged, top.squeeze(-1) + torch.log(total)
    # END SOLUTION
