"""n answers to one prompt (``SamplingParams.n``), sharing the prompt's KV blocks.

A request with n > 1 runs as n sequences: ``Request``s the scheduler and the runner treat like any
other, sequence 0 with the request's id and sequence i with ``f"{request_id}#{i}"``. Only sequence 0 is
queued at first, so the prompt is prefilled once. When it samples its first token its prompt's K/V are
all in the cache, and the others *fork* from it: each starts its block table with a reference to
sequence 0's whole prompt blocks (``BlockTables.fork``) and computes only the rest of the prompt, at
most one block of tokens, into a block of its own — the block it then goes on writing its output into.

That is copy-on-write at block granularity with nothing to copy: the partly filled last block, the
only one a sequence would write into, is never shared; recomputing its few tokens replaces the copy
(and gives each sequence its own logits for its first token). Prefix caching shares blocks the same
way, through a radix tree, between requests; this needs no tree and works with it off. The forked
sequences join the waiting queue with their shared blocks and are admitted like any other; a
preempted one lets its references go and recomputes, as any request does.

Seeds: sequence i samples with ``seed + i`` (vLLM's choice), so the n answers differ and each is
reproducible whatever else runs. ``prompt_logprobs`` come from sequence 0, which alone computes the
prompt. The request's output holds the n sequences' outputs in order; it is finished when all are.
"""

from __future__ import annotations

from dataclasses import replace

from minillm.kv.paged import BlockTables
from minillm.request import Request, RequestOutput, SamplingParams


class SequenceGroup:
    """The n sequences of one request. Reads like a ``Request`` to the API: ``request_id``, ``finished``,
    ``to_output``."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival_time: float | None = None):
        self.request_id, self.params = request_id, params
        self.sequences: list[Request] = []
        for i in range(params.n):
            own = replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                          prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            sequence = Request(sequence_id(request_id, i), prompt, prompt_token_ids, own, priority, arrival_time)
            sequence.index = i
            self.sequences.append(sequence)
        self.unforked = self.sequences[1:]  # waiting for sequence 0's prompt K/V

    @property
    def first(self) -> Request:
        return self.sequences[0]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def fork(self, block_tables: BlockTables) -> list[Request]:
        """Sequence 0's prompt is computed: the other sequences share its whole blocks but the one its last
        prompt token is in (that token must be computed again for its logits, and its block is written next).
        Returns them, to be queued."""
        first, block_size = self.first, block_tables.block_size
        shared = (first.num_prompt_tokens - 1) // block_size
        for sequence in self.unforked:
            block_tables.fork(first.request_id, sequence.request_id, shared)
            sequence.num_computed_tokens = shared * block_size
        forked, self.unforked = self.unforked, []
        return forked

    def to_output(self) -> RequestOutput:
        first = self.first
        metrics = first.metrics
        if self.finished:  # the request ends with its last sequence
            metrics = replace(metrics, finished_time=max(s.metrics.finished_time for s in self.sequences))
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids,
                             [s.completion() for s in self.sequences], self.finished, metrics, prompt_logprobs)


def sequence_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


class SequenceGroups:
    """The engine's live requests with n > 1, found by the ids of their sequences."""

    def __init__(self, block_tables: BlockTables | None):
        self.block_tables = block_tables  # None with static batching, which has no n > 1
        self.by_sequence: dict[str, SequenceGroup] = {}

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.by_sequence

    def add(self, group: SequenceGroup) -> None:
        self.by_sequence.update((s.request_id, group) for s in group.sequences)

    def after_token(self, sequence: Request) -> list[Request]:
        """``sequence`` got a token: if it is a group's sequence 0 with its first token, fork the others
        (returned, to be queued). Called before a finished sequence's blocks are freed."""
        group = self.by_sequence.get(sequence.request_id)
        if group is None or sequence is not group.first or not group.unforked:
            return []
        return group.fork(self.block_tables)

    def output(self, sequence: Request) -> RequestOutput | None:
        """The output of ``sequence``'s request if it is part of a group (None otherwise); a finished group
        is forgotten."""
        group = self.by_sequence.get(sequence.request_id)
        if group is None:
            return None
        if group.finished:
            self.forget(group.sequences)
        return group.to_output()

    def forget(self, sequences: list[Request]) -> None:
        """The request of these sequences finished or was aborted."""
        for sequence in sequences:
            self.by_sequence.pop(sequence.request_id, None)

