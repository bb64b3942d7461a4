"""Static and dynamic batching: the baseline continuous batching replaces (tuning path step 0).

- ``StaticScheduler``: first come, first served, ``max_batch`` at a time; the batch is prefilled together
  (left-padded to its longest prompt), then decodes one token per row per step until *every* row is finished.
  Rows that finished early keep occupying the batch and newcomers wait for the whole batch to end — the two
  wastes continuous batching (``minillm/scheduler.py``) removes.
- ``DynamicScheduler``: static batches formed more wisely — wait up to ``batch_timeout`` for a full batch, and
  group requests of similar prompt length (length buckets) to pad less.

Both run over the contiguous KV cache (``minillm/kv/contiguous.py``) through ``StaticRunner``.
"""

from __future__ import annotations

from minillm.request import Request, RequestStatus, output_budget
from minillm.scheduler import ScheduledBatch


class StaticScheduler:
    def __init__(self, max_batch: int, max_model_len: int):
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request_id: str) -> Request | None:
        """Abort: a waiting request leaves the queue; a running row idles until its batch ends."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    def schedule(self, now: float) -> ScheduledBatch | None:
        if any(not r.finished for r in self.running):
            return ScheduledBatch(self.running, [1] * len(self.running))
        self.running = self._next_batch(now)
        for request in self.running:
            request.status = RequestStatus.RUNNING
            request.metrics.first_scheduled_time = now
        if not self.running:
            return None
        return ScheduledBatch(self.running, [r.num_prompt_tokens for r in self.running], is_prefill=True)

    def finish(self, request: Request) -> None:
        """A finished row stays in its static batch until the batch ends."""

    def _next_batch(self, now: float) -> list[Request]:
        return self._fill([r for r in self.waiting if r.metrics.arrival_time <= now])

    def _fill(self, candidates: list[Request]) -> list[Request]:
        """Take candidates in order while the left-padded batch fits the cache's columns (longest
        prompt + longest output budget - 1 <= max_model_len); one that does not fit waits for the
        next batch, which it then heads (it is older than everything behind it)."""
        batch: list[Request] = []
        longest_prompt = longest_output = 0
        for request in candidates:
            if len(batch) == self.max_batch:
                break
            prompt = max(longest_prompt, request.num_prompt_tokens)
            output = max(longest_output, output_budget(request, self.max_model_len))
            if batch and prompt + output - 1 > self.max_model_len:
                continue
            batch.append(request)
            longest_prompt, longest_output = prompt, output
        for request in batch:
            self.waiting.remove(request)
        return batch


class DynamicScheduler(StaticScheduler):
    """Dynamic batching (the seeds' intermediate step): a batch starts when ``max_batch`` requests
    wait or the oldest has waited ``batch_timeout`` seconds; it takes the oldest request's length
    bucket (prompt length // ``bucket_width``) first, in arrival order, then fills up from the rest.
    Batches still run until their longest request ends."""

    def __init__(self, max_batch: int, max_model_len: int, batch_timeout: float, bucket_width: int):
        super().__init__(max_batch, max_model_len)
        self.batch_timeout, self.bucket_width = batch_timeout, bucket_width

    def _next_batch(self, now: float) -> list[Request]:
        arrived = [r for r in self.waiting if r.metrics.arrival_time <= now]
        if not arrived:
            return []
        if len(arrived) < self.max_batch and now - arrived[0].metrics.arrival_time < self.batch_timeout:
            return []  # wait for more requests
        bucket = arrived[0].num_prompt_tokens // self.bucket_width
        same = [r for r in arrived if r.num_prompt_tokens // self.bucket_width == bucket]
        return self._fill(same + [r for r in arrived if r.num_prompt_tokens // self.bucket_width != bucket])
