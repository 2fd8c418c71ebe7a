"""The packed FP8 cache ops on the CPU backend, against float64 brute-force definitions."""

import pytest
import torch

import sparse_dsa_ops as dsa
from sparse_dsa_ops import KCacheLayout
from tests.oracle import GEOMETRIES, INT_MAX, INT_MIN, brute_fp8, brute_scales, fp8_rank, split_packed


def make_k(gen, n, geo, magnitude=1.0):
    """K rows with magnitudes spread over many binades, one all-zero tile and one all-zero row."""
    k_nope = torch.randn(n, geo.d_nope, generator=gen) * magnitude
    k_nope *= (
        torch.exp2(torch.randint(-8, 8, (n, geo.d_nope // 128, 1), generator=gen).float())
        .repeat_interleave(128, dim=1)
        .reshape(n, -1)
    )
    k_nope[0, :128] = 0
    k_nope[-1] = 0
    k_rope = torch.randn(n, geo.d_rope, generator=gen).bfloat16() if geo.d_rope else None
    return k_nope.bfloat16(), k_rope


@pytest.mark.parametrize("round_scale", [False, True], ids=["fp32-scale", "pow2-scale"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_quant_bytes(gen, geo, round_scale):
    k_nope, k_rope = make_k(gen, 9, geo)
    packed = dsa.quant_k_cache(k_nope, k_rope, round_scale)
    assert packed.dtype == torch.uint8 and packed.shape == (9, KCacheLayout(geo.d_nope, geo.d_rope).row_bytes)
    values, scales, tail = split_packed(packed, geo.d_nope, geo.d_rope)
    expect_scales = brute_scales(k_nope, round_scale)
    assert torch.equal(scales, expect_scales)  # scales exactly
    if geo.d_rope:
        assert torch.equal(tail.view(torch.int16), k_rope.view(torch.int16))  # tail bit for bit
    else:
        assert tail.numel() == 0
    exact = k_nope.double().reshape(9, -1, 128) / expect_scales.double().unsqueeze(-1)
    expect = brute_fp8(exact.reshape(-1))
    # within one FP8 step of the correctly rounded value
    assert (fp8_rank(values.reshape(-1)) - fp8_rank(expect)).abs().max() <= 1
    assert torch.isfinite(values).all() and torch.isfinite(scales).all()


def test_quant_rounds_to_nearest_even(gen):
    # values that sit exactly between two FP8 numbers after scaling by amax / 448 = 1
    k = torch.zeros(1, 128)
    k[0, :6] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, -19.0, 0.5 * 2**-9])
    packed = dsa.quant_k_cache(k.bfloat16(), None)
    values, scales, _ = split_packed(packed, 128, 0)
    assert scales.item() == 1.0
    assert values[0, :6].tolist() == [448.0, 1.0, 1.25, 16.0, -20.0, 0.0]


def test_zero_rows_round_trip_exactly():
    packed = dsa.quant_k_cache(torch.zeros(3, 512, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.bfloat16))
    _, scales, _ = split_packed(packed, 512, 64)
    assert torch.equal(scales, torch.ones(3, 4))
    assert torch.equal(dsa.dequant_k_cache(packed), torch.zeros(3, 576, dtype=torch.bfloat16))


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4], ids=["tiny", "unit", "huge"])
@pytest.mark.parametrize("round_scale", [False, True], ids=["fp32-scale", "pow2-scale"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_round_trip(gen, geo, round_scale, magnitude):
    k_nope, k_rope = make_k(gen, 17, geo, magnitude)
    packed = dsa.quant_k_cache(k_nope, k_rope, round_scale)
    back = dsa.dequant_k_cache(packed)
    assert back.shape == (17, geo.d_qk) and back.dtype == torch.bfloat16
    x = k_nope.double()
    scale = brute_scales(k_nope, round_scale).double().repeat_interleave(128, dim=1)
    # FP8 e4m3: half an ulp is 2^-4 relative for normals, 2^-10 * scale absolute for subnormals;
    # then one bf16 rounding of the product.
    bound = x.abs() * (2**-4 + 2**-8) + scale * 2**-10 * (1 + 2**-8)
    err = (back[:, : geo.d_nope].double() - x).abs()
    assert (err <= bound).all(), (err - bound).max()
    if geo.d_rope:
        assert torch.equal(back[:, geo.d_nope :], k_rope)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_dequant_definition(gen, geo):
    k_nope, k_rope = make_k(gen, 5, geo)
    packed = dsa.quant_k_cache(k_nope, k_rope)
    values, scales, _ = split_packed(packed, geo.d_nope, geo.d_rope)
    expect = (values * scales.double().repeat_interleave(128, dim=1)).float().bfloat16()
    assert torch.equal(dsa.dequant_k_cache(packed)[:, : geo.d_nope].float(), expect.float())


def test_dequant_keeps_leading_dims(gen):
    k_nope, k_rope = make_k(gen, 12, GEOMETRIES[0])
    packed = dsa.quant_k_cache(k_nope, k_rope).reshape(3, 4, 1, 656)
    assert torch.equal(dsa.dequant_k_cache(packed), dsa.dequant_k_cache(packed.reshape(12, 656)).reshape(3, 4, 1, 576))


def random_pool(gen, num_pages, page_size, row_bytes):
    return torch.randint(0, 256, (num_pages, page_size, row_bytes), generator=gen, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_store_writes_exactly_the_addressed_slots(gen, geo, slot_dtype):
    lay = KCacheLayout(geo.d_nope, geo.d_rope)
    cache = random_pool(gen, 4, 16, lay.row_bytes)  # sentinel bytes everywhere
    before = cache.clone()
    k_nope, k_rope = make_k(gen, 8, geo)
    # interleaved valid slots on several pages, with padding and out-of-range entries
    loc = torch.tensor([5, -1, 17, 64, 63, INT_MIN, 0, 33], dtype=slot_dtype)
    if slot_dtype == torch.int64:
        loc[3] = 2**40
    dsa.store_k_cache(k_nope, k_rope, cache, loc)
    flat, flat_before = cache.reshape(64, -1), before.reshape(64, -1)
    rows = dsa.quant_k_cache(k_nope, k_rope)
    written = {5: 0, 17: 2, 63: 4, 0: 6, 33: 7}
    for slot in range(64):
        expect = rows[written[slot]] if slot in written else flat_before[slot]
        assert torch.equal(flat[slot], expect), slot


def test_store_round_scale_and_singleton_head_dim(gen):
    geo = GEOMETRIES[1]
    cache = torch.zeros(2, 8, 1, 264, dtype=torch.uint8)
    k_nope, _ = make_k(gen, 3, geo)
    loc = torch.tensor([15, 3, 100], dtype=torch.int32)
    dsa.store_k_cache(k_nope, None, cache, loc, True)
    expect = dsa.quant_k_cache(k_nope, None, True)
    assert torch.equal(cache.reshape(16, 264)[15], expect[0]) and torch.equal(cache.reshape(16, 264)[3], expect[1])
    assert cache.reshape(16, 264)[[i for i in range(16) if i not in (3, 15)]].eq(0).all()


def test_store_of_nothing_changes_nothing(gen):
    cache = random_pool(gen, 2, 4, 264)
    before = cache.clone()
    dsa.store_k_cache(torch.zeros(0, 256, dtype=torch.bfloat16), None, cache, torch.zeros(0, dtype=torch.int64))
    dsa.store_k_cache(torch.ones(2, 256, dtype=torch.bfloat16), None, cache, torch.tensor([-1, 8]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_gather_repeated_pages_and_invalid_ids(gen, geo):
    lay = KCacheLayout(geo.d_nope, geo.d_rope)
    k_nope, k_rope = make_k(gen, 24, geo)
    cache = dsa.quant_k_cache(k_nope, k_rope).reshape(3, 8, lay.row_bytes)
    ids = torch.tensor([9, 9, 23, 0, -1, 24, INT_MIN, INT_MAX, 8, 9], dtype=torch.int32)
    got = dsa.gather_k_cache(cache, ids)
    assert got.shape == (10, lay.row_bytes) and got.dtype == torch.uint8
    flat = cache.reshape(24, -1)
    for i, s in enumerate(ids.tolist()):
        expect = flat[s] if 0 <= s < 24 else torch.zeros(lay.row_bytes, dtype=torch.uint8)
        assert torch.equal(got[i], expect), i
    deq = dsa.gather_dequant_k_cache(cache, ids.long())
    assert deq.shape == (10, geo.d_qk) and deq.dtype == torch.bfloat16
    assert torch.equal(deq, dsa.dequant_k_cache(got))
    assert deq[4:8].eq(0).all()


def test_gather_of_nothing(gen):
    cache = random_pool(gen, 2, 4, 656)
    assert dsa.gather_k_cache(cache, torch.zeros(0, dtype=torch.int32)).shape == (0, 656)
    assert dsa.gather_dequant_k_cache(cache, torch.zeros(0, dtype=torch.int32)).shape == (0, 576)
