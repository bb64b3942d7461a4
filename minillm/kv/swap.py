"""Swap space: a pool of KV blocks in CPU memory for preempted requests (vLLM's ``swap_space``).

When the paged cache runs out of blocks the scheduler preempts a request. By default it recomputes:
the request's blocks are freed and, when it is readmitted, its whole context (prompt + the tokens
it generated) is prefilled again. With ``preemption_mode="swap"`` its blocks are copied to this CPU
pool instead, and readmission copies them back, so it continues decoding where it stopped without
recomputing anything. The trade-off: swapping moves ``2 * layers * context * kv_heads * head_dim``
elements over PCIe twice, recomputing costs a prefill of the context (FLOPs, and a share of the
step's token budget). Long contexts on a fast link favour swap; short ones, and chunked prefill
with spare compute, favour recompute (vLLM's V1 engine only recomputes).

Who does what: the scheduler decides (it allocates and frees CPU block ids through its own
``BlockTables`` over a CPU ``BlockAllocator``, and records each copy on the step's
``ScheduledBatch``); ``KVSwapper``, which owns the CPU tensors, carries out the copies, called by the
engine before the step's forward pass. The attention backends only ever read the GPU pool.
"""

from __future__ import annotations

import torch

from minillm.kv.paged import PagedKVCache


def block_bytes(cache: PagedKVCache) -> int:
    """Bytes of one block across all layers, K and V (and their scales, if quantized)."""
    return sum(pool[:, 0].nbytes for pool in cache.pools)


def swap_blocks_that_fit(swap_space: int, cache: PagedKVCache) -> int:
    """How many KV blocks ``swap_space`` bytes of CPU memory hold; a clear error if not even one."""
    size = block_bytes(cache)
    if swap_space < size:
        raise ValueError(f"swap_space of {swap_space:,} bytes holds no KV block (one block of {cache.block_size} "
                         f"tokens needs {size:,} bytes); raise swap_space or use preemption_mode='recompute'")
    return swap_space // size


class KVSwapper:
    """The CPU block pool (same layout as the GPU pool, without its scratch block) and the copies
    between the two. Pinned memory when the GPU pool is on CUDA, as vLLM does: page-locked memory
    is what the GPU's copy engine reads and writes directly.

    ``pools`` mirror the cache's: K and V, then their scales if the cache is quantized, so a block's
    scales leave and come back with its values."""

    def __init__(self, cache: PagedKVCache, num_blocks: int):
        self.cache, self.num_blocks = cache, num_blocks
        pin = cache.k.device.type == "cuda"
        # Empty, not zeros: a CPU block is always written (swap out) before it is read (swap in).
        self.pools = [torch.empty((pool.shape[0], num_blocks, *pool.shape[2:]), dtype=pool.dtype, pin_memory=pin)
                      for pool in cache.pools]

    @property
    def k(self) -> torch.Tensor:
        return self.pools[0]

    @property
    def v(self) -> torch.Tensor:
        return self.pools[1]

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools)

    @torch.inference_mode()
    def run(self, ops: list[tuple[str, list[int], list[int]]]) -> None:
        """Carry out ``(direction, source blocks, destination blocks)`` copies in the order given:
        "out" copies GPU blocks to CPU blocks, "in" CPU blocks to GPU blocks. The order matters: a
        GPU block freed by a swap out may be the destination of a swap in decided later in the step."""
        for direction, src, dst in ops:
            if direction == "out":
                pools = zip(self.cache.pools, self.pools)
            elif direction == "in":
                pools = zip(self.pools, self.cache.pools)
            else:
                raise ValueError(f"swap direction {direction!r} is neither 'out' nor 'in'")
            for source, dest in pools:
                # One gather on the source device, one transfer, one scatter: all layers at once.
                src_idx = torch.tensor(src, device=source.device)
                dest[:, torch.tensor(dst, device=dest.device)] = source[:, src_idx].to(dest.device)
