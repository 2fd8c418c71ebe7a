"""The k-pool indexer's ops (kpool_store_index_k, kpool_topk) against a transcription of GLM-5.3-Flash's public
indexer (its ``Glm5NextTextIndexer``): per request, tokens grouped into pools of ``kpool`` counted from the first
token; a complete pool's key the per-channel softmax-gated sum of its tokens' keys (softmax in float32, weights and
products in bfloat16); pools visible when their last token is; the best ``index_topk / kpool`` pools expanded to their
tokens, then the visible tokens of the incomplete pool ("always select tail").

The oracles below are written from that description in plain Python loops and torch's bfloat16 arithmetic (as the
model computes), with their own FP8 rounding, never from ``reference.py``. The CPU ops are the reference; the ``cuda``
tests hold the GPU ops to it.
"""

import functools
import math
import re
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
from csrc_tl.kpool import KpoolExpandKey, KpoolStoreKey, build_kpool_expand, build_kpool_store_index_k, lane_plan
from sparse_dsa_ops import reference
from tests.nvcc import compile_sm90a, needs_nvcc
from tests.oracle import INT_MAX, INT_MIN
from tests.test_indexer_kernels import enclosing_conditions

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4
SCALE_BYTES = 4
KPOOL = 16  # GLM-5.3-Flash's index_kpool
DIM = 128


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------------------------------
# Oracles: the public model's formulas.


def model_pool_keys(keys, gate, ape, kpool):
    """The complete pools of one request's token stream, as the model builds them: ``keys``, ``gate [n, D]`` bfloat16
    of tokens 0..n-1, ``ape [kpool, D]`` -> ``[n // kpool, D]`` bfloat16."""
    pools = keys.shape[0] // kpool
    grouped_keys = keys[: pools * kpool].reshape(pools, kpool, keys.shape[1])
    grouped_gate = gate[: pools * kpool].reshape(pools, kpool, gate.shape[1])
    probabilities = (grouped_gate.float() + ape.float()[None]).softmax(dim=1).to(torch.bfloat16)
    return (probabilities * grouped_keys).sum(dim=1)  # bfloat16 products, summed as torch sums bfloat16


def fp8_row(x):
    """One index-K row of ``x [D]``: its FP8 bytes ``[D]`` uint8 and float32 scale, ``max(amax, 1e-4) / 448``."""
    xf = x.float()
    scale = torch.tensor(max(xf.abs().max().item(), SCALE_FLOOR), dtype=torch.float32) / FP8_MAX
    values = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.view(torch.uint8), scale


def cache_row(cache2d, slot, page, dim):
    """The FP8 bytes and the scale of ``slot`` of a ``[P, page * (D + 4)]`` cache, read from the layout."""
    p, o = divmod(slot, page)
    values = cache2d[p, o * dim : (o + 1) * dim]
    scale = cache2d[p, page * dim + SCALE_BYTES * o : page * dim + SCALE_BYTES * (o + 1)].view(torch.float32)[0]
    return values, scale


def rank_key(logit, position):
    """Sort key of a candidate: logit descending (NaN below -inf, -0 equal to +0), then position ascending."""
    if math.isnan(logit):
        return (1, 0.0, position)
    return (0, -logit, position)


