"""How much KV cache fits: memory budget minus weights minus a workspace, divided into units
(whole sequences for the contiguous cache, blocks for the paged one)."""

from __future__ import annotations


def workspace_bytes(weight_bytes: int) -> int:
    """Memory kept back for activations, logits and the allocator's slack: a rule of thumb (a tenth
    of the weights, at least 256 MiB), not a measurement."""
    return max(256 * 2**20, weight_bytes // 10)


def units_that_fit(budget: int, weight_bytes: int, unit_bytes: int, unit: str) -> int:
    """How many KV units of ``unit_bytes`` fit in ``budget``; a clear error if not even one does."""
    kv_budget = budget - weight_bytes - workspace_bytes(weight_bytes)
    fit = kv_budget // unit_bytes
    if fit < 1:
        raise ValueError(
            f"memory budget of {budget:,} bytes ({budget / 1e9:.2f} GB) leaves {max(kv_budget, 0) / 1e9:.2f} GB "
            f"for the KV cache after {weight_bytes / 1e9:.2f} GB of weights and "
            f"{workspace_bytes(weight_bytes) / 1e9:.2f} GB of workspace, but one {unit} needs "
            f"{unit_bytes / 1e9:.4f} GB; raise the budget or lower max_model_len"
        )
    return fit
