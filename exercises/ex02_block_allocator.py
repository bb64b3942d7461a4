# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex02_block_allocator.py by exercises/make_stubs.py.
"""Exercise 02: the block allocator of a paged KV cache.

A paged KV cache (PagedAttention, Kwon et al., SOSP 2023, the vLLM paper) keeps K and V in one pool of
fixed-size *blocks* of ``block_size`` tokens. Each request owns a *block table*, the list of pool blocks
that hold its tokens in order, and the table grows one block at a time as the request generates. Someone
has to hand out the blocks and take them back: the **block allocator**. It keeps

- a **free list**: the ids of the blocks nobody uses, ready to hand out;
- a **reference count** per block: how many owners it has. Prefix caching lets several requests share
  one block of a common prompt prefix, so a block is free again only when its *last* owner lets go.

Worked example with 4 blocks::

    operation        returns   ref_counts     free blocks
    (new)                      [0, 0, 0, 0]   {0, 1, 2, 3}
    allocate()       0         [1, 0, 0, 0]   {1, 2, 3}      any free id is fine; 0 is just an example
    allocate()       1         [1, 1, 0, 0]   {2, 3}
    share(0)                   [2, 1, 0, 0]   {2, 3}         a second request uses block 0 too
    release(0)                 [1, 1, 0, 0]   {2, 3}         one owner left: still allocated
    release(0)                 [0, 1, 0, 0]   {0, 2, 3}      last owner gone: back on the free list
    release(0)                 ValueError: block 0 is already free (double release)

Where it lives in minillm: ``minillm/kv/paged.py``. ``BlockTables.grow`` calls ``allocate()`` for
each new block of a request, ``BlockTables.free`` calls ``release()`` for each block of a finished,
aborted or preempted request, and the scheduler reads ``num_free`` to decide whom to admit and when to
preempt. The engine keeps its ``BlockTables`` in ``engine.block_tables`` (the scheduler and the runner
hold the very same object), so you can swap in your allocator while the engine is idle::

    from minillm import LLM, SamplingParams
    from exercises.ex02_block_allocator import BlockAllocator   # yours (run from the repo root)

    llm = LLM("tiny", load_format="dummy", batching="continuous", block_size=4, num_kv_blocks=24)
    llm.engine.block_tables.allocator = BlockAllocator(24)      # the engine now pages with your code
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0))

Test your version (from the repository root)::

    pytest exercises/tests/test_ex02_block_allocator.py --impl=mine
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """A free list of block ids ``0 .. num_blocks - 1`` with one reference count per block.

    Attributes (minillm reads them, so keep these names):
        num_blocks: the pool's size, fixed at construction.
        ref_counts: a list of ``num_blocks`` ints; ``ref_counts[b]`` is the number of owners of block
            ``b``, and 0 means block ``b`` is free.

    Every operation should take constant time (the scheduler calls them for every block of every
    request, every step): no scanning of all ``num_blocks`` entries.
    """

    def __init__(self, num_blocks: int):
        """All ``num_blocks`` blocks start free (reference count 0).

        Raises:
            ValueError: if ``num_blocks < 1``; the message names the value.

        Hint: ``collections.deque`` (imported above) pops and appends at either end in constant time.
        A plain ``list`` used as a stack (``append`` / ``pop()``) works too.
        """
        raise NotImplementedError("ex02: validate num_blocks, then self.num_blocks, self.ref_counts and a free list")

    @property
    def num_free(self) -> int:
        """How many blocks are free right now (reference count 0)."""
        raise NotImplementedError("ex02: the length of the free list")

    def allocate(self) -> int:
        """Take one free block and return its id; it now has exactly one owner.

        Raises:
            RuntimeError: if no block is free. (The scheduler checks ``num_free`` first, so in the
                engine this means a scheduler bug, not a full cache.)
        """
        raise NotImplementedError("ex02: raise RuntimeError when the free list is empty, else pop a block, count 1")

    def share(self, block: int) -> None:
        """One more owner of an *allocated* block (prefix caching): its reference count goes up by one.

        Raises:
            ValueError: if ``block`` is free, or not a block id at all (outside ``0 .. num_blocks - 1``);
                the message names the block.
        """
        raise NotImplementedError("ex02: check the id and that the block is allocated, then count one more owner")

    def release(self, block: int) -> None:
        """One owner lets go of ``block``; when the last one does, the block is free again.

        Raises:
            ValueError: if ``block`` is already free (a double release: some request table holds a
                stale id, which would otherwise end with two requests writing the same slots), or not
                a block id at all; the message names the block.
        """
        raise NotImplementedError("ex02: check the id and that the block is allocated, count one owner less, free at 0")

    def _check(self, block: int) -> None:
        """ValueError unless ``block`` is an int in ``0 .. num_blocks - 1``.

        Careful: ``ref_counts[-1]`` is valid Python (the last block), so a negative id would not
        fail on its own.
        """
        raise NotImplementedError("ex02: isinstance int (not bool), 0 <= block < num_blocks, else ValueError naming it")
