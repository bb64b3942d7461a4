"""What every kernel wrapper checks before a launch, in one place: the dtypes the kernels take, and
whether a tensor can run at all (on a GPU, or on a CPU under Triton's interpreter).

Imports no Triton, so the engine can ask ``interpreter_on()`` before deciding to load the kernels.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreter_on() -> bool:
    """Is TRITON_INTERPRET set? (Triton reads it when a kernel is defined, so set it before import.)"""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_runnable(name: str, tensor: torch.Tensor) -> None:
    """A CUDA tensor, or a CPU one with the interpreter on."""
    check(tensor.is_cuda or interpreter_on(), f"{name} is on {tensor.device}; the Triton kernels need CUDA tensors "
          "(or TRITON_INTERPRET=1 set before minillm.kernels is imported)")
