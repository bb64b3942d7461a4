"""The W4A16 GEMV's weight loop on tensor cores: ``w4_gemv_hopper``'s kernel (TMA copies issued before the wait,
x tables once a program, split-K fix-up) with a body that leaves the multiply-adds to ``mma.sync`` instead of HFMA2.

Why: in the batch-1 decode graph the GEMVs' math runs after each one's wait for x, bound by instruction issue at about
15.5 instructions a packed int32 (figures/h200/sweeps/decode_graph_probes.json: 0.37 ms of 1.785 a token). Here the
tensor core does the products and the sum over K, and a packed int32 costs seven ALU instructions to dequantize.

The swap-AB product. y^T = W^T x: W^T is the A operand of ``mma.sync.m16n8k16`` (16 output columns by 16 inputs), x
the B operand (16 inputs by 8, every column x itself: all eight of C's columns come out equal and one is kept).

- **A from a packed int32 in seven instructions.** Nibble pair (j, j + 4) of an int32 (GPTQ order: nibble j is input
  8r + j) becomes two bf16 by OR-ing them into the mantissa of 128.0 (0x4300): (w & 0x000F000F) | 0x43004300 is
  (128 + q0, 128 + q4). The odd nibbles are shifted one bit short of the bottom, so they sit at bits 3-6 and read
  128 + 8q (a nibble at bits 4-7 would reach the exponent). Three shifts, four LOP3s: four A registers.
- **The order of K is free**, so each thread's registers are whole int32s: a quad of lanes (one A row, one column)
  holds four packed rows of that column, lane t row 2t (+1), and A's k slots (2t, 2t + 1) carry nibbles (0, 4) or
  (2, 6), (2t + 8, 2t + 9) nibbles (1, 5) or (3, 7). B carries x in the same order, the odd nibbles' x divided by 8.
- **The offsets come off per group**: the products sum to sum (q + 128) x over even inputs and (q + 16) x over odd
  ones, so a group's sum less 128 E + 16 O (E, O: its sums of x over even and odd inputs) and z (E + O) is
  sum (q - z) x. Those per-column terms are formed apart from the loop, one thread a column, from the same scale and
  zero copies (``_offsets``).
- **Conflict-free shared memory.** A program's weights land through a 4-D TMA box [2, 4, 16, 32] with the 128-byte
  swizzle: warp w's two halves of 32 columns (A rows g and g + 8), 16 packed rows each. Lane (g, t) loads 16 bytes (4
  columns) of rows 2t and 2t + 1; the swizzle puts the 8 lanes of each quarter-warp on distinct banks.

What it takes beyond ``w4_gemv_hopper.unsupported``: N a multiple of 64 (two 32-column halves a warp).
"""

from __future__ import annotations

import torch

from minillm.kernels import w4_gemv_hopper as hopper
from minillm.kernels.checks import num_sms
from minillm.kernels.flash_attention_hopper import GLUON_USABLE, gluon
from minillm.kernels.pdl import supported as pdl_supported
from minillm.kernels.split_k import tile_counters
from minillm.kernels.w4_gemv_norms import SUMSQ_COLUMNS, Norm

