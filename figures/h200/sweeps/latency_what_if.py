"""What-if decomposition of a batch-1 decode step: how much of the token's time each class of small kernel holds on
the critical path, measured by leaving it out (the answers are then wrong; only the time counts). Variants: the whole
step; no RMSNorm kernels (a norm returns its input, and the residual add is skipped); no attention (the context
returns q: no RoPE/KV store, no split, no merge kernel); neither. llama2-7b, dummy weights, RTN INT4 and bf16, the
``latency`` workload, engines in the order ABCD DCBA in one process (drift weighs on all alike).
Run from the repository root on an H200: ``PYTHONPATH=$PWD python3 figures/h200/sweeps/latency_what_if.py`` (QUANTS:
"rtn-int4,bf16" by default, one block of eight engines each)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch_sweep import latency_engines, save_result  # noqa: E402

from minillm.kv.paged_triton import TritonPagedBatch  # noqa: E402
from minillm.model import norm_folding  # noqa: E402
from minillm.model.llama import RMSNorm  # noqa: E402

norm_folding.ENABLED = False  # every norm a kernel to leave out (folded ones hand RMSNorm a ResidualRow)

norm_forward, attention_call = RMSNorm.forward, TritonPagedBatch.__call__


def no_norm(self, x, residual=None):
    return x if residual is None else (x, residual)


def no_attention(self, layer_idx, q, k, v, rope=None):
    return q


VARIANTS = {"whole": (norm_forward, attention_call), "no_norms": (no_norm, attention_call),
            "no_attention": (norm_forward, no_attention), "neither": (no_norm, no_attention)}
ORDER = list(VARIANTS) + list(reversed(VARIANTS))


def switch(name):
    RMSNorm.forward, TritonPagedBatch.__call__ = VARIANTS[name]


runs = {}
for quant in os.environ.get("QUANTS", "rtn-int4,bf16").split(","):
    row = runs[quant] = {"order": ORDER, "quantization": quant, **latency_engines(ORDER, switch, quant)}
    RMSNorm.forward, TritonPagedBatch.__call__ = norm_forward, attention_call
    mean_ms = {name: 2e3 / sum(row[name]) for name in VARIANTS}  # two engines a variant
    row["mean_ms_per_token"] = mean_ms
    row["ms_per_token_saved"] = {name: mean_ms["whole"] - mean_ms[name] for name in VARIANTS}
    print(quant, row["ms_per_token_saved"], flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "latency_what_if", "latency, llama2-7b, batch 1, RTN INT4 and bf16",
            "mean decode tok/s of bench_latency per engine, in the order given; variants leave kernels out", runs)
