"""What-if decomposition of a batch-1 INT4 decode step: how much of the token's time each class of small kernel holds
on the critical path, measured by leaving it out (the answers are then wrong; only the time counts). Variants: the
whole step; no RMSNorm kernels (a norm returns its input, and the residual add is skipped); no attention (the
context returns q: no RoPE/KV store, no split, no merge kernel); neither. llama2-7b, dummy weights, RTN INT4, the
``latency`` workload, engines in the order ABCD DCBA in one process (drift weighs on all alike).
Run from the repository root on an H200: ``[QUANT=bf16] PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_what_if.py``;
latency_what_if.json holds both runs (QUANT rtn-int4, the default, and bf16)."""
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import save_result  # noqa: E402

from minillm.bench.harness import bench_latency  # noqa: E402
from minillm.kv.paged_triton import TritonPagedBatch  # noqa: E402
from minillm.model.llama import RMSNorm  # noqa: E402

norm_forward, attention_call = RMSNorm.forward, TritonPagedBatch.__call__


def no_norm(self, x, residual=None):
    return x if residual is None else (x, residual)


def no_attention(self, layer_idx, q, k, v, rope=None):
    return q


VARIANTS = {"whole": (norm_forward, attention_call), "no_norms": (no_norm, attention_call),
            "no_attention": (norm_forward, no_attention), "neither": (no_norm, no_attention)}
ORDER = list(VARIANTS) + list(reversed(VARIANTS))
quant = os.environ.get("QUANT", "rtn-int4")
runs = {"order": ORDER, "quantization": quant, **{name: [] for name in VARIANTS}}
for name in ORDER:
    RMSNorm.forward, TritonPagedBatch.__call__ = VARIANTS[name]
    result = bench_latency(model="llama2-7b", load_format="dummy", scale="gpu", num_requests=None, peers=[],
                           batching="continuous", quantization=None if quant == "bf16" else quant)
    runs[name].append(result["runs"]["minillm"]["mean_decode_tok_s"])
    print(name, f"{runs[name][-1]:.1f} tok/s", flush=True)
    gc.collect(); torch.cuda.empty_cache()
mean_ms = {name: 2e3 / sum(runs[name]) for name in VARIANTS}
runs["mean_ms_per_token"] = mean_ms
runs["ms_per_token_saved"] = {name: mean_ms["whole"] - mean_ms[name] for name in VARIANTS}
print(runs["ms_per_token_saved"])
save_result(os.environ.get("OUT", "/tmp/out"), f"latency_what_if_{quant}", f"latency, llama2-7b {quant}, batch 1",
            "mean decode tok/s of bench_latency per engine, in the order given; variants leave kernels out", runs)
