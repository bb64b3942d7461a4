"""Multi-step decoding: up to ``num_scheduler_steps`` decode passes per scheduler step, with one host
sync at the end instead of one per token.

Why: a decode step's next input is the token it samples, and with one pass per step that token
reaches the host (``.tolist()``) before the host can schedule, build and launch the next pass. The
host's share of a step (sampling's sync, detokenizing and stop checks, ``scheduler.schedule``, the
runner's lists, filling the CUDA graph's buffers) then runs in series with the GPU: 0.38 ms of the
4.62 ms of a batch-1 llama2-7b token on an H200, 1.3 ms with tensor parallelism
(``figures/h200/tp_decode_profile.json``). Here the token sampled by pass i stays on the device and
is pass i+1's input id, so the host enqueues pass i+1 while the GPU still runs pass i; all k x B
tokens are fetched once, then postprocessed in order as if each pass had been a step of its own.
This is vLLM's multi-step scheduling (``--num-scheduler-steps``, vLLM v0.6.0, "vLLM v0.6.0: 2.7x
Throughput Improvement and 5x Latency Reduction", vLLM blog, September 2024).

Async scheduling (``EngineConfig.async_scheduling``, on by default for continuous batching in one
process; vLLM's ``--async-scheduling``) takes the same idea across scheduler steps: once a pure decode
batch is launched, ``MultiStepScheduler.chain`` gives the batch that continues it (the same requests, its last
tokens as their inputs on the device, up to k passes again) before the host reads the first one's
tokens, so the host's postprocessing and the next launch overlap the GPU's passes even at k = 1. The
chain ends where the scheduler must decide: a request arrives or waits, one ended (a stop found when
its batch was read, or an abort: the chained batch's tokens for it are dropped like a multi-step
batch's after a stop), one has no budget left past the tokens in flight, or the blocks for the next
passes would take preemption. Its trade-offs are those of k passes below, with k counted across the
chain: a request's passes after its stop are computed and dropped (one more batch's at most), and an
arrival waits for the batch in flight.

Only a *pure decode* batch runs several passes: every sequence brings one token that completes its
context, and none asks for penalties or logprobs (they need the host after every token: such a
request runs one pass per step). The scheduler (``MultiStepScheduler.lookahead``) picks
k_eff = min(k, every request's remaining output budget), so no request is computed past
``max_tokens`` or ``max_model_len``, and allocates the KV blocks of all k_eff tokens up front
(counted like any others: the cache's usage and preemption see them); it lowers k_eff until they fit
in the free blocks rather than preempting anyone for them.

The trade-offs, known from vLLM's:
- a request that arrives during the passes is admitted at the next scheduler step, up to k - 1
  passes later than with k = 1 (its time to first token grows);
- a request that stops at pass j (EOS, a stop token or string) still computes passes j+1..k-1;
  their tokens are discarded, never reported, and the K/V they wrote lie past the request's
  computed tokens, in blocks freed with it;
- the k tokens of one scheduler step reach the host together: streaming and inter-token latency
  come in bursts of k;
- sampling: greedy rows are the argmax, so they equal k = 1's tokens. Each pass samples the same
  rows in the same order as k = 1 would, so a request with its own ``seed`` draws the same tokens
  too. Unseeded sampled requests share the engine's generator: a batch mate that stopped at pass j
  keeps drawing from it in passes j+1..k-1, where k = 1 would already have dropped it, so their
  tokens depend on k (reproducible for a fixed seed and k). Matching k = 1 would mean detecting
  stops on the device, which stop strings rule out. On CUDA a batch with sampled rows still waits
  for the GPU once per pass: ``torch.multinomial`` checks its probabilities with a host read.
  Greedy batches (the latency benchmarks) never do.

With CUDA graphs, pass i+1's static ``input_ids`` buffer is filled by a device-to-device copy of
pass i's sampled tokens (``DecodeGraphs.run``): sampling stays outside the graph, so seeded
requests keep their own generators and the graphs stay the ones k = 1 replays. With tensor
parallelism rank 0 sends the ``DecodePlan`` once; every rank runs the same passes, and rank 0
broadcasts each pass's sampled tokens on the device (``dist.broadcast``, asynchronous on NCCL), so
the ranks feed identical ids even when sampling is random. Pipeline parallelism is refused
(``EngineConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from minillm.kv.paged import BlockTables, to_device
from minillm.request import Request, output_budget
from minillm.runner import PagedRunner
from minillm.scheduler import ContinuousScheduler, ScheduledBatch, is_pure_decode


class MultiStepScheduler(ContinuousScheduler):
    """The continuous scheduler, whose pure decode batches run up to ``num_scheduler_steps`` passes
    (``lookahead``), and which chains a batch to the one in flight where it need not decide (``chain``)."""

    def __init__(self, *args, num_scheduler_steps: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_scheduler_steps = num_scheduler_steps

    def lookahead(self, scheduled: list[tuple[Request, int]]) -> int:
        """How many decode passes this step's batch runs (1: an ordinary step); grows the requests' block
        tables to hold every pass's K/V."""
        if self.num_scheduler_steps == 1 or not scheduled or not all(
                is_pure_decode(r, n) for r, n in scheduled):
            return 1  # (a prefill chunk's next input is a prompt token, known on the host)
        return max(1, _grow_for_passes(self, [r for r, _ in scheduled], self.num_scheduler_steps, 0))

    def chain(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Async scheduling (``EngineConfig.async_scheduling``): the batch that continues ``batch``, a pure
        decode batch still on the device whose tokens the host has not read, or None where the scheduler
        must decide. The same requests, one token each, up to ``num_scheduler_steps`` passes fed
        ``batch``'s last tokens on the device; their blocks grown here. None if a request arrived or waits
        (the scheduler admits it), one of ``batch``'s requests ended (aborted, or finished by an earlier
        batch), one has no output budget left after ``batch``'s passes, or blocks would need preemption."""
        if self.waiting or not batch.requests or any(r.finished for r in batch.requests):
            return None
        steps = _grow_for_passes(self, batch.requests, self.num_scheduler_steps, batch.num_steps)
        if steps < 1:
            return None
        # (Chained while ``batch`` is in flight, when the host has read every batch before it.)
        return replace(batch, swaps=[], num_steps=steps, in_flight=batch.num_steps)


