"""Issue 6's latency criterion in one process: batch-1 decode (the ``latency`` workload, BENCHMARKS.md) of
llama2-7b (dummy weights) in bf16 and with AWQ INT4 weights, each with 1 and 8 decode passes per scheduler
step (``num_scheduler_steps``, minillm/multi_step.py: the host's per-token work off the GPU's critical path).
The INT4 weights are quantized once (8 calibration samples) and reloaded from a saved checkpoint for the
second run, as ``bench tuning-path`` does. Each run is ``bench_latency``'s result (tok/s and the roofline).
SILU_KERNEL=1 adds INT4 runs with SiLU-and-multiply as a kernel of its own (``QuantLinear.takes_gated`` off), against
the default where batch-1 down_proj applies it in its GEMV (``w4_gemv_fused.fused_gemv(gated=True)``).
Run: PYTHONPATH=$PWD python figures/h200/sweeps/latency_int4.py -> $OUT/latency_int4.json."""
import gc, json, os, sys, tempfile
import torch
from minillm import LLM
from minillm.bench.harness import bench_latency, result_header
from minillm.quant.checkpoint import save_quantized
from minillm.quant.linear import QuantLinear

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
STEPS = [int(k) for k in os.environ.get("STEPS", "1 8").split()]
MODEL, SCALE = os.environ.get("MODEL", "llama2-7b"), os.environ.get("SCALE", "gpu")  # MODEL=tiny SCALE=cpu: a smoke test
common = dict(load_format="dummy", scale=SCALE, num_requests=None, peers=[], batching="continuous")
doc = result_header("latency_int4", "latency", f"{MODEL} (dummy weights)", "python figures/h200/sweeps/latency_int4.py")
doc["runs"] = {}


def save(name, result):
    doc["runs"][name] = result
    m = result["runs"]["minillm"]
    print(f"{name}: {m['mean_decode_tok_s']:.1f} tok/s ({m['fraction_of_roofline']:.0%} of its roofline)", flush=True)
    json.dump(doc, open(f"{OUT}/latency_int4.json", "w"), indent=1)


for k in STEPS:
    save(f"bf16_k{k}", bench_latency(model=MODEL, num_scheduler_steps=k, **common))
    gc.collect(); torch.cuda.empty_cache()
with tempfile.TemporaryDirectory() as scratch:
    llm = LLM(MODEL, load_format="dummy", quantization="awq-int4", calibration_samples=8, batching="continuous")
    path = str(save_quantized(llm, os.path.join(scratch, "awq")))
    llm.close(); del llm; gc.collect(); torch.cuda.empty_cache()
    for k in STEPS:
        save(f"awq_int4_k{k}", bench_latency(model=path, num_scheduler_steps=k, **{**common, "load_format": "auto"}))
        gc.collect(); torch.cuda.empty_cache()
    if os.environ.get("SILU_KERNEL") == "1":
        QuantLinear.takes_gated = lambda self, gate_up: False
        for k in STEPS:
            save(f"awq_int4_k{k}_silu_kernel", bench_latency(model=path, num_scheduler_steps=k,
                                                             **{**common, "load_format": "auto"}))
            gc.collect(); torch.cuda.empty_cache()
for k in STEPS:
    bf16, int4 = (doc["runs"][f"{q}_k{k}"]["runs"]["minillm"]["mean_decode_tok_s"] for q in ("bf16", "awq_int4"))
    doc[f"int4_over_bf16_k{k}"] = int4 / bf16
    print(f"k={k}: INT4 / bf16 = {int4 / bf16:.2f}x (issue 6 asks >= 2.5x)")
json.dump(doc, open(f"{OUT}/latency_int4.json", "w"), indent=1)
sys.exit(0)
