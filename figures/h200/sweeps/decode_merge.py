"""Who should merge the paged decode kernel's splits on the H200: a second kernel (merge="kernel") or the
last split program of each (sequence, KV head) to finish (merge="last_split")? The answer sets
kernels/paged_attention.py's DEFAULT_MERGE.

Part 1, the kernel: for llama2-7b's heads (32/32, no GQA) and a GQA shape (32/8), batch 1..32, contexts
up to the table's width (the engine's graphs size the table by max_model_len, and the split count
follows it: choose_num_splits), bf16 and INT8 / INT4 KV: GPU time per call of each merge, timed as
time_ms does (graph replays, so the second kernel's launch gap counts as in the engine), the two
interleaved twice; each output is checked against the reference and the two for bit equality.
Part 2, the engine (skipped with SMALL): batch-1 llama2-7b dummy decode graph replay (as
tp_decode_profile.py times it) with each DEFAULT_MERGE, in one process.
Run: PYTHONPATH=$PWD python figures/h200/sweeps/decode_merge.py -> $OUT/decode_merge.json (ENGINE=0: part 1 only;
the JSON is written after part 1 and again at the end).
DEV=cpu SMALL=1 TRITON_INTERPRET=1 checks the script on a CPU (fp16: the interpreter mis-reads bf16 tiles)."""
import json, os, sys
import torch
from minillm.bench.harness import result_header
from minillm.bench.kernels import paged_copy, time_ms
from minillm.kernels import paged_attention as pa
from minillm.kernels.checks import num_sms
from minillm.kv.quant import quantize_kv

OUT = os.environ.get("OUT", "/tmp/out"); dev = torch.device(os.environ.get("DEV", "cuda"))
SMALL = bool(os.environ.get("SMALL"))
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
D, BS = 128, 16
# (kv format, query heads, KV heads, batch, context, table width in tokens = max_model_len)
cases = [(kv, 32, hkv, b, s, width) for kv in ("auto",) for hkv in (32, 8) for b in (1, 2, 8, 32)
         for s, width in ((512, 2048), (2000, 2048), (8000, 8192))]
cases += [(kv, 32, 32, 1, 2000, 2048) for kv in ("int8", "int4")]
if SMALL:
    cases = [("auto", 4, 2, 2, 48, 64), ("int8", 4, 4, 1, 80, 128)]

rows = []
for kv, H, Hkv, B, S, width in cases:
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=gen)
    k, v = (torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=gen) for _ in range(2))
    k_pool, tables = paged_copy(k, BS, torch.Generator().manual_seed(0))
    v_pool = torch.empty_like(k_pool); v_pool[tables.view(-1).long()] = v.reshape(-1, BS, Hkv, D)
    tables = torch.cat([tables, torch.zeros(B, width // BS - tables.shape[1], dtype=torch.int32, device=dev)], 1)
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    scales = {}
    if kv != "auto":
        k_pool, ks = quantize_kv(k_pool, kv); v_pool, vs = quantize_kv(v_pool, kv); scales = dict(k_scale=ks, v_scale=vs)
    splits = pa.choose_num_splits(B, Hkv, width, num_sms(dev)) if not SMALL else 3
    ref = pa.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, **scales).float()
    ws = pa.PagedAttentionWorkspace.allocate(B, H, D, splits, dev)
    outs = {m: torch.full_like(q, float("nan")) for m in pa.MERGES}
    call = {m: (lambda m=m: pa.paged_decode_attention(q, k_pool, v_pool, tables, lens, num_splits=splits, out=outs[m],
                                                       workspace=ws, merge=m, **scales)) for m in pa.MERGES}
    ms = {m: [] for m in pa.MERGES}
    for _ in range(2):  # interleaved: clock drift hits both
        for m in pa.MERGES:
            ms[m].append(time_ms(call[m], dev, iters=50, repeats=5))
    for m in pa.MERGES:
        outs[m].fill_(float("nan")); call[m]()
    row = dict(kv=kv, heads=H, kv_heads=Hkv, batch=B, context=S, table_tokens=width, splits=splits,
               **{f"{m}_us": min(ms[m]) * 1e3 for m in pa.MERGES},
               err=(outs["last_split"].float() - ref).abs().max().item(),
               bit_identical=bool(torch.equal(outs["kernel"], outs["last_split"])))
    row["last_split_over_kernel"] = row["last_split_us"] / row["kernel_us"]
    rows.append(row)
    print({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}, flush=True)



def save(engine):
    ratios = [r["last_split_over_kernel"] for r in rows]
    result = result_header("decode_merge", "paged decode: split merge by a second kernel vs the last split program",
                           "llama2-7b / GQA 32:8 heads, D=128", "python figures/h200/sweeps/decode_merge.py")
    result["runs"] = rows
    result["engine_replay_ms"] = engine
    result["summary"] = dict(worst_ratio=max(ratios), best_ratio=min(ratios),
                             all_bit_identical=all(r["bit_identical"] for r in rows),
                             note="ratio = last_split us / kernel us per call; < 1: the in-kernel merge is faster")
    os.makedirs(OUT, exist_ok=True)
    json.dump(result, open(f"{OUT}/decode_merge.json", "w"), indent=1)
    return result


save({})  # the kernel part is kept even if the engine part runs out of time
engine = {}
if not SMALL and os.environ.get("ENGINE", "1") == "1":  # ENGINE=0: the kernel part only
    sys.path.insert(0, os.path.dirname(__file__))
    from tp_decode_profile import replay_ms  # beside this script
    from minillm import LLM, SamplingParams
    prompt = list(range(100, 228))
    for merge in ("kernel", "last_split", "kernel"):  # kernel twice: how much the figure drifts
        pa.DEFAULT_MERGE = merge  # read at every call, so the graphs captured by this LLM use it
        llm = LLM("llama2-7b", load_format="dummy", batching="continuous", memory_budget=100 * 2**30, max_model_len=2048)
        llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
        engine.setdefault(merge, []).append(replay_ms(llm.engine.runner, 200))
        print(merge, engine[merge][-1], "ms per batch-1 decode replay", flush=True)
        llm.close()
        del llm; torch.cuda.empty_cache()

print(save(engine)["summary"])
