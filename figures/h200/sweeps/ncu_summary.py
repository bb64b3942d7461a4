"""Condense ncu_kernels.sh's raw CSV (ncu --page raw --csv) into JSON: per profiled kernel, in launch order, its
time (us), instructions, DRAM bytes read (MB) and their share of peak, SM throughput, achieved warps per SM, registers,
shared memory per block (KB), shared-memory bank conflicts and the six largest warp-stall reasons (cycles per issued
instruction). ncu scales units per metric, so each value is converted by the CSV's units row.
Usage: python3 ncu_summary.py ncu_raw.csv.gz > out.json"""
import csv, gzip, json, sys

# key -> (metric, {unit: factor to the key's unit}); None: a count or a percentage, taken as it is.
SCALE_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
SCALE_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
SCALE_KB = {"byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}
METRICS = {"us": ("gpu__time_duration.sum", SCALE_US), "instructions": ("smsp__inst_executed.sum", None),
           "dram_read_mb": ("dram__bytes_read.sum", SCALE_MB),
           "dram_read_pct_of_peak": ("dram__bytes_read.sum.pct_of_peak_sustained_elapsed", None),
           "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", None),
           "warps_per_sm": ("sm__warps_active.avg.per_cycle_active", None),
           "registers": ("launch__registers_per_thread", None),
           "smem_per_block_kb": ("launch__shared_mem_per_block_dynamic", SCALE_KB),
           "smem_load_bank_conflicts": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", None),
           "smem_store_bank_conflicts": ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", None)}
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")

rows = list(csv.reader(gzip.open(sys.argv[1], "rt")))
header, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(header)}
stalls = [h for h in header if h.startswith(STALL[0]) and h.endswith(STALL[1])]
out = []
for r in data:
    row = {"kernel": r[col["Kernel Name"]], **{key: r[col[name]] if name in col else None
                                               for key, name in (("grid", "Grid Size"), ("block", "Block Size"))}}
    for key, (metric, scale) in METRICS.items():
        if metric in col and r[col[metric]] not in ("", "n/a"):
            unit = units[col[metric]]
            if scale is not None and unit not in scale:
                raise SystemExit(f"{metric} is in {unit!r}; this script knows {sorted(scale)}")
            row[key] = float(r[col[metric]].replace(",", "")) * (scale[unit] if scale else 1.0)
    top = sorted(((float(r[col[s]] or 0), s[len(STALL[0]):-len(STALL[1])]) for s in stalls), reverse=True)[:6]
    row["stalls_per_issue"] = {name: round(v, 2) for v, name in top}
    out.append(row)
json.dump(out, sys.stdout, indent=1)
