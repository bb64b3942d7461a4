# Batch-1 decode of llama2-7b (dummy) on one H200 and on two (NCCL, then the all-reduce fused into the
# norms), side by side in one call on nvidia-h200-x2; plus the fused kernel's GPU tests. Writes $OUT.
# Run from the repository root: bash figures/h200/sweeps/tp_fused.sh
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q tests/kernels/test_all_reduce_norm.py 2>&1 | tail -3 > $OUT/gpu_tests.log
timeout 150 python3 -m pytest -q tests/test_parallel_gpu.py -k "fused" 2>&1 | tail -1 >> $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
mkdir -p $OUT/profiles
for cfg in "1 nccl" "2 nccl" "2 fused"; do set -- $cfg
  MINILLM_TP_ALLREDUCE=$2 timeout 120 python3 -m minillm.cli bench latency --model llama2-7b --load-format dummy \
    --batching continuous --num-requests 3 --peers --num-scheduler-steps 8 -tp $1 --output $OUT/profiles/latency_tp$1_$2.json 2>&1 | tail -2
done
for cfg in "1 nccl" "2 nccl" "2 fused"; do set -- $cfg
  MINILLM_TP_ALLREDUCE=$2 timeout 170 python3 figures/h200/sweeps/tp_decode_profile.py $1 $OUT/profiles/profile_tp$1_$2.json 2>&1 \
    | grep -v -i warn | tail -9
done
tar czf $OUT/profiles.tgz -C $OUT profiles && rm -r $OUT/profiles
