#!/bin/bash
# The ``latency`` workload as a user runs it: `minillm bench latency` on llama2-7b (dummy weights; MODEL: another
# preset), each quantization in a process of its own (QUANTS, "bf16" for none; ROUNDS rounds in turn), async
# scheduling as default (continuous batching, as the in-process sweeps). In one process the first engine's INT4
# decode runs ~3 % faster than any engine built after another (latency_pool.json's uncounted first engine: 651.5
# tok/s, the next four 629.8-632.6; decode_engine_order.json: 1.511 ms a token alone, 1.556 once a second engine
# was built) while bf16's does not change, so the in-process ABBA sweeps understate INT4 against what one process,
# one engine gives. A QUANTS entry may carry environment switches for its process after a +, e.g.
# rtn-int4+MINILLM_GEMV_STREAM=0 (an A/B of a switch, one process a run). Writes latency_processes.json to $OUT.
# Run from the repository root on an H200: bash figures/h200/sweeps/latency_processes.sh
set -e
QUANTS=${QUANTS:-rtn-int4,bf16,rtn-int4-head8}
ROUNDS=${ROUNDS:-2}
MODEL=${MODEL:-llama2-7b}
RUNS=${OUT:-/tmp/out}/runs  # each run's JSON as it ends (a cut-short call keeps them)
mkdir -p "$RUNS"
for round in $(seq "$ROUNDS"); do
  for label in ${QUANTS//,/ }; do
    quant=${label%%+*}
    rest=${label#"$quant"}; switches=(); IFS=+ read -r -a switches <<< "${rest#+}"
    flag=(); [ "$quant" != bf16 ] && flag=(--quantization "$quant")
    env "${switches[@]}" python3 -m minillm.cli bench latency --model "$MODEL" --load-format dummy --batching continuous --peers "${flag[@]}" \
      --output "$RUNS/${label}_${round}.json" > "/tmp/${label}_${round}.log" 2>&1 || tail -5 "/tmp/${label}_${round}.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], round(r['runs']['minillm']['mean_decode_tok_s'], 1), 'tok/s', flush=True)" "$RUNS/${label}_${round}.json" "$label $round"
  done
done
python3 - "$RUNS" "$QUANTS" <<'PY'
import glob, json, os, sys
sys.path.insert(0, "figures/h200/sweeps")
from launch_sweep import save_result
runs_dir, quants = sys.argv[1], sys.argv[2].split(",")
runs, mean = {}, {}
for quant in quants:
    tok_s = [json.load(open(f))["runs"]["minillm"]["mean_decode_tok_s"]
             for f in sorted(glob.glob(f"{runs_dir}/{quant}_*.json"))]
    runs[quant] = {"tok_s_per_process": tok_s}
    mean[quant] = sum(tok_s) / len(tok_s)
for quant in quants:
    if quant != "bf16" and "bf16" in mean:
        runs[f"{quant}_over_bf16"] = mean[quant] / mean["bf16"]
        print(quant, "/ bf16:", round(runs[f"{quant}_over_bf16"], 4), flush=True)
save_result(os.environ.get("OUT", "/tmp/out"), "latency_processes", "latency, llama2-7b, batch 1",
            "mean decode tok/s of `minillm bench latency`, one process per run, the quantizations in turn", runs)
PY
