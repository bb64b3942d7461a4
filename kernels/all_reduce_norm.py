"""Tensor parallelism's all-reduce fused into the residual add and RMSNorm that follow it: one kernel
where NCCL's all-reduce and a norm kernel were two, twice per decoder layer.

Why: at batch 1 a TP=2 decode step of Llama-2-7B all-reduces a 4096-wide row 65 times, 8 KB each:
pure latency. On two H200s NCCL took 9 us a call, 587 us of a 3.38 ms step, and the norm kernel after
each call 2.1 us more (``figures/h200/tp_decode_profile.json``). Every all-reduce of a row-parallel
output is followed by ``x + residual`` and an RMSNorm (``model/llama.py``'s DecoderLayer), so one
kernel can do all three once the sum's bytes are in this GPU.

How: a *one-shot push* all-reduce, the scheme of vLLM's and TensorRT-LLM's custom all-reduce kernels,
here in Triton over PyTorch's symmetric memory (every rank maps every peer's buffer; NVLink carries
the stores), with NCCL's "LL" (low-latency) protocol for the handshake:

1. push: each program stores its rows of this rank's partial sum into every peer's buffer, in the
   slot of this rank, as 8-byte words that each hold 4 bytes of data and the call's *epoch*;
2. wait: it reads its rows of each peer's slot in this GPU's memory until every word carries the
   epoch. An aligned 8-byte store lands whole (NCCL's LL protocol relies on the same; it issues its
   stores volatile, these are plain), so a word with the epoch holds this call's data: no flag, no
   fence and no second trip over NVLink, which a flag written after a release fence costs
   (``figures/h200/latency_tp_fused.json``);
3. reduce: sum the partials in rank order, so every rank computes the same bits; round to the dtype
   as an all-reduce's output is; then the residual add and the norm of ``fused_layer_ops.rms_norm``.

The epoch: each program counts its calls in a device tensor (CUDA-graph replays read it current).
The grid is always ``programs`` wide and every rank makes the same calls, so program p's count is the
same on every rank. Slots alternate with the epoch's parity (double buffering): a peer can run at most
one call ahead (it cannot finish call n + 1 before this rank pushes call n + 1, which it does only after
its call n kernel has finished), so a peer never overwrites words that this rank has yet to read, and
the words of the slot being read carry either this call's epoch or the one two calls back. The wait is
for *equality* with the epoch and the parity is its low bit, so the int32 count may wrap (after 2**31
calls of a program: about a day of batch-1 decoding of Llama-2-7B at TP=2).

A wait that outlasts ``MAX_SPIN`` polls (tens of minutes, as NCCL's timeout here: a peer may be
compiling or autotuning a kernel) stops the kernel with a ``trap``, a CUDA error instead of a silent
hang: ranks that disagree on the sequence of calls (where NCCL would hang too).

Under the interpreter (CPU tests) one process plays every rank, which cannot spin while another rank
is yet to run: ``PHASE=1`` runs step 1 for each rank, then ``PHASE=2`` steps 2-3 (``phases``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check, interpreter_on
from .fused_layer_ops import rms_norm_ref
from .int_float import ASM
from .hopper.pdl import let_next_start, supported as pdl_supported

INTERPRET = interpreter_on()
MAX_SPIN = 1 << 30  # polls of a peer's row before the kernel traps: ~30 min at ~1-2 us a poll


def all_reduce_rms_norm_ref(partials: list[torch.Tensor], weight: torch.Tensor, eps: float,
                            residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' partial sums added in rank order in fp32 and rounded to their dtype (an all-reduce's
    output), then ``rms_norm_ref`` with the residual: (normed, new residual)."""
    total = torch.stack([p.float() for p in partials]).sum(0).to(partials[0].dtype)
    return rms_norm_ref(total, weight, eps, residual)


