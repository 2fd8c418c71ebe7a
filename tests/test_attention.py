"""sparse_attn on the CPU backend against a float64 brute-force loop, with hostile inputs."""

import math

import pytest
import torch

import sparse_dsa_ops as dsa
from sparse_dsa_ops import KCacheLayout
from tests.oracle import DEEPSEEK, GEOMETRIES, GLM, brute_attn, hostile_indices, unselected_slots

NUM_SLOTS = 3000


def check_against_brute(out, lse, q, rows_of, indices, sm_scale, d_v, topk_length=None):
    """inf/NaN positions first, then per-output tolerances.

    out is bf16: one rounding of a convex combination of V rows, 2^-9 relative, plus float32
    accumulation error; lse is float32 accumulated over at most a few thousand terms.
    """
    ref_out, ref_lse = brute_attn(q, rows_of, indices, sm_scale, d_v, topk_length)
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    empty = torch.isinf(ref_lse)
    assert (lse[empty] == -math.inf).all() and out[empty].eq(0).all()
    err = (out.double() - ref_out).abs()
    assert (err <= ref_out.abs() * 2**-8 + 1e-5).all(), err.max()
    fin = ~empty
    assert torch.allclose(lse[fin].double(), ref_lse[fin], rtol=1e-5, atol=1e-4)


def bf16_pool(gen, geo, nan_slots=None):
    kv = torch.randn(NUM_SLOTS, geo.d_qk, generator=gen).bfloat16()
    if nan_slots is not None:
        kv[nan_slots] = float("nan")
    return kv


@pytest.mark.parametrize("heads", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_bf16_heads(gen, geo, heads):
    t_count, topk = 3, 128
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS, empty_rows=[1])
    kv = bf16_pool(gen, geo, unselected_slots(idx, NUM_SLOTS))
    q = torch.randn(t_count, heads, geo.d_qk, generator=gen).bfloat16()
    sm_scale = geo.d_qk**-0.5
    out, lse = dsa.sparse_attn(q, kv, idx, sm_scale, geo.d_nope)
    check_against_brute(
        out, lse, q, lambda s: kv[s].double() if 0 <= s < NUM_SLOTS else None, idx, sm_scale, geo.d_nope
    )


@pytest.mark.parametrize("topk", [64, 192, 2048, 2112])
@pytest.mark.parametrize("geo", [DEEPSEEK, GLM], ids=str)
def test_bf16_topk_and_lengths(gen, geo, topk):
    t_count, heads = 4, 8
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS, invalid_frac=0.1)
    idx[2, 2051:] = -1  # 2051 valid entries padded with -1 (for the long rows)
    lengths = torch.tensor([topk, 0, topk - 5, 1], dtype=torch.int32)
    kv = bf16_pool(gen, geo, unselected_slots(idx, NUM_SLOTS, lengths))
    q = torch.randn(t_count, heads, geo.d_qk, generator=gen).bfloat16()
    out, lse = dsa.sparse_attn(q, kv, idx, 0.05, geo.d_nope, lengths)
    check_against_brute(
        out, lse, q, lambda s: kv[s].double() if 0 <= s < NUM_SLOTS else None, idx, 0.05, geo.d_nope, lengths
    )
    assert (lse[1] == -math.inf).all()


@pytest.mark.parametrize("geo", GEOMETRIES, ids=str)
def test_packed_pool_paged(gen, geo):
    lay = KCacheLayout(geo.d_nope, geo.d_rope)
    t_count, heads, topk, page = 3, 16, 256, 64
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS - NUM_SLOTS % page, empty_rows=[2])
    num_slots = NUM_SLOTS - NUM_SLOTS % page
    k_nope = torch.randn(num_slots, geo.d_nope, generator=gen).bfloat16()
    k_rope = torch.randn(num_slots, geo.d_rope, generator=gen).bfloat16() if geo.d_rope else None
    pool = dsa.quant_k_cache(k_nope, k_rope)
    pool[unselected_slots(idx, num_slots)] = 0xFF  # NaN values and NaN scales in rows never read
    kv = pool.reshape(num_slots // page, page, 1, lay.row_bytes)
    q = torch.randn(t_count, heads, geo.d_qk, generator=gen).bfloat16()
    out, lse = dsa.sparse_attn(q, kv, idx.reshape(t_count, 1, topk), 0.07, geo.d_nope)
    deq = dsa.dequant_k_cache(pool).double()  # the packed kv means its dequantized rows
    check_against_brute(out, lse, q, lambda s: deq[s] if 0 <= s < num_slots else None, idx, 0.07, geo.d_nope)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["q-bf16", "q-fp8"])
@pytest.mark.parametrize("geo", [DEEPSEEK, GLM], ids=str)
def test_native_fp8(gen, geo, q_dtype):
    t_count, heads, topk = 3, 16, 128
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS)
    kv = torch.randn(NUM_SLOTS, geo.d_qk, generator=gen).to(torch.float8_e4m3fn)
    kv.view(torch.uint8)[unselected_slots(idx, NUM_SLOTS)] = 0x7F  # NaN
    q = torch.randn(t_count, heads, geo.d_qk, generator=gen).to(q_dtype)
    out, lse = dsa.sparse_attn(q, kv, idx, 0.05, geo.d_nope)
    check_against_brute(out, lse, q, lambda s: kv[s].double() if 0 <= s < NUM_SLOTS else None, idx, 0.05, geo.d_nope)


