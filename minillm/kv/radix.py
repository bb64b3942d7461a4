"""A radix tree of cached KV blocks: requests that share a prefix share its KV (RadixAttention).

System prompts, few-shot examples and chat histories repeat across requests. SGLang's RadixAttention
(Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024) keeps the
KV of finished and running requests in a radix tree keyed by token ids, so a new request whose
prompt starts with a cached prefix skips that part of its prefill.

This tree is *block-granular*, as minillm's cache is paged: every edge holds a whole number of
blocks (``block_size`` tokens each) and the ids of the pool blocks that store their K/V. Children are
keyed by their first block's tokens, so two edges out of a node never share a first block and a
lookup compares whole blocks. A partly filled last block is never cached (its K/V are still being
written).

Ownership, with the allocator's reference counts:
- the tree holds one reference to each block it caches;
- a request that uses cached blocks holds one more each, and *locks* the deepest node it uses: the
  lock count of that node and of all its ancestors goes up, so none of them can be evicted while
  the request runs (SGLang's ``lock_ref``);
- an unlocked node is therefore held by the tree alone, and so is its whole subtree. Eviction takes
  unlocked leaves, least recently used first, and gives their blocks back to the allocator.

Eviction runs whenever a request needs a block and the free list is empty, which in a busy server is
most steps: so it must not walk the tree. A heap of *candidates* (a node, with its last access when it
was pushed) gets every node that may have become an evictable leaf (a new node, a node unlocked, a node
whose last child was evicted). Entries are checked when popped: a node no longer an unlocked leaf of the
tree is skipped, and one used since it was pushed goes back in line at its last access; so the popped
leaf is the least recently used one, at O(log n) a leaf instead of O(n) a call.

Statistics count tokens, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` do.
"""

from __future__ import annotations

import heapq
import itertools

from minillm.kv.paged import BlockAllocator


class RadixNode:
    def __init__(self, tokens: tuple[int, ...], blocks: list[int], parent: RadixNode | None):
        self.tokens, self.blocks, self.parent = tokens, blocks, parent
        self.children: dict[tuple[int, ...], RadixNode] = {}  # keyed by the child's first block of tokens
        self.lock_ref = 0  # requests using this node or a node below it
        self.last_access = 0  # the cache's clock at the last match or insert through this node

    def __repr__(self) -> str:
        return f"RadixNode({len(self.tokens)} tokens, blocks {self.blocks}, lock {self.lock_ref})"


class RadixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self.root = RadixNode((), [], None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0  # blocks of unlocked nodes: the allocator can have them back
        self.queries = self.hits = 0  # tokens looked up at admission, tokens found
        self._candidates: list[tuple[int, int, RadixNode]] = []  # (last access when pushed, order, node): a heap
        self._order = itertools.count()  # ties in last access: first pushed, first evicted

    # -- lookups ----------------------------------------------------------------------------------

    def _first_block(self, tokens, start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.block_size])

    def _matching_blocks(self, node: RadixNode, tokens, pos: int) -> int:
        """How many whole blocks of ``node``'s edge equal ``tokens`` from ``pos`` on."""
        bs, matched = self.block_size, 0
        while matched < len(node.blocks):
            start, end = matched * bs, (matched + 1) * bs
            if pos + end > len(tokens) or tuple(tokens[pos + start:pos + end]) != node.tokens[start:end]:
                break
            matched += 1
        return matched

    def match_prefix(self, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        """The longest cached prefix of ``tokens`` in whole blocks: (the node where it ends, its
        blocks from the root on). A match that ends inside an edge splits the edge there, so that
        locking the node protects exactly the blocks matched and the rest stays evictable."""
        node, blocks, _ = self._walk(tokens, now=next(self._clock))
        return node, blocks

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """Tokens of ``tokens``' longest cached prefix (whole blocks), changing nothing: no edge
        split, no access time. The scheduler's longest-prefix-match ordering asks this of every
        waiting request."""
        return self._walk(tokens, now=None)[2]

    def _walk(self, tokens: list[int], now: int | None) -> tuple[RadixNode, list[int], int]:
        """Follow ``tokens`` down the tree, whole blocks at a time: (the deepest node reached, the
        blocks from the root to it, the tokens matched). With a clock value ``now`` (a match that
        will be used) an edge matched only in part is split and every node passed is stamped;
        with None nothing changes, and a part-matched edge only adds its matched tokens."""
        bs, node, blocks, pos = self.block_size, self.root, [], 0
        while len(tokens) - pos >= bs:
            child = node.children.get(self._first_block(tokens, pos))
            if child is None:
                break
            matched = self._matching_blocks(child, tokens, pos)
            pos += matched * bs
            if matched < len(child.blocks):
                if now is None:
                    break
                child = self._split(child, matched)  # the unmatched rest keeps its last access
            if now is not None:
                child.last_access = now
            blocks += child.blocks
            node = child
        return node, blocks, pos

    # -- changes ----------------------------------------------------------------------------------

    def insert(self, tokens: list[int], blocks: list[int]) -> RadixNode:
        """Cache ``blocks`` as the K/V of ``tokens`` (a whole number of blocks, ``len(blocks)`` of
        them). Parts already cached keep their blocks (the caller's duplicates stay the caller's);
        new parts take a tree reference to the caller's blocks. Returns the deepest node of the path."""
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"insert needs whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of {bs}")
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(self._first_block(tokens, pos))
            if child is None:
                new = RadixNode(tuple(tokens[pos:]), list(blocks[pos // bs:]), node)
                new.last_access = now
                node.children[new.tokens[:bs]] = new
                for block in new.blocks:
                    self.allocator.share(block)
                self.num_cached_blocks += len(new.blocks)
                self._add_evictable(new, len(new.blocks))
                return new
            matched = self._matching_blocks(child, tokens, pos)
            pos += matched * bs
            if matched < len(child.blocks):
                child = self._split(child, matched)
            child.last_access = now
            node = child
        return node

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node``'s edge after ``num_blocks`` blocks; returns the new upper node."""
        bs, parent = self.block_size, node.parent
        upper = RadixNode(node.tokens[:num_blocks * bs], node.blocks[:num_blocks], parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access  # node's locks cover upper too
        parent.children[upper.tokens[:bs]] = upper
        node.tokens, node.blocks, node.parent = node.tokens[num_blocks * bs:], node.blocks[num_blocks:], upper
        upper.children[node.tokens[:bs]] = node
        return upper

    def lock(self, node: RadixNode) -> None:
        """A request uses ``node`` (and so its ancestors): none of them may be evicted."""
        while node is not None:
            if node.lock_ref == 0:
                self._add_evictable(node, -len(node.blocks))
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"{node} unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._add_evictable(node, len(node.blocks))
            node = node.parent

    def _add_evictable(self, node: RadixNode, delta: int) -> None:
        """Count ``delta`` more (or fewer) evictable blocks for an unlocked ``node``; one that gains them
        (new, or just unlocked) may be an evictable leaf: a candidate."""
        if node.lock_ref == 0:
            self.num_evictable_blocks += delta
            if delta > 0:
                self._push_candidate(node)

    def _push_candidate(self, node: RadixNode) -> None:
        if len(self._candidates) > 2 * self.num_cached_blocks + 64:  # mostly stale entries: start afresh
            self._candidates = [(n.last_access, next(self._order), n) for n in self._nodes() if self._evictable(n)]
            heapq.heapify(self._candidates)
        heapq.heappush(self._candidates, (node.last_access, next(self._order), node))

    def _evictable(self, node: RadixNode) -> bool:
        """An unlocked leaf still in the tree (an evicted node is no longer its parent's child)."""
        parent = node.parent
        return (not node.children and node.lock_ref == 0 and parent is not None
                and parent.children.get(node.tokens[:self.block_size]) is node)

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks (fewer if too few are unlocked): unlocked leaves,
        least recently used first; a parent left childless and unlocked becomes a candidate."""
        freed = 0
        while freed < num_blocks and self._candidates:
            pushed_at, _, node = heapq.heappop(self._candidates)
            if not self._evictable(node):
                continue
            if pushed_at != node.last_access:  # used since it was pushed: back in line at its last use
                heapq.heappush(self._candidates, (node.last_access, next(self._order), node))
                continue
            for block in node.blocks:
                if self.allocator.ref_counts[block] != 1:
                    raise RuntimeError(f"block {block} of unlocked {node} is held outside the cache")
                self.allocator.release(block)
            freed += len(node.blocks)
            self.num_cached_blocks -= len(node.blocks)
            self.num_evictable_blocks -= len(node.blocks)
            parent = node.parent
            del parent.children[node.tokens[:self.block_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push_candidate(parent)
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())

    def reset(self) -> int:
        """Evict everything unlocked (e.g. between benchmark runs); returns the blocks freed."""
        return self.evict(self.num_evictable_blocks)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
