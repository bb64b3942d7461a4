"""Tests for exercise 02, the block allocator: a brute-force model, the error cases, and the real engine.

Run from the repository root: ``pytest exercises/tests/test_ex02_block_allocator.py --impl=mine``.
"""

from __future__ import annotations

import random
import re

import pytest
from drive import run_requests  # exercises/tests is on sys.path (pytest)


def names(block, message: str) -> bool:
    """Does the error message mention this block id (as a whole number, not inside another one)?"""
    return re.search(rf"(?<![\d-]){re.escape(str(block))}(?!\d)", message) is not None


def state(alloc) -> tuple[int, list[int]]:
    return alloc.num_free, list(alloc.ref_counts)


class Model:
    """The brute-force allocator: a reference count per block, and "free" means count 0."""

    def __init__(self, n: int):
        self.counts = [0] * n

    @property
    def free(self) -> set[int]:
        return {b for b, c in enumerate(self.counts) if c == 0}


def test_new_allocator_is_all_free(impl):
    for n in (1, 5, 64):
        alloc = impl.BlockAllocator(n)
        assert alloc.num_blocks == n
        assert alloc.num_free == n
        assert list(alloc.ref_counts) == [0] * n


@pytest.mark.parametrize("n", [0, -3])
def test_no_blocks_is_rejected(impl, n):
    impl.BlockAllocator(1)  # the stub raises NotImplementedError here, before pytest.raises
    with pytest.raises(ValueError) as error:
        impl.BlockAllocator(n)
    assert names(n, str(error.value)), f"the message should name num_blocks={n}: {error.value}"


def test_worked_example(impl):
    alloc = impl.BlockAllocator(4)
    a = alloc.allocate()
    b = alloc.allocate()
    assert a != b and {a, b} <= {0, 1, 2, 3}
    assert alloc.num_free == 2 and alloc.ref_counts[a] == 1 and alloc.ref_counts[b] == 1
    alloc.share(a)
    assert alloc.ref_counts[a] == 2 and alloc.num_free == 2
    alloc.release(a)
    assert alloc.ref_counts[a] == 1 and alloc.num_free == 2, "a shared block stays allocated until its last owner lets go"
    alloc.release(a)
    assert alloc.ref_counts[a] == 0 and alloc.num_free == 3
    with pytest.raises(ValueError) as error:
        alloc.release(a)
    assert names(a, str(error.value)), f"the message should name block {a}: {error.value}"


def test_allocate_hands_out_every_block_once_then_raises(impl):
    alloc = impl.BlockAllocator(10)
    got = [alloc.allocate() for _ in range(10)]
    assert sorted(got) == list(range(10)), f"expected each of the 10 blocks exactly once, got {got}"
    assert alloc.num_free == 0 and list(alloc.ref_counts) == [1] * 10
    with pytest.raises(RuntimeError):
        alloc.allocate()
    assert state(alloc) == (0, [1] * 10), "a failed allocate must not change anything"


def test_free_blocks_are_reused(impl):
    alloc = impl.BlockAllocator(8)
    for _ in range(8):
        alloc.allocate()
    for block in (6, 1, 3):
        alloc.release(block)
    assert alloc.num_free == 3
    again = {alloc.allocate() for _ in range(3)}
    assert again == {1, 3, 6}, f"with only blocks 1, 3, 6 free, allocate must return those, got {again}"
    with pytest.raises(RuntimeError):
        alloc.allocate()
    # A single block, round and round: it must come back every time.
    one = impl.BlockAllocator(1)
    for _ in range(5):
        block = one.allocate()
        assert block == 0 and one.num_free == 0
        one.release(block)
        assert one.num_free == 1


def test_double_release_raises_and_names_the_block(impl):
    alloc = impl.BlockAllocator(6)
    blocks = [alloc.allocate() for _ in range(4)]
    victim = blocks[2]
    alloc.release(victim)
    before = state(alloc)
    with pytest.raises(ValueError) as error:
        alloc.release(victim)
    assert names(victim, str(error.value)), f"the message should name block {victim}: {error.value}"
    assert state(alloc) == before, "a refused release must not change anything"
    # A block that was never allocated is free too.
    never = ({0, 1, 2, 3, 4, 5} - set(blocks)).pop()
    with pytest.raises(ValueError) as error:
        alloc.release(never)
    assert names(never, str(error.value)), f"the message should name block {never}: {error.value}"
    assert state(alloc) == before


def test_sharing_a_free_block_raises_and_names_the_block(impl):
    alloc = impl.BlockAllocator(5)
    block = alloc.allocate()
    alloc.release(block)
    before = state(alloc)
    for free_block in (block, 4 if block != 4 else 3):
        with pytest.raises(ValueError) as error:
            alloc.share(free_block)
        assert names(free_block, str(error.value)), f"the message should name block {free_block}: {error.value}"
        assert state(alloc) == before, "a refused share must not change anything"


def test_shared_block_is_freed_by_its_last_owner_only(impl):
    alloc = impl.BlockAllocator(3)
    block = alloc.allocate()
    for owners in range(2, 6):
        alloc.share(block)
        assert alloc.ref_counts[block] == owners
    for owners in range(4, 0, -1):
        alloc.release(block)
        assert alloc.ref_counts[block] == owners and alloc.num_free == 2
    alloc.release(block)
    assert alloc.num_free == 3 and alloc.ref_counts[block] == 0
    with pytest.raises(ValueError):
        alloc.release(block)