HALF = 32  # columns a swizzled box row (128 bytes): a warp's A rows g (first half) and g + 8 (second)
WARP_COLUMNS = 2 * HALF
BLOCK_ROWS = 8  # packed rows a load: lane t's rows 2t and 2t + 1

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from minillm.kernels.flash_attention_hopper import tma_load, warps_barrier
    from minillm.kernels.w4_gemv_hopper import (_finish, _fma2, _let_next_start, _prmt, _table, _wait_for_previous,
                                                 _word_sum, _x_inputs)

    _MAGIC = gl.constexpr(0x43004300)  # 128.0 in both halves
    _HALF, _BLOCK_ROWS, WARP_COLUMNS_ = gl.constexpr(HALF), gl.constexpr(BLOCK_ROWS), gl.constexpr(WARP_COLUMNS)

    @gluon.jit
    def _or_magic(w, MASK: gl.constexpr):
        """(w & MASK) | 0x43004300 in one LOP3 (the constant in a register: LOP3 takes one immediate)."""
        magic = gl.full(w.shape, 0x43004300, gl.int32, layout=w.type.layout)
        if MASK == 0x000F000F:
            return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, $2, 0xea;", "=r,r,r", [w, magic],
                                             dtype=gl.int32, is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x00780078, $2, 0xea;", "=r,r,r", [w, magic],
                                             dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _dequantize(w, NIBBLE: gl.constexpr):
        """Nibbles (NIBBLE, NIBBLE + 4) of packed int32s w as two bf16 each: 128 + q (NIBBLE even), 128 + 8q (odd)."""
        if NIBBLE == 0:
            return _or_magic(w, 0x000F000F)
        elif NIBBLE == 1:
            return _or_magic(w >> 1, 0x00780078)
        elif NIBBLE == 2:
            return _or_magic(w >> 8, 0x000F000F)
        else:
            return _or_magic(w >> 9, 0x00780078)

    @gluon.jit
    def _mma(a0, a1, a2, a3, b0, b1, c):
        """One ``mma.sync.m16n8k16`` (bf16 in, fp32 sums) per element: A's registers a0-a3 (rows g and g + 8: the
        halves' columns; k slots 2t, 2t + 1, then 2t + 8, 2t + 9), B's b0, b1 (x's pairs, all 8 columns alike), C the
        four sums so far (C's columns are equal: c[0], c[1] the first half's column, c[2], c[3] the second's)."""
        return gl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, c[0], c[1], c[2], c[3]],
            dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)

    @gluon.jit
    def _x_tables(XW, first_row, K_ROWS, NormW, SumSq, eps, ROWS: gl.constexpr, WARPS_: gl.constexpr,
                  GATED: gl.constexpr, NORMED: gl.constexpr, SUMSQ_TILES: gl.constexpr):
        """x as B wants it, in shared memory: [ROWS, 4] int32, row r's pairs (x_8r+j, x_8r+j+4) for j = 0..3 (odd j
        divided by 8), and [ROWS] fp32 each, the rows' sums of x and of what the magic offsets add (128 times the
        even inputs, 16 times the odd). Arguments as ``w4_gemv_hopper._x_tables``."""
        w0, w1, w2, w3 = _x_inputs(XW, first_row, K_ROWS, NormW, SumSq, eps, ROWS, WARPS_, GATED, NORMED, SUMSQ_TILES)
        eighth: gl.constexpr = 0x3E003E00
        p0, p1 = _prmt(w0, w2, 0x5410), _fma2(_prmt(w0, w2, 0x7632), eighth, 0)
        p2, p3 = _prmt(w1, w3, 0x5410), _fma2(_prmt(w1, w3, 0x7632), eighth, 0)
        pairs = gl.reshape(gl.permute(gl.join(gl.join(p0, p1), gl.join(p2, p3)), [0, 2, 1]), [ROWS, 4])
        table = gl.allocate_shared_memory(gl.int32, [ROWS, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        table.store(pairs)
        total = _word_sum(w0) + _word_sum(w1) + _word_sum(w2) + _word_sum(w3)
        even = _low_fp32(w0) + _low_fp32(w1) + _low_fp32(w2) + _low_fp32(w3)
        return table, _table(total), _table(112.0 * even + 16.0 * total)

    @gluon.jit
    def _low_fp32(w):
        """The low bf16 of each int32 of w (its even input), in fp32."""
        return (w << 16).to(gl.float32, bitcast=True)

    @gluon.jit
    def _block_sums(w_tile, pairs, ROW: gl.constexpr, FIRST: gl.constexpr, c, w_l: gl.constexpr, e_l: gl.constexpr):
        """C sums c plus the products of the tile's packed rows ROW to ROW + 8 (x's rows from FIRST + ROW): two mmas
        an element, nibbles (0, 4) and (1, 5), then (2, 6) and (3, 7)."""
        x_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, e_l))
        words_l: gl.constexpr = gl.BlockedLayout([2, 4], [4, 8], [1, gl.num_warps()], [0, 1])
        w = w_tile.slice(ROW, _BLOCK_ROWS, dim=2).load(w_l)
        w0, w1 = gl.split(gl.permute(w, [1, 2, 3, 0]))
        w0 = gl.convert_layout(w0, e_l)
        w1 = gl.convert_layout(w1, e_l)
        even, odd = gl.split(gl.reshape(pairs.slice(FIRST + ROW, _BLOCK_ROWS).load(words_l), [_BLOCK_ROWS, 2, 2]))
        x0, x2 = gl.split(even)
        x1, x3 = gl.split(odd)
        x0 = gl.broadcast(gl.convert_layout(x0, x_l)[None, :, None], w0)[0]
        x1 = gl.broadcast(gl.convert_layout(x1, x_l)[None, :, None], w0)[0]
        x2 = gl.broadcast(gl.convert_layout(x2, x_l)[None, :, None], w0)[0]
        x3 = gl.broadcast(gl.convert_layout(x3, x_l)[None, :, None], w0)[0]
        c = _mma(_dequantize(w0, 0), _dequantize(w1, 0), _dequantize(w0, 1), _dequantize(w1, 1), x0, x1, c)
        return _mma(_dequantize(w0, 2), _dequantize(w1, 2), _dequantize(w0, 3), _dequantize(w1, 3), x2, x3, c)

    @gluon.jit
    def _w4_gemv_mma_kernel(XW, w_desc, s_desc, z_desc, Y, Partials, Counters, N, K_ROWS, R, SumSqOut, NormW, SumSqIn,
                            eps, TILES: gl.constexpr, GROUP_ROWS: gl.constexpr, PDL: gl.constexpr,
                            GATED: gl.constexpr, ADD: gl.constexpr, NORMED: gl.constexpr,
                            SUMSQ_TILES: gl.constexpr):
        """``w4_gemv_hopper._w4_gemv_kernel`` with the tensor-core body (this module's docstring)."""
        WARPS_: gl.constexpr = gl.num_warps()
        TILE_ROWS: gl.constexpr = 16
        BLOCK_N: gl.constexpr = 256
        GROUPS: gl.constexpr = TILE_ROWS // GROUP_ROWS
        tile_n = gl.program_id(0)
        split = gl.program_id(1)
        n0 = tile_n * BLOCK_N
        first_row = split * (TILES * TILE_ROWS)

        w_smem = gl.allocate_shared_memory(gl.int32, [TILES, 2, WARPS_, TILE_ROWS, _HALF], w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [TILES, GROUPS, BLOCK_N], s_desc.layout)
        z_smem = gl.allocate_shared_memory(gl.int8, [TILES, GROUPS, BLOCK_N // 2], z_desc.layout)
        landed = gl.allocate_shared_memory(gl.int64, [TILES, 1], mbarrier.MBarrierLayout())
        for t in gl.static_range(TILES):
            mbarrier.init(landed.index(t), count=1)
        fence_async_shared()
        for t in gl.static_range(TILES):
            row = first_row + t * TILE_ROWS
            if row < K_ROWS:
                mbarrier.expect(landed.index(t), w_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + z_desc.block_type.nbytes)
                tma_load(w_desc, [0, n0 // WARP_COLUMNS_, row, 0], landed.index(t), w_smem.index(t))
                tma_load(s_desc, [row // GROUP_ROWS, n0], landed.index(t), s_smem.index(t))
                tma_load(z_desc, [row // GROUP_ROWS, n0 // 2], landed.index(t), z_smem.index(t))
        _let_next_start(PDL)
        _wait_for_previous(PDL)
        pairs, sums, offset_sums = _x_tables(XW, first_row, K_ROWS, NormW, SumSqIn, eps, TILES * TILE_ROWS, WARPS_,
                                             GATED, NORMED, SUMSQ_TILES)
        warps_barrier()

        # [half, warp, row, column]: lane (g, t) rows 2t, 2t + 1 and 4 columns; the halves in its registers.
        w_l: gl.constexpr = gl.BlockedLayout([2, 1, 2, 4], [1, 1, 4, 8], [1, WARPS_, 1, 1], [0, 2, 3, 1])
        e_l: gl.constexpr = gl.BlockedLayout([1, 2, 4], [1, 4, 8], [WARPS_, 1, 1], [1, 2, 0])  # [warp, row, column]
        r_l: gl.constexpr = gl.BlockedLayout([1, 1, 2, 4], [1, 4, 1, 8], [WARPS_, 1, 1, 1], [2, 1, 3, 0])
        c_l: gl.constexpr = gl.SliceLayout(2, r_l)  # [warp, lane t (copies), column]
        # One thread a column pair for the offsets (w4_gemv_hopper's layouts).
        tile_l: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, WARPS_], [1, 0])
        cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
        bytes_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS_], [1, 0])
        rows_l: gl.constexpr = gl.BlockedLayout([GROUP_ROWS], [32], [WARPS_], [0])
        out0 = gl.zeros([WARPS_, 4, _HALF], gl.float32, layout=c_l)
        out1 = gl.zeros([WARPS_, 4, _HALF], gl.float32, layout=c_l)
        offsets = gl.zeros([BLOCK_N], gl.float32, layout=cols_l)
        for t in gl.static_range(TILES):
            if first_row + t * TILE_ROWS < K_ROWS:
                mbarrier.wait(landed.index(t), 0)
                for g in gl.static_range(GROUPS):
                    zero = gl.zeros([WARPS_, _BLOCK_ROWS, _HALF], gl.float32, layout=e_l)
                    c = (zero, zero, zero, zero)
                    for blk in gl.static_range(GROUP_ROWS // _BLOCK_ROWS):
                        c = _block_sums(w_smem.index(t), pairs, g * GROUP_ROWS + blk * _BLOCK_ROWS, t * TILE_ROWS, c,
                                        w_l, e_l)
                    # The group's sums: a lane's two rows added; scaled per column.
                    g0 = gl.sum(gl.convert_layout(gl.reshape(c[0], [WARPS_, 4, 2, _HALF]), r_l), axis=2)
                    g1 = gl.sum(gl.convert_layout(gl.reshape(c[2], [WARPS_, 4, 2, _HALF]), r_l), axis=2)
                    halves = s_smem.index(t).slice(g, 1).reshape([WARPS_, 2, _HALF])  # [warp, half, column]
                    out0 += g0 * gl.broadcast(halves.slice(0, 1, dim=1).load(c_l).to(gl.float32), g0)[0]
                    out1 += g1 * gl.broadcast(halves.slice(1, 1, dim=1).load(c_l).to(gl.float32), g1)[0]
                    # What the offsets added and z sum x, times the scale, one thread a column pair.
                    scale = gl.sum(s_smem.index(t).slice(g, 1).load(tile_l).to(gl.float32), axis=0)
                    z_byte = gl.sum(z_smem.index(t).slice(g, 1).load(bytes_l).to(gl.int32) & 255, axis=0)
                    z = gl.convert_layout(gl.reshape(gl.join(z_byte & 15, z_byte >> 4), [BLOCK_N]), cols_l)
                    x_sum = gl.sum(sums.slice(t * TILE_ROWS + g * GROUP_ROWS, GROUP_ROWS).load(rows_l), axis=0)
                    added = gl.sum(offset_sums.slice(t * TILE_ROWS + g * GROUP_ROWS, GROUP_ROWS).load(rows_l), axis=0)
                    offsets += scale * (z.to(gl.float32) * x_sum + added)

        # The halves' columns (lane copies dropped) in the fix-up's layout.
        both = gl.permute(gl.join(out0, out1), [0, 1, 3, 2])  # [warp, lane t, half, column]
        out = gl.convert_layout(gl.reshape(gl.max(both, axis=1), [BLOCK_N]), cols_l) - offsets
        _finish(out, Y, Partials, Counters, tile_n, N, R, SumSqOut, WARPS_, ADD)


def unsupported(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int) -> str | None:
    """Why this body cannot run these inputs (``w4_gemv_hopper.unsupported``'s reasons, and N), or None."""
    reason = hopper.unsupported(x, qweight, scales, zeros, group)
    if reason is None and qweight.shape[1] % WARP_COLUMNS:
        return f"the tensor-core body needs N a multiple of {WARP_COLUMNS}, not {qweight.shape[1]}"
    return reason


def _descriptors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """The packed weight [K // 8, N] seen as [half, N // 64, K // 8, 32] (boxes [2, 4, 16, 32], 128-byte swizzle),
    and ``w4_gemv_hopper``'s scale and zero point descriptors."""
    k_rows, n = qweight.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)
    weights = TensorDescriptor(qweight, [2, n // WARP_COLUMNS, k_rows, HALF], [HALF, WARP_COLUMNS, n, 1],
                               [2, hopper.WARPS, hopper.TILE_ROWS, HALF], layout)
    return [weights, *hopper._descriptors(qweight, scales, zeros, group)[1:]]


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
            out: torch.Tensor, partials: torch.Tensor, counters: torch.Tensor, pdl: bool,
            tiles: int | None = None, gated: bool = False, residual: torch.Tensor | None = None,
            sumsq: torch.Tensor | None = None, norm: Norm | None = None) -> None:
    """``w4_gemv_hopper.w4_gemv`` with the tensor-core body (same arguments but ``run``)."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    tiles = tiles or hopper.choose_tiles(k, n, num_sms(x.device))
    splits = hopper.splits_needed(k, tiles)
    grid = (-(-n // hopper.BLOCK_N), splits)
    words = x.view(torch.int32)
    added = (residual, sumsq) if residual is not None else (out, partials)
    normed = (norm.weight.view(torch.int32), norm.sumsq, norm.eps) if norm else (words, partials, 0.0)
    sumsq_tiles = 1 << max(0, (-(-k // SUMSQ_COLUMNS) - 1).bit_length()) if norm else 1
    _w4_gemv_mma_kernel[grid](words, *_descriptors(qweight, scales, zeros, group), out, partials, counters,
                              n, k // 8, *added, *normed, TILES=tiles, GROUP_ROWS=group // 8, PDL=pdl, GATED=gated,
                              ADD=residual is not None, NORMED=norm is not None, SUMSQ_TILES=sumsq_tiles,
                              num_warps=hopper.WARPS, launch_pdl=pdl)


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
         out: torch.Tensor, gated: bool = False, residual: torch.Tensor | None = None,
         sumsq: torch.Tensor | None = None, norm: Norm | None = None) -> None:
    """``w4_gemv_hopper.gemv`` with the tensor-core body."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    tiles = hopper.choose_tiles(k, n, num_sms(x.device))
    splits = hopper.splits_needed(k, tiles)
    partials = torch.empty(splits * n if splits > 1 else 1, dtype=torch.float32, device=x.device)
    w4_gemv(x, qweight, scales, zeros, group, out, partials, tile_counters(x.device), pdl_supported(x.device),
            tiles=tiles, gated=gated, residual=residual, sumsq=sumsq, norm=norm)
