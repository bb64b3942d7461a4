#!/bin/bash
# What the prefix cache costs and gives on a GPU (llama2-7b, dummy weights; MODEL: another preset), one call:
#   1. mixed (no prompt shares a block with another: 0 % hits) on the whole card;
#   2. mixed on a 24 GB card (FULL_POOL, default --memory-budget 24GB): the KV pool is full, and a request's
#      new blocks come from evicting cached ones on most steps;
#   3. multi-turn: CHATS chats x 4 turns in a closed loop (each turn = history + the real answer + a new
#      message, sent when the answer has finished): hit rate beside the chats' own shared-token fraction.
# Each is one process: the cache on, off, then on again (--variants prefix_cache_off prefix_cache_on), so the
# comparison on / off does not put the process's first timed run on one side only. Writes each run's JSON and
# plot to $OUT, and prints the on / off ratios. Run from the repository root on a GPU, after
# `python3 -m pip install -q --no-deps --no-build-isolation -e .`, naming the commit where the copy has no .git:
#   MINILLM_COMMIT=<commit> OUT=/tmp/out bash benchmarks/prefix_cache_gpu.sh
# A CPU-sized check of the same (cpu scale, a few minutes): MODEL=tiny FULL_POOL="--num-kv-blocks 160" CHATS=8 bash ...
set -e -o pipefail
MODEL=${MODEL:-llama2-7b}
CHATS=${CHATS:-64}
FULL_POOL=${FULL_POOL:---memory-budget 24GB}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() {  # name, then the workload's own flags; progress bars left out, a failed run reported and the next one run
  local name=$1; shift
  minillm bench throughput --batching continuous --model "$MODEL" --load-format dummy --enable-prefix-caching \
    --variants prefix_cache_off prefix_cache_on --peers "$@" --output "$OUT/$name.json" 2>&1 \
    | grep -av 'req/s\]\|turn/s\]' || echo "$name failed"
}
run prefix_cache_mixed --workload mixed
# shellcheck disable=SC2086  # FULL_POOL is two words
run prefix_cache_mixed_full_pool --workload mixed $FULL_POOL
run prefix_cache_multi_turn --workload multi-turn --num-requests "$CHATS"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

print(f"{'run':<36}{'tok/s on/off':>14}{'TPOT on/off':>13}{'TTFT on/off':>13}{'hit rate':>10}{'shared':>8}")
for name in ("prefix_cache_mixed", "prefix_cache_mixed_full_pool", "prefix_cache_multi_turn"):
    path = Path(sys.argv[1]) / f"{name}.json"
    if not path.exists():
        print(f"{name:<36}  no result")
        continue
    runs = json.loads(path.read_text())["runs"]
    off = runs["minillm_prefix_cache_off"]
    for on_name in ("minillm", "minillm_prefix_cache_on"):
        on = runs[on_name]
        shared = f"{on['shared_token_fraction']:.1%}" if "shared_token_fraction" in on else "-"
        print(f"{name + (' (1st)' if on_name == 'minillm' else ''):<36}"
              f"{on['output_throughput'] / off['output_throughput']:>14.3f}"
              f"{on['mean_tpot_ms'] / off['mean_tpot_ms']:>13.3f}{on['mean_ttft_ms'] / off['mean_ttft_ms']:>13.3f}"
              f"{on['prefix_cache_hit_rate']:>10.1%}{shared:>8}")
PY
