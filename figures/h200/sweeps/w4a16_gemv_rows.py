"""Prototype: a W4A16 GEMV over a row-major repacking of the GPTQ weight (qweight.T: [N, K / 8] int32, each output's
packed inputs contiguous), shaped like the dense GEMV (kernels/gemv.py: many programs of a few output rows, each
streaming its rows' contiguous bytes), with the HFMA2 pair math of kernels/w4_gemv_pairs.py. The question: does the
GPTQ layout ([K / 8, N], an output's weights N * 4 bytes apart) hold the W4A16 GEMV at 2.0-2.2x bf16 where a bf16 GEMV
reading the same bytes runs at ~3x (figures/h200/sweeps/w4a16_gemv_tiles.json)?
Writes $OUT/w4a16_gemv_rows.json. Without CUDA: a tiny shape under the interpreter (TRITON_INTERPRET=1)."""
import itertools, json, os, random, time
import torch
import triton
import triton.language as tl
from minillm.bench.kernels import time_ms
from minillm.kernels.gemv import gemv
from minillm.kernels.int_float import int8_to_float
from minillm.kernels.quant_matmul import autotuned_config, pack_int4, pack_int4_along_n, w4a16_matmul, w4a16_matmul_ref
from minillm.kernels.quant_pack import unpack_int4_along_n
from minillm.kernels.split_k import finish, split_range, tile_counters
from minillm.kernels.w4_gemv_pairs import _fma2, _halves, _x_pairs


@triton.jit
def _word_sums(packed, pairs, BF16: tl.constexpr):
    """Per packed int32 (8 inputs of one output): sum_j x_j q_j 2**-32 (bf16) in fp32, via 4 LOP3 + 4+4 HFMA2."""
    acc2 = tl.zeros(packed.shape, tl.int32)
    shifted = packed >> 8
    for j in tl.static_range(4):
        src = packed if j < 2 else shifted
        v = src & (0x000F000F if j % 2 == 0 else 0x00F000F0)
        x_big = _fma2(pairs[j], 0x72007200 if j % 2 == 0 else 0x70007000, 0, BF16)
        acc2 = _fma2(x_big, v, acc2, BF16)
    lo, hi = _halves(acc2, BF16)
    return lo + hi


@triton.jit
def _rows_kernel(X, QT, ST, ZT, Y, Partials, Counters, N, KW, stride_q, stride_s,
                 BLOCK_N: tl.constexpr, GT: tl.constexpr, GW: tl.constexpr, SPLIT_K: tl.constexpr):
    """y[n] = sum_k x[k] (q[n, k] - z[n, g]) s[n, g]; tiles [BLOCK_N, GT groups, GW words a group] (bf16 x)."""
    XW = X.to(tl.pointer_type(tl.int32), bitcast=True)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nc = tl.minimum(n, N - 1)[:, None, None]
    start, end = split_range(KW, GT * GW, SPLIT_K)
    word = tl.arange(0, GT)[None, :, None] * GW + tl.arange(0, GW)[None, None, :]  # [1, GT, GW]
    acc = tl.zeros((BLOCK_N, GT, GW), tl.float32)
    for w0 in range(start, end, GT * GW):
        words = w0 + word
        ok = words < end
        at = tl.minimum(words, end - 1)
        packed = tl.load(QT + nc * stride_q + at)
        groups = tl.minimum(w0 + tl.arange(0, GT) * GW, end - 1)[None, :, None] // GW
        s = tl.load(ST + nc * stride_s + groups).to(tl.float32)
        z = int8_to_float(tl.load(ZT + nc * stride_s + groups))
        pairs, x_sum = _x_pairs(XW, words, ok, True)
        acc += _word_sums(packed, pairs, True) * (s * 4294967296.0) - x_sum * (z * s)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    finish(y[None, :], Y, Partials, Counters, tl.arange(0, 1), n, (n < N)[None, :], 1, N, 0, tl.program_id(0), SPLIT_K)


def rows_gemv(x, qt, st, zt, group_size, config):
    n, kw = qt.shape
    gw = group_size // 8
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    splits = config["SPLIT_K"]
    partials = torch.empty(splits * n if splits > 1 else 1, dtype=torch.float32, device=x.device)
    launch = {k: v for k, v in config.items() if k in ("num_warps", "num_stages")} if x.is_cuda else {}
    _rows_kernel[(triton.cdiv(n, config["BLOCK_N"]), splits)](
        x, qt, st, zt, y, partials, tile_counters(x.device), n, kw, qt.stride(0), st.stride(0),
        BLOCK_N=config["BLOCK_N"], GT=config["GT"], GW=gw, SPLIT_K=splits, **launch)
    return y


def repack(qweight, scales, zeros):
    """GPTQ [K / 8, N] -> row-major [N, K / 8] words, scales [N, groups], zero points int8 [N, groups]."""
    return (qweight.t().contiguous(), scales.t().contiguous(),
            unpack_int4_along_n(zeros).t().contiguous().to(torch.int8))


