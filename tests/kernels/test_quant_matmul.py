"""W4A16 / W8A16 matmul kernels against their torch references, the references against a
dequantization written here from the layout's definition, and the INT4 packing helpers.
Under TRITON_INTERPRET=1 on CPU (tests/conftest.py): small shapes, fp32 and fp16 (bf16 on a GPU; the
HFMA2 GEMV, whose helpers round to bf16 themselves, in bf16 on the CPU too)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from minillm.kernels import quant_matmul, quant_matmul_configs, split_k
from minillm.kernels.w4_pairs import dequant_tile_pairs
from minillm.kernels.quant_matmul import (pack_int4, pack_int4_along_n, unpack_int4, unpack_int4_along_n,
                                          w4a16_matmul, w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# Relative to the largest |y|: the GEMV keeps the weight in fp32 where the reference rounds it to
# x's dtype, so 16-bit results may differ in their last bit or two.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def int4_problem(m: int, k: int, n: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    """Random x, 4-bit weights, zero points and scales, packed: (x, qweight, scales, zeros, q, z)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // (k if group_size == -1 else group_size))
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (groups, n), generator=g)
    scales = torch.rand(groups, n, generator=g) * 0.09 + 0.01
    x = torch.randn(m, k, generator=g)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), pack_int4(q).to(**to), scales.to(dtype=dtype, **to),
            pack_int4_along_n(z).to(**to), q, z)


def int8_problem(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.02 + 0.001
    x = torch.randn(m, k, generator=g)
    return x.to(dtype=dtype, device=DEVICE), q.to(DEVICE), scales.to(dtype=dtype, device=DEVICE)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all(), "the kernel left poisoned (NaN) outputs"
    torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=TOL[dtype] * ref.float().abs().max().item())


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_replays_in_a_graph(run, x, qweight, scales, zeros, group) -> None:
    """``run()`` (a GEMV of row x into its ``out``, which it returns) captured in a CUDA graph, then replayed on three
    new rows of x, each answer against ``w4a16_matmul_ref``."""
    run()  # (compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in range(3):
        x.copy_(int4_problem(1, x.shape[1], 8, group, x.dtype, seed=40 + seed)[0])
        out.fill_(float("nan"))
        graph.replay()
        assert_matches(out, w4a16_matmul_ref(x, qweight, scales, zeros, group), x.dtype)


def counters_are_clean() -> bool:
    """Split-K launches must leave their arrival counters at zero, or the next launch (or graph replay) breaks."""
    return all(int(c.abs().sum()) == 0 for c in split_k.COUNTERS.values())


# ----------------------------------------------------------------------------- packing


def test_pack_int4_puts_value_j_of_eight_in_bits_4j():
    q = torch.randint(0, 16, (24, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5)
    for i in range(3):
        for col in range(5):
            expected = sum(int(q[8 * i + j, col]) << (4 * j) for j in range(8))
            assert int(packed[i, col]) & 0xFFFFFFFF == expected
    assert torch.equal(unpack_int4(packed), q.to(torch.int32))


def test_zeros_pack_along_n_and_round_trip():
    z = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(2))
    packed = pack_int4_along_n(z)
    assert packed.shape == (3, 2)
    for group in range(3):
        for c in range(2):
            expected = sum(int(z[group, 8 * c + j]) << (4 * j) for j in range(8))
            assert int(packed[group, c]) & 0xFFFFFFFF == expected
    assert torch.equal(unpack_int4_along_n(packed), z.to(torch.int32))


@pytest.mark.parametrize("bad, message", [(torch.full((8, 2), 16), "0..15"), (torch.zeros(12, 2, dtype=torch.long), "multiple of 8"),
                                          (torch.zeros(8, 2), "integer dtype")])
def test_pack_int4_refuses_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        pack_int4(bad)


