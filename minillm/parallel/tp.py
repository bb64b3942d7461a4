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

**Quantized weights** (``minillm.quant``) split the same way, on one condition: a group of weights
that shares a scale and a zero point stays whole on one rank. Column-parallel layers keep whole input
rows, so every group does. Row-parallel layers split the input channels, so each rank's share of
``o_proj`` and ``down_proj`` must be whole groups (``group_size`` divides it), and INT4 packs 8 codes
(zero points: 8 output channels) to an int32, so every rank's part of every projection is a multiple
of 8 wide (:func:`quantized_layout_problem`). Where the quantization happens:

- **RTN (INT4, INT8) on load**: each rank quantizes its own dense shard. RTN looks at one group at a
  time, so whole groups give exactly the codes, scales and zero points of quantizing the full weight
  and then splitting it — without any rank ever holding the full weight. One case needs a
  collective: with one group per output channel (INT8; INT4 ``-channel``) a row-parallel layer's
  groups span every rank, so their range is all-reduced (min and max) before rounding.
- **GPTQ and AWQ**: they calibrate on whole layers, propagating each channel's rounding error into
  the channels not yet quantized across all K inputs (and AWQ folds scales across layers), so a rank
  alone cannot reproduce them. Quantize once in one process, save the checkpoint
  (``minillm.quant.checkpoint.save_quantized``), and load it with tensor parallelism: each rank reads
  its columns of ``qweight``, ``scales`` and ``qzeros`` (or its rows: whole groups), never the rest.
  Act-order checkpoints scatter each group over the input channels, so they cannot split by rows;
  they are refused (quantize with ``-noact``).
