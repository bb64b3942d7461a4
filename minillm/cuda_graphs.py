"""Decode steps replayed from CUDA graphs.

Why: an eager decode step of llama2-7b launches ~900 kernels, each costing microseconds of Python
and driver time, so at small batches the GPU waits on the CPU (figures/h200/profile_decode_step.json:
the GPU was busy 6.5 ms of a 16 ms step). A CUDA graph records the launches once and replays them
all with one call (NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; vLLM and gpt-fast decode the
same way).

A graph replays fixed kernels on fixed addresses with fixed shapes, so:
- one graph per *capture size* (1, 2, 4, 8, then every 8 up to ``max_num_seqs``, as vLLM does);
  a batch runs in the smallest that holds it;
- every input lives in a static buffer that each step overwrites (copied from pinned host memory
  without blocking the CPU);
- padding rows (batch 5 in the graph of 8) get token 0 at position 0, one token of context, and
  the cache's scratch block, so they write and read only memory that no request owns;
- the attention kernels' launch grids depend on shapes only, never on the context lengths, which
  change every step (see ``kernels/paged_attention.py``).
Only pure decode steps (every sequence brings one token) are captured; prefills run eagerly.
"""

from __future__ import annotations

import torch

from minillm.kv.paged import PagedKVCache, PagedStep
from minillm.model.llama import LlamaForCausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including ``max_batch``."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, make_attention, max_batch: int,
                 max_model_len: int, device: torch.device):
        self.model, self.cache, self.make_attention, self.device = model, cache, make_attention, device
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.scratch_slot = cache.scratch_block * cache.block_size
        width = -(-max_model_len // cache.block_size)
        largest = self.sizes[-1]
        # The static inputs, holding padding values until a step overwrites its rows.
        self.input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((largest, width), cache.scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.num_replays = 0  # decode steps served from a graph (the benchmarks report it)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _forward(self, size: int) -> torch.Tensor:
        step = PagedStep(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size],
                         torch.zeros(1, dtype=torch.int32, device=self.device), [1] * size,
                         [self.max_model_len] * size, num_decode=size)  # host lengths: the longest possible
        attn = self.make_attention(self.cache, step)
        hidden = self.model(self.input_ids[:, :size], self.positions[:, :size], attn)
        return self.model.compute_logits(hidden[0])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            # Warm up outside the graph: compiles the Triton kernels, picks cuBLAS algorithms.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """Copy one decode step's inputs into the static buffers, replay, return [batch, vocab] logits."""
        batch = len(ids)
        size = next(s for s in self.sizes if s >= batch)
        pad = size - batch
        width = max(map(len, tables))
        scratch = self.cache.scratch_block
        rows = [t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width] * pad

        def put(buffer: torch.Tensor, values) -> None:
            host = torch.tensor(values, dtype=buffer.dtype, pin_memory=True)
            buffer.copy_(host, non_blocking=True)

        put(self.input_ids[0, :size], ids + [0] * pad)
        put(self.positions[0, :size], positions + [0] * pad)
        put(self.slot_mapping[:size], slots + [self.scratch_slot] * pad)
        put(self.context_lens[:size], context_lens + [1] * pad)
        put(self.block_tables[:size, :width], rows)  # columns past width: stale ids, never read
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:batch]
