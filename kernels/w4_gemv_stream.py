"""A persistent, stream-K W4A16 GEMV (M = 1) for Hopper (sm_90), in Gluon: each program streams a contiguous run of
the weight's tiles through a ring of TMA slots, computing each tile as it lands.

Why it exists: the split-K GEMV (``w4_gemv_hopper_kernel.py``) puts the whole weight in flight at once, one program
per 16-32 KB, and then waits. Its copies alone take 7.0 us at 4096 x 11008 (81 % of the copy bandwidth), but the
kernel 9.9: the tiles that land last are computed after the stream has ended, and the split-K fix-up behind them
(a fenced atomic, the partials' round trip) adds ~1.5 us more (figures/h200/sweeps/w4a16_gemv_probe.json). Both are
bubbles in which HBM idles. This kernel aims at the other end: few programs (PROGRAMS_PER_SM an SM), each with a
ring of STAGES tiles in flight, so that

- the math trails the stream tile by tile, and only the last tile's is left when the stream ends;
- a program's shared memory is small enough that the next GEMV's programs, launched early (PDL), fit beside it and
  fill their rings (and ask L2 for their next tiles: ``L2_TILES``) while this one finishes its math and fix-up.

The work: units of 16 packed rows (128 inputs) x 256 columns, numbered column tile by column tile (u = c KT + j);
program p takes units [p U / P, (p + 1) U / P) (stream-K's contiguous split: Osama, Merrill, Cecka, Garland, Rennich,
"Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on the GPU", 2023,
https://arxiv.org/abs/2301.03598). A column tile whose units one program holds whole is written by it; otherwise its
other programs store their partials as they finish (``st.relaxed.gpu``: strong, as the PTX memory model wants of
stores that loads read while they are written), and its first program (whose run ends in it) reads them
from L2 until none is EMPTY, sums them in a fixed order (the same bits every run) and writes y, leaving the slots
EMPTY for the next launch (FIXUP_POLL: no fence and no counter, one L2 round trip after the last partial lands, where
``split_k.py``'s last-arrival fix-up, FIXUP_COUNTER here, takes three). The poll waits for other programs, so all P
must be resident at once: ``w4_gemv_stream`` refuses a launch whose programs an SM do not fit (``programs_that_fit``).
A unit's slots, copies and math are the split-K kernel's (``w4_gemv_hopper_kernel.tile_slots``, ``load_tile``,
``add_tile``).

Measured on the H200 (figures/h200/sweeps/w4a16_gemv_stream.json, w4a16_gemv_stream_start.json; 20 calls in a CUDA
graph, each on another copy of the weights, against torch's bf16 matmul in the same rounds): the ring's copies alone
5.8-6.2 us at 4096 x 11008 and 11008 x 4096 (the split-K kernel's 7.0); y added to an fp32 row (ADD, no fix-up)
7.18-7.23 and 7.15-7.16 us, 3.29-3.37x and 3.45-3.49x the bf16 matmul; a bf16 y with the fix-up 9.16-9.27 and
9.06-9.09 (the split-K kernel 9.60-9.65 and 9.65-9.67). Letting the next kernel start after the last copy (START 1)
or asking L2 for later units (L2_TILES) was slower. In the batch-1 decode graph, though, the four add forms on this
kernel made a token 1.8016 ms against 1.5543 (figures/h200/sweeps/decode_graph_stream.json): launched early behind the
GEMV ahead, the split-K kernel's resident programs put their whole share of the weight in flight, this one only its
rings, and its programs, sized for an idle GPU, share the SMs with the kernels launched around them. With the next
kernel let start only at its end (START 2), 1.6076 against 1.5552 (decode_graph_stream_start.json): o_proj faster
(4.08 against 5.98 us), qkv_proj slower (10.19 against 5.79), having lost the head start the split-K qkv_proj gets
during down_proj. So ``w4_gemv_hopper.gemv`` runs the add forms on it only where MINILLM_GEMV_STREAM names them.

The plain form (a bf16 y) with the poll (figures/h200/sweeps/w4a16_gemv_stream_poll.json): 8.61 and 9.16 us, 2.86x and
2.74x the bf16 matmul, against the counter's 9.33 and 9.04 and the split-K kernel's 9.58 and 9.69; where ~25 programs
share a tile (11008 x 4096) the counter wins, hence ``choose_fixup``. At 4096 x 4096 (2 x 3) the counter takes
5.03-5.04 against split-K's 5.52-5.56, not yet measured in a decode graph, so ``poll_pays`` keeps such shapes on
split-K. Summing a tile in one of its programs with a shorter run, which is done (and polls) earlier, was slower still
(10.09 and 11.77 us, w4a16_gemv_stream_short.json). Programs that own their columns over all of K need no fix-up;
session 32's, fetching 32 columns in 2 KB boxes, copied slower (7.58 and 11.20 us against this kernel's 6.13 and
6.01): 11.63 and 14.09 us (commit d11bda5; w4a16_gemv_columns.json, w4a16_gemv_columns_probe.json). In 16 KB boxes
such strips copy in 6.53 and 6.64 (w4a16_strip_copies.json): ``w4_gemv_columns.py`` now takes them. Eight warps a
program, a column a thread, one program an SM (its last unit's math after the stream one unit's, not three's), could
not keep its math up with its copies: 9.53 and 9.39 us without any fix-up against 3 x 2's 7.38 and 7.30 (commit
9f2e921, reverted; w4a16_gemv_stream_w8.json). In the batch-1 decode graph with nothing folded (the norm kernels,
as under tensor parallelism) qkv_proj and gate_up_proj on this kernel make a token 1.8073 ms against 1.8966
(decode_graph_stream_plain.json), so ``gemv`` runs the plain form there by default. With the norms folded (every
GEMV an add form) each placement of the add forms on it was slower in ``minillm bench latency``, one process a run
(latency_stream_placement.json; MINILLM_GEMV_STREAM_START sets START for such sweeps).

What it takes (``unsupported``): one bf16 row (fp32 for the normed and scaled forms), K a multiple of 128, N of 32,
group 64 or 128; the gated and normed forms only with ADD. Not under Triton's interpreter (Gluon has none): tested on
an sm_90 GPU (tests/kernels/test_w4_gemv_stream.py, and the fused forms' tests with MINILLM_GEMV_STREAM=1); compiled
for sm_90 on the CPU by tests/test_w4_gemv_stream_sass.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.runtime.errors import OutOfResources

from minillm.kernels.checks import num_sms
from minillm.kernels.w4_gemv_norms import Norm, Rms
from minillm.kernels.flash_attention_hopper import GLUON_USABLE, gluon

if GLUON_USABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from minillm.kernels.flash_attention_hopper import reinterpret, warps_barrier
    from minillm.kernels.w4_gemv_hopper_kernel import (_let_next_start, _wait_for_previous, add_tile, load_tile,
                                                       tile_slots, x_pairs)
    from minillm.kernels.w4_gemv_norms import stored_inv_rms

from minillm.kernels.w4_gemv_hopper_kernel import BLOCK_N, RUN, SUB_ROWS, TILE_ROWS, _descriptors

WARPS = 4
# How a column tile that several programs share gets its y (the kernel's FIXUP): FIXUP_POLL, its first program reads
# the others' partials until none is EMPTY; FIXUP_COUNTER, the last to arrive at a counter sums them (split_k.py's);
# FIXUP_NONE, partials stored, not summed (a probe: y is wrong).
FIXUP_NONE, FIXUP_COUNTER, FIXUP_POLL = 0, 1, 2
EMPTY = -1  # an unstored partial's bits in the poll's slots: a NaN (0xFFFFFFFF) that GPU arithmetic does not return
# (its NaNs are 0x7FFFFFFF); a partial with these bits is stored as 0x7FFFFFFF all the same


def start_switch(value: str) -> int:
    """MINILLM_GEMV_STREAM_START's value as the kernel's START (0, 1 or 2); a ValueError names what is valid."""
    if value.strip() not in ("0", "1", "2"):
        raise ValueError(f"MINILLM_GEMV_STREAM_START must be 0, 1 or 2 (the kernel's START), got {value!r}")
    return int(value)


# When ``w4_gemv_hopper.gemv``'s launches let the next kernel start (the kernel's START; a sweep may change it, or set
# MINILLM_GEMV_STREAM_START).
START = start_switch(os.environ.get("MINILLM_GEMV_STREAM_START", "0"))

if GLUON_USABLE:
    _TILE_ROWS_S, _BLOCK_N_S = gl.constexpr(TILE_ROWS), gl.constexpr(BLOCK_N)
    _SUB_ROWS_S, _RUN_S = gl.constexpr(SUB_ROWS), gl.constexpr(RUN)
    _FIXUP_COUNTER_S, _FIXUP_POLL_S = gl.constexpr(FIXUP_COUNTER), gl.constexpr(FIXUP_POLL)
    _EMPTY_S, _NAN_S = gl.constexpr(EMPTY), gl.constexpr(0x7FFFFFFF)

    @gluon.jit
    def _program_of(u, P, U):
        """The program whose run holds unit u: the largest p with p U // P <= u."""
        return ((u + 1) * P - 1) // U

    @gluon.jit
    def _load_unit(u, KT, w_desc, s_desc, z_desc, bar, w_slot, s_slot, z_slot, GROUP_ROWS: gl.constexpr):
        """Unit u's packed weights, scales and zero points into a slot, landing on ``bar``."""
        load_tile((u % KT) * _TILE_ROWS_S, (u // KT) * _BLOCK_N_S, w_desc, s_desc, z_desc, bar, w_slot, s_slot,
                  z_slot, GROUP_ROWS)

    @gluon.jit
    def _prefetch_unit(WP, u, KT, N, K_ROWS, WARPS_: gl.constexpr):
        """Ask L2 for unit u's packed weights: its 16 rows of 1 KB, eight 128-byte lines each (a line a thread)."""
        lines_l: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS_, 1], [1, 0])
        r = (u % KT) * _TILE_ROWS_S + gl.arange(0, _TILE_ROWS_S, layout=gl.SliceLayout(1, lines_l))[:, None]
        col = (u // KT) * _BLOCK_N_S + 32 * gl.arange(0, 8, layout=gl.SliceLayout(0, lines_l))[None, :]
        ok = (r < K_ROWS) & (col < N)
        ptrs = WP + gl.where(ok, r * N + col, 0)
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _run_tables(XW, u0, n_units, KT, K_ROWS, NormW, inv, UNITS: gl.constexpr, WARPS_: gl.constexpr,
                    GATED: gl.constexpr, NORMED: gl.constexpr, SCALED: gl.constexpr):
        """x's pair tables and row sums for the program's units, [UNITS, 16] each in shared memory: row r of unit t is
        packed row (u0 + t) % KT * 16 + r of x (``w4_gemv_hopper_kernel._x_tables`` has the pairs' arithmetic and the
        forms GATED, NORMED and SCALED). NORMED: also the sum of squares of the inputs of the program's units of column
        tile 0, whose programs between them hold every row of K once (0 for the others)."""
        tab_l: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [WARPS_, 1], [1, 0])
        t = gl.arange(0, UNITS, layout=gl.SliceLayout(1, tab_l))[:, None]
        r = ((u0 + t) % KT) * _TILE_ROWS_S + gl.arange(0, _TILE_ROWS_S, layout=gl.SliceLayout(0, tab_l))[None, :]
        ok = (t < n_units) & (r < K_ROWS)
        values, total, squares = x_pairs(XW, r, ok, K_ROWS, NormW, inv, GATED, NORMED, SCALED)
        if NORMED:
            squares = gl.sum(gl.sum(gl.where((u0 + t < KT) & ok, squares, 0.0), axis=1), axis=0)
        pairs = (_table2(values[0]), _table2(values[1]), _table2(values[2]), _table2(values[3]))
        return pairs, _table2(total), squares

    @gluon.jit
    def _table2(values):
        """values [UNITS, 16] in shared memory, viewed with a layout of one rank less: what .index(unit) leaves."""
        table = gl.allocate_shared_memory(values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        table.store(values)
        return reinterpret(table, values.dtype, values.shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _flush(out, c, p, P, U, KT, Y, Partials, Counters, N, MAX_SLOTS: gl.constexpr, FIXUP: gl.constexpr,
               ADD: gl.constexpr, WARPS_: gl.constexpr):
        """Column tile c's part of y from program p: y itself if p holds all of c's units, else a partial, summed
        with the others in an order fixed by the plan (deterministic) by c's first program (FIXUP_POLL: c is the last
        tile of its run, so it waits only at its end) or by the last to arrive (FIXUP_COUNTER). ADD: Y is an fp32
        row and each program adds its part to it (a RED: no fix-up)."""
        cols_l: gl.constexpr = out.type.layout
        cols = gl.arange(0, _BLOCK_N_S, layout=cols_l)
        n = c * _BLOCK_N_S + cols
        first = _program_of(c * KT, P, U)
        count = _program_of((c + 1) * KT - 1, P, U) - first + 1
        tile = Partials + c * MAX_SLOTS * _BLOCK_N_S  # c's slots, a program's partial each
        if ADD:
            gl.atomic_add(Y + n, out, mask=n < N, sem="relaxed")
        elif count == 1:
            gl.store(Y + n, out.to(Y.dtype.element_ty), mask=n < N)
        elif FIXUP == _FIXUP_POLL_S:
            words = tile.to(gl.pointer_type(gl.int32))
            if p == first:
                y = _sum_when_stored(out, words, count, MAX_SLOTS, WARPS_)
                gl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)
            else:  # a NaN's bits made canonical, so that no partial reads as "not stored yet"
                bits = out.to(gl.int32, bitcast=True)
                _store_relaxed(words + (p - first) * _BLOCK_N_S + cols, gl.where(bits == _EMPTY_S, _NAN_S, bits))
        else:
            gl.store(tile + (p - first) * _BLOCK_N_S + cols, out)
            if FIXUP == _FIXUP_COUNTER_S:
                warps_barrier()  # every thread's partial stored before the arrival
                if gl.atomic_add(Counters + c, 1, sem="acq_rel") == count - 1:
                    gl.store(Counters + c, 0)
                    slots, fcols = _slot_grid(MAX_SLOTS, WARPS_)
                    parts = gl.load(tile + slots * _BLOCK_N_S + fcols, mask=(slots < count) & (fcols < _BLOCK_N_S),
                                    other=0.0, cache_modifier=".cg")
                    y = gl.convert_layout(gl.sum(parts, axis=0), cols_l)
                    gl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)

    @gluon.jit
    def _store_relaxed(ptrs, bits):
        """A partial's words stored with ``st.relaxed.gpu``: the poll's volatile loads (relaxed, system scope) read them
        while they are written, which the PTX memory model allows between strong operations only (a plain store is
        weak: a data race, however aligned)."""
        gl.inline_asm_elementwise("st.relaxed.gpu.global.b32 [$1], $2; // $0 unused", "=r,l,r", [ptrs, bits],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _slot_grid(MAX_SLOTS: gl.constexpr, WARPS_: gl.constexpr):
        """A column tile's slots [MAX_SLOTS, 1] and columns [1, BLOCK_N], laid out for the fix-ups: a thread's two
        columns in every slot, so that the sum over slots stays in its registers."""
        fix_l: gl.constexpr = gl.BlockedLayout([MAX_SLOTS, 2], [1, 32], [1, WARPS_], [1, 0])
        slots = gl.arange(0, MAX_SLOTS, layout=gl.SliceLayout(1, fix_l))[:, None]
        fcols = gl.arange(0, _BLOCK_N_S, layout=gl.SliceLayout(0, fix_l))[None, :]
        return slots, fcols

    @gluon.jit
    def _sum_when_stored(own, words, count, MAX_SLOTS: gl.constexpr, WARPS_: gl.constexpr):
        """own (slot 0's partial, this program's) plus the sum of slots 1 .. count - 1, read from L2 until none is
        EMPTY (their programs store them as they finish: no fence, no counter), in a fixed order; the slots are left
        EMPTY again for the next launch."""
        slots, fcols = _slot_grid(MAX_SLOTS, WARPS_)
        ptrs = words + slots * _BLOCK_N_S + fcols
        peers = (slots >= 1) & (slots < count) & (fcols < _BLOCK_N_S)
        bits = gl.load(ptrs, mask=peers, other=0, volatile=True)
        while gl.max(gl.max(gl.where(bits == _EMPTY_S, 1, 0), axis=1), axis=0) > 0:  # (a REDUX a slot: no spill)
            bits = gl.load(ptrs, mask=peers, other=0, volatile=True)
        gl.store(ptrs, gl.full([MAX_SLOTS, _BLOCK_N_S], _EMPTY_S, gl.int32, slots.type.layout), mask=peers)
        return own + gl.convert_layout(gl.sum(bits.to(gl.float32, bitcast=True), axis=0), own.type.layout)

    @gluon.jit
    def _w4_gemv_stream_kernel(XW, WP, w_desc, s_desc, z_desc, Y, Partials, Counters, N, K_ROWS, KT, U, NormW, eps,
                               Squares, square_slots, norm_width, STAGES: gl.constexpr, UNITS: gl.constexpr,
                               GROUP_ROWS: gl.constexpr, MAX_SLOTS: gl.constexpr, PDL: gl.constexpr,
                               L2_TILES: gl.constexpr, COMPUTE: gl.constexpr, FIXUP: gl.constexpr, START: gl.constexpr,
                               ADD: gl.constexpr = False, GATED: gl.constexpr = False,
                               NORMED: gl.constexpr = False, SCALED: gl.constexpr = False,
                               SQUARE_SLOTS: gl.constexpr = 1):
        """Program p: units [p U / P, (p + 1) U / P) through a ring of STAGES slots (module docstring). UNITS: a power
        of two at least the longest run. FIXUP: the module's FIXUP_*. COMPUTE off: a probe (the copies alone).
        START: when the next kernel, launched early (PDL), may start: 0 before the wait, 1 once the program has
        issued its last copy (its ring and L2 asks then land during this kernel's last math and fix-up), 2 at the
        end. ADD, GATED, NORMED, SCALED: as ``w4_gemv_hopper_kernel._w4_gemv_kernel``'s, NORMED only with ADD (the
        programs that hold units of column tile 0 store their squares at Squares[p]: between them, the whole row's)."""
        WARPS_: gl.constexpr = gl.num_warps()
        GROUPS: gl.constexpr = _TILE_ROWS_S // GROUP_ROWS
        p = gl.program_id(0)
        P = gl.num_programs(0)
        u0 = p * U // P
        n_units = (p + 1) * U // P - u0

        w_smem, s_smem, z_smem, landed = tile_slots(w_desc, s_desc, z_desc, STAGES, GROUPS)
        for first in gl.static_range(STAGES):
            if first < n_units:
                _load_unit(u0 + first, KT, w_desc, s_desc, z_desc, landed.index(first), w_smem.index(first),
                           s_smem.index(first), z_smem.index(first), GROUP_ROWS)
        for t in gl.static_range(L2_TILES):
            if STAGES + t < n_units:
                _prefetch_unit(WP, u0 + STAGES + t, KT, N, K_ROWS, WARPS_)
        if (START == 0) | ((START == 1) & (n_units <= STAGES)):
            _let_next_start(PDL)
        _wait_for_previous(PDL)
        inv = 1.0
        if SCALED:
            inv = stored_inv_rms(Squares, square_slots, SQUARE_SLOTS, norm_width, eps, WARPS_)
        pairs, sums, squares = _run_tables(XW, u0, n_units, KT, K_ROWS, NormW, inv, UNITS, WARPS_, GATED, NORMED,
                                           SCALED)
        if NORMED:
            if u0 < KT:
                gl.store(Squares + p, squares)
        warps_barrier()  # the tables are written

        tile_l: gl.constexpr = gl.BlockedLayout([_SUB_ROWS_S // _RUN_S, 2], [1, 32], [1, WARPS_], [1, 0])
        cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)
        bytes_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS_], [1, 0])
        out = gl.zeros([_BLOCK_N_S], gl.float32, layout=cols_l)
        for i in range(n_units):
            s = i % STAGES
            mbarrier.wait(landed.index(s), (i // STAGES) & 1)
            u = u0 + i
            if COMPUTE:
                pairs_i = (pairs[0].index(i), pairs[1].index(i), pairs[2].index(i), pairs[3].index(i))
                out = add_tile(out, w_smem.index(s), s_smem.index(s), z_smem.index(s), pairs_i, sums.index(i), 0,
                               GROUP_ROWS, tile_l, bytes_l, _RUN_S)
            warps_barrier()  # every warp done with slot s
            if i + STAGES < n_units:
                _load_unit(u + STAGES, KT, w_desc, s_desc, z_desc, landed.index(s), w_smem.index(s),
                           s_smem.index(s), z_smem.index(s), GROUP_ROWS)
                if (START == 1) & (i + STAGES == n_units - 1):
                    _let_next_start(PDL)
            if ((u + 1) % KT == 0) | (i == n_units - 1):
                _flush(out, u // KT, p, P, U, KT, Y, Partials, Counters, N, MAX_SLOTS, FIXUP, ADD, WARPS_)
                out = gl.zeros([_BLOCK_N_S], gl.float32, layout=cols_l)
        if START == 2:
            _let_next_start(PDL)


def choose_shape(k: int, n: int, sms: int) -> tuple[int, int]:
    """(programs an SM, ring slots a program) for a K x N weight: 3 x 2 where that leaves a program at least three
    units, else 2 x 3 (H200, add form: 3 x 2 7.18 / 7.16 us at 4096 x 11008 / 11008 x 4096 against 2 x 3's 7.75 /
    7.68; at 4096 x 4096, 512 units, 2 x 3 3.62 against 3.91: figures/h200/sweeps/w4a16_gemv_stream.json)."""
    kt = -(-k // (8 * TILE_ROWS))
    return (3, 2) if kt * -(-n // BLOCK_N) >= 9 * sms else (2, 3)


def poll_pays(k: int, n: int, sms: int) -> bool:
    """Whether ``w4_gemv_hopper.gemv`` runs a bf16 y (the plain form) here rather than on the split-K kernel: where
    ``choose_shape`` gives 3 x 2, the shapes measured in the decode graph with nothing folded (qkv_proj, gate_up_proj:
    figures/h200/sweeps/decode_graph_stream_plain.json; alone 8.61 / 9.04 us at 4096 x 11008 / 11008 x 4096 against
    split-K's 9.58 / 9.69, w4a16_gemv_stream_poll.json)."""
    return choose_shape(k, n, sms) == (3, 2)


def choose_fixup(k: int, n: int, programs: int) -> int:
    """A bf16 y's fix-up: FIXUP_POLL where at most 16 programs share a column tile, FIXUP_COUNTER where more do (the
    poll reads every sharer's slot at each try; H200, 3 x 2: at 4096 x 11008, 9-10 programs a tile, poll 8.61 / 8.77
    against counter 9.33 / 9.32 us; at 11008 x 4096, ~25, poll 9.16 / 9.37 against 9.04 / 9.17:
    figures/h200/sweeps/w4a16_gemv_stream_poll.json, w4a16_gemv_stream_short.json)."""
    return FIXUP_POLL if plan(k, n, programs)["MAX_SLOTS"] <= 16 else FIXUP_COUNTER


@functools.lru_cache(maxsize=None)
def plan(k: int, n: int, programs: int) -> dict:
    """The launch's numbers for a K x N weight over ``programs`` programs: units U, units a column tile KT, the
    programs P (at most U), UNITS (a power of two at least the longest run) and MAX_SLOTS (a power of two at least the
    most programs sharing a column tile). Cached (an eager call asks up to four times, and the search over column
    tiles is a Python loop): read it, never change it."""
    kt = -(-k // (8 * TILE_ROWS))
    u = kt * -(-n // BLOCK_N)
    p = min(programs, u)

    def program_of(unit):  # (_program_of)
        return ((unit + 1) * p - 1) // u

    most = max(program_of((c + 1) * kt - 1) - program_of(c * kt) + 1 for c in range(u // kt))
    return {"U": u, "KT": kt, "P": p, "UNITS": triton.next_power_of_2(-(-u // p)),
            "MAX_SLOTS": triton.next_power_of_2(most)}


def partials_needed(k: int, n: int, programs: int) -> int:
    """fp32 the fix-up of a K x N weight over ``programs`` programs needs: MAX_SLOTS partials a column tile."""
    numbers = plan(k, n, programs)
    return numbers["U"] // numbers["KT"] * numbers["MAX_SLOTS"] * BLOCK_N


POLL_SLOTS = {}  # device -> int32 slots, EMPTY where no partial waits (FIXUP_POLL leaves them so)
RETIRED_SLOTS = []  # slots outgrown, kept for the CUDA graphs captured with them


def poll_slots(device: torch.device, needed: int) -> torch.Tensor:
    """The device's slots for FIXUP_POLL's partials, at least ``needed``, filled with EMPTY once (grown outside CUDA
    graph capture only: a captured launch keeps its slots' address). Like ``split_k.tile_counters``, one launch at a
    time a device: launches on two streams at once would share them."""
    slots = POLL_SLOTS.get(device)
    if slots is None or slots.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the stream GEMV's fix-up needs {needed} slots on {device}, more than it holds; run "
                               "this GEMV once before capturing a CUDA graph (warm-up does)")
        if slots is not None:  # (a captured graph may still write to the old slots: they are never freed)
            RETIRED_SLOTS.append(slots)
        slots = POLL_SLOTS[device] = torch.full((max(needed, 1 << 18),), EMPTY, dtype=torch.int32, device=device)
    return slots


def programs_that_fit(shared_bytes: int, registers: int, warps: int, device: torch.device) -> int:
    """Programs of a kernel using ``shared_bytes`` of shared memory and ``registers`` a thread that one SM holds at
    once: FIXUP_POLL's first programs wait for the others, so all P must be resident together."""
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    per_warp = -(-registers * 32 // 256) * 256  # (allocated 256 a warp at a time)
    return min(shared // (shared_bytes + 1024), regs // (per_warp * warps))  # (1 KB of an SM's reserved a program)


FITS = {}  # (device, K, N, the launch's constexprs) -> programs_that_fit


class DoesNotFit(ValueError):
    """FIXUP_POLL's programs cannot all be resident at once (``w4_gemv_hopper.gemv`` then runs the split-K kernel)."""


def w4_gemv_stream(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                   out: torch.Tensor, partials: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                   pdl: bool = True, programs_per_sm: int = 2, stages: int = 3, l2_tiles: int = 0,
                   compute: bool = True, fixup: int = FIXUP_POLL, start: int = 0, add: bool = False,
                   gated: bool = False, norm: Norm | None = None, squares: torch.Tensor | None = None,
                   rms: Rms | None = None) -> None:
    """y = x @ W into ``out`` [1, N] (x [1, K] bf16, GPTQ-packed qweight [K / 8, N], group 64 or 128). A bf16 y's
    column tiles that several programs share are summed by ``fixup``: FIXUP_POLL in the device's ``poll_slots``,
    FIXUP_COUNTER in ``partials`` (fp32, at least ``partials_needed``) with ``counters``
    (``split_k.tile_counters``), FIXUP_NONE not at all (a probe). ``add``: ``out`` is fp32 and y is added to it (no
    fix-up). With ``add``, the forms of ``w4_gemv_hopper.w4_gemv``: ``gated`` (x the gate_up row [1, 2K]; ``rms``:
    its 1 / rms left to this GEMV) and ``norm`` with ``squares`` (x the residual stream's fp32 row; y added without
    the norm's 1 / rms, the sums of squares left at ``squares``, a slot a program of column tile 0, at most
    K / 128)."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    reason = unsupported(k, n, group, x.dtype, x.shape[0], add, gated, norm is not None, rms is not None)
    if reason:
        raise ValueError(f"the stream GEMV cannot run these inputs: {reason}")
    if fixup not in (FIXUP_NONE, FIXUP_COUNTER, FIXUP_POLL):
        raise ValueError(f"fixup must be FIXUP_NONE, FIXUP_COUNTER or FIXUP_POLL (0, 1, 2), got {fixup!r}")
    programs = programs_per_sm * num_sms(x.device)
    numbers = plan(k, n, programs)
    needed = partials_needed(k, n, programs)
    if not add and fixup == FIXUP_POLL:
        partials = poll_slots(x.device, needed)
    elif not add and (partials is None or partials.numel() < needed or (fixup and counters is None)):
        raise ValueError(f"a bf16 y's fix-up {fixup} needs partials of at least {needed} floats"
                         f"{' and counters' if fixup else ''}; got {None if partials is None else partials.numel()} "
                         f"floats{' and no counters' if fixup and counters is None else ''}")
    if norm is not None and (squares is None or squares.numel() < numbers["KT"]):
        raise ValueError(f"a normed GEMV leaves its sums of squares in squares: fp32 with {numbers['KT']} slots, got "
                         f"{None if squares is None else squares.numel()}")
    partials = partials if partials is not None else out
    counters = counters if counters is not None else out
    weight, eps = (norm.weight.view(torch.int32), norm.eps) if norm else (partials, rms.eps if rms else 0.0)
    squares_at = squares if norm else rms.squares if rms else partials
    args = (x if norm or rms else x.view(torch.int32), qweight, *_descriptors(qweight, scales, zeros, group), out,
            partials, counters, n, k // 8, numbers["KT"], numbers["U"], weight, eps, squares_at,
            rms.squares.numel() if rms else 0, rms.width if rms else 0)
    constexprs = dict(STAGES=stages, UNITS=numbers["UNITS"], GROUP_ROWS=group // 8, MAX_SLOTS=numbers["MAX_SLOTS"],
                      PDL=pdl, L2_TILES=l2_tiles, COMPUTE=compute, FIXUP=fixup, START=start, ADD=add, GATED=gated,
                      NORMED=norm is not None, SCALED=rms is not None,
                      SQUARE_SLOTS=triton.next_power_of_2(rms.squares.numel()) if rms else 1)
    if not add and fixup == FIXUP_POLL:
        key = (x.device, k, n, tuple(sorted(constexprs.items())))  # (k, n: the compiler specialises on them)
        if key not in FITS:
            compiled = _w4_gemv_stream_kernel.warmup(*args, grid=(1,), **constexprs, num_warps=WARPS, launch_pdl=pdl)
            try:
                compiled._init_handles()  # (loading the binary gives its registers)
                FITS[key] = programs_that_fit(compiled.metadata.shared, compiled.n_regs, WARPS, x.device)
            except OutOfResources:
                FITS[key] = 0
        if FITS[key] < min(programs_per_sm, numbers["P"] / num_sms(x.device)):
            raise DoesNotFit(f"programs_per_sm={programs_per_sm}, but an SM holds {FITS[key]} of these programs at "
                             "once, and the poll's fix-up waits for all of them: ask for fewer, or fixup=FIXUP_COUNTER")
    _w4_gemv_stream_kernel[(numbers["P"],)](*args, **constexprs, num_warps=WARPS, launch_pdl=pdl)


def unsupported(k: int, n: int, group: int, dtype: torch.dtype, rows: int, add: bool = False, gated: bool = False,
                normed: bool = False, scaled: bool = False) -> str | None:
    """Why the stream GEMV cannot take a K x N weight at ``group`` with x of ``dtype`` and ``rows`` rows in this form,
    or None if it can (``w4_gemv_hopper.unsupported`` checks the rest: the device, alignment, Gluon)."""
    want = torch.float32 if normed or scaled else torch.bfloat16
    if dtype != want or rows != 1:
        return f"it takes one {want} row, not {rows} of {dtype}"
    if k % (8 * TILE_ROWS) or n % 32 or group not in (64, 128):
        return f"it takes K a multiple of 128, N of 32 and group 64 or 128; got K = {k}, N = {n}, group {group}"
    if (gated or normed) and not add:
        return "its gated and normed forms add y to a row (add=True)"
    if normed and gated:
        return "it applies SiLU-and-multiply to x or normalises it, not both"
    return None