# ----------------------------------------------------------------------------- the references


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k, group_size", [(576, 128), (64, -1), (96, 32)])
def test_w4a16_reference_is_dequantize_then_matmul(dtype, k, group_size):
    """Written from the layout's definition, element by element, in float64."""
    x, qweight, scales, zeros, _, _ = int4_problem(3, k, 16, group_size, dtype)
    x, qweight, scales, zeros = (t.cpu() for t in (x, qweight, scales, zeros))
    group = k if group_size == -1 else group_size
    w = torch.empty(k, 16, dtype=torch.float64)
    for row in range(k):
        for col in range(16):
            q = (int(qweight[row // 8, col]) >> (4 * (row % 8))) & 15
            z = (int(zeros[row // group, col // 8]) >> (4 * (col % 8))) & 15
            w[row, col] = (q - z) * float(scales[row // group, col])
    expected = x.double() @ w.to(dtype).double()  # the weight a dense layer of x's dtype would hold
    assert_matches(w4a16_matmul_ref(x, qweight, scales, zeros, group_size), expected.to(dtype), dtype)


def test_w8a16_reference_scales_each_output_channel():
    x, q, scales = (t.cpu() for t in int8_problem(4, 40, 24, torch.float32))
    expected = x.double() @ (q.double() * scales.double()[None, :])
    assert_matches(w8a16_matmul_ref(x, q, scales), expected.float(), torch.float32)


# ----------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, group_size, path", [
    (1, 576, 40, 128, None),    # decode GEMV; K = 576 with G = 128: the last group holds 64 inputs
    (3, 576, 40, 128, None),    # M = 3 takes the dot
    (3, 128, 24, 64, "gemv"),   # several rows through the GEMV
    (1, 256, 72, 64, "dot"),    # one row through the dot
    (16, 256, 72, 64, None),
    (33, 128, 40, -1, None),    # per-channel (one group), three row tiles
    (1, 200, 40, 200, None),    # group_size = K: per-channel too, K not a multiple of the tile
    (5, 256, 48, 16, "dot"),    # groups smaller than the dot's tile: a scale and zero per packed row
    (3, 200, 40, 64, "dequant"),  # the dequantized weight through the GEMM, short last group
])
def test_w4a16_matches_reference(dtype, m, k, n, group_size, path):
    x, qweight, scales, zeros, _, _ = int4_problem(m, k, n, group_size, dtype, seed=m + k)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path=path, out=poisoned((m, n), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n, group_size", [(576, 40, 128), (256, 48, 16), (200, 40, -1)])
def test_w4a16_dequantize_is_the_reference_weight_bit_for_bit(dtype, k, n, group_size):
    _, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group_size, dtype, seed=k)
    w = quant_matmul.w4a16_dequantize(qweight, scales, zeros, group_size, dtype)
    assert torch.equal(w, quant_matmul.dequantize_int4(qweight, scales, zeros, group_size, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a16_large_m_takes_the_dequant_path(dtype, monkeypatch):
    """From DEQUANT_MIN_M rows on, the weight is dequantized and cuBLAS (or the CPU's GEMM) runs the matmul."""
    m = quant_matmul.DEQUANT_MIN_M
    x, qweight, scales, zeros, _, _ = int4_problem(m, 128, 40, 64, dtype, seed=11)
    ref = w4a16_matmul_ref(x, qweight, scales, zeros, 64)
    calls = []
    real = quant_matmul.w4a16_dequantize
    monkeypatch.setattr(quant_matmul, "w4a16_dequantize", lambda *a: calls.append(a) or real(*a))
    assert_matches(w4a16_matmul(x, qweight, scales, zeros, 64, out=poisoned((m, 40), dtype)), ref, dtype)
    assert len(calls) == 1
    assert_matches(w4a16_matmul(x[:m - 1], qweight, scales, zeros, 64), ref[:m - 1], dtype)
    assert len(calls) == 1, "M below DEQUANT_MIN_M must stay on the dot"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, path", [(1, 100, 40, None), (3, 96, 24, "gemv"), (3, 100, 40, None),
                                           (16, 64, 72, None), (33, 72, 40, None), (1, 64, 40, "dot")])
def test_w8a16_matches_reference(dtype, m, k, n, path):
    x, q, scales = int8_problem(m, k, n, dtype, seed=m + k)
    y = w8a16_matmul(x, q, scales, path=path, out=poisoned((m, n), dtype))
    assert_matches(y, w8a16_matmul_ref(x, q, scales), dtype)
    assert counters_are_clean()


@pytest.mark.parametrize("path, config", [
    ("gemv", dict(BLOCK_N=16, BLOCK_KP=8, SPLIT_K=1)),
    ("gemv", dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=5)),  # 9 tiles of rows over 5 splits: one split is empty
    ("dot", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=1)),  # each tile inside one group
    ("dot", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLIT_K=3)),
    ("dot", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2)),  # tiles span two groups: a scale per row
])
def test_w4a16_split_counts_agree(path, config):
    """SPLIT_K = 1 stores directly; more splits go through the partials and the last program's sum,
    which must not depend on how the rows were split, and must leave the counters clean."""
    x, qweight, scales, zeros, _, _ = int4_problem(2, 576, 40, 128, torch.float32, seed=7)
    ref = w4a16_matmul_ref(x, qweight, scales, zeros, 128)
    first = w4a16_matmul(x, qweight, scales, zeros, 128, path=path, config=config, out=poisoned((2, 40), x.dtype))
    assert_matches(first, ref, torch.float32)
    again = w4a16_matmul(x, qweight, scales, zeros, 128, path=path, config=config, out=poisoned((2, 40), x.dtype))
    assert torch.equal(first, again) and counters_are_clean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, config", [
    (128, dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=1)),   # 64 inputs a tile: one group each
    (32, dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=3)),    # two groups a tile: a scale per packed row
    (64, dict(BLOCK_N=16, BLOCK_KP=4, SPLIT_K=5)),    # 18 tiles over 5 splits, the last split short
])
def test_w4a16_gemv_prefetch_matches_reference(dtype, group_size, config):
    """PREFETCH loads tile t + 1 while tile t is computed, masked past the split's end."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 576, 40, group_size, dtype, seed=group_size)
    ref = w4a16_matmul_ref(x, qweight, scales, zeros, group_size)
    for prefetch in (False, True):
        y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="gemv", config={**config, "PREFETCH": prefetch},
                         out=poisoned((1, 40), dtype))
        assert_matches(y, ref, dtype)
    assert counters_are_clean()


# The HFMA2 variant needs 16-bit x; bf16 runs under the interpreter too (its helpers round to bf16 themselves).
HFMA2_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HFMA2_DTYPES)
@pytest.mark.parametrize("k, n, group_size, config", [
    # N = 40 over tiles of 32 columns (a masked tile); 72 packed rows = 4.5 tiles of 16: a masked last tile
    (576, 40, 128, dict(BLOCK_N=32, BLOCK_KP=16, SPLIT_K=1, RUN=2)),
    # groups of 32 inputs in tiles of 64: a scale and zero per run of 4 rows; split-K over 3
    (576, 40, 32, dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=3, RUN=4)),
    # N a multiple of BLOCK_N (no column mask), runs of one row
    (576, 64, 64, dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=2, RUN=1)),
    # one group (-1) over K = 200: 25 packed rows, uneven splits, short tiles at both split ends
    (200, 40, -1, dict(BLOCK_N=16, BLOCK_KP=4, SPLIT_K=2, RUN=2)),
])
def test_hfma2_gemv_matches_reference(dtype, k, n, group_size, config):
    """Two weights per HFMA2 in x's dtype (kernels/w4_pairs.py), 16-bit sums over runs of RUN packed rows."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group_size, dtype, seed=k + n)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="gemv", config={**config, "HFMA2": True},
                     out=poisoned((1, n), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


class OutOfBounds:
    """Records every address a kernel loads under the interpreter that lies in none of the given tensors (nor in the
    split-K partials and counters): the interpreter reads past a tensor's end without complaint, so a kernel that
    clamps instead of masking (gemv_pairs_tiles) needs this to show a clamp that is off by one."""

    def __init__(self, monkeypatch, *tensors):
        import numpy as np
        import triton.runtime.interpreter as interpreter
        self.ranges, self.outside = [], []
        for t in tensors:
            self.allow(t)
        real_empty, real_load = torch.empty, interpreter.InterpreterBuilder.create_masked_load

        def empty(*args, **kwargs):  # the launcher's partials
            return self.allow(real_empty(*args, **kwargs))

        def load(builder, ptrs, mask, *rest):
            size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            for address in np.unique(ptrs.data.astype(np.uint64)[mask.data.astype(bool)]):
                if not any(lo <= int(address) and int(address) + size <= hi for lo, hi in self.ranges):
                    self.outside.append(int(address))
            return real_load(builder, ptrs, mask, *rest)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", load)
        self.allow(split_k.tile_counters(torch.device(DEVICE)))

    def allow(self, t: torch.Tensor) -> torch.Tensor:
        self.ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t


@pytest.mark.parametrize("dtype", HFMA2_DTYPES)
@pytest.mark.parametrize("k, n, group_size, config", [
    # N = 40 over tiles of 32 columns (the second one clamped); 72 packed rows = 4.5 tiles of 16, the last group half long
    (576, 40, 128, dict(BLOCK_N=32, BLOCK_KP=16, SPLIT_K=1)),
    # groups of 64 inputs, one per tile; split-K over 3 (splits of 3, 3 and 3 tiles)
    (576, 40, 64, dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=3)),
    # groups of 128 inputs, two tiles each; 8 splits of 9 rows rounded up to 2 tiles: the last split is empty
    (576, 40, 128, dict(BLOCK_N=16, BLOCK_KP=8, SPLIT_K=8)),
    # groups of 32 inputs in tiles of 4 rows, N a multiple of BLOCK_N
    (576, 64, 32, dict(BLOCK_N=32, BLOCK_KP=4, SPLIT_K=2)),
    # one group (-1) over K = 200: 25 packed rows, splits of 16 and 9 rows, the second ending in a short tile
    (200, 40, -1, dict(BLOCK_N=16, BLOCK_KP=4, SPLIT_K=2)),
    # groups of 24 inputs: 3 tiles of one row each (a divisor that is no power of two)
    (72, 16, 24, dict(BLOCK_N=16, BLOCK_KP=1, SPLIT_K=2)),
])
def test_hfma2_tiles_gemv_matches_reference(dtype, k, n, group_size, config, monkeypatch):
    """The HFMA2 math on 2-d tiles with the next tile loaded ahead (w4_pairs.gemv_pairs_tiles), which clamps
    rows and columns instead of masking them: every load must stay inside its operands."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, k, n, group_size, dtype, seed=k + n + 1)
    out = poisoned((1, n), dtype)
    bounds = OutOfBounds(monkeypatch, x, qweight, scales, zeros, out)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="gemv",
                     config={**config, "HFMA2": True, "RUN": 1, "TILES": True}, out=out)
    assert bounds.outside == []
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


@pytest.mark.skipif(DEVICE != "cuda", reason="PDL and CUDA graphs need a GPU")
@pytest.mark.parametrize("hopper", [False, None])
def test_autotuned_gemv_in_a_cuda_graph_after_a_norm(hopper):
    """The decode step's way: a norm that lets the next kernel start early writes x, and the W4A16 GEMV (launched
    with PDL on Hopper, warming L2 before it waits) reads it, replayed from a graph with new inputs each time: the
    autotuned Triton GEMV (hopper=False), and what runs by default (the Gluon GEMV on an H100/H200)."""
    from minillm.kernels.fused_layer_ops import rms_norm
    x0, qweight, scales, zeros, _, _ = int4_problem(1, 4096, 1024, 128, torch.bfloat16, seed=7)
    weight = torch.rand(4096, dtype=torch.bfloat16, device=DEVICE) + 0.5
    h = x0.clone()
    w4a16_matmul(rms_norm(h, weight, 1e-5), qweight, scales, zeros, 128, hopper=hopper)  # autotunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_matmul(rms_norm(h, weight, 1e-5), qweight, scales, zeros, 128, hopper=hopper)
    for seed in range(3):
        h.copy_(int4_problem(1, 4096, 8, 128, torch.bfloat16, seed=20 + seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        assert_matches(y, w4a16_matmul_ref(rms_norm(h, weight, 1e-5), qweight, scales, zeros, 128), torch.bfloat16)


@pytest.mark.parametrize("dtype, magnitude", [(torch.float16, 3000.0), (torch.bfloat16, 1e6), (torch.bfloat16, 1e-6)])
def test_hfma2_gemv_keeps_large_and_small_activations(dtype, magnitude):
    """fp16 sums of x (q - z) overflow past 65504 unless scaled down (|x| 3000 makes 45000 a product);
    bf16 scales x up by 2**101, which must neither overflow at 1e6 nor lose 1e-6 to subnormals."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 256, 32, 64, dtype, seed=3)
    x = (x.float() * magnitude).to(dtype)
    for tiles in (False, True):
        y = w4a16_matmul(x, qweight, scales, zeros, 64,
                         config=dict(BLOCK_N=32, BLOCK_KP=8, SPLIT_K=1, HFMA2=True, TILES=tiles))
        assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 64), dtype)


