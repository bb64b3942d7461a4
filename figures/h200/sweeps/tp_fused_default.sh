# Ran at commit 5071f37, when MINILLM_TP_ALLREDUCE=auto (since removed) was the default and picked the fused
# all-reduce, on nvidia-h200-x2: the two-GPU tests, then batch-1 decode of llama2-7b (dummy) on one H200 and on
# two, one after the other. Writes $OUT. Run from the repository root: bash figures/h200/sweeps/tp_fused_default.sh
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q tests/test_parallel_gpu.py 2>&1 | tail -4 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
mkdir -p $OUT/runs
for tp in 1 2; do
  timeout 100 python3 -m minillm.cli bench latency --model llama2-7b --load-format dummy --batching continuous \
    --num-requests 3 --peers --num-scheduler-steps 8 -tp $tp --output $OUT/runs/latency_tp$tp.json 2>&1 | tail -1 | sed "s/^/tp=$tp /"
done
tar czf $OUT/runs.tgz -C $OUT runs && rm -r $OUT/runs
