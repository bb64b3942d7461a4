"""A W4A16 GEMV (M = 1) for Hopper (sm_90), in Gluon, with no split-K fix-up: each program owns 32 columns of y and
streams all of K for them through a ring of TMA slots; its warps share out K, and their sums meet in shared memory.

Why it exists: the split-K and stream-K GEMVs (``w4_gemv_hopper_kernel.py``, ``w4_gemv_stream.py``) cut K among
programs, so a bf16 y needs a fix-up after the last math: partials through L2 and a fence and counter, or a poll,
1.2-2 us of a 7-9 us kernel at Llama-2-7B's shapes (figures/h200/sweeps/w4a16_gemv_stream_poll.json: the stream
kernel 8.61 / 9.16 us with its poll, 7.40 / 7.15 with the fix-up left out). Here a program's columns are its own from
the first input to the last, so y is written where it is summed. Columns are what there are many of: 32 a program
gives 344 programs at N = 11008 and 128 at N = 4096, enough to fill the H200's 132 SMs, where split-K's 256-column
tiles give 43 and 16.

The work: a program takes column tile c (32 columns: 128-byte rows of packed weights) and all of K in bands of
16 WARPS packed rows (128 WARPS inputs), STAGES bands in flight. A band is 2 WARPS blocks of 8 packed rows (64 inputs:
a group of 64, half a group of 128); warp w computes blocks 2w and 2w + 1, a half-warp each, two columns a thread,
with the split-K kernel's HFMA2 body (``w4_gemv_hopper_kernel``'s docstring): rows r and r + 4 of a block share their
16-bit sums (RUN = 2). The copies need that pairing in a thread: a band's weights come in eight TMA copies, one for
each row of a block ([2 WARPS, 32] over the packed weight viewed as [K / 64, 8 N]), so that rows 0-3 and 4-7 of every
block sit in two slabs that each thread loads alike. Each thread keeps its blocks' sums, scaled per group, until the
last band; then one sum over the program's threads (in shared memory) makes its 32 columns of y.

The cost of owning columns: a program's copies are 128-byte rows 4 N bytes apart, where the split-K kernel's are
1 KB rows; and its share of the SMs is rounded to whole column tiles (at N = 11008, 2 or 3 programs an SM).

Measured on the H200 (figures/h200/sweeps/w4a16_gemv_columns.json, w4a16_gemv_columns_probe.json; 20 calls in a CUDA
graph, L2-cold, against the stream kernel and torch's bf16 matmul in the same rounds): slower where it was meant to
win. At 4096 x 11008 11.63-11.69 us at 8 warps x 4 slots (the stream kernel's poll 8.62); at 11008 x 4096 14.09-14.14
at 8 x 8 (the stream kernel 9.06-9.43); only at 4096 x 4096, 5.29-5.31 at 8 x 8 against split-K's 5.49-5.52. The
copies alone say why: 7.58 and 11.20 us against the stream kernel's 6.13 and 6.01. Rows of 128 bytes, each in another
DRAM page, stream slower than the 1 KB rows of 256-column tiles, and one program an SM (N = 4096) cannot keep enough of
them in flight; the math then adds ~4 us that the slower copies do not hide.

What it takes (``unsupported``): one bf16 row, K a multiple of 64, N of 32, group 64 or 128. Not under Triton's
interpreter (Gluon has none): tested on an sm_90 GPU (tests/kernels/test_w4_gemv_columns.py); compiled for sm_90 on
the CPU by tests/test_w4_gemv_columns_sass.py.
"""

from __future__ import annotations

import torch
import triton

from minillm.kernels.flash_attention_hopper import GLUON_USABLE, gluon

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from minillm.kernels.flash_attention_hopper import reinterpret, tma_load, warps_barrier
    from minillm.kernels.w4_gemv_hopper_kernel import _fma2, _let_next_start, _wait_for_previous, _word_sum, x_pairs

COLS = 32  # columns a program: 128-byte rows of packed weights
BLOCK_ROWS = 8  # packed rows a block (64 inputs): a group of 64, half a group of 128
WARPS = 8
STAGES = 4