def test_hfma2_gemv_reads_a_misaligned_x():
    """x two inputs per int32: a row starting at an odd 16-bit element is copied first, not misread."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 128, 16, 128, torch.float16, seed=5)
    wide = torch.randn(1, 130, generator=torch.Generator().manual_seed(6)).to(dtype=torch.float16, device=DEVICE)
    wide[:, 1:129] = x
    y = w4a16_matmul(wide[:, 1:129], qweight, scales, zeros, 128,
                     config=dict(BLOCK_N=16, BLOCK_KP=4, SPLIT_K=1, HFMA2=True))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.float16)


def test_hfma2_gemv_refuses_what_it_cannot_do():
    x, qweight, scales, zeros, _, _ = int4_problem(2, 128, 16, 32, torch.float16)
    gemv = dict(BLOCK_N=16, BLOCK_KP=4, SPLIT_K=1, HFMA2=True)
    for call, message in [
        (lambda: w4a16_matmul(x.float(), qweight, scales.float(), zeros, 32, path="gemv", config=gemv), "float32"),
        (lambda: w4a16_matmul(x, qweight, scales, zeros, 32, config=gemv), "not the GEMV"),  # M = 2 takes the dot
        (lambda: w4a16_matmul(x[:1], qweight, scales, zeros, 32, config={**gemv, "RUN": 3}), "RUN = 3"),
        (lambda: w4a16_matmul(x[:1], qweight, scales, zeros, 32, config={**gemv, "BLOCK_KP": 8, "RUN": 8}), "RUN = 8"),
        (lambda: w4a16_matmul(x[:1], qweight, scales, zeros, 32, config={**gemv, "BLOCK_KP": 8, "TILES": True}),
         "BLOCK_KP = 8 must divide group_size / 8 = 4"),
        (lambda: w4a16_matmul(x[:1], qweight, scales, zeros, 32, config={**gemv, "HFMA2": False, "TILES": True}),
         "needs HFMA2=True"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    # runs of 4 rows are 32 inputs: they fit groups of 32 but not of 16
    x16, qweight16, scales16, zeros16, _, _ = int4_problem(1, 128, 16, 16, torch.float16)
    with pytest.raises(ValueError, match="RUN = 4"):
        w4a16_matmul(x16, qweight16, scales16, zeros16, 16, config={**gemv, "RUN": 4})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, group_size, config", [
    (37, 128, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1)),  # three row tiles, one group per tile
    (5, 64, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2)),    # tiles span two groups, split-K
])
def test_w4a16_swapped_dot_matches_reference(dtype, m, group_size, config):
    """SWAP_AB computes y^T = W^T x^T (the weight as the dot's first operand): the same y."""
    x, qweight, scales, zeros, _, _ = int4_problem(m, 576, 40, group_size, dtype, seed=m)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="dot", config={**config, "SWAP_AB": True},
                     out=poisoned((m, 40), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


@triton.jit
def _pairs_tile_kernel(QW, S, Z, W, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores dequant_tile_pairs of the first BLOCK_K // 8 packed rows (one group: scale and zero row 0)."""
    r, n = tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_N)
    packed = tl.load(QW + r[:, None] * N + n[None, :])
    scale = tl.load(S + n)[None, :]
    zero = (tl.load(Z + n // 8) >> ((n % 8) * 4))[None, :] & 15
    w = dequant_tile_pairs(packed, scale, zero, W.dtype.element_ty, BLOCK_K, BLOCK_N)
    tl.store(W + tl.arange(0, BLOCK_K)[:, None] * N + n[None, :], w)


@pytest.mark.parametrize("dtype", HFMA2_DTYPES)
def test_pairs_tile_is_the_reference_weight_bit_for_bit(dtype):
    """(q - z) s from 16-bit pairs (128 + q or 1024 + q, minus 128 + z, times s) is the reference's rounded weight,
    row k in k's order."""
    _, qweight, scales, zeros, _, _ = int4_problem(1, 64, 32, 64, dtype, seed=11)
    scales = scales * torch.logspace(-3, 3, 32, device=DEVICE).to(dtype)  # small and large scales round differently
    w = poisoned((64, 32), dtype)
    _pairs_tile_kernel[(1,)](qweight, scales, zeros, w, 32, BLOCK_K=64, BLOCK_N=32)
    want = quant_matmul.dequantize_int4(qweight, scales, zeros, 64, dtype)
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # (the interpreter's bf16 dot misreads)
@pytest.mark.parametrize("m, group_size, config", [
    (37, 128, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1)),   # row tiles, one group per tile
    (5, 32, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),     # two groups per tile, split-K
    (3, -1, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, SWAP_AB=True)),  # one group, swapped
])
def test_w4a16_pairs_dot_matches_reference(dtype, m, group_size, config):
    """The dot with its tile dequantized two weights per HFMA2 (kernels/w4_pairs.py): N = 40 over tiles of
    16 or 32 columns (a masked tile), K = 576 (9 tiles of 64, a ragged last group of 128)."""
    x, qweight, scales, zeros, _, _ = int4_problem(m, 576, 40, group_size, dtype, seed=m + 1)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="dot", config={**config, "PAIRS": True},
                     out=poisoned((m, 40), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


def test_pairs_refuses_what_it_cannot_do():
    x, qweight, scales, zeros, _, _ = int4_problem(3, 128, 16, 32, torch.float16)
    dot = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, PAIRS=True)
    with pytest.raises(ValueError, match="float32"):
        w4a16_matmul(x.float(), qweight, scales.float(), zeros, 32, config=dot)
    with pytest.raises(ValueError, match="not the dot"):
        w4a16_matmul(x[:1], qweight, scales, zeros, 32, config=dot)  # M = 1 takes the GEMV


@pytest.mark.parametrize("path, config", [("gemv", dict(BLOCK_N=32, BLOCK_K=16, SPLIT_K=3)),
                                          ("dot", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=1))])
def test_w8a16_pinned_configs(path, config):
    x, q, scales = int8_problem(2, 88, 40, torch.float32, seed=3)
    y = w8a16_matmul(x, q, scales, path=path, config=config, out=poisoned((2, 40), x.dtype))
    assert_matches(y, w8a16_matmul_ref(x, q, scales), torch.float32)


@pytest.mark.parametrize("config", quant_matmul_configs._W8_GEMV, ids=str)
def test_every_autotuned_w8a16_gemv_config_matches_reference(config):
    """Each row of the autotuner's W8A16 GEMV list, pinned, on a ragged shape (K and N not multiples of its tiles)."""
    x, q, scales = int8_problem(1, 300, 72, torch.float16 if DEVICE == "cuda" else torch.float32, seed=4)
    pinned = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    y = w8a16_matmul(x, q, scales, path="gemv", config=pinned, out=poisoned((1, 72), x.dtype))
    assert_matches(y, w8a16_matmul_ref(x, q, scales), x.dtype)
    assert counters_are_clean()


def test_leading_dims_and_strided_rows():
    """x [..., K] keeps its leading dims; rows may be strided (a slice of a wider tensor)."""
    x, qweight, scales, zeros, _, _ = int4_problem(6, 64, 16, 32, torch.float32, seed=5)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :64]
    assert wide.stride(0) == 128
    y = w4a16_matmul(wide.view(2, 3, 64), qweight, scales, zeros, 32)
    assert y.shape == (2, 3, 16)
    assert_matches(y.view(6, 16), w4a16_matmul_ref(x, qweight, scales, zeros, 32), torch.float32)
    x8, q8, s8 = int8_problem(6, 32, 16, torch.float32)
    assert_matches(w8a16_matmul(x8.view(3, 2, 32), q8, s8).view(6, 16), w8a16_matmul_ref(x8, q8, s8), torch.float32)


