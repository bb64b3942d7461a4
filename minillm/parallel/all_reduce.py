"""The all-reduce of tensor parallelism: NCCL (gloo on a CPU); a one-shot all-reduce over symmetric memory;
or that all-reduce fused into the residual add and RMSNorm after it (the default on GPUs that are peers).

Why a second one: a decode step of Llama-2-7B all-reduces one [batch, 4096] activation twice per
layer, 64 times per token, and at batch 1 that is 8 KB each: pure latency. NCCL's ring pays a few
microseconds of protocol per call; at 64 calls that is a sizeable share of a ~3 ms TP=2 step.
PyTorch's symmetric memory (``torch.distributed._symmetric_memory``, alpha: "PyTorch Symmetric
Memory" in its docs) gives every rank a buffer the others can read over NVLink, and its one-shot
all-reduce is one kernel in which each rank reads every peer's buffer and sums: no ring steps,
no protocol (the idea of vLLM's and TensorRT-LLM's custom all-reduce kernels).

``EngineConfig.tp_all_reduce`` picks one; "auto" is
``fused`` where every rank's GPU reaches the others' memory, and NCCL (gloo on a CPU) otherwise.
``symm_mem`` needs CUDA GPUs with peer access (NVLink); activations larger than the buffer (one step's
token budget) and other dtypes still go through NCCL. On two H200s it saved ~1.5 % of a batch-1 decode
step (``figures/h200/tp_decode_profile.json``): torch's kernel pays for a barrier of its own, and
the copy into the buffer is a kernel too.

``fused`` goes further: every row-parallel output (o_proj, down_proj) is followed by ``x + residual``
and an RMSNorm, so the row-parallel linear leaves its output unreduced and the norm after it runs
``kernels/all_reduce_norm.py``: push to the peers, wait, sum, add, normalise, one kernel
(:class:`FusedAllReduceNorm`, wired in by :func:`fuse_into_norms`). Decode batches up to ``MAX_ROWS``
rows take it; longer steps (prefill chunks) keep NCCL and the plain norm. On two H200s it took TP=2's
batch-1 decode from 1.28x to 1.48x one GPU's (``figures/h200/latency_tp_fused.json``), with NCCL's
tokens.

A second symmetric-memory engine in one process: symmetric memory's rendezvous numbers the keys it
exchanges through the store by how many exchanges *this process* has made (PyTorch's static
sequence counter; pytorch/pytorch#196082 is the same mismatch between subgroups). The driver keeps its
count from one engine to the next, but a new engine's worker processes start from zero, so they and
the driver would wait on different keys forever. So before
each rendezvous the ranks agree on the highest count of rendezvous made, and a rank that is behind
makes the missing ones alone, on a group of its own (:func:`_catch_up`). That rests on each rendezvous
advancing the count alike whatever its group's size, true where it was tested (two H200s, no multicast,
torch 2.11: the two-GPU suite builds three symmetric-memory engines in one process); where it is not,
the driver would wait at its next rendezvous until the collective timeout. Starting every rank, the
driver's too, in a new process would remove the question.
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
import torch.distributed as dist

CHOICES = ("nccl", "symm_mem", "fused")  # "nccl": the process group's own all-reduce (NCCL on GPUs, gloo on a CPU)

_symmetric: "SymmetricAllReduce | None" = None  # this process's, while a tensor-parallel engine is open


def all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    if _symmetric is not None and _symmetric.fits(x):
        _symmetric(x)
    else:
        dist.all_reduce(x)


def chosen(choice: str, device: torch.device, size: int) -> str:
    """The all-reduce ``choice`` (``EngineConfig.tp_all_reduce``) names, checked against ``device`` and, for the
    symmetric-memory ones, against ``size`` ranks' GPUs (0 .. size - 1, one a rank). "auto": "fused" on GPUs
    that reach each other's memory, "nccl" otherwise."""
    if choice == "auto":
        return "fused" if device.type == "cuda" and _peers_reach_each_other(size) else "nccl"
    if choice not in CHOICES:
        raise ValueError(f"tp_all_reduce={choice!r}; valid: auto, {', '.join(CHOICES)}")
    if choice != "nccl" and device.type != "cuda":
        raise ValueError(f"tp_all_reduce={choice!r} needs CUDA GPUs (NVLink peers), but the ranks run on "
                         f"{device.type}; use 'auto' (NCCL or gloo)")
    if choice != "nccl" and not _peers_reach_each_other(size):
        raise ValueError(f"tp_all_reduce={choice!r} needs GPUs 0..{size - 1} of one host to reach each other's "
                         f"memory (peer access), and they do not; use 'auto' (NCCL)")
    return choice


