#!/bin/bash
# minillm's server against its own offline engine and against transformers' server, on one GPU, in one call:
#  (a) LLM.generate's throughput on the `mixed` workload (`minillm bench throughput`, no peers);
#  (b) `minillm serve` with the same requests all at once through HTTP (`minillm bench serve --request-rate inf`),
#      and its throughput as a share of (a) (the target: >= 90 %);
#  (c) a request-rate sweep of `minillm serve` (SWEEP_REQUESTS requests at each of RATES);
#  (d) `transformers serve --continuous-batching` on a random checkpoint of the same shape (in /dev/shm if writable)
#      (no EOS, a word-level tokenizer: prompts travel as text, outputs run to max_tokens), the same sweep.
# Each result lands in $OUT as soon as it exists: offline.json, serve_all_at_once.json, sweep_minillm.json,
# sweep_hf.json, serve_sweep.json (and serve_sweep.png, both servers' runs), serve_summary.json (the two ratios).
# LEGS="minillm hf" picks the legs; RESUME=DIR starts from the JSONs an earlier run on the same machine left in
# its $OUT, so the two legs can run as two calls of the device tool and still merge into one sweep and summary.
# A peer that fails or runs out of HF_TIMEOUT seconds keeps the rates it finished. transformers serve needs
# fastapi, uvicorn, pydantic and openai importable (carried wheels on PYTHONPATH; uvloop and httptools for minillm
# serve's fast path). Run from the repository root: OUT=/tmp/out bash benchmarks/serve_gpu.sh (on a copy without
# .git, MINILLM_COMMIT=<commit> names the code in the JSON).
# A CPU check of the script itself (a minute or two):
#   MODEL=tiny SCALE=cpu DTYPE=float32 DEVICE=cpu NUM_REQUESTS=8 SWEEP_REQUESTS=8 RATES="inf 4" WARMUPS=2 \
#     HF_FLAGS="--cb-num-blocks 64 --cb-max-batch-tokens 256" bash benchmarks/serve_gpu.sh
set -uo pipefail
MODEL=${MODEL:-llama2-7b}
SCALE=${SCALE:-gpu}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
NUM_REQUESTS=${NUM_REQUESTS:-128}
SWEEP_REQUESTS=${SWEEP_REQUESTS:-64}
RATES=${RATES:-inf 2 4 8}
WARMUPS=${WARMUPS:-64}
HF_FLAGS=${HF_FLAGS:-}
HF_TIMEOUT=${HF_TIMEOUT:-240}
LEGS=${LEGS:-minillm hf}
OUT=${OUT:-/tmp/out}
# -P: the repository root is not put on sys.path, so its top-level kernels/ never stands in for Hugging Face's
# `kernels` package, which some transformers versions import and fail on.
PY=${PYTHON:-python3 -P}
WORK=$(mktemp -d)
mkdir -p "$OUT"
[ -n "${RESUME:-}" ] && cp "$RESUME"/*.json "$WORK/"
export PYTHONUNBUFFERED=1
VOCAB=$($PY -c "from minillm.model.config import PRESETS; print(PRESETS['$MODEL'].vocab_size)") || exit 1
COMMON=(--workload mixed --scale "$SCALE" --vocab-size "$VOCAB" --seed 0)
read -r -a RATE_LIST <<< "$RATES"

log() { echo "[serve_gpu $(date +%T)] $*"; }
free_port() { $PY -c "from minillm.bench.serve import free_port; print(free_port())"; }
wait_health() {  # URL PID SECONDS: 0 once URL/health answers 200, 1 if PID exits or time runs out
  for _ in $(seq "$3"); do
    kill -0 "$2" 2>/dev/null || return 1
    $PY -c "import httpx, sys; sys.exit(httpx.get('$1/health', timeout=2).status_code != 200)" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
stop() { kill -TERM "$1" 2>/dev/null; for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return; sleep 1; done; kill -9 "$1"; }
merge() {  # the sweeps so far -> $OUT/serve_sweep.json + .png; the ratios -> $OUT/serve_summary.json
  $PY - "$WORK" "$OUT" "MODEL=$MODEL RATES='$RATES' SWEEP_REQUESTS=$SWEEP_REQUESTS bash benchmarks/serve_gpu.sh" <<'PY'
import json, sys
from pathlib import Path
from minillm.bench.harness import result_header, write_result
from minillm.bench.plots import plot_result
work, out, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
sweeps = [json.loads(p.read_text()) for p in (work / "sweep_minillm.json", work / "sweep_hf.json") if p.exists()]
if sweeps:
    merged = sweeps[0] | {"command": command, "runs": {k: v for s in sweeps for k, v in s["runs"].items()}}
    merged["servers"] = {s["runs"][next(iter(s["runs"]))]["label"]: s["served_model"] for s in sweeps if s["runs"]}
    write_result(merged, out / "serve_sweep.json")
    plot_result(merged, out / "serve_sweep.json")
summary = result_header("serve-summary", "mixed", merged["model"] if sweeps else "-", command)
offline, online = work / "offline.json", work / "serve_all_at_once.json"
if offline.exists() and online.exists():
    a = json.loads(offline.read_text())["runs"]["minillm"]["output_throughput"]
    b = json.loads(online.read_text())["runs"]["minillm@inf"]["output_throughput"]
    summary |= {"offline_output_throughput": a, "server_output_throughput": b, "server_over_offline": b / a}
    print(f"server / LLM.generate, all requests at once: {b:.0f} / {a:.0f} tok/s = {b / a:.1%} (target >= 90 %)")
runs = sweeps and {k: v for s in sweeps for k, v in s["runs"].items()}
if runs and "minillm@inf" in runs and "hf_serve@inf" in runs:
    m, h = runs["minillm@inf"]["output_throughput"], runs["hf_serve@inf"]["output_throughput"]
    summary |= {"minillm_at_saturation": m, "hf_serve_at_saturation": h, "minillm_over_hf_serve": m / h}
    print(f"minillm serve / transformers serve, all at once: {m:.0f} / {h:.0f} tok/s = {m / h:.1f}x (target >= 5x)")
write_result(summary, out / "serve_summary.json")
PY
}

if [[ " $LEGS " == *" minillm "* ]]; then
  log "(a) LLM.generate offline: $MODEL, mixed, $NUM_REQUESTS requests"
  $PY -m minillm.cli bench throughput --model "$MODEL" --load-format dummy --dtype "$DTYPE" --device "$DEVICE" \
    --batching continuous --workload mixed --scale "$SCALE" --num-requests "$NUM_REQUESTS" --peers \
    --output "$WORK/offline.json" | tail -3 && cp "$WORK/offline.json" "$OUT/"

  PORT=$(free_port)
  log "(b, c) minillm serve on port $PORT"
  $PY -m minillm.cli serve --model "$MODEL" --load-format dummy --dtype "$DTYPE" --device "$DEVICE" --host 127.0.0.1 \
    --port "$PORT" --uvicorn-log-level warning > "$WORK/minillm_server.log" 2>&1 &
  SERVER=$!
  if wait_health "http://127.0.0.1:$PORT" "$SERVER" 300; then
    log "(b) all $NUM_REQUESTS requests at once ($WARMUPS warm-up requests first)"
    $PY -m minillm.cli bench serve --base-url "http://127.0.0.1:$PORT" --label minillm "${COMMON[@]}" \
      --num-requests "$NUM_REQUESTS" --num-warmups "$WARMUPS" --request-rate inf \
      --output "$WORK/serve_all_at_once.json" \
      | tail -4 && cp "$WORK/serve_all_at_once.json" "$OUT/"
    log "(c) request rates $RATES, $SWEEP_REQUESTS requests each"
    $PY -m minillm.cli bench serve --base-url "http://127.0.0.1:$PORT" --label minillm "${COMMON[@]}" \
      --num-requests "$SWEEP_REQUESTS" --request-rate "${RATE_LIST[@]}" --output "$WORK/sweep_minillm.json" | tail -8
    cp "$WORK/sweep_minillm.json" "$OUT/"
  else
    log "minillm serve did not come up:"; tail -20 "$WORK/minillm_server.log"
  fi
  stop "$SERVER"
  merge
fi

if [[ " $LEGS " == *" hf "* ]]; then
  log "(d) transformers serve --continuous-batching: a random $MODEL checkpoint"
  # In memory where there is room (/dev/shm), so the checkpoint costs no disk writes.
  HF_DIR=$(mktemp -d -p "$([ -w /dev/shm ] && echo /dev/shm || echo "$WORK")")
  $PY -c "from minillm.bench.peers import write_hf_checkpoint as w; w('$MODEL', '$HF_DIR', '$DTYPE', '$DEVICE')" \
    || exit 1
  log "checkpoint written: $(du -sh "$HF_DIR" | cut -f1)"
  PORT=$(free_port)
  # shellcheck disable=SC2086
  $PY -m transformers.cli.transformers serve "$HF_DIR" --continuous-batching --host 127.0.0.1 --port "$PORT" \
    --device "$DEVICE" --dtype "$DTYPE" --log-level warning $HF_FLAGS > "$WORK/hf_server.log" 2>&1 &
  SERVER=$!
  if wait_health "http://127.0.0.1:$PORT" "$SERVER" 300; then
    timeout "$HF_TIMEOUT" $PY -m minillm.cli bench serve --base-url "http://127.0.0.1:$PORT" --label hf_serve \
      --model "$HF_DIR" --tokenizer "$HF_DIR" --no-ignore-eos "${COMMON[@]}" --num-requests "$SWEEP_REQUESTS" \
      --num-warmups 4 --request-rate "${RATE_LIST[@]}" --output "$WORK/sweep_hf.json" | tail -8
    [ -f "$WORK/sweep_hf.json" ] && cp "$WORK/sweep_hf.json" "$OUT/"
  else
    log "transformers serve did not come up:"; tail -20 "$WORK/hf_server.log"
  fi
  stop "$SERVER"
  merge
  rm -rf "$HF_DIR"
fi
log "done: $(ls "$OUT")"
rm -rf "$WORK"
