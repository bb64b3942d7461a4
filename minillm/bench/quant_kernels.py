"""The weight-only quantized matmul section of ``minillm bench kernels``: W8A16 and W4A16
(``kernels/quant_matmul.py``) next to ``torch.matmul`` on the dense weight.

Why: INT4 weights are a quarter of bf16's bytes, and a batch-1 decode step is bytes over bandwidth,
so the question is how much of that 4x a kernel call keeps. For each [M, K] @ [K, N] we time torch's
dense matmul, W8A16 and W4A16 (group size 128) on every path that applies: the GEMV and the dot up
to M = 4, the dot and W4A16's dequantize + cuBLAS from DEQUANT_MIN_M (and at M = 1 on an H100/H200, where
W4A16's GEMV is the Gluon kernel, the Triton GEMV too: "gemv_triton"). We report milliseconds, GB/s
counting the bytes a call moves (weights, scales, zeros and x read, y written), the fraction of the
measured copy bandwidth, and the speed-up over torch. Every kernel's output is also checked against
its torch reference, so a fast wrong kernel shows.

L2: the H200's L2 (50 MB) holds a 4096 x 11008 INT4 weight (23 MB). Replaying one call would then
read it from L2, which a decode step never does (each layer's weight is read once per step). So the
timed function cycles through enough copies of its weights to fill twice the L2.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from minillm.bench.kernels import time_ms

GROUP_SIZE = 128
GEMV_BENCH_MAX_M = 4  # both paths are timed up to this M: the data behind quant_matmul.GEMV_MAX_M


@dataclass(frozen=True)
class QuantShape:
    m: int
    k: int
    n: int


# Llama-2-7B's MLP (gate/up: 4096 -> 11008, down: 11008 -> 4096) and attention (4096 x 4096) projections.
GPU_QUANT = [QuantShape(m, k, n) for k, n in ((4096, 11008), (11008, 4096), (4096, 4096)) for m in (1, 4, 16, 64, 256)]
CPU_QUANT = [QuantShape(1, 256, 64), QuantShape(16, 256, 64)]


def _copies(nbytes: int, device: torch.device) -> int:
    """How many copies of ``nbytes`` of weights fill twice the L2 (1 on a CPU: no claim rests on it)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    return max(2, -(-2 * l2 // nbytes))


def _weights(shape: QuantShape, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> dict:
    """One set of random weights in the three formats: {"bf16": (w,), "w8a16": (q, s), "w4a16": (q, s, z)}."""
    from minillm.kernels.quant_matmul import pack_int4, pack_int4_along_n

    k, n = shape.k, shape.n
    groups = -(-k // GROUP_SIZE)
    ints = dict(device=device, generator=generator)
    return {
        "bf16": (torch.randn(k, n, dtype=dtype, **ints) * 0.02,),
        "w8a16": (torch.randint(-128, 128, (k, n), dtype=torch.int8, **ints),
                  torch.rand(n, dtype=dtype, **ints) * 1e-3),
        "w4a16": (pack_int4(torch.randint(0, 16, (k, n), **ints)),
                  torch.rand(groups, n, dtype=dtype, **ints) * 0.01,
                  pack_int4_along_n(torch.randint(0, 16, (groups, n), **ints))),
    }


def bytes_moved(fmt: str, shape: QuantShape, element_size: int) -> int:
    """Bytes one call must move: the weight in its format (with scales and zeros), x read, y written."""
    m, k, n = shape.m, shape.k, shape.n
    groups = -(-k // GROUP_SIZE)
    weight = {"bf16": k * n * element_size, "w8a16": k * n + n * element_size,
              "w4a16": k * n // 2 + groups * n * element_size + groups * n // 2}[fmt]
    return weight + (m * k + m * n) * element_size


def gluon_gemv_label(k: int, n: int, sms: int) -> str:
    """Which Gluon kernel the plain W4A16 GEMV of a K x N weight runs, and its shape."""
    from minillm.kernels.hopper import w4_gemv, w4_gemv_columns

    if w4_gemv_columns.unsupported(k, n, GROUP_SIZE, torch.bfloat16, 1) is None:
        warps, stages, blocks, _ = w4_gemv_columns.choose_shape(k, n, sms)
        return f"column kernel, {warps} warps x {stages} slots x {blocks} blocks"
    return f"split-K kernel, {w4_gemv.choose_tiles(k, n, sms)} tiles a program"


def bench_quant_matmul(shape: QuantShape, device: torch.device, dtype: torch.dtype, bandwidth_gbs: float) -> dict:
    from minillm.kernels.checks import num_sms
    from minillm.kernels.quant_matmul import DEQUANT_MIN_M, GEMV_MAX_M, autotuned_config, w4a16_matmul, \
        w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref
    from minillm.kernels.hopper.w4_gemv import use_hopper

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.m, shape.k, dtype=dtype, device=device, generator=gen)
    size = x.element_size()
    copies = _copies(bytes_moved("w4a16", shape, size), device)
    sets = [_weights(shape, dtype, device, gen) for _ in range(copies)]
    # "gemv_triton": W4A16's Triton GEMV where the Gluon one (hopper/w4_gemv.py) is what "gemv" runs, side by side.
    calls = {"bf16": lambda w, path: torch.matmul(x, w),
             "w8a16": lambda q, s, path: w8a16_matmul(x, q, s, path=path),
             "w4a16": lambda q, s, z, path: w4a16_matmul(x, q, s, z, GROUP_SIZE, path=path.removesuffix("_triton"),
                                                         hopper=False if path == "gemv_triton" else None)}
    refs = {"w8a16": w8a16_matmul_ref(x, *sets[0]["w8a16"]),
            "w4a16": w4a16_matmul_ref(x, *sets[0]["w4a16"], GROUP_SIZE)}

    def timed(fmt: str, path: str | None) -> dict:
        cycle = itertools.cycle(s[fmt] for s in sets)
        ms = time_ms(lambda: calls[fmt](*next(cycle), path=path), device)
        gbs = bytes_moved(fmt, shape, size) / ms / 1e6
        return {"ms": ms, "gbs": gbs, "fraction_of_bandwidth": gbs / bandwidth_gbs}

    row = {"shape": vars(shape), "dtype": str(dtype).removeprefix("torch."), "weight_copies": copies,
           "torch": timed("bf16", None)}
    kernel = gluon_gemv_label(shape.k, shape.n, num_sms(device))  # the Gluon GEMV's, for its config label
    for fmt, ref in refs.items():
        dequant = fmt == "w4a16" and shape.m >= DEQUANT_MIN_M
        paths = ("gemv", "dot") if shape.m <= GEMV_BENCH_MAX_M else ("dot", "dequant") if dequant else ("dot",)
        gluon = fmt == "w4a16" and use_hopper(x, *sets[0]["w4a16"], GROUP_SIZE, None, None)
        paths += ("gemv_triton",) if gluon else ()
        result = {"auto_path": "gemv" if shape.m <= GEMV_MAX_M else "dequant" if dequant else "dot"}
        for path in paths:
            run = timed(fmt, path)
            run["speedup"] = row["torch"]["ms"] / run["ms"]
            run["config"] = "dequantize + cuBLAS" if path == "dequant" else \
                f"Gluon (hopper/w4_gemv.py), {kernel}" if gluon and path == "gemv" else \
                autotuned_config(fmt[:2], path.removesuffix("_triton")) if device.type == "cuda" else \
                "interpreter (pinned)"
            error = (calls[fmt](*sets[0][fmt], path=path).float() - ref.float()).abs().max()
            run["max_rel_error"] = (error / ref.float().abs().max()).item()
            result[path] = run
        row[fmt] = result
    return row


def format_quant_table(rows: list[dict]) -> str:
    lines = [f"{'quant (M,K,N)':<22}{'bf16 GB/s':>10}{'w8a16 GB/s':>12}{'speed-up':>9}{'w4a16 GB/s':>12}"
             f"{'speed-up':>9}{'of copy BW':>11}{'w4 other path':>15}"]
    for row in rows:
        s = row["shape"]
        w8, w4 = (row[f][row[f]["auto_path"]] for f in ("w8a16", "w4a16"))
        other = {"gemv": "dot", "dot": "gemv", "dequant": "dot"}[row["w4a16"]["auto_path"]]
        other_cell = f"{other} {row['w4a16'][other]['speedup']:.2f}x" if other in row["w4a16"] else "-"
        lines.append(f"{str((s['m'], s['k'], s['n'])):<22}{row['torch']['gbs']:>10.0f}{w8['gbs']:>12.0f}"
                     f"{w8['speedup']:>8.2f}x{w4['gbs']:>12.0f}{w4['speedup']:>8.2f}x"
                     f"{w4['fraction_of_bandwidth']:>11.0%}{other_cell:>15}")
    return "\n".join(lines)


def plot_quant(axis, rows: list[dict]) -> None:
    """Speed-up over torch's dense matmul per shape and M, W8A16 and W4A16 side by side (each on its default path)."""
    labels = [f"M={r['shape']['m']}\n{r['shape']['k']}x{r['shape']['n']}" for r in rows]
    positions = range(len(rows))
    for offset, fmt, color in ((-0.2, "w8a16", "tab:green"), (0.2, "w4a16", "tab:purple")):
        axis.bar([p + offset for p in positions], [r[fmt][r[fmt]["auto_path"]]["speedup"] for r in rows], 0.4,
                 label=fmt, color=color)
    axis.set_xticks(list(positions), labels)
    axis.axhline(1.0, color="gray", lw=1)
    axis.set_ylabel("speed-up over torch.matmul (dense)")
    axis.set_title(f"weight-only quantized matmul (group {GROUP_SIZE})")
    axis.legend()
