"""Decode-step weight prefetch: as one linear layer's kernel ends, ask L2 for the weights of the next ones.

Why: at small batches a decode step reads every weight once, and reads them only while its GEMVs run. After
``qkv_proj`` come RoPE with the KV store, attention (split and merge) and ``o_proj``; after ``down_proj``, the
next layer's norm: microseconds in which the HBM is nearly idle (``figures/h200/profile_decode_batch1.json``:
~170 small kernels a step at batch 1). Prefetching the next projections' weights into L2 in those gaps lets
their GEMVs read from L2 instead of starting a cold stream. The prefetch kernel (``kernels/l2_prefetch.py``)
runs on a side stream, forked from the compute stream right after the GEMV, so the compute stream's next
kernel does not wait for it; the side stream is joined back at the end of the forward pass (as CUDA graph
capture requires, ``offload.py`` does the same).

What is prefetched, per decoder layer, up to ``budget`` bytes at each point:
- after ``qkv_proj``: ``o_proj``, then as much of ``gate_up_proj`` as fits (the gap is attention's);
- after ``down_proj``: the next layer's ``qkv_proj`` (the gap is the next input norm).
Not after ``o_proj`` or ``gate_up_proj``: the kernel after each is short or (down_proj, started early by
PDL, ``kernels/pdl.py``) already reading. A module that is prefetched in part gets the same fraction of each
of its tensors (a GEMV's programs read all of their tiles at once, so no part of a weight is read first).
The budget should stay below L2 (50 MB on an H100/H200): lines prefetched beyond it evict each other.

Only passes of at most ``max_rows`` tokens prefetch: a prefill's GEMMs are bound by compute, not by bytes.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from minillm.kernels.l2_prefetch import prefetch_l2


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The weight tensors a linear layer's kernel reads (its own parameters and buffers, not its children's)."""
    return [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t.is_contiguous()]


def plan(modules: list[nn.Module], budget: int) -> list[tuple[torch.Tensor, int]]:
    """(tensor, bytes from its start) to prefetch for ``modules`` in order, at most ``budget`` bytes in all."""
    pieces, left = [], budget
    for module in modules:
        tensors = module_tensors(module)
        size = sum(t.nbytes for t in tensors)
        if left <= 0 or size == 0:
            break
        share = min(1.0, left / size)
        pieces += [(t, int(t.nbytes * share)) for t in tensors]
        left -= size
    return pieces


class WeightPrefetch:
    """Installs the prefetches on ``model``'s decoder layers (forward hooks); ``remove()`` takes them off."""

    def __init__(self, model: nn.Module, device: torch.device, budget: int, max_rows: int = 64):
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget}")
        self.device, self.budget, self.max_rows = device, budget, max_rows
        self.side = torch.cuda.Stream(device)
        self.forked = False
        self.handles = []
        layers = model.model.layers
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            self._after(attn.qkv_proj, plan([attn.o_proj, mlp.gate_up_proj], budget))
            if i + 1 < len(layers):
                self._after(mlp.down_proj, plan([layers[i + 1].self_attn.qkv_proj], budget))
        self.handles.append(model.register_forward_hook(lambda *_: self._join()))

    def _after(self, module: nn.Module, pieces: list[tuple[torch.Tensor, int]]) -> None:
        def hook(_module, args, _output):
            x = args[0]
            if x.numel() // max(1, x.shape[-1]) > self.max_rows:
                return
            main = torch.cuda.current_stream(self.device)
            if os.environ.get("MINILLM_L2_AHEAD_STREAM") == "main":
                for tensor, nbytes in pieces:
                    prefetch_l2(tensor, nbytes)
                return
            self.side.wait_stream(main)  # after this GEMV, alongside the kernels that follow it
            with torch.cuda.stream(self.side):
                for tensor, nbytes in pieces:
                    prefetch_l2(tensor, nbytes)
            self.forked = True
        self.handles.append(module.register_forward_hook(hook))

    def _join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.forked = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