_rendezvous_made = 0  # symmetric-memory rendezvous this process has made (_catch_up)


def _catch_up(symm_mem, device: torch.device) -> None:
    """Bring this rank's count of rendezvous up to the highest of the ranks' (collective): the store keys
    of the next one are numbered by that count (the module docstring says why). A rank behind (a new
    worker of a driver that set up an earlier engine) makes the missing rendezvous alone, each on a
    one-element buffer over a group of its own."""
    global _rendezvous_made
    highest = torch.tensor([_rendezvous_made], dtype=torch.int64, device=device)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    behind = int(highest.item()) - _rendezvous_made
    if behind:
        alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)  # only this rank calls it
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(alone.group_name)
        for _ in range(behind):
            symm_mem.rendezvous(symm_mem.empty(1, dtype=torch.int64, device=device), alone.group_name)
            _rendezvous_made += 1
        # ``alone`` is kept: only a new worker is ever behind, and it ends with its engine. (It makes this rank
        # know one group more than the others, which would matter to a later hashed group name; minillm makes none.)


def _peers_reach_each_other(size: int) -> bool:
    """Whether GPUs 0 .. size - 1 can all read and write each other's memory (NVLink or PCIe peers). Ranks
    on several hosts (torchrun's LOCAL_WORLD_SIZE below the ranks) cannot."""
    if torch.cuda.device_count() < size or int(os.environ.get("LOCAL_WORLD_SIZE", size)) < size:
        return False  # (the engine then says how many GPUs it needs)
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(size) for b in range(size) if a != b)


def _symmetric_empty(numel: int, dtype: torch.dtype, device: torch.device):
    """A zeroed tensor in symmetric memory on every rank of the default group (collective), and the
    address of every rank's copy as this process sees it."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required by older torch releases, harmless in newer
        symm_mem.enable_symm_mem_for_group(group)
    global _rendezvous_made
    _catch_up(symm_mem, device)
    tensor = symm_mem.empty(numel, dtype=dtype, device=device).zero_()
    torch.cuda.synchronize(device)  # zeroed before any peer can learn where it is
    handle = symm_mem.rendezvous(tensor, group)  # collective: every rank maps the others' buffers
    _rendezvous_made += 1
    # buffer_ptrs are the allocations' starts; a pooled tensor may sit at the same offset into each.
    offset = tensor.data_ptr() - handle.buffer_ptrs[handle.rank]
    return tensor, [ptr + offset for ptr in handle.buffer_ptrs]


class SymmetricAllReduce:
    """A symmetric buffer of ``max_elements`` of ``dtype`` on every rank of the default group, and the
    one-shot all-reduce through it: copy x in, sum every rank's copy into x."""

    def __init__(self, device: torch.device, max_elements: int, dtype: torch.dtype):
        self.group_name = dist.group.WORLD.group_name
        self.buffer, _ = _symmetric_empty(max_elements, dtype, device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> None:
        staged = self.buffer[:x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))


