"""Perplexity on CPython's reference manual: how much a lossy step (quantization) costs the model.

Greedy outputs stop being comparable to the oracle once the weights change, so lossy steps report
perplexity instead: exp of the mean negative log-likelihood (natural log) of held-out text. The same
fixed protocol every time makes the numbers comparable between methods and runs.

**The corpus** is ``minillm/corpus.py``'s evaluation part (GPTQ and AWQ calibrate on its other part).

**The protocol** (Hugging Face's "perplexity of fixed-length models" recipe):

- the text: the first ``num_tokens`` tokens of the evaluation part (default 16384);
- windows of ``seq_len`` tokens (default 512) starting every ``stride`` tokens (default
  ``stride = seq_len``: disjoint windows), as many as fit in ``num_tokens``;
- each token is scored once: window [b, b + seq_len) scores the tokens from max(b + 1, end of the
  previous window) to its end (a window's first token has no context), each given everything
  before it in the window; with ``stride = seq_len`` that is seq_len - 1 tokens per window;
- perplexity = exp(mean NLL over all scored tokens).

**Scoring.** By default each window is one forward pass with causal attention and no cache, and all
its positions' logits. With ``chunk_size=k`` the window is prefilled k tokens at a time through the
engine's own paged KV cache (``batching="continuous"``), so later chunks attend to K/V read back
from the cache: the path whose numerics a quantized KV cache changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from minillm.attention import CausalAttention
from minillm.corpus import (CORPUS, NUM_TOKENS, SEQ_LEN, calibration_samples, corpus_parts, corpus_text,  # noqa: F401
                            corpus_tokens, evaluation_tokens)

def windows(num_tokens: int, seq_len: int = SEQ_LEN, stride: int | None = None) -> list[tuple[int, int, int]]:
    """The protocol's windows over ``num_tokens`` tokens: (start, end, first scored token), each token
    scored once. A text shorter than ``seq_len`` is one window over all of it."""
    stride = seq_len if stride is None else stride
    if seq_len < 2 or not 1 <= stride <= seq_len:
        raise ValueError(f"need seq_len >= 2 and 1 <= stride <= seq_len, got seq_len={seq_len}, stride={stride}")
    seq_len = min(seq_len, num_tokens)
    spans, scored_to = [], 0
    for start in range(0, num_tokens - seq_len + 1, stride):
        end = start + seq_len
        spans.append((start, end, max(start + 1, scored_to)))
        scored_to = end
    return spans


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_scored_tokens: int
    window_nll: list[float] = field(repr=False)  # mean NLL of each window: their spread says how noisy a gap is

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "nll": self.nll, "num_scored_tokens": self.num_scored_tokens,
                "num_windows": len(self.window_nll), "window_nll": self.window_nll}


@torch.inference_mode()
def _logits_whole(model: nn.Module, ids: torch.Tensor, rows: slice) -> torch.Tensor:
    """One forward over the whole window, no cache; logits of positions ``rows``."""
    positions = torch.arange(len(ids), device=ids.device)
    hidden = model(ids[None], positions[None], CausalAttention())
    return model.compute_logits(hidden[0, rows])


def _logits_chunked(engine, ids: torch.Tensor, rows: slice, chunk_size: int) -> torch.Tensor:
    """Prefill the window ``chunk_size`` tokens at a time through the engine's paged KV cache (its
    runner, cache and attention backend, as a request's chunked prefill would); logits of ``rows``."""
    tables = engine.block_tables
    if tables.blocks_for(len(ids)) > tables.allocator.num_free:
        raise ValueError(f"a {len(ids)}-token window needs {tables.blocks_for(len(ids))} KV blocks, but only "
                         f"{tables.allocator.num_free} are free; give the engine more (num_kv_blocks)")
    request_id, tokens = "perplexity-window", ids.tolist()
    tables.grow(request_id, len(tokens))
    wanted, logits = range(len(tokens))[rows], []
    try:
        for start in range(0, len(tokens), chunk_size):
            end = min(start + chunk_size, len(tokens))
            last_index = [i - start for i in wanted if start <= i < end]
            out = engine.runner.forward(tokens[start:end], list(range(start, end)), tables.slots(request_id, start, end),
                                        [tables.tables[request_id]], [end - start], [end], last_index)
            if out is not None:
                logits.append(out)
    finally:
        tables.free(request_id)
    return torch.cat(logits)


