"""CPU weight offload: some decoder layers' weights wait in host memory and cross PCIe every forward pass.

Why: a card too small for the weights plus a useful KV cache can still serve the model if part of
the weights live in CPU memory (vLLM's ``cpu_offload_gb``: GiB of weights per GPU kept in CPU
memory; the seeds' tuning path pairs it with INT4 weights). Every byte offloaded becomes KV cache.

What it costs: every forward pass (one per engine step, prefill or decode) copies every offloaded
byte host -> device once, over PCIe (tens of GB/s; ``minillm bench offload`` measures it) instead
of reading it from HBM (4.2 TB/s on the H200). Decode reads all weights every step, so a step
takes at least ``bytes_per_step / PCIe bandwidth``: about 20 ms for 1 GiB, against ~3.2 ms for
all of llama2-7b's 13.5 GB from HBM. Large batches share that cost; batch 1 pays all of it. Two
staging buffers of one layer each stay on the device, so offloading two layers saves no device
memory at all (one layer needs one buffer: it saves nothing either).

How:
- Whole decoder layers, the last ones (``layers_to_offload`` says why). Each one's parameters and
  buffers (quantized layers' packed codes included) are packed into one flat host buffer, pinned
  on CUDA: the copy engine reads page-locked memory directly, and only a copy from pinned memory
  can be captured in a CUDA graph. A layer crosses in one copy.
- Offloaded layer j (counting offloaded layers only) always runs from staging buffer j % 2. While
  layer j computes, layer j + 1's copy runs on a side stream (double buffering). Events order the
  streams: before layer j, the compute stream waits for layer j's copy only (``copied[j]``); buffer
  j % 2 is refilled with layer j + 2 only once layer j, which reads it, has finished (``used[j]``).
- Outside a forward pass an offloaded layer's tensors hold its host copy; forward hooks point them
  at the staging buffer just before the layer runs and back just after. The model file never knows.
- CUDA graphs stay on: the copies are captured into the decode graphs. Every address is fixed
  (layer j always lands in buffer j % 2, from the same pinned buffer), and ``torch.cuda.graph``
  captures a side stream that is forked from the capture stream by an event and joined back by
  events (CUDA C++ Programming Guide, "Stream Capture", cross-stream dependencies). Turning graphs
  off instead would slow the offloaded runs by the launch overhead too (an eager llama2-7b step is
  bound by launches, ``cuda_graphs.py``), and the benchmark could no longer tell the two apart.

Host memory: the pinned allocator rounds each layer's buffer up to a power of two (a 405 MB
llama2-7b layer takes 512 MiB of pinned memory). The memory budget's workspace reserve is a tenth
of the weights left on the device, so it shrinks a little as layers leave, although activations do not.

The model is loaded onto the device first and then moved: offloading here gives an emulated card
(``memory_budget``) its KV cache; loading straight into host memory is left out.
"""

from __future__ import annotations

import torch
from torch import nn

ALIGN = 256  # bytes: every tensor in a flat buffer starts on a boundary any kernel's vector loads accept


def layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's parameters, then its buffers (QuantLinear's codes and scales), each once, in a fixed order."""
    return [*layer.parameters(), *layer.buffers()]


def layers_to_offload(model: nn.Module, cpu_offload_gb: float) -> list[int]:
    """The last decoder layers, as few as hold at least ``cpu_offload_gb`` GiB of weights (like vLLM,
    offloading stops once the requested bytes are reached, so it may offload a little more).

    The last, not the first (vLLM offloads in module order): the copies of the first two offloaded
    layers start with the step and overlap the compute of every resident layer before them, whereas
    offloading the first layers would open every step by waiting for a copy."""
    layers = model.model.layers
    sizes = [sum(t.nbytes for t in layer_tensors(layer)) for layer in layers]
    requested = cpu_offload_gb * 2**30
    if requested > sum(sizes):
        raise ValueError(f"cpu_offload_gb={cpu_offload_gb} is more than the {len(layers)} decoder layers' weights "
                         f"({sum(sizes):,} bytes); valid: 0 to {sum(sizes) / 2**30:.6g} GiB")
    chosen, total = [], 0
    for index in reversed(range(len(layers))):
        if total >= requested:
            break
        chosen.append(index)
        total += sizes[index]
    return sorted(chosen)


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed one after the other, each aligned, and the total size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.nbytes // ALIGN) * ALIGN
    return offsets, end


def _views(flat: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Tensors shaped like ``tensors`` over the bytes of ``flat`` at ``offsets``."""
    return [flat[o:o + t.nbytes].view(t.dtype).view(t.shape) for t, o in zip(tensors, offsets)]


