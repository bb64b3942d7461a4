# Nsight Compute on the kernels behind the open issue bars (ncu_kernels.py says which and why). Run on the H200
# from the repository root: bash figures/h200/sweeps/ncu_kernels.sh; CASES=a,b picks cases. Writes to $OUT the
# details page as text (ncu_details.txt), every metric as CSV (ncu_raw.csv.gz), the source page with stall samples
# per instruction (ncu_source.csv.gz, condensed in ncu_source.json) and the report (kernels.ncu-rep.gz).
ln -sfn ../kernels minillm/kernels; export PYTHONPATH=$PWD
ncu --version > $OUT/ncu.log 2>&1
(cd figures/h200/sweeps && timeout ${NCU_TIMEOUT:-400} ncu --clock-control none --profile-from-start off --set full \
  --import-source no -f -o $OUT/kernels python3 ncu_kernels.py >> $OUT/ncu.log 2>&1)
ncu -i $OUT/kernels.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu -i $OUT/kernels.ncu-rep --page raw --csv > $OUT/ncu_raw.csv 2>&1
# Stall samples per SASS instruction (where each kernel waits), condensed by ncu_source.py.
ncu -i $OUT/kernels.ncu-rep --page source --print-source sass --csv > $OUT/ncu_source.csv 2>&1
gzip -f $OUT/ncu_raw.csv $OUT/ncu_source.csv $OUT/kernels.ncu-rep
python3 figures/h200/sweeps/ncu_summary.py $OUT/ncu_raw.csv.gz > $OUT/ncu_summary.json
python3 figures/h200/sweeps/ncu_source.py $OUT/ncu_source.csv.gz > $OUT/ncu_source.json
tail -3 $OUT/ncu.log; grep -c "Section: GPU Speed Of Light" $OUT/ncu_details.txt
