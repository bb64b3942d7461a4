"""``minillm.info()``: versions and the device, printed first in every notebook and by ``minillm info``,
so every number a learner sees comes with the machine that produced it."""

from __future__ import annotations

import platform
from importlib import metadata

import torch


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def device_description() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def info_dict() -> dict:
    return {
        "minillm": _version("minillm"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "device": device_description(),
    }


def info() -> dict:
    """Print and return versions and the device."""
    facts = info_dict()
    for key, value in facts.items():
        print(f"{key:>13}: {value}")
    return facts
