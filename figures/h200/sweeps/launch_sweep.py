"""The loop the paged-decode launch sweeps share (decode_launch.py, decode_int4.py): each
(block_n, warps, stages) x split count in random order until the deadline, timed, then run once more
on a poisoned output and compared with the reference; a launch that fails (e.g. too much shared
memory) is recorded, not fatal. Returns the rows fastest first."""
import itertools, random, time
from minillm.bench.kernels import time_ms


def time_launches(run, ref, out, kv_bytes, launches, splits, deadline, bandwidth=None):
    """``run(num_splits=, block_n=, num_warps=, num_stages=)`` writes ``out``; ``ref`` is its fp32 answer."""
    rows = []
    for (bn, w, st), ns in itertools.product(random.sample(launches, len(launches)), splits):
        if time.time() > deadline:
            break
        launch = dict(splits=ns, block_n=bn, num_warps=w, num_stages=st)
        call = lambda: run(num_splits=ns, block_n=bn, num_warps=w, num_stages=st)
        try:
            ms = time_ms(call, out.device, iters=10, repeats=3)
            out.fill_(float("nan")); call(); err = (out.float() - ref).abs().max().item()
            row = dict(ms=ms, gbs=kv_bytes / ms / 1e6, **launch, err=err)
            if bandwidth:
                row["fraction_of_bandwidth"] = row["gbs"] / bandwidth
            rows.append(row)
        except Exception as e:
            rows.append(dict(ms=float("inf"), **launch, error=str(e)[:150]))
    return sorted(rows, key=lambda r: r["ms"])
