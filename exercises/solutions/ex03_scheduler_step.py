"""Exercise 03: one step of a continuous-batching scheduler with a token budget.

Static batching runs a batch until its longest request ends. Continuous batching (Orca, OSDI 2022)
decides again at *every* step who runs, so a finished request's place goes to a waiting one at once.
vLLM V1 gives each step one **token budget**, ``max_num_batched_tokens``, shared by everybody:

1. **Running requests first**, most urgent first. A request computes the tokens it has not computed
   yet, capped by the budget left: one token for a request that is decoding, the next *chunk* of
   its prompt for one that is still prefilling (chunked prefill: a long prompt is spread over
   several steps instead of stalling every decode behind it).
2. **Then admissions**: waiting requests join, most urgent first, while the budget, the sequence
   limit ``max_num_seqs`` and the free KV blocks allow. Admission keeps ``watermark_blocks`` blocks
   free, so the running requests can still grow; the first waiting request that does not fit stops
   admission (nobody behind it overtakes it).

Worked example: ``max_num_batched_tokens=8``, ``max_num_seqs=3``, plenty of blocks. A is decoding,
B has a 20-token prompt of which 12 are computed; C (5-token prompt) and D (2 tokens) wait::

    step   A    B                   C                 D       budget left
    1      1    7 (19 of 20 done)   waits: budget 0   waits   0
    2      1    1 (prompt done)     5 (admitted)      waits   1, but A, B, C = max_num_seqs
    3      1    1                   1                 waits   5, still 3 sequences running

When the blocks run out, someone must give theirs back: **preemption**. The least urgent running
request (the end of ``scheduler.running``) loses its blocks and waits again; it recomputes its
tokens when it is readmitted. ``scheduler.reserve`` does that for you. A step that had to preempt
admits nobody: the cache is full.

Where it lives in minillm: ``minillm/scheduler.py``. ``ContinuousScheduler.schedule`` sorts
``running`` by urgency (and, under the priority policy, preempts for an urgent newcomer), then calls
``self.fill_token_budget(self, now)`` and hands its pairs to the model runner. It is a plain
attribute, so you can put your version into a running engine::

    from minillm import LLM, SamplingParams
    from exercises.ex03_scheduler_step import fill_token_budget   # yours (run from the repo root)

    llm = LLM("tiny", load_format="dummy", batching="continuous", max_num_batched_tokens=8)
    llm.engine.scheduler.fill_token_budget = fill_token_budget     # the engine now schedules with your code
    llm.generate([[5, 6, 7] * 10], SamplingParams(max_tokens=10, temperature=0.0))

Test your version (from the repository root)::

    pytest exercises/tests/test_ex03_scheduler_step.py --impl=mine
"""

from __future__ import annotations


def fill_token_budget(scheduler, now: float) -> list[tuple]:
    """Choose this step's work: a list of ``(request, num_new_tokens)`` pairs, running requests
    first (in ``scheduler.running``'s order), then the admitted ones (in the order admitted).

    Args:
        scheduler: the ``ContinuousScheduler``. What you need of it:

            - ``scheduler.running``: the running requests, most urgent first (``schedule`` sorted
              them); ``scheduler.max_num_batched_tokens``, ``scheduler.max_num_seqs``,
              ``scheduler.watermark_blocks``; ``scheduler.num_preemptions``, a running count.
            - ``scheduler.reserve(request, num_tokens) -> bool``: grow a *running* request's blocks
              so they cover ``num_tokens`` tokens in all, preempting from the end of ``running``
              while blocks are short. ``False`` means the request was preempted itself.
            - ``scheduler.next_waiting(now)``: the most urgent waiting request that has arrived,
              or ``None``.
            - ``scheduler.fits(request, num_tokens, reserve) -> bool``: are there enough free
              blocks for ``num_tokens`` tokens of it in all, with ``reserve`` blocks to spare?
            - ``scheduler.admit(request, num_tokens, now)``: move a waiting request to ``running``
              with blocks for ``num_tokens`` tokens in all.

            And of a request: ``request.num_tokens`` (prompt + generated so far) and
            ``request.num_computed_tokens`` (those whose K/V are in the cache already).
        now: the current time (``time.perf_counter`` seconds); pass it on.

    Returns:
        The pairs, each ``num_new_tokens >= 1``, their sum at most ``max_num_batched_tokens``.
        Every request in them is running and has blocks for all its tokens after this step.

    Hints:
        - A request's tokens this step: ``min(request.num_tokens - request.num_computed_tokens,
          budget_left)``. ``reserve``, ``fits`` and ``admit`` want totals: ``num_computed_tokens + n``
          tokens of blocks (a waiting request usually has none computed; one swapped out to CPU
          memory, ``preemption_mode="swap"``, brings its computed tokens back).
        - Walk ``running`` with an index and a ``while`` loop, not ``for request in running``:
          ``reserve`` may remove requests from the end of the list while you walk it. When it
          returns ``False``, stop.
        - Compare ``scheduler.num_preemptions`` before and after the running requests: if it grew,
          return without admitting anybody.
        - Admission stops at the first request that cannot come in: no budget left, ``max_num_seqs``
          requests running, or ``fits(request, total, scheduler.watermark_blocks)`` is False. Only
          admissions keep the watermark; running requests may take the last free blocks.
    """
    # BEGIN SOLUTION: running requests first (reserve their blocks), then admit waiting ones in order
    budget = scheduler.max_num_batched_tokens
    preemptions_before = scheduler.num_preemptions
    scheduled = []

    # 1. Running requests, most urgent first: a decode token, or the next chunk of the prompt.
    index = 0
    while index < len(scheduler.running) and budget > 0:
        request = scheduler.running[index]
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not scheduler.reserve(request, request.num_computed_tokens + n):
            break  # preempted itself: everything less urgent is already gone
        scheduled.append((request, n))
        budget -= n
        index += 1

    # 2. A step that had to preempt has a full cache: nobody new comes in.
    if scheduler.num_preemptions > preemptions_before:
        return scheduled

    # 3. Admissions, most urgent first, until the first one that does not fit.
    while budget > 0 and len(scheduler.running) < scheduler.max_num_seqs:
        request = scheduler.next_waiting(now)
        if request is None:
            break
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        total = request.num_computed_tokens + n
        if not scheduler.fits(request, total, scheduler.watermark_blocks):
            break
        scheduler.admit(request, total, now)
        scheduled.append((request, n))
        budget -= n
    return scheduled
    # END SOLUTION
