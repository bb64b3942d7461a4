"""Who runs this step, and how many tokens each, under continuous batching. The scheduler only
decides; it never touches tensors (the runner does).

``ContinuousScheduler`` (tuning path step 1): iteration-level scheduling (Orca, OSDI 2022) over a paged KV
cache with one token budget per step (vLLM V1): running requests first, then admissions; long prompts are
split into chunks (chunked prefill); preemption when blocks run out or a more urgent request waits, by
recomputation or, with CPU swap space, by swapping (``minillm.kv.swap``). How one step spends its budget is
``fill_token_budget``, a plain function so that exercise ex03 can swap a learner's version into a live
engine. The static and dynamic schedulers it replaces are in ``minillm/static_scheduler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minillm.request import Request, RequestStatus
from minillm.sequence_group import share_prompt

if TYPE_CHECKING:  # (prefix caching is optional: the engine imports the radix tree when asked for)
    from minillm.kv.radix import RadixCache, RadixNode


@dataclass
class ScheduledBatch:
    requests: list[Request]  # static: the batch's rows, fixed for the batch's life
    num_new_tokens: list[int]  # tokens each request computes this step (a prefill chunk or 1)
    is_prefill: bool = False  # static batching: the batch's first step
    # KV copies to do before the forward pass, in order: ("out", GPU blocks, CPU blocks) for a
    # swapped-out request, ("in", CPU blocks, GPU blocks) for a swapped-in one (preemption_mode="swap").
    swaps: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    num_steps: int = 1  # decode passes to run back to back (num_scheduler_steps; minillm/multi_step.py)
    # Async scheduling (MultiStepScheduler.chain): tokens a request has on the device beyond what the host has seen, its
    # batch's first input the last of them. 0: every request's last token is on the host.
    in_flight: int = 0

    @property
    def is_pure_decode(self) -> bool:
        return all(is_pure_decode(r, n) for r, n in zip(self.requests, self.num_new_tokens))


def is_pure_decode(request: Request, num_new: int) -> bool:
    """The request brings its last token and samples the next, and needs the host only at the end (no penalties,
    no logprobs: ``SamplingParams.one_token_at_a_time``): a batch of such requests can run several passes, or have
    another chained to it (``minillm/multi_step.py``)."""
    return num_new == 1 and request.num_computed_tokens + 1 == request.num_tokens and \
        not request.params.one_token_at_a_time


def fill_token_budget(scheduler: ContinuousScheduler, now: float) -> list[tuple[Request, int]]:
    """One step's work: ``(request, tokens it computes)`` pairs within ``max_num_batched_tokens``.

    Running requests first, most urgent first (``scheduler.running`` is sorted): each computes
    what it has not computed yet, capped by the budget left (one decode token, or the next chunk
    of its prefill); ``reserve`` grows its blocks, preempting from the least urgent end. Then, in
    a step that preempted nobody, waiting requests are admitted in urgency order while sequence
    slots, budget and free blocks above the watermark allow; the first that does not fit stops
    admission, so nobody overtakes it. Exercise ex03 has a learner write this function.
    """
    budget = scheduler.max_num_batched_tokens
    preemptions_before = scheduler.num_preemptions
    scheduled: list[tuple[Request, int]] = []
    index = 0  # by index: preemption removes requests from the end of the list while we walk it
    while index < len(scheduler.running) and budget > 0:
        request = scheduler.running[index]
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not scheduler.reserve(request, request.num_computed_tokens + n):
            break  # it was preempted itself: nothing less urgent is left running
        scheduled.append((request, n))
        budget -= n
        index += 1
    # Admissions; none in a step that had to preempt (the cache is full).
    if scheduler.num_preemptions > preemptions_before:
        return scheduled
    while budget > 0 and len(scheduler.running) < scheduler.max_num_seqs:
        request = scheduler.next_waiting(now)
        if request is None:
            break
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        # Totals: a swapped-out request brings its computed context back (num_computed_tokens > 0).
        if not scheduler.fits(request, request.num_computed_tokens + n, scheduler.watermark_blocks):
            break
        scheduler.admit(request, request.num_computed_tokens + n, now)
        scheduled.append((request, n))
        budget -= n
    return scheduled


class ContinuousScheduler:
    """Continuous batching over a paged KV cache.

    Each step spends at most ``max_num_batched_tokens`` tokens: first on running requests in order
    of urgency (one decode token each, or the next chunk of an unfinished prefill), then on
    admitting waiting requests while sequences, tokens and free blocks allow. Admission keeps
    ``watermark_blocks`` free so running decodes are not starved of blocks at once.

    Urgency: ``fcfs`` orders by arrival; ``priority`` by (priority, arrival), lower = more urgent.
    ``lpm`` (longest prefix match, SGLang's policy of that name; needs the prefix cache) admits the
    waiting request with the most cached prompt tokens first, ties by arrival: requests that share
    a prefix run together while it is cached, rather than after it was evicted. Like SGLang it
    falls back to arrival order when more than ``LPM_MAX_WAITING`` requests wait, where matching
    every one of them each step would cost more than it saves.
    Preemption victim: the least urgent, most recently arrived running request. Its blocks are
    freed and it waits again (at the front of its level), keeping the tokens it generated. By
    default it recomputes: its whole context is prefilled again when it is readmitted. Given
    ``cpu_block_tables`` (preemption_mode="swap"), its computed blocks are swapped out to CPU blocks
    instead (status SWAPPED, ``num_computed_tokens`` kept) and swapped back in at readmission; when
    the CPU pool is full it falls back to recomputation. The scheduler only allocates block ids and
    lists the copies on the batch (``ScheduledBatch.swaps``); the engine's ``KVSwapper`` copies.

    ``lookahead`` says how many passes a batch runs: one here; ``multi_step.MultiStepScheduler`` runs a pure
    decode batch up to ``num_scheduler_steps`` passes, with blocks for all of them.

    ``fill_token_budget`` decides the step's work, through ``reserve``, ``next_waiting``, ``fits``
    and ``admit``. It is a plain attribute: ``scheduler.fill_token_budget = f`` makes the engine
    call ``f(scheduler, now)`` instead (exercise ex03).
    """

    fill_token_budget = staticmethod(fill_token_budget)
    LPM_MAX_WAITING = 128  # SGLang's threshold for the same fallback (schedule_policy.py)

    def __init__(self, block_tables, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 watermark_blocks: int = 0, cpu_block_tables=None, max_model_len: int | None = None):
        self.block_tables, self.cpu_block_tables = block_tables, cpu_block_tables
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.policy, self.watermark_blocks = policy, watermark_blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for step statistics
        self.num_swap_outs = self.num_swap_ins = 0  # swap mode: preemptions that swapped, readmissions
        self.num_swap_fallbacks = 0  # swap mode: preemptions that recomputed, the CPU pool being full
        self._swaps: list[tuple[str, list[int], list[int]]] = []  # decided, not yet handed to a batch
        # Prefix caching (enable_prefix_caching): the radix tree, the node each request has locked,
        # the requests whose prompt is cached already, and waiting requests matched this step.
        self.prefix_cache: RadixCache | None = None
        self._prefix_nodes: dict[str, RadixNode] = {}
        self._prompt_cached: set[str] = set()
        self._matched_waiting: list[Request] = []
        self._cached_lens: dict[str, int] = {}  # lpm: waiting request -> cached prefix tokens, this step

    def _urgency(self, request: Request) -> tuple:
        priority = request.priority if self.policy == "priority" else 0
        return priority, request.metrics.arrival_time, request.seq

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out of the queues (abort), freeing its blocks."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._release_prefix(request)
                    self.block_tables.free(request_id)
                    if self.cpu_block_tables is not None:
                        self.cpu_block_tables.free(request_id)  # a swapped-out request's CPU blocks
                    return request
        return None

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self._cache_prefix(request)  # its prompt and output can serve later requests (multi-turn)
        self._release_prefix(request)
        self.block_tables.free(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._cache_prefix(victim)  # recompute then starts from whatever of it is still cached
        self._release_prefix(victim)
        if self._swap_out(victim):
            victim.status = RequestStatus.SWAPPED  # keeps num_computed_tokens: its K/V wait in CPU blocks
        else:
            victim.num_computed_tokens = 0  # recompute: prefilled again at readmission
            victim.status = RequestStatus.WAITING
        self.block_tables.free(victim.request_id)
        victim.num_preemptions += 1
        self.waiting.insert(0, victim)
        self.num_preemptions += 1

    def _swap_out(self, victim: Request) -> bool:
        """Swap mode: give the victim CPU blocks for its computed tokens and list the copy. The
        GPU blocks are freed right after, but nothing overwrites them before the copy: the engine
        runs the step's copies before its forward pass. False (recompute) without swap space."""
        if self.cpu_block_tables is None or victim.num_computed_tokens == 0:
            return False
        cpu = self.cpu_block_tables
        if cpu.extra_blocks_needed(victim.request_id, victim.num_computed_tokens) > cpu.allocator.num_free:
            self.num_swap_fallbacks += 1
            return False
        cpu.grow(victim.request_id, victim.num_computed_tokens)
        cpu_blocks = cpu.tables[victim.request_id]
        self._swaps.append(("out", self.block_tables.tables[victim.request_id][:len(cpu_blocks)], list(cpu_blocks)))
        self.num_swap_outs += 1
        return True

    def fits(self, request: Request, num_tokens: int, reserve: int) -> bool:
        """Would growing the request's table to ``num_tokens`` still leave ``reserve`` blocks free?"""
        needed = self.block_tables.extra_blocks_needed(request.request_id, num_tokens)
        return needed + reserve <= self.available_blocks()

    def available_blocks(self) -> int:
        """Blocks that growing a table may take: the free ones, and cached unused ones (evicted on demand)."""
        available = self.block_tables.allocator.num_free
        if self.prefix_cache is not None:
            available += self.prefix_cache.num_evictable_blocks
        return available

    def next_waiting(self, now: float) -> Request | None:
        """The most urgent waiting request that has arrived by ``now``; None if there is none."""
        arrived = [r for r in self.waiting if r.metrics.arrival_time <= now]
        if not arrived:
            return None
        if self.policy == "lpm" and len(arrived) <= self.LPM_MAX_WAITING:
            request = min(arrived, key=lambda r: (-self._cached_len(r), self._urgency(r)))
        else:
            request = min(arrived, key=self._urgency)
        self._match_prefix(request)
        return request

    def _cached_len(self, request: Request) -> int:
        if request.request_id not in self._cached_lens:
            computed = request.num_computed_tokens  # a swapped-out request's K/V come back whole
            self._cached_lens[request.request_id] = computed or \
                self.prefix_cache.cached_prefix_len(request.all_token_ids[:request.num_tokens - 1])
        return self._cached_lens[request.request_id]

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Grow a running request's blocks to cover ``num_tokens``, preempting the least urgent
        running requests (the end of ``running``, which ``schedule`` sorts) while blocks are short.
        False if the request had to be preempted itself (it is waiting again, with no blocks)."""
        while not self.fits(request, num_tokens, 0):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        self.block_tables.grow(request.request_id, num_tokens)
        return True

    def admit(self, request: Request, num_tokens: int, now: float) -> None:
        """Move a waiting request to ``running`` with blocks for its first ``num_tokens`` tokens in
        all; a swapped-out one gets its CPU blocks copied back into the first of them."""
        if num_tokens <= request.num_computed_tokens:
            raise ValueError(f"admit wants the total tokens to hold, computed ones included: request "
                             f"{request.request_id} has {request.num_computed_tokens} computed, got {num_tokens}")
        swapped = request.status is RequestStatus.SWAPPED
        if self.prefix_cache is not None and not swapped:
            self.prefix_cache.queries += request.num_tokens
            self.prefix_cache.hits += request.num_computed_tokens  # what the match skipped
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = request.num_computed_tokens  # what the prefix match skipped
        self.block_tables.grow(request.request_id, num_tokens)
        if swapped:
            cpu_blocks = self.cpu_block_tables.tables[request.request_id]
            self._swaps.append(("in", list(cpu_blocks), self.block_tables.tables[request.request_id][:len(cpu_blocks)]))
            self.cpu_block_tables.free(request.request_id)  # reusable by a later swap out: copies run in order
            self.num_swap_ins += 1

    # -- prefix caching ----------------------------------------------------------------------------

    def _match_prefix(self, request: Request) -> None:
        """A waiting request about to be considered takes the cached blocks of its longest cached
        prefix (whole blocks, and never its last token: that one must be computed to give logits);
        it then computes only the rest. Without any, a sequence of a request with n > 1 takes its first
        sequence's prompt blocks the same way (``sequence_group.share_prompt``). Undone at the end of
        the step if it is not admitted."""
        if request.num_computed_tokens or request.request_id in self._prefix_nodes or \
                request.params.prompt_logprobs is not None:  # (to be scored, every prompt position is computed)
            return
        cache = self.prefix_cache
        limit = 0 if cache is None else (request.num_tokens - 1) // cache.block_size * cache.block_size
        node, blocks = cache.match_prefix(request.all_token_ids[:limit]) if limit else (None, [])
        if not blocks:
            if share_prompt(request, self.block_tables):
                self._matched_waiting.append(request)
            return
        for block in blocks:
            cache.allocator.share(block)
        self.block_tables.tables[request.request_id] = list(blocks)
        cache.lock(node)
        self._prefix_nodes[request.request_id] = node
        request.num_computed_tokens = len(blocks) * cache.block_size
        self._matched_waiting.append(request)

    def _unmatch_still_waiting(self) -> None:
        for request in self._matched_waiting:
            if request.status is RequestStatus.WAITING:  # not admitted: give the blocks back
                self._release_prefix(request)
                self.block_tables.free(request.request_id)
                request.num_computed_tokens = 0
        self._matched_waiting.clear()

    def _cache_prefix(self, request: Request) -> None:
        """Put the request's computed whole blocks in the tree and lock the path it now uses."""
        cache = self.prefix_cache
        if cache is None:
            return
        full = request.num_computed_tokens // cache.block_size
        if full:
            node = cache.insert(request.all_token_ids[:full * cache.block_size],
                                self.block_tables.tables[request.request_id][:full])
            cache.lock(node)
            self._release_prefix(request)
            self._prefix_nodes[request.request_id] = node
        if request.num_computed_tokens >= request.num_prompt_tokens:
            self._prompt_cached.add(request.request_id)

    def _release_prefix(self, request: Request) -> None:
        node = self._prefix_nodes.pop(request.request_id, None)
        if node is not None:
            self.prefix_cache.unlock(node)
        self._prompt_cached.discard(request.request_id)

    def _make_room_for_urgent(self, now: float) -> None:
        """priority policy: preempt less urgent running requests while the most urgent waiting one
        cannot be admitted (no sequence slot or too few blocks for its first chunk)."""
        while self.running:
            candidate = self.next_waiting(now)
            victim = max(self.running, key=self._urgency)
            if candidate is None or candidate.priority >= victim.priority:
                return
            computed = candidate.num_computed_tokens  # > 0 for a swapped-out request
            first_chunk = computed + min(candidate.num_tokens - computed, self.max_num_batched_tokens)
            if len(self.running) < self.max_num_seqs and self.fits(candidate, first_chunk, self.watermark_blocks):
                return
            self._preempt(victim)

    def lookahead(self, scheduled: list[tuple[Request, int]]) -> int:
        """Forward passes the step's batch runs: one (``multi_step.MultiStepScheduler`` runs more)."""
        return 1

    def schedule(self, now: float) -> ScheduledBatch | None:
        if self.policy == "priority":
            self._make_room_for_urgent(now)
        self.running.sort(key=self._urgency)  # most urgent first: preemption takes from the end
        for request in self.running:  # a prompt prefilled in full is cached at once: others may share it
            if request.num_computed_tokens >= request.num_prompt_tokens and \
                    request.request_id not in self._prompt_cached:
                self._cache_prefix(request)
        scheduled = self.fill_token_budget(self, now)
        self._unmatch_still_waiting()
        num_steps = self.lookahead(scheduled)  # after the unmatched blocks went back
        self._cached_lens.clear()  # the tree changes between steps
        swaps, self._swaps = self._swaps, []
        if not scheduled and not swaps:
            return None
        # A batch with swaps and no requests still goes to the engine: the copies must happen.
        return ScheduledBatch([r for r, _ in scheduled], [n for _, n in scheduled], swaps=swaps, num_steps=num_steps)
