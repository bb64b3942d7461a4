"""Tests for exercise 05, the radix tree's match_prefix and insert: hand-built trees with known answers,
edge splits, whole blocks only, reference counts and eviction bookkeeping, random operations against
minillm's own RadixCache, and the real engine with your functions plugged in.

Run from the repository root: ``pytest exercises/tests/test_ex05_radix_cache.py --impl=mine``.
"""

from __future__ import annotations

import random
import types

import pytest

from minillm.kv.paged import BlockAllocator
from minillm.kv.radix import RadixCache
from drive import run_requests  # exercises/tests is on sys.path (pytest)


def fresh(impl, block_size=2, num_blocks=64, allocated=True):
    """A RadixCache whose match_prefix / insert are the ones under test. With ``allocated`` every block
    is already allocated once (the caller's reference), so a block the tree adopts has reference count 2."""
    allocator = BlockAllocator(num_blocks)
    for _ in range(num_blocks if allocated else 0):
        allocator.allocate()
    cache = RadixCache(allocator, block_size)
    cache.match_prefix = types.MethodType(impl.match_prefix, cache)
    cache.insert = types.MethodType(impl.insert, cache)
    return cache


def tree(cache) -> list[str]:
    """The tree as sorted lines 'path tokens | edge tokens | blocks', one per node."""
    lines, stack = [], [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for key, child in node.children.items():
            assert child.parent is node, f"{child} does not point back to its parent"
            assert key == child.tokens[:cache.block_size], f"{child} is keyed by {key}, not its first block"
            assert len(child.tokens) == len(child.blocks) * cache.block_size and child.blocks, \
                f"{child}: an edge holds a whole, non-zero number of blocks"
            lines.append(f"{prefix} | {child.tokens} | {child.blocks}")
            stack.append((child, prefix + child.tokens))
    return sorted(lines)


def refs(cache, blocks) -> list[int]:
    return [cache.allocator.ref_counts[b] for b in blocks]


def let_go(cache, blocks) -> None:
    """The caller's request finishes: it releases its reference; the tree keeps what it adopted.
    (Eviction gives a block back to the allocator, so it insists the tree is the block's last owner.)"""
    for block in blocks:
        cache.allocator.release(block)


def test_worked_example(impl):
    """The docstring's example, block_size 2."""
    cache = fresh(impl)
    first = cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert tree(cache) == ["() | (1, 2, 3, 4, 5, 6) | [10, 11, 12]"]
    assert first.tokens == (1, 2, 3, 4, 5, 6) and first.parent is cache.root
    second = cache.insert([1, 2, 3, 4, 7, 8], [20, 21, 22])
    assert tree(cache) == ["() | (1, 2, 3, 4) | [10, 11]",
                           "(1, 2, 3, 4) | (5, 6) | [12]",
                           "(1, 2, 3, 4) | (7, 8) | [22]"]
    assert second.tokens == (7, 8) and second.blocks == [22]
    node, blocks = cache.match_prefix([1, 2, 3, 4, 7, 8, 9])
    assert node is second and blocks == [10, 11, 22]
    assert cache.match_prefix([5, 6]) == (cache.root, [])
    node, blocks = cache.match_prefix([1, 2, 3, 9])
    assert blocks == [10] and node.tokens == (1, 2) and node.blocks == [10] and node.parent is cache.root
    assert tree(cache) == ["() | (1, 2) | [10]",
                           "(1, 2) | (3, 4) | [11]",
                           "(1, 2, 3, 4) | (5, 6) | [12]",
                           "(1, 2, 3, 4) | (7, 8) | [22]"]
    # The tree took one reference to each block it adopted, and none to the caller's duplicates.
    assert refs(cache, [10, 11, 12, 22]) == [2, 2, 2, 2]
    assert refs(cache, [20, 21]) == [1, 1]
    assert cache.num_cached_blocks == 4 and cache.num_evictable_blocks == 4


def test_empty_tree_and_short_lookups(impl):
    cache = fresh(impl, block_size=4)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == (cache.root, [])
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [3, 4])
    assert cache.match_prefix([]) == (cache.root, [])
    assert cache.match_prefix([1, 2, 3]) == (cache.root, []), "three tokens are not a whole block of 4"
    assert cache.match_prefix([1, 2, 3, 5]) == (cache.root, []), "the first block differs in its last token"
    assert cache.match_prefix([9, 1, 2, 3, 4]) == (cache.root, []), "a match starts at the first token"
    assert tree(cache) == ["() | (1, 2, 3, 4, 5, 6, 7, 8) | [3, 4]"], "a lookup that matches nothing changes nothing"


