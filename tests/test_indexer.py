"""The lightning indexer's ops (quant_index, store_index_k, gather_index_k, index_logits, paged_index_logits) and the
attention extras (attention sinks, attn_max_logits) against independent brute-force definitions.

The oracles here read the index-K cache byte by byte from the layout's definition, round to FP8 through a table of
every code, and compute logits in float64, so that a mistake in ``reference.py`` does not hide itself. The CPU ops
are the reference; the ``cuda`` tests hold the GPU ops to it on the same data.
"""

import math
import struct

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
from sparse_dsa_ops import reference
from tests.oracle import INT_MAX, INT_MIN, brute_attn, hostile_indices, unselected_slots

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_NAN = 0x7F  # an e4m3fn NaN byte; 0xFF (also NaN) fills whole poisoned scales too
# Every non-negative finite e4m3fn value, by code: code c (0x00-0x7E) is entry c, ascending.
FP8_POSITIVE = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(FP8).double()
SCALE_FLOOR = float(torch.tensor(1e-4, dtype=torch.float32))  # the amax floor, as a float32
SCALE_BYTES = 4
PAGE_SIZES = [1, 16, 64, 128]
SLOT_DTYPES = [torch.int32, torch.int64]
HEADS = [1, 8, 32, 64, 128]
Q_DTYPES = {"q-fp8": FP8, "q-bf16": torch.bfloat16}
CACHE_FORMS = ["2d", "3d", "4d"]

# Logit tolerance (CPU). Every product of q and k (fp8 x fp8, or bf16 x fp8) is exact in float32, but the float32
# sums over D and over the heads round in whatever order a backend picks. For any order, recursive, blocked or
# pairwise, a sum of n terms is within (n - 1) * 2^-24 of the sum of their magnitudes; the logit is a D-term dot,
# a weight product, an Hi-term sum and a scale product, so the bound is (D + Hi + 2) * 2^-24 times
# k_scale * sum_h |w_h| * sum_d |q_hd * k_d|, doubled for second-order terms.
CPU_SUM_ROUNDING = 2 * 2.0**-24
# GPU kernels may accumulate on FP8 tensor cores, whose adders keep about 14 mantissa bits: hold them to 2^-9 of
# the same magnitude (a wrong row, scale or weight is off by the order of the magnitude itself).
GPU_LOGIT_RTOL = 2.0**-9


def junk_slots(num_slots, dtype):
    """Slot ids that address nothing: -1, other negatives, >= S, the int32 extremes (and past int32 for int64)."""
    junk = [-1, -2, -(2**20), num_slots, num_slots + 1, INT_MIN, INT_MAX]
    if dtype == torch.int64:
        junk += [2**40, -(2**40), num_slots + 2**32]  # the last one wraps onto a valid slot if read as int32
    return torch.tensor(junk, dtype=torch.int64)


def as_form(cache2d, page, dim, form):
    """The cache ``[P, page * (D + 4)]`` as the view the op is called with, and the head_dim to pass."""
    pages = cache2d.shape[0]
    if form == "2d":
        return cache2d, dim
    if form == "3d":
        return cache2d.view(pages, page, dim + SCALE_BYTES), None
    return cache2d.view(pages, page, 1, dim + SCALE_BYTES), None


def make_rows(gen, n, dim):
    """bf16 rows over many binades; an all-zero row, a row under the amax floor and a row of exact RNE midpoints."""
    x = torch.randn(n, dim, generator=gen) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=gen).float())
    x[0] = 0
    if n > 1:
        x[1] *= 1e-6 / x[1].abs().max()
    if n > 2:  # amax 448 gives scale 1: these values sit halfway between two FP8 numbers
        x[2] = 0
        x[2, :7] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, -19.0, 2.0**-10, -(3 * 2.0**-11)])
    return x.bfloat16()


# ------------------------------------------------------------------------------------------
# Oracles


def brute_fp8_codes(y):
    """e4m3fn codes (uint8) of float64 values already rounded to float32: saturate to +-448, nearest, ties to even."""
    sign = torch.signbit(y)
    a = y.abs().clamp(max=FP8_MAX).contiguous()
    upper = torch.searchsorted(FP8_POSITIVE, a).clamp(max=len(FP8_POSITIVE) - 1)  # first value >= a
    lower = (upper - 1).clamp(min=0)
    to_lower, to_upper = a - FP8_POSITIVE[lower], FP8_POSITIVE[upper] - a
    tie_pick = torch.where(lower % 2 == 0, lower, upper)  # the even code, i.e. the even last mantissa bit
    code = torch.where(to_lower < to_upper, lower, torch.where(to_upper < to_lower, upper, tie_pick))
    return (code + 128 * sign.long()).to(torch.uint8)


def brute_quant_index(x, round_scale):
    """(codes [..., D] uint8, scale [...] float32) of bf16 rows, one row at a time in float64."""
    rows = x.double().reshape(-1, x.shape[-1])
    scales = []
    for row in rows:
        s = float(torch.tensor(max(row.abs().max().item(), SCALE_FLOOR) / FP8_MAX, dtype=torch.float32))
        if round_scale:
            mantissa, exponent = math.frexp(s)
            s = s if mantissa == 0.5 else math.ldexp(1.0, exponent)
        scales.append(s)
    scale = torch.tensor(scales, dtype=torch.float64)
    quotient = (rows / scale[:, None]).float().double()  # the float32 quotient x / scale
    codes = brute_fp8_codes(quotient).reshape(x.shape)
    return codes, scale.float().reshape(x.shape[:-1])


