"""``minillm bench kernels``: the Triton kernels next to torch's own ops and the device's ceilings.

Prefill (FlashAttention-style, ``kernels/flash_attention.py``) is compute-bound: we report TFLOP/s
and the fraction of SDPA's TFLOP/s on the same input (flash and cuDNN backends, each where torch
offers it). Decode (``kernels/paged_attention.py``) is memory-bound: we report GB/s counting the
K/V bytes it must read, and the fraction of the measured copy bandwidth (``bench/roofline.py``).
Every shape is also checked against SDPA, so a fast wrong kernel cannot pass as fast.

Decode also runs on quantized caches (``kv_cache_dtype`` int8 / fp8 / int4, ``minillm/kv/quant.py``):
its GB/s count the bytes actually read, quantized K/V plus their scales, so "keeps its bandwidth
utilisation while reading half the bytes" shows as the same fraction of copy bandwidth at half the
time. Each quantized row is timed in three interleaved rounds with the same K/V in unquantized pools
(``utilisation_vs_unquantized``: its GB/s over theirs, best round against best round, and round by round):
both kernels' times vary between rounds, and a ratio is only fair within the same ones. A row's "triton"
entry is minillm's kernel, whichever ran ("kernel": "triton" or "gluon_hopper"; the key predates the Gluon
kernels). Their error against SDPA on the unquantized K/V is the
quantization's; their error against ``paged_decode_attention_ref`` on the same quantized cache is the kernel's.

FLOPs of causal attention: 4·D per (query, key) pair and head, S(S+1)/2 pairs per sequence — the
convention of ``bench/roofline.py``. The weight-only quantized matmuls (W8A16, W4A16 against
``torch.matmul``) have a section of their own, ``bench/quant_kernels.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minillm.bench.roofline import measure_bandwidth
from minillm.kv.quant import kv_layout, quantize_kv


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    heads: int
    kv_heads: int
    context: int
    head_dim: int
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    block_n: int | None = None  # the decode kernel's tile and warps; None = its defaults
    num_warps: int | None = None


GPU_PREFILL = [PrefillShape(8, 32, 32, s, 128) for s in (512, 1024, 2048, 4096)] + \
              [PrefillShape(8, 32, 8, 2048, 128), PrefillShape(8, 32, 32, 2048, 64)]
GPU_DECODE = [DecodeShape(b, 32, 8, c, 128) for b, c in ((1, 2048), (1, 16384), (8, 2048), (32, 2048),
                                                         (64, 2048), (128, 2048), (64, 512), (64, 8192))] + \
             [DecodeShape(64, 32, 8, 2048, 128, kv_cache_dtype=kv) for kv in ("int8", "fp8", "int4")] + \
             [DecodeShape(64, 32, 8, 2048, 128, kv_cache_dtype="int8", block_n=128, num_warps=w) for w in (4, 8)]
# (A 1-byte cache moves half the bytes per tile: whether a 128-token tile reads it faster is measured, not assumed.)
# Under the interpreter on a CPU: the same code paths on shapes small enough to finish (no timings worth a claim).
CPU_PREFILL = [PrefillShape(1, 2, 1, 33, 16)]
CPU_DECODE = [DecodeShape(2, 4, 2, 40, 16, block_size=8),  # contexts: whole blocks (paged_copy)
              DecodeShape(2, 4, 2, 40, 16, block_size=8, kv_cache_dtype="int8")]


def time_ms(fn, device: torch.device, iters: int = 20, repeats: int = 5) -> float:
    """Milliseconds of GPU time per call: ``iters`` calls captured in one CUDA graph and replayed
    between two CUDA events, best of ``repeats``. The graph takes the CPU's launch cost out, as the
    engine's decode graphs do; a call that cannot be captured is timed as eager calls back to back.
    On a CPU: the wall time of one call (no claim rests on it)."""
    fn()  # warm-up: compiles, autotunes
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    run = _captured(fn, iters, device)
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / iters)
    return best


def _captured(fn, iters: int, device: torch.device):
    """A function that runs ``fn`` ``iters`` times: one graph replay if capture works, else a loop."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except RuntimeError:
        torch.cuda.synchronize(device)
        return lambda: [fn() for _ in range(iters)]
    return graph.replay


def _sdpa(backend: SDPBackend, q, k, v, causal: bool):
    """q [B, H, S, D], k/v [B, Hkv, S, D] through one SDPA backend; None if it refuses the input."""
    def call():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    try:
        call()
    except RuntimeError:
        return None
    return call


SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_interleaved(calls: dict, device: torch.device) -> dict:
    """{name: {"ms" (the best round), "ms_rounds"}} for each call: on a GPU timed in turn, three rounds, since an
    H200's clocks sag by up to ~15 % within a minute of load, and a ratio is only fair when both sides saw the same
    ones (figures/h200/sweeps/prefill_gluon, run 18); one round on a CPU."""
    rounds = {name: [] for name in calls}
    for _ in range(3 if device.type == "cuda" else 1):
        for name, call in calls.items():
            rounds[name].append(time_ms(call, device))
    return {name: {"ms": min(times), "ms_rounds": times} for name, times in rounds.items()}


def time_against_sdpa(triton_call, qkv, causal: bool, device: torch.device, rate) -> dict:
    """{"triton": ..., "sdpa_flash": ..., ...}: each {"ms" (the best round), "ms_rounds", **rate(ms)}
    (``time_interleaved``), None where torch offers no such SDPA kernel for this input."""
    timed = {"triton": triton_call}
    timed |= {name: _sdpa(backend, *qkv, causal=causal) for name, backend in SDPA_BACKENDS.items()}
    times = time_interleaved({name: call for name, call in timed.items() if call is not None}, device)
    return {name: times[name] | rate(times[name]["ms"]) if name in times else None for name in timed}


def causal_flops(shape: PrefillShape) -> float:
    pairs = shape.seq_len * (shape.seq_len + 1) / 2
    return 4 * shape.batch * shape.heads * shape.head_dim * pairs


def bench_prefill(shape: PrefillShape, device: torch.device, dtype: torch.dtype) -> dict:
    from minillm.kernels.flash_attention import choose_kernel, flash_attention

    B, H, Hkv, S, D = shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B * S, H, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B * S, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B * S, Hkv, D, device=device, dtype=dtype, generator=gen)
    cu = torch.arange(0, (B + 1) * S, S, device=device, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))

    def triton_call():
        return flash_attention(q, k, v, cu, cu, S, causal=True, out=out)

    def batched(x, heads):
        return x.view(B, S, heads, D).transpose(1, 2)

    qb, kb, vb = batched(q, H), batched(k, Hkv), batched(v, Hkv)
    flops = causal_flops(shape)
    row = {"shape": vars(shape), "dtype": str(dtype).removeprefix("torch."), "flops": flops}
    row["kernel"] = choose_kernel(q, k, v, out)[0]  # which one flash_attention runs
    row |= time_against_sdpa(triton_call, (qb, kb, vb), True, device, lambda ms: {"tflops": flops / ms / 1e9})
    reference = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), is_causal=True,
                                               enable_gqa=Hkv != H).transpose(1, 2).reshape(B * S, H, D)
    triton_call()
    row["max_abs_error"] = (out.float() - reference).abs().max().item()
    best = max((row[n]["tflops"] for n in SDPA_BACKENDS if row[n]), default=None)
    row["fraction_of_best_sdpa"] = row["triton"]["tflops"] / best if best else None  # best round against best round
    sdpa = [row[n]["ms_rounds"] for n in SDPA_BACKENDS if row[n]]
    rounds = zip(row["triton"]["ms_rounds"], *sdpa)  # round by round: both sides at the same clocks
    row["fraction_of_best_sdpa_rounds"] = [min(times) / mine for mine, *times in rounds] if sdpa else None
    return row


def paged_copy(contiguous: torch.Tensor, block_size: int, generator: torch.Generator):
    """[B, S, Hkv, D] -> (pool [blocks, block_size, Hkv, D], block tables [B, S/bs]) with the blocks shuffled,
    as a long-running engine's are."""
    B, S, Hkv, D = contiguous.shape
    per_seq = S // block_size
    order = torch.randperm(B * per_seq, generator=generator, device="cpu").to(contiguous.device)
    pool = torch.empty(B * per_seq, block_size, Hkv, D, dtype=contiguous.dtype, device=contiguous.device)
    pool[order] = contiguous.reshape(B * per_seq, block_size, Hkv, D)
    return pool, order.view(B, per_seq).to(torch.int32)


