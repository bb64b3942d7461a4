"""Prefix caching (RadixAttention): the radix tree against a brute-force model, LRU eviction and
locks, and the engine with the cache on giving the same greedy tokens as without it."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.config import EngineConfig
from minillm.kv.paged import BlockAllocator
from minillm.kv.radix import RadixCache
from test_continuous import VOCAB, check_outputs_equal_solo_runs, schedules, tiny_engine

BS = 4


def cached_prefixes(cache: RadixCache) -> dict[tuple, int]:
    """Every cached whole-block prefix -> the block holding its last block of tokens."""
    found, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, block in enumerate(node.blocks):
            found[prefix + node.tokens[:(i + 1) * BS]] = block
        stack += [(child, prefix + node.tokens) for child in node.children.values()]
    return found


def test_radix_tree_against_a_brute_force_model():
    """Random inserts, matches, locks and evictions over prompts that share prefixes. After each
    operation: matches are the longest cached prefix, every block's reference count is the tree's
    one plus its users', evictions take only unlocked prefixes and whole subtrees."""
    rng = random.Random(0)
    allocator = BlockAllocator(200)
    cache = RadixCache(allocator, BS)
    stems = [[rng.randrange(VOCAB) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    holders: list[tuple] = []  # (node, blocks) a simulated request holds and has locked
    for _ in range(300):
        op = rng.random()
        tokens = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.choice([0, 4, 8]))]
        before = cached_prefixes(cache)
        if op < 0.4 and allocator.num_free >= len(tokens) // BS:  # a request computed these blocks
            blocks = [allocator.allocate() for _ in range(len(tokens) // BS)]
            if blocks:
                node = cache.insert(tokens, blocks)
                for block in blocks:
                    allocator.release(block)  # the request ends; the tree keeps what it adopted
                after = cached_prefixes(cache)
                for k in range(1, len(blocks) + 1):  # new prefixes took the request's block
                    prefix = tuple(tokens[:k * BS])
                    assert after[prefix] == before.get(prefix, blocks[k - 1])
        elif op < 0.7:  # match, then hold what matched like an admitted request
            node, blocks = cache.match_prefix(tokens)
            k = len(blocks)
            assert all(before[tuple(tokens[:(i + 1) * BS])] == b for i, b in enumerate(blocks))
            assert k == len(tokens) // BS or tuple(tokens[:(k + 1) * BS]) not in before  # the longest
            if blocks:
                for block in blocks:
                    allocator.share(block)
                cache.lock(node)
                holders.append((node, blocks))
        elif op < 0.85 and holders:  # a holder finishes
            node, blocks = holders.pop(rng.randrange(len(holders)))
            cache.unlock(node)
            for block in blocks:
                allocator.release(block)
        else:
            wanted = rng.randint(1, 6)
            freed = cache.evict(wanted)
            after = cached_prefixes(cache)
            removed = set(before) - set(after)
            assert set(after) <= set(before)
            assert len(removed) == freed
            assert freed >= wanted or cache.num_evictable_blocks == 0
            held = {b for _, blocks in holders for b in blocks}
            assert not {before[p] for p in removed} & held  # nothing in use was evicted
            for prefix in removed:  # whole subtrees: nothing below an evicted prefix survives
                assert not any(p[:len(prefix)] == prefix for p in after)
        # Ownership: the tree's one reference plus one per holder; evictable = cached minus locked.
        users = {}
        for _, blocks in holders:
            for block in blocks:
                users[block] = users.get(block, 0) + 1
        cached = cached_prefixes(cache)
        assert cache.num_cached_blocks == len(cached)
        for block in cached.values():
            assert allocator.ref_counts[block] == 1 + users.get(block, 0)
        locked = {b for node, _ in holders for b in path_blocks(node)}
        assert cache.num_evictable_blocks == len(set(cached.values()) - locked)
        assert allocator.num_free + len(cached) == allocator.num_blocks


def path_blocks(node):
    blocks = []
    while node is not None:
        blocks += node.blocks
        node = node.parent
    return blocks


def test_eviction_is_least_recently_used_and_respects_locks():
    allocator = BlockAllocator(10)
    cache = RadixCache(allocator, BS)
    prompts = {name: [i * 10 + j for j in range(8)] for i, name in enumerate("abc")}
    for name in "abc":
        blocks = [allocator.allocate() for _ in range(2)]
        cache.insert(prompts[name], blocks)
        for block in blocks:
            allocator.release(block)
    node_a, _ = cache.match_prefix(prompts["a"])  # a is now the most recently used
    node_c, _ = cache.match_prefix(prompts["c"])
    cache.lock(node_c)  # c is in use
    assert cache.evict(1) == 2  # a whole leaf: b, the least recently used unlocked one
    assert set(cached_prefixes(cache)) == {tuple(prompts[n][:k]) for n in "ac" for k in (4, 8)}
    assert cache.evict(100) == 2  # a; c is locked
    cache.unlock(node_c)
    assert cache.evict(100) == 2 and allocator.num_free == 10


def test_eviction_takes_the_least_recently_used_leaf_after_random_use():
    """Matches re-stamp whole paths and locks come and go; every single-leaf eviction must still take an
    unlocked leaf of the oldest last access of all (the brute-force answer over the whole tree)."""
    rng = random.Random(1)
    allocator = BlockAllocator(64)
    cache = RadixCache(allocator, BS)
    stems = [[rng.randrange(VOCAB) for _ in range(BS * rng.randint(1, 3))] for _ in range(5)]
    locked = []
    for _ in range(400):
        tokens = rng.choice(stems) + [rng.randrange(4) for _ in range(BS * rng.randint(0, 2))]
        op = rng.random()
        if op < 0.4 and allocator.num_free >= len(tokens) // BS:
            blocks = [allocator.allocate() for _ in range(len(tokens) // BS)]
            cache.insert(tokens, blocks)
            for block in blocks:
                allocator.release(block)
        elif op < 0.6:
            node, _ = cache.match_prefix(tokens)
            if node is not cache.root and rng.random() < 0.5:
                cache.lock(node)
                locked.append(node)
        elif op < 0.75 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            leaves = [n for n in cache._nodes() if not n.children and n.lock_ref == 0]
            oldest = min((n.last_access for n in leaves), default=None)
            before = {id(n): n for n in cache._nodes()}
            freed = cache.evict(1)
            gone = [n for key, n in before.items() if key not in {id(m) for m in cache._nodes()}]
            assert (freed > 0) == (oldest is not None) and len(gone) == (freed > 0)
            if gone:
                assert gone[0].last_access == oldest


def test_eviction_does_not_walk_the_tree():
    """A full pool in the steady state of a server: every new request's blocks come from evicting the
    least recently used leaf. The work per eviction must not grow with the tree (it once visited every
    node, every time)."""
    allocator = BlockAllocator(400)
    cache = RadixCache(allocator, BS)
    visited = [0]
    walk = cache._nodes

    def counted_walk():
        for node in walk():
            visited[0] += 1
            yield node

    cache._nodes = counted_walk
    rng = random.Random(2)
    cycles = 2000
    for _ in range(cycles):
        if allocator.num_free == 0:
            assert cache.evict(1) == 1
        block = allocator.allocate()
        cache.insert([rng.randrange(VOCAB) for _ in range(BS)], [block])
        allocator.release(block)
    assert cache.num_cached_blocks == 400
    assert visited[0] <= 2 * cycles  # whole-tree walks: 400 nodes for each of the 1600 evictions


def test_a_split_edge_keeps_its_blocks_and_locks():
    allocator = BlockAllocator(10)
    cache = RadixCache(allocator, BS)
    long = list(range(12))
    cache.insert(long, [allocator.allocate() for _ in range(3)])
    node, blocks = cache.match_prefix(long)
    cache.lock(node)
    other = long[:4] + [99] * 4  # shares one block, then differs: the edge splits after block 1
    cache.insert(other, [blocks[0], allocator.allocate()])
    assert cache.match_prefix(long)[1] == blocks and cache.match_prefix(other)[1][0] == blocks[0]
    assert cache.num_evictable_blocks == 1  # only the new branch; the locked path stays
    cache.unlock(node)
    assert cache.num_evictable_blocks == 4


def run(engine, prompts, max_tokens=6):
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           request_id=str(i))
    outputs, computed = {}, 0
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        computed += engine.stats[-1].num_tokens
    return outputs, computed


@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_shared_system_prompt_is_computed_once(attention_backend):
    system = list(range(3, 43))  # 40 tokens: 10 blocks of 4; a budget of 42 admits one prompt per step
    prompts = [system + [100 + i, 200 + i] for i in range(5)]
    results = {}
    for on in (False, True):
        engine = tiny_engine(batching="continuous", block_size=BS, num_kv_blocks=60, max_num_batched_tokens=42,
                             enable_prefix_caching=on, attention_backend=attention_backend)
        results[on] = run(engine, prompts)
    assert results[True][0] == results[False][0]
    cache = engine.prefix_cache
    assert cache.hits >= 4 * 40  # the 4 later requests found the whole system prompt
    assert results[True][1] <= results[False][1] - 4 * 40  # and did not compute it again


def test_multi_turn_reuses_the_previous_answer():
    engine = tiny_engine(batching="continuous", block_size=BS, num_kv_blocks=60, enable_prefix_caching=True)
    first, _ = run(engine, [list(range(3, 23))], max_tokens=12)
    follow_up = list(range(3, 23)) + first["0"] + [7, 8, 9]
    engine.add_request(follow_up, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="1")
    hits_before = engine.prefix_cache.hits
    while engine.has_unfinished():
        engine.step()
    # 20 prompt + 11 computed output tokens were cached: 7 whole blocks of 4.
    assert engine.prefix_cache.hits - hits_before == 28


shared_requests = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=10),
              st.integers(1, 10), st.integers(0, 2)),
    min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stems=st.lists(st.lists(st.integers(2, VOCAB - 1), min_size=0, max_size=30), min_size=3, max_size=3),
       picks=shared_requests, block_size=st.sampled_from([1, 2, 4]),
       preemption_mode=st.sampled_from(["recompute", "swap"]),
       **{**schedules, "policy": st.sampled_from(["fcfs", "priority", "lpm"])})
