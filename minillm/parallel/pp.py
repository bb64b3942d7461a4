"""Pipeline parallelism: the decoder layers split into contiguous stages, one process (GPU) each.

Stage s holds layers [start, end) and the KV cache of those layers only; stage 0 also holds the
embedding, the last stage the final norm and the LM head. A step's tokens enter stage 0, and each
stage hands its output hidden states (the residual stream, [1, tokens, hidden]) to the next with a
point-to-point send; the last stage sends the sampled rows' logits back to rank 0, which samples.

One batch through S stages would keep S - 1 of them idle at any moment, so the step's sequences are
split into M **micro-batches** (whole sequences, so each is a complete attention batch with its
own block tables), and they flow through GPipe-style (Huang et al. 2019, "GPipe: Efficient
Training of Giant Neural Networks using Pipeline Parallelism", arXiv:1811.06965): while stage 1
works on micro-batch 0, stage 0 already computes micro-batch 1. With equal work per micro-batch
and free communication the step takes M + S - 1 slots of one micro-batch's stage time, of which
each stage is busy M, so the idle share — the **bubble** — is (S - 1) / (M + S - 1). (Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
arXiv:2104.04473, section 2.2, state it as bubble time over ideal time, (S - 1) / M.) In
inference the next step needs this step's sampled tokens, so the pipeline drains every step and
the bubble is paid every step. Every rank records, per step, when each of its micro-batches
computed; ``PipelineRunner.bubble_report`` gathers them and sets the measured bubble beside the
formula.

Rank 0 schedules and splits the step as in tensor parallelism (``workers.py``): the step's metadata
and the micro-batch split travel to every rank first, so each knows the shapes it will receive.

Quantized weights need nothing new: a stage holds whole layers, so it quantizes its own linears on
load exactly as one process would (RTN, FP8), or reads its layers' tensors of a quantized
checkpoint. GPTQ and AWQ on load are refused (``EngineConfig``): their calibration runs the
calibration tokens through every layer in order, from the embedding, which no stage holds alone.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn

from minillm.kv.paged import PagedStep, to_device
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.quant.spec import QuantSpec
from minillm.runner import PagedRunner

EVERYTHING = (slice(None),)


def layer_ranges(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, as equal as possible. The first ``num_layers % size``
    stages take one layer more: the last stage also runs the LM head, so it should not."""
    check_stages(num_layers, size)
    base, extra = divmod(num_layers, size)
    ends = list(accumulate(base + (s < extra) for s in range(size)))
    return list(zip([0] + ends[:-1], ends))


def check_stages(num_layers: int, size: int) -> None:
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} needs a decoder layer per stage, but the model has "
                         f"{num_layers}; valid sizes for it: 1 to {num_layers}")


class ResidualSum(nn.Module):
    """A stage's stand-in for the final norm when a later stage holds it. A decoder layer leaves its
    residual add to the next norm (``DecoderLayer.forward``); here the next norm is on the next
    stage, so the add happens at the boundary and one tensor, the residual stream, crosses it. The
    next stage's first layer starts from it as layer 0 starts from the embedding: the same rounded
    sum its fused norm would have computed, so the outputs are those of one process."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (in x's dtype: with the norms folded, the residual is the fp32 stream, norm_folding.py)
        hidden = (x + residual).to(x.dtype)
        return hidden, hidden  # what RMSNorm(x, residual) returns, (normed, sum), without the norm


@dataclass(frozen=True)
class Stage:
    """Which part of the model this process holds: layers [start, end) as stage ``rank`` of ``size``."""

    rank: int
    size: int
    start: int
    end: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> "Stage":
        return cls(rank, size, *layer_ranges(config.num_layers, size)[rank])

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    # What the loader asks of any part of a model (``tp.Shard`` answers the same three questions).
    def model_config(self, config: ModelConfig) -> ModelConfig:
        """This stage's layers, numbered from 0 (so its KV cache has just them). Never tied: the
        embedding and the LM head live on different stages; the last one loads the embedding's
        weights into its own LM head."""
        return replace(config, num_layers=self.end - self.start, tie_word_embeddings=False)

    def prepare(self, model: nn.Module) -> None:
        """Drop what other stages hold, before storage exists. A later stage's input is already a
        hidden state, so its embedding becomes a pass-through; an earlier stage has no final norm
        (``ResidualSum`` stands in for it) and no LM head."""
        if not self.is_first:
            model.model.embed_tokens = nn.Identity()
        if not self.is_last:
            model.model.norm = ResidualSum()
            model.lm_head = None

    def locate(self, name: str, config: ModelConfig) -> tuple[str, tuple[slice, ...]] | None:
        """Checkpoint tensor ``name`` in this stage's model (whole), or None: another stage holds it."""
        parts = name.split(".")
        if name.startswith("model.layers."):
            layer = int(parts[2])
            if not self.start <= layer < self.end:
                return None
            return ".".join(["model", "layers", str(layer - self.start), *parts[3:]]), EVERYTHING
        if name.startswith("model.embed_tokens."):
            if self.is_first:
                return name, EVERYTHING
            return ("lm_head.weight", EVERYTHING) if self.is_last and config.tie_word_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            return (name, EVERYTHING) if self.is_last else None
        return name, EVERYTHING  # a name no stage knows: the model says so when asked for it

    def quantize_linear(self, linear: nn.Module, spec: QuantSpec) -> nn.Module:
        """A stage holds whole layers: each linear is quantized as in one process (RTN, FP8)."""
        from minillm.quant.quantize import quantize_linear

        return quantize_linear(linear, spec)


