"""The W4A16 GEMV (M = 1) for Hopper (sm_90), in Gluon: the kernel and its tile layout. ``w4_gemv.py`` checks
what it takes, chooses its tiles and launches it (``w4a16_matmul`` runs it for one row of bf16 x on an H100/H200,
the matmul a batch-1 decode step of an INT4 model mostly runs).

Why it exists: the Triton GEMVs (``../quant_matmul.py``) read Llama-2-7B's INT4 weights at about half of the copy
bandwidth. The H200's counters said why: 4.9 warps an SM, each waiting on its own loads
(figures/h200/sweeps/ncu_kernels.json). A plain-pointer GEMV keeps only the loads its warps have issued in flight, a
few KB an SM, where HBM wants ~30 KB an SM in flight to stream at full rate (bandwidth x latency: 4.8 TB/s x ~0.8 us
over 132 SMs). TMA copies change that arithmetic: a program issues the copies of all its tiles at once, and they land
in shared memory while it computes. The design:

- **Every tile in flight from the start.** A program owns a column tile of 256 columns and TILES tiles of 16 packed
  rows (128 inputs; 16 KB of int4 weights each, with their scales and zero points). It issues all its TMA copies
  first, each completing on an mbarrier of its own, then computes tile after tile as they land: no ring, no refills.
  At 2 tiles a program holds 35 KB of shared memory, six programs an SM: the whole weight (23 MB at
  4096 x 11008) is requested within the first microsecond. The default is 4 (68 KB, three programs an SM): alone
  and cold, 2 is faster; in the decode graph, where PDL lets each GEMV's copies land during the kernel ahead, 4 is
  (half the splits to sum; below).
- **Started early (PDL).** The copies read only weights, which no kernel of a decode step writes: they are issued
  before the program waits for the kernel ahead (which writes x), as ``pdl.py`` describes. Each program then lets a
  kernel launched early behind it start (``griddepcontrol.launch_dependents``): the gated down_proj behind gate_up
  (both W4A16 GEMVs) issues its copies during gate_up's tail, as it did behind the SiLU kernel it replaces. But not
  every copy: x's loads after the wait would queue behind them, so the last LATE tiles (one,
  ``w4_gemv.LATE_TILES``) are copied once x's tables are built (figures/h200/sweeps/latency_late_default.json).
- **x once per program.** x's pairs, scaled for the 16-bit products, and its sums per row are computed once per
  program into shared memory (``_x_tables``), where the weight loop reads them as broadcasts.
- **The HFMA2 body** of ``w4_pairs.py``: a packed int32 holds nibbles j and j + 4 as two bf16 subnormals, one
  LOP3 takes them out as a pair and one ``fma.rn.bf16x2`` multiplies both into a 16-bit pair of sums; the
  products of RUN = 2 packed rows are summed in 16 bits, then in fp32, and the zero point comes off once per group as
  z s sum(x) (that module's docstring has the arithmetic and its accuracy at RUN <= 2). Each thread holds two
  columns of eight packed rows at a time, rows i and i + 4 sharing their 16-bit sums (that module pairs neighbouring
  rows; the sums are the same length): about 12.5 instructions a packed int32 (8 weights), 14.5 at RUN = 1.
- **Gated** (``w4_gemv_fused.fused_gemv(gated=True)``): for the MLP's down projection at batch 1, x is the gate_up
  row and the tables are built from silu(gate) * up, computed by ``fused_layer_ops.silu_mul`` as x is loaded: one
  kernel where there were two.
- **Norms folded** (``fused_gemv(residual=...)``, ``fused_gemv(norm=...)``): the residual add and RMSNorm between two
  of a layer's GEMVs done by them: the GEMV ahead adds its part of y to the residual stream's fp32 row where each
  program holds it, the GEMV behind weights its inputs as the tables are built and applies 1 / rms where its fix-up
  writes y (``w4_gemv_norms.py``). gate_up_proj leaves its norm's 1 / rms to down_proj: it adds its parts of y to a
  zeroed fp32 row with the sums of squares beside it, and down_proj scales that row as it loads it.
- **Split-K fix-up** as ``../split_k.py``: each program writes its fp32 partial, the last of a column tile to arrive
  sums them, FIX_CHUNK partials a load, and writes y. A GEMV adding to the residual stream has none: its programs'
  reductions in L2 (``red.global.add.f32``) are the sum.

Where its time goes (figures/h200/sweeps/w4a16_gemv_probe.json, the same grid's copies with no math): the copies take
most of it; the fix-up (a fenced atomic, then the partials' round trip to L2, behind the last program) and the math of
the tiles that land last share the rest. That fix-up is why a bf16 y (the plain form) runs the column kernel
(``w4_gemv_columns.py``) instead where it can; ``minillm bench kernels`` measures both against torch's bf16 matmul.
Not under Triton's interpreter (Gluon has none): tested on an sm_90 GPU (tests/kernels/test_hopper_w4_gemv.py);
on the CPU it is compiled for sm_90 and its instructions counted (tests/test_w4_gemv_hopper_sass.py).
"""