@dataclass
class Workspace:
    """One rank's view of the symmetric memory the kernel works in.

    buffer: this rank's int64 [2, world, max_rows, words] slots (parity, source rank) of rows of
    ``dtype`` in LL words (``words`` = hidden * itemsize / 4), which peers write; epochs: [programs + 1]
    int32, this rank's own count of calls per program, then a word the interpreter sets when a wait
    gives up; peer_buffers: int64 [world], the address of every rank's buffer as this process sees it
    (its own included, unused)."""

    rank: int
    world: int
    dtype: torch.dtype
    buffer: torch.Tensor
    epochs: torch.Tensor
    peer_buffers: torch.Tensor

    @staticmethod
    def buffer_shape(world: int, max_rows: int, hidden: int, dtype: torch.dtype) -> tuple[int, ...]:
        check(hidden * dtype.itemsize % 4 == 0, f"rows of {hidden} {dtype} are not whole 4-byte words")
        return 2, world, max_rows, hidden * dtype.itemsize // 4

    @staticmethod
    def zeroed_epochs(programs: int, device: torch.device) -> torch.Tensor:
        """A fresh ``epochs``: no calls yet, not stopped."""
        return torch.zeros(programs + 1, dtype=torch.int32, device=device)

    @property
    def programs(self) -> int:
        """The kernel's grid: one program per epoch counter."""
        return self.epochs.numel() - 1

    @property
    def max_rows(self) -> int:
        return self.buffer.shape[2]

    @property
    def hidden(self) -> int:
        return self.buffer.shape[3] * 4 // self.dtype.itemsize

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (a row-parallel output) can go through this kernel; otherwise NCCL and a norm."""
        return (x.dtype == self.dtype and x.shape[-1] == self.hidden and x.is_contiguous()
                and x.numel() // x.shape[-1] <= self.max_rows)


@triton.jit
def _all_reduce_rms_norm_kernel(X, R, W, Y, S, Buffer, Epochs, PeerBuffers, rank, n_rows, n_cols, max_rows, eps,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, WORDS: tl.constexpr, PHASE: tl.constexpr,
                                MAX_SPIN: tl.constexpr, PDL: tl.constexpr):
    let_next_start(PDL)  # the next GEMV may warm L2 while this waits for its peers (hopper/pdl.py)
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    words = tl.arange(0, WORDS)
    epoch = tl.load(Epochs + p) + 1  # (wraps after 2**31: see the module docstring)
    parity = epoch & 1
    row_words = n_cols * WORDS // BLOCK  # a row's words: hidden * itemsize / 4 (a whole number: checked)
    word_mask = words < row_words
    if PHASE != 2:  # push this rank's rows, stamped with the epoch, into every peer's slot for it
        stamp = epoch.to(tl.int64) << 32
        for row in range(p, n_rows, programs):
            x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0)
            ll = stamp | (_to_words(x, BLOCK).to(tl.int64) & 0xFFFFFFFF)
            for q in tl.static_range(WORLD):
                if q != rank:
                    peer = tl.multiple_of(tl.load(PeerBuffers + q).to(tl.pointer_type(tl.int64)), 16)
                    tl.store(peer + ((parity * WORLD + rank) * max_rows + row) * row_words + words, ll, mask=word_mask)
    if PHASE != 1:  # wait for every peer's rows, then sum in rank order, add the residual, normalise
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        for row in range(p, n_rows, programs):
            r_ptrs = row * n_cols + cols
            own = tl.load(X + r_ptrs, mask=mask, other=0.0)  # this GPU's loads first: they need no peer
            residual = tl.load(R + r_ptrs, mask=mask, other=0.0)
            total = tl.zeros((BLOCK,), tl.float32)
            for q in tl.static_range(WORLD):
                if q == rank:
                    part = own
                else:  # volatile: each poll reads memory again (peers write it over NVLink)
                    ptrs = Buffer + ((parity * WORLD + q) * max_rows + row) * row_words + words
                    ll = tl.load(ptrs, mask=word_mask, other=0, volatile=True)
                    spins = 0
                    while (_arrived(ll, word_mask, epoch) == 0) & (spins < MAX_SPIN):
                        ll = tl.load(ptrs, mask=word_mask, other=0, volatile=True)
                        spins += 1
                    if _arrived(ll, word_mask, epoch) == 0:
                        _stop(spins, Epochs + programs)
                    part = _from_words(ll.to(tl.int32), X.dtype.element_ty, BLOCK)
                total += part.to(tl.float32)
            s = total.to(X.dtype.element_ty) + residual  # rounded, as in torch
            tl.store(S + r_ptrs, s, mask=mask)
            sf = s.to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n_cols + eps)
            normed = (sf * inv_rms).to(X.dtype.element_ty)  # round, then multiply by the weight (transformers)
            tl.store(Y + r_ptrs, (normed.to(tl.float32) * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(Epochs + p, epoch)


@triton.jit
def _arrived(ll, word_mask, epoch):
    """1 if every word of the row (the masked ones aside) is stamped with ``epoch``, else 0."""
    return tl.min(tl.where(word_mask, (ll >> 32).to(tl.int32) == epoch, True).to(tl.int32), axis=0)


@triton.jit
def _to_words(x, BLOCK: tl.constexpr):
    """A row of 4- or 2-byte values as int32 words: [BLOCK], or [BLOCK / 2] with pairs low half first."""
    if x.dtype.primitive_bitwidth == 32:
        words = x.to(tl.int32, bitcast=True)
    else:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        low, high = tl.split(tl.reshape(bits, (BLOCK // 2, 2)))
        words = low | (high << 16)
    return words


@triton.jit
def _from_words(words, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """``_to_words`` undone: [BLOCK] values of ``dtype``."""
    if dtype.primitive_bitwidth == 32:
        values = words.to(dtype, bitcast=True)
    else:
        low = words.to(tl.int16).to(dtype, bitcast=True)
        high = (words >> 16).to(tl.int16).to(dtype, bitcast=True)
        values = tl.reshape(tl.join(low, high), (BLOCK,))
    return values


@triton.jit
def _stop(spins, Stopped):
    """End the kernel with an error: a peer's row never arrived. The interpreter runs no PTX: there the
    program sets the workspace's stop word, for the wrapper to raise on."""
    if ASM:
        tl.inline_asm_elementwise("trap;", "=r,r", [spins], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(Stopped, 1)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                        workspace: Workspace, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                        phases: tuple[int, ...] = (0,), max_spin: int = MAX_SPIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) = RMSNorm(sum over ranks of x + residual) with the sum, as its output;
    x is this rank's partial sum [..., hidden]. Every rank of ``workspace`` must make the same calls.
    ``out``: where to write them (else new tensors). ``phases``: (0,) the whole kernel; (1,) or (2,) one
    half of it, for one process playing every rank (the interpreter). ``max_spin``: polls before a trap."""
    check(workspace.fits(x), f"x is {x.dtype} {tuple(x.shape)} (contiguous: {x.is_contiguous()}); the workspace "
          f"takes contiguous {workspace.dtype} rows of {workspace.hidden}, at most {workspace.max_rows}")
    check(weight.shape == (x.shape[-1],) and weight.dtype == x.dtype,
          f"weight is {weight.dtype} {tuple(weight.shape)}; expected {x.dtype} ({x.shape[-1]},)")
    check(residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous(),
          f"residual is {residual.dtype} {tuple(residual.shape)}; expected contiguous {x.dtype} {tuple(x.shape)}")
    rows, block = x.numel() // x.shape[-1], triton.next_power_of_2(x.shape[-1])
    y, s = out if out is not None else (torch.empty_like(x), torch.empty_like(x))
    check(y.shape == s.shape == x.shape and y.is_contiguous() and s.is_contiguous(),
          f"out has shapes {tuple(y.shape)}, {tuple(s.shape)}; expected contiguous {tuple(x.shape)}")
    for phase in phases:
        _all_reduce_rms_norm_kernel[(workspace.programs,)](
            x, residual, weight, y, s, workspace.buffer, workspace.epochs, workspace.peer_buffers, workspace.rank, rows,
            x.shape[-1], workspace.max_rows, eps, WORLD=workspace.world, BLOCK=block,
            WORDS=block * x.dtype.itemsize // 4, PHASE=phase, MAX_SPIN=max_spin, PDL=pdl_supported(x.device))
        if INTERPRET and phase != 1 and workspace.epochs[-1] != 0:
            raise RuntimeError("all_reduce_rms_norm: a peer's rows never arrived (the ranks disagree on the calls)")
    return y, s
