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
