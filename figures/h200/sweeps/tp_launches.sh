# Batch-1 decode of llama2-7b (dummy) on one H200 and on two (TP=2, fused all-reduce), this tree against an
# older one side by side in one call (BASE: a directory holding that commit's minillm/ and kernels/, e.g.
# `git archive a06a8dc minillm kernels | tar -x -C _baseline`); then each tree's kernel timeline of one
# decode-graph replay (tp_timeline.py); last, the GPU tests of what changed. Writes $OUT.
# Run on nvidia-h200-x2 from the repository root: BASE=_baseline bash figures/h200/sweeps/tp_launches.sh
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
mkdir -p $OUT/runs
bench() {  # tree label tp
  reduce=$([ $3 = 1 ] && echo nccl || echo fused)
  (cd $1 && ln -sfn ../kernels minillm/kernels && MINILLM_TP_ALLREDUCE=$reduce PYTHONPATH=$PWD \
    timeout 100 python3 -m minillm.cli bench latency --model llama2-7b --load-format dummy --batching continuous \
    --num-requests 3 --peers --num-scheduler-steps 8 -tp $3 --output $OUT/runs/tp$3_$2.json 2>&1 \
    | grep "minillm " | tail -1 | sed "s/^/tp$3 $2: /")
}
for round in 1 2; do for tp in 1 2; do bench $PWD now$round $tp; bench $BASE base$round $tp; done; done
for tp in 1 2; do
  timeout 150 python3 figures/h200/sweeps/tp_timeline.py $tp $OUT/runs/timeline_tp${tp}_now.json 2>&1 \
    | grep -A9 "replay us"
  (cd $BASE && PYTHONPATH=$PWD timeout 150 python3 ../figures/h200/sweeps/tp_timeline.py $tp \
    $OUT/runs/timeline_tp${tp}_base.json 2>&1 | grep "replay us")
done
rm -f $OUT/runs/*.png; tar czf $OUT/runs.tgz -C $OUT runs && rm -r $OUT/runs
timeout 300 python3 -m pytest -q tests/kernels/test_kv_store.py tests/kernels/test_gemv.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_fused_layer_ops.py tests/test_cuda_graphs.py \
  tests/test_parallel_gpu.py 2>&1 | tail -3 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