def stage_footprints(config: ModelConfig, size: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(weight bytes, KV bytes per token) of every stage, counted on the meta device. Every rank
    must have the same number of KV blocks (rank 0 hands out the block ids), so a memory budget
    gives each rank as many as the fullest stage can hold."""
    footprints = []
    for rank in range(size):
        stage = Stage.of(config, rank, size)
        with torch.device("meta"):
            model = LlamaForCausalLM(stage.model_config(config))
            stage.prepare(model)
        weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        footprints.append((weights, model.config.kv_bytes_per_token(dtype.itemsize)))
    return footprints


def split_micro_batches(query_lens: list[int], num_micro_batches: int) -> list[tuple[int, int]]:
    """Contiguous [first, end) groups of sequences with token counts as equal as possible: at most
    ``num_micro_batches`` of them and never an empty one. Contiguous keeps each group's decodes
    first, as ``PagedStep`` wants them."""
    count = min(num_micro_batches, len(query_lens))
    prefix = list(accumulate(query_lens))
    cuts = [0]
    for k in range(1, count):
        target = prefix[-1] * k / count
        after = bisect_left(prefix, target)  # the first sequence at whose end the target is reached
        cut = after if after > 0 and target - prefix[after - 1] < prefix[after] - target else after + 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(query_lens) - (count - k)))
    return list(zip(cuts, cuts[1:] + [len(query_lens)]))


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle share of a pipelined step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


class StageClock:
    """Timestamps of one rank's work: CUDA events on a GPU (the host only queues the kernels, so its
    clock says nothing about when they ran), ``time.perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class StepTiming:
    """One step on one rank."""

    micro_batches: int
    started: float  # time.perf_counter() when this rank began the step: the host clock all ranks share
    span: float  # seconds from the step's start on this rank (metadata received) to its last transfer
    compute: list[tuple[float, float]]  # each micro-batch's compute: (start, end), seconds after the step's start

    @property
    def busy(self) -> float:
        return sum(end - start for start, end in self.compute)