if GLUON_USABLE:
    _COLS = gl.constexpr(COLS)
    _TWO_POW_32 = gl.constexpr(4294967296.0)

    @gluon.jit
    def _band_tables(XW, K_ROWS, BANDS: gl.constexpr, WARPS_: gl.constexpr):
        """x as the bands want it, in shared memory: pairs[j] [2 BANDS, 4, WARPS, 2] (int32), index i BANDS + band
        holding rows 4 i .. 4 i + 3 of the band's blocks (block 2 w + h at [:, w, h]), pair j of each as
        ``w4_gemv_hopper_kernel.x_pairs`` makes it; and sums [2 BANDS, WARPS, 2], those rows' sums of x. Rows past
        K_ROWS are zeros."""
        tab_l: gl.constexpr = gl.BlockedLayout([1, 4, 1, 1], [16, 1, 1, 2], [1, 1, WARPS_, 1], [3, 2, 1, 0])
        q = gl.arange(0, 2 * BANDS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, tab_l))))
        rr = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, tab_l))))
        w = gl.arange(0, WARPS_, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, tab_l))))
        h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, tab_l))))
        block = (q % BANDS)[:, None, None, None] * (2 * WARPS_) + 2 * w[None, None, :, None] + h[None, None, None, :]
        r = block * 8 + 4 * (q // BANDS)[:, None, None, None] + rr[None, :, None, None]
        pairs, total, _ = x_pairs(XW, r, r < K_ROWS, K_ROWS, XW, 1.0, False, False, False)
        sums = _shared(gl.sum(total, axis=1))
        return (_shared(pairs[0]), _shared(pairs[1]), _shared(pairs[2]), _shared(pairs[3])), sums

    @gluon.jit
    def _shared(values):
        """values (rank 3 or 4) in a shared-memory buffer of their own, viewed with a layout of one rank less: what
        .index() leaves."""
        if len(values.shape) == 4:
            table = gl.allocate_shared_memory(values.dtype, values.shape,
                                              gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
            table.store(values)
            return reinterpret(table, values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        else:
            table = gl.allocate_shared_memory(values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
            table.store(values)
            return reinterpret(table, values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _load_band(band, c, N, w_desc, s_desc, z_desc, bar, w_runs, slot, s_slot, z_slot, WARPS_: gl.constexpr,
                   GROUP_BLOCKS: gl.constexpr):
        """Band ``band`` of column tile c onto ``bar``: row r of each of its 2 WARPS blocks into w_runs[2 slot + r // 4,
        r % 4] (eight copies), and the band's scales and zero points."""
        mbarrier.expect(bar, 8 * w_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes)
        copy_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # w_desc's
        for r in gl.static_range(8):
            rows = reinterpret(w_runs.index(2 * slot + r // 4), gl.int32, [4, 2 * WARPS_, _COLS], copy_l)
            tma_load(w_desc, [band * (2 * WARPS_), r * N + c * _COLS], bar, rows.index(r % 4))
        tma_load(s_desc, [band * (2 * WARPS_ // GROUP_BLOCKS), c * _COLS], bar, s_slot)
        tma_load(z_desc, [band * (2 * WARPS_ // GROUP_BLOCKS), c * (_COLS // 2)], bar, z_slot)

    @gluon.jit
    def _add_band(out, w_runs, slot, s_slot, z_slot, pairs, sums, band, BANDS: gl.constexpr, band_l: gl.constexpr,
                  GROUP_BLOCKS: gl.constexpr):
        """out ([WARPS, 2, 32] fp32: a block's column sums so far, each thread its own) plus a landed band's
        products with x, scaled and less the zero points' share: sum_k x (q - z) s = (2**32 s) sum x q 2**-32 -
        (z s) sum x, per block (both blocks of a group of 128 take its scale and zero point)."""
        WARPS_: gl.constexpr = gl.num_warps()
        x_l: gl.constexpr = gl.SliceLayout(3, band_l)
        blocks_l: gl.constexpr = gl.SliceLayout(0, band_l)
        acc2 = gl.zeros([4, WARPS_, 2, _COLS], gl.int32, layout=band_l)  # +0.0 in both halves
        for i in gl.static_range(2):  # rows 0-3, then 4-7, of every block: row r's sums shared with row r + 4
            packed = w_runs.index(2 * slot + i).load(band_l)
            shifted = packed >> 8  # nibbles 2, 3, 6, 7 to where 0, 1, 4, 5 were
            for j in gl.static_range(4):
                x_j = pairs[j].index(i * BANDS + band).load(x_l)[:, :, :, None]
                src = packed if j < 2 else shifted
                acc2 = _fma2(gl.broadcast(x_j, acc2)[0], src & (0x000F000F if j % 2 == 0 else 0x00F000F0), acc2)
        part = gl.sum(_word_sum(acc2), axis=0)  # [WARPS, 2, 32]: sum x q 2**-32 per block and column
        sums_l: gl.constexpr = gl.SliceLayout(2, blocks_l)
        x_sum = (sums.index(band).load(sums_l) + sums.index(BANDS + band).load(sums_l))[:, :, None]
        if GROUP_BLOCKS == 1:  # a group a block: scales [2 WARPS, 32] seen as [WARPS, 2, 32]
            scale = s_slot.reshape([WARPS_, 2, _COLS]).load(blocks_l).to(gl.float32)
            bytes_l: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 2, 16], [WARPS_, 1, 1], [2, 1, 0])
            z_byte = z_slot.reshape([WARPS_, 2, _COLS // 2]).load(bytes_l).to(gl.int32) & 255
            z = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [WARPS_, 2, _COLS]), blocks_l)
        else:  # a group two blocks: a warp's pair (scales [WARPS, 32]), the group's row for both
            group_l: gl.constexpr = gl.SliceLayout(1, blocks_l)
            scale = s_slot.load(group_l).to(gl.float32)[:, None, :]
            bytes_l: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [WARPS_, 1], [1, 0])
            z_byte = z_slot.load(bytes_l).to(gl.int32) & 255
            z = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [WARPS_, _COLS]), group_l)[:, None, :]
        return out + part * (scale * _TWO_POW_32) - x_sum * (z.to(gl.float32) * scale)

    @gluon.jit
    def _w4_gemv_columns_kernel(XW, w_desc, s_desc, z_desc, Y, N, K_ROWS, n_bands, STAGES: gl.constexpr,
                                BANDS: gl.constexpr, GROUP_BLOCKS: gl.constexpr, PDL: gl.constexpr,
                                COMPUTE: gl.constexpr = True):
        """Program c: y[32 c : 32 c + 32] over all of K, n_bands bands through a ring of STAGES slots (the module
        docstring). BANDS: a power of two at least n_bands; GROUP_BLOCKS: blocks a group (1 or 2). COMPUTE off: a probe
        (the copies alone; y is wrong)."""
        WARPS_: gl.constexpr = gl.num_warps()
        GROUPS: gl.constexpr = 2 * WARPS_ // GROUP_BLOCKS  # scale rows a band
        c = gl.program_id(0)

        # Slot s holds rows 0-3 of the band's blocks 2 w + h at [2 s, :, w, h], rows 4-7 at [2 s + 1] (eight copies).
        w_runs = gl.allocate_shared_memory(gl.int32, [2 * STAGES, 4, WARPS_, 2, _COLS],
                                           gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, GROUPS, _COLS], s_desc.layout)
        # (TMA writes to 128-byte aligned shared memory: a slot of zero points is 8 rows of 16 bytes at least)
        Z_ROWS: gl.constexpr = GROUPS if GROUPS >= 8 else 8
        z_smem = gl.allocate_shared_memory(gl.int8, [STAGES, Z_ROWS, _COLS // 2], z_desc.layout)
        landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for first in gl.static_range(STAGES):
            mbarrier.init(landed.index(first), count=1)
        fence_async_shared()
        for first in gl.static_range(STAGES):
            if first < n_bands:
                _load_band(first, c, N, w_desc, s_desc, z_desc, landed.index(first), w_runs, first,
                           s_smem.index(first), z_smem.index(first).slice(0, GROUPS), WARPS_, GROUP_BLOCKS)
        _let_next_start(PDL)  # (the copies read weights only; x, which the kernel ahead writes, comes after the wait)
        _wait_for_previous(PDL)
        pairs, sums = _band_tables(XW, K_ROWS, BANDS, WARPS_)
        warps_barrier()  # the tables are written

        band_l: gl.constexpr = gl.BlockedLayout([4, 1, 1, 2], [1, 1, 2, 16], [1, WARPS_, 1, 1], [3, 2, 1, 0])
        out = gl.zeros([WARPS_, 2, _COLS], gl.float32, layout=gl.SliceLayout(0, band_l))
        for band in range(n_bands):
            s = band % STAGES
            mbarrier.wait(landed.index(s), (band // STAGES) & 1)
            if COMPUTE:
                out = _add_band(out, w_runs, s, s_smem.index(s), z_smem.index(s).slice(0, GROUPS), pairs, sums, band,
                                BANDS, band_l, GROUP_BLOCKS)
            warps_barrier()  # every warp done with slot s
            if band + STAGES < n_bands:
                _load_band(band + STAGES, c, N, w_desc, s_desc, z_desc, landed.index(s), w_runs, s,
                           s_smem.index(s), z_smem.index(s).slice(0, GROUPS), WARPS_, GROUP_BLOCKS)
        y = gl.sum(gl.sum(out, axis=1), axis=0)  # the warps' blocks meet (through shared memory)
        n = c * _COLS + gl.arange(0, _COLS, layout=y.type.layout)
        gl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)


def _descriptors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, warps: int):
    """TMA descriptors: the packed weight [K / 8, N] viewed as [K / 64, 8 N] (a block's eight rows side by side;
    boxes of [2 warps, 32]: one row of each of a band's blocks), the scales [groups, N] and the zero points as bytes
    [groups, N / 2] (boxes of a band's groups)."""
    k_rows, n = qweight.shape
    groups = 2 * warps * BLOCK_ROWS * 8 // group
    boxes = ((qweight.view(k_rows // BLOCK_ROWS, BLOCK_ROWS * n), [2 * warps, COLS], gl.int32),
             (scales, [groups, COLS], gl.bfloat16), (zeros.view(torch.int8), [groups, COLS // 2], gl.int8))
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                             gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.primitive_bitwidth,
                                                  rank=2))
            for t, box, dtype in boxes]


def plan(k: int, warps: int) -> dict:
    """A K-long column's bands: n_bands (of 16 ``warps`` packed rows) and BANDS, a power of two at least that."""
    n_bands = -(-k // (8 * 2 * warps * BLOCK_ROWS))
    return {"n_bands": n_bands, "BANDS": triton.next_power_of_2(n_bands)}


def w4_gemv_columns(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    out: torch.Tensor, pdl: bool = True, warps: int = WARPS, stages: int = STAGES,
                    compute: bool = True) -> None:
    """y = x @ W into ``out`` [1, N] bf16 (x [1, K] bf16, GPTQ-packed qweight [K / 8, N], group 64 or 128): a program
    a 32-column tile, ``warps`` warps sharing out K in bands of 128 ``warps`` inputs, ``stages`` bands in flight.
    ``compute`` off: a probe, the copies alone (y is wrong)."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    reason = unsupported(k, n, group, x.dtype, x.shape[0])
    if reason:
        raise ValueError(f"the column GEMV cannot run these inputs: {reason}")
    if warps not in (2, 4, 8, 16) or stages not in (1, 2, 4, 8):  # (shared memory views want powers of two)
        raise ValueError(f"warps and stages must be 2, 4, 8 or 16 and 1, 2, 4 or 8; got warps={warps}, "
                         f"stages={stages}")
    if out.dtype != torch.bfloat16 or out.shape != (1, n):
        raise ValueError(f"out must be [1, {n}] bf16, got {list(out.shape)} {out.dtype}")
    numbers = plan(k, warps)
    _w4_gemv_columns_kernel[(n // COLS,)](x.view(torch.int32), *_descriptors(qweight, scales, zeros, group, warps),
                                          out, n, k // 8, numbers["n_bands"], STAGES=stages, BANDS=numbers["BANDS"],
                                          GROUP_BLOCKS=group // 64, PDL=pdl, COMPUTE=compute, num_warps=warps,
                                          launch_pdl=pdl)


def unsupported(k: int, n: int, group: int, dtype: torch.dtype, rows: int) -> str | None:
    """Why the column GEMV cannot take a K x N weight at ``group`` with x of ``dtype`` and ``rows`` rows, or None if
    it can (``w4_gemv_hopper.unsupported`` checks the rest: the device, alignment, Gluon)."""
    if dtype != torch.bfloat16 or rows != 1:
        return f"it takes one bf16 row, not {rows} of {dtype}"
    if k % 64 or k == 0 or n % COLS or n == 0 or group not in (64, 128):
        return f"it takes K a multiple of 64, N of 32 and group 64 or 128; got K = {k}, N = {n}, group {group}"
    return None
