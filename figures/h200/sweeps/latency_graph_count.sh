#!/bin/bash
# Whether the number of decode graphs an engine captures moves its batch-1 decode: `minillm bench latency` on
# llama2-7b (dummy weights), one process a run, with the default max_num_seqs (256: 35 capture sizes) and with
# --max-num-seqs 1 (one), with and without the short-context attention graphs (MINILLM_SHORT_ATTENTION_TILES, at
# commit 4cb8cd7 only: reverted after this sweep, latency_graph_count.json).
# CONFIGS: label=quantization:max_num_seqs:switches (switches KEY=VALUE joined by +; quantization bf16 for none).
# Writes latency_graph_count.json to $OUT. Run from the repository root on an H200:
# bash figures/h200/sweeps/latency_graph_count.sh
set -e
CONFIGS=${CONFIGS:-"int4_256_short=rtn-int4:256: int4_256=rtn-int4:256:MINILLM_SHORT_ATTENTION_TILES=0 int4_1_short=rtn-int4:1: int4_1=rtn-int4:1:MINILLM_SHORT_ATTENTION_TILES=0 bf16_256=bf16:256:MINILLM_SHORT_ATTENTION_TILES=0 bf16_1_short=bf16:1: bf16_1=bf16:1:MINILLM_SHORT_ATTENTION_TILES=0"}
RUNS=${OUT:-/tmp/out}/runs
mkdir -p "$RUNS"
for config in $CONFIGS; do
  label=${config%%=*}; spec=${config#*=}
  IFS=: read -r quant seqs switches <<< "$spec"
  flag=(); [ "$quant" != bf16 ] && flag=(--quantization "$quant")
  env ${switches//+/ } python3 -m minillm.cli bench latency --model llama2-7b --load-format dummy --batching continuous \
    --max-num-seqs "$seqs" --peers "${flag[@]}" --output "$RUNS/$label.json" > "/tmp/$label.log" 2>&1 || tail -5 "/tmp/$label.log"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], round(r['runs']['minillm']['mean_decode_tok_s'], 1), 'tok/s', flush=True)" "$RUNS/$label.json" "$label"
done
python3 - "$RUNS" "$CONFIGS" <<'PY'
import json, os, sys
sys.path.insert(0, "figures/h200/sweeps")
from launch_sweep import save_result
runs_dir, configs = sys.argv[1], sys.argv[2].split()
runs = {}
for config in configs:
    label, spec = config.split("=", 1)
    runs[label] = {"config": spec, "tok_s": json.load(open(f"{runs_dir}/{label}.json"))["runs"]["minillm"]["mean_decode_tok_s"]}
save_result(os.environ.get("OUT", "/tmp/out"), "latency_graph_count", "latency, llama2-7b, batch 1",
            "mean decode tok/s of `minillm bench latency`, one process a run; config quantization:max_num_seqs:switches", runs)
PY