class FusedAllReduceNorm:
    """The workspace of ``kernels/all_reduce_norm.py`` on this rank: two slots a rank of ``max_rows`` rows
    of ``hidden`` in symmetric memory (as LL words: twice the bytes), and this rank's epochs."""

    # The kernel's grid: rows are dealt out over it, and every call launches all of it (the epochs need
    # that). 16: 2.25 us at batch 1 and 5.9 at 64 rows on one H200 without a peer; 64: 2.51 and 2.7
    # (figures/h200/sweeps/all_reduce_norm_local.json). Batch-1 latency wins.
    PROGRAMS = 16
    MAX_ROWS = 256  # the most rows it takes (the engine's decode batches); more go through NCCL and a norm

    def __init__(self, device: torch.device, max_rows: int, hidden: int, dtype: torch.dtype):
        from minillm.kernels.all_reduce_norm import Workspace, all_reduce_rms_norm

        self.kernel = all_reduce_rms_norm
        world = dist.get_world_size()
        shape = Workspace.buffer_shape(world, max_rows, hidden, dtype)
        # Zeroed: every word stamped with epoch 0, older than the first call's (1).
        buffer, buffers = _symmetric_empty(math.prod(shape), torch.int64, device)
        self.workspace = Workspace(dist.get_rank(), world, dtype, buffer.view(shape),
                                   Workspace.zeroed_epochs(self.PROGRAMS, device),
                                   torch.tensor(buffers, dtype=torch.int64, device=device))

    def fits(self, x: torch.Tensor) -> bool:
        return self.workspace.fits(x)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor):
        """(RMSNorm(all-reduced x + residual), all-reduced x + residual)."""
        return self.kernel(x, weight, eps, residual, self.workspace)


def fuse_into_norms(model, op: FusedAllReduceNorm | None) -> None:
    """Route each row-parallel output's all-reduce into the norm that follows it (``op``), or, with None,
    back to the linear. The decoder (``model/llama.py``) adds every row-parallel output (o_proj's,
    down_proj's) to the residual in the next norm, and no other input reaches a norm with a residual; the
    norms become ``model/fused.py``'s, which sum their input with ``op``."""
    from minillm.model.fused import fuse_norm
    from minillm.parallel.tp import RowParallelLinear, RowParallelQuantLinear

    for layer in model.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if not isinstance(linear, (RowParallelLinear, RowParallelQuantLinear)) or linear.bias is not None:
                raise ValueError(f"tp_all_reduce='fused' needs row-parallel o_proj and down_proj without a bias; "
                                 f"this model has {type(linear).__name__} (bias: {linear.bias is not None})")
            linear.reduced_by_next_norm = op
        fuse_norm(layer.input_layernorm, op)
        fuse_norm(layer.post_attention_layernorm, op)
    fuse_norm(model.model.norm, op)


def install(choice: str, model, workers, max_num_seqs: int, max_num_batched_tokens: int, hidden_size: int,
            dtype: torch.dtype) -> None:
    """Set up ``choice`` (``chosen``'s) for a tensor-parallel engine's ``model``, undone when ``workers`` shut down:
    the symmetric-memory buffer, sized for a step's token budget, or the fused all-reduce for decode batches of up
    to ``max_num_seqs`` rows. Before any CUDA graph captures the all-reduces."""
    device = workers.device
    if choice == "symm_mem":
        enable_symmetric(device, max_num_batched_tokens * hidden_size, dtype)
        workers.on_shutdown(disable_symmetric)
    elif choice == "fused":
        rows = min(max_num_seqs, FusedAllReduceNorm.MAX_ROWS)
        fuse_into_norms(model, FusedAllReduceNorm(device, rows, hidden_size, dtype))
        # A partial, not a lambda: a closure over the engine would keep it alive (Workers.on_shutdown).
        workers.on_shutdown(partial(fuse_into_norms, model, None))


def enable_symmetric(device: torch.device, max_elements: int, dtype: torch.dtype) -> SymmetricAllReduce:
    """Route this process's tensor-parallel all-reduces through symmetric memory (every rank must call it)."""
    global _symmetric
    _symmetric = SymmetricAllReduce(device, max_elements, dtype)
    return _symmetric


def disable_symmetric() -> None:
    """Back to NCCL; the buffer goes before the group it was mapped over (``Workers.on_shutdown``)."""
    global _symmetric
    _symmetric = None