def model_selection(logits_row, start, seen, k, kpool, tail=True):
    """Token positions a query row selects: ``seen`` tokens visible, its pool p's logit at ``logits_row[start + p]``
    (columns outside the row are no candidates)."""
    seen = max(seen, 0)
    width = logits_row.shape[0]
    candidates = [p for p in range(seen // kpool) if 0 <= start + p < width]
    ranked = sorted(candidates, key=lambda p: rank_key(float(logits_row[start + p]), p))
    tokens = sorted(t for p in ranked[:k] for t in range(p * kpool, (p + 1) * kpool))
    if tail:
        tokens += list(range(seen - seen % kpool, seen))
    return tokens


def to_slots(tokens, table_row, page_size):
    """Positions of a request -> slots through its page-table row (-1 past the table or for a negative entry)."""
    out = []
    for t in tokens:
        page = t // page_size
        entry = int(table_row[page]) if table_row is not None and page < table_row.shape[0] else -1
        out.append(entry * page_size + t % page_size if entry >= 0 else -1)
    return out


def brute_kpool_topk(
    logits, lengths, k, kpool, starts=None, page_table=None, row_request=None, page_size=64, out_width=None, tail=True
):
    rows = logits.shape[0]
    width = out_width if out_width is not None else k * kpool + (kpool - 1 if tail else 0)
    out = torch.full((rows, width), -1, dtype=torch.int32)
    for r in range(rows):
        start = 0 if starts is None else int(starts[r])
        tokens = model_selection(logits[r], start, int(lengths[r]), k, kpool, tail)
        if page_table is not None:
            b_count = page_table.shape[0]
            b = int(row_request[r]) if row_request is not None else r // (rows // b_count)
            tokens = to_slots(tokens, page_table[b] if 0 <= b < b_count else None, page_size)
        out[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    return out


# ------------------------------------------------------------------------------------------
# Compress and store.


def pool_inputs(gen, pools, kpool, dim=DIM, gate_dtype=torch.bfloat16):
    k = (torch.randn(pools, kpool, dim, generator=gen) * 2).bfloat16()
    gate = (torch.randn(pools, kpool, dim, generator=gen) * 3).to(gate_dtype)
    ape = torch.randn(kpool, dim, generator=gen).to(gate_dtype)
    return k, gate, ape


@pytest.mark.parametrize("kpool", [1, 3, 16])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["gate-bf16", "gate-fp32"])
def test_compress_is_the_models_pool_key(gen, kpool, gate_dtype):
    # one request's token stream whose length is not a multiple of the pool: only complete pools have keys
    n = 5 * kpool + kpool // 2
    keys = (torch.randn(n, DIM, generator=gen) * 2).bfloat16()
    gate = (torch.randn(n, DIM, generator=gen) * 3).to(gate_dtype)
    ape = torch.randn(kpool, DIM, generator=gen).to(gate_dtype)
    want = model_pool_keys(keys, gate, ape, kpool)
    got = reference.kpool_compress(
        keys[: 5 * kpool].reshape(5, kpool, DIM), gate[: 5 * kpool].reshape(5, kpool, DIM), ape
    )
    assert got.dtype == torch.bfloat16 and got.shape == (5, DIM)
    assert torch.equal(got, want)
    if kpool == 1:  # a pool of one token is the token: softmax of one logit is 1
        assert torch.equal(got, keys[:5])


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("form", ["2d", "3d", "4d"])
def test_store_writes_each_pools_fp8_row(gen, page, form):
    pools = 11
    pages = max(3, -(-2 * pools // page))  # room for every pool, and unwritten slots
    k, gate, ape = pool_inputs(gen, pools, KPOOL)
    cache2d = torch.randint(0, 256, (pages, page * (DIM + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    slots = pages * page
    loc = torch.randperm(slots, generator=gen)[:pools]
    loc[::4] = -1  # pools that did not complete this step
    before = cache2d.clone()
    view = {"2d": cache2d, "3d": cache2d.view(pages, page, -1), "4d": cache2d.view(pages, page, 1, -1)}[form]
    dsa.kpool_store_index_k(k, gate, ape, view, loc.int())
    keys = model_pool_keys(k.reshape(-1, DIM), gate.reshape(-1, DIM), ape, KPOOL)  # the pools, one after another
    written = torch.zeros(pages, page, dtype=torch.bool)
    for i, slot in enumerate(loc.tolist()):
        if not 0 <= slot < slots:
            continue
        values, scale = cache_row(cache2d, slot, page, DIM)
        want_values, want_scale = fp8_row(keys[i])
        assert torch.equal(values, want_values) and scale.view(torch.int32) == want_scale.view(torch.int32)
        written[slot // page, slot % page] = True
    # no other byte changed: the unwritten slots' values and scales are the bytes they held
    values_now, scales_now = reference.index_cache_slots(cache2d, DIM)
    values_before, scales_before = reference.index_cache_slots(before, DIM)
    assert torch.equal(values_now[~written], values_before[~written])
    assert torch.equal(scales_now[~written], scales_before[~written])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_skips_hostile_slots(gen, slot_dtype):
    pages, page = 2, 16
    junk = [-1, -2, pages * page, pages * page + 1, INT_MIN, INT_MAX]
    if slot_dtype == torch.int64:
        junk += [2**40, -(2**40), pages * page + 2**32]  # the last one wraps onto slot 0 if read as int32
    k, gate, ape = pool_inputs(gen, len(junk) + 1, KPOOL)
    cache = torch.randint(0, 256, (pages, page * (DIM + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    dsa.kpool_store_index_k(k, gate, ape, cache, torch.tensor(junk + [5], dtype=slot_dtype), True)
    untouched = before.clone()
    reference.store_index_k(reference.kpool_compress(k[-1:], gate[-1:], ape), untouched, torch.tensor([5]), True)
    assert torch.equal(cache, untouched) and not torch.equal(cache, before)  # slot 5 written, no other byte


def test_store_round_scale_is_store_index_k_s(gen):
    k, gate, ape = pool_inputs(gen, 6, KPOOL)
    for round_scale in (False, True):
        a = torch.zeros(2, 4 * (DIM + SCALE_BYTES), dtype=torch.uint8)
        b = a.clone()
        dsa.kpool_store_index_k(k, gate, ape, a, torch.arange(6), round_scale)
        dsa.store_index_k(reference.kpool_compress(k, gate, ape), b, torch.arange(6), round_scale)
        assert torch.equal(a, b)


def test_store_nothing_to_do(gen):
    k, gate, ape = pool_inputs(gen, 0, KPOOL)
    cache = torch.randint(0, 256, (2, 64 * (DIM + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    before = cache.clone()
    dsa.kpool_store_index_k(k, gate, ape, cache, torch.zeros(0, dtype=torch.int32))
    assert torch.equal(cache, before)


# ------------------------------------------------------------------------------------------
# Selection with expansion.


def _decode_rows(gen):
    # lengths: 0, shorter than one pool (tail only), exactly whole pools (no tail), one past, many pools, negative
    lengths = i32([0, 5, 15, 16, 17, 48, 100, 160, -3])
    logits = torch.randn(9, 10, generator=gen)
    return dict(logits=logits, lengths=lengths, k=3, kpool=KPOOL)


def _ties_and_nan(gen):
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, -0.0, 0.0], [math.nan, -math.inf, 1.0, math.nan, -math.inf, 0.0]])
    return dict(logits=logits, lengths=i32([6 * 4, 6 * 4 + 2]), k=3, kpool=4)


def _prefill_starts(gen):
    # a ragged prefill over the batch's pools: row r's pool 0 at column starts[r]; some ranges run off the row
    logits = torch.randn(6, 40, generator=gen)
    starts = i32([0, 0, 10, 10, 35, -4])
    lengths = i32([3, 70, 41, 200, 160, 64])
    return dict(logits=logits, lengths=lengths, k=4, kpool=5, starts=starts)


def _token_slots(gen):
    # pools of 16 over pages of 24 tokens: pools straddle pages; a negative page-table entry maps to -1
    table = torch.randperm(60, generator=gen)[:20].int().reshape(2, 10)
    table[1, 3] = -1
    logits = torch.randn(4, 14, generator=gen)
    return dict(logits=logits, lengths=i32([230, 9, 100, 239]), k=5, kpool=KPOOL, page_table=table, page_size=24)


def _row_request(gen):
    table = torch.randint(-1, 40, (3, 4), generator=gen, dtype=torch.int32)
    logits = torch.randn(5, 8, generator=gen)
    return dict(
        logits=logits,
        lengths=i32([64, 30, 47, 64, 12]),
        k=2,
        kpool=8,
        page_table=table,
        row_request=i32([2, 0, -1, INT_MAX, 1]),
        page_size=16,
        out_width=64,
    )


def _no_tail(gen):
    return dict(logits=torch.randn(3, 12, generator=gen), lengths=i32([50, 7, 200]), k=2, kpool=KPOOL, tail=False)


def _glm(gen):
    # GLM-5.3-Flash's shape: 128 of the pools of an 8K context, 2063 entries padded to 2112
    logits = torch.randn(2, 512, generator=gen)
    return dict(logits=logits, lengths=i32([8191, 2047]), k=128, kpool=KPOOL, out_width=2112)


def _empty(gen):
    return dict(logits=torch.zeros(3, 0), lengths=i32([40, 0, 15]), k=2, kpool=KPOOL)


CASES = {
    "decode-lengths": _decode_rows,
    "ties-and-nan": _ties_and_nan,
    "prefill-starts": _prefill_starts,
    "token-slots-straddling-pages": _token_slots,
    "row-request": _row_request,
    "no-tail": _no_tail,
    "glm-5.3-flash": _glm,
    "no-pool-columns": _empty,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kpool_topk_is_the_models_selection(gen, case):
    args = CASES[case](gen)
    got = dsa.kpool_topk(**args)
    want = brute_kpool_topk(**args)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)


def test_expansion_order_and_tail_position():
    # pools 0 and 2 win; then the tail of the row's incomplete pool (it sees 3 * 4 + 3 tokens); then -1
    logits = torch.tensor([[5.0, 1.0, 4.0]])
    got = dsa.kpool_topk(logits, i32([15]), 2, 4, out_width=16)
    assert got.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, -1, -1, -1, -1, -1]]
    # fewer pools than k: the tail follows the last selected pool's tokens directly
    got = dsa.kpool_topk(logits, i32([6]), 2, 4)
    assert got.tolist() == [[0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("case", ["decode-lengths", "prefill-starts", "token-slots-straddling-pages", "row-request"])
def test_kpool_1_is_topk(gen, case):
    args = CASES[case](gen)
    args.pop("kpool")
    assert torch.equal(dsa.kpool_topk(**args, kpool=1), dsa.topk(**args))


def test_width_of_glm():
    assert dsa.ops.kpool_width(128, 16) == 2063 and dsa.ops.kpool_width(128, 16, tail=False) == 2048


# ------------------------------------------------------------------------------------------
# The flow of a layer: pools stored as decode completes them, scored by paged_index_logits over the pool cache,
# selected and expanded to token slots.


def test_decode_flow_against_the_model(gen):
    kpool, page, heads = 4, 8, 4
    seq_lens = [3, 21, 37]  # tail only; pools and a tail; pools straddling the token pages of 8 (kpool 4 does not)
    b_count, max_tokens = len(seq_lens), max(seq_lens)
    pool_pages = -(-(max_tokens // kpool) // page)
    pool_table = torch.randperm(b_count * pool_pages + 1, generator=gen)[: b_count * pool_pages].int()
    pool_table = pool_table.reshape(b_count, pool_pages)
    pool_cache = torch.full((b_count * pool_pages + 1, page * (DIM + SCALE_BYTES)), 0xFF, dtype=torch.uint8)
    token_pages = -(-max_tokens // page)
    token_table = torch.randperm(b_count * token_pages, generator=gen).int().reshape(b_count, token_pages)
    ape = torch.randn(kpool, DIM, generator=gen).bfloat16()
    keys = [(torch.randn(n, DIM, generator=gen) * 2).bfloat16() for n in seq_lens]
    gates = [(torch.randn(n, DIM, generator=gen) * 3).bfloat16() for n in seq_lens]

    # decode one token at a time: each step, the requests whose pool just completed store it (the others pass -1)
    for t in range(max_tokens):
        k_step = torch.zeros(b_count, kpool, DIM, dtype=torch.bfloat16)
        g_step = torch.zeros(b_count, kpool, DIM, dtype=torch.bfloat16)
        loc = [-1] * b_count
        for b, n in enumerate(seq_lens):
            if t < n and (t + 1) % kpool == 0:
                pool = (t + 1) // kpool - 1
                k_step[b], g_step[b] = keys[b][t + 1 - kpool : t + 1], gates[b][t + 1 - kpool : t + 1]
                loc[b] = int(pool_table[b, pool // page]) * page + pool % page
        dsa.kpool_store_index_k(k_step, g_step, ape, pool_cache, i32(loc))

    q = (torch.randn(b_count, 1, heads, DIM, generator=gen) * 0.5).to(FP8)
    weights = torch.randn(b_count, heads, generator=gen)
    lengths = i32(seq_lens)
    pool_counts = torch.div(lengths, kpool, rounding_mode="floor")
    logits = dsa.paged_index_logits(q, pool_cache, weights, pool_counts, pool_table)  # [B, pool_pages * page]
    got = dsa.kpool_topk(logits, lengths, 2, kpool, page_table=token_table, page_size=page, out_width=16)

    for b, n in enumerate(seq_lens):
        pool_keys = model_pool_keys(keys[b], gates[b], ape, kpool)  # [n // kpool, D]
        scored = []
        for p in range(pool_keys.shape[0]):
            values, scale = fp8_row(pool_keys[p])
            k8 = values.view(FP8).double()
            dots = (q[b, 0].double() @ k8).relu()  # [Hi]
            scored.append(float((dots * weights[b].double()).sum() * float(scale)))
        want_logits = torch.tensor(scored, dtype=torch.float64)
        assert torch.allclose(logits[b, : len(scored)].double(), want_logits, rtol=1e-5, atol=1e-6)
        assert torch.isinf(logits[b, len(scored) :]).all()
        tokens = model_selection(logits[b], 0, n, 2, kpool)
        want = to_slots(tokens, token_table[b], page) + [-1] * (16 - len(tokens))
        assert got[b].tolist() == want


# ------------------------------------------------------------------------------------------
# Bad input: the checker names the argument.


def _bad_cases():
    k = torch.zeros(2, 4, DIM, dtype=torch.bfloat16)
    cache = torch.zeros(2, 8 * (DIM + SCALE_BYTES), dtype=torch.uint8)
    loc = i32([0, 1])
    logits, lengths = torch.zeros(2, 8), i32([5, 5])
    return {
        "k-rank": (dsa.kpool_store_index_k, (k[0], k[0], k[0, 0:4], cache, loc), ValueError, "k must be 3-d"),
        "k-dtype": (dsa.kpool_store_index_k, (k.float(), k, k[0], cache, loc), TypeError, "k must be bfloat16"),
        "k-dim": (
            dsa.kpool_store_index_k,
            (k[..., :96], k[..., :96], k[0, :, :96], cache, loc),
            ValueError,
            "head dim",
        ),
        "empty-pool": (dsa.kpool_store_index_k, (k[:, :0], k[:, :0], k[0, :0], cache, loc), ValueError, "kpool >= 1"),
        "gate-shape": (dsa.kpool_store_index_k, (k, k[:, :2], k[0], cache, loc), ValueError, "gate must be"),
        "gate-dtype": (dsa.kpool_store_index_k, (k, k.half(), k[0], cache, loc), TypeError, "gate must be"),
        "ape-shape": (dsa.kpool_store_index_k, (k, k, k[0, :2], cache, loc), ValueError, "ape must be [kpool, D]"),
        "loc-length": (dsa.kpool_store_index_k, (k, k, k[0], cache, i32([0])), ValueError, "loc must be"),
        "cache-dtype": (dsa.kpool_store_index_k, (k, k, k[0], cache.int(), loc), TypeError, "cache must be uint8"),
        "kpool": (dsa.kpool_topk, (logits, lengths, 2, 0), ValueError, "kpool must be an int >= 1"),
        "out-width": (dsa.kpool_topk, (logits, lengths, 2, 4, None, None, None, 64, 10), ValueError, ">= 11"),
        "k": (dsa.kpool_topk, (logits, lengths, 0, 4), ValueError, "dsa.kpool_topk: k must be"),
        "lengths": (dsa.kpool_topk, (logits, lengths.long(), 2, 4), TypeError, "dsa.kpool_topk: lengths must be"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_input(case):
    fn, args, exc, text = _bad_cases()[case]
    with pytest.raises(exc, match=None) as info:
        fn(*args)
    assert text in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------
# The torch.library contract.


def _op_samples(gen):
    k, gate, ape = pool_inputs(gen, 5, KPOOL)
    cache = torch.zeros(3, 4, DIM + SCALE_BYTES, dtype=torch.uint8)
    dsa.store_index_k(torch.randn(12, DIM, generator=gen).bfloat16(), cache, torch.arange(12))
    loc = i32([1, -1, 11, 12, INT_MAX])
    slots = CASES["token-slots-straddling-pages"](gen)
    return {
        "store": ("kpool_store_index_k", (k, gate, ape, cache.clone(), loc, False)),
        "store-fp32-gate-int64-round": (
            "kpool_store_index_k",
            (k, gate.float(), ape.float(), cache.reshape(3, -1).clone(), loc.long(), True),
        ),
        "topk": ("kpool_topk", tuple(CASES["decode-lengths"](gen).values())),
        "topk-slots": (
            "kpool_topk",
            (slots["logits"], slots["lengths"], 5, KPOOL, None, slots["page_table"], None, 24, 128, True),
        ),
        "topk-starts-no-tail": ("kpool_topk", (*CASES["prefill-starts"](gen).values(), None, None, 64, None, False)),
    }


SAMPLES = sorted(_op_samples(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", SAMPLES)
def test_opcheck(gen, case):
    name, args = _op_samples(gen)[case]
    torch.library.opcheck(getattr(torch.ops.dsa, name).default, args)


@pytest.mark.parametrize("case", SAMPLES)
def test_fake_matches_real(gen, case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, args = _op_samples(gen)[case]
    op = getattr(torch.ops.dsa, name).default
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    if real is None:
        assert fake is None
    else:
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


def _decode_step(k, gate, ape, cache, loc, q, weights, pool_counts, pool_table, lengths, token_table):
    torch.ops.dsa.kpool_store_index_k(k, gate, ape, cache, loc)
    logits = torch.ops.dsa.paged_index_logits(q, cache, weights, pool_counts, pool_table)
    return torch.ops.dsa.kpool_topk(logits, lengths, 4, KPOOL, None, token_table, None, 64, 128)


def _decode_inputs(gen, b_count):
    k, gate, ape = pool_inputs(gen, b_count, KPOOL)
    lengths = torch.randint(0, 16 * 64 * 2, (b_count,), generator=gen, dtype=torch.int32)
    return dict(
        k=k,
        gate=gate,
        ape=ape,
        cache=torch.zeros(40, 16 * (DIM + SCALE_BYTES), dtype=torch.uint8),
        loc=torch.randint(-1, 640, (b_count,), generator=gen, dtype=torch.int32),
        q=(torch.randn(b_count, 1, 8, DIM, generator=gen) * 0.5).to(FP8),
        weights=torch.randn(b_count, 8, generator=gen),
        pool_counts=torch.div(lengths, KPOOL, rounding_mode="floor"),
        pool_table=torch.randint(0, 40, (b_count, 8), generator=gen, dtype=torch.int32),
        lengths=lengths,
        token_table=torch.randint(-1, 1000, (b_count, 32), generator=gen, dtype=torch.int32),
    )


def test_compile_without_recompiles(gen):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_decode_step, backend=counter, fullgraph=True, dynamic=True)
    for b_count in (3, 5, 9):
        inputs = _decode_inputs(gen, b_count)
        a = {k: v.clone() for k, v in inputs.items()}
        b = {k: v.clone() for k, v in inputs.items()}
        assert torch.equal(compiled(**a), _decode_step(**b)) and torch.equal(a["cache"], b["cache"])
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------------
# The store's kernel (csrc_tl/kpool.py) on the CPU: its key, its thread mapping, the one launch the backend makes, and
# what its lowered source shows.


def test_store_key_names_spell_the_specialization():
    assert str(KpoolStoreKey(16, 128, 64)) == "kpool_store_index_k_pool16_d128_p64_gbf16_abf16_i32"
    key = KpoolStoreKey(3, 64, 1, "float32", "bfloat16", True, "int64")
    assert key.name == "kpool_store_index_k_pool3_d64_p1_gfp32_abf16_pow2_i64"


@pytest.mark.parametrize(
    "kpool, dim, lanes, passes, pools_per_block, min_blocks, unrolled",
    [
        (16, 128, 32, 1, 4, 3, True),  # GLM-5.3-Flash: a warp a pool, 4 channels a lane, 12 warps an SM
        (16, 64, 16, 1, 8, 3, True),
        (3, 192, 16, 3, 8, 3, True),
        (16, 192, 16, 3, 8, 1, False),  # 192 values a lane: the token loops run through local memory
        (32, 256, 32, 2, 4, 1, False),
    ],
)
def test_store_lane_plan(kpool, dim, lanes, passes, pools_per_block, min_blocks, unrolled):
    plan = lane_plan(kpool, dim)
    assert (plan.lanes, plan.passes, plan.pools_per_block) == (lanes, passes, pools_per_block)
    assert (plan.min_blocks, plan.unrolled) == (min_blocks, unrolled)
    assert plan.lanes * plan.per_lane == dim  # the pool's lanes own every channel once


@pytest.mark.parametrize(
    "key, message",
    [
        (KpoolStoreKey(0, 128, 64), "kpool must be a positive"),
        (KpoolStoreKey(16, 96, 64), "multiple of 64"),
        (KpoolStoreKey(16, 128, 0), "page must be a positive"),
        (KpoolStoreKey(16, 128, 64, gate_dtype="float16"), "gate is bfloat16 or float32"),
        (KpoolStoreKey(16, 128, 64, ape_dtype="float16"), "ape is bfloat16 or float32"),
        (KpoolStoreKey(16, 128, 64, slot_dtype="int16"), "int32 or int64"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_store_builder_refuses_bad_keys(key, message):
    with pytest.raises(AssertionError, match=message):
        build_kpool_store_index_k(key)


def test_gpu_store_is_one_launch_keyed_by_the_call(gen, monkeypatch):
    # the GPU backend on CPU tensors with its launches recorded: one kernel a call, keyed by the pool size, head dim,
    # page, both input dtypes, round_scale and the slot dtype, writing into the caller's cache
    from sparse_dsa_ops._cuda import kpool as gpu

    launches = []
    monkeypatch.setattr(gpu, "kernel", lambda key: lambda *args: launches.append((key, args)))
    k, gate, _ = pool_inputs(gen, 5, 3, dim=64, gate_dtype=torch.float32)
    ape = torch.randn(3, 64, generator=gen).bfloat16()
    cache = torch.zeros(2, 4, 1, 64 + SCALE_BYTES, dtype=torch.uint8)
    loc = torch.tensor([0, -1, 7, 8, INT_MAX], dtype=torch.int64)
    gpu.kpool_store_index_k(
        dsa.ops.check_kpool_store_index_k(k, gate, ape, cache, loc, True), k, gate, ape, cache, loc, True
    )
    ((key, args),) = launches
    assert key == KpoolStoreKey(3, 64, 4, "float32", "bfloat16", True, "int64")
    assert [tuple(a.shape) for a in args] == [(5, 3, 64), (5, 3, 64), (3, 64), (5,), (2, 4 * (64 + SCALE_BYTES))]
    assert args[-1].data_ptr() == cache.data_ptr()
    launches.clear()
    none = k[:0], gate[:0], ape, cache, loc[:0]
    gpu.kpool_store_index_k(dsa.ops.check_kpool_store_index_k(*none), *none)
    assert not launches  # no pools: nothing to launch


@functools.cache
def lowered_body(key, target: str) -> str:
    src = dsa._cuda.lower_source(key, target)
    return src[src.index('extern "C"') :]


@pytest.mark.parametrize("target", ["cuda", "hip"], ids=["sm90a", "gfx950"])  # ("cuda" in an id marks a GPU test)
def test_store_kernel_source(target):
    src = lowered_body(KpoolStoreKey(KPOOL, DIM, 64), target)
    # one pass over the pool: every 8-byte load of k and gate comes before the first exponential
    loads = [m.start() for m in re.finditer(r"= \*\(uint2\*\)\((?:k|gate) \+ ", src)]
    assert len(loads) == 2 and max(loads) < src.index("expf(")  # (each in a loop over the 16 tokens)
    # the accurate exponential and the corrected quotients on both targets; divisions only on the fallback path
    assert "__expf(" not in src and "__builtin_fmaf(__builtin_fmaf(" in src
    divisions = [m.start() for m in re.finditer(r"ex\[[^\]]*\] / den\[", src)]
    assert len(divisions) == 1 and divisions[0] > src.index("if (tiny[0] < ")
    # the amax butterfly over a warp, then every write behind the slot check (int32 ids widened: no truncation)
    assert len(re.findall(r"shfl_xor\w*\(", src)) == 5
    writes = enclosing_conditions(src, r"\(\(fp8_e4_t\*\)scales\) \+ .*\) = |\(\(float\*\)scales\)\[.*\] = sc\[0\]")
    limit = "slot < (((int64_t)p) * (int64_t)64)"
    assert len(writes) == 2 and all("(int64_t)0 <= slot" in c and limit in c for c in writes), writes


def test_store_kernel_amax_covers_three_passes():
    # D = 192 gives a lane 3 chunks of 4 channels: the row's amax takes all 12 of its values (a tree of pairwise
    # maxima over a count that is no power of two must split 3 into 1 + 2)
    src = lowered_body(KpoolStoreKey(3, 192, 16), "cuda")
    (amax,) = [line for line in src.splitlines() if "sc[0] = max(" in line and "fabsf" in line]
    assert sorted(int(i) for i in re.findall(r"fabsf\(pooled\[(\d+)\]\)", amax)) == list(range(12))


@pytest.mark.lowering
@needs_nvcc
@pytest.mark.parametrize(
    "key", [KpoolStoreKey(KPOOL, DIM, 64), KpoolStoreKey(KPOOL, DIM, 64, "float32", "float32", True, "int64")], ids=str
)
def test_store_kernel_builds_for_sm90a(key):
    import tilelang

    program = dsa._cuda.program(key)
    built = tilelang.compile(program, target=dsa._cuda.TARGETS["cuda"], pass_configs=dsa._cuda.pass_configs(key))
    # 12 warps an SM: the launch asks ptxas to keep a thread within 168 registers
    assert "__launch_bounds__(128, 3)" in built.get_kernel_source()


# ------------------------------------------------------------------------------------------
# The expansion's kernel (csrc_tl/kpool.py) on the CPU: its key, the launches of kpool_topk's backend (the top-k
# family's selection, then this one kernel), and what its lowered source shows.


def expand_key_of(args: dict) -> KpoolExpandKey:
    """The expansion kernel a ``kpool_topk`` call of keyword ``args`` runs."""
    from sparse_dsa_ops._cuda import kpool as gpu

    paged = args.get("page_table") is not None
    page = args.get("page_size", 64) if paged else 0
    return gpu.expand_key(args["kpool"], args.get("tail", True), page, args.get("row_request") is not None)


def test_expand_key_names_spell_the_specialization():
    from sparse_dsa_ops._cuda import kpool as gpu

    assert str(KpoolExpandKey(16)) == "kpool_expand_pool16_tail_positions"
    assert KpoolExpandKey(5, False, 24, True).name == "kpool_expand_pool5_page24_rowreq"
    # a pool of one token leaves no incomplete pool: kpool 1 takes the kernel without the tail, tail or not
    assert gpu.expand_key(1, True) == gpu.expand_key(1, False) == KpoolExpandKey(1, False)
    assert gpu.expand_key(16, True, 64, True) == KpoolExpandKey(16, True, 64, True)


@pytest.mark.parametrize(
    "key, message",
    [
        (KpoolExpandKey(0), "kpool must be a positive"),
        (KpoolExpandKey(16, page_size=-1), "page_size is 0"),
        (KpoolExpandKey(16, has_row_request=True), "needs a page table"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_expand_builder_refuses_bad_keys(key, message):
    with pytest.raises(AssertionError, match=message):
        build_kpool_expand(key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_topk_is_the_selection_then_one_expansion(gen, monkeypatch, case):
    # the GPU backend on CPU tensors with its launches recorded: the top-k family's selection over each row's
    # complete pools, then one expansion kernel that reads the selection's pools and the row lengths and writes the
    # whole output it returns
    from sparse_dsa_ops._cuda import kpool as gpu

    selections, launches = [], []

    def select(logits, pool_lengths, k, starts):
        selections.append((pool_lengths, starts))
        return reference.topk(logits, pool_lengths, k, starts)

    monkeypatch.setattr(gpu, "select_pools", select)
    monkeypatch.setattr(gpu, "kernel", lambda key: lambda *args: launches.append((key, args)))
    args = CASES[case](gen)
    got = gpu.kpool_topk(dsa.ops.check_kpool_topk(**args), **args)
    rows, kpool, lengths = args["logits"].shape[0], args["kpool"], args["lengths"]

    ((pool_lengths, starts),) = selections
    # the floor of a negative length is a negative pool count: no candidates, as 0 gives (and no clamp to launch)
    assert torch.equal(pool_lengths, torch.div(lengths, kpool, rounding_mode="floor"))
    assert torch.equal(
        reference.topk(args["logits"], pool_lengths, args["k"], starts),
        reference.topk(args["logits"], pool_lengths.clamp_min(0), args["k"], starts),
    )
    assert starts is args.get("starts")

    ((key, launched),) = launches
    assert key == expand_key_of(args)
    paging = [t for t in (args.get("page_table"), args.get("row_request")) if t is not None]
    assert len(launched) == 3 + len(paging)
    pools, row_lengths, *mapping, out = launched
    assert pools.shape == (rows, args["k"]) and torch.equal(row_lengths, lengths)
    assert all(torch.equal(a, b) for a, b in zip(mapping, paging))
    width = args.get("out_width") or dsa.ops.kpool_width(args["k"], kpool, args.get("tail", True))
    assert out is got and out.shape == (rows, width) and out.dtype == torch.int32 and out.is_contiguous()


def test_gpu_topk_of_kpool_1_selects_over_the_lengths_themselves(gen, monkeypatch):
    from sparse_dsa_ops._cuda import kpool as gpu

    selected = []
    monkeypatch.setattr(gpu, "select_pools", lambda logits, pool_lengths, k, starts: selected.append(pool_lengths))
    monkeypatch.setattr(gpu, "kernel", lambda key: lambda *args: None)
    args = dict(logits=torch.randn(3, 8, generator=gen), lengths=i32([-5, 3, 9]), k=2, kpool=1)
    gpu.kpool_topk(dsa.ops.check_kpool_topk(**args), **args)
    assert selected == [args["lengths"]] and selected[0] is args["lengths"]  # no division to launch


def test_gpu_topk_of_no_rows_launches_nothing(monkeypatch):
    from sparse_dsa_ops._cuda import kpool as gpu

    launches = []
    monkeypatch.setattr(gpu, "select_pools", lambda *args: launches.append("select"))
    monkeypatch.setattr(gpu, "kernel", lambda key: lambda *args: launches.append(key))
    args = dict(logits=torch.zeros(0, 8), lengths=i32([]), k=2, kpool=KPOOL, out_width=64)
    got = gpu.kpool_topk(dsa.ops.check_kpool_topk(**args), **args)
    assert got.shape == (0, 64) and not launches


@pytest.mark.parametrize("target", ["cuda", "hip"], ids=["sm90a", "gfx950"])  # ("cuda" in an id marks a GPU test)
@pytest.mark.parametrize("key", [KpoolExpandKey(KPOOL, True, 64, True), KpoolExpandKey(5)], ids=str)
def test_expand_kernel_source(key, target):
    src = lowered_body(key, target)
    # the row's pool count found in one step: one barrier, no loop but the one over the pools and the unrolled one
    # over a thread's columns
    assert src.count("__syncthreads()") == 1
    assert len(re.findall(r"\bfor \(", src)) == 2 and "for (int i = 0; i < ((k + 127) >> 7); ++i)" in src
    # the one global write: a column of the row inside the output's width, as int32
    writes = enclosing_conditions(src, r"\bout\[.*\] = ")
    assert len(writes) == 1 and "< width)" in writes[0], writes
    assert re.search(r"\bout\[.*\] = \(\(int\)token\);", src)
    if not key.page_size:
        assert "page_table" not in src
        return
    # the table read only for a request inside [0, B) and a page inside the row of the table; slots in int64
    reads = enclosing_conditions(src, r"= page_table\[")
    assert reads and all("request < requests" in c and "< ((int64_t)max_pages)" in c for c in reads), reads
    assert "(((int64_t)entry) * (int64_t)64)" in src


@pytest.mark.lowering
@needs_nvcc
@pytest.mark.parametrize("key", [KpoolExpandKey(KPOOL), KpoolExpandKey(KPOOL, True, 64, True)], ids=str)
def test_expand_kernel_compiles_for_sm90a(key, tmp_path):
    log = compile_sm90a(dsa._cuda.lower_source(key, "cuda"), tmp_path)
    assert (tmp_path / "k.cubin").stat().st_size > 1000, log
    assert " 0 bytes spill stores" in log and "used 1 barriers" in log, log


# ------------------------------------------------------------------------------------------
# GPU ops against the reference on CPU copies.


@pytest.fixture(scope="module")
def warm():
    keys = dsa._cuda.kpool.warmup_keys(
        k=None, dim=DIM, page=16, round_scale=(False, True), slot_dtypes=("int32", "int64")
    )
    for k in (2, 3, 4, 5, 128, *EXPAND_KS):
        keys += dsa._cuda.kpool.warmup_keys(k, DIM, 16)
    # the expansions the cases run (pools of 4, 5, 8 and 16 tokens, positions and slots, with and without the tail)
    seeded = torch.Generator().manual_seed(0)
    keys += [expand_key_of(CASES[case](seeded)) for case in CASES]
    keys += [expand_key_of(expand_args(seeded, geo, EXPAND_KS[0])) for geo in EXPAND_GEOMETRIES]
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def dequantized_rows(cache2d, page):
    values, scales = reference.index_cache_slots(cache2d, DIM)
    return values.view(FP8).float() * scales.view(torch.float32)  # [P, page, D]


@pytest.mark.cuda
@pytest.mark.parametrize("pools", [1, 37, 4096])
def test_cuda_store_matches_reference(warm, pools):
    gen = torch.Generator().manual_seed(pools)
    k, gate, ape = pool_inputs(gen, pools, KPOOL)
    pages = -(-2 * pools // 16)
    cache = torch.randint(0, 256, (pages, 16 * (DIM + SCALE_BYTES)), generator=gen, dtype=torch.uint8)
    loc = torch.randperm(pages * 16, generator=gen)[:pools].int()
    loc[::5] = -1
    want = cache.clone()
    reference.kpool_store_index_k(k, gate, ape, want, loc)
    got = cache.cuda()
    dsa.kpool_store_index_k(k.cuda(), gate.cuda(), ape.cuda(), got, loc.cuda())
    got = got.cpu()
    # the softmax on the GPU may round a weight's last float32 bit otherwise, which can move a bfloat16 product and
    # then one FP8 code by one step: the bytes agree almost everywhere, the values within one FP8 step
    differ = got != want
    assert differ.float().mean() <= 1e-3
    a, b = dequantized_rows(got, 16), dequantized_rows(want, 16)
    written = b.isfinite()  # (the random bytes of rows nothing writes may decode to NaN or inf)
    assert ((a - b).abs()[written] <= 2.0**-3 * b.abs()[written] + 2.0**-9 * b.abs()[written].amax()).all()


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_kpool_topk_matches_reference(warm, case):
    args = CASES[case](torch.Generator().manual_seed(1))
    got = dsa.kpool_topk(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert torch.equal(got.cpu(), reference.kpool_topk(**args))


@pytest.mark.cuda
def test_cuda_kpool_topk_glm_long_rows(warm):
    # 128 of the 8192 pools of a 128K context for 1 and 64 rows (the split and the one-CTA top-k)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 64):
        logits = torch.randn(rows, 8192, generator=gen)
        lengths = torch.randint(0, 8192 * KPOOL + KPOOL, (rows,), generator=gen, dtype=torch.int32)
        got = dsa.kpool_topk(logits.cuda(), lengths.cuda(), 128, KPOOL, out_width=2112)
        assert torch.equal(got.cpu(), reference.kpool_topk(logits, lengths, 128, KPOOL, out_width=2112))


@pytest.mark.cuda
def test_cuda_graph_replay_on_new_data(warm):
    gen = torch.Generator().manual_seed(3)
    inputs = {k: v.cuda() for k, v in _decode_inputs(gen, 4).items()}
    inputs["cache"] = torch.zeros(40, 16 * (DIM + SCALE_BYTES), dtype=torch.uint8, device="cuda")
    _decode_step(**inputs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(**inputs)
    fresh = {k: v.cuda() for k, v in _decode_inputs(gen, 4).items()}
    for name, value in fresh.items():
        inputs[name].copy_(value)
    graph.replay()
    want_cache = fresh["cache"].clone()
    want = _decode_step(**{**fresh, "cache": want_cache})  # the same inputs, eagerly
    assert torch.equal(out, want) and torch.equal(inputs["cache"], want_cache)


# ------------------------------------------------------------------------------------------
# The expansion on the GPU, exact against the reference for every kind of key: hostile lengths (negative, 0, below
# one pool, whole pools, huge), rows with fewer complete pools than k, page tables with negative and huge entries and
# too few pages, requests outside the table, outputs wider than needed, outputs poisoned before the call.


@dataclass(frozen=True)
class ExpandGeometry:
    kpool: int
    tail: bool
    mapping: str  # "positions", "slots" (request r // (R / B)) or "row-request"

    @property
    def page_size(self) -> int:
        return {"positions": 0, "slots": 24, "row-request": 64}[self.mapping]  # (24: pools of 16 straddle pages)

    def __str__(self) -> str:
        return f"pool{self.kpool}-{'tail' if self.tail else 'no-tail'}-{self.mapping}"


EXPAND_GEOMETRIES = [
    ExpandGeometry(kpool, tail, mapping)
    for kpool in (1, 4, KPOOL)
    for tail in (True, False)
    for mapping in ("positions", "slots", "row-request")
]
EXPAND_ROWS, EXPAND_COLUMNS = 48, 300
EXPAND_KS = (3, 130)  # a CTA counts the pools of a row in one step, and in two (it has 128 threads)
EXTRA_WIDTH = 37  # output columns past the widest row
POISON = -7  # no entry the op writes (positions, slots, -1) is below -1


def expand_args(gen, geo: ExpandGeometry, k: int) -> dict:
    """Keyword arguments of ``kpool_topk``: logits with ties, hostile lengths, the page table and requests of
    ``geo``, an output EXTRA_WIDTH wider than needed."""
    kp = geo.kpool
    logits = torch.randn(EXPAND_ROWS, EXPAND_COLUMNS, generator=gen)
    logits[:, ::5] = logits[:, :1]  # ties: the lower position wins
    lengths = torch.randint(0, (EXPAND_COLUMNS + 2) * kp, (EXPAND_ROWS,), generator=gen, dtype=torch.int32)
    hostile = [INT_MIN, -kp - 1, -1, 0, 1, kp - 1, kp, kp + 1, 2 * kp - 1, k * kp, k * kp + kp - 1, INT_MAX]
    lengths[: len(hostile)] = i32(hostile)
    width = dsa.ops.kpool_width(k, kp, geo.tail) + EXTRA_WIDTH
    args = dict(logits=logits, lengths=lengths, k=k, kpool=kp, out_width=width, tail=geo.tail)
    if geo.page_size:
        b_count = 4 if geo.mapping == "slots" else 3
        pages = (EXPAND_COLUMNS + 1) * kp // geo.page_size * 2 // 3  # the last pages of a long row are missing
        table = torch.randint(-3, 1 << 20, (b_count, pages), generator=gen, dtype=torch.int32)
        table[0, :3] = INT_MAX  # slots past int32 wrap as the reference's int64 -> int32 conversion wraps them
        args.update(page_table=table, page_size=geo.page_size)
        if geo.mapping == "row-request":
            request = torch.randint(-1, b_count + 1, (EXPAND_ROWS,), generator=gen, dtype=torch.int32)
            request[:2] = i32([INT_MIN, INT_MAX])
            args["row_request"] = request
    return args


def cuda_args(args: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.cuda
@pytest.mark.parametrize("k", EXPAND_KS)
@pytest.mark.parametrize("geo", EXPAND_GEOMETRIES, ids=str)
def test_cuda_kpool_topk_expansion_is_exact(warm, geo, k):
    args = expand_args(torch.Generator().manual_seed(11), geo, k)
    got = dsa.kpool_topk(**cuda_args(args))
    assert torch.equal(got.cpu(), reference.kpool_topk(**args))


@pytest.mark.cuda
@pytest.mark.parametrize("geo", EXPAND_GEOMETRIES, ids=str)
def test_cuda_expand_kernel_writes_its_rows_whole_and_nothing_else(warm, geo):
    # the kernel alone, into the rows 1..R of a poisoned buffer: every entry of those rows written, exactly as the
    # reference expands the same pools; the rows around them untouched
    args = expand_args(torch.Generator().manual_seed(12), geo, EXPAND_KS[-1])
    kp, width = geo.kpool, args["out_width"]
    pool_lengths = torch.div(args["lengths"].clamp_min(0), kp, rounding_mode="floor")
    pools = reference.topk(args["logits"], pool_lengths, args["k"])
    buffer = torch.full((EXPAND_ROWS + 2, width), POISON, dtype=torch.int32, device="cuda")
    paging = [args[name].cuda() for name in ("page_table", "row_request") if name in args]
    dsa._cuda.kernel(expand_key_of(args))(pools.cuda(), args["lengths"].cuda(), *paging, buffer[1:-1])
    want = reference.kpool_expand(
        pools, args["lengths"], kp, width, geo.tail, args.get("page_table"), args.get("row_request"), geo.page_size
    )
    got = buffer.cpu()
    assert torch.equal(got[1:-1], want)
    assert (got[0] == POISON).all() and (got[-1] == POISON).all()


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_cuda_kpool_topk_graph_replay(warm, rows):
    # GLM-5.3-Flash's selection to slots (the top-k split over CTAs at 1 row, a CTA a row at 64) captured once and
    # replayed over new logits, lengths, page table and requests
    gen = torch.Generator().manual_seed(13)
    pools, page = 8192, 64

    def inputs():
        logits = torch.randn(rows, pools, generator=gen)
        lengths = torch.randint(-KPOOL, pools * KPOOL + KPOOL, (rows,), generator=gen, dtype=torch.int32)
        table = torch.randint(-1, 1 << 20, (3, pools * KPOOL // page), generator=gen, dtype=torch.int32)
        request = torch.randint(-1, 4, (rows,), generator=gen, dtype=torch.int32)
        return [logits, lengths, table, request]

    def select(logits, lengths, table, request):
        return dsa.kpool_topk(logits, lengths, 128, KPOOL, None, table, request, page, 2112)

    static = [t.cuda() for t in inputs()]
    select(*static)  # (outside the capture: the kernels are built)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select(*static)
    for _ in range(2):
        fresh = inputs()
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(out.cpu(), select(*fresh))


# ------------------------------------------------------------------------------------------
# The store's kernel on the GPU against the reference, over geometries of every thread mapping. Exact where the
# weights are exact in float32 (equal logits, or logits so far below the others that their weights vanish in the
# sum or underflow to 0); within the rounding a weight's last bit can move elsewhere, since the GPU's expf and the
# CPU's exponential may differ by an ulp. The slots are hostile and the cache is random bytes (NaN codes and scales
# included) before the call: every byte of an unwritten slot must come back as it was.


@dataclass(frozen=True)
class StoreGeometry:
    kpool: int
    dim: int
    page: int

    def __str__(self) -> str:
        return f"pool{self.kpool}-d{self.dim}-p{self.page}"


STORE_GEOMETRIES = [
    StoreGeometry(KPOOL, DIM, 64),  # GLM-5.3-Flash: a warp a pool
    StoreGeometry(3, 64, 1),  # half a warp a pool, pages of one slot
    StoreGeometry(1, 256, 2),  # two passes a lane; a pool of one token is the token
    StoreGeometry(KPOOL, 192, 16),  # three passes a lane; the token loops run through local memory
    StoreGeometry(32, DIM, 16),  # unrolled, the block count left to ptxas
]
# (gate dtype, ape dtype, round_scale, slot dtype)
STORE_VARIANTS = [
    (torch.bfloat16, torch.bfloat16, False, torch.int32),
    (torch.float32, torch.float32, True, torch.int64),
    (torch.float32, torch.bfloat16, False, torch.int64),
    (torch.bfloat16, torch.float32, True, torch.int32),
]
STORE_POOLS = 600  # blocks of 4 and 8 pools with a partial last one


def variant_id(v) -> str:
    gate, ape, round_scale, slot = v
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}
    return f"g{name[gate]}-a{name[ape]}{'-pow2' if round_scale else ''}-{str(slot).removeprefix('torch.')}"


def store_key_of(geo: StoreGeometry, variant) -> KpoolStoreKey:
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}
    gate, ape, round_scale, slot = variant
    return KpoolStoreKey(geo.kpool, geo.dim, geo.page, name[gate], name[ape], round_scale, name[slot])


@pytest.fixture(scope="module")
def warm_store():
    keys = [store_key_of(geo, v) for geo in STORE_GEOMETRIES for v in STORE_VARIANTS]
    dsa._cuda.warmup(keys, workers=16, progress=False)


def hostile_loc(gen, pools: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[pools]`` distinct valid slots, every 5th replaced by a sentinel: -1, the dtype's extremes, past the end,
    negatives; for int64 also ids that wrap onto valid slots if read as int32."""
    loc = torch.randperm(slots, generator=gen)[:pools].to(torch.int64)
    junk = [-1, INT_MIN, INT_MAX, slots, slots + 5, -slots]
    if dtype == torch.int64:
        junk += [2**40, -(2**40), 2**32 + 3, -(2**63), 2**63 - 1]
    loc[::5] = torch.tensor(junk)[torch.arange(len(loc[::5])) % len(junk)]
    return loc.to(dtype)


def random_cache(gen, geo: StoreGeometry, pools: int) -> torch.Tensor:
    pages = -(-3 * pools // (2 * geo.page)) + 1  # unwritten slots besides the written ones
    return torch.randint(0, 256, (pages, geo.page * (geo.dim + SCALE_BYTES)), generator=gen, dtype=torch.uint8)


def exact_inputs(gen, geo: StoreGeometry, variant, case: str):
    """Pools whose weights are exact: per pool and channel a set of "on" tokens (all of them, or a power-of-two
    subset) share one logit; the others sit 60 below (weights near 1e-27 / m: their products vanish in the sum, k
    taken positive so that no sum cancels down to them) or 16384 below (weights 0: the kernel's division path).
    Keys are multiples of 1/8 up to 8, so that every sum of their products is exact in float32 in any order (the CPU
    reference sums 32 or more terms in another order than the kernel's)."""
    gate_dtype, ape_dtype = variant[0], variant[1]
    sign = torch.randint(0, 2, (STORE_POOLS, geo.kpool, geo.dim), generator=gen) * 2 - 1
    k = (torch.randint(1, 65, (STORE_POOLS, geo.kpool, geo.dim), generator=gen) * sign / 8).bfloat16()
    level = torch.randint(-4, 5, (STORE_POOLS, 1, geo.dim), generator=gen).float()
    bias = torch.randn(1, geo.dim, generator=gen).expand(geo.kpool, geo.dim)  # the same for every position
    if case == "uniform":
        gate = level.expand(-1, geo.kpool, -1)
    else:
        sizes = [m for m in (1, 2, 4, 8, 16, 32) if m <= geo.kpool]
        m = torch.tensor(sizes)[torch.randint(0, len(sizes), (STORE_POOLS, 1, geo.dim), generator=gen)]
        rank = torch.rand(STORE_POOLS, geo.kpool, geo.dim, generator=gen).argsort(dim=1)
        below = 60.0 if case == "subsets" else 16384.0
        gate = level - below * (rank >= m)
        if case == "subsets":
            k = k.abs()
    return k, gate.to(gate_dtype).contiguous(), bias.to(ape_dtype).contiguous()


def run_store(k, gate, ape, cache, loc, round_scale):
    """The op on the GPU on copies of CPU tensors -> the cache it wrote, on the CPU."""
    got = cache.cuda()
    dsa.kpool_store_index_k(k.cuda(), gate.cuda(), ape.cuda(), got, loc.cuda(), round_scale)
    return got.cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["uniform", "subsets", "subsets-underflow"])
@pytest.mark.parametrize("variant", STORE_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("geo", STORE_GEOMETRIES, ids=str)
def test_cuda_store_kernel_is_exact_where_the_weights_are(warm_store, geo, variant, case):
    gen = torch.Generator().manual_seed(7)
    k, gate, ape = exact_inputs(gen, geo, variant, case)
    cache = random_cache(gen, geo, STORE_POOLS)
    loc = hostile_loc(gen, STORE_POOLS, cache.shape[0] * geo.page, variant[3])
    want = cache.clone()
    reference.kpool_store_index_k(k, gate, ape, want, loc, variant[2])
    assert not torch.equal(want, cache)
    assert torch.equal(run_store(k, gate, ape, cache, loc, variant[2]), want)


def slot_bytes(cache: torch.Tensor, geo: StoreGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [P, page, D] uint8, scales [P, page] float32)`` views of a cache."""
    values, scales = reference.index_cache_slots(cache, geo.dim)
    return values, scales.view(torch.float32)[..., 0]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", STORE_VARIANTS, ids=variant_id)
@pytest.mark.parametrize("geo", STORE_GEOMETRIES, ids=str)
def test_cuda_store_kernel_random_pools(warm_store, geo, variant):
    gen = torch.Generator().manual_seed(8)
    k, gate, ape = pool_inputs(gen, STORE_POOLS, geo.kpool, geo.dim)
    gate, ape = gate.to(variant[0]), ape.to(variant[1])
    cache = random_cache(gen, geo, STORE_POOLS)
    loc = hostile_loc(gen, STORE_POOLS, cache.shape[0] * geo.page, variant[3])
    want = cache.clone()
    reference.kpool_store_index_k(k, gate, ape, want, loc, variant[2])
    got = run_store(k, gate, ape, cache, loc, variant[2])

    valid = (loc >= 0) & (loc < cache.shape[0] * geo.page)
    slot = loc[valid].long()
    page, offset = slot // geo.page, slot % geo.page
    written = torch.zeros(cache.shape[0], geo.page, dtype=torch.bool)
    written[page, offset] = True
    got_values, got_scales = slot_bytes(got, geo)
    want_values, want_scales = slot_bytes(want, geo)
    # no other byte changed
    assert torch.equal(got_values[~written], want_values[~written])
    assert torch.equal(got_scales[~written].view(torch.int32), want_scales[~written].view(torch.int32))

    # A weight whose float32 quotient differs by an ulp may round to the other bfloat16 neighbour (2^-7 relative), and
    # its product then to the other neighbour too: a product moves by at most 2^-6 of w_i |k_i|, the pooled value by
    # 2^-6 of M = sum_i w_i |k_i| plus one bfloat16 step of its own (2^-7). The scale follows the amax (or moves by a
    # factor 2 where round_scale crosses a power of two); each FP8 code lies within half a step of its value (2^-4
    # relative, 2^-10 of the scale below the normal range). The bounds below hold those with some room; a wrong
    # token, channel, weight or slot is off by the order of the values themselves.
    weights = (gate.float() + ape.float()).softmax(dim=1)[valid]  # [V, kpool, D]
    spread = (weights * k[valid].float().abs()).sum(dim=1)  # [V, D], M
    a_scale, b_scale = got_scales[page, offset], want_scales[page, offset]  # [V]
    if variant[2]:
        assert ((a_scale == b_scale) | (a_scale == 2 * b_scale) | (2 * a_scale == b_scale)).all()
    else:
        assert ((a_scale - b_scale).abs() <= 2**-7 * b_scale + 2**-5 * spread.amax(dim=1) / 448).all()
    assert (a_scale != b_scale).float().mean() <= 0.01
    a_codes, b_codes = got_values[page, offset], want_values[page, offset]  # [V, D]
    assert (a_codes != b_codes).float().mean() <= 0.01
    a = a_codes.view(FP8).float() * a_scale[:, None]
    b = b_codes.view(FP8).float() * b_scale[:, None]
    bound = 0.15 * b.abs() + 2**-5 * spread + 2**-8 * torch.maximum(a_scale, b_scale)[:, None]
    assert ((a - b).abs() <= bound).all()


@pytest.mark.cuda
def test_cuda_store_kernel_nothing_to_store(warm_store):
    geo = STORE_GEOMETRIES[0]
    gen = torch.Generator().manual_seed(9)
    cache = random_cache(gen, geo, 64).cuda()
    before = cache.clone()
    k, gate, ape = (t.cuda() for t in pool_inputs(gen, 0, geo.kpool, geo.dim))
    dsa.kpool_store_index_k(k, gate, ape, cache, torch.zeros(0, dtype=torch.int32, device="cuda"))
    k, gate, ape = (t.cuda() for t in pool_inputs(gen, 40, geo.kpool, geo.dim))
    nowhere = torch.tensor([-1, INT_MIN, INT_MAX, cache.shape[0] * geo.page] * 10, dtype=torch.int32, device="cuda")
    dsa.kpool_store_index_k(k, gate, ape, cache, nowhere)
    assert torch.equal(cache, before)


@pytest.mark.cuda
def test_cuda_store_kernel_graph_replay(warm_store):
    # a decode step's store captured once and replayed over new pools and slots (most of them -1)
    geo = STORE_GEOMETRIES[0]
    gen = torch.Generator().manual_seed(10)
    cache = random_cache(gen, geo, 256)

    def inputs():
        k, gate, ape = pool_inputs(gen, 96, geo.kpool, geo.dim)
        loc = torch.randperm(cache.shape[0] * geo.page, generator=gen)[:96].int()
        loc[torch.rand(96, generator=gen) < 0.8] = -1
        return [t.cuda() for t in (k, gate, ape, loc)]

    static = inputs()
    got = cache.cuda()
    dsa.kpool_store_index_k(*static[:3], got, static[3])  # (outside the capture: the kernel is already built)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsa.kpool_store_index_k(*static[:3], got, static[3])
    for _ in range(2):
        fresh = inputs()
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        want = got.clone()
        dsa.kpool_store_index_k(*fresh[:3], want, fresh[3])  # the same step, eagerly
        graph.replay()
        assert torch.equal(got, want)


def test_warmup_compiles_the_pool_store_of_each_dtype_pair(monkeypatch):
    # warmup(kpool=...) names the store kernels of the (gate, ape) dtypes the caller will pass, and the pool
    # selection's kernels of topk_k // kpool pools
    from sparse_dsa_ops import _cuda

    compiled = []
    monkeypatch.setattr(_cuda.attention, "warmup_keys_of", lambda spec: [])  # (attention's plan needs a GPU)
    monkeypatch.setattr(_cuda, "warmup", lambda keys, **kwargs: compiled.extend(keys))
    pairs = (("float32", "bfloat16"), ("bfloat16", "bfloat16"))
    dsa.warmup(heads=8, d_nope=512, d_rope=0, sm_scale=0.1, cache_ops=False, topk_k=2048, kpool=16, kpool_dtypes=pairs)
    stores = {(k.gate_dtype, k.ape_dtype) for k in compiled if type(k).__name__ == "KpoolStoreKey"}
    assert stores == set(pairs)
    assert any(getattr(k, "k", None) == 2048 // 16 for k in compiled)
