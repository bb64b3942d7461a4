# Batch-1 decode of llama2-7b (dummy) on one H200 and on two (TP=2, the all-reduce fused into the norms):
# cuBLAS's GEMVs against minillm's (kernels/gemv.py), without and with programmatic dependent launch
# (kernels/pdl.py) and its L2 warm-up of MINILLM_GEMV_PREFETCH_MB; the GEMV's GPU tests first.
# Run on nvidia-h200-x2 from the repository root: bash figures/h200/sweeps/tp_gemv.sh [config ...]
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
[ -n "$SKIP_TESTS" ] || timeout 240 python3 -m pytest -q tests/kernels/test_gemv.py tests/kernels/test_fused_layer_ops.py 2>&1 | tail -2 > $OUT/gpu_tests.log
cat $OUT/gpu_tests.log
mkdir -p $OUT/runs
configs=${@:-"1:cublas 1:pdl8 2:cublas 2:pdl8 1:nopdl 2:nopdl 1:pdl0 2:pdl0 1:pdl16 2:pdl16"}
for cfg in $configs; do
  tp=${cfg%%:*}; v=${cfg#*:}
  case $v in
    cublas) env="MINILLM_GEMV=cublas MINILLM_PDL=0";;
    nopdl) env="MINILLM_PDL=0";;
    pdl*) env="MINILLM_GEMV_PREFETCH_MB=${v#pdl}";;
  esac
  env $env MINILLM_TP_ALLREDUCE=$([ $tp = 1 ] && echo nccl || echo fused) timeout 100 python3 -m minillm.cli bench latency \
    --model llama2-7b --load-format dummy --batching continuous --num-requests 3 --peers --num-scheduler-steps 8 -tp $tp \
    --output $OUT/runs/tp${tp}_$v.json 2>&1 | grep -i "tok/s\|error" | tail -1 | sed "s/^/tp$tp $v: /"
done
tar czf $OUT/runs.tgz -C $OUT runs && rm -r $OUT/runs
