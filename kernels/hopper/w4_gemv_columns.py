"""A W4A16 GEMV (M = 1) for Hopper (sm_90), in Gluon, with no split-K fix-up: each program owns 32 columns of y and
streams all of K for them through a ring of TMA slots; its warps share out K, and their sums meet in shared memory.
``w4_gemv.gemv`` runs it for the plain form (a bf16 y), the one ``QuantLinear`` runs by default.

Why it exists: the split-K GEMV (``w4_gemv_split_k.py``) cuts K among programs, so a bf16 y needs a fix-up after
the last math: partials through L2, a fence and a counter, a sizable part of a 7-9 us kernel at Llama-2-7B's shapes.
Here a program's columns are its own from
the first input to the last, so y is written where it is summed. Columns are what there are many of: 32 a program
gives 344 programs at N = 11008 and 128 at N = 4096, enough to fill the H200's 132 SMs, where split-K's 256-column
tiles give 43 and 16.

The work: a program takes column tile c (32 columns: 128-byte rows of packed weights) and all of K in bands of
8 H WARPS packed rows (64 H WARPS inputs), STAGES bands in flight, a band one TMA copy of [8 H WARPS, 32] (32 KB at 8
warps and H = 4). A band is H WARPS blocks of 8 packed rows (64 inputs: a group of 64, half a group of 128); warp w
computes blocks H w .. H w + H - 1, a half-warp H / 2 of them, two columns a thread, with the split-K kernel's HFMA2
body (``w4_gemv_split_k``'s docstring): rows r and r + 4 of a block share their 16-bit sums (RUN = 2). A thread
reads its rows of both halves of its blocks from the landed band in one load, the band's rows seen as [r, w, h,
column, i] (band row 8 H w + 8 h + 4 i + r), and ``split`` parts the halves in its registers. Each thread keeps its
blocks' sums, scaled per group, until the last band; then one sum over the program's threads (in shared memory)
makes its 32 columns of y.

Why the copies after the wait are few: the ring's copies, issued before the wait for the kernel ahead (PDL), would be
queued ahead of x's loads after it, so x (and with it every band's math) would come only once most of the weights
had. So only the first slots are filled before the wait, and the last ``late`` after x's loads are issued
(``choose_shape``). x's tables are stored r fastest, so that a band's reads are free of bank conflicts, and
one x-sum table a block keeps a program small enough for three to share an SM at K = 4096.

What it takes (``unsupported``): one bf16 row, K a multiple of 64, N of 32, group 64 or 128. Not under Triton's
interpreter (Gluon has none): tested on an sm_90 GPU (tests/kernels/test_hopper_w4_gemv_columns.py); compiled for
sm_90 on the CPU by tests/test_w4_gemv_columns_sass.py.
"""

from __future__ import annotations

import torch
import triton

from .gluon import GLUON_USABLE, gluon

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon import reinterpret, tma_load, warps_barrier
    from .w4_gemv_split_k import (_fma2, _let_next_start, _wait_for_previous, _word_sum,
                                                       word_pairs)

COLS = 32  # columns a program: 128-byte rows of packed weights
BLOCK_ROWS = 8  # packed rows a block (64 inputs): a group of 64, half a group of 128
WARPS = 8
STAGES = 4
BLOCKS = 2  # blocks a warp computes of each band, unless told (``choose_shape``, what ``gemv`` launches, takes 4)
RING_BYTES = 128 * 1024  # the most the ring's weights may take of an SM's shared memory


def choose_shape(k: int, n: int, sms: int) -> tuple[int, int, int, int]:
    """(warps, ring slots, blocks a warp, late slots) for a K x N weight on ``sms`` SMs: 4 warps, 4 blocks a warp
    (16 KB bands), every slot but the first filled after x's loads are issued (copies issued before them would keep
    x's loads waiting behind the whole ring's). Where the programs (N / 32) are
    no more than the SMs, 8 slots (a 128 KB ring), so that the next GEMV's programs, launched early, cannot share an
    SM: at 4096 x 4096, 4 x 8 x 4 3.96 us against 4 x 4 x 4's 4.83, which leaves room for them. Where there are
    more, as many slots as bands up to 4 (the whole column at K = 4096: three programs an SM, 344 at 4096 x 11008
    all resident). H200, every slot but one late (w4a16_gemv_columns_late_shapes.json): 4096 x 11008 4 x 4 x 4
    7.08 us (8 x 2 x 4 7.45), 11008 x 4096 4 x 8 x 4 7.48 (8 x 4 x 4 7.72), torch's bf16 matmul 24.84 / 25.29."""
    if n // COLS <= sms:
        stages = 8
    else:
        stages = min(4, triton.next_power_of_2(plan(k, 4, 4)["n_bands"]))
    return 4, stages, 4, stages - 1