class PipelineRunner(PagedRunner):
    """``PagedRunner`` whose forward runs this rank's stage over the step's micro-batches.

    Every rank runs the same ``forward`` (rank 0 with the split it chose, the others with the split
    it broadcast). Sends are asynchronous, so a stage goes on to its next micro-batch while the
    next stage receives the last one; receives block, which is what orders the pipeline.
    """

    def __init__(self, model: LlamaForCausalLM, cache, block_tables, device: torch.device, seed: int,
                 make_attention, workers, micro_batches: int):
        super().__init__(model, cache, block_tables, device, seed, make_attention)
        self.stage, self.workers, self.micro_batches = workers.part, workers, micro_batches
        self.hidden_size, self.vocab_size = model.config.hidden_size, model.config.vocab_size
        self.dtype = cache.k.dtype
        # The logits return to rank 0 through a group of their own. On NCCL, a pair of ranks' sends
        # and receives in one group queue on one stream, each waiting for its match: with two stages,
        # stage 1's send of the first logits would sit ahead of its receive of the next hidden state,
        # and rank 0's receive of those logits behind its send of that hidden state — each would wait
        # for the other.
        self.logits_group = dist.new_group()
        self.clock = StageClock(device)
        self.timings: deque[StepTiming] = deque(maxlen=100_000)

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                query_lens: list[int], context_lens: list[int], last_index: list[int],
                groups: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
        """Run this stage over the micro-batches; on rank 0, return the ``last_index`` rows' logits."""
        if groups is None:  # rank 0 splits; the other ranks receive its split with the step
            groups = split_micro_batches(query_lens, self.micro_batches)
        if self.on_forward is not None:
            self.on_forward((ids, positions, slots, tables, query_lens, context_lens, last_index, groups))
        stage, clock = self.stage, self.clock
        started, start = time.perf_counter(), clock.mark()
        marks, in_flight, sampled = [], [], []  # in_flight: (work, tensor), the tensor kept alive until sent
        token_start = 0
        for first, end in groups:
            token_end = token_start + sum(query_lens[first:end])
            rows = [i - token_start for i in last_index if token_start <= i < token_end]
            sampled.append(len(rows))
            if stage.is_first:
                x = to_device([ids[token_start:token_end]], torch.long, self.device)
            else:
                x = torch.empty(1, token_end - token_start, self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, stage.rank - 1)
            begin = clock.mark()
            step = PagedStep.from_host(slots[token_start:token_end], tables[first:end], query_lens[first:end],
                                       context_lens[first:end], self.device)
            out = self.model(x, to_device([positions[token_start:token_end]], torch.long, self.device),
                             self.make_attention(self.cache, step))
            if stage.is_last:
                out = self.model.compute_logits(out[0, rows]) if rows else None
            marks.append((begin, clock.mark()))
            if out is not None:
                to = 0 if stage.is_last else stage.rank + 1
                group = self.logits_group if stage.is_last else None
                in_flight.append((dist.isend(out.contiguous(), to, group=group), out))
            token_start = token_end
        logits = []
        if stage.is_first:
            for count in filter(None, sampled):
                logits.append(torch.empty(count, self.vocab_size, dtype=torch.float32, device=self.device))
                dist.recv(logits[-1], stage.size - 1, group=self.logits_group)
        for work, _ in in_flight:
            work.wait()
        stop = clock.mark()
        self.timings.append(StepTiming(len(groups), started, clock.seconds(start, stop),
                                       [(clock.seconds(start, b), clock.seconds(start, e)) for b, e in marks]))
        return torch.cat(logits) if logits else None

    def bubble_report(self, reset: bool = True) -> dict:
        """Rank 0: every stage's step timings gathered, summarised by ``bubble_summary``."""
        return bubble_summary(self.workers.run_everywhere(self, gather_timings, reset))


def gather_timings(runner: PipelineRunner, reset: bool) -> list[list[StepTiming]] | None:
    """Every rank: send this rank's step timings to rank 0, which returns them all, by stage."""
    mine = list(runner.timings)
    if reset:
        runner.timings.clear()
    everyone = [None] * runner.stage.size if runner.stage.is_first else None
    dist.gather_object(mine, everyone, dst=0, group=runner.workers.meta_group)
    return everyone


def bubble_summary(stage_timings: list[list[StepTiming]]) -> dict:
    """The measured bubble beside the formula, for each micro-batch count the steps had.

    A step lasts from the first rank's start to the last rank's end (the ranks start when the step's
    metadata reaches them, a little apart; ``time.perf_counter`` is one clock for all processes of a
    machine, and on GPUs each rank's device is idle when its step begins, so its host start is its
    device's too). The measured bubble is the share of stages x that time in which they did not compute.
    The last step's compute intervals on every stage come along, on rank 0's clock, to draw its
    timeline.
    """
    stages = len(stage_timings)
    groups: dict[int, dict] = {}
    for step in zip(*stage_timings):
        group = groups.setdefault(step[0].micro_batches, {"steps": 0, "seconds": 0.0, "busy": [0.0] * stages})
        group["steps"] += 1
        group["seconds"] += max(t.started + t.span for t in step) - min(t.started for t in step)
        for s, timing in enumerate(step):
            group["busy"][s] += timing.busy
    last_step: list[list[tuple[float, float]]] = [[] for _ in stage_timings]
    if stage_timings[0]:  # every rank ran every step
        last = [timings[-1] for timings in stage_timings]
        zero = last[0].started
        last_step = [[(begin + t.started - zero, end + t.started - zero) for begin, end in t.compute] for t in last]
    return {
        "stages": stages,
        "by_micro_batches": {
            str(m): {"steps": g["steps"], "seconds": g["seconds"],
                     "stage_busy": [busy / g["seconds"] for busy in g["busy"]],
                     "measured_bubble": 1 - sum(g["busy"]) / (stages * g["seconds"]),
                     "formula_bubble": bubble_fraction(stages, m)}
            for m, g in sorted(groups.items())},
        "last_step": last_step,
    }
