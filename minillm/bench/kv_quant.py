"""KV-cache quantization, measured: what it costs in accuracy and what it buys in capacity.

- ``paged_perplexity``: teacher-forced perplexity where attention reads the paged KV cache, chunk
  by chunk as a chunked prefill does, so with ``kv_cache_dtype="int8"`` every score and every
  weighted value comes from quantized K/V — as in serving. (Scoring in one pass with
  ``CausalAttention`` never touches the cache, so it cannot see KV quantization at all.)
- ``heldout_token_ids``: the text it scores: windows from the second half of CPython's reference
  manual (``pydoc_data.topics``, shipped with Python, so nothing is downloaded); the first half is
  left for calibrating weight quantization.
- ``kv_capacity``: how many blocks, tokens and sequences a memory budget holds for each
  ``kv_cache_dtype``, by the engine's own arithmetic (``kv/budget.py``, ``kv/quant.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.bench.roofline import weight_bytes
from minillm.kv.budget import units_that_fit
from minillm.kv.quant import KV_CACHE_DTYPES, kv_bytes_per_token
from minillm.llm import LLM
from minillm.model.config import ModelConfig


def heldout_token_ids(tokenizer, num_windows: int, window: int) -> list[list[int]]:
    """``num_windows`` consecutive windows of ``window`` tokens from the middle of the reference
    manual (topics in sorted order, each tokenized on its own: no warning about long inputs)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids += tokenizer(topics[name] + "\n\n", add_special_tokens=False)["input_ids"]
    start = len(ids) // 2
    if start + num_windows * window > len(ids):
        raise ValueError(f"the held-out half has {len(ids) - start} tokens; {num_windows} windows of {window} "
                         "do not fit")
    return [ids[start + i * window : start + (i + 1) * window] for i in range(num_windows)]


@torch.inference_mode()
def paged_perplexity(llm: LLM, windows: list[list[int]], chunk: int = 64) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window, given the
    ones before it, computed through ``llm``'s paged cache (``batching="continuous"``).

    Each window gets its own blocks and is fed ``chunk`` tokens at a time; the runner writes the
    chunk's K/V (quantized, if the cache is) and attention reads the whole context back from the
    cache, the chunk's own tokens included. The blocks are freed afterwards."""
    engine = llm.engine
    if engine.config.batching != "continuous":
        raise ValueError(f"paged_perplexity reads the paged KV cache: it needs batching='continuous', "
                         f"got {engine.config.batching!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    total_nll, count = 0.0, 0
    for index, ids in enumerate(windows):
        if not 2 <= len(ids) <= engine.max_model_len:
            raise ValueError(f"window {index} has {len(ids)} tokens; it needs 2..max_model_len={engine.max_model_len}")
        request_id = f"perplexity-{index}"
        engine.block_tables.grow(request_id, len(ids))
        table = engine.block_tables.tables[request_id]
        try:
            for start in range(0, len(ids) - 1, chunk):
                end = min(start + chunk, len(ids))
                logits = engine.runner.forward(ids[start:end], list(range(start, end)),
                                               engine.block_tables.slots(request_id, start, end), [table],
                                               [end - start], [end], list(range(end - start)))
                targets = torch.tensor(ids[start + 1 : end + 1], device=logits.device)
                total_nll += F.cross_entropy(logits[: len(targets)].float(), targets, reduction="sum").item()
                count += len(targets)
        finally:
            engine.block_tables.free(request_id)
    return math.exp(total_nll / count)


def kv_capacity(config: ModelConfig, memory_budget: int, dtype: torch.dtype, block_size: int,
                sequence_lens: dict[str, list[int]], kv_cache_dtypes=KV_CACHE_DTYPES) -> dict[str, dict]:
    """Per ``kv_cache_dtype``: bytes per token (scales included), KV blocks and tokens that fit in
    ``memory_budget`` next to the model's weights (in ``dtype``) and workspace, and for each named
    list of sequence lengths in ``sequence_lens`` how many such sequences fit at once, each holding
    whole blocks for its full length (on average over the list)."""
    weights = int(weight_bytes(config, dtype.itemsize))
    rows = {}
    for kv in kv_cache_dtypes:
        per_token = kv_bytes_per_token(config, kv, dtype)
        blocks = units_that_fit(memory_budget, weights, per_token * block_size, "KV block")
        row = {"kv_bytes_per_token": per_token, "num_blocks": blocks, "tokens": blocks * block_size}
        for name, lens in sequence_lens.items():
            mean_blocks = sum(-(-n // block_size) for n in lens) / len(lens)
            row[f"sequences_{name}"] = int(blocks // mean_blocks)
        rows[kv] = row
    return rows


def format_capacity_table(rows: dict[str, dict]) -> str:
    names = [key for key in next(iter(rows.values())) if key.startswith("sequences_")]
    lines = [f"{'kv_cache_dtype':<16}{'bytes/token':>12}{'blocks':>10}{'tokens':>11}"
             + "".join(f"{name.removeprefix('sequences_'):>16}" for name in names)]
    for kv, row in rows.items():
        lines.append(f"{kv:<16}{row['kv_bytes_per_token']:>12,}{row['num_blocks']:>10,}{row['tokens']:>11,}"
                     + "".join(f"{row[name]:>16,}" for name in names))
    return "\n".join(lines)