def bench_decode(shape: DecodeShape, device: torch.device, dtype: torch.dtype, bandwidth_gbs: float) -> dict:
    from minillm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
    from minillm.kernels.hopper.paged_decode import use_hopper

    B, H, Hkv, S, D = shape.batch, shape.heads, shape.kv_heads, shape.context, shape.head_dim
    quantized = shape.kv_cache_dtype != "auto"
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, S, Hkv, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, S, Hkv, D, device=device, dtype=dtype, generator=gen)
    cpu_gen = torch.Generator().manual_seed(0)
    k_pool, tables = paged_copy(k, shape.block_size, cpu_gen)
    v_pool = torch.empty_like(k_pool)
    v_pool[tables.view(-1).long()] = v.reshape(-1, shape.block_size, Hkv, D)
    lens = torch.full((B,), S, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    scales = {}
    plain_pools = (k_pool, v_pool)
    if quantized:
        k_pool, k_scale = quantize_kv(k_pool, shape.kv_cache_dtype)
        v_pool, v_scale = quantize_kv(v_pool, shape.kv_cache_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)

    def triton_call():
        return paged_decode_attention(q, k_pool, v_pool, tables, lens, out=out, block_n=shape.block_n,
                                      num_warps=shape.num_warps, **scales)

    # What the kernel reads: K and V of every token and head, scales included.
    kv_bytes = 2 * B * S * Hkv * kv_layout(shape.kv_cache_dtype, D, dtype).bytes_per_token_head()
    row = {"shape": vars(shape), "dtype": str(dtype).removeprefix("torch."), "kv_bytes": kv_bytes,
           # which kernel paged_decode_attention ran: the Gluon one for int8 on sm_90 (hopper/paged_decode.py)
           "kernel": "gluon_hopper" if use_hopper(q, k_pool, v_pool, scales.get("k_scale"), None, shape.block_n or
                                                  shape.num_warps) else "triton"}
    qb, kb, vb = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)  # SDPA reads contiguous K/V: no paging
    if quantized:
        # SDPA cannot read a quantized cache. The same K/V unquantized (bf16 on a GPU), timed in the same rounds, is
        # the comparison that says whether the quantized kernel keeps the unquantized kernel's utilisation.
        plain_bytes = 2 * B * S * Hkv * D * k.element_size()
        plain_out = torch.empty_like(q)
        times = time_interleaved({"triton": triton_call, "unquantized": lambda: paged_decode_attention(
            q, *plain_pools, tables, lens, out=plain_out)}, device)
        row["triton"] = times["triton"] | {"gbs": kv_bytes / times["triton"]["ms"] / 1e6}
        row["unquantized"] = times["unquantized"] | {"gbs": plain_bytes / times["unquantized"]["ms"] / 1e6}
        row["utilisation_vs_unquantized"] = row["triton"]["gbs"] / row["unquantized"]["gbs"]  # best against best
        row["utilisation_vs_unquantized_rounds"] = [kv_bytes * plain / (plain_bytes * mine) for mine, plain in zip(
            times["triton"]["ms_rounds"], times["unquantized"]["ms_rounds"])]
    else:
        row |= time_against_sdpa(triton_call, (qb, kb, vb), False, device, lambda ms: {"gbs": kv_bytes / ms / 1e6})
    reference = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), enable_gqa=Hkv != H)[:, :, 0]
    triton_call()
    row["max_abs_error"] = (out.float() - reference).abs().max().item()
    if quantized:
        kernel_ref = paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, **scales)
        row["max_abs_error_vs_ref"] = (out.float() - kernel_ref.float()).abs().max().item()
    row["fraction_of_bandwidth"] = row["triton"]["gbs"] / bandwidth_gbs
    return row


SECTIONS = ("prefill", "decode", "quant")


def bench_kernels(device: torch.device, dtype: torch.dtype | None = None, prefill=None, decode=None, quant=None,
                  progress: bool = True) -> dict:
    """Run the sweeps; returns {"ceilings", "prefill": [...], "decode": [...], "quant": [...]}. A sweep
    left as None gets its default shapes (GPU or CPU); an empty list skips it."""
    from tqdm.auto import tqdm

    from minillm.bench.quant_kernels import CPU_QUANT, GPU_QUANT, bench_quant_matmul

    on_gpu = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    defaults = {"prefill": (GPU_PREFILL, CPU_PREFILL), "decode": (GPU_DECODE, CPU_DECODE), "quant": (GPU_QUANT, CPU_QUANT)}
    given = {"prefill": prefill, "decode": decode, "quant": quant}
    shapes = {name: defaults[name][0 if on_gpu else 1] if given[name] is None else given[name] for name in SECTIONS}
    bandwidth = measure_bandwidth(device)
    run = {"prefill": lambda s: bench_prefill(s, device, dtype), "decode": lambda s: bench_decode(s, device, dtype, bandwidth),
           "quant": lambda s: bench_quant_matmul(s, device, dtype, bandwidth)}
    result = {"ceilings": {"bandwidth_gbs": bandwidth}} | {name: [] for name in SECTIONS}
    with tqdm(total=sum(map(len, shapes.values())), desc="kernels", disable=not progress) as bar:
        for name in SECTIONS:
            for shape in shapes[name]:
                result[name].append(run[name](shape))
                bar.update()
    return result