class LayerOffloader:
    """Keeps decoder layers ``indices`` of ``model`` in host memory and streams them into (up to) two
    staging buffers on ``device`` as each forward pass reaches them (see the module docstring)."""

    def __init__(self, model: nn.Module, indices: list[int], device: torch.device):
        if not indices:
            raise ValueError("LayerOffloader needs at least one layer to offload")
        self.indices, self.device = list(indices), device
        cuda = device.type == "cuda"
        self.tensors = [layer_tensors(model.model.layers[i]) for i in self.indices]
        layouts = [_layout(tensors) for tensors in self.tensors]
        size = max(end for _, end in layouts)
        # Two buffers (one when a single layer is offloaded: then it alone is staged, and costs nothing).
        self.staging = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(indices)))]
        self.host: list[torch.Tensor] = []  # one flat buffer per offloaded layer
        self.host_views: list[list[torch.Tensor]] = []
        self.staging_views: list[list[torch.Tensor]] = []
        for j, (tensors, (offsets, end)) in enumerate(zip(self.tensors, layouts)):
            host = torch.empty(end, dtype=torch.uint8, pin_memory=cuda)
            host_views = _views(host, tensors, offsets)
            for tensor, view in zip(tensors, host_views):
                view.copy_(tensor)
                tensor.data = view  # the device copy has no other owner: it goes back to the allocator
            self.host.append(host)
            self.host_views.append(host_views)
            self.staging_views.append(_views(self.staging[j % 2], tensors, offsets))
        # The copies' stream (None on a CPU: copy in place). A high-priority stream comes from a pool of
        # its own, so it cannot be one that torch.cuda.graph or a warm-up hands out for compute, which
        # would serialise the copies behind the layers they should overlap.
        self.side = torch.cuda.Stream(device, priority=-1) if cuda else None
        if cuda:
            self.step_start = torch.cuda.Event()
            self.copied = [torch.cuda.Event() for _ in self.indices]
            self.used = [torch.cuda.Event() for _ in self.indices]
            torch.cuda.empty_cache()  # give the moved layers' memory back to the device
        model.register_forward_pre_hook(lambda module, args: self._start_step())
        for j, index in enumerate(self.indices):
            layer = model.model.layers[index]
            layer.register_forward_pre_hook(lambda module, args, j=j: self._before_layer(j))
            layer.register_forward_hook(lambda module, args, output, j=j: self._after_layer(j))

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of weights kept in host memory instead of on the device."""
        return sum(t.nbytes for tensors in self.tensors for t in tensors)

    @property
    def bytes_per_step(self) -> int:
        """Bytes copied host -> device per forward pass (the flat buffers, alignment padding included)."""
        return sum(host.nbytes for host in self.host)

    @property
    def staging_bytes(self) -> int:
        """Device memory of the staging buffers (one layer each; two, or one when one layer is offloaded)."""
        return sum(buffer.nbytes for buffer in self.staging)

    def _compute_stream(self) -> torch.cuda.Stream:
        """The stream the layers run on now: the default one, a graph warm-up's, or the capture stream."""
        return torch.cuda.current_stream(self.device)

    def _copy_in(self, j: int) -> None:
        """Start copying offloaded layer j into its staging buffer (on CPU: copy it now)."""
        staging = self.staging[j % 2][:self.host[j].numel()]
        if self.side is None:
            staging.copy_(self.host[j])
            return
        with torch.cuda.stream(self.side):
            staging.copy_(self.host[j], non_blocking=True)
            self.copied[j].record(self.side)

    def _start_step(self) -> None:
        """At the start of a forward pass: start copying the first two offloaded layers."""
        if self.side is not None:
            # Fork: the side stream starts after all work queued so far, including the last step's
            # layers that read the staging buffers.
            self.step_start.record(self._compute_stream())
            self.side.wait_event(self.step_start)
        for j in range(min(2, len(self.indices))):
            self._copy_in(j)

    def _before_layer(self, j: int) -> None:
        """Offloaded layer j is next: wait for its copy and point its tensors at the staging buffer."""
        if self.side is not None:
            self._compute_stream().wait_event(self.copied[j])  # its own copy only: later ones keep running
        for tensor, view in zip(self.tensors[j], self.staging_views[j]):
            tensor.data = view

    def _after_layer(self, j: int) -> None:
        """Offloaded layer j is done: point its tensors back home and refill its buffer with layer j + 2."""
        for tensor, view in zip(self.tensors[j], self.host_views[j]):
            tensor.data = view
        if j + 2 >= len(self.indices):
            # No refill left. Nor a wait without a copy after it: a capture must join every side-stream
            # operation back into the capture stream, and only copies are joined (before their layers).
            return
        if self.side is not None:  # buffer j % 2 is refilled only after layer j, which reads it, is done
            self.used[j].record(self._compute_stream())
            self.side.wait_event(self.used[j])
        self._copy_in(j + 2)


def offload_layers(model: nn.Module, cpu_offload_gb: float, device: torch.device) -> LayerOffloader | None:
    """Offload the last layers holding ``cpu_offload_gb`` GiB of ``model``'s weights; None for 0."""
    if cpu_offload_gb == 0:
        return None
    return LayerOffloader(model, layers_to_offload(model, cpu_offload_gb), device)
