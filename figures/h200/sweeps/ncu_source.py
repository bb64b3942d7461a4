"""Condense Nsight Compute's source page (SASS with warp-stall samples per instruction) into JSON: for each kernel,
the share of stall samples per reason, the instructions that collect the most samples, and the global loads, async
copies and async-copy waits inside its hottest loop (the span of the backward branch the most samples fall in).

Why: ncu_summary.py's per-kernel totals say *that* a kernel waits; this says *where*, e.g. that the INT8-KV decode
kernel's waits sit on the first use of a 2-byte global load inside its loop. Input: the CSV of
``ncu -i REPORT --page source --print-source sass --csv`` (gzipped or not). Usage:
python figures/h200/sweeps/ncu_source.py dec_source.csv.gz [labels...] > out.json"""
import collections, csv, gzip, io, json, re, sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(text: str):
    """(kernel name, rows as dicts) per kernel section of the CSV."""
    for part in text.split('"Kernel Name",')[1:]:
        lines = part.splitlines()
        name = lines[0].strip().strip(",").strip('"')
        rows = list(csv.DictReader(io.StringIO("\n".join(lines[1:]))))
        yield name, rows


def condense(rows, top: int = 25) -> dict:
    stalls = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, h: int(r[h] or 0)  # noqa: E731
    total = sum(count(r, SAMPLES) for r in rows)
    reasons = collections.Counter({h[6:]: sum(count(r, h) for r in rows) for h in stalls})
    address = lambda r: int(r["Address"], 16)  # noqa: E731
    # The loop: the backward branch whose span holds the most samples.
    spans = []
    for r in rows:
        m = re.search(r"BRA\s+(?:`\()?(?:0x)?([0-9a-f]+)", r["Source"])
        if m and int(m.group(1), 16) < address(r):
            lo, hi = int(m.group(1), 16), address(r)
            spans.append((sum(count(x, SAMPLES) for x in rows if lo <= address(x) <= hi), lo, hi))
    loop = {}
    if spans:
        samples, lo, hi = max(spans)
        body = [r for r in rows if lo <= address(r) <= hi]
        ops = collections.Counter(r["Source"].split()[0] if not r["Source"].strip().startswith("@")
                                  else r["Source"].split()[1] for r in body)
        loop = dict(instructions=len(body), share_of_samples=round(samples / total, 3),
                    global_loads=[r["Source"].strip() for r in body if re.search(r"\bLDG\.", r["Source"])],
                    async_copies=sum(n for op, n in ops.items() if op.startswith("LDGSTS")),
                    async_waits=[r["Source"].strip() for r in body if "DEPBAR" in r["Source"]])
    hot = sorted(rows, key=lambda r: -count(r, SAMPLES))[:top]
    return dict(samples=total, reasons={k: round(v / total, 3) for k, v in reasons.most_common() if v},
                hottest_loop=loop,
                top_instructions=[dict(address=r["Address"][-5:], sass=r["Source"].strip(),
                                       share=round(count(r, SAMPLES) / total, 3),
                                       reasons=dict(sorted(((h[6:], count(r, h)) for h in stalls if count(r, h)),
                                                           key=lambda x: -x[1])[:3])) for r in hot])


if __name__ == "__main__":
    path, labels = sys.argv[1], sys.argv[2:]
    text = (gzip.open if path.endswith(".gz") else open)(path, "rt").read()
    result = {}
    for i, (name, rows) in enumerate(kernels(text)):
        result[labels[i] if i < len(labels) else f"{name} #{i}"] = condense(rows)
    print(json.dumps(result, indent=1))