@pytest.mark.parametrize("bad", [-1, -4, 4, 100])
def test_ids_outside_the_pool_are_rejected(impl, bad):
    alloc = impl.BlockAllocator(4)
    for _ in range(4):
        alloc.allocate()  # every real block allocated: ref_counts[-1] would be 1, a valid-looking owner
    before = state(alloc)
    for operation in (alloc.release, alloc.share):
        with pytest.raises(ValueError) as error:
            operation(bad)
        assert names(bad, str(error.value)), f"the message should name block {bad}: {error.value}"
        assert state(alloc) == before, f"{operation.__name__}({bad}) must not change anything"


@pytest.mark.parametrize("num_blocks,seed", [(1, 0), (2, 1), (3, 2), (7, 3), (16, 4), (64, 5), (64, 6)])
def test_random_operations_match_brute_force(impl, num_blocks, seed):
    """Thousands of random allocate / share / release calls, valid and invalid, against the model."""
    rng = random.Random(seed)
    alloc, model = impl.BlockAllocator(num_blocks), Model(num_blocks)
    for step in range(3000):
        where = f"step {step} (num_blocks={num_blocks}, seed={seed})"
        op = rng.choices(["allocate", "share", "release", "release_free", "share_free"], [4, 2, 4, 1, 1])[0]
        owned = [b for b, c in enumerate(model.counts) if c > 0]
        if op == "allocate":
            if model.free:
                block = alloc.allocate()
                assert block in model.free, f"{where}: allocate() returned block {block}, which is not free"
                model.counts[block] = 1
            else:
                with pytest.raises(RuntimeError):
                    alloc.allocate()
        elif op in ("share", "release") and owned:
            block = rng.choice(owned)
            getattr(alloc, op)(block)
            model.counts[block] += 1 if op == "share" else -1
        elif op in ("release_free", "share_free") and model.free:
            block = rng.choice(sorted(model.free))
            with pytest.raises(ValueError) as error:
                getattr(alloc, op.split("_")[0])(block)
            assert names(block, str(error.value)), f"{where}: the message should name block {block}: {error.value}"
        assert alloc.num_free == len(model.free), f"{where} ({op}): num_free {alloc.num_free}, expected {len(model.free)}"
        assert list(alloc.ref_counts) == model.counts, f"{where} ({op}): ref_counts differ from the model"
    # Release everything still owned: the pool must be whole again.
    for block, count in enumerate(model.counts):
        for _ in range(count):
            alloc.release(block)
    assert alloc.num_free == num_blocks and list(alloc.ref_counts) == [0] * num_blocks
    assert sorted(alloc.allocate() for _ in range(num_blocks)) == list(range(num_blocks))


# -- the real engine ---------------------------------------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE = 24, 4
PROMPTS = [[5 + i + 7 * j for j in range(6 + 2 * i)] for i in range(6)]  # 6 .. 16 tokens


def run_engine(llm, prompts, params, max_steps=1000):
    """Drive the engine step by step (a broken allocator could otherwise stall it forever)."""
    return run_requests(llm.engine, prompts, params, max_steps)


def test_wired_into_minillm(impl):
    """Swap the allocator into a live engine: the same greedy tokens as minillm's own, and no leaks."""
    mine = impl.BlockAllocator(NUM_BLOCKS)  # before anything else: the stub raises here
    from minillm import LLM, SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def make_llm():
        return LLM("tiny", load_format="dummy", batching="continuous", block_size=BLOCK_SIZE,
                   num_kv_blocks=NUM_BLOCKS)

    reference_llm = make_llm()
    expected = run_engine(reference_llm, PROMPTS, params)
    assert reference_llm.engine.scheduler.num_preemptions > 0, "the workload should force preemption"

    llm = make_llm()
    engine = llm.engine
    # One BlockTables object is shared by the engine, the scheduler and the runner: swapping its
    # allocator swaps it everywhere.
    assert engine.scheduler.block_tables is engine.block_tables
    assert engine.runner.block_tables is engine.block_tables
    builtin = engine.block_tables.allocator
    engine.block_tables.allocator = mine

    calls = {"allocate": 0, "release": 0}
    for name in calls:
        method = getattr(mine, name)

        def counted(*args, _method=method, _name=name):
            calls[_name] += 1
            return _method(*args)

        setattr(mine, name, counted)

    got = run_engine(llm, PROMPTS, params)
    assert calls["allocate"] > 0 and calls["release"] > 0, f"the engine did not use the swapped-in allocator: {calls}"
    assert builtin.num_free == NUM_BLOCKS and list(builtin.ref_counts) == [0] * NUM_BLOCKS, \
        "minillm's own allocator was used"
    assert engine.scheduler.num_preemptions > 0, "the workload should force preemption"
    assert got == expected, "different greedy tokens from minillm's own allocator"
    assert mine.num_free == NUM_BLOCKS, f"{NUM_BLOCKS - mine.num_free} block(s) still allocated after every request finished"
    assert list(mine.ref_counts) == [0] * NUM_BLOCKS
    assert not engine.block_tables.tables
    assert calls["allocate"] == calls["release"], f"allocations and releases do not balance: {calls}"
