"""Exercise 07: one GPTQ column update — round one input channel, let the others make up for it.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1) quantizes a linear layer's weight W [out, in] one input channel (a column)
at a time so that the layer's *outputs* on calibration inputs X change as little as possible:
minimise ||(W - Q) X^T||^2. Its Hessian, H = 2 X^T X / tokens, says how input channels move together.
When column i is rounded to q, its error ``w_i - q`` can be partly cancelled by nudging the columns
not yet quantized (Optimal Brain Surgeon). With U the upper Cholesky factor of H^-1 (so only row i of
U is needed at step i), the update is::

    err = (w_i - q) / U[i, i]
    W[:, i:] -= err ⊗ U[i, i:]          (an outer product: err[:, None] * U[i, i:][None, :])

Column i itself becomes exactly q (U[i, i] cancels), columns before i are already quantized and stay
as they are, and the columns after i absorb the error in proportion to how their inputs correlate with
input i. GPTQ then rounds column i + 1 *as updated*, and so on.

GPTQ works on blocks of 128 columns (the "lazy batch" trick): ``block`` is W[:, b0:b0 + 128] and
``hinv`` the matching square of U, so here i is a column index inside the block. The errors you
return are collected and applied to the columns after the block in one matrix product.

Worked example, one output row, a block of two columns::

    block = [[1.0, 2.0]]    hinv = [[2.0, 1.0],     q = [0.5]  (column 0 rounded)
                                    [0.0, 4.0]]
    err = (1.0 - 0.5) / 2.0 = 0.25
    block -> [[1.0 - 0.25 * 2.0,  2.0 - 0.25 * 1.0]] = [[0.5, 1.75]],   return [0.25]

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
        ``err`` [out] = (block[:, i] before the update - q) / hinv[i, i].

    Hints:
        - Compute ``err`` from ``block[:, i]`` *before* you change ``block``.
        - ``block[:, i:]`` is a view: ``block[:, i:] -= ...`` writes into ``block``.
    """
    # BEGIN SOLUTION: err = (w_i - q) / hinv[i, i]; block[:, i:] -= outer(err, hinv[i, i:])
    err = (block[:, i] - q) / hinv[i, i]
    block[:, i:] -= err[:, None] * hinv[i, i:][None, :]
    return err
    # END SOLUTION
