"""Condense ncu_kernels.sh's raw CSV (ncu --page raw --csv) into JSON: per profiled kernel, in launch order, its
time, instructions, DRAM bytes and throughput, achieved warps per SM, registers, shared memory, bank conflicts and
the six largest warp-stall reasons (cycles per issued instruction). Usage: python3 ncu_summary.py ncu_raw.csv.gz
CASE,CASE,... > ncu_kernels.json (the cases in the order ncu_kernels.py ran them; a case may launch several kernels,
which then share its name)."""
import csv, gzip, json, sys

METRICS = {"us": ("gpu__time_duration.sum", 1), "instructions": ("smsp__inst_executed.sum", 1),
           "dram_read_mb": ("dram__bytes_read.sum", 1), "dram_read_pct_of_peak": ("dram__bytes_read.sum.pct_of_peak_sustained_elapsed", 1),
           "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
           "warps_per_sm": ("sm__warps_active.avg.per_cycle_active", 1), "registers": ("launch__registers_per_thread", 1),
           "smem_per_block_kb": ("launch__shared_mem_per_block_dynamic", 1),
           "smem_load_bank_conflicts": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", 1),
           "smem_store_bank_conflicts": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", 1)}
rows = list(csv.reader(gzip.open(sys.argv[1], "rt")))
header, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(header)}
cases = sys.argv[2].split(",") if len(sys.argv) > 2 else []
stalls = [h for h in header if h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio")]
out = []
for i, r in enumerate(data):
    row = {"kernel": r[col["Kernel Name"]], "grid": r[col["Grid Size"]] if "Grid Size" in col else None,
           "block": r[col["Block Size"]] if "Block Size" in col else None}
    for key, (metric, factor) in METRICS.items():
        if metric in col and r[col[metric]] not in ("", "n/a"):
            row[key] = float(r[col[metric]].replace(",", "")) * factor
    top = sorted(((float(r[col[s]] or 0), s[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")])
                  for s in stalls), reverse=True)[:6]
    row["stalls_per_issue"] = {name: round(v, 2) for v, name in top}
    out.append(row)
json.dump(out, sys.stdout, indent=1)