def test_duplicates_count_each_time(gen):
    kv = torch.randn(4, 256, generator=gen).bfloat16()
    q = torch.randn(1, 2, 256, generator=gen).bfloat16()
    idx = torch.full((1, 64), -1, dtype=torch.int32)
    idx[0, :3] = torch.tensor([1, 1, 2])
    out, lse = dsa.sparse_attn(q, kv, idx, 0.1, 256)
    s = (q[0].double() @ kv[[1, 2]].double().T) * 0.1
    assert torch.allclose(lse[0].double(), torch.logsumexp(torch.stack([s[:, 0], s[:, 0], s[:, 1]], 1), 1), atol=1e-5)


def test_empty_pool_and_empty_batch(gen):
    q = torch.randn(2, 4, 256, generator=gen).bfloat16()
    out, lse = dsa.sparse_attn(
        q, torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32), 0.1, 256
    )
    assert out.eq(0).all() and (lse == -math.inf).all()
    out, lse = dsa.sparse_attn(
        q[:0], torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(0, 64, dtype=torch.int32), 0.1, 256
    )
    assert out.shape == (0, 4, 256) and lse.shape == (0, 4)


@pytest.mark.parametrize("empty_lse", [math.inf, 0.0, -math.inf])
def test_empty_lse(gen, empty_lse):
    # rows without a valid entry (token 1: all -1; token 2: topk_length 0) take empty_lse, the others are unchanged
    kv = torch.randn(100, 256, generator=gen).bfloat16()
    q = torch.randn(3, 4, 256, generator=gen).bfloat16()
    idx = torch.randint(0, 100, (3, 64), generator=gen, dtype=torch.int32)
    idx[1] = -1
    lengths = torch.tensor([64, 64, 0], dtype=torch.int32)
    for f in (dsa.sparse_attn, dsa.sparse_attn_with_max_logits):
        base = f(q, kv, idx, 0.1, 256, lengths)
        got = f(q, kv, idx, 0.1, 256, lengths, None, empty_lse)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1][0], base[1][0])
        assert (got[1][1:] == empty_lse).all() and (base[1][1:] == -math.inf).all()
        assert all(torch.equal(g, b) for g, b in zip(got[2:], base[2:]))


def test_value_width_is_a_prefix(gen):
    # d_v narrower than d_nope is the caller's choice: V is the first d_v columns
    kv = torch.randn(100, 576, generator=gen).bfloat16()
    q = torch.randn(2, 4, 576, generator=gen).bfloat16()
    idx = torch.randint(0, 100, (2, 64), generator=gen, dtype=torch.int32)
    wide, lse_wide = dsa.sparse_attn(q, kv, idx, 0.1, 512)
    narrow, lse_narrow = dsa.sparse_attn(q, kv, idx, 0.1, 128)
    assert torch.equal(narrow, wide[..., :128]) and torch.equal(lse_narrow, lse_wide)


def test_deepseek_geometry_chunks_tokens(gen):
    # T 64, H 128, top-k 2048 at 576/512 spans several token chunks; check tokens from each
    kv = torch.randn(4096, 576, generator=gen).bfloat16()
    q = torch.randn(64, 128, 576, generator=gen).bfloat16()
    idx = torch.randint(-1, 4096, (64, 2048), generator=gen, dtype=torch.int32)
    out, lse = dsa.sparse_attn(q, kv, idx, 576**-0.5, 512)
    some = [0, 37, 63]
    check_against_brute(
        out[some], lse[some], q[some], lambda s: kv[s].double() if s >= 0 else None, idx[some], 576**-0.5, 512
    )


def test_deterministic(gen):
    kv = torch.randn(500, 576, generator=gen).bfloat16()
    q = torch.randn(5, 16, 576, generator=gen).bfloat16()
    idx = hostile_indices(gen, 5, 256, 500)
    a = dsa.sparse_attn(q, kv, idx, 0.1, 512)
    b = dsa.sparse_attn(q, kv, idx, 0.1, 512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kind", ["bf16", "fp8", "packed", "packed-strided-pages"])
def test_gpu_max_logits_scheme_matches_the_reference(gen, kind, monkeypatch):
    # the GPU backend's attn_max_logits is torch code over the K-cache family's gather kernel: run it here with the
    # reference's gather in the kernel's place
    from sparse_dsa_ops import _cuda
    from sparse_dsa_ops.ops import check_attn_max_logits

    gather = dsa.reference.gather_dequant_k_cache
    monkeypatch.setattr(_cuda.attention.k_cache, "gather_dequant_k_cache", lambda _, cache, ids: gather(cache, ids))

    geo, t_count, heads, topk = DEEPSEEK, 5, 16, 192
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS, empty_rows=[1])
    kv = bf16_pool(gen, geo, unselected_slots(idx, NUM_SLOTS))
    q = torch.randn(t_count, heads, geo.d_qk, generator=gen).bfloat16()
    if kind == "fp8":
        q, kv = q.to(torch.float8_e4m3fn), kv.nan_to_num().to(torch.float8_e4m3fn)
    elif kind.startswith("packed"):
        kv = dsa.quant_k_cache(kv[:, : geo.d_nope].nan_to_num(), kv[:, geo.d_nope :].nan_to_num())
        if kind == "packed-strided-pages":  # pages of 50 rows, 60 rows apart
            wide = torch.zeros(NUM_SLOTS // 50, 60, kv.shape[-1], dtype=torch.uint8)
            wide[:, :50] = kv.view(-1, 50, kv.shape[-1])
            kv = wide[:, :50]
    lengths = torch.tensor([topk, topk, 0, 100, 1], dtype=torch.int32)
    args = (q, kv, idx, geo.d_qk**-0.5, geo.d_nope, lengths)
    got = _cuda.attention.attn_max_logits(check_attn_max_logits(*args), *args)
    want = dsa.reference.attn_max_logits(*args)
    assert torch.equal(got.isinf(), want.isinf()) and (want[2] == -math.inf).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