def _grow_for_passes(scheduler: ContinuousScheduler, requests: list[Request], steps: int, in_flight: int) -> int:
    """Passes (at most ``steps``; 0 if none) that decode batch of ``requests`` can run after ``in_flight``
    tokens each that are computed or being computed but not yet on the host: no request past its output
    budget, the K/V blocks of them all free without preempting anyone. Grows the block tables to them."""
    for request in requests:
        left = output_budget(request, scheduler.max_model_len) - len(request.output_token_ids) - in_flight
        steps = min(steps, left)
    tables = scheduler.block_tables
    # Pass i of a request with n tokens (n + in_flight on the device) writes position n + in_flight - 1 + i.
    while steps > 0 and scheduler.available_blocks() < sum(
            tables.extra_blocks_needed(r.request_id, r.num_tokens + in_flight + steps - 1) for r in requests):
        steps -= 1
    if steps > 0:
        for request in requests:
            tables.grow(request.request_id, request.num_tokens + in_flight + steps - 1)
    return steps


@dataclass
class DecodePlan:
    """All the host knows of a multi-step batch before it runs: everything but the input ids after
    the first pass. Plain lists, so that tensor parallelism sends it to the other ranks pickled."""

    ids: list[int] | None  # each sequence's last token: pass 0's input (None: the batch before's, on the device)
    positions: list[int]  # pass 0's positions; pass i's are these + i
    slots: list[list[int]]  # [pass][sequence]: the pool slot each pass's K/V go to
    tables: list[list[int]]  # block tables, already covering every pass

    @classmethod
    def of(cls, batch: ScheduledBatch, block_tables: BlockTables) -> DecodePlan:
        starts = [r.num_computed_tokens + batch.in_flight for r in batch.requests]
        per_sequence = [block_tables.slots(r.request_id, start, start + batch.num_steps)
                        for r, start in zip(batch.requests, starts)]
        return cls(None if batch.in_flight else [r.last_token_id for r in batch.requests], starts,
                   [list(s) for s in zip(*per_sequence)], [block_tables.tables[r.request_id] for r in batch.requests])