def main():
    OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True); G = 128
    GPU = torch.cuda.is_available(); dev = torch.device("cuda" if GPU else "cpu")
    dtype = torch.bfloat16
    L2 = torch.cuda.get_device_properties(dev).L2_cache_size if GPU else 0
    SHAPES = [(4096, 11008), (11008, 4096), (4096, 4096)] if GPU else [(512, 48)]
    # rows a thread = BLOCK_N * 4 GT / (32 num_warps): each thread's 16-byte loads cover 4 words of one row, and the
    # x-side work (loads, pair joins, sums) is shared by the rows a thread holds.
    CONFIGS = [dict(BLOCK_N=bn, GT=gt, SPLIT_K=sk, num_warps=w, num_stages=st)
               for bn, gt, sk, w, st in itertools.product((8, 16, 32, 64), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4), (1, 2, 3))
               if 2 <= bn * 4 * gt // (32 * w) <= 16]
    random.seed(0)
    PICKED = [dict(BLOCK_N=bn, GT=gt, SPLIT_K=sk, num_warps=w, num_stages=st) for bn, gt, sk, w, st in [
        (32, 2, 1, 1, 2), (32, 4, 1, 2, 2), (16, 2, 1, 1, 2), (32, 2, 2, 1, 2), (16, 2, 2, 1, 2), (32, 2, 4, 1, 2),
        (16, 4, 2, 1, 2), (64, 2, 2, 2, 2), (32, 2, 1, 1, 3), (16, 2, 4, 1, 3)]]
    SAMPLE = PICKED + [c for c in random.sample(CONFIGS, int(os.environ.get("SAMPLES", "30"))) if c not in PICKED] \
        if GPU else [dict(BLOCK_N=4, GT=2, SPLIT_K=2)]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, budget = [], float(os.environ.get("BUDGET_S", "360")) / len(SHAPES)
    for k, n in SHAPES:
        deadline, groups = time.time() + budget, k // G
        copies = max(2, -(-2 * L2 // (k * n // 2)))
        sets = [(pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=gen)),
                 (torch.rand(groups, n, device=dev, generator=gen) * 0.01).to(dtype),
                 pack_int4_along_n(torch.randint(0, 16, (groups, n), device=dev, generator=gen))) for _ in range(copies)]
        rsets = [repack(*s) for s in sets]
        x = torch.randn(1, k, device=dev, generator=gen).to(dtype)
        ref = w4a16_matmul_ref(x, *sets[0], G).float()
        dense = [torch.randn(k, n, device=dev, generator=gen).to(dtype) for _ in range(max(2, -(-2 * L2 // (2 * k * n))))]
        cyc = itertools.cycle(dense); torch_ms = time_ms(lambda: torch.matmul(x, next(cyc)), dev)
        del dense
        same = [torch.randn(n // 4, k, device=dev, generator=gen).to(dtype) for _ in range(copies)]
        cyc = itertools.cycle(same); same_ms = time_ms(lambda: gemv(x, next(cyc)), dev)
        del same
        cyc = itertools.cycle(sets)
        tuned_ms = time_ms(lambda: w4a16_matmul(x, *next(cyc), G, path="gemv", hopper=False), dev, iters=10, repeats=3)
        tuned_err = ((w4a16_matmul(x, *sets[0], G, path="gemv", hopper=False).float() - ref).abs().max() / ref.abs().max()).item()
        results = []
        for c in SAMPLE:
            if time.time() > deadline:
                break
            try:
                cyc = itertools.cycle(rsets)
                t = time_ms(lambda: rows_gemv(x, *next(cyc), G, c), dev, iters=10, repeats=3)
                y = rows_gemv(x, *rsets[0], G, c).float()
                results.append(dict(ms=t, err=((y - ref).abs().max() / ref.abs().max()).item(), **c))
            except Exception as e:
                results.append(dict(ms=float("inf"), error=str(e)[:160], **c))
        results.sort(key=lambda r: r["ms"])
        best = results[0]
        rows.append(dict(k=k, n=n, torch_ms=torch_ms, same_bytes_bf16_gemv_ms=same_ms, tuned_gptq_layout=dict(ms=tuned_ms, err=tuned_err,
                         config=autotuned_config("w4", "gemv")), tried=len(results), rows_top=results[:10]))
        print(f"K={k} N={n}: torch {torch_ms * 1e3:.1f}us same-bytes bf16 gemv {same_ms * 1e3:.1f}us; GPTQ-layout autotuned "
              f"{tuned_ms * 1e3:.1f}us ({torch_ms / tuned_ms:.2f}x, err {tuned_err:.2g}); rows best {best['ms'] * 1e3:.1f}us "
              f"({torch_ms / best['ms']:.2f}x) {best}", flush=True)
        json.dump(rows, open(f"{OUT}/w4a16_gemv_rows.json", "w"), indent=1)
        del sets, rsets


if __name__ == "__main__":
    main()
