"""Exact top-k selection against a brute-force Python definition, with hostile rows.

The oracle sorts each row's candidates with Python's ``sorted`` on (NaN last, logit descending, position ascending),
so that a mistake in the integer keys of ``reference.topk`` does not hide itself. The ``cuda`` tests hold the GPU
op to the reference bit for bit.
"""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
from sparse_dsa_ops import reference
from tests.oracle import INT_MAX, INT_MIN

NAN, INF = float("nan"), float("inf")


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------------------------------
# The oracle


def brute_slot(position, r, num_rows, page_table, row_request, page_size):
    """The pool slot of ``position`` in row ``r``, or -1, by the definition."""
    b_count, max_pages = page_table.shape
    b = int(row_request[r]) if row_request is not None else r // (num_rows // b_count)
    if not 0 <= b < b_count or position // page_size >= max_pages:
        return -1
    entry = int(page_table[b, position // page_size])
    return -1 if entry < 0 else entry * page_size + position % page_size


def brute_topk(logits, lengths, k, starts=None, page_table=None, row_request=None, page_size=64, out_width=None):
    """``[R, out_width or k]`` int32, one row at a time with Python's sorted."""
    num_rows, width = logits.shape
    out = torch.full((num_rows, k if out_width is None else out_width), -1, dtype=torch.int32)
    for r in range(num_rows):
        start = 0 if starts is None else int(starts[r])
        row = logits[r].tolist()
        candidates = [(c - start, row[c]) for c in range(max(start, 0), min(start + int(lengths[r]), width))]
        # -0.0 and 0.0 compare equal here, so they tie on position like any equal logits
        candidates.sort(key=lambda pv: (math.isnan(pv[1]), 0.0 if math.isnan(pv[1]) else -pv[1], pv[0]))
        chosen = sorted(p for p, _ in candidates[:k])
        if page_table is not None:
            chosen = [brute_slot(p, r, num_rows, page_table, row_request, page_size) for p in chosen]
        out[r, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


# ------------------------------------------------------------------------------------------
# Cases: each builds the keyword arguments of one topk call


def _all_equal(gen):
    return dict(logits=torch.ones(5, 300), lengths=i32([300, 100, 5, 0, 300]), k=64, starts=i32([0, 50, 298, 0, -7]))


def _ties_at_the_cut(gen):
    logits = torch.randint(0, 4, (6, 500), generator=gen).float()  # hundreds of equal logits at every rank
    return dict(logits=logits, lengths=i32([500, 499, 300, 101, 100, 99]), k=100)


def _signed_zeros(gen):
    logits = torch.zeros(3, 200)
    logits[:, 1::2] = -0.0
    logits[1, :50] = -1.0
    logits[2, 150:] = 2.0**-149  # the smallest subnormal ranks above both zeros
    return dict(logits=logits, lengths=i32([200, 200, 200]), k=75)


def _minus_inf_and_nan(gen):
    w = 400
    logits = torch.full((6, w), -INF)
    perm = [torch.randperm(w, generator=gen) for _ in range(6)]
    logits[0, perm[0][:10]] = torch.randn(10, generator=gen)  # 10 finite, 30 -inf chosen, NaN never
    logits[0, perm[0][10:60]] = NAN
    logits[1, perm[1][:100]] = NAN  # only -inf and NaN: -inf first
    logits[2] = NAN  # only NaN: by position
    logits[3, perm[3][:3]] = INF
    logits[3, perm[3][3:200]] = NAN
    logits[4, perm[4][:20]] = torch.randn(20, generator=gen)  # finite, NaN and -inf, all of them chosen
    logits[4, perm[4][20:30]] = NAN
    logits[5, perm[5]] = torch.randn(w, generator=gen)
    logits[5, perm[5][:25]] = NAN
    return dict(logits=logits, lengths=i32([w, w, w, w, 35, w]), k=40)


def _lengths(gen):
    k, w = 64, 300
    lengths = i32([0, 1, k - 1, k, k + 1, w, w + 100, -5, INT_MAX, INT_MIN])
    return dict(logits=torch.randn(len(lengths), w, generator=gen), lengths=lengths, k=k)


def _starts(gen):
    w = 300
    starts = i32([0, 10, w - 1, w, w + 1000, -10, -(w + 5), INT_MAX, INT_MIN, 250, 250])
    lengths = i32([100, 100, 100, 100, 100, 50, 400, INT_MAX, INT_MAX, 100, 50])
    return dict(logits=torch.randn(len(starts), w, generator=gen), lengths=lengths, k=32, starts=starts)


def _k1(gen):
    logits = torch.randint(0, 3, (8, 200), generator=gen).float()  # the largest value repeats
    return dict(
        logits=logits, lengths=i32([200, 1, 0, 150, 3, 200, 17, 199]), k=1, starts=i32([0, 0, 0, 7, 197, -3, 60, 1])
    )


def _k4096(gen):
    logits = torch.randn(4, 5000, generator=gen)
    logits[0, 100:900] = 1.5  # a run of ties across the cut
    return dict(logits=logits, lengths=i32([5000, 4097, 4096, 3000]), k=4096)


def _k4096_out_width(gen):
    logits = torch.randn(2, 4500, generator=gen).round()
    return dict(logits=logits, lengths=i32([4500, 4096]), k=4096, starts=i32([0, 400]), out_width=4160)


def _out_width(gen):
    return dict(logits=torch.randn(4, 50, generator=gen), lengths=i32([50, 5, 0, 10]), k=10, out_width=64)


def _strided_rows(gen):
    buffer = torch.randn(6, 700, generator=gen)
    logits = buffer[:, 13:513]  # rows 700 apart, starting off the buffer's first column
    assert logits.stride() == (700, 1)
    return dict(logits=logits, lengths=i32([500, 400, 200, 1, 0, 500]), k=128, starts=i32([0, 50, 300, 7, 0, -20]))


def _paged(gen):
    w, page = 700, 64
    table = torch.randint(0, 1000, (2, 11), generator=gen, dtype=torch.int32)
    table[0, 1] = table[1, 5] = -1
    table[1, 0] = INT_MIN
    return dict(
        logits=torch.randn(4, w, generator=gen),
        lengths=i32([700, 200, 130, 0]),
        k=150,
        page_table=table,
        page_size=page,
        starts=i32([0, 64, 3, 0]),
    )


def _paged_row_request(gen):
    table = torch.randint(-1, 500, (3, 6), generator=gen, dtype=torch.int32)
    return dict(
        logits=torch.randn(7, 96, generator=gen),
        lengths=i32([96, 50, 17, 96, 96, 96, 40]),
        k=48,
        page_table=table,
        row_request=i32([2, 0, 2, -1, 3, INT_MAX, 1]),
        page_size=16,
        out_width=64,
    )


def _paged_page_one(gen):
    table = torch.randint(-2, 100, (2, 40), generator=gen, dtype=torch.int32)
    return dict(
        logits=torch.randn(6, 48, generator=gen),
        lengths=i32([48, 40, 39, 1, 0, 45]),
        k=20,
        page_table=table,
        page_size=1,
    )


def _paged_short_table(gen):
    table = torch.randint(0, 50, (2, 3), generator=gen, dtype=torch.int32)  # three pages of 16 for rows of 80
    return dict(
        logits=torch.randn(4, 80, generator=gen), lengths=i32([80, 80, 60, 20]), k=70, page_table=table, page_size=16
    )


def _random(gen):
    r, w = 16, 2000
    logits = torch.randn(r, w, generator=gen)
    logits[::3] = logits[::3].round()  # some rows full of ties
    starts = torch.randint(-100, 1500, (r,), generator=gen, dtype=torch.int32)
    lengths = torch.randint(-10, 2100, (r,), generator=gen, dtype=torch.int32)
    return dict(logits=logits, lengths=lengths, k=256, starts=starts)


def _long_row(gen):
    logits = torch.randn(1, 131072, generator=gen)
    logits[0, ::7] = 3.0  # 18725 equal maxima: the first 2048 of them win
    return dict(logits=logits, lengths=i32([131072]), k=2048)


def _empty(gen):
    return dict(logits=torch.zeros(3, 0), lengths=i32([5, 0, -1]), k=8, out_width=16)


CASES = {
    "all-equal": _all_equal,
    "ties-at-the-cut": _ties_at_the_cut,
    "signed-zeros": _signed_zeros,
    "minus-inf-and-nan": _minus_inf_and_nan,
    "lengths": _lengths,
    "starts": _starts,
    "k1": _k1,
    "k4096": _k4096,
    "k4096-out-width": _k4096_out_width,
    "out-width": _out_width,
    "strided-rows": _strided_rows,
    "paged": _paged,
    "paged-row-request": _paged_row_request,
    "paged-page-size-1": _paged_page_one,
    "paged-short-table": _paged_short_table,
    "random": _random,
    "long-row": _long_row,
    "empty": _empty,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_topk_matches_brute(gen, case):
    args = CASES[case](gen)
    got = dsa.topk(**args)
    want = brute_topk(**args)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)


def test_topk_in_chunks(gen, monkeypatch):
    # a scratch bound under one row's makes the reference take one row at a time
    monkeypatch.setattr(reference.selection, "_TOPK_CHUNK_BYTES", 1)
    for case in ("random", "paged-row-request", "minus-inf-and-nan"):
        args = CASES[case](gen)
        assert torch.equal(dsa.topk(**args), brute_topk(**args))


def test_topk_no_rows():
    got = dsa.topk(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int32), 4, out_width=8)
    assert got.shape == (0, 8) and got.dtype == torch.int32


def test_topk_all_of_a_short_row_ascending(gen):
    logits = torch.tensor([[3.0, -1.0, NAN, 7.0, -INF, 0.5]])
    assert dsa.topk(logits, i32([6]), 8).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    assert dsa.topk(logits, i32([6]), 4).tolist() == [[0, 1, 3, 5]]
    assert dsa.topk(logits, i32([6]), 5).tolist() == [[0, 1, 3, 4, 5]]  # -inf before NaN


# ------------------------------------------------------------------------------------------
# The torch.library contract


OPCHECK_CASES = ["all-equal", "starts", "out-width", "paged", "paged-row-request", "strided-rows"]


def _positional(args):
    names = ("logits", "lengths", "k", "starts", "page_table", "row_request", "page_size", "out_width")
    defaults = dict(starts=None, page_table=None, row_request=None, page_size=64, out_width=None)
    return tuple(args.get(name, defaults.get(name)) for name in names)


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(gen, case):
    torch.library.opcheck(torch.ops.dsa.topk.default, _positional(CASES[case](gen)))


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_bit_identical_repeats(gen, case):
    args = CASES[case](gen)
    assert torch.equal(dsa.topk(**args), dsa.topk(**args))


def _select(logits, lengths, starts):
    return torch.ops.dsa.topk(logits, lengths, 48, starts, None, None, 64, 64)


def _select_slots(logits, lengths, table):
    return torch.ops.dsa.topk(logits, lengths, 48, None, table, None, 16, None)


def _select_inputs(gen, rows):
    return dict(
        logits=torch.randn(rows, 300 + rows, generator=gen).round(),
        lengths=torch.randint(0, 400, (rows,), generator=gen, dtype=torch.int32),
        starts=torch.randint(-5, 100, (rows,), generator=gen, dtype=torch.int32),
    )


def _slot_inputs(gen, b_count):
    rows = 3 * b_count  # three query rows per request
    return dict(
        logits=torch.randn(rows, 160, generator=gen).round(),
        lengths=torch.randint(0, 170, (rows,), generator=gen, dtype=torch.int32),
        table=torch.randint(-1, 400, (b_count, 10), generator=gen, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "step, make, sizes",
    [(_select, _select_inputs, (2, 3, 5, 9)), (_select_slots, _slot_inputs, (2, 4, 5))],
    ids=["rows", "requests"],
)
def test_compile_without_recompiles(gen, step, make, sizes):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for size in sizes:
        inputs = make(gen, size)
        assert torch.equal(compiled(**inputs), step(**inputs))
    assert counter.frame_count == 1  # one graph for every size, no graph break


# ------------------------------------------------------------------------------------------
# The GPU op against the reference


def poison_allocator(nbytes=1 << 28):
    """Fill a block of the caching allocator with NaN bits and free it: the next outputs reuse it."""
    junk = torch.full((nbytes // 4,), NAN, device="cuda")
    del junk


def on_cuda(args):
    return {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in args.items()}


def _kernels_of(args) -> list:
    """The kernels ``dsa.topk(**args)`` launches on an H200-sized GPU."""
    rows, width = args["logits"].shape
    plan = dsa._cuda.selection.plan_topk(rows, width, dsa._cuda.selection.sm_count(torch.device("cuda")))
    paged = args.get("page_table") is not None
    return plan.keys(
        args["k"],
        args.get("page_size", 64) if paged else 0,
        args.get("starts") is not None,
        args.get("row_request") is not None,
    )


@pytest.fixture(scope="module")
def warm():
    keys = [key for case in CASES.values() for key in _kernels_of(case(torch.Generator().manual_seed(7)))]
    keys += [key for case in LARGE.values() for key in _kernels_of(large_case(torch.Generator(), *case))]
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def large_case(gen, rows, width, k, ties=False, paged=False):
    logits = torch.randn(rows, width, generator=gen)
    if ties:
        # True: a handful of values, ties at every cut; a number n: steps of 1 / n, a few equal values at the cut
        steps = 2 if ties is True else ties
        logits = (logits * steps).round() / steps
    logits[0, :: max(1, width // 100)] = NAN
    lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = width
    args = dict(logits=logits, lengths=lengths, k=k, out_width=k + 64)
    if paged:
        b_count = max(1, rows // 2) if rows % 2 == 0 else rows
        table = torch.randint(-1, 1 << 16, (b_count, width // 64), generator=gen, dtype=torch.int32)
        args.update(page_table=table, page_size=64)
    return args


LARGE = {
    "1-row-131072": (1, 131072, 2048, False, False),
    "4-rows-131072": (4, 131072, 2048, False, False),
    "64-rows-131072-ties": (64, 131072, 2048, True, False),
    "8-rows-65536-k4096": (8, 65536, 4096, False, False),
    "16-rows-32768-paged": (16, 32768, 2048, False, True),
    # a few rows split over CTAs: fine ties at the guessed threshold's cut, and wider than the bitmap (where the guess
    # fails, the last CTA's own two reads gather the list in column order)
    "4-rows-131072-fine-ties": (4, 131072, 2048, 64, False),
    "4-rows-200000": (4, 200000, 2048, False, False),
    "300-rows-8192-k1": (300, 8192, 1, True, False),
    # a CTA a row (rows >= the SMs): a long row read once on a guessed threshold, the list gathered in no order and
    # written through the column bitmap
    "140-rows-131072": (140, 131072, 2048, False, False),
    "140-rows-131072-fine-ties": (140, 131072, 2048, 64, False),
    "140-rows-65536-paged": (140, 65536, 2048, False, True),
    # a handful of values: the guessed threshold's bin overflows the list, and so does the histogram's
    "140-rows-65536-ties": (140, 65536, 2048, True, False),
    # wider than the bitmap: the list gathered in column order
    "140-rows-140000": (140, 140000, 2048, False, False),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_topk_matches_reference(warm, case):
    args = CASES[case](torch.Generator().manual_seed(7))
    want = reference.topk(**args)
    poison_allocator()
    got = dsa.topk(**on_cuda(args))
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(LARGE))
def test_cuda_topk_large(warm, case):
    args = large_case(torch.Generator().manual_seed(len(case)), *LARGE[case])
    want = reference.topk(**args)
    poison_allocator()
    got = dsa.topk(**on_cuda(args))
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
def test_cuda_topk_strided_rows_and_starts():
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(32, 70000, generator=g)
    args = dict(
        logits=buffer[:, 100:65636],
        lengths=torch.randint(0, 65536, (32,), generator=g, dtype=torch.int32),
        k=2048,
        starts=torch.randint(-1000, 60000, (32,), generator=g, dtype=torch.int32),
    )
    want = reference.topk(**args)
    got = dsa.topk(buffer.cuda()[:, 100:65636], args["lengths"].cuda(), 2048, args["starts"].cuda())
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
def test_cuda_topk_graph_replay_on_new_data():
    def inputs(seed):
        return large_case(torch.Generator().manual_seed(seed), 8, 16384, 2048, ties=seed % 2 == 1, paged=True)

    live = on_cuda(inputs(0))
    dsa.topk(**live)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dsa.topk(**live)
    for seed in (1, 2):
        new = inputs(seed)
        for name, value in new.items():
            if isinstance(value, torch.Tensor):
                live[name].copy_(value)
        graph.replay()
        assert torch.equal(out.cpu(), reference.topk(**new))
