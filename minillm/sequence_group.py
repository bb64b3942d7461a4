"""n answers to one prompt (``SamplingParams.n``), sharing the prompt's KV blocks.

A request with n > 1 runs as n sequences: ``Request``s the scheduler and the runner treat like any
other, sequence 0 with the request's id and sequence i with ``f"{request_id}#{i}"``. Only sequence 0 is
queued at first, so the prompt is prefilled once. When it samples its first token its prompt's K/V are
all in the cache, and the others are queued. When the scheduler considers one for admission it
*forks* from sequence 0 (``share_prompt``, called where a prefix-cache match would be taken): its
block table starts with references to sequence 0's whole prompt blocks (``BlockTables.fork``) and it
computes only the rest of the prompt, at most one block of tokens, into a block of its own — the
block it then goes on writing its output into.

That is copy-on-write at block granularity with nothing to copy: the partly filled last block, the
only one a sequence would write into, is never shared; recomputing its few tokens replaces the copy
(and gives each sequence its own logits for its first token). Taking the blocks at admission, like a
prefix match, keeps the scheduler's rule that a waiting request holds no blocks across steps: one not
admitted gives them back at the end of the step, and a preempted one lets them go and forks again
when readmitted. A sequence considered after sequence 0 finished or was preempted finds no blocks to
share and computes the prompt itself (with prefix caching on, the cache usually has it).

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
            own = replace(params, n=1, seed=None if params.seed is None else _wrap_seed(params.seed + i),
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

    def fork(self) -> list[Request]:
        """Sequence 0's prompt is computed: the other sequences, to be queued; each shares its prompt blocks
        when admitted (``share_prompt``)."""
        for sequence in self.unforked:
            sequence.shares_prompt_of = self.first
        forked, self.unforked = self.unforked, []
        return forked

    def to_output(self) -> RequestOutput:
        first = self.first
        metrics = first.metrics
        if self.finished:  # the request ends with its last sequence
            metrics = replace(metrics, finished_time=max(s.metrics.finished_time for s in self.sequences))
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids,
                             [s.completion() for s in self.sequences], self.finished, metrics, prompt_logprobs,
                             first.num_cached_tokens)


def _wrap_seed(seed: int) -> int:
    """A seed past 2**64 - 1 as the same torch.Generator seed (manual_seed takes it modulo 2**64)."""
    return seed - 2**64 if seed >= 2**64 else seed


def sequence_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


def share_prompt(sequence: Request, block_tables: BlockTables) -> bool:
    """A waiting sequence of a request with n > 1 about to be admitted takes references to the whole blocks of
    its first sequence's prompt, but the block the last prompt token is in (that token is computed again for
    its logits, and its block is written next); it computes the rest. False if there is nothing to share: it
    is not such a sequence, or the first one holds no computed prompt blocks now (finished or preempted)."""
    first = sequence.shares_prompt_of
    if first is None or first.request_id not in block_tables.tables:
        return False
    block_size = block_tables.block_size
    shared = min(first.num_prompt_tokens - 1, first.num_computed_tokens) // block_size
    if shared == 0:
        return False
    block_tables.fork(first.request_id, sequence.request_id, shared)
    sequence.num_computed_tokens = shared * block_size
    return True


class SequenceGroups:
    """The engine's live requests with n > 1, found by the ids of their sequences."""

    def __init__(self):
        self.by_sequence: dict[str, SequenceGroup] = {}

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self.by_sequence

    def add(self, group: SequenceGroup) -> None:
        self.by_sequence.update((s.request_id, group) for s in group.sequences)

    def after_token(self, sequence: Request) -> list[Request]:
        """``sequence`` got a token: if it is a group's sequence 0 with its first token, the others (to be
        queued: its prompt is computed)."""
        group = self.by_sequence.get(sequence.request_id)
        if group is None or sequence is not group.first or not group.unforked:
            return []
        return group.fork()

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