if GLUON_USABLE:
    _COLS = gl.constexpr(COLS)
    _TWO_POW_32 = gl.constexpr(4294967296.0)

    @gluon.jit
    def _x_words(XW, K_ROWS, BANDS: gl.constexpr, WARPS_: gl.constexpr, H: gl.constexpr):
        """x's packed rows as [band, w, h, i, r, word] (int32, two bf16 a word; zeros past K_ROWS), row 8 H WARPS
        band + 8 H w + 8 h + 4 i + r, in row order: a packed row's four words (16 bytes) a thread, a warp 512
        contiguous bytes. Each program reads all of x, and read in the tables' order (a warp's words 2 KB apart, one
        sector each) they would leave the ring full and idle for microseconds. The loads are issued here;
        ``_band_tables`` waits for them."""
        # x's packed rows as [band, w, h, i, r, word]: row 8 H WARPS band + 8 H w + 8 h + 4 i + r, its words 4 row ..;
        # a warp's 32 threads take 32 consecutive rows (H = 2: of two warps' blocks; H = 4: of one warp's)
        TW: gl.constexpr = 4 // H
        words_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 1, 4], [1, TW, H, 2, 4, 1],
                                                 [TW, WARPS_ // TW, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])
        row_l: gl.constexpr = gl.SliceLayout(5, words_l)
        # (each index's 1-D layout: the other four dimensions sliced away)
        band = gl.arange(0, BANDS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, row_l)))))
        w = gl.arange(0, WARPS_, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, row_l)))))
        h = gl.arange(0, H, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, row_l)))))
        i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, row_l)))))
        rr = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, row_l)))))
        r = (((band[:, None, None, None, None] * WARPS_ + w[None, :, None, None, None]) * H
              + h[None, None, :, None, None]) * 2 + i[None, None, None, :, None]) * 4 + rr[None, None, None, None, :]
        word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, gl.SliceLayout(4, words_l))))))
        at = 4 * r[:, :, :, :, :, None] + word[None, None, None, None, None, :]
        return gl.load(XW + at, mask=at < 4 * K_ROWS, other=0)

    @gluon.jit
    def _band_tables(words):
        """x as the bands want it, in shared memory, from its words (``_x_words``): pairs[j] [2 BANDS, 4, WARPS, H]
        (int32), index i BANDS + band holding rows 4 i .. 4 i + 3 of the band's blocks (block H w + h at [:, w, h]),
        pair j of each as ``w4_gemv_split_k.word_pairs`` makes it; and sums [BANDS, WARPS, H], each block's sum
        of x."""
        BANDS: gl.constexpr = words.shape[0]
        WARPS_: gl.constexpr = words.shape[1]
        H: gl.constexpr = words.shape[2]
        even, odd = gl.split(gl.reshape(words, [BANDS, WARPS_, H, 2, 4, 2, 2]))  # words 0, 2 and 1, 3
        w0, w2 = gl.split(even)
        w1, w3 = gl.split(odd)
        pairs, total = word_pairs(w0, w1, w2, w3)
        # a block's sum over both halves, [band, w, h]: one table, not one a half (256 bytes less at K = 4096 lets
        # three programs of 8 warps x 2 slots x H = 4 share an SM, where two did: 76,816 bytes a program before)
        block_sums = gl.sum(gl.sum(total, axis=4), axis=3)
        sums = gl.allocate_shared_memory(gl.float32, block_sums.shape, gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        sums.store(block_sums)
        sums = reinterpret(sums, gl.float32, block_sums.shape, gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        # the pairs to the bands' order [i, band, r, w, h], i BANDS + band leading
        return (_shared(gl.permute(pairs[0], [3, 0, 4, 1, 2])), _shared(gl.permute(pairs[1], [3, 0, 4, 1, 2])),
                _shared(gl.permute(pairs[2], [3, 0, 4, 1, 2])), _shared(gl.permute(pairs[3], [3, 0, 4, 1, 2]))), sums

    @gluon.jit
    def _shared(values):
        """values [2, BANDS, 4, WARPS, H] (a pair table: [i, band, r, w, h]) in a shared-memory buffer of their own,
        seen as [2 BANDS, 4, WARPS, H] with a layout of one rank less than that: what .index() leaves. Stored r
        fastest, then h, w: a warp's 32 lanes (4 r, H h, 2 i at H = 4) then write 16 consecutive words and two banks
        at most; stored h fastest, r's lanes would fall 32 words apart, all on one bank (8-way conflicts on the
        critical path after the wait). A band's read
        then takes a thread's four r in one 16-byte load."""
        table = gl.allocate_shared_memory(values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [2, 4, 3, 1, 0]))
        table.store(values)
        shape: gl.constexpr = [2 * values.shape[1], values.shape[2], values.shape[3], values.shape[4]]
        return reinterpret(table, values.dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, [0, 2, 1]))

    @gluon.jit
    def _load_band(band, c, w_desc, s_desc, z_desc, bar, w_slot, s_slot, z_slot):
        """Band ``band`` of column tile c onto ``bar``: its packed rows in one box (8 H WARPS rows: 16 KB at 8 warps
        and H = 2), and its scales and zero points."""
        ROWS: gl.constexpr = w_desc.block_type.shape[0]
        GROUPS: gl.constexpr = s_desc.block_type.shape[0]
        mbarrier.expect(bar, w_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes)
        tma_load(w_desc, [band * ROWS, c * _COLS], bar, w_slot)
        tma_load(s_desc, [band * GROUPS, c * _COLS], bar, s_slot)
        tma_load(z_desc, [band * GROUPS, c * (_COLS // 2)], bar, z_slot)

    @gluon.jit
    def _first_fill(FROM: gl.constexpr, TO: gl.constexpr, c, n_bands, w_desc, s_desc, z_desc, landed, w_smem, s_smem,
                    z_smem):
        """Bands FROM .. TO - 1 (those that exist) into the ring's slots of the same numbers."""
        GROUPS: gl.constexpr = s_smem.shape[1]
        for first in gl.static_range(FROM, TO):
            if first < n_bands:
                _load_band(first, c, w_desc, s_desc, z_desc, landed.index(first), w_smem.index(first),
                           s_smem.index(first), z_smem.index(first).slice(0, GROUPS))

    @gluon.jit
    def _band_halves(w_slot, band_l: gl.constexpr, WARPS_: gl.constexpr, H: gl.constexpr):
        """A landed band's rows 0-3 and 4-7 of every block, each [4, WARPS, H, 32] in band_l: row 4 i + r of block
        H w + h at [r, w, h] of half i. The box's rows are row-major [w, h, i, r] (band row 8 H w + 8 h + 4 i + r),
        read here as [r, w, h, column, i], so that a thread holds both halves of its rows and split parts them."""
        rows_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 0, 4, 2, 1])
        rows = reinterpret(w_slot, gl.int32, [4, WARPS_, H, _COLS, 2], rows_l)
        both_l: gl.constexpr = gl.BlockedLayout([4, 1, H // 2, 2, 2], [1, 1, 2, 16, 1], [1, WARPS_, 1, 1, 1],
                                                [4, 3, 2, 1, 0])
        low, high = gl.split(rows.load(both_l))
        return gl.convert_layout(low, band_l, assert_trivial=True), gl.convert_layout(high, band_l, assert_trivial=True)

    @gluon.jit
    def _group_rows(values, wide_l: gl.constexpr, blocks_l: gl.constexpr):
        """A band's per-group values [WARPS, H / 2, 32] (groups of two blocks, in SliceLayout(2, wide_l)) as per-block
        [WARPS, H, 32] in blocks_l: block H w + h takes group row (H w + h) // 2."""
        WARPS_: gl.constexpr = values.shape[0]
        wide = values[:, :, None, :] + gl.zeros([WARPS_, values.shape[1], 2, _COLS], values.dtype, layout=wide_l)
        return gl.convert_layout(gl.reshape(wide, [WARPS_, 2 * values.shape[1], _COLS]), blocks_l, assert_trivial=True)

    @gluon.jit
    def _add_band(out, w_slot, s_slot, z_slot, pairs, sums, band, BANDS: gl.constexpr, band_l: gl.constexpr,
                  GROUP_BLOCKS: gl.constexpr, H: gl.constexpr):
        """out ([WARPS, H, 32] fp32: a block's column sums so far, each thread its own) plus a landed band's
        products with x, scaled and less the zero points' share: sum_k x (q - z) s = (2**32 s) sum x q 2**-32 -
        (z s) sum x, per block (both blocks of a group of 128 take its scale and zero point)."""
        WARPS_: gl.constexpr = gl.num_warps()
        x_l: gl.constexpr = gl.SliceLayout(3, band_l)
        blocks_l: gl.constexpr = gl.SliceLayout(0, band_l)
        acc2 = gl.zeros([4, WARPS_, H, _COLS], gl.int32, layout=band_l)  # +0.0 in both halves
        halves = _band_halves(w_slot, band_l, WARPS_, H)
        for i in gl.static_range(2):  # rows 0-3, then 4-7, of every block: row r's sums shared with row r + 4
            packed = halves[i]
            shifted = packed >> 8  # nibbles 2, 3, 6, 7 to where 0, 1, 4, 5 were
            for j in gl.static_range(4):
                x_j = pairs[j].index(i * BANDS + band).load(x_l)[:, :, :, None]
                src = packed if j < 2 else shifted
                acc2 = _fma2(gl.broadcast(x_j, acc2)[0], src & (0x000F000F if j % 2 == 0 else 0x00F000F0), acc2)
        part = gl.sum(_word_sum(acc2), axis=0)  # [WARPS, H, 32]: sum x q 2**-32 per block and column
        sums_l: gl.constexpr = gl.SliceLayout(2, blocks_l)
        x_sum = sums.index(band).load(sums_l)[:, :, None]
        # (zero points read where they are used, in bytes whose nibbles ``join`` parts in registers: no exchange
        # through shared memory)
        if GROUP_BLOCKS == 1:  # a group a block: scales [H WARPS, 32] seen as [WARPS, H, 32]
            scale = s_slot.reshape([WARPS_, H, _COLS]).load(blocks_l).to(gl.float32)
            bytes_l: gl.constexpr = gl.BlockedLayout([1, H // 2, 1], [1, 2, 16], [WARPS_, 1, 1], [2, 1, 0])
            z_byte = z_slot.reshape([WARPS_, H, _COLS // 2]).load(bytes_l).to(gl.int32) & 255
            z = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [WARPS_, H, _COLS]), blocks_l,
                                  assert_trivial=True)
        else:  # a group two blocks: scales [H WARPS / 2, 32] seen as [WARPS, H / 2, 32], each row for its two blocks
            # [WARPS, H / 2 (group), 2 (block of the group), 32] as blocks_l holds [WARPS, H, 32]: a warp's block h is
            # its h-thread t's (t in 0, 1) register h - t H / 2, so a group (two blocks) is one thread's pair at H = 4
            # and the two threads' one block each at H = 2
            wide_l: gl.constexpr = gl.BlockedLayout([1, 1, H // 2, 2], [1, H // 2, 2 // (H // 2), 16],
                                                    [WARPS_, 1, 1, 1], [3, 2, 1, 0])
            group_l: gl.constexpr = gl.SliceLayout(2, wide_l)
            scale = _group_rows(s_slot.reshape([WARPS_, H // 2, _COLS]).load(group_l).to(gl.float32), wide_l, blocks_l)
            bytes_l: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout(
                [1, 1, H // 2, 1], [1, H // 2, 2 // (H // 2), 16], [WARPS_, 1, 1, 1], [3, 2, 1, 0]))
            if H == 2:  # a group a warp: z_slot may be a slice of a padded slot (fewer than 8 rows), not reshaped
                z_byte = z_slot.load(gl.SliceLayout(1, bytes_l))[:, None, :].to(gl.int32) & 255
            else:
                z_byte = z_slot.reshape([WARPS_, H // 2, _COLS // 2]).load(bytes_l).to(gl.int32) & 255
            z_group = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [WARPS_, H // 2, _COLS]),
                                        group_l, assert_trivial=True)
            z = _group_rows(z_group, wide_l, blocks_l)
        return out + part * (scale * _TWO_POW_32) - x_sum * (z.to(gl.float32) * scale)

    @gluon.jit
    def _w4_gemv_columns_kernel(XW, w_desc, s_desc, z_desc, Y, N, K_ROWS, n_bands, STAGES: gl.constexpr,
                                BANDS: gl.constexpr, GROUP_BLOCKS: gl.constexpr, PDL: gl.constexpr,
                                H: gl.constexpr = 2, LATE: gl.constexpr = 0):
        """Program c: y[32 c : 32 c + 32] over all of K, n_bands bands through a ring of STAGES slots (the module
        docstring). BANDS: a power of two at least n_bands; GROUP_BLOCKS: blocks a group (1 or 2); H: blocks a warp
        a band (2 or 4). LATE: the ring's slots filled after x's loads are issued, the rest before the wait."""
        WARPS_: gl.constexpr = gl.num_warps()
        GROUPS: gl.constexpr = H * WARPS_ // GROUP_BLOCKS  # scale rows a band
        c = gl.program_id(0)

        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 8 * H * WARPS_, _COLS], w_desc.layout)  # a band a slot
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, GROUPS, _COLS], s_desc.layout)
        # (TMA writes to 128-byte aligned shared memory: a slot of zero points is 8 rows of 16 bytes at least)
        Z_ROWS: gl.constexpr = GROUPS if GROUPS >= 8 else 8
        z_smem = gl.allocate_shared_memory(gl.int8, [STAGES, Z_ROWS, _COLS // 2], z_desc.layout)
        landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for first in gl.static_range(STAGES):
            mbarrier.init(landed.index(first), count=1)
        fence_async_shared()
        EARLY: gl.constexpr = STAGES - LATE
        _first_fill(0, EARLY, c, n_bands, w_desc, s_desc, z_desc, landed, w_smem, s_smem, z_smem)
        _let_next_start(PDL)  # (the copies read weights only; x, which the kernel ahead writes, comes after the wait)
        _wait_for_previous(PDL)
        words = _x_words(XW, K_ROWS, BANDS, WARPS_, H)
        # (x's loads then queue ahead of these copies)
        _first_fill(EARLY, STAGES, c, n_bands, w_desc, s_desc, z_desc, landed, w_smem, s_smem, z_smem)
        pairs, sums = _band_tables(words)
        warps_barrier()  # the tables are written

        band_l: gl.constexpr = gl.BlockedLayout([4, 1, H // 2, 2], [1, 1, 2, 16], [1, WARPS_, 1, 1], [3, 2, 1, 0])
        out = gl.zeros([WARPS_, H, _COLS], gl.float32, layout=gl.SliceLayout(0, band_l))
        for band in range(n_bands):
            s = band % STAGES
            mbarrier.wait(landed.index(s), (band // STAGES) & 1)
            out = _add_band(out, w_smem.index(s), s_smem.index(s), z_smem.index(s).slice(0, GROUPS), pairs, sums,
                            band, BANDS, band_l, GROUP_BLOCKS, H)
            if band + STAGES < n_bands:
                # every warp done with slot s before it is refilled (no refill, no wait: a ring that holds all of K,
                # as at 4096 x 11008, never stops its warps)
                warps_barrier()
                _load_band(band + STAGES, c, w_desc, s_desc, z_desc, landed.index(s), w_smem.index(s),
                           s_smem.index(s), z_smem.index(s).slice(0, GROUPS))
        y = gl.sum(gl.sum(out, axis=1), axis=0)  # the warps' blocks meet (through shared memory)
        n = c * _COLS + gl.arange(0, _COLS, layout=y.type.layout)
        gl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)


def _descriptors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, warps: int,
                 blocks: int):
    """TMA descriptors: the packed weight [K / 8, N] (boxes of a band, [8 ``blocks`` warps, 32]), the scales
    [groups, N] and the zero points as bytes [groups, N / 2] (boxes of a band's groups)."""
    groups = blocks * warps * BLOCK_ROWS * 8 // group
    boxes = ((qweight, [blocks * warps * BLOCK_ROWS, COLS], gl.int32),
             (scales, [groups, COLS], gl.bfloat16), (zeros.view(torch.int8), [groups, COLS // 2], gl.int8))
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                             gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.primitive_bitwidth,
                                                  rank=2))
            for t, box, dtype in boxes]


def plan(k: int, warps: int, blocks: int = BLOCKS) -> dict:
    """A K-long column's bands: n_bands (of 8 ``blocks`` ``warps`` packed rows) and BANDS, a power of two at least
    that."""
    n_bands = -(-k // (8 * blocks * warps * BLOCK_ROWS))
    return {"n_bands": n_bands, "BANDS": triton.next_power_of_2(n_bands)}


def ring_bytes(warps: int, stages: int, blocks: int) -> int:
    """The bytes of weights a ring of ``stages`` bands holds."""
    return stages * blocks * warps * BLOCK_ROWS * COLS * 4


def w4_gemv_columns(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    out: torch.Tensor, pdl: bool = True, warps: int = WARPS, stages: int = STAGES,
                    blocks: int = BLOCKS, late: int = 0) -> None:
    """y = x @ W into ``out`` [1, N] bf16 (x [1, K] bf16, GPTQ-packed qweight [K / 8, N], group 64 or 128): a program
    a 32-column tile, ``warps`` warps sharing out K in bands of 64 ``blocks`` ``warps`` inputs (``blocks`` blocks of
    64 a warp: 2 or 4), ``stages`` bands in flight. ``late``: ring slots filled after x's loads are issued, not
    before the wait."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    reason = unsupported(k, n, group, x.dtype, x.shape[0])
    if reason:
        raise ValueError(f"the column GEMV cannot run these inputs: {reason}")
    reason = shape_unsupported(warps, stages, blocks)
    if reason:
        raise ValueError(reason)
    if blocks * warps * 64 // group < 8 and not (blocks == 2 and group == 128):
        raise ValueError(f"warps={warps} x blocks={blocks} at group {group} makes {blocks * warps * 64 // group} "
                         f"zero-point rows a band, too few to view (8 at least, or 2 blocks a warp at group 128)")
    if not 0 <= late <= stages:
        raise ValueError(f"late counts ring slots filled after x's loads: 0 to stages={stages}, got {late}")
    if out.dtype != torch.bfloat16 or out.shape != (1, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [1, {n}] torch.bfloat16 row, got {list(out.shape)} {out.dtype}")
    numbers = plan(k, warps, blocks)
    _w4_gemv_columns_kernel[(n // COLS,)](x.view(torch.int32),
                                          *_descriptors(qweight, scales, zeros, group, warps, blocks),
                                          out, n, k // 8, numbers["n_bands"], STAGES=stages, BANDS=numbers["BANDS"],
                                          GROUP_BLOCKS=group // 64, PDL=pdl, H=blocks, LATE=late,
                                          num_warps=warps, launch_pdl=pdl)


def shape_unsupported(warps: int, stages: int, blocks: int) -> str | None:
    """Why the kernel cannot take ``warps`` x ``stages`` ring slots x ``blocks`` blocks a warp, or None if it can."""
    if warps not in (2, 4, 8, 16) or stages not in (1, 2, 4, 8) or blocks not in (2, 4):
        return (f"warps, stages and blocks must be 2, 4, 8 or 16; 1, 2, 4 or 8; and 2 or 4 (shared memory views want "
                f"powers of two); got warps={warps}, stages={stages}, blocks={blocks}")
    if ring_bytes(warps, stages, blocks) > RING_BYTES:  # (the x tables and the scales need the rest of an SM's 227 KB)
        return (f"warps={warps} x stages={stages} x blocks={blocks} would hold "
                f"{ring_bytes(warps, stages, blocks) // 1024} KB of weights in flight, more than the "
                f"{RING_BYTES // 1024} KB the ring may take: fewer of one")
    return None


def unsupported(k: int, n: int, group: int, dtype: torch.dtype, rows: int) -> str | None:
    """Why the column GEMV cannot take a K x N weight at ``group`` with x of ``dtype`` and ``rows`` rows, or None if
    it can (``w4_gemv.unsupported`` checks the rest: the device, alignment, Gluon)."""
    if dtype != torch.bfloat16 or rows != 1:
        return f"it takes one bf16 row, not {rows} of {dtype}"
    if k % 64 or k == 0 or n % COLS or n == 0 or group not in (64, 128):
        return f"it takes K a multiple of 64, N of 32 and group 64 or 128; got K = {k}, N = {n}, group {group}"
    return None