def scale_bytes(s):
    return torch.tensor(list(struct.pack("<f", s)), dtype=torch.uint8)


def brute_store(cache2d, page, dim, codes, scales, loc):
    """The cache bytes after writing rows ``codes [N, D]`` / ``scales [N]`` into slots ``loc``, byte by byte."""
    out = cache2d.clone()
    num_slots = cache2d.shape[0] * page
    for i, slot in enumerate(loc.tolist()):
        if 0 <= slot < num_slots:
            p, o = divmod(slot, page)
            out[p, o * dim : (o + 1) * dim] = codes[i]
            out[p, page * dim + SCALE_BYTES * o : page * dim + SCALE_BYTES * (o + 1)] = scale_bytes(float(scales[i]))
    return out


def brute_gather(cache2d, page, dim, ids):
    """(value bytes [M, D] uint8, scale bytes [M, 4] uint8) of slots ``ids``; zeros for invalid ids."""
    values = torch.zeros(len(ids), dim, dtype=torch.uint8)
    scales = torch.zeros(len(ids), SCALE_BYTES, dtype=torch.uint8)
    for i, slot in enumerate(ids.tolist()):
        if 0 <= slot < cache2d.shape[0] * page:
            p, o = divmod(slot, page)
            values[i] = cache2d[p, o * dim : (o + 1) * dim]
            scales[i] = cache2d[p, page * dim + SCALE_BYTES * o : page * dim + SCALE_BYTES * (o + 1)]
    return values, scales


def brute_logits(q, keys, key_scale, weights):
    """float64 (logits [Hi-summed, m], magnitude [m]) of one query row ``q [Hi, D]`` over keys ``[m, D]``."""
    dots = q.double() @ keys.double().T  # [Hi, m], exact: every product and partial sum fits in float64
    w = weights.double()[:, None]  # [Hi, 1]
    logits = (w * dots.clamp(min=0)).sum(0) * key_scale.double()
    magnitude = (w.abs() * (q.double().abs() @ keys.double().abs().T)).sum(0) * key_scale.double().abs()
    return logits, magnitude


def brute_index_logits(q, k, k_scale, weights, ks, ke):
    """float64 (logits [T, N], magnitude [T, N]) by the definition, token by token."""
    t_count, n = q.shape[0], k.shape[0]
    out = torch.full((t_count, n), -math.inf, dtype=torch.float64)
    mag = torch.zeros(t_count, n, dtype=torch.float64)
    for t in range(t_count):
        lo, hi = max(int(ks[t]), 0), min(int(ke[t]), n)
        if lo < hi:
            out[t, lo:hi], mag[t, lo:hi] = brute_logits(q[t], k[lo:hi], k_scale[lo:hi], weights[t])
    return out, mag


