# Ran at commit 305280e; the prefetch it measures made decoding slower and was removed after this run
# (figures/h200/sweeps/l2_prefetch.json says by how much). To rerun it, check out that commit.
# Does warming L2 with the next matmul's weights inside the norm kernels pay (kernels/l2_prefetch.py)?
# Batch-1 decode of llama2-7b (dummy) on one H200 and on two (fused all-reduce), MINILLM_L2_PREFETCH_MB
# 0 / 16 / 32, all in one call on nvidia-h200-x2; plus the kernels' GPU tests. Writes $OUT.
# Run from the repository root: bash figures/h200/sweeps/l2_prefetch.sh
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q tests/kernels/test_fused_layer_ops.py tests/kernels/test_all_reduce_norm.py 2>&1 | tail -3 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
mkdir -p $OUT/runs
for mb in 0 16 32; do for tp in 1 2; do
  MINILLM_TP_ALLREDUCE=fused MINILLM_L2_PREFETCH_MB=$mb timeout 120 python3 -m minillm.cli bench latency --model llama2-7b \
    --load-format dummy --batching continuous --num-requests 3 --peers --num-scheduler-steps 8 -tp $tp \
    --output $OUT/runs/latency_tp${tp}_mb${mb}.json 2>&1 | tail -1 | sed "s/^/tp=$tp mb=$mb /"
done; done
tar czf $OUT/runs.tgz -C $OUT runs && rm -r $OUT/runs
