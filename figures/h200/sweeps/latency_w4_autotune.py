"""Issue 6's batch-1 criterion after the W4A16 autotune lists took the H200 sweeps' winners (HFMA2 GEMV, PAIRS dot):
llama2-7b (dummy weights) with RTN INT4 weights (the same W4A16 kernels as AWQ's, no calibration to wait for) and in
bf16, one after the other in one process, each ``bench_latency``'s result (3 requests, 1 decode pass per step).
Run: OUT=... PYTHONPATH=$PWD python figures/h200/sweeps/latency_w4_autotune.py -> $OUT/latency_w4.json."""
import json, os, gc, torch
from minillm.bench.harness import bench_latency, result_header
from minillm.kernels.quant_matmul import autotuned_config
OUT = os.environ["OUT"]
doc = result_header("latency_w4_autotune", "latency", "llama2-7b (dummy weights)", "python figures/h200/sweeps/latency_w4_autotune.py")
doc["runs"] = {}


def save(result):
    with open(f"{OUT}/latency_w4.json", "w") as f:
        json.dump(result, f, indent=1, default=str)


common = dict(model="llama2-7b", load_format="dummy", scale="gpu", num_requests=3, peers=[], batching="continuous")
for name, extra in (("rtn_int4", {"quantization": "rtn-int4"}), ("bf16", {})):
    r = bench_latency(**common, **extra)
    if name == "rtn_int4":
        r["autotuned_gemv_last_key"] = autotuned_config("w4", "gemv")
    doc["runs"][name] = r
    m = r["runs"]["minillm"]
    print(f"{name}: {m['mean_decode_tok_s']:.1f} tok/s ({m['fraction_of_roofline']:.0%} of its roofline)", flush=True)
    save(doc)
    gc.collect(); torch.cuda.empty_cache()
t = {n: r["runs"]["minillm"]["mean_decode_tok_s"] for n, r in doc["runs"].items()}
doc["int4_over_bf16"] = t["rtn_int4"] / t["bf16"]
print("ratio INT4 / bf16", doc["int4_over_bf16"])
save(doc)
