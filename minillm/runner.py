"""Runners turn a scheduled batch into tensors, run the model, and sample. They never decide who runs.

- ``StaticRunner`` (contiguous cache): the batch is left-padded, so row b's prompt sits at the right
  end of the first ``L`` columns (``L`` = longest prompt) and every row writes its next token into
  the same cache column. It keeps that column and which columns hold real tokens.
- ``PagedRunner`` (paged cache): all scheduled tokens are packed into one flat row — decodes first,
  then prefill chunks — with each token's position and pool slot; only sequences whose whole
  context is computed after this step get a sampled token.

Both return the step's tokens with the log-probabilities the requests asked for (``logprobs.py``): a
request with ``prompt_logprobs`` has the LM head run on its prompt positions too, only then.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.kv.contiguous import ContiguousKVCache, LeftPaddedBatch
from minillm.kv.paged import BlockTables, PagedBatch, PagedKVCache, PagedStep, to_device
from minillm.logprobs import StepLogprobs, prompt_positions
from minillm.model.llama import LlamaForCausalLM
from minillm.sampling import Sampler
from minillm.scheduler import ScheduledBatch


class StepOutput(NamedTuple):
    token_ids: list[int | None]  # one per request of the batch; None: it samples nothing this step
    logprobs: StepLogprobs | None = None  # None when no request asked for any


class StaticRunner:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, max_model_len: int, device: torch.device,
                 seed: int = 0):
        self.model, self.device = model, device
        dtype = model.model.embed_tokens.weight.dtype  # (the LM head may be quantized: "-head")
        self.cache = ContiguousKVCache(model.config, max_batch, max_model_len, dtype, device)
        self.sampler = Sampler(device, seed)
        self.key_valid: torch.Tensor | None = None  # [B, max_model_len] for the batch in flight
        self.pad: torch.Tensor | None = None  # [B] left-padding per row
        self.next_col = 0  # the cache column the next decode token goes to

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        if batch.is_prefill:
            input_ids, positions, attn = self._prepare_prefill(batch)
        else:
            input_ids, positions, attn = self._prepare_decode(batch)
        hidden = self.model(input_ids, positions, attn)
        logits = self.model.compute_logits(hidden[:, -1])
        tokens = self.sampler.sample(logits, batch.requests)
        logprobs = StepLogprobs()
        logprobs.score_sampled(logits, tokens, batch.requests, list(range(len(batch.requests))))
        for row, request in enumerate(batch.requests if batch.is_prefill else ()):
            scored = None if request.prompt_logprobs is None else prompt_positions(request, 0, request.num_prompt_tokens)
            if scored:  # the prompt is right-aligned in the first columns: position p sits at column pad + p
                columns = int(self.pad[row]) + torch.tensor(scored, device=hidden.device)
                logprobs.score_prompt(row, request, self.model.compute_logits(hidden[row, columns]), scored)
        return StepOutput(tokens.tolist(), logprobs or None)

    def _prepare_prefill(self, batch: ScheduledBatch):
        prompts = [r.prompt_token_ids for r in batch.requests]
        longest = max(map(len, prompts))
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        positions = torch.zeros(len(prompts), longest, dtype=torch.long)
        key_valid = torch.zeros(len(prompts), self.cache.max_len, dtype=torch.bool)
        pad = torch.tensor([longest - len(p) for p in prompts])
        for row, prompt in enumerate(prompts):
            ids[row, pad[row]:] = torch.tensor(prompt)
            positions[row, pad[row]:] = torch.arange(len(prompt))
            key_valid[row, pad[row]:longest] = True
        self.key_valid = key_valid.to(self.device)
        self.pad = pad.to(self.device)
        self.next_col = longest
        attn = LeftPaddedBatch(self.cache, self.key_valid, start=0, num_new=longest)
        return ids.to(self.device), positions.to(self.device), attn

    def _prepare_decode(self, batch: ScheduledBatch):
        col = self.next_col
        if col >= self.cache.max_len:
            raise RuntimeError(f"static batch ran past the cache's {self.cache.max_len} columns (scheduler bug)")
        ids = torch.tensor([[r.last_token_id] for r in batch.requests], device=self.device)
        positions = (col - self.pad)[:, None]
        self.key_valid[:, col] = True
        self.next_col += 1
        return ids, positions, LeftPaddedBatch(self.cache, self.key_valid, start=col, num_new=1)


class PagedRunner:
    """Runs continuous-batching steps over the paged cache.

    ``make_attention(cache, step)`` builds the step's attention context (the torch reference
    ``PagedBatch`` or the Triton kernels' ``TritonPagedBatch``). With ``graphs`` (CUDA only),
    steps where every sequence brings one token replay a captured CUDA graph instead.

    ``forward`` is the model's part of a step, from plain lists; ``on_forward`` (set by tensor
    parallelism on rank 0) receives those lists first and sends them to the other ranks, which
    replay the same ``forward`` on their shards. ``multi_step.MultiStepRunner`` runs multi-step
    batches, whose plan ``on_decode_steps`` sends the same way.
    """

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, block_tables: BlockTables,
                 device: torch.device, seed: int = 0, make_attention=PagedBatch, graphs=None):
        self.model, self.cache, self.block_tables, self.device = model, cache, block_tables, device
        self.make_attention, self.graphs = make_attention, graphs
        self.sampler = Sampler(device, seed)
        self.on_forward = self.on_decode_steps = None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        # Sequences with one new token go first so the attention context can batch them.
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] != 1)
        ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        logit_rows, sampling, sampling_rows = [], [], []  # flat indices needing logits; who samples, from which
        prompt_rows = {}  # prompt_logprobs: request -> (its rows in logit_rows, the positions they score)
        for i in order:
            request, n = batch.requests[i], batch.num_new_tokens[i]
            start = request.num_computed_tokens
            ids += request.token_ids(start, start + n)
            positions += range(start, start + n)
            slots += self.block_tables.slots(request.request_id, start, start + n)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(self.block_tables.tables[request.request_id])
            scored = None if request.prompt_logprobs is None else prompt_positions(request, start, start + n)
            if scored:
                prompt_rows[i] = (range(len(logit_rows), len(logit_rows) + len(scored)), scored)
                logit_rows += [len(ids) - n + p - start for p in scored]
            if start + n == request.num_tokens:
                sampling_rows.append(len(logit_rows))
                logit_rows.append(len(ids) - 1)
                sampling.append(i)
        tokens: list[int | None] = [None] * len(batch.requests)
        logits = self.forward(ids, positions, slots, tables, query_lens, context_lens, logit_rows)
        logprobs = StepLogprobs()
        for i, (rows, scored) in prompt_rows.items():
            logprobs.score_prompt(i, batch.requests[i], logits[rows.start:rows.stop], scored)
        if sampling:  # (prefill chunks that end before their prompts do only write K/V)
            requests = [batch.requests[i] for i in sampling]
            sampling_logits = logits[sampling_rows] if prompt_rows else logits
            sampled = self.sampler.sample(sampling_logits, requests)
            logprobs.score_sampled(sampling_logits, sampled, requests, sampling)
            for i, token in zip(sampling, sampled.tolist()):
                tokens[i] = token
        return StepOutput(tokens, logprobs or None)

    def forward(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                query_lens: list[int], context_lens: list[int], last_index: list[int]) -> torch.Tensor | None:
        """Write the step's K/V and return the logits of the ``last_index`` tokens (None: no row samples)."""
        if self.on_forward is not None:
            self.on_forward((ids, positions, slots, tables, query_lens, context_lens, last_index))
        return self.forward_here(ids, positions, slots, tables, query_lens, context_lens, last_index)

    @torch.inference_mode()
    def forward_here(self, ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
                     tables: list[list[int]], query_lens: list[int], context_lens: list[int],
                     last_index: list[int]) -> torch.Tensor | None:
        """``forward`` on this rank only (the other ranks were told already). ``ids`` may be a [tokens]
        int64 tensor on the device: a multi-step pass's input, sampled by the pass before."""
        if self.graphs is not None and len(ids) == len(query_lens) and self.graphs.fits(len(ids)):
            logits = self.graphs.run(ids, positions, slots, tables, context_lens)
            # Every decode row samples, in order, so last_index is 0..B-1: no gather needed.
            return logits if len(last_index) == len(ids) else logits[last_index]
        step = PagedStep.from_host(slots, tables, query_lens, context_lens, self.device)
        input_ids = ids[None] if isinstance(ids, torch.Tensor) else to_device([ids], torch.long, self.device)
        hidden = self.model(input_ids, to_device([positions], torch.long, self.device),
                            self.make_attention(self.cache, step))
        if not last_index:
            return None  # skipped on every rank alike: the tensor-parallel LM head is a collective
        return self.model.compute_logits(hidden[0, last_index])

