"""Variants of one engine for side-by-side runs: the same weights and KV cache with one part switched.

``minillm bench throughput --variants ...`` runs minillm as configured, then once more after each variant,
applied in the order given, each on top of the ones before: the difference between two runs is the part
switched, not a second engine's memory layout or warm-up.
"""

from __future__ import annotations

import weakref

# minillm itself with one step of the tuning path undone, on the same engine (same weights, same KV
# cache), so each step is measured side by side: no prefix cache, Triton kernels without CUDA
# graphs, and the pure-torch reference backend (eager). prefix_cache_on turns the cache back on after
# prefix_cache_off: on, off, on again, so that neither side of the comparison is the process's first timed run.
VARIANTS = ("prefix_cache_off", "prefix_cache_on", "triton_eager", "torch_eager")

_switched_off = weakref.WeakKeyDictionary()  # engine -> (its prefix cache, its policy), while prefix_cache_off


def use_variant(engine, variant: str) -> None:
    """Switch a continuous engine in place (see VARIANTS); variants apply in the order given, each on
    top of the ones before."""
    from minillm.kv.paged import PagedBatch

    if variant == "prefix_cache_off":
        if engine.prefix_cache is None:
            raise ValueError("variant 'prefix_cache_off' compares against the cache: run with enable_prefix_caching")
        engine.prefix_cache.reset()
        _switched_off[engine] = (engine.prefix_cache, engine.scheduler.policy)
        engine.scheduler.prefix_cache = engine.block_tables.evict = None
        engine.prefix_cache = None
        if engine.scheduler.policy == "lpm":  # nothing cached to order by: arrival order
            engine.scheduler.policy = "fcfs"
        return
    if variant == "prefix_cache_on":
        if engine not in _switched_off:
            raise ValueError("variant 'prefix_cache_on' turns the cache back on: give it after prefix_cache_off")
        cache, engine.scheduler.policy = _switched_off.pop(engine)
        engine.prefix_cache = engine.scheduler.prefix_cache = cache
        engine.block_tables.evict = cache.evict
        return
    engine.runner.graphs = None
    if variant == "torch_eager":
        engine.runner.make_attention = PagedBatch
        engine.model.enable_fused_kernels(False)
    elif engine.attention_backend != "triton":
        raise ValueError(f"variant {variant!r} needs the engine on attention_backend='triton'")
