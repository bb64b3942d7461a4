# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex01_roofline.py by exercises/make_stubs.py.
"""Exercise 01, the roofline: count a decode step's FLOPs and bytes, and find its time floor on the roofline.

Notebook 01 explains why decode is memory-bound: a decode step reads every weight once, whatever the
batch, but does only 2 FLOPs per weight per sequence. Here you write the counting yourself, for a
Llama-style decoder described by ``ModelConfig`` (``minillm/model/config.py``):

- ``config.num_params``: the parameters (embeddings counted once when tied);
- ``config.num_layers``, ``config.num_heads``, ``config.head_dim``: what attention's work depends on;
- ``config.kv_bytes_per_token(dtype_bytes)``: the bytes of K and V one cached token takes, all layers.

A matmul of a ``[m, k]`` input by a ``[k, n]`` weight is ``2·m·k·n`` FLOPs (one multiply, one add).
Attention of one query over ``t`` keys costs, per head and layer, ``2·t·head_dim`` for the scores and
``2·t·head_dim`` for the weighted sum of values.

Where it lives in minillm: ``minillm/bench/roofline.py`` (``decode_flops``, ``decode_bytes``,
``time_floor``), which notebook 01 and ``minillm bench`` use to draw the roofline. The tests check
your counts against it on real model shapes, and ``test_wired_into_minillm`` swaps yours into
``decode_roofline_tok_s``.

Test your version (from the repository root)::

    .venv/bin/pytest exercises/tests/test_ex01_roofline.py
"""

from __future__ import annotations


def decode_flops(config, batch: int, context: int) -> float:
    """FLOPs of one decode step: ``batch`` sequences, each adding one token that attends to
    ``context`` tokens (its own included).

    Hints:
        - The matmuls: every parameter takes part once per new token.
        - Attention: per layer and query head, the scores and the weighted sum over ``context`` keys.
    """
    raise NotImplementedError("ex01: per sequence, the weights' matmuls plus attention over `context` keys; times the batch")


def decode_bytes(config, dtype_bytes: float, batch: int, context: int) -> float:
    """Bytes one decode step must read at least: every weight once, and the cached K and V of every
    sequence (``dtype_bytes`` per stored value, weights and cache alike).

    Hint: which of the two grows with the batch, and which does not?
    """
    raise NotImplementedError("ex01: the weights once, plus each sequence's cached K and V")


def time_floor(flops: float, nbytes: float, bandwidth_gbs: float, peak_tflops: float) -> float:
    """The least time in seconds a step can take on a device that moves ``bandwidth_gbs`` GB/s and
    computes ``peak_tflops`` TFLOP/s, when memory traffic and compute overlap perfectly.

    Hint: mind the units (GB = 1e9 bytes, TFLOP = 1e12 FLOPs).
    """
    raise NotImplementedError("ex01: the slower of moving the bytes and doing the FLOPs")
