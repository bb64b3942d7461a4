"""PagedAttention's KV cache (Kwon et al., SOSP 2023, the vLLM paper): memory in fixed-size blocks.

The contiguous cache reserves ``max_model_len`` tokens per sequence up front; most of it is never
written. Here K/V live in a shared pool of blocks of ``block_size`` tokens, and each request owns a
*block table*: the list of pool blocks holding its tokens in order, grown one block at a time as it
generates. Token ``p`` of a request lives in slot ``table[p // block_size] * block_size +
p % block_size`` (its *slot mapping*). Waste is at most one partly filled block per request.

Blocks carry reference counts so that several requests can share one (prefix caching; the n sequences
of one prompt); a block returns to the free list when its count drops to zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minillm.attention import additive_mask, masked_attention
from minillm.kv.quant import SCALE_DTYPE, dequantize_kv, kv_layout, quantize_kv
from minillm.model.config import ModelConfig


class BlockAllocator:
    """A free list of block ids with reference counts."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        if not self.free_ids:
            raise RuntimeError("out of KV blocks (the scheduler should have checked num_free)")
        block = self.free_ids.popleft()
        self.ref_counts[block] = 1
        return block

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:  # a negative id would silently index from the end
            raise ValueError(f"block {block} is not a block id (0..{self.num_blocks - 1})")

    def share(self, block: int) -> None:
        """One more owner of an allocated block."""
        self._check(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only allocated blocks can be shared")
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self._check(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free (double release)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids.append(block)


class BlockTables:
    """Each request's block table, grown and freed through one allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self.tables: dict[str, list[int]] = {}
        # Prefix caching: evict(n) frees at least n cached, unused blocks when the free list is short.
        self.evict = None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to allocate so that the request's table covers ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(request_id, ())))

    def grow(self, request_id: str, num_tokens: int) -> None:
        needed = self.extra_blocks_needed(request_id, num_tokens)
        if needed > self.allocator.num_free and self.evict is not None:
            self.evict(needed - self.allocator.num_free)
        table = self.tables.setdefault(request_id, [])
        for _ in range(needed):
            table.append(self.allocator.allocate())

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Start ``child_id``'s table with the first ``num_blocks`` blocks of ``parent_id``'s, shared (their
        reference counts go up): the child reads that K/V and never writes it (``sequence_group.py``)."""
        if child_id in self.tables:
            raise ValueError(f"{child_id!r} has a block table already; a fork starts a new one")
        shared = self.tables[parent_id][:num_blocks]
        for block in shared:
            self.allocator.share(block)
        self.tables[child_id] = list(shared)

    def free(self, request_id: str) -> None:
        for block in self.tables.pop(request_id, ()):
            self.allocator.release(block)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Pool slots of the request's tokens [start, end)."""
        table, bs = self.tables[request_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class PagedKVCache:
    """The block pool: K and V of shape [layers, num_blocks + 1, block_size, kv_heads, head_dim].

    The extra last block (``scratch_block``) is never handed out: padding rows of a CUDA-graph
    batch write their K/V there and read only it, so a graph padded to its captured batch size
    never touches a live request's blocks.

    With a quantized ``kv_cache_dtype`` (``kv/quant.py``) K and V hold int8 / fp8 / packed int4
    values, and ``k_scale`` / ``v_scale`` pools of the same [layers, blocks + 1, block_size,
    kv_heads] leading shape hold their scales: a slot's scales live in the same block as its
    values, so whatever moves or shares a block (swap, prefix cache) moves or shares them too.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 kv_cache_dtype: str = "auto"):
        layout = kv_layout(kv_cache_dtype, config.head_dim, dtype)
        slots = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads)
        # Zeros, not empty: masked-out slots (padding, the tail of a block) are still read by the
        # torch backend, and their softmax weight of 0 times a NaN left in uninitialised memory is NaN.
        self.k = torch.zeros(*slots, layout.width, dtype=layout.dtype, device=device)
        self.v = torch.zeros(*slots, layout.width, dtype=layout.dtype, device=device)
        self.k_scale = self.v_scale = None
        if layout.scale_shape is not None:
            self.k_scale = torch.zeros(*slots, *layout.scale_shape, dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(*slots, *layout.scale_shape, dtype=SCALE_DTYPE, device=device)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype  # dtype: the model's, what attention computes in
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks

    @property
    def pools(self) -> list[torch.Tensor]:
        """Every tensor indexed [layer, block, ...]: K and V, then their scales if quantized."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools)

    def layer(self, layer_idx: int) -> LayerKV:
        scales = (None, None) if self.k_scale is None else (self.k_scale[layer_idx], self.v_scale[layer_idx])
        return LayerKV(self.k[layer_idx], self.v[layer_idx], *scales)


class LayerKV(NamedTuple):
    """One layer's pools, as the attention kernels take them (scales None unless quantized)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@dataclass
class PagedStep:
    """One step's paged-attention metadata: what each new token writes and what it may read.

    The step's tokens are packed into one row: first ``num_decode`` sequences with one new token
    each, then prefill chunks. Sequence i brings ``query_lens[i]`` new tokens and then holds
    ``context_lens[i]`` tokens in total (cached + new); its new tokens sit at the end of that
    context. Device tensors for the kernels, host lists for the torch reference's Python loop.
    """

    slot_mapping: torch.Tensor  # [tokens] int64: the pool slot each new token's K/V go to
    block_tables: torch.Tensor  # [seqs, width] int32, padded with valid ids that are never read
    context_lens: torch.Tensor  # [seqs] int32
    cu_prefill_lens: torch.Tensor  # [prefills + 1] int32: prefix sums of the prefill rows' query_lens
    query_lens: list[int]
    context_lens_host: list[int]
    num_decode: int

    @classmethod
    def from_host(cls, slots: list[int], tables: list[list[int]], query_lens: list[int], context_lens: list[int],
                  device: torch.device, pad_block: int = 0) -> "PagedStep":
        """Build the tensors from Python lists (through ``to_device``)."""
        num_decode = sum(1 for n in query_lens if n == 1)
        width = max(map(len, tables))
        cu = [0]
        for n in query_lens[num_decode:]:
            cu.append(cu[-1] + n)
        padded = [t + [pad_block] * (width - len(t)) for t in tables]
        return cls(to_device(slots, torch.int64, device), to_device(padded, torch.int32, device),
                   to_device(context_lens, torch.int32, device), to_device(cu, torch.int32, device),
                   query_lens, context_lens, num_decode)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) list as a tensor on ``device``. On CUDA through pinned memory with a non-blocking
    copy, so the CPU goes on building the step while the copy runs."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


class PagedBatch:
    """Attention context for one step over a flat batch of sequences (pure torch reference).

    Decodes are batched (each gathers its blocks, masked past its length); prefill chunks run one
    sequence at a time, each attending to its cached context with a causal offset. A quantized
    cache is dequantized as it is gathered, into the model's dtype.
    """

    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step
        n = step.num_decode
        if n:
            longest = max(step.context_lens_host[:n])
            blocks = -(-longest // cache.block_size)
            self.decode_tables = step.block_tables[:n, :blocks]
            key_pos = torch.arange(blocks * cache.block_size, device=cache.k.device)
            allowed = key_pos[None, :] < step.context_lens[:n, None]
            self.decode_mask = additive_mask(allowed, cache.dtype)[:, None, None, :]  # [B, 1, 1, S]

    def _gather(self, pool: torch.Tensor, scale: torch.Tensor | None, tables: torch.Tensor) -> torch.Tensor:
        """[B, blocks] table -> [B, blocks * block_size, kv_heads, head_dim] keys or values."""
        gathered = dequantize_kv(pool[tables], None if scale is None else scale[tables], self.cache.dtype)
        return gathered.flatten(1, 2)

    def __call__(self, layer_idx: int, q, k, v):
        pools = write_kv(self.cache, self.step, layer_idx, k, v)
        outputs = []
        step, n = self.step, self.step.num_decode
        if n:
            keys = self._gather(pools.k, pools.k_scale, self.decode_tables)
            values = self._gather(pools.v, pools.v_scale, self.decode_tables)
            outputs.append(masked_attention(q[0, :n, None], keys, values, self.decode_mask)[:, 0])
        start = n
        for i in range(n, len(step.query_lens)):
            q_len, ctx = step.query_lens[i], step.context_lens_host[i]
            table = step.block_tables[i : i + 1, : -(-ctx // self.cache.block_size)]
            keys = self._gather(pools.k, pools.k_scale, table)[:, :ctx]
            values = self._gather(pools.v, pools.v_scale, table)[:, :ctx]
            # The new tokens are the last q_len of the context: causal with an offset.
            query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]
            mask = additive_mask(allowed, q.dtype)[None, None]
            outputs.append(masked_attention(q[:, start : start + q_len], keys, values, mask)[0])
            start += q_len
        return torch.cat(outputs)[None]


def write_kv(cache: PagedKVCache, step: PagedStep, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
    """Store the new tokens' K/V ([1, tokens, kv_heads, head_dim]) in their slots, quantized if the
    cache is; return the layer's pools. Index_puts, so it can be captured in a CUDA graph."""
    pools = cache.layer(layer_idx)
    heads = pools.k.shape[-2]
    if pools.k_scale is None:
        pools.k.view(-1, heads, pools.k.shape[-1])[step.slot_mapping] = k[0]
        pools.v.view(-1, heads, pools.v.shape[-1])[step.slot_mapping] = v[0]
        return pools
    for new, pool, scale_pool in ((k, pools.k, pools.k_scale), (v, pools.v, pools.v_scale)):
        data, scale = quantize_kv(new[0], cache.kv_cache_dtype)
        pool.flatten(0, 1)[step.slot_mapping] = data
        scale_pool.flatten(0, 1)[step.slot_mapping] = scale
    return pools