- **FP8** scales each token's activations by the largest over *all* input channels, which the
  row-parallel layers split; matching one process would need an all-reduce per layer: refused
  (``EngineConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig
from minillm.model.dense import product
from minillm.parallel.all_reduce import all_reduce
from minillm.quant import rtn
from minillm.quant.linear import QuantLinear
from minillm.quant.spec import QuantSpec


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

    def quantize_linear(self, linear: nn.Module, spec: QuantSpec) -> nn.Module:
        """RTN of this rank's part of one linear (``EngineConfig`` lets no other method through with
        tensor parallelism): the rank's part of what one process makes of the whole linear."""
        from minillm.quant.quantize import quantize_linear

        if not isinstance(linear, RowParallelLinear):
            return quantize_linear(linear, spec)  # column-parallel: whole input rows, the very same groups
        codes, scales, zeros = row_parallel_rtn(linear.weight, spec)
        return RowParallelQuantLinear.from_codes(codes, scales, zeros, spec.bits, spec.group_size, linear.bias,
                                                 dtype=linear.weight.dtype)


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


def quantized_layout_problem(config: ModelConfig, size: int, spec: QuantSpec) -> str | None:
    """Why ``size`` ranks cannot split this model's ``spec``-quantized linears, or None if they can
    (for a size whose dense layout fits: ``layout_problem``)."""
    if spec.lm_head:
        return "its LM head is quantized (-head), and tensor parallelism splits the head by vocabulary"
    if spec.act_order and spec.group_size != -1:
        return ("its act-order (desc_act) groups scatter over the input channels, which o_proj and down_proj "
                "split over ranks (quantize without act-order: gptq-int4-noact)")
    d, per_word = config.head_dim, 32 // spec.bits  # the GPTQ v1 layout packs 32 / bits codes into an int32
    columns = {"q_proj": config.num_heads // size * d, "k_proj": max(config.num_kv_heads // size, 1) * d,
               "gate_proj": config.intermediate_size // size}
    rows = {"o_proj": config.num_heads // size * d, "down_proj": config.intermediate_size // size}
    for name, width in [*columns.items(), *rows.items()]:
        if width % per_word:
            side = "output" if name in columns else "input"
            return (f"each rank's {width} {side} channels of {name} are not a multiple of {per_word} "
                    f"(INT{spec.bits} packs {per_word} codes into an int32)")
    if spec.group_size == -1:
        return None
    for name, width in rows.items():
        if width % spec.group_size:
            common = gcd(*rows.values())  # a multiple of 8 (checked above): so is some divisor <= group_size
            fits = max(g for g in range(8, spec.group_size + 1, 8) if common % g == 0)
            return (f"each rank's {width} input channels of {name} are not whole groups of {spec.group_size} "
                    f"({replace(spec, group_size=fits).name} or {replace(spec, group_size=-1).name} would split)")
    return None


def tp_problem(config: ModelConfig, size: int, spec: QuantSpec | None = None) -> str | None:
    """Why ``size`` ranks cannot split this model, with ``spec``-quantized weights if given, or None."""
    problem = layout_problem(config, size)
    if problem is None and spec is not None and size > 1:
        problem = quantized_layout_problem(config, size, spec)
    return problem


def valid_tp_sizes(config: ModelConfig, spec: QuantSpec | None = None) -> list[int]:
    return [n for n in range(1, config.num_heads + 1) if tp_problem(config, n, spec) is None]


def check_layout(config: ModelConfig, size: int, spec: QuantSpec | None = None) -> None:
    """ValueError naming why ``size`` ranks cannot split this model (with ``spec``-quantized weights,
    if given), and the sizes that can."""
    problem = tp_problem(config, size, spec)
    if problem is not None:
        weights = "" if spec is None else f" with {spec.name} weights"
        raise ValueError(f"tensor_parallel_size={size} does not fit this model{weights}: {problem}; "
                         f"valid sizes for it: {valid_tp_sizes(config, spec)}")


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


def _reduced(linear: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear's partial product ``y`` summed over the ranks, plus its bias (once) — or
    ``y`` as it is, when the norm after the linear sums it (``all_reduce.fuse_into_norms``)."""
    if linear.reduced_by_next_norm is not None and linear.reduced_by_next_norm.fits(y):
        return y  # the norm decides by the same fits(y): it will sum it
    all_reduce(y)
    return y if linear.bias is None else y + linear.bias


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, (+ bias once): x arrives sharded by features (each rank's
    heads or MLP slice), W_r is this rank's columns of W, and an all-reduce sums the partials."""

    reduced_by_next_norm = None  # see _reduced
    gemv = None  # see dense.product

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        return _reduced(self, product(x, self.weight, self.gemv, gated))  # gated: see dense.takes_gated


class RowParallelQuantLinear(QuantLinear):
    """``RowParallelLinear`` with quantized weights: this rank's input channels, in whole groups (one
    group per output channel: the whole row's scale, the same on every rank)."""

    reduced_by_next_norm = None  # see _reduced

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        return _reduced(self, self.gated_matmul(x) if gated else self.matmul(x))  # gated: see dense.takes_gated

    def folds_norms(self) -> bool:
        """Never: the residual is added to the sum over the ranks, after the all-reduce (model/norm_folding.py)."""
        return False


def row_parallel_rtn(weight: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, ...]:
    """RTN of this rank's input channels of a row-parallel weight [out, in / N]: codes, scales and zero
    points as ``rtn.quantize_groupwise`` returns them, equal to this rank's part of the whole weight's.
    Whole groups are rounded alone. One group per output channel spans every rank: its range is the
    min and max over the ranks' parts (all-reduced), which is all that ``minmax_params`` reads."""
    if spec.group_size != -1:
        return rtn.quantize_groupwise(weight, spec.bits, spec.group_size, spec.sym)
    w = weight.float()
    low, high = w.amin(dim=1), w.amax(dim=1)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    scale, zero = rtn.minmax_params(torch.stack((low, high), dim=1), spec.bits, spec.sym)
    codes = rtn.quantize(w, scale[:, None], zero[:, None], spec.bits).to(torch.uint8)
    return codes, scale[:, None], zero[:, None].to(torch.int32)


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
        all_reduce(x)
        return x


class VocabParallelLMHead(nn.Module):
    """Logits of vocabulary slice [start, end), all-gathered into full logits on every rank.
    all_gather wants equal sizes, so a short last slice is padded and the padding cut off."""

    gemv = None  # see dense.product

    def __init__(self, start: int, end: int, vocab_size: int, size: int, hidden_size: int):
        super().__init__()
        self.vocab_size, self.per_rank, self.size = vocab_size, -(-vocab_size // size), size
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = product(hidden, self.weight, self.gemv)
        local = F.pad(local, (0, self.per_rank - local.shape[-1])).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def parallelize(model: nn.Module, shard: Shard) -> None:
    """Swap the communicating layers into a model built from ``shard_config`` (on the meta device,
    before its storage exists). qkv_proj and gate_up_proj stay as they are (``nn.Linear`` or, for a
    quantized checkpoint, ``QuantLinear``): column-parallel."""
    config = model.config
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            local = getattr(parent, name)
            if isinstance(local, QuantLinear):
                row_parallel = RowParallelQuantLinear(local.in_features, local.out_features, local.bits,
                                                      local.group_size, local.bias is not None, local.perm is not None)
            else:
                row_parallel = RowParallelLinear(local.in_features, local.out_features, local.bias is not None)
            setattr(parent, name, row_parallel)
    start, end = vocab_range(config.vocab_size, shard)
    model.model.embed_tokens = VocabParallelEmbedding(start, end, config.hidden_size)
    model.lm_head = VocabParallelLMHead(start, end, config.vocab_size, shard.size, config.hidden_size)
