"""Decode steps replayed from CUDA graphs.

Why: an eager decode step of llama2-7b launches ~900 kernels, each costing microseconds of Python
and driver time, so at small batches the GPU waits on the CPU (figures/h200/profile_decode_step.json:
the GPU was busy 6.5 ms of a 16 ms step). A CUDA graph records the launches once and replays them
all with one call (NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; vLLM and gpt-fast decode the
same way).

A graph replays fixed kernels on fixed addresses with fixed shapes, so:
- one graph per *capture size* (1, 2, 4, 8, then every 8 up to ``max_num_seqs``, as vLLM does);
  a batch runs in the smallest that holds it;
- every input lives in a static buffer that each step overwrites (filled in pinned host memory
  and copied without blocking the CPU);
- padding rows (batch 5 in the graph of 8) get token 0 at position 0, one token of context, and
  the cache's scratch block, so they write and read only memory that no request owns;
- the attention kernels' launch grids depend on shapes only, never on the context lengths, which
  change every step (see ``kernels/paged_attention.py``).
Only pure decode steps (every sequence brings one token) are captured; prefills run eagerly.
With ``cpu_offload_gb`` the graphs also hold the offloader's copies (``minillm/offload.py``): they
read its pinned host buffers and write its staging buffers, which live as long as the engine.
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
        # The static inputs live in one device buffer with a pinned host twin that a step fills in place
        # (through numpy views: no tensor built per step) and copies over without blocking, in one copy: int64
        # rows [token ids, positions, slots], then int32 context lengths and the block table, whose first
        # ``size`` rows end the bytes a step of that size copies. They start out holding padding values (see
        # the module docstring).
        self._long_bytes = 3 * largest * 8
        host = torch.zeros(self._long_bytes + largest * (1 + width) * 4, dtype=torch.uint8).pin_memory()
        self._host_long, self._host_int = self._split(host, largest)
        self._long, self._int = self._host_long.numpy(), self._host_int.numpy()
        self._long[2] = self.scratch_slot
        self._int[:largest] = 1
        self._int[largest:] = cache.scratch_block
        self._host, self._dev = host, host.to(device)
        self._dev_long, self._dev_int = self._split(self._dev, largest)
        self.input_ids, self.positions = self._dev_long[0:1], self._dev_long[1:2]  # [1, largest]
        self.slot_mapping = self._dev_long[2]
        self.context_lens = self._dev_int[:largest]
        self.block_tables = self._dev_int[largest:].view(largest, width)
        # A decode step has no prefill rows: their prefix sums are one zero, made here rather than by a fill kernel
        # in every graph.
        self.cu_prefill_lens = torch.zeros(1, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event()  # the last step's copies have read the host buffers
        self.num_replays = 0  # decode steps served from a graph (the benchmarks report it)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        try:
            self._capture_all()
        except BaseException:
            self.release()  # graphs captured before the failure would otherwise outlive it (see release)
            raise

    def _split(self, buffer: torch.Tensor, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The byte buffer's two views: int64 [3, largest] and int32 [largest * (1 + table width)]."""
        return buffer[:self._long_bytes].view(torch.int64).view(3, largest), buffer[self._long_bytes:].view(torch.int32)

    def fits(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.sizes[-1]

    def release(self) -> None:
        """Destroy the graphs (later decode steps run eagerly). A parallel engine must do this before
        its NCCL communicator is destroyed: NCCL's teardown waits until every CUDA graph that captured
        one of its collectives is gone (``commDestroySync`` in NCCL's init.cc; pytorch/pytorch#115388),
        so a live graph makes ``destroy_process_group`` wait forever."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()

    def _forward(self, size: int) -> torch.Tensor:
        step = PagedStep(self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size],
                         self.cu_prefill_lens, [1] * size,
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

    def run(self, ids: list[int] | torch.Tensor, positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """Copy one decode step's inputs into the static buffers, replay, return [batch, vocab] logits.
        ``ids`` on the device (a multi-step pass's, sampled by the pass before) are copied device to
        device, after the host rows: the host never sees them."""
        batch = len(ids)
        size = next(s for s in self.sizes if s >= batch)
        largest, width = self.block_tables.shape
        self._copied.synchronize()  # normally long done: the last step's tokens were read since
        longs, lens, table = self._long, self._int[:largest], self._int[largest:].reshape(largest, width)
        on_device = isinstance(ids, torch.Tensor)
        longs[0, :batch] = 0 if on_device else ids
        longs[1, :batch], longs[2, :batch] = positions, slots
        lens[:batch] = context_lens
        for row, blocks in enumerate(tables):
            table[row, :len(blocks)] = blocks  # columns past a row's length: stale ids, never read
        # Padding rows: token 0 at position 0, one token of context in the scratch block.
        longs[:2, batch:size], longs[2, batch:size], lens[batch:size] = 0, self.scratch_slot, 1
        table[batch:size, 0] = self.cache.scratch_block
        end = self._long_bytes + (largest + size * width) * 4  # through the table's first `size` rows
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        self._copied.record()
        if on_device:
            self.input_ids[0, :batch].copy_(ids)  # after the host rows' copy, in stream order
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:batch]
