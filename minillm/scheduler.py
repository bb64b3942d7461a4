"""Who runs this step. Static batching: the naive deployment of tuning path step 0.

Requests are taken first come, first served, ``max_batch`` at a time; the batch is prefilled
together (left-padded to its longest prompt), then decodes one token per row per step until *every*
row is finished. Rows that finished early keep occupying the batch (their outputs are ignored) and
newcomers wait for the whole batch to end — the two wastes continuous batching removes.

The scheduler only decides; it never touches tensors (the runner does).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minillm.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request]  # the batch's rows; fixed for the life of a static batch
    is_prefill: bool


def output_budget(request: Request, max_model_len: int) -> int:
    """Tokens this request may still generate: its max_tokens, capped so prompt + output fits."""
    return min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)


class StaticScheduler:
    def __init__(self, max_batch: int, max_model_len: int):
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove_waiting(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return request
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    def schedule(self, now: float) -> ScheduledBatch | None:
        if any(not r.finished for r in self.running):
            return ScheduledBatch(self.running, is_prefill=False)
        self.running = self._next_batch(now)
        for request in self.running:
            request.status = RequestStatus.RUNNING
            request.metrics.first_scheduled_time = now
        return ScheduledBatch(self.running, is_prefill=True) if self.running else None

    def _next_batch(self, now: float) -> list[Request]:
        """Arrived requests in FIFO order while the left-padded batch fits the cache's columns:
        longest prompt + longest output budget - 1 <= max_model_len."""
        batch: list[Request] = []
        longest_prompt = longest_output = 0
        while self.waiting and len(batch) < self.max_batch and self.waiting[0].metrics.arrival_time <= now:
            request = self.waiting[0]
            prompt = max(longest_prompt, request.num_prompt_tokens)
            output = max(longest_output, output_budget(request, self.max_model_len))
            if batch and prompt + output - 1 > self.max_model_len:
                break  # it would push a batch mate past the cache's end: it goes in the next batch
            batch.append(self.waiting.popleft())
            longest_prompt, longest_output = prompt, output
        return batch