def test_whole_blocks_only(impl):
    cache = fresh(impl, block_size=4)
    leaf = cache.insert(list(range(12)), [0, 1, 2])
    assert cache.match_prefix(list(range(12))) == (leaf, [0, 1, 2])
    assert cache.match_prefix(list(range(15))) == (leaf, [0, 1, 2]), "tokens past the cached ones do not match"
    node, blocks = cache.match_prefix(list(range(11)))  # the third block is incomplete: two blocks match
    assert blocks == [0, 1] and node.tokens == tuple(range(8))
    node, blocks = cache.match_prefix(list(range(7)) + [99] + list(range(8, 12)))  # differs inside block 2
    assert blocks == [0] and node.tokens == tuple(range(4))
    assert tree(cache) == ["() | (0, 1, 2, 3) | [0]",
                           "(0, 1, 2, 3) | (4, 5, 6, 7) | [1]",
                           "(0, 1, 2, 3, 4, 5, 6, 7) | (8, 9, 10, 11) | [2]"]


def test_match_splits_so_a_lock_covers_only_the_match(impl):
    cache = fresh(impl, block_size=2)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8])
    let_go(cache, [5, 6, 7, 8])
    last_before = cache.root.children[(1, 2)].last_access
    node, blocks = cache.match_prefix([1, 2, 3, 4, 0, 0])
    assert blocks == [5, 6] and node.tokens == (1, 2, 3, 4) and node.parent is cache.root
    (rest,) = node.children.values()
    assert rest.tokens == (5, 6, 7, 8) and rest.blocks == [7, 8]
    assert node.last_access > last_before, "a match stamps the nodes it used (LRU)"
    assert rest.last_access == last_before, "the unmatched lower part was not used: keep its stamp"
    cache.lock(node)  # what the scheduler does for the request that uses the match
    assert cache.num_evictable_blocks == 2, "only the unmatched part may be evicted"
    assert cache.evict(10) == 2 and tree(cache) == ["() | (1, 2, 3, 4) | [5, 6]"]
    assert refs(cache, [5, 6, 7, 8]) == [1, 1, 0, 0], "evicted blocks go back to the allocator"
    cache.unlock(node)
    assert cache.num_evictable_blocks == 2


def test_match_changes_no_reference_counts(impl):
    cache = fresh(impl, block_size=2)
    cache.insert([1, 2, 3, 4], [0, 1])
    counts = list(cache.allocator.ref_counts)
    for tokens in ([1, 2, 3, 4], [1, 2], [1, 2, 9, 9], [7, 7]):
        cache.match_prefix(tokens)
    assert list(cache.allocator.ref_counts) == counts
    assert cache.num_cached_blocks == 2 and cache.num_evictable_blocks == 2


def test_insert_adopts_only_new_blocks(impl):
    cache = fresh(impl, block_size=2)
    a = cache.insert([1, 2, 3, 4], [0, 1])
    assert refs(cache, [0, 1]) == [2, 2] and cache.num_cached_blocks == 2
    again = cache.insert([1, 2, 3, 4], [2, 3])  # the same tokens from another request's blocks
    assert again is a, "all cached already: return the node where the tokens end"
    assert refs(cache, [0, 1, 2, 3]) == [2, 2, 1, 1], "the duplicates stay the caller's"
    longer = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 5])  # extends a: adopts blocks 4, 5
    assert longer.parent is a and longer.tokens == (5, 6, 7, 8) and longer.blocks == [4, 5]
    assert refs(cache, [2, 3, 4, 5]) == [1, 1, 2, 2]
    assert cache.num_cached_blocks == 4 and cache.num_evictable_blocks == 4
    inner = cache.insert([1, 2, 3, 4, 5, 6], [9, 9, 9])  # ends inside longer's edge: split, adopt nothing
    assert inner.tokens == (5, 6) and inner.blocks == [4] and inner.parent is a
    assert refs(cache, [9]) == [1] and cache.num_cached_blocks == 4
    assert tree(cache) == ["() | (1, 2, 3, 4) | [0, 1]",
                           "(1, 2, 3, 4) | (5, 6) | [4]",
                           "(1, 2, 3, 4, 5, 6) | (7, 8) | [5]"]


