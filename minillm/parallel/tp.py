"""Tensor parallelism: one model split across N processes, each holding 1/N of every big matrix.

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", arXiv:1909.08053, section 3). A transformer block has
two matmul pairs, and each pair needs one all-reduce:

- **Column-parallel** (split the output features): ``qkv_proj`` and ``gate_up_proj``. Rank r keeps
  the rows of W for *its* attention heads (q rows of its query heads, k and v rows of the KV heads
  those queries read) and *its* slice of the MLP's hidden units (gate rows and up rows of the same
  slice, so SiLU(gate) * up stays local). The input is replicated, the output is sharded, nothing
  is communicated — so a column-parallel linear is just an ``nn.Linear`` with fewer rows: the model
  is built from :func:`shard_config`, whose head counts and ``intermediate_size`` are per rank.
- **Row-parallel** (split the input features): ``o_proj`` and ``down_proj``. Rank r keeps the
  columns of W that multiply its heads' (or hidden units') outputs, computes a partial product,
  and one all-reduce sums the partials into the full, replicated output. A bias is added once,
  after the sum (:class:`RowParallelLinear`).
- Attention is per head, so it needs no communication: each rank's KV cache holds only its KV
  heads. With fewer KV heads than ranks (GQA, e.g. 1 KV head and N = 2) the KV heads are
  *replicated*: each rank keeps the one KV head its query heads use.
- **Vocab-parallel** embedding and LM head: rank r holds a contiguous slice of the vocabulary.
  The embedding gives zero rows for ids outside the slice and an all-reduce fills them in; the LM
  head computes its slice of the logits and an all-gather concatenates them, so the sampler (on
  rank 0) sees full logits exactly as in one process.

So per layer: one all-reduce after attention, one after the MLP (Megatron's "f"/"g" operators).
Norms, RoPE and the residual stream are replicated: every rank computes them on identical data.

Weights are loaded shard-wise: :func:`checkpoint_slice` says which rows or columns of each Hugging
Face tensor rank r needs, and the loader reads just that slice from the safetensors file, never the
whole tensor (see ``minillm.model.loader``). The process management lives in ``workers.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds: rank ``rank`` of ``size``."""

    rank: int
    size: int

    # What the loader asks of any part of a model (``pp.Stage`` answers the same three questions).
    def model_config(self, config: ModelConfig) -> ModelConfig:
        return shard_config(config, self)

    def prepare(self, model: nn.Module) -> None:
        parallelize(model, self)

    def locate(self, name: str, config: ModelConfig) -> tuple[str, tuple[slice, ...]]:
        """Where checkpoint tensor ``name`` goes in this rank's model, and which part of it."""
        return name, checkpoint_slice(name, config, self)


# -- which layouts are possible ------------------------------------------------------------------


def layout_problem(config: ModelConfig, size: int) -> str | None:
    """Why ``size`` ranks cannot split this model evenly, or None if they can."""
    if config.num_heads % size:
        return f"its {config.num_heads} attention heads do not split into {size} equal groups"
    kv = config.num_kv_heads
    if kv % size and size % kv:  # either split the KV heads, or give each rank one (replicated)
        return f"its {kv} KV heads neither split into {size} groups nor replicate evenly over {size} ranks"
    if config.intermediate_size % size:
        return f"its intermediate_size {config.intermediate_size} does not split into {size} equal parts"
    return None


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    return [n for n in range(1, config.num_heads + 1) if layout_problem(config, n) is None]