@torch.inference_mode()
def decode_steps(runner: PagedRunner, plan: DecodePlan, requests: list[Request] | None,
                 share: bool = False, first_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run the plan's passes on this rank; return the [passes, sequences] tokens, on the device.

    ``requests`` given (rank 0): sample each pass's tokens, and with ``share`` broadcast them to the
    other ranks. None (ranks > 0): receive them. ``first_ids``: pass 0's input on the device, where
    the plan has no ids (a batch chained to the one before it). Nothing here waits for the device.
    """
    batch = len(plan.positions)
    ids = to_device(plan.ids, torch.long, runner.device) if plan.ids is not None else first_ids
    if ids is None or len(ids) != batch:
        raise ValueError(f"a plan without ids needs first_ids of its {batch} sequences on the device, got "
                         f"{None if ids is None else tuple(ids.shape)}")
    every_row = list(range(batch))
    tokens = []
    for step, slots in enumerate(plan.slots):
        positions = [p + step for p in plan.positions]
        context_lens = [p + 1 for p in positions]
        logits = runner.forward_here(ids, positions, slots, plan.tables, [1] * batch, context_lens, every_row)
        if requests is None:
            ids = torch.empty(batch, dtype=torch.long, device=runner.device)
            dist.broadcast(ids, src=0)
        else:
            ids = runner.sampler.sample(logits, requests)
            if share:
                dist.broadcast(ids, src=0)
        tokens.append(ids)
    return torch.stack(tokens) if len(tokens) > 1 else tokens[0][None]  # (one pass: a view, no copy kernel)


def follow_decode_steps(runner: PagedRunner, plan: DecodePlan) -> None:
    """Ranks > 0 of a tensor-parallel engine: rank 0's multi-step batch, with rank 0's tokens."""
    decode_steps(runner, plan, None)


class MultiStepRunner(PagedRunner):
    """The paged runner, which also runs a pure decode batch's ``batch.num_steps`` passes back to back."""

    def run_steps(self, batch: ScheduledBatch) -> list[list[int]]:
        """A pure decode batch's ``batch.num_steps`` passes, each fed the last one's tokens on the
        device: [pass][request] tokens, fetched from the device once."""
        return self.launch_steps(batch).read()

    def launch_steps(self, batch: ScheduledBatch, first_ids: torch.Tensor | None = None) -> LaunchedSteps:
        """``run_steps`` without the wait: the passes' tokens, on their way to the host. ``first_ids``: the
        first pass's input for a batch chained to one still in flight (``batch.in_flight``)."""
        plan = DecodePlan.of(batch, self.block_tables)
        if self.on_decode_steps is not None:
            if plan.ids is None:
                raise ValueError("a chained batch (async scheduling) runs in one process: the other ranks would "
                                 "need its first ids")
            self.on_decode_steps(plan)
        tokens = decode_steps(self, plan, batch.requests, share=self.on_decode_steps is not None, first_ids=first_ids)
        return LaunchedSteps(tokens)


class LaunchedSteps:
    """A launched batch's [pass, request] tokens: ``tokens`` on the device (the next batch's input), and
    a copy to the host queued right behind the passes. ``read`` waits for that copy alone: a batch
    launched after this one (async scheduling) does not delay it, where ``tokens.tolist()`` would
    queue its copy behind that batch and wait for it too."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self._copied = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = tokens

    def read(self) -> list[list[int]]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