def perplexity(target, token_ids: list[int], *, seq_len: int = SEQ_LEN, stride: int | None = None,
               chunk_size: int | None = None, progress: bool = False) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``target``: an ``LLM`` (its engine's model, and its paged cache
    with ``chunk_size``) or a bare model (whole windows only), by the protocol in the module docstring."""
    engine = getattr(target, "engine", None)
    model = target if engine is None else engine.model
    if chunk_size is not None:
        if engine is None or not hasattr(engine, "block_tables"):
            raise ValueError("chunk_size scores through the paged KV cache: give an LLM with batching='continuous'")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
        if min(seq_len, len(token_ids)) > engine.max_model_len:
            raise ValueError(f"seq_len={seq_len} exceeds the engine's max_model_len={engine.max_model_len}")
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=device)
    total, count, window_nll = 0.0, 0, []
    for start, end, first in tqdm(windows(len(ids), seq_len, stride), desc="perplexity", unit="window",
                                  disable=not progress):
        window = ids[start:end]
        rows = slice(first - start - 1, end - start - 1)  # logits at position j predict token j + 1
        logits = _logits_whole(model, window, rows) if chunk_size is None else \
            _logits_chunked(engine, window, rows, chunk_size)
        nll = F.cross_entropy(logits.float(), ids[first:end], reduction="sum").item()
        total, count = total + nll, count + end - first
        window_nll.append(nll / (end - first))
    return PerplexityResult(math.exp(total / count), total / count, count, window_nll)


def evaluate_perplexity(*, model: str | None, quantizations: list[str] = ("none",), num_tokens: int = NUM_TOKENS,
                        seq_len: int = SEQ_LEN, stride: int | None = None, chunk_size: int | None = None,
                        command: str = "", **engine_kwargs) -> dict:
    """``minillm eval ppl``: the model's perplexity by the protocol, once per quantization method
    ("none" = as loaded), as a result document: the bench commands' header, the protocol, ``runs``."""
    import platform
    import time

    from minillm.bench.harness import result_header
    from minillm.llm import LLM

    runs, source, dtype = {}, None, None
    for method in quantizations:
        start = time.perf_counter()
        llm = LLM(model, quantization=None if method == "none" else method, **engine_kwargs)
        loaded = time.perf_counter()
        tokens = evaluation_tokens(llm.tokenizer, num_tokens)
        result = perplexity(llm, tokens, seq_len=seq_len, stride=stride, chunk_size=chunk_size, progress=True)
        name = llm.engine.quantization or "none"
        runs[name] = result.as_dict() | {"load_seconds": loaded - start, "eval_seconds": time.perf_counter() - loaded,
                                         "weight_bytes": llm.engine.weight_bytes}
        source, dtype = llm.engine.model_source, str(llm.engine.dtype).removeprefix("torch.")
        del llm  # one model in memory at a time
    return {
        **result_header("perplexity", f"{CORPUS} evaluation part", source, command),
        "dtype": dtype,
        "protocol": {"corpus": CORPUS, "python": platform.python_version(), "num_tokens": num_tokens,
                     "seq_len": seq_len, "stride": stride or seq_len, "chunk_size": chunk_size,
                     "calibration_samples": engine_kwargs.get("calibration_samples"),
                     "topics": {part: len(names) for part, names in corpus_parts().items()}},
        "runs": runs,
    }


def format_perplexity_table(result: dict) -> str:
    p = result["protocol"]
    lines = [f"perplexity on {p['corpus']} (evaluation part, {p['num_tokens']} tokens, seq_len {p['seq_len']}, "
             f"stride {p['stride']}) on {result['device']}, {result['model']} {result['dtype']}",
             f"{'run':<22}{'perplexity':>12}{'vs none':>10}{'weights MiB':>13}"]
    base = result["runs"].get("none")
    for name, run in result["runs"].items():
        change = f"{run['perplexity'] / base['perplexity'] - 1:+.2%}" if base else "-"
        lines.append(f"{name:<22}{run['perplexity']:>12.3f}{change:>10}{run['weight_bytes'] / 2**20:>13.1f}")
    return "\n".join(lines)
