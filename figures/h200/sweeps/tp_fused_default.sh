# The fused all-reduce as the default (MINILLM_TP_ALLREDUCE=auto) on nvidia-h200-x2: the two-GPU tests, the
# kernel's tests, and batch-1 decode of llama2-7b (dummy) on one H200, on two with the default, and on two
# with NCCL, one after another. Writes $OUT. Run from the repository root:
# bash figures/h200/sweeps/tp_fused_default.sh
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
mkdir -p $OUT/runs
for cfg in "1 auto" "2 auto" "2 nccl"; do set -- $cfg
  MINILLM_TP_ALLREDUCE=$2 timeout 120 python3 -m minillm.cli bench latency --model llama2-7b --load-format dummy \
    --batching continuous --num-requests 3 --peers --num-scheduler-steps 8 -tp $1 \
    --output $OUT/runs/latency_tp$1_$2.json 2>&1 | tail -1 | sed "s/^/tp=$1 $2 /"
done
tar czf $OUT/runs.tgz -C $OUT runs && rm -r $OUT/runs
timeout 60 python3 -m pytest -q tests/kernels/test_all_reduce_norm.py 2>&1 | tail -1 > $OUT/gpu_tests.log
timeout 330 python3 -m pytest -q tests/test_parallel_gpu.py 2>&1 | tail -3 >> $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
