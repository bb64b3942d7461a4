# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex05_radix_cache.py by exercises/make_stubs.py.
"""Exercise 05: the radix tree of a prefix cache, its lookup and its insert.

Requests often start the same way: a system prompt, few-shot examples, the earlier turns of a chat. A
prefix cache keeps the KV blocks of such prefixes after their request ends, so the next request that
starts with them skips that part of its prefill. SGLang's RadixAttention (Zheng et al., 2024) keeps them
in a **radix tree** keyed by token ids; vLLM's automatic prefix caching does the same job with a hash
per block.

minillm's tree (``minillm/kv/radix.py``, class ``RadixCache``) is *block-granular*, because the KV cache
is paged with ``block_size`` tokens per block:

- every node but the root holds an *edge*: ``node.tokens``, a tuple of a whole number of blocks of
  token ids, and ``node.blocks``, the pool blocks holding their K/V (one id per ``block_size`` tokens);
- ``node.children`` maps a child's **first block of tokens** (a tuple of ``block_size`` ids) to the
  child, so two children of one node never start with the same block;
- the tokens of the path from the root to a node are a cached prefix, and the blocks along that path
  are its KV. Only whole blocks are ever cached or matched.

Worked example, ``block_size = 2``. Insert ``[1, 2, 3, 4, 5, 6]`` with blocks ``[10, 11, 12]``, then
``[1, 2, 3, 4, 7, 8]`` with blocks ``[20, 21, 22]``::

    after the first insert          after the second insert: the edge splits after 2 blocks
    root                            root
    └── (1 2 3 4 5 6) [10 11 12]    └── (1 2 3 4) [10 11]
                                        ├── (5 6) [12]
                                        └── (7 8) [22]    new: only block 22 is adopted;
                                                          the caller keeps its 20, 21
    match_prefix([1, 2, 3, 4, 7, 8, 9])  ->  (node (7 8), [10, 11, 22])   the 9 is not a whole block
    match_prefix([5, 6])                 ->  (cache.root, [])              (5 6) is no child of the root
    match_prefix([1, 2, 3, 9])           ->  (node (1 2), [10])            and the tree is now:

    root
    └── (1 2) [10]                       the match ended inside the edge (1 2 3 4):
        └── (3 4) [11]                   it was split after its first block
            ├── (5 6) [12]
            └── (7 8) [22]

Reference counts: the tree holds **one** reference to each block it caches (``allocator.share(block)``
when a block first enters the tree). Blocks of parts that were already cached stay as they are: the tree
keeps its own, and the caller's duplicates remain the caller's to release.

Where it lives in minillm: ``minillm/kv/radix.py``. With ``enable_prefix_caching=True`` the continuous
scheduler calls ``prefix_cache.match_prefix(prompt)`` when it considers a waiting request (the request
then computes only the tokens after the match) and ``prefix_cache.insert(tokens, blocks)`` when a
prompt has been computed, when a request finishes and when one is preempted. Your functions take the
cache as their first argument, so they bind onto the engine's cache like methods::

    import types

from minillm.kv.radix import RadixNode
    from minillm import LLM, SamplingParams
    from exercises.ex05_radix_cache import match_prefix, insert   # yours (run from the repo root)

    llm = LLM("tiny", load_format="dummy", batching="continuous", enable_prefix_caching=True,
              block_size=4, max_num_batched_tokens=48)
    cache = llm.engine.prefix_cache
    cache.match_prefix = types.MethodType(match_prefix, cache)   # the scheduler now looks up with yours
    cache.insert = types.MethodType(insert, cache)               # ... and caches with yours
    system = list(range(3, 43))
    llm.generate([system + [100 + i] for i in range(4)], SamplingParams(max_tokens=4, temperature=0.0))
    print(cache.hit_rate)                                        # > 0: later requests reused the prefix

(``install(cache)`` below does those two assignments.)

Test your version (from the repository root)::

    pytest exercises/tests/test_ex05_radix_cache.py --impl=mine
"""

from __future__ import annotations

import types

from minillm.kv.radix import RadixNode


def match_prefix(cache, tokens: list[int]):
    """The longest cached prefix of ``tokens``, in whole blocks: returns ``(node, blocks)``.

    ``node`` is the tree node where the match ends (``cache.root`` if not even one block matches) and
    ``blocks`` the pool blocks of the matched tokens, in order, from the root on: the path's
    ``node.blocks`` concatenated, so ``len(blocks) * cache.block_size`` tokens matched.

    - Walk from ``cache.root``. At each node, the child to follow is the one keyed by the next
      ``block_size`` tokens: ``cache._first_block(tokens, pos)`` builds that key (a tuple). Stop when
      fewer than ``block_size`` tokens are left, or no child has that key.
    - Along a child's edge, compare block by block (``child.tokens[i * bs:(i + 1) * bs]`` against the
      next ``bs`` tokens) and count the whole blocks that match.
    - If the match ends *inside* the edge (fewer blocks matched than ``len(child.blocks)``), split the
      edge there: ``cache._split(child, matched)`` cuts it after ``matched`` blocks and returns the new
      upper node, which holds exactly the matched blocks. Return that node, so that locking it (the
      scheduler does, for the request that uses the match) protects only what is used, and the
      unmatched rest stays evictable.
    - Eviction is least recently used first, by ``node.last_access``: take one stamp
      ``now = next(cache._clock)`` per call and set ``last_access = now`` on every node you pass
      through (not on the unmatched lower part of a split edge: it was not used).

    Do not change any reference count or lock here; the caller does that for what it uses.
    """
    raise NotImplementedError("ex05: walk down by first-block keys, count matching blocks per edge, split a partial edge")


def insert(cache, tokens: list[int], blocks: list[int]):
    """Cache ``blocks`` as the K/V of ``tokens``; returns the deepest node of the path (the node whose
    edge ends at ``len(tokens)``).

    ``tokens`` is a whole number of blocks: ``len(tokens) == len(blocks) * cache.block_size``, else
    raise ``ValueError`` (naming both lengths) before changing anything.

    - Walk down as in ``match_prefix`` (the same first-block keys, the same block-by-block comparison,
      the same split of an edge where the tokens part from it, the same ``last_access`` stamp).
      Parts already cached keep the tree's blocks: ignore the caller's blocks for them.
    - When no child matches the next block, the rest of ``tokens`` is new: make one node for it,
      ``RadixNode(tuple(tokens[pos:]), list(blocks[pos // bs:]), parent)`` (imported above; set its
      ``last_access``), and hang it under its parent keyed by its first block.
    - The tree takes one reference to each block it adopts: ``cache.allocator.share(block)``. Count
      them in ``cache.num_cached_blocks``, and tell the eviction bookkeeping with
      ``cache._add_evictable(new_node, len(new_node.blocks))`` (it counts them as evictable unless the
      node is locked; a new node never is).
    - If every block was already cached, nothing is adopted: return the node where the tokens end
      (after a split if they end inside an edge).
    """
    raise NotImplementedError("ex05: check whole blocks, walk and split like match_prefix, hang the new rest, share its blocks")


def install(cache) -> None:
    """Bind your ``match_prefix`` and ``insert`` onto a live ``RadixCache`` (e.g. ``llm.engine.prefix_cache``):
    the scheduler calls ``cache.match_prefix(...)`` and ``cache.insert(...)``, so from now on it uses yours."""
    cache.match_prefix = types.MethodType(match_prefix, cache)
    cache.insert = types.MethodType(insert, cache)