def test_insert_rejects_partial_blocks(impl):
    cache = fresh(impl, block_size=4)
    cache.insert([1, 2, 3, 4], [0])
    before = (tree(cache), list(cache.allocator.ref_counts), cache.num_cached_blocks)
    for tokens, blocks in (([1, 2, 3, 4, 5], [0, 1]), ([5, 6, 7, 8, 9], [1]), ([5, 6, 7, 8], [1, 2])):
        with pytest.raises(ValueError) as error:
            cache.insert(tokens, blocks)
        assert str(len(tokens)) in str(error.value) and str(len(blocks)) in str(error.value), \
            f"the message should name both lengths: {error.value}"
        assert (tree(cache), list(cache.allocator.ref_counts), cache.num_cached_blocks) == before, \
            "a refused insert must change nothing"


def test_new_blocks_below_a_locked_node_are_evictable(impl):
    cache = fresh(impl, block_size=2)
    base = cache.insert([1, 2, 3, 4], [0, 1])
    let_go(cache, [0, 1])
    cache.lock(base)  # a running request uses it
    assert cache.num_evictable_blocks == 0
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])  # that request's next block
    let_go(cache, [2])
    assert cache.num_evictable_blocks == 1 and cache.num_cached_blocks == 3
    assert cache.evict(5) == 1 and tree(cache) == ["() | (1, 2, 3, 4) | [0, 1]"]
    cache.unlock(base)
    assert cache.num_evictable_blocks == 2


def test_recency_decides_what_is_evicted(impl):
    cache = fresh(impl, block_size=2)
    for i, name in enumerate("abc"):
        cache.insert([10 * (i + 1), 1, 2, 3], [2 * i, 2 * i + 1])
    let_go(cache, range(8))
    cache.match_prefix([10, 1, 2, 3])  # a is now more recent than b and c: c is the least recently used
    cache.insert([20, 1, 2, 3], [40, 41])  # b is now more recent than c (an insert uses the path too)
    assert cache.evict(1) == 2 and [line.split(" | ")[1] for line in tree(cache)] == ["(10, 1, 2, 3)", "(20, 1, 2, 3)"]
    assert cache.evict(1) == 2 and [line.split(" | ")[1] for line in tree(cache)] == ["(20, 1, 2, 3)"], \
        "a was matched before b was inserted: a is the older one now"


@pytest.mark.parametrize("block_size,seed", [(1, 0), (2, 1), (4, 2), (4, 3)])
def test_random_operations_match_minillm(impl, block_size, seed):
    """Random inserts, matches, locks and evictions on prompts that share stems, side by side with
    minillm's own RadixCache: the same answers, trees, reference counts and bookkeeping throughout."""
    rng = random.Random(seed)
    mine, ref = fresh(impl, block_size, 400, allocated=False), fresh(impl, block_size, 400, allocated=False)
    del ref.match_prefix, ref.insert  # back to the class's own methods
    stems = [[rng.randrange(1, 30) for _ in range(block_size * rng.randint(1, 4))] for _ in range(4)]
    held = []  # nodes locked in both, pairwise
    for step in range(250):
        where = f"step {step} (block_size={block_size}, seed={seed})"
        tokens = rng.choice(stems)[:block_size * rng.randint(0, 4)] + \
            [rng.randrange(3) for _ in range(rng.randint(0, 3 * block_size))]
        op = rng.random()
        if op < 0.45:
            n = len(tokens) // block_size
            tokens = tokens[:n * block_size]
            if n and mine.allocator.num_free >= n:  # a request computed these blocks, then finishes
                blocks = [mine.allocator.allocate() for _ in range(n)]
                assert [ref.allocator.allocate() for _ in range(n)] == blocks
                got, want = mine.insert(tokens, blocks), ref.insert(tokens, blocks)
                let_go(mine, blocks), let_go(ref, blocks)
                assert (got.tokens, got.blocks) == (want.tokens, want.blocks), f"{where}: insert returned {got}, expected {want}"
        elif op < 0.8:
            (got, got_blocks), (want, want_blocks) = mine.match_prefix(tokens), ref.match_prefix(tokens)
            assert got_blocks == want_blocks, f"{where}: match_prefix({tokens}) gave blocks {got_blocks}, expected {want_blocks}"
            assert (got.tokens, got.blocks) == (want.tokens, want.blocks), f"{where}: match ended at {got}, expected {want}"
            if want_blocks and rng.random() < 0.5:
                mine.lock(got), ref.lock(want)
                held.append((got, want))
        elif op < 0.9 and held:
            got, want = held.pop(rng.randrange(len(held)))
            mine.unlock(got), ref.unlock(want)
        else:
            wanted = rng.randint(1, 5)
            assert mine.evict(wanted) == ref.evict(wanted), f"{where}: evicted a different number of blocks"
        assert tree(mine) == tree(ref), f"{where}: the trees differ"
        assert list(mine.allocator.ref_counts) == list(ref.allocator.ref_counts), f"{where}: reference counts differ"
        assert (mine.num_cached_blocks, mine.num_evictable_blocks) == (ref.num_cached_blocks, ref.num_evictable_blocks), \
            f"{where}: num_cached_blocks / num_evictable_blocks differ"


