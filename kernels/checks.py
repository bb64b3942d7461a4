"""What every kernel wrapper checks before a launch, in one place: the dtypes the kernels take, and
whether a tensor can run at all (on a GPU, or on a CPU under Triton's interpreter).

Imports no Triton, so the engine can ask ``interpreter_on()`` before deciding to load the kernels.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SMs of ``device``; one where there are none (the CPU, where Triton's interpreter runs): launch heuristics
    that size grids by SMs then pick their smallest grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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


def check_operand(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, like: torch.Tensor) -> None:
    """A kernel operand of exactly ``dtype`` and ``shape``, on ``like``'s device, contiguous in its last dim."""
    check(t.dtype == dtype, f"{name}.dtype is {t.dtype}; expected {dtype}")
    check(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}; expected {shape}")
    check(t.device == like.device, f"{name} is on {t.device} but x is on {like.device}")
    check(t.stride(-1) == 1, f"{name} needs a contiguous last dim, got strides {t.stride()}")