def brute_paged_logits(q, cache2d, page, weights, lengths, page_table):
    """float64 (logits [R, W], magnitude [R, W]), each position read straight from the page bytes."""
    b_count, n_rows, _, dim = q.shape
    pages, max_pages = cache2d.shape[0], page_table.shape[1]
    width = max_pages * page
    out = torch.full((b_count * n_rows, width), -math.inf, dtype=torch.float64)
    mag = torch.zeros(b_count * n_rows, width, dtype=torch.float64)
    for b in range(b_count):
        for i in range(n_rows):
            r = b * n_rows + i
            pos = [p for p in range(min(max(int(lengths[r]), 0), width)) if 0 <= int(page_table[b, p // page]) < pages]
            if not pos:
                continue
            pos_t = torch.tensor(pos)
            entry, offset = page_table[b, pos_t // page].long(), pos_t % page
            keys = cache2d[entry[:, None], offset[:, None] * dim + torch.arange(dim)].view(FP8)  # [m, D]
            scale = cache2d[entry[:, None], page * dim + SCALE_BYTES * offset[:, None] + torch.arange(SCALE_BYTES)]
            out[r, pos_t], mag[r, pos_t] = brute_logits(q[b, i], keys, scale.view(torch.float32)[:, 0], weights[r])
    return out, mag


def check_logits(got, want, magnitude, rtol):
    """-inf exactly where the definition has it, nothing else infinite or NaN, then the rounding bound."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not got.isnan().any()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and (got[torch.isinf(got)] < 0).all()
    fin = torch.isfinite(want)
    err = (got.double()[fin] - want[fin]).abs()
    bound = rtol * magnitude[fin]
    assert (err <= bound).all(), (err - bound).max()


def index_rtol(dim, heads):
    return CPU_SUM_ROUNDING * (dim + heads + 2)


# ------------------------------------------------------------------------------------------
# quant_index


@pytest.mark.parametrize("round_scale", [False, True], ids=["fp32-scale", "pow2-scale"])
@pytest.mark.parametrize("shape", [(9, 128), (3, 4, 64), (2, 2, 3, 192), (128,)], ids=lambda s: "x".join(map(str, s)))
def test_quant_index_bytes(gen, shape, round_scale):
    x = make_rows(gen, math.prod(shape[:-1]), shape[-1]).reshape(shape)
    values, scale = dsa.quant_index(x, round_scale)
    assert values.dtype == FP8 and values.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == x.shape[:-1]
    want_codes, want_scale = brute_quant_index(x, round_scale)
    assert torch.equal(scale, want_scale)
    assert torch.equal(values.view(torch.uint8), want_codes)


def test_quant_index_floor_and_midpoints():
    x = torch.zeros(2, 64)
    x[1, :6] = torch.tensor([448.0, 1.0625, 1.1875, 17.0, -19.0, 2.0**-10])
    values, scale = dsa.quant_index(x.bfloat16())
    floor = torch.tensor(SCALE_FLOOR / FP8_MAX, dtype=torch.float32)
    assert scale[0] == floor and scale[1] == 1.0  # a zero row gets the floor's scale, never 0
    assert values[0].float().eq(0).all()
    assert values[1, :6].float().tolist() == [448.0, 1.0, 1.25, 16.0, -20.0, 0.0]


# ------------------------------------------------------------------------------------------
# store_index_k and gather_index_k


def slot_batch(gen, num_slots, n_valid, dtype):
    """Distinct valid slots mixed with every kind of junk, shuffled."""
    valid = torch.randperm(num_slots, generator=gen)[:n_valid]
    loc = torch.cat([valid, junk_slots(num_slots, dtype)])
    return loc[torch.randperm(len(loc), generator=gen)].to(dtype)


@pytest.mark.parametrize("form", CACHE_FORMS)
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=str)
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_store_index_k_writes_only_addressed_slots(gen, page, slot_dtype, form):
    dim = 128
    pages = max(6, 24 // page)
    cache2d = torch.randint(0, 256, (pages, page * (dim + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    loc = slot_batch(gen, pages * page, min(10, pages * page - 2), slot_dtype)
    k = make_rows(gen, len(loc), dim)
    codes, scales = brute_quant_index(k, round_scale=False)
    want = brute_store(cache2d, page, dim, codes, scales, loc)
    cache, _ = as_form(cache2d, page, dim, form)
    dsa.store_index_k(k, cache, loc)
    assert torch.equal(cache2d, want)


@pytest.mark.parametrize("dim", [64, 256], ids=lambda d: f"D{d}")
def test_store_index_k_round_scale_and_widths(gen, dim):
    page, pages = 16, 4
    cache2d = torch.full((pages, page * (dim + SCALE_BYTES)), 0xA5, dtype=torch.uint8)
    loc = slot_batch(gen, pages * page, 20, torch.int32)
    k = make_rows(gen, len(loc), dim)
    codes, scales = brute_quant_index(k, round_scale=True)
    dsa.store_index_k(k, cache2d, loc, True)
    assert torch.equal(cache2d, brute_store(torch.full_like(cache2d, 0xA5), page, dim, codes, scales, loc))


def test_store_index_k_nothing_valid_changes_nothing(gen):
    cache = torch.randint(0, 256, (3, 64, 132), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    loc = junk_slots(3 * 64, torch.int64)
    dsa.store_index_k(make_rows(gen, len(loc), 128), cache, loc)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("form", CACHE_FORMS)
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=str)
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_gather_index_k_bytes(gen, page, slot_dtype, form):
    dim, pages = 128, 5
    cache2d = torch.randint(0, 256, (pages, page * (dim + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    valid = torch.randint(0, pages * page, (40,), generator=gen)  # duplicates included
    ids = torch.cat([valid, junk_slots(pages * page, slot_dtype)])
    ids = ids[torch.randperm(len(ids), generator=gen)].to(slot_dtype)
    cache, head_dim = as_form(cache2d, page, dim, form)
    values, scale = dsa.gather_index_k(cache, ids, head_dim)
    assert values.dtype == FP8 and values.shape == (len(ids), dim)
    assert scale.dtype == torch.float32 and scale.shape == (len(ids),)
    want_values, want_scales = brute_gather(cache2d, page, dim, ids)
    assert torch.equal(values.view(torch.uint8), want_values)
    assert torch.equal(scale.view(torch.uint8).reshape(-1, SCALE_BYTES), want_scales)


@pytest.mark.parametrize("page", [1, 64], ids=lambda p: f"page{p}")
def test_store_then_gather_round_trip(gen, page):
    dim, pages = 128, 8
    cache = torch.full((pages, page, dim + SCALE_BYTES), 0xFF, dtype=torch.uint8)  # NaN everywhere first
    loc = torch.randperm(pages * page, generator=gen)[: min(30, pages * page)].int()
    k = make_rows(gen, len(loc), dim)
    dsa.store_index_k(k, cache, loc)
    values, scale = dsa.gather_index_k(cache, loc)
    want_values, want_scale = dsa.quant_index(k)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_gather_index_k_empty_cache_and_no_ids():
    values, scale = dsa.gather_index_k(torch.zeros(0, 16, 132, dtype=torch.uint8), torch.tensor([0, -1, 5]))
    assert values.view(torch.uint8).eq(0).all() and scale.eq(0).all() and values.shape == (3, 128)
    values, scale = dsa.gather_index_k(
        torch.zeros(2, 16 * 132, dtype=torch.uint8), torch.zeros(0, dtype=torch.int32), 128
    )
    assert values.shape == (0, 128) and scale.shape == (0,)


# ------------------------------------------------------------------------------------------
# index_logits


def logit_inputs(gen, t_count, n, heads, dim, q_dtype):
    q = torch.randn(t_count, heads, dim, generator=gen).to(q_dtype)
    k = (torch.randn(n, dim, generator=gen) * 4).to(FP8)
    k_scale = torch.rand(n, generator=gen) * 0.1 + 1e-3
    weights = torch.randn(t_count, heads, generator=gen)
    return q, k, k_scale, weights


# (ks, ke) per token: the whole row, empty, ks > ke, ks < 0, ke > N, the int32 extremes, a single key
def hostile_ranges(n):
    pairs = [(0, n), (5, 5), (40, 3), (-7, 40), (n - 50, n + 50), (INT_MIN, INT_MAX), (n - 1, n), (INT_MAX, INT_MIN)]
    ks, ke = zip(*pairs)
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


@pytest.mark.parametrize("q_dtype", Q_DTYPES.values(), ids=Q_DTYPES.keys())
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hi{h}")
def test_index_logits(gen, heads, q_dtype):
    n, dim = 300, 128
    ks, ke = hostile_ranges(n)
    q, k, k_scale, weights = logit_inputs(gen, len(ks), n, heads, dim, q_dtype)
    got = dsa.index_logits(q, k, k_scale, weights, ks, ke)
    want, magnitude = brute_index_logits(q, k, k_scale, weights, ks, ke)
    check_logits(got, want, magnitude, index_rtol(dim, heads))
    assert torch.isinf(got[[1, 2, 7]]).all()  # empty, ks > ke and reversed extremes: all -inf


@pytest.mark.parametrize("dim", [64, 192], ids=lambda d: f"D{d}")
def test_index_logits_widths(gen, dim):
    ks, ke = hostile_ranges(100)
    q, k, k_scale, weights = logit_inputs(gen, len(ks), 100, 8, dim, FP8)
    want, magnitude = brute_index_logits(q, k, k_scale, weights, ks, ke)
    check_logits(dsa.index_logits(q, k, k_scale, weights, ks, ke), want, magnitude, index_rtol(dim, 8))


def test_index_logits_never_show_keys_outside_the_ranges(gen):
    n, dim, heads = 256, 128, 16
    ks = torch.tensor([0, 10, 100, 0], dtype=torch.int32)
    ke = torch.tensor([64, 64, 180, 0], dtype=torch.int32)
    q, k, k_scale, weights = logit_inputs(gen, 4, n, heads, dim, FP8)
    outside = torch.ones(n, dtype=torch.bool)
    outside[:64] = outside[100:180] = False
    k.view(torch.uint8)[outside] = FP8_NAN
    k_scale[outside] = float("nan")
    got = dsa.index_logits(q, k, k_scale, weights, ks, ke)
    want, magnitude = brute_index_logits(q, k, k_scale, weights, ks, ke)
    check_logits(got, want, magnitude, index_rtol(dim, heads))


def test_index_logits_in_chunks(gen, monkeypatch):
    # a scratch bound of 30 keys' worth at 128 heads makes the reference walk 9 key chunks of one token each
    monkeypatch.setattr(reference.indexer, "_INDEX_CHUNK_BYTES", 4 * (128 + 128) * 30)
    ks, ke = hostile_ranges(250)
    q, k, k_scale, weights = logit_inputs(gen, len(ks), 250, 128, 128, torch.bfloat16)
    want, magnitude = brute_index_logits(q, k, k_scale, weights, ks, ke)
    check_logits(dsa.index_logits(q, k, k_scale, weights, ks, ke), want, magnitude, index_rtol(128, 128))


def test_index_logits_empty(gen):
    q, k, k_scale, weights = logit_inputs(gen, 3, 0, 4, 128, FP8)
    ks = ke = torch.zeros(3, dtype=torch.int32)
    assert dsa.index_logits(q, k, k_scale, weights, ks, ke).shape == (3, 0)
    q, k, k_scale, weights = logit_inputs(gen, 0, 10, 4, 128, FP8)
    ks = ke = torch.zeros(0, dtype=torch.int32)
    assert dsa.index_logits(q, k, k_scale, weights, ks, ke).shape == (0, 10)


# ------------------------------------------------------------------------------------------
# paged_index_logits


MAX_PAGES = {1: 40, 16: 6, 64: 4, 128: 3}  # a few pages per request, W from 40 to 384


def paged_case(gen, page, heads, q_dtype, b_count=4, n_rows=2, dim=128, pages=0):
    """Hostile paged inputs: lengths 0, 1, a page, a page plus one, all of W, past W, W - 1, negative; page tables
    with -1, other negatives and entries >= P both inside and past the lengths; NaN in every byte no row reads."""
    max_pages = MAX_PAGES[page]
    width = max_pages * page
    pages = max(pages, b_count * max_pages + 3)
    table = torch.randperm(pages, generator=gen)[: b_count * max_pages].reshape(b_count, max_pages).int()
    lengths = torch.tensor([0, 1, page, page + 1, width, width + 7, width - 1, -3], dtype=torch.int32)
    lengths = lengths.repeat(b_count * n_rows // 8 + 1)[: b_count * n_rows]
    # inside the length of request 2's rows (W and W + 7), and past the length of request 0's rows (0 and 1)
    if b_count > 2:
        table[2, 1], table[2, -1] = -1, pages
    else:
        table[-1, 1] = -1
    table[0, -1], table[0, 1] = INT_MAX, INT_MIN
    if b_count > 3:
        table[3, 0] = -(2**20)
    cache2d = torch.full((pages, page * (dim + SCALE_BYTES)), 0xFF, dtype=torch.uint8)
    read = []
    for r in range(b_count * n_rows):
        b = r // n_rows
        for p in range(min(max(int(lengths[r]), 0), width)):
            entry = int(table[b, p // page])
            if 0 <= entry < pages:
                read.append(entry * page + p % page)
    slots = torch.tensor(sorted(set(read)), dtype=torch.int64)
    dsa.store_index_k(make_rows(gen, len(slots), dim), cache2d, slots)
    q = torch.randn(b_count, n_rows, heads, dim, generator=gen).to(q_dtype)
    weights = torch.randn(b_count * n_rows, heads, generator=gen)
    return q, cache2d, weights, lengths, table


def check_paged(q, cache2d, weights, lengths, table, page, form="3d"):
    cache, _ = as_form(cache2d, page, q.shape[-1], form)
    got = dsa.paged_index_logits(q, cache, weights, lengths, table)
    want, magnitude = brute_paged_logits(q, cache2d, page, weights, lengths, table)
    check_logits(got, want, magnitude, index_rtol(q.shape[-1], q.shape[-2]))
    return got


@pytest.mark.parametrize("q_dtype", Q_DTYPES.values(), ids=Q_DTYPES.keys())
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_paged_index_logits(gen, page, q_dtype):
    inputs = paged_case(gen, page, 32, q_dtype)
    got = check_paged(*inputs, page)
    width = MAX_PAGES[page] * page
    assert torch.isinf(got[0]).all() and torch.isfinite(got[1, :1]).all() and torch.isinf(got[1, 1:]).all()
    assert got.shape == (8, width)


@pytest.mark.parametrize("heads", [1, 64, 128], ids=lambda h: f"Hi{h}")
def test_paged_index_logits_heads(gen, heads):
    check_paged(*paged_case(gen, 64, heads, FP8), 64, form="4d")


def test_paged_index_logits_one_row_per_request_2d_cache(gen):
    check_paged(*paged_case(gen, 16, 8, FP8, b_count=8, n_rows=1), 16, form="2d")


def test_paged_index_logits_in_chunks(gen, monkeypatch):
    # two pages of one request per chunk (16-token pages, 2 rows of 8 heads)
    monkeypatch.setattr(reference.indexer, "_INDEX_CHUNK_BYTES", 4 * 16 * (128 + 2 * 8) * 2)
    check_paged(*paged_case(gen, 16, 8, torch.bfloat16), 16)


def test_paged_index_logits_empty_pool(gen):
    q = torch.randn(2, 1, 4, 128, generator=gen).to(FP8)
    got = dsa.paged_index_logits(
        q,
        torch.zeros(0, 16, 132, dtype=torch.uint8),
        torch.ones(2, 4),
        torch.tensor([5, 16], dtype=torch.int32),
        torch.zeros(2, 3, dtype=torch.int32),
    )
    assert got.shape == (2, 48) and torch.isinf(got).all()


# ------------------------------------------------------------------------------------------
# Attention sinks and attn_max_logits (the attention ops' extras)


NUM_SLOTS = 600


def attn_case(gen, heads, d_qk=256, t_count=5, topk=128):
    idx = hostile_indices(gen, t_count, topk, NUM_SLOTS, empty_rows=[1])
    lengths = torch.tensor([topk, topk, 0, 37, topk - 1], dtype=torch.int32)[:t_count]
    kv = torch.randn(NUM_SLOTS, d_qk, generator=gen).bfloat16()
    kv[unselected_slots(idx, NUM_SLOTS, lengths)] = float("nan")
    q = torch.randn(t_count, heads, d_qk, generator=gen).bfloat16()
    return q, kv, idx, lengths


def brute_max_logits(q, kv, indices, sm_scale, topk_length):
    """float64 (max over valid entries of sm_scale * q.k [T, H], the rounding bound of each)."""
    t_count, heads, d_qk = q.shape
    best = torch.full((t_count, heads), -math.inf, dtype=torch.float64)
    bound = torch.zeros(t_count, heads, dtype=torch.float64)
    for t in range(t_count):
        ids = [int(s) for s in indices[t, : max(0, int(topk_length[t]))] if 0 <= int(s) < kv.shape[0]]
        if ids:
            rows = kv[ids].double()
            best[t] = (q[t].double() @ rows.T * sm_scale).amax(-1)
            bound[t] = 2 * d_qk * 2.0**-24 * (q[t].double().abs() @ rows.abs().T * sm_scale).amax(-1)
    return best, bound


@pytest.mark.parametrize("sink_kind", ["random", "minus-inf", "large"])
@pytest.mark.parametrize("heads", [1, 16, 64], ids=lambda h: f"H{h}")
def test_attn_sink(gen, heads, sink_kind):
    q, kv, idx, lengths = attn_case(gen, heads)
    sink = {
        "random": torch.randn(heads, generator=gen) * 3,
        "minus-inf": torch.full((heads,), -math.inf),
        "large": torch.full((heads,), 30.0),
    }[sink_kind]
    sm_scale = 256**-0.5
    out, lse = dsa.sparse_attn(q, kv, idx, sm_scale, 256, lengths, sink)
    ref_out, ref_lse = brute_attn(
        q, lambda s: kv[s].double() if 0 <= s < NUM_SLOTS else None, idx, sm_scale, 256, lengths
    )
    empty = torch.isinf(ref_lse)
    factor = torch.where(empty, 0.0, 1 / (1 + torch.exp(sink.double() - ref_lse)))  # FlashMLA's sink
    ref_out = ref_out * factor.unsqueeze(-1)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] == -math.inf).all() and out[empty].eq(0).all()
    assert torch.allclose(lse[~empty].double(), ref_lse[~empty], rtol=1e-5, atol=1e-4)  # the sink stays out of lse
    err = (out.double() - ref_out).abs()
    assert (err <= ref_out.abs() * 2**-8 + 1e-5).all(), err.max()


def test_attn_sink_of_zero_weight_is_plain_attention(gen):
    q, kv, idx, lengths = attn_case(gen, 8)
    plain = dsa.sparse_attn(q, kv, idx, 0.1, 256, lengths)
    sunk = dsa.sparse_attn(q, kv, idx, 0.1, 256, lengths, torch.full((8,), -math.inf))
    assert torch.equal(plain[0], sunk[0]) and torch.equal(plain[1], sunk[1])


@pytest.mark.parametrize("with_lengths", [True, False], ids=["lengths", "no-lengths"])
@pytest.mark.parametrize("heads", [1, 16, 128], ids=lambda h: f"H{h}")
def test_attn_max_logits(gen, heads, with_lengths):
    q, kv, idx, lengths = attn_case(gen, heads)
    if not with_lengths:
        kv = torch.nan_to_num(kv.float(), nan=0.0).bfloat16()
    topk_length = lengths if with_lengths else None
    got = dsa.attn_max_logits(q, kv, idx, 0.0625, 256, topk_length)
    full = torch.full((q.shape[0],), idx.shape[1], dtype=torch.int32)
    want, bound = brute_max_logits(q, kv, idx, 0.0625, lengths if with_lengths else full)
    assert got.dtype == torch.float32 and got.shape == want.shape and not got.isnan().any()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and (got[torch.isinf(got)] < 0).all()
    fin = torch.isfinite(want)
    assert ((got.double()[fin] - want[fin]).abs() <= bound[fin]).all()


def test_attn_max_logits_of_a_packed_pool(gen):
    k = torch.randn(128, 512, generator=gen).bfloat16()
    r = torch.randn(128, 64, generator=gen).bfloat16()
    pool = dsa.quant_k_cache(k, r).reshape(8, 16, 656)
    idx = hostile_indices(gen, 3, 64, 128, empty_rows=[2])
    q = torch.randn(3, 16, 576, generator=gen).bfloat16()
    got = dsa.attn_max_logits(q, pool, idx, 0.05, 512)
    rows = dsa.dequant_k_cache(pool.reshape(128, 656))  # the packed kv means its dequantized rows
    want, bound = brute_max_logits(q, rows, idx, 0.05, torch.full((3,), 64))
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), ~fin) and ((got.double()[fin] - want[fin]).abs() <= bound[fin]).all()


# ------------------------------------------------------------------------------------------
# The torch.library contract: opcheck, torch.compile, determinism


def _op_samples(gen):
    k = make_rows(gen, 6, 128)
    cache = torch.zeros(3, 16, 132, dtype=torch.uint8)
    dsa.store_index_k(make_rows(gen, 48, 128), cache, torch.arange(48))  # real keys: opcheck compares with allclose
    loc = torch.tensor([1, -1, 47, 48, 7, INT_MAX], dtype=torch.int32)
    q, kk, k_scale, weights = logit_inputs(gen, 8, 40, 4, 128, FP8)
    ks, ke = hostile_ranges(40)
    paged = paged_case(gen, 16, 4, FP8, b_count=2)
    q_bf16 = paged_case(gen, 16, 4, torch.bfloat16, b_count=2)
    return {
        "quant": ("quant_index", (k, False)),
        "quant-3d-round": ("quant_index", (k.reshape(2, 3, 128), True)),
        "store-3d": ("store_index_k", (k, cache.clone(), loc, False)),
        "store-2d-int64-round": ("store_index_k", (k, cache.reshape(3, -1).clone(), loc.long(), True)),
        "gather-4d": ("gather_index_k", (cache.reshape(3, 16, 1, 132), loc, None)),
        "gather-2d": ("gather_index_k", (cache.reshape(3, -1), loc.long(), 128)),
        "logits-fp8": ("index_logits", (q, kk, k_scale, weights, ks, ke)),
        "logits-bf16": ("index_logits", (q.bfloat16(), kk, k_scale, weights, ks, ke)),
        "paged-fp8": ("paged_index_logits", paged),
        "paged-bf16": ("paged_index_logits", q_bf16),
    }


SAMPLES = sorted(_op_samples(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", SAMPLES)
def test_opcheck(gen, case):
    name, args = _op_samples(gen)[case]
    fp8_input = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    # torch's schema check compares inputs with allclose, which has no float8 kernel on the CPU
    tests = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8_input else None
    torch.library.opcheck(getattr(torch.ops.dsa, name).default, args, **({"test_utils": tests} if tests else {}))


def _bits(outputs):
    """The bytes of each output (NaN scales of random cache bytes compare equal to themselves this way)."""
    return [t.contiguous().view(torch.uint8) for t in outputs]


def _run(name, args):
    fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = getattr(torch.ops.dsa, name).default(*fresh)
    return _bits(out if isinstance(out, tuple) else [fresh[1]] if out is None else [out])  # a store writes its cache


@pytest.mark.parametrize("case", SAMPLES)
def test_bit_identical_repeats(gen, case):
    name, args = _op_samples(gen)[case]
    for a, b in zip(_run(name, args), _run(name, args)):
        assert torch.equal(a, b)


def _prefill_step(k, cache, loc, q, weights, ks, ke):
    torch.ops.dsa.store_index_k(k, cache, loc)
    keys, scale = torch.ops.dsa.gather_index_k(cache, loc)
    return torch.ops.dsa.index_logits(q, keys, scale, weights, ks, ke)


def _decode_step(k, cache, loc, q, weights, lengths, table):
    torch.ops.dsa.store_index_k(k, cache, loc)
    return torch.ops.dsa.paged_index_logits(q, cache, weights, lengths, table)


def _prefill_inputs(gen, t_count):
    cache = torch.randint(0, 256, (8, 16, 132), generator=gen, dtype=torch.uint8)
    q, _, _, weights = logit_inputs(gen, t_count, 0, 4, 128, FP8)
    ks = torch.randint(-2, t_count, (t_count,), generator=gen, dtype=torch.int32)
    return dict(
        k=make_rows(gen, t_count, 128),
        cache=cache,
        loc=torch.randperm(128, generator=gen)[:t_count].int(),
        q=q,
        weights=weights,
        ks=ks,
        ke=ks + 3,
    )


def _decode_inputs(gen, b_count):
    # one cache for every batch, as a serving stack keeps it; 16 heads, so that no dim equals a batch-sized one
    # (duck sizing would tie the two and recompile)
    q, cache, weights, lengths, table = paged_case(gen, 16, 16, FP8, b_count=b_count, n_rows=2, pages=48)
    loc = torch.randint(-1, cache.shape[0] * 16, (b_count,), generator=gen, dtype=torch.int32)
    return dict(
        k=make_rows(gen, b_count, 128), cache=cache, loc=loc, q=q, weights=weights, lengths=lengths, table=table
    )


@pytest.mark.parametrize(
    "step, make, sizes",
    [(_prefill_step, _prefill_inputs, (2, 3, 5, 9)), (_decode_step, _decode_inputs, (4, 5, 7))],
    ids=["prefill", "decode"],
)
def test_compile_without_recompiles(gen, step, make, sizes):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for size in sizes:
        inputs = make(gen, size)
        a = {k: v.clone() for k, v in inputs.items()}
        b = {k: v.clone() for k, v in inputs.items()}
        got, want = compiled(**a), step(**b)
        assert torch.equal(got, want) and torch.equal(a["cache"], b["cache"])
    assert counter.frame_count == 1  # one graph for every size, no graph break


# ------------------------------------------------------------------------------------------
# GPU ops against the reference on CPU copies


@pytest.fixture(scope="module")
def warm():
    keys = []
    for heads in HEADS:
        for page in PAGE_SIZES:
            keys += dsa._cuda.indexer.warmup_keys(heads, 128, page, (False, True), ("int32", "int64"))
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def poison_allocator(nbytes=1 << 28):
    """Fill a block of the caching allocator with NaN and free it: the next outputs reuse it."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def absolute(x):
    """``|x|`` of a float8 or bf16 tensor, exactly, in its dtype."""
    return x.float().abs().to(x.dtype)


def absolute_cache(cache2d, page, dim):
    """The index-K cache with the sign bit of every FP8 value and scale cleared."""
    out = cache2d.clone()
    values, scales = reference.index_cache_slots(out, dim)
    values.bitwise_and_(0x7F)
    scales[..., SCALE_BYTES - 1].bitwise_and_(0x7F)  # the sign of a little-endian float32 is in its last byte
    return out


def check_gpu_logits(got, want, magnitude):
    """GPU logits against the reference's: -inf in the same places, then GPU_LOGIT_RTOL of the magnitude (the
    reference's logits of |q|, |k|, |k_scale| and |weights|: relu never clips those, so no sum cancels)."""
    got = got.cpu()
    assert not got.isnan().any()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs()
    assert (err <= GPU_LOGIT_RTOL * magnitude[fin]).all(), err.max()


def paged_reference(q, cache2d, weights, lengths, table, page):
    """The reference's paged logits and their magnitude."""
    want = reference.paged_index_logits(q, cache2d, weights, lengths, table)
    magnitude = reference.paged_index_logits(
        absolute(q), absolute_cache(cache2d, page, q.shape[-1]), weights.abs(), lengths, table
    )
    return want, magnitude


@pytest.mark.cuda
@pytest.mark.parametrize("round_scale", [False, True], ids=["fp32-scale", "pow2-scale"])
@pytest.mark.parametrize("rows", [1, 9, 1 << 20], ids=["1-row", "9-rows", "1M-rows"])
def test_cuda_quant_index_bytes(warm, rows, round_scale):
    x = make_rows(torch.Generator().manual_seed(rows), rows, 128)
    poison_allocator()
    values, scale = dsa.quant_index(x.cuda(), round_scale)
    want_values, want_scale = reference.quant_index(x, round_scale)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale.cpu().view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=str)
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_cuda_store_and_gather_index_k(warm, page, slot_dtype):
    g = torch.Generator().manual_seed(page)
    dim, pages = 128, max(8, 4096 // page)
    cache = torch.randint(0, 256, (pages, page, dim + SCALE_BYTES), generator=g, dtype=torch.uint8)
    loc = slot_batch(g, pages * page, 3000, slot_dtype)
    k = make_rows(g, len(loc), dim)
    gpu_cache = cache.cuda()
    dsa.store_index_k(k.cuda(), gpu_cache, loc.cuda())
    reference.store_index_k(k, cache, loc)
    assert torch.equal(gpu_cache.cpu(), cache)
    ids = torch.cat([torch.randint(0, pages * page, (500,), generator=g), junk_slots(pages * page, slot_dtype)])
    ids = ids.to(slot_dtype)
    for form in CACHE_FORMS:
        view, head_dim = as_form(cache.reshape(pages, -1), page, dim, form)
        gpu_view, _ = as_form(gpu_cache.reshape(pages, -1), page, dim, form)
        poison_allocator()
        values, scale = dsa.gather_index_k(gpu_view, ids.cuda(), head_dim)
        want_values, want_scale = reference.gather_index_k(view, ids, head_dim)
        assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scale.cpu().view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("q_dtype", Q_DTYPES.values(), ids=Q_DTYPES.keys())
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hi{h}")
def test_cuda_index_logits(warm, heads, q_dtype):
    g = torch.Generator().manual_seed(heads)
    n = 4099
    ks, ke = hostile_ranges(n)
    extra = torch.randint(-5, n, (50,), generator=g, dtype=torch.int32)
    ks, ke = torch.cat([ks, extra]), torch.cat([ke, extra + torch.randint(-3, 2000, (50,), generator=g).int()])
    q, k, k_scale, weights = logit_inputs(g, len(ks), n, heads, 128, q_dtype)
    want = reference.index_logits(q, k, k_scale, weights, ks, ke)
    magnitude = reference.index_logits(absolute(q), absolute(k), k_scale.abs(), weights.abs(), ks, ke)
    poison_allocator()
    got = dsa.index_logits(q.cuda(), k.cuda(), k_scale.cuda(), weights.cuda(), ks.cuda(), ke.cuda())
    check_gpu_logits(got, want, magnitude)


@pytest.mark.cuda
@pytest.mark.parametrize("q_dtype", Q_DTYPES.values(), ids=Q_DTYPES.keys())
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hi{h}")
@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_cuda_paged_index_logits(warm, page, heads, q_dtype):
    q, cache, weights, lengths, table = paged_case(torch.Generator().manual_seed(page + heads), page, heads, q_dtype)
    poison_allocator()
    got = dsa.paged_index_logits(q.cuda(), cache.cuda(), weights.cuda(), lengths.cuda(), table.cuda())
    check_gpu_logits(got, *paged_reference(q, cache, weights, lengths, table, page))


@pytest.mark.cuda
def test_cuda_paged_index_logits_graph_replay(warm):
    def inputs(seed):
        return paged_case(torch.Generator().manual_seed(seed), 64, 64, FP8)

    q, cache, weights, lengths, table = (x.cuda() for x in inputs(0))
    dsa.paged_index_logits(q, cache, weights, lengths, table)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dsa.paged_index_logits(q, cache, weights, lengths, table)
    for seed in (1, 2):
        new = inputs(seed)
        for dst, src in zip((q, cache, weights, lengths, table), new):
            dst.copy_(src)
        graph.replay()
        check_gpu_logits(out, *paged_reference(*new, 64))
        assert torch.equal(out, dsa.paged_index_logits(q, cache, weights, lengths, table))


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [16, 128], ids=lambda h: f"H{h}")
def test_cuda_attn_sink_and_max_logits(heads):
    q, kv, idx, lengths = attn_case(torch.Generator().manual_seed(heads), heads, t_count=5, topk=128)
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 3
    want_out, want_lse = reference.sparse_attn(q, kv, idx, 0.0625, 256, lengths, sink)
    want_max = reference.attn_max_logits(q, kv, idx, 0.0625, 256, lengths)
    poison_allocator()
    q_, kv_, idx_, lengths_, sink_ = (x.cuda() for x in (q, kv, idx, lengths, sink))
    out, lse = dsa.sparse_attn(q_, kv_, idx_, 0.0625, 256, lengths_, sink_)
    best = dsa.attn_max_logits(q_, kv_, idx_, 0.0625, 256, lengths_).cpu()
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any() and not best.isnan().any()
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and out[empty].eq(0).all()
    assert torch.equal(torch.isinf(best), torch.isinf(want_max))
    # the kernels round probabilities to bf16 before the PV product; the reference keeps float32
    assert (out.float() - want_out.float()).abs().max() <= 2**-6 * want_out.float().abs().max() + 1e-6
    assert (lse[~empty] - want_lse[~empty]).abs().max() <= 1e-3 * max(1.0, want_lse[~empty].abs().max().item())
    fin = torch.isfinite(want_max)
    assert (best[fin] - want_max[fin]).abs().max() <= 1e-3 * max(1.0, want_max[fin].abs().max().item())