# -- the real engine ---------------------------------------------------------------------------------------

BLOCK_SIZE = 4
SYSTEM = list(range(3, 43))  # 40 tokens: 10 blocks
PROMPTS = [SYSTEM + [100 + i, 200 + i, 7 * i + 5] for i in range(5)] + [SYSTEM[:20] + [250, 251, 252]]


def make_engine(num_kv_blocks):
    from minillm.config import EngineConfig
    from minillm.engine import Engine

    # A token budget of 48 admits one prompt per step, so the later ones find the first one's prefix.
    engine = Engine(EngineConfig(model="tiny", load_format="dummy", dtype="float32", device="cpu",
                                 batching="continuous", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                                 max_num_batched_tokens=48, enable_prefix_caching=True))
    engine.model.lm_head.weight.mul_(30)  # decisive argmaxes: equal tokens test the cache, not rounding
    return engine


def run_engine(engine, max_steps=1000):
    """Run PROMPTS step by step (a broken tree could stall the engine); returns the greedy tokens and
    the blocks evicted from the prefix cache to make room."""
    from minillm import SamplingParams

    evicted, evict = [0], engine.block_tables.evict

    def counted_evict(num_blocks):
        freed = evict(num_blocks)
        evicted[0] += freed
        return freed

    engine.block_tables.evict = counted_evict

    outputs = run_requests(engine, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), max_steps)
    return outputs, evicted[0]


@pytest.mark.parametrize("num_kv_blocks", [80, 24])  # roomy, and tight enough that the cache must evict
def test_wired_into_minillm(impl, num_kv_blocks):
    """Plug your functions into a live engine's prefix cache: the same greedy tokens, hits and final
    state as minillm's own tree."""
    impl.match_prefix(RadixCache(BlockAllocator(1), BLOCK_SIZE), [1, 2, 3, 4])  # the stub raises here

    reference = make_engine(num_kv_blocks)
    expected, expected_evicted = run_engine(reference)
    assert reference.prefix_cache.hits > 0
    assert (expected_evicted > 0) == (num_kv_blocks == 24), "the small cache should have to evict, the big one not"

    engine = make_engine(num_kv_blocks)
    cache = engine.prefix_cache
    assert engine.scheduler.prefix_cache is cache and engine.block_tables.evict == cache.evict
    calls = {"match_prefix": 0, "insert": 0}

    def counted(name):
        function = getattr(impl, name)

        def wrapper(self, *args):
            calls[name] += 1
            return function(self, *args)
        return wrapper

    for name in calls:  # what impl.install(cache) does, with a call counter around each
        setattr(cache, name, types.MethodType(counted(name), cache))
    got, evicted = run_engine(engine)
    assert calls["match_prefix"] > 0 and calls["insert"] > 0, f"the engine did not call the plugged-in functions: {calls}"
    assert got == expected, "different greedy tokens from minillm's own prefix cache"
    assert cache.hits == reference.prefix_cache.hits > 0, \
        f"{cache.hits} prefix-cache hits (tokens), minillm's own tree found {reference.prefix_cache.hits}"
    assert evicted == expected_evicted, f"{evicted} blocks evicted, {expected_evicted} with minillm's own tree"
    assert tree(cache) == tree(reference.prefix_cache), "the trees differ after the run"
    assert cache.num_evictable_blocks == cache.num_cached_blocks, "every request finished: nothing is locked"
    cached = cache.num_cached_blocks
    assert cache.reset() == cached and cache.num_cached_blocks == 0
    assert engine.block_tables.allocator.num_free == num_kv_blocks, "blocks leaked after evicting everything"


def test_install_binds_onto_a_cache(impl):
    cache = RadixCache(BlockAllocator(8), 2)
    impl.install(cache)
    block = cache.allocator.allocate()
    node = cache.insert([1, 2], [block])  # the stub's insert raises here
    assert cache.match_prefix([1, 2, 3]) == (node, [block])
    assert cache.allocator.ref_counts[block] == 2