from __future__ import annotations

import torch

from .gluon import GLUON_USABLE, gluon

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon import tma_load, warps_barrier
    from ..fused_layer_ops import silu_mul
    from .w4_gemv_norms import (bf16_words, high_bf16, inv_rms, low_bf16, scaled_bf16, stored_inv_rms,
                                               weighted_word)

TILE_ROWS = 16  # packed rows a tile: 128 inputs
SUB_ROWS = 8  # packed rows a thread holds at a time (two columns each), loaded RUN slices of SUB_ROWS / RUN rows
RUN = 2  # packed rows whose products share 16-bit sums (rows i and i + SUB_ROWS / RUN; w4_pairs.py's accuracy)
BLOCK_N = 256  # columns a tile: TMA's largest box dimension
WARPS = 4
FIX_CHUNK = 32  # partials the fix-up loads at once: 64 registers a thread, after the weights' are free


if GLUON_USABLE:
    _TILE_ROWS, _SUB_ROWS, _BLOCK_N = gl.constexpr(TILE_ROWS), gl.constexpr(SUB_ROWS), gl.constexpr(BLOCK_N)
    _TWO_POW_32 = gl.constexpr(4294967296.0)
    _FIX_CHUNK = gl.constexpr(FIX_CHUNK)

    @gluon.jit
    def _fma2(a, b, c):
        """a * b + c on the pairs of bf16 held in int32s: one HFMA2."""
        return gl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _prmt(a, b, SELECTOR: gl.constexpr):
        """Bytes of (a, b) picked by SELECTOR: 0x5410 joins the low halves, 0x7632 the high ones (one PRMT)."""
        if SELECTOR == 0x5410:
            return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b], dtype=gl.int32,
                                             is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b], dtype=gl.int32,
                                             is_pure=True, pack=1)

    @gluon.jit
    def _let_next_start(PDL: gl.constexpr):
        """``pdl.let_next_start``: a kernel launched early behind this one may be scheduled once every program here
        has passed this point."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _wait_for_previous(PDL: gl.constexpr):
        """``pdl.wait_for_previous``: block until the kernel ahead has finished and its writes (x) are visible."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _x_tables(XW, first_row, K_ROWS, NormW, inv, ROWS: gl.constexpr, WARPS_: gl.constexpr, GATED: gl.constexpr,
                  NORMED: gl.constexpr, SCALED: gl.constexpr):
        """The program's ROWS packed rows of x (two bf16 a word, XW) as the products want them, in shared memory:
        four [ROWS] int32, pair j of row r = (x_8r+j, x_8r+j+4) times 2**101 (j even) or 2**97 (j odd), and [ROWS] fp32,
        each row's sum of x; and for a norm the sum of squares of the program's inputs (0 without). Rows past K_ROWS
        are zeros. GATED: XW is the MLP's gate_up row (K gates, then K ups) and x = silu(gate) * up, rounded as
        ``fused_layer_ops.silu_and_mul`` rounds it. NORMED: XW is the residual stream's fp32 row s, x = s times the
        norm's weight (its words NormW), and the squares are s's (``w4_gemv_norms.py``: 1 / rms comes after). SCALED
        (with GATED): XW is the fp32 gate_up row its GEMV left unnormalised, each gate and up times ``inv`` (1 / rms)
        and rounded to bf16 before SiLU-and-multiply."""
        rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS_], [0])
        r = first_row + gl.arange(0, ROWS, layout=rows_l)
        pairs, total, squares = x_pairs(XW, r, r < K_ROWS, K_ROWS, NormW, inv, GATED, NORMED, SCALED)
        if NORMED:
            squares = gl.sum(squares, axis=0)
        return (_table(pairs[0]), _table(pairs[1]), _table(pairs[2]), _table(pairs[3])), _table(total), squares

    @gluon.jit
    def x_pairs(XW, r, ok, K_ROWS, NormW, inv, GATED: gl.constexpr, NORMED: gl.constexpr, SCALED: gl.constexpr):
        """For packed rows r of x (any shape; zeros where not ok), in registers: the four pairs the products want
        (``_x_tables``), each row's sum of x, and with NORMED each row's sum of squares of s (0 without)."""
        if NORMED:  # inputs 8r, 8r + 1 in word 0 ...
            w0, q0 = weighted_word(XW, NormW, 4 * r, ok)
            w1, q1 = weighted_word(XW, NormW, 4 * r + 1, ok)
            w2, q2 = weighted_word(XW, NormW, 4 * r + 2, ok)
            w3, q3 = weighted_word(XW, NormW, 4 * r + 3, ok)
            squares = q0 + q1 + q2 + q3
        else:
            w0 = _x_words(XW, 4 * r, ok, 4 * K_ROWS, inv, GATED, SCALED)
            w1 = _x_words(XW, 4 * r + 1, ok, 4 * K_ROWS, inv, GATED, SCALED)
            w2 = _x_words(XW, 4 * r + 2, ok, 4 * K_ROWS, inv, GATED, SCALED)
            w3 = _x_words(XW, 4 * r + 3, ok, 4 * K_ROWS, inv, GATED, SCALED)
            squares = 0.0
        pairs, total = word_pairs(w0, w1, w2, w3)
        return pairs, total, squares

    @gluon.jit
    def word_pairs(w0, w1, w2, w3):
        """A packed row's four int32 words of x (inputs 8r .. 8r + 7, two bf16 a word) as the four pairs the products
        want (``_x_tables``), and the row's sum of x."""
        # Nibble pair j of a packed int32 is (q_j, q_j+4) at 2**-133, or 16 times that for odd j: see _tile_sum.
        pairs = (_fma2(_prmt(w0, w2, 0x5410), 0x72007200, 0), _fma2(_prmt(w0, w2, 0x7632), 0x70007000, 0),
                 _fma2(_prmt(w1, w3, 0x5410), 0x72007200, 0), _fma2(_prmt(w1, w3, 0x7632), 0x70007000, 0))
        # Exact: a bf16 is an fp32 with its low 16 bits zero.
        total = _word_sum(w0) + _word_sum(w1) + _word_sum(w2) + _word_sum(w3)
        return pairs, total

    @gluon.jit
    def _x_words(XW, word, ok, UP_WORDS, inv, GATED: gl.constexpr, SCALED: gl.constexpr):
        """x's int32 words ``word`` (two bf16 each), zeros where not ok; GATED: silu(gate) * up of the gate words there
        and the up words UP_WORDS further, each bf16 as ``fused_layer_ops.silu_mul`` computes it. SCALED: XW is an fp32
        gate_up row, whose inputs 2 word and 2 word + 1 (and the ups 2 UP_WORDS further) are first multiplied by inv
        and rounded to bf16, as the unfused GEMV's 1 / rms and rounding of y would have them."""
        if SCALED:
            low, high, up = 2 * word, 2 * word + 1, 2 * UP_WORDS
            w = bf16_words(silu_mul(scaled_bf16(XW, low, ok, inv), scaled_bf16(XW, up + low, ok, inv)),
                           silu_mul(scaled_bf16(XW, high, ok, inv), scaled_bf16(XW, up + high, ok, inv)))
        else:
            w = gl.load(XW + word, mask=ok, other=0)
            if GATED:
                up = gl.load(XW + UP_WORDS + word, mask=ok, other=0)
                w = bf16_words(silu_mul(low_bf16(w), low_bf16(up)), silu_mul(high_bf16(w), high_bf16(up)))
        return w

    @gluon.jit
    def _word_sum(w):
        """The sum of the two bf16 in each int32 of w, in fp32 (a shift, a LOP3 and an FADD)."""
        return (w << 16).to(gl.float32, bitcast=True) + (w & -65536).to(gl.float32, bitcast=True)

    @gluon.jit
    def _table(values):
        """values [ROWS] stored in a shared-memory buffer of their own."""
        table = gl.allocate_shared_memory(values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))
        table.store(values)
        return table

    @gluon.jit
    def _tile_sum(w_tile, row: gl.constexpr, pairs, first: gl.constexpr, layout: gl.constexpr, RUN: gl.constexpr):
        """sum over the SUB_ROWS packed rows of w_tile from ``row`` (x's rows from ``first``) of sum_k x_k q_k 2**-32,
        per column, fp32. A shift, four LOP3s and four HFMA2s make a packed row's 8 products' two 16-bit sums; RUN
        rows (i and i + SUB_ROWS / RUN) share those sums, which then go to fp32 and are added."""
        x_l: gl.constexpr = gl.SliceLayout(1, layout)
        acc2 = gl.zeros([_SUB_ROWS // RUN, _BLOCK_N], gl.int32, layout=layout)  # +0.0 in both halves
        for i in gl.static_range(RUN):
            packed = w_tile.slice(row + i * (_SUB_ROWS // RUN), _SUB_ROWS // RUN).load(layout)
            shifted = packed >> 8  # nibbles 2, 3, 6, 7 to where 0, 1, 4, 5 were
            for j in gl.static_range(4):
                x_j = pairs[j].slice(first + i * (_SUB_ROWS // RUN), _SUB_ROWS // RUN).load(x_l)[:, None]
                src = packed if j < 2 else shifted
                acc2 = _fma2(gl.broadcast(x_j, acc2)[0], src & (0x000F000F if j % 2 == 0 else 0x00F000F0), acc2)
        return gl.sum(_word_sum(acc2), axis=0)

    @gluon.jit
    def tile_slots(w_desc, s_desc, z_desc, COUNT: gl.constexpr, GROUPS: gl.constexpr):
        """Shared memory for COUNT tiles' packed weights, scales and zero points, and an mbarrier each (initialised)."""
        w_smem = gl.allocate_shared_memory(gl.int32, [COUNT, _TILE_ROWS, _BLOCK_N], w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [COUNT, GROUPS, _BLOCK_N], s_desc.layout)
        z_smem = gl.allocate_shared_memory(gl.int8, [COUNT, GROUPS, _BLOCK_N // 2], z_desc.layout)
        landed = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
        for t in gl.static_range(COUNT):
            mbarrier.init(landed.index(t), count=1)
        fence_async_shared()
        return w_smem, s_smem, z_smem, landed

    @gluon.jit
    def load_tile(row, n0, w_desc, s_desc, z_desc, bar, w_slot, s_slot, z_slot, GROUP_ROWS: gl.constexpr):
        """The tile of packed rows from ``row`` and columns from n0: weights, scales and zero points into their slots,
        landing on ``bar``."""
        mbarrier.expect(bar, w_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes)
        tma_load(w_desc, [row, n0], bar, w_slot)
        tma_load(s_desc, [row // GROUP_ROWS, n0], bar, s_slot)
        tma_load(z_desc, [row // GROUP_ROWS, n0 // 2], bar, z_slot)

    @gluon.jit
    def _load_tiles(FROM: gl.constexpr, TO: gl.constexpr, first_row, K_ROWS, n0, w_desc, s_desc, z_desc, landed, w_smem,
                    s_smem, z_smem, GROUP_ROWS: gl.constexpr):
        """A program's tiles FROM .. TO - 1 (those within K) into their slots."""
        for t in gl.static_range(FROM, TO):
            row = first_row + t * _TILE_ROWS
            if row < K_ROWS:
                load_tile(row, n0, w_desc, s_desc, z_desc, landed.index(t), w_smem.index(t), s_smem.index(t),
                          z_smem.index(t), GROUP_ROWS)

    @gluon.jit
    def add_tile(out, w_tile, s_tile, z_tile, pairs, sums, first: gl.constexpr, GROUP_ROWS: gl.constexpr,
                 tile_l: gl.constexpr, bytes_l: gl.constexpr, RUN: gl.constexpr):
        """out (fp32 [BLOCK_N]) plus a landed tile's products with x, group by group: x's rows of the tile start at
        row ``first`` of the tables ``pairs`` and ``sums``."""
        WARPS_: gl.constexpr = gl.num_warps()
        cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
        for g in gl.static_range(_TILE_ROWS // GROUP_ROWS):
            # (Rows of one: an NVMMA-laid buffer keeps its rank; the sums over them only drop the axis.)
            scale = gl.sum(s_tile.slice(g, 1).load(tile_l).to(gl.float32), axis=0)
            z_byte = gl.sum(z_tile.slice(g, 1).load(bytes_l).to(gl.int32) & 255, axis=0)
            z = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [_BLOCK_N]), cols_l)
            x_sum = gl.sum(sums.slice(first + g * GROUP_ROWS, GROUP_ROWS).load(
                gl.BlockedLayout([GROUP_ROWS], [32], [WARPS_], [0])), axis=0)
            part = gl.zeros([_BLOCK_N], gl.float32, layout=cols_l)
            for sub in gl.static_range(GROUP_ROWS // _SUB_ROWS):
                part += _tile_sum(w_tile, g * GROUP_ROWS + sub * _SUB_ROWS, pairs, first + g * GROUP_ROWS
                                  + sub * _SUB_ROWS, tile_l, RUN)
            # sum_k x (q - z) s = (2**32 s) sum x q 2**-32 - (z s) sum x
            out += part * (scale * _TWO_POW_32) - x_sum * (z.to(gl.float32) * scale)
        return out

    @gluon.jit
    def _w4_gemv_kernel(XW, w_desc, s_desc, z_desc, Y, Partials, Counters, N, K_ROWS, NormW, eps, Squares,
                        square_slots, norm_width,
                        TILES: gl.constexpr, GROUP_ROWS: gl.constexpr, PDL: gl.constexpr, GATED: gl.constexpr,
                        RUN: gl.constexpr, ADD: gl.constexpr, NORMED: gl.constexpr, SCALED: gl.constexpr = False,
                        SQUARE_SLOTS: gl.constexpr = 1, LATE: gl.constexpr = 0):
        """Program (column tile, split): y[n0 : n0 + 256] from packed rows split * TILES * 16 onwards. ADD: Y is the
        residual stream's fp32 row, and each split adds its part of y to it; NORMED: XW is that row s, and the product's
        input RMSNorm(s) with the weight NormW and eps (``w4_gemv_norms.py``). Both: Y is a zeroed fp32 row that
        gets y before the norm's 1 / rms, and each split's sum of squares goes to Squares[split]. SCALED (GATED): XW
        is such a row of gate_up, and its norm's 1 / rms comes from its ``square_slots`` sums of squares at Squares
        (SQUARE_SLOTS: a power of two at least as large), a row of ``norm_width`` inputs, and eps. LATE: the last
        LATE of the TILES tiles are copied after x's tables are built, not before the wait."""
        WARPS_: gl.constexpr = gl.num_warps()
        GROUPS: gl.constexpr = _TILE_ROWS // GROUP_ROWS  # scale rows a tile
        tile_n = gl.program_id(0)
        split = gl.program_id(1)
        n0 = tile_n * _BLOCK_N
        first_row = split * (TILES * _TILE_ROWS)

        # The copies of all tiles but the LATE last first: weights, scales and zero points of tile t land on barrier t.
        w_smem, s_smem, z_smem, landed = tile_slots(w_desc, s_desc, z_desc, TILES, GROUPS)
        EARLY: gl.constexpr = TILES - LATE
        _load_tiles(0, EARLY, first_row, K_ROWS, n0, w_desc, s_desc, z_desc, landed, w_smem, s_smem, z_smem, GROUP_ROWS)
        # The next GEMV, if launched early (the gated down_proj behind gate_up), takes SM slots as programs here end
        # and issues its copies during this kernel's tail (fix-up, last tiles' math), as a norm ahead of it lets it.
        _let_next_start(PDL)
        _wait_for_previous(PDL)
        inv = 1.0
        if SCALED:
            inv = stored_inv_rms(Squares, square_slots, SQUARE_SLOTS, norm_width, eps, WARPS_)
        pairs, sums, squares = _x_tables(XW, first_row, K_ROWS, NormW, inv, TILES * _TILE_ROWS, WARPS_, GATED, NORMED,
                                         SCALED)
        # LATE tiles: copied once x is in, its loads not queued behind them
        _load_tiles(EARLY, TILES, first_row, K_ROWS, n0, w_desc, s_desc, z_desc, landed, w_smem, s_smem, z_smem,
                    GROUP_ROWS)
        warps_barrier()  # the tables are written

        # A thread: two neighbouring columns, SUB_ROWS / RUN rows a slice; the 128 threads span the tile's 256 columns.
        tile_l: gl.constexpr = gl.BlockedLayout([_SUB_ROWS // RUN, 2], [1, 32], [1, WARPS_], [1, 0])
        cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
        bytes_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS_], [1, 0])  # a thread's byte: 2 columns
        out = gl.zeros([_BLOCK_N], gl.float32, layout=cols_l)
        for t in gl.static_range(TILES):
            if first_row + t * _TILE_ROWS < K_ROWS:
                mbarrier.wait(landed.index(t), 0)
                out = add_tile(out, w_smem.index(t), s_smem.index(t), z_smem.index(t), pairs, sums, t * _TILE_ROWS,
                               GROUP_ROWS, tile_l, bytes_l, RUN)

        _finish(out, Y, Partials, Counters, tile_n, N, 8 * K_ROWS, squares, eps, Squares, WARPS_, ADD, NORMED)

    @gluon.jit
    def _finish(out, Y, Partials, Counters, tile_n, N, K, squares, eps, Squares, WARPS_: gl.constexpr,
                ADD: gl.constexpr, NORMED: gl.constexpr):
        """y[n0 : n0 + 256] = out, or with splits ``split_k.finish``'s fix-up: each program stores its fp32 partial, the
        last of the column tile to arrive sums them, FIX_CHUNK splits a load (one round trip to L2 each, where a
        load a split took ~0.07 us each: figures/h200/sweeps/w4a16_gemv_probe.json), and writes y (``_store_y``).
        NORMED: each split's sum of squares goes with its partial (after the N x splits of them), and y is scaled by
        1 / rms of their sum. ADD: each program adds its partial to Y itself (``w4_gemv_norms.py``): no fix-up; with
        NORMED, the first column tile's programs store their splits' sums of squares at Squares for the reader."""
        cols_l: gl.constexpr = out.type.layout
        n = tile_n * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=cols_l)
        splits = gl.num_programs(1)
        if ADD:
            gl.atomic_add(Y + n, out, mask=n < N, sem="relaxed")  # a RED: nothing comes back, nothing waits
            if NORMED and tile_n == 0:  # (every column tile's split has the same squares: its inputs')
                gl.store(Squares + gl.program_id(1), squares)
        elif splits == 1:
            _store_y(out, Y, n, N, squares, K, eps, NORMED)
        else:
            split = gl.program_id(1)
            gl.store(Partials + split * N + n, out, mask=n < N)
            if NORMED:  # (every column tile's split stores the same value: its inputs' squares)
                gl.store(Partials + splits * N + split, squares)
            warps_barrier()  # every thread's partial stored before the arrival (split_k.last_arrival)
            if gl.atomic_add(Counters + tile_n, 1, sem="acq_rel") == splits - 1:
                gl.store(Counters + tile_n, 0)
                fix_l: gl.constexpr = gl.BlockedLayout([_FIX_CHUNK, 2], [1, 32], [1, WARPS_], [1, 0])
                rows = gl.arange(0, _FIX_CHUNK, layout=gl.SliceLayout(1, fix_l))[:, None]
                cols = gl.convert_layout(n, gl.SliceLayout(0, fix_l))[None, :]
                total = gl.zeros([_BLOCK_N], gl.float32, layout=gl.SliceLayout(0, fix_l))
                squares_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS_], [0])  # a split's squares a lane
                lanes = gl.arange(0, _FIX_CHUNK, layout=squares_l)
                all_squares = 0.0
                for first in range(0, splits, _FIX_CHUNK):  # chunks in split order, each summed in a fixed order
                    ok = (first + rows < splits) & (cols < N)
                    total += gl.sum(gl.load(Partials + (first + rows) * N + cols, mask=ok, other=0.0,
                                            cache_modifier=".cg"), axis=0)
                    if NORMED:
                        split_squares = Partials + splits * N + first + lanes
                        all_squares += gl.sum(gl.load(split_squares, mask=first + lanes < splits, other=0.0,
                                                      cache_modifier=".cg"), axis=0)
                _store_y(gl.convert_layout(total, cols_l), Y, n, N, all_squares, K, eps, NORMED)

    @gluon.jit
    def _store_y(y, Y, n, N, squares, K, eps, NORMED: gl.constexpr):
        """Columns n of y (fp32) into Y in its dtype; NORMED: y / rms, from the row's sum of squares."""
        if NORMED:
            y = y * inv_rms(squares, K, eps)
        gl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)


def _descriptors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """TMA descriptors over the packed weight [K // 8, N] (boxes of [16, 256]), the scales [groups, N] and the zero
    points read as bytes [groups, N // 2] (a byte: two columns), boxes of a tile's groups."""
    tile_groups = TILE_ROWS * 8 // group
    boxes = ((qweight, [TILE_ROWS, BLOCK_N], gl.int32), (scales, [tile_groups, BLOCK_N], gl.bfloat16),
             (zeros.view(torch.int8), [tile_groups, BLOCK_N // 2], gl.int8))
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                             gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.primitive_bitwidth,
                                                  rank=2))
            for t, box, dtype in boxes]
