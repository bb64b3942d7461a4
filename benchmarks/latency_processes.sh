#!/bin/bash
# The ``latency`` workload as a user runs it: `minillm bench latency` on llama2-7b (dummy weights; MODEL: another
# preset), each quantization in a process of its own (QUANTS, "bf16" for none; ROUNDS rounds in turn), continuous
# batching with the engine's defaults. One process a run: a second engine built in the same process decodes INT4
# a few percent slower than the first, so in-process A/B comparisons understate INT4 against bf16.
# Writes each run's JSON to $OUT/runs and the summary (tok/s per process, each quantization over bf16) to
# $OUT/latency_processes.json. Run from the repository root on a GPU: bash benchmarks/latency_processes.sh
set -e
QUANTS=${QUANTS:-rtn-int4,bf16}
ROUNDS=${ROUNDS:-2}
MODEL=${MODEL:-llama2-7b}
OUT=${OUT:-/tmp/out}
RUNS=$OUT/runs  # each run's JSON as it ends (a cut-short call keeps them)
mkdir -p "$RUNS"
for round in $(seq "$ROUNDS"); do
  for quant in ${QUANTS//,/ }; do
    flag=(); [ "$quant" != bf16 ] && flag=(--quantization "$quant")
    minillm bench latency --model "$MODEL" --load-format dummy --batching continuous --peers "${flag[@]}" \
      --output "$RUNS/${quant}_${round}.json" > "$RUNS/${quant}_${round}.log" 2>&1 || tail -5 "$RUNS/${quant}_${round}.log"
  done
done
python3 - "$RUNS" "$QUANTS" "$OUT" <<'PY'
import glob, json, sys
from minillm.bench.harness import result_header
runs_dir, quants, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
runs, mean = {}, {}
for quant in quants:
    tok_s = [json.load(open(f))["runs"]["minillm"]["mean_decode_tok_s"]
             for f in sorted(glob.glob(f"{runs_dir}/{quant}_*.json"))]
    runs[quant] = {"tok_s_per_process": tok_s}
    mean[quant] = sum(tok_s) / len(tok_s)
    print(quant, [round(t, 1) for t in tok_s], "tok/s", flush=True)
for quant in quants:
    if quant != "bf16" and "bf16" in mean:
        runs[f"{quant}_over_bf16"] = mean[quant] / mean["bf16"]
        print(quant, "/ bf16:", round(runs[f"{quant}_over_bf16"], 3), flush=True)
result = result_header("latency_processes", "latency, batch 1", "-", f"QUANTS={','.join(quants)} bash benchmarks/latency_processes.sh")
result["note"] = "mean decode tok/s of `minillm bench latency`, one process per run, the quantizations in turn"
result["runs"] = runs
json.dump(result, open(f"{out}/latency_processes.json", "w"), indent=1)
PY