def test_outputs_with_the_prefix_cache_equal_solo_runs(stems, picks, block_size, preemption_mode, token_budget,
                                                       spare_blocks, policy, arrivals, max_num_seqs):
    requests = [(tuple(stems[stem] + suffix), max_tokens, priority) for stem, suffix, max_tokens, priority in picks]
    engine = check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals,
                                           max_num_seqs, enable_prefix_caching=True, preemption_mode=preemption_mode,
                                           swap_space=4 * block_size * 512)  # a few blocks of the tiny model
    event("prefix hits" if engine.prefix_cache.hits else "no hits")
    event("preempted" if engine.scheduler.num_preemptions else "no preemption")


def test_prefix_caching_needs_the_paged_cache():
    with pytest.raises(ValueError, match="enable_prefix_caching needs batching='continuous'"):
        EngineConfig(enable_prefix_caching=True, batching="static")
    with pytest.raises(ValueError, match="True or False"):
        EngineConfig(enable_prefix_caching="yes", batching="continuous")


def test_cached_prefix_len_agrees_with_match_prefix_and_changes_nothing():
    rng = random.Random(3)
    allocator = BlockAllocator(200)
    cache = RadixCache(allocator, 2)
    stems = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    for _ in range(8):
        tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        tokens = tokens[:len(tokens) // 2 * 2]
        cache.insert(tokens, [allocator.allocate() for _ in range(len(tokens) // 2)])
    for _ in range(50):
        query = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        shape_before = sorted((n.tokens, tuple(n.blocks), n.last_access) for n in cache._nodes())
        length = cache.cached_prefix_len(query)
        assert sorted((n.tokens, tuple(n.blocks), n.last_access) for n in cache._nodes()) == shape_before
        assert length == len(cache.match_prefix(query)[1]) * 2


def test_lpm_admits_the_longest_cached_prefix_first():
    system = list(range(3, 43))  # 10 blocks of 4, cached by the first request
    order = {}
    for policy in ("fcfs", "lpm"):
        engine = tiny_engine(batching="continuous", block_size=BS, num_kv_blocks=60, max_num_seqs=1,
                             enable_prefix_caching=True, scheduling_policy=policy)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.add_request(system + [100], params, request_id="warm")
        while engine.has_unfinished():
            engine.step()
        # One sequence at a time: the order of admission is the order of first tokens.
        engine.add_request(list(range(200, 230)), params, request_id="cold")
        engine.add_request(system + [101, 102], params, request_id="hot")
        firsts = []
        while engine.has_unfinished():
            firsts += [o.request_id for o in engine.step() if len(o.outputs[0].token_ids) == 1]
        order[policy] = firsts
    assert order == {"fcfs": ["cold", "hot"], "lpm": ["hot", "cold"]}


def test_lpm_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="lpm.*enable_prefix_caching"):
        EngineConfig(scheduling_policy="lpm", batching="continuous")
