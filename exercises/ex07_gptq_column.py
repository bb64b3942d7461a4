# The exercise: replace each `raise NotImplementedError` with your code.
# Generated from exercises/solutions/ex07_gptq_column.py by exercises/make_stubs.py.
"""Exercise 07, part 2: one GPTQ column update — round one input channel, let the others make up for it.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1) quantizes a linear layer's weight W [out, in] one input channel (a column)
at a time so that the layer's *outputs* on calibration inputs X change as little as possible:
minimise ||(W - Q) X^T||^2. Its Hessian, H = 2 X^T X / tokens, says how input channels move together.
When column i is rounded to q, its error ``w_i - q`` can be partly cancelled by nudging the columns
not yet quantized (Optimal Brain Surgeon). GPTQ uses U, the upper Cholesky factor of H^-1, so that
step i needs only row i of U: the error, measured in units of the pivot U[i, i], is spread over the
columns from i on in proportion to that row. Column i itself ends up exactly q, columns before i are
already quantized and stay as they are, and the columns after i absorb the error in proportion to how
their inputs correlate with input i. GPTQ then rounds column i + 1 *as updated*, and so on. (The paper's
Algorithm 1, lines 5-7, has the formula; derive it from the two facts above before you look.)

GPTQ works on blocks of 128 columns (the "lazy batch" trick): ``block`` is W[:, b0:b0 + 128] and
``hinv`` the matching square of U, so here i is a column index inside the block. The errors you
return are collected and applied to the columns after the block in one matrix product.

Check yourself by hand before you run the tests: one output row, a block of two columns,
``block = [[1.0, 2.0]]``, ``hinv = [[2.0, 1.0], [0.0, 4.0]]``, column 0 rounded to ``q = [0.5]``.
What must ``block`` become, and what do you return? (``test_worked_example`` holds the answer.)

Where it lives in minillm: ``minillm/quant/gptq.py``. ``gptq_quantize`` calls the module's
``update_column(block, hinv, i, q)`` for every column, looked up at each call, so you can swap yours in::

    import minillm.quant.gptq as gptq
    from exercises.ex07_gptq_column import update_column   # yours (run from the repo root)

    gptq.update_column = update_column
    llm = LLM(quantization="gptq-int4-g64")                # GPTQ now runs your update

``test_wired_into_minillm`` does that and checks that GPTQ with your update gives exactly minillm's
codes, and that those beat round-to-nearest on held-out inputs.

Test your version (from the repository root)::

    pytest exercises/tests/test_ex07_gptq_column.py --impl=mine
"""

from __future__ import annotations

import torch


def update_column(block: torch.Tensor, hinv: torch.Tensor, i: int, q: torch.Tensor) -> torch.Tensor:
    """Quantize column ``i`` of ``block`` to ``q`` and spread its error over columns i and after.

    Args:
        block: [out, b] float32, updated **in place**: afterwards column i equals ``q`` (up to
            rounding) and columns after i carry the compensation; columns before i are unchanged.
        hinv: [b, b] float32, the block's upper-triangular Cholesky factor of the inverse Hessian.
        i: the column being quantized, 0 <= i < b.
        q: [out] float32, the quantized (already dequantized) values of column i.

    Returns:
        ``err`` [out]: column i's rounding error (before the update) in units of the pivot hinv[i, i].

    Hints:
        - Compute the error from ``block[:, i]`` *before* you change ``block``.
        - ``block[:, i:]`` is a view: an in-place operation on it writes into ``block``.
    """
    raise NotImplementedError("ex07: the scaled error of column i, then one in-place update of columns i and after")