def decode_kv_label(shape: dict) -> str:
    """A decode row's KV format, and its tile x warps when the row overrides them."""
    label = shape.get("kv_cache_dtype", "auto")  # files written before quantized KV have no such key
    if shape.get("block_n"):
        label += f"/{shape['block_n']}x{shape['num_warps'] or 4}"
    return label


def format_kernel_table(result: dict) -> str:
    """One block per section the result holds (older results have no "quant")."""
    from minillm.bench.quant_kernels import format_quant_table

    runs = result["runs"]
    lines = []
    if runs.get("prefill"):
        lines.append(f"{'prefill (B,H,Hkv,S,D)':<26}{'kernel':>14}{'TFLOP/s':>9}{'SDPA flash':>12}{'SDPA cuDNN':>12}"
                     f"{'vs best':>9}")
    for row in runs.get("prefill", []):
        s = row["shape"]
        cells = [f"{row[n]['tflops']:.1f}" if row.get(n) else "-" for n in ("triton", "sdpa_flash", "sdpa_cudnn")]
        frac = row["fraction_of_best_sdpa"]
        lines.append(f"{str((s['batch'], s['heads'], s['kv_heads'], s['seq_len'], s['head_dim'])):<26}"
                     f"{row.get('kernel', 'triton'):>14}{cells[0]:>9}{cells[1]:>12}{cells[2]:>12}"
                     f"{(f'{frac:.0%}' if frac else '-'):>9}")
    if runs.get("decode"):
        lines.append(f"{'decode (B,H,Hkv,ctx,D)':<26}{'KV':>10}{'kernel':>14}{'GB/s':>8}{'ms':>9}{'SDPA flash':>12}"
                     f"{'of copy BW':>12}{'of unquant.':>13}")
    for row in runs.get("decode", []):
        s = row["shape"]
        flash = f"{row['sdpa_flash']['gbs']:.0f}" if row.get("sdpa_flash") else "-"
        kv = decode_kv_label(s)
        lines.append(f"{str((s['batch'], s['heads'], s['kv_heads'], s['context'], s['head_dim'])):<26}{kv:>10}"
                     f"{row.get('kernel', 'triton'):>14}{row['triton']['gbs']:>8.0f}{row['triton']['ms']:>9.3f}"
                     f"{flash:>12}"
                     f"{row['fraction_of_bandwidth']:>12.0%}"
                     + (f"{row['utilisation_vs_unquantized']:>13.0%}" if "utilisation_vs_unquantized" in row else ""))
    if runs.get("quant"):
        lines.append(format_quant_table(runs["quant"]))
    return "\n".join(lines)


def _plot_prefill(axis, rows: list[dict], ceilings: dict) -> None:
    labels = [f"S={r['shape']['seq_len']}\nHkv={r['shape']['kv_heads']} D={r['shape']['head_dim']}" for r in rows]
    axis.bar(labels, [r["fraction_of_best_sdpa"] or 0 for r in rows], color="tab:blue")
    axis.axhline(1.0, color="gray", lw=1)
    axis.set_ylabel("Triton TFLOP/s / best SDPA TFLOP/s")
    axis.set_title("prefill (causal, B=8, H=32)")


def _plot_decode(axis, rows: list[dict], ceilings: dict) -> None:
    labels = [f"B={r['shape']['batch']}\nctx={r['shape']['context']}"
              + ("" if decode_kv_label(r["shape"]) == "auto" else f"\n{decode_kv_label(r['shape'])}") for r in rows]
    axis.bar(labels, [r["fraction_of_bandwidth"] for r in rows], color="tab:orange")
    axis.axhline(1.0, color="gray", lw=1)
    axis.set_ylabel("K/V GB/s / copy bandwidth")
    axis.set_title(f"paged decode (H=32, Hkv=8, D=128); copy {ceilings['bandwidth_gbs']:.0f} GB/s")


def plot_kernels(result: dict, path: str) -> str:
    """A panel per section the result holds: prefill as a fraction of the best SDPA backend, decode as a
    fraction of copy bandwidth, quantized matmuls as a speed-up over torch's dense matmul."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.bench.quant_kernels import plot_quant

    runs = result["runs"]
    panels = {"prefill": _plot_prefill, "decode": _plot_decode, "quant": lambda axis, rows, _: plot_quant(axis, rows)}
    present = [name for name in SECTIONS if runs.get(name)]
    fig, axes = plt.subplots(1, len(present), figsize=(6 * len(present), 4), squeeze=False)
    for axis, name in zip(axes[0], present):
        panels[name](axis, runs[name], runs["ceilings"])
        axis.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{result['device']} · commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