def check_layout(config: ModelConfig, size: int) -> None:
    problem = layout_problem(config, size)
    if problem is not None:
        raise ValueError(f"tensor_parallel_size={size} does not fit this model: {problem}; "
                         f"valid sizes for it: {valid_tp_sizes(config)}")


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape one rank's model has: its heads, its KV heads, its MLP slice (vocab_size stays
    the full vocabulary: token ids and logits are always full-size outside the model)."""
    check_layout(config, shard.size)
    return replace(config, num_heads=config.num_heads // shard.size,
                   num_kv_heads=max(config.num_kv_heads // shard.size, 1),
                   intermediate_size=config.intermediate_size // shard.size)


# -- which part of each checkpoint tensor a rank holds ------------------------------------------


def vocab_range(vocab_size: int, shard: Shard) -> tuple[int, int]:
    """Rank r's token ids [start, end): equal slices, the last one shorter when N does not divide V."""
    per_rank = -(-vocab_size // shard.size)
    start = min(vocab_size, shard.rank * per_rank)
    return start, min(vocab_size, start + per_rank)


def kv_head_range(config: ModelConfig, shard: Shard) -> tuple[int, int]:
    """The KV heads rank r's query heads read. Fewer KV heads than ranks: the single one its group
    of query heads shares (query head h reads KV head h // (num_heads // num_kv_heads))."""
    kv = config.num_kv_heads
    if kv >= shard.size:
        per_rank = kv // shard.size
        return shard.rank * per_rank, (shard.rank + 1) * per_rank
    head = shard.rank * kv // shard.size
    return head, head + 1


def checkpoint_slice(name: str, config: ModelConfig, shard: Shard) -> tuple[slice, ...]:
    """The index into Hugging Face tensor ``name`` (of the full model ``config``) of rank r's part."""
    prefix, _, kind = name.rpartition(".")  # kind: "weight" | "bias"
    module = prefix.rpartition(".")[2]
    d, r, n = config.head_dim, shard.rank, shard.size
    everything = slice(None)
    if module == "q_proj":
        heads = config.num_heads // n
        return (slice(r * heads * d, (r + 1) * heads * d),)
    if module in ("k_proj", "v_proj"):
        first, last = kv_head_range(config, shard)
        return (slice(first * d, last * d),)
    if module in ("gate_proj", "up_proj", "down_proj"):
        part = config.intermediate_size // n
        units = slice(r * part, (r + 1) * part)
        if module != "down_proj":
            return (units,)
        return (everything, units) if kind == "weight" else (everything,)
    if module == "o_proj":
        heads = config.num_heads // n
        columns = slice(r * heads * d, (r + 1) * heads * d)
        return (everything, columns) if kind == "weight" else (everything,)  # a bias is added once, whole
    if module in ("embed_tokens", "lm_head"):
        return (slice(*vocab_range(config.vocab_size, shard)),)
    return (everything,)  # norms: replicated


# -- the layers that communicate -----------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, (+ bias once): x arrives sharded by features (each rank's
    heads or MLP slice), W_r is this rank's columns of W, and an all-reduce sums the partials."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; other ids look up zeros, and the all-reduce adds the
    one rank's row that is not zero."""

    def __init__(self, start: int, end: int, hidden_size: int):
        super().__init__()
        self.start, self.end = start, end
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        dist.all_reduce(x)
        return x


class VocabParallelLMHead(nn.Module):
    """Logits of vocabulary slice [start, end), all-gathered into full logits on every rank.
    all_gather wants equal sizes, so a short last slice is padded and the padding cut off."""

    def __init__(self, start: int, end: int, vocab_size: int, size: int, hidden_size: int):
        super().__init__()
        self.vocab_size, self.per_rank, self.size = vocab_size, -(-vocab_size // size), size
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        local = F.pad(local, (0, self.per_rank - local.shape[-1])).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def parallelize(model: nn.Module, shard: Shard) -> None:
    """Swap the communicating layers into a model built from ``shard_config`` (on the meta device,
    before its storage exists). qkv_proj and gate_up_proj stay plain nn.Linear: column-parallel."""
    config = model.config
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            dense = getattr(parent, name)
            setattr(parent, name, RowParallelLinear(dense.in_features, dense.out_features, dense.bias is not None))
    start, end = vocab_range(config.vocab_size, shard)
    model.model.embed_tokens = VocabParallelEmbedding(start, end, config.hidden_size)
    model.lm_head = VocabParallelLMHead(start, end, config.vocab_size, shard.size, config.hidden_size)