def test_bad_inputs_are_refused_with_the_bad_value():
    x, qweight, scales, zeros, _, _ = int4_problem(2, 64, 16, 32, torch.float32)
    cases = [
        (lambda: w4a16_matmul(x, qweight, scales, zeros, 20), "group_size is 20"),
        (lambda: w4a16_matmul(x, qweight, scales, zeros, 16), r"scales has shape \(2, 16\); expected \(4, 16\)"),
        (lambda: w4a16_matmul(x[:, :32], qweight, scales, zeros, 32), "last dim must be K = 64"),
        (lambda: w4a16_matmul(x.to(torch.int32), qweight, scales, zeros, 32), "x.dtype is torch.int32"),
        (lambda: w4a16_matmul(x, qweight.to(torch.int64), scales, zeros, 32), "qweight.dtype is torch.int64"),
        (lambda: w4a16_matmul(x, qweight, scales.half(), zeros, 32), "scales.dtype is torch.float16"),
        (lambda: w4a16_matmul(x, qweight[:, :12], scales[:, :12], zeros, 32), "N = 12"),
        (lambda: w4a16_matmul(x, qweight, scales, zeros, 32, path="gemm"), "path is 'gemm'"),
        (lambda: w4a16_matmul(x, qweight, scales, zeros, 32, out=torch.empty(2, 8)), r"out is .* \(2, 8\)"),
        (lambda: w8a16_matmul(x, torch.zeros(64, 16, dtype=torch.int32, device=DEVICE), scales[0]),
         "qweight.dtype is torch.int32; expected torch.int8"),
        (lambda: w8a16_matmul(x, torch.zeros(64, 16, dtype=torch.int8, device=DEVICE), scales), r"scales has shape"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# ----------------------------------------------------------------------------- the autotuner's lists


def _pinned(config: triton.Config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def test_gemv_autotuning_offers_hfma2_only_where_it_can_run():
    configs = quant_matmul._W4_GEMV
    hfma2 = [c for c in configs if c.kwargs.get("HFMA2")]
    assert hfma2 and len(hfma2) < len(configs)  # both bodies compete
    x16, x32 = torch.randn(1, 4096, dtype=torch.float16), torch.randn(1, 4096)
    fit = lambda x, group, m=1: quant_matmul_configs.fit_gemv_variants(configs, {"X": x, "group_size": group, "K": 4096,  # noqa: E731
                                                                         "M": m})
    assert fit(x16, 128) == configs
    assert fit(x32, 128) == [c for c in configs if not c.kwargs.get("HFMA2")]
    # Groups of 8 inputs (one packed row) fit only runs of one row; a single group (K) fits every run.
    assert {c.kwargs["RUN"] for c in fit(x16, 8) if c.kwargs.get("HFMA2")} == {1}
    assert fit(x16, 4096) == configs
    # TILES needs whole tiles inside a group: groups of 64 inputs (8 packed rows) keep tiles of 8 rows, not 16.
    assert {c.kwargs["BLOCK_KP"] for c in fit(x16, 64) if c.kwargs.get("TILES")} == {8}
    # A GEMV forced on many rows gets no split-K: _launch sizes partials only up to SPLIT_MAX_M rows.
    many = fit(x16, 128, m=quant_matmul_configs.SPLIT_MAX_M + 1)
    assert many and all(c.kwargs["SPLIT_K"] == 1 for c in many)


ADDED_GEMV = [c for c in quant_matmul._W4_GEMV if c.kwargs.get("HFMA2") or c.kwargs.get("PREFETCH")]


@pytest.mark.parametrize("dtype, group_size", [(torch.float16, 128), (torch.bfloat16, 32), (torch.bfloat16, 128)])
@pytest.mark.parametrize("config", ADDED_GEMV, ids=str)
def test_every_added_gemv_config_computes_the_reference(config, dtype, group_size):
    """The configs the H200 sweep added, pinned as the autotuner would launch them (N = 256: whole tiles);
    groups of 32 give the tiles of 4 or 8 packed rows a scale per run, groups of 128 one per tile. A TILES config
    whose tiles do not fit in a group is one the autotuner must drop, not run."""
    if not quant_matmul_configs.hfma2_runs_fit(config.kwargs, group_size, 512):
        x = torch.randn(1, 512, dtype=dtype)
        kept = quant_matmul_configs.fit_gemv_variants([config], {"X": x, "group_size": group_size, "K": 512, "M": 1})
        assert config.kwargs.get("TILES") and kept == []
        return
    x, qweight, scales, zeros, _, _ = int4_problem(1, 512, 256, group_size, dtype, seed=3)
    y = w4a16_matmul(x, qweight, scales, zeros, group_size, path="gemv", config=_pinned(config),
                     out=poisoned((1, 256), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, group_size), dtype)
    assert counters_are_clean()


@pytest.mark.parametrize("config", [c for c in quant_matmul._W4_DOT if c.kwargs.get("PAIRS")], ids=str)
def test_every_pairs_dot_config_computes_the_reference(config):
    """fp16 (the interpreter misreads bf16 dots); M = 20 rows in tiles of 16 to 64, N = 200 over masked tiles."""
    x, qweight, scales, zeros, _, _ = int4_problem(20, 256, 200, 128, torch.float16, seed=5)
    y = w4a16_matmul(x, qweight, scales, zeros, 128, path="dot", config=_pinned(config),
                     out=poisoned((20, 200), x.dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), torch.float16)
    assert counters_are_clean()


@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuned GEMV runs on a GPU (the interpreter pins one config)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autotuned_gemv_reads_a_misaligned_x(dtype):
    """The autotuner may pick an HFMA2 config, which reads x two inputs per int32: an x two bytes off a 4-byte
    boundary is copied first (``_launch``), not read across the boundary."""
    x, qweight, scales, zeros, _, _ = int4_problem(1, 4096, 4096, 128, dtype, seed=11)
    misaligned = torch.empty(4097, dtype=dtype, device=DEVICE)[1:].view(1, 4096)
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 4 == 2
    y = w4a16_matmul(misaligned, qweight, scales, zeros, 128, out=poisoned((1, 4096), dtype))
    assert_matches(y, w4a16_matmul_ref(x, qweight, scales, zeros, 128), dtype)
