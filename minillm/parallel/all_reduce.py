"""The all-reduce of tensor parallelism: NCCL by default, or a one-shot all-reduce over symmetric memory.

Why a second one: a decode step of Llama-2-7B all-reduces one [batch, 4096] activation twice per
layer, 64 times per token, and at batch 1 that is 8 KB each: pure latency. NCCL's ring pays a few
microseconds of protocol per call; at 64 calls that is a sizeable share of a ~3 ms TP=2 step.
PyTorch's symmetric memory (``torch.distributed._symmetric_memory``, alpha: "PyTorch Symmetric
Memory" in its docs) gives every rank a buffer the others can read over NVLink, and its one-shot
all-reduce is one kernel in which each rank reads every peer's buffer and sums: no ring steps,
no protocol (the idea of vLLM's and TensorRT-LLM's custom all-reduce kernels).

Opt-in and experimental: ``MINILLM_TP_ALLREDUCE=symm_mem`` (vLLM switches its own with an
environment variable too). It needs CUDA GPUs with peer access (NVLink); activations larger than
the buffer (one step's token budget) and other dtypes still go through NCCL. Not yet measured on
GPUs: ``minillm bench parallel`` run both ways is the test of whether it pays.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

ENV = "MINILLM_TP_ALLREDUCE"
CHOICES = ("nccl", "symm_mem")  # "nccl": the process group's own all-reduce (NCCL on GPUs, gloo on a CPU)

_symmetric: "SymmetricAllReduce | None" = None  # this process's, while a tensor-parallel engine is open


def all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    if _symmetric is not None and _symmetric.fits(x):
        _symmetric(x)
    else:
        dist.all_reduce(x)


def chosen(device: torch.device) -> str:
    """The all-reduce ``MINILLM_TP_ALLREDUCE`` asks for (default "nccl"), checked against ``device``."""
    choice = os.environ.get(ENV, "nccl")
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}; valid: {', '.join(CHOICES)}")
    if choice == "symm_mem" and device.type != "cuda":
        raise ValueError(f"{ENV}=symm_mem needs CUDA GPUs (NVLink peers), but the ranks run on {device.type}; "
                         f"unset it (NCCL or gloo is used)")
    return choice


class SymmetricAllReduce:
    """A symmetric buffer of ``max_elements`` of ``dtype`` on every rank of the default group, and the
    one-shot all-reduce through it: copy x in, sum every rank's copy into x."""

    def __init__(self, device: torch.device, max_elements: int, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required by older torch releases, harmless in newer
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_elements, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank maps the others' buffers

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> None:
        staged = self.buffer[:x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))


def enable_symmetric(device: torch.device, max_elements: int, dtype: torch.dtype) -> SymmetricAllReduce:
    """Route this process's tensor-parallel all-reduces through symmetric memory (every rank must call it)."""
    global _symmetric
    _symmetric = SymmetricAllReduce(device, max_elements, dtype)
    return _symmetric


def disable_symmetric() -> None:
    """Back to NCCL; the buffer goes before the group it was mapped over (``Workers.on_shutdown``)."""
    global _symmetric
    _symmetric = None
