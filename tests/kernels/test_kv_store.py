"""store_kv against its reference: random K/V written to random distinct slots of poisoned pools."""

import pytest
import torch

from minillm.kernels.kv_store import store_kv, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 16), (7, 2, 32), (33, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_kv_matches_reference(tokens, heads, dim, dtype):
    g = torch.Generator().manual_seed(tokens * 100 + heads)
    blocks, block_size = 6, 8
    # Strided rows, as the k and v slices of the fused qkv projection are.
    qkv = torch.randn(tokens, 3 * heads, dim, generator=g).to(DEVICE, dtype)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(DEVICE)
    pools = [torch.full((blocks, block_size, heads, dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_ref(k, v, pools[2], pools[3], slots)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.isnan(), want.isnan())  # untouched slots stay poisoned in both
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=0)
    assert not pools[0].view(-1, heads, dim)[slots].isnan().any()


def test_store_kv_refuses_bad_inputs_naming_them():
    k = torch.randn(4, 2, 16, device=DEVICE)
    pool = torch.zeros(3, 8, 2, 16, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, pool, pool, slots.int())
    with pytest.raises(ValueError, match="k_pool"):
        store_kv(k, k, torch.zeros(3, 8, 4, 16, device=DEVICE), pool, slots)
    with pytest.raises(ValueError, match="float64"):
        store_kv(k.double(), k.double(), pool.double(), pool.double(), slots)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 16), (9, 3, 64), (4, 5, 48)])
def test_int8_store_is_quantize_kv_bit_for_bit(tokens, heads, dim):
    """Codes and fp16 scales equal write_kv's torch path (quantize_kv); untouched slots keep their poison."""
    from minillm.kv.quant import quantize_kv

    g = torch.Generator().manual_seed(tokens + dim)
    blocks, block_size = 5, 4
    qkv = torch.randn(tokens, 3 * heads, dim, generator=g) * torch.logspace(-3, 2, tokens)[:, None, None]
    qkv[0, heads] = 0.0  # an all-zero head: the smallest scale, not a division by zero
    qkv = qkv.to(DEVICE, torch.float16)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(DEVICE)
    pools = [torch.full((blocks, block_size, heads, dim), -7, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    scales = [torch.full((blocks, block_size, heads), float("nan"), dtype=torch.float16, device=DEVICE) for _ in range(2)]
    store_kv(k, v, pools[0], pools[1], slots, scales[0], scales[1])
    for new, pool, scale in ((k, pools[0], scales[0]), (v, pools[1], scales[1])):
        want_codes, want_scale = quantize_kv(new, "int8")
        assert torch.equal(pool.view(-1, heads, dim)[slots], want_codes)
        assert torch.equal(scale.view(-1, heads)[slots], want_scale)
        untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert (pool.view(-1, heads, dim)[untouched] == -7).all()
        assert scale.view(-1, heads)[untouched].isnan().all()


def test_quantized_store_needs_its_scale_pools():
    k = torch.randn(2, 2, 16, device=DEVICE)
    pool = torch.zeros(3, 8, 2, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, k, pool, pool, torch.arange(2, device=DEVICE))
    slots = torch.arange(2, device=DEVICE)
    for bad in (torch.zeros(3, 8, 2, device=DEVICE),  # float32
                torch.zeros(1, dtype=torch.float16, device=DEVICE)):  # too small: the kernel would write past it
        with pytest.raises(ValueError, match="k_scale"):
            store_kv(k, k, pool, pool, slots, bad, torch.zeros(3, 8, 2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="k_scale"):  # scales with a float cache
        store_kv(k, k, pool.float(), pool.float(), slots, torch.zeros(3, 8, 2, dtype=torch.float16, device=DEVICE),
                 torch.zeros(3, 8, 2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # fp8 stays on the torch path
        fp8 = pool.to(torch.float8_e4m3fn)
        store_kv(k, k, fp8, fp8, torch.arange(2, device=DEVICE))


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (5, 3, 3, 32), (9, 6, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_rope_store_kv_is_rope_then_store_kv_bit_for_bit(tokens, heads, kv_heads, dim, dtype):
    """One kernel for RoPE on q and k (in place) and the store of the rotated k and of v: the bits of the RoPE
    kernel followed by store_kv, on q/k/v slices of one fused qkv row (head counts not powers of two too),
    into poisoned pools whose other slots stay poisoned."""
    from minillm.kernels.fused_layer_ops import rope
    from minillm.kernels.kv_store import rope_store_kv
    g = torch.Generator().manual_seed(tokens * 10 + heads)
    blocks, block_size = 4, 8
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(DEVICE, dtype)
    angles = torch.randn(tokens, dim // 2, generator=g) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(DEVICE)
    pools = [torch.full((blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
             for _ in range(4)]
    fused = qkv.clone()
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)
    rope_store_kv(q, k, v, cos, sin, pools[0], pools[1], slots)
    apart = qkv.clone()
    rows = apart[:, :heads + kv_heads]
    rope(rows, cos, sin, out=rows)
    store_kv(apart[:, heads:heads + kv_heads], apart[:, heads + kv_heads:], pools[2], pools[3], slots)
    torch.testing.assert_close(fused, apart, rtol=0, atol=0)  # q and k rotated in place, v untouched
    assert not torch.equal(fused[:, :heads], qkv[:, :heads])
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=0)


def test_rope_store_kv_refuses_a_quantized_cache_and_mismatched_q():
    from minillm.kernels.kv_store import rope_store_kv
    qkv = torch.randn(2, 4, 16, device=DEVICE)
    q, k, v = qkv.split([2, 1, 1], dim=1)
    cos = sin = torch.ones(2, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    pool = torch.zeros(1, 8, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="quantized cache"):
        rope_store_kv(q, k, v, cos, sin, pool.to(torch.int8), pool.to(torch.int8), slots)
    with pytest.raises(ValueError, match="q is"):
        rope_store_kv(q[:, :, :8], k, v, cos, sin, pool, pool, slots)
