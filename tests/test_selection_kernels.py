"""The top-k kernels of ``csrc_tl.selection``: lowering on the CPU (CUDA sm_90a and HIP gfx950), exact results on a GPU.

The GPU tests compile the kernels straight from their builders and hold them to an oracle written here (a stable sort
of (-key, position) per row, in int64 on the CPU), independent of ``sparse_dsa_ops.reference``.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from csrc_tl import selection
from tests.nvcc import assert_no_spills, compile_sm90a, needs_nvcc
from tests.oracle import INT_MAX, INT_MIN

WIDTH = 20000  # columns of the GPU cases: more than a list (8192) holds, so every path of the kernels runs
PAGE = 64
POISON = -7  # what the outputs hold before a call: every entry must be written


@functools.cache
def source(key, target: str) -> str:
    """The generated kernel source of ``key`` for ``target``, lowered as the build lowers it."""
    from sparse_dsa_ops import _cuda

    return _cuda.lower_source(key, target)


def signature(src: str) -> str:
    """The parameter list of the (only) kernel of ``src``."""
    return re.search(r"__global__ void (?:__launch_bounds__\([^)]*\) )?\w+\(([^)]*)\)", src).group(1)


# ----------------------------------------------------------------------------------------------
# Keys and plans (CPU).


def test_names_spell_out_the_specialization():
    keys = [
        selection.TopkKey(2048),
        selection.TopkKey(1024),
        selection.TopkKey(2048, page_size=64),
        selection.TopkKey(2048, has_starts=True),
        selection.TopkKey(2048, page_size=64, has_row_request=True),
        selection.TopkKey(2048, threads=1024),
        selection.TopkKey(2048, cap=4096),
        selection.TopkSplitKey(2048),
        selection.TopkSplitKey(2048, cap=16384),
    ]
    assert len({key.name for key in keys}) == len(keys)
    assert (
        selection.TopkKey(4096, page_size=64, has_starts=True).name == "topk_rows_k4096_page64_starts_t512_v4_cap8192"
    )


@pytest.mark.parametrize(
    "fields",
    [
        dict(k=0),
        dict(k=selection.MAX_K + 1),
        dict(k=64, has_row_request=True),
        dict(k=64, threads=96),
        dict(k=64, threads=64, vec=4),
    ],
    ids=["k0", "k-too-big", "requests-without-table", "threads", "tile-scan"],
)
def test_keys_refuse_what_the_kernels_cannot_do(fields):
    with pytest.raises(AssertionError):
        selection.TopkKey(**fields)


@pytest.mark.parametrize("width, chunks", [(1, 1), (131072, 32), (131071, 32), (65536, 7), (0, 3)])
def test_split_chunks_cover_the_row(width, chunks):
    chunk = selection.split_chunk(width, chunks)
    assert chunk >= 1 and chunks * chunk >= width and (width == 0 or (chunks - 1) * chunk < width)


# ----------------------------------------------------------------------------------------------
# Lowering (CPU).

LOWERED = [
    (selection.TopkKey(2048, page_size=PAGE, has_starts=True, has_row_request=True), "cuda"),
    (selection.TopkKey(2048, page_size=PAGE, has_starts=True, has_row_request=True), "hip"),
    (selection.TopkSplitKey(2048, has_starts=True, threads=1024, cap=16384), "cuda"),  # the split the op plans
]


@pytest.mark.parametrize("key, target", LOWERED, ids=lambda v: getattr(v, "name", v))
def test_kernels_lower(key, target):
    src = source(key, target)
    params = signature(src)
    # the row stride is an argument: a caller passes strided logits without a copy
    assert re.search(r"\bint ld\b", params), params
    # each tensor argument is its own buffer (two arguments of one buffer type would be read as one)
    names = ["logits", "lengths", "starts"] + (["page_table", "row_request"] if key.page_size else [])
    assert all(re.search(rf"\* __restrict__ {name}\b", params) for name in names), params
    # every shuffle is within 32 lanes (the same code on 32- and 64-wide warps)
    shuffles = re.findall(r"__shfl_up(?:_sync)?\(([^;]*)\);", src)
    assert shuffles and all(s.rstrip(")").endswith(", 32") for s in shuffles), shuffles
    if key.name.startswith("topk_split"):
        # the row's last CTA reads the other CTAs' writes only after a ticket and a device-scope fence
        assert "__threadfence()" in src and "AtomicLoad" in src
    # a long row's list gathered in any order (a shared-memory ticket per entry) and put out through the column
    # bitmap: atomicOr on a generic address, which shared memory takes (TileLang's AtomicOr is a global reduction)
    assert "AtomicAddRet((&(((int*)state)" in src and "AtomicOr(" not in src
    assert re.search(r"\batomicOr\(\(&\(\(\(int\*\)hist\)", src) and "__popc(" in src and "__ffs(" in src


def _sweep():
    variants = [
        (False, 0, False),
        (True, 0, False),
        (False, PAGE, False),
        (True, PAGE, False),
        (False, PAGE, True),
        (True, 1, True),
    ]
    keys = []
    for starts, page, request in variants:
        keys.append(selection.TopkKey(2048, page_size=page, has_starts=starts, has_row_request=request))
        keys.append(selection.TopkSplitKey(1, page_size=page, has_starts=starts, has_row_request=request))
    # (and the split the op plans: 1024 threads, a list of 16384 entries; 150 KiB of shared memory, under gfx950's 160)
    return keys + [
        selection.TopkKey(4096, threads=1024),
        selection.TopkKey(1, threads=256, cap=4096),
        selection.TopkSplitKey(2048, threads=1024, cap=16384),
    ]


@pytest.mark.lowering
@pytest.mark.parametrize("target", ["cuda", "hip"])
@pytest.mark.parametrize("key", _sweep(), ids=lambda k: k.name)
def test_every_variant_lowers(key, target):
    assert f"{key.name.split('_k')[0]}_kernel" in source(key, target)


@pytest.mark.lowering
@needs_nvcc
@pytest.mark.parametrize("key", _sweep(), ids=lambda k: k.name)
def test_cuda_sources_compile_without_spills(key, tmp_path):
    assert_no_spills(compile_sm90a(source(key, "cuda"), tmp_path))


# ----------------------------------------------------------------------------------------------
# The oracle and hostile cases (GPU tests).


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 values in the logits' order: -0 equal to +0, every NaN below -inf."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [n] the raw bits
    mag = bits & 0x7FFFFFFF
    key = torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)  # negative floats: larger magnitude, smaller
    key = torch.where(mag == 0, 2**31, key)
    return torch.where(mag > 0x7F800000, -1, key)


def oracle(logits, lengths, k, out_width, starts=None, page_table=None, row_request=None, page_size=PAGE):
    """``[R, out_width]`` int32: each row's k first candidates in (logit descending, position ascending), as
    ascending positions (or their page-table slots), then -1."""
    logits, lengths = logits.cpu(), lengths.cpu()
    rows, width = logits.shape
    out = torch.full((rows, out_width), -1, dtype=torch.int64)
    for r in range(rows):
        s = int(starts[r]) if starts is not None else 0
        lo = min(max(s, 0), width)
        hi = max(min(s + int(lengths[r]), width), lo)
        key = order_keys(logits[r, lo:hi])  # [n]
        best = torch.sort(-key, stable=True).indices[:k]  # ties: the lower position first
        pos = (best + lo - s).sort().values  # [min(n, k)] ascending
        if page_table is not None:
            b_count, max_pages = page_table.shape
            b = int(row_request[r]) if row_request is not None else r // (rows // b_count)
            slots = []
            for p in pos.tolist():
                entry = int(page_table[b, p // page_size]) if 0 <= b < b_count and p // page_size < max_pages else -1
                slot = entry * page_size + p % page_size if entry >= 0 else -1
                slots.append((slot + 2**31) % 2**32 - 2**31)  # stored as int32
            pos = torch.tensor(slots, dtype=torch.int64)
        out[r, : pos.numel()] = pos
    return out.int()


def hostile_rows(k: int, gen: torch.Generator):
    """``(logits [R, WIDTH] float32 with a row stride of WIDTH + 37 and a misaligned start, lengths [R], starts [R])``:
    ties, NaN, +-inf, +-0 and denormals; lengths 0, 1, k - 1, k, k + 1, past the row's end and huge; starts past
    the row, negative and INT_MIN; rows that fit the shared list and rows that overflow it."""
    cases = [  # (values, start, length)
        ("normal", 0, WIDTH),
        ("equal", 0, WIDTH),  # every candidate ties: the list overflows, the row is read again
        ("specials", 0, WIDTH),
        ("steps", 0, WIDTH),  # few distinct values: huge ties at the threshold
        ("normal", 0, 0),
        ("normal", 3, 1),
        ("equal", 5, k - 1),
        ("normal", 11, k),
        ("equal", 17, k + 1),
        ("normal", 0, 6000),  # more than k, fits the list: read once
        ("normal", WIDTH - 3000, 10**6),  # past the row's end
        ("normal", WIDTH + 5, 100),  # starts past the row
        ("specials", -100, 9000),  # a negative start
        ("few-finite", 0, WIDTH),  # fewer than k numbers, the rest -inf: the threshold is -inf
        ("denormal", 1, WIDTH - 1),
        ("normal", 0, INT_MAX),
        ("normal", INT_MIN, INT_MAX),
        ("normal", INT_MAX, INT_MAX),
    ]
    rows = len(cases)
    base = torch.randn(rows, WIDTH + 37, generator=gen)
    logits = base[:, 7 : 7 + WIDTH]  # [R, W] with a row stride of WIDTH + 37 (odd: rows start misaligned)
    for r, (kind, _, _) in enumerate(cases):
        if kind == "equal":
            logits[r] = 1.5
        elif kind == "specials":
            table = torch.tensor([float("nan"), float("-inf"), float("inf"), 0.0, -0.0, 1.0, -1.0])
            logits[r] = table[torch.randint(0, len(table), (WIDTH,), generator=gen)]
            logits[r, ::5] = torch.randn(logits[r, ::5].shape, generator=gen)
        elif kind == "steps":
            logits[r] = torch.randint(-3, 3, (WIDTH,), generator=gen).float()
        elif kind == "few-finite":
            logits[r] = float("-inf")
            logits[r, torch.randperm(WIDTH, generator=gen)[: max(k // 3, 1)]] = 2.0
            logits[r, 5] = float("nan")
        elif kind == "denormal":
            logits[r] *= 1e-39
    starts = torch.tensor([c[1] for c in cases], dtype=torch.int32)
    lengths = torch.tensor([c[2] for c in cases], dtype=torch.int32)
    return logits, lengths, starts


def hostile_pages(rows: int, requests: int, gen: torch.Generator):
    """``(page_table [B, max_pages] int32, row_request [R] int32)``: shuffled pages, some -1 entries, fewer pages
    than the rows span (positions past them give -1), and requests -1 and B among the rows."""
    max_pages = WIDTH // PAGE - 3
    table = torch.stack([torch.randperm(4 * max_pages, generator=gen)[:max_pages] for _ in range(requests)])
    table[torch.rand(table.shape, generator=gen) < 0.1] = -1
    request = torch.randint(0, requests, (rows,), generator=gen)
    request[1], request[2] = -1, requests
    return table.int(), request.int()


@functools.cache
def compiled(key):
    import tilelang

    build = selection.build_topk_rows if isinstance(key, selection.TopkKey) else selection.build_topk_split
    return tilelang.compile(
        build(key), target="hip" if torch.version.hip else "cuda", pass_configs=selection.pass_configs(key)
    )


def inputs(key, out_width, gen):
    """The kernel's inputs for the hostile rows (on the GPU) and the oracle's answer."""
    logits, lengths, starts = hostile_rows(key.k, gen)
    rows = logits.shape[0]
    table = request = None
    if key.page_size:
        # with row_request: 3 requests (and rows of request -1 and 3); without: 6 requests of 3 rows each
        table, request = hostile_pages(rows, 3 if key.has_row_request else 6, gen)
    expect = oracle(
        logits,
        lengths,
        key.k,
        out_width,
        starts if key.has_starts else None,
        table,
        request if key.has_row_request else None,
        key.page_size or PAGE,
    )
    optional = [
        t.cuda()
        for t, on in ((starts, key.has_starts), (table, bool(key.page_size)), (request, key.has_row_request))
        if on
    ]
    big = torch.empty(rows, WIDTH + 37, device="cuda")  # keep the odd row stride and offset on the GPU
    big[:, 7 : 7 + WIDTH] = logits.cuda()
    return big[:, 7 : 7 + WIDTH], lengths.cuda(), optional, expect


# (key, output width W')
GPU_KEYS = [
    (selection.TopkKey(1, has_starts=True), 64),
    (selection.TopkKey(4096, has_starts=True), 4096),
    (selection.TopkKey(2048, page_size=PAGE, has_starts=True, has_row_request=True), 2112),
    (selection.TopkKey(2048, page_size=PAGE), 2048),
]


@pytest.mark.cuda
@pytest.mark.parametrize("key, out_width", GPU_KEYS, ids=lambda k: getattr(k, "name", str(k)))
def test_rows_kernel_is_exact(gen, key, out_width):
    logits, lengths, optional, expect = inputs(key, out_width, gen)
    out = torch.full((logits.shape[0], out_width), POISON, dtype=torch.int32, device="cuda")
    compiled(key)(logits, lengths, *optional, out)
    assert torch.equal(out.cpu(), expect)
    again = torch.full_like(out, POISON)
    compiled(key)(logits, lengths, *optional, again)
    assert torch.equal(again, out)  # deterministic


@pytest.mark.cuda
@pytest.mark.parametrize("key, out_width", GPU_KEYS[1:3], ids=lambda k: getattr(k, "name", str(k)))
@pytest.mark.parametrize("chunks", [1, 7])
def test_split_kernel_is_exact(gen, key, out_width, chunks):
    fields = {f: getattr(key, f) for f in ("k", "page_size", "has_starts", "has_row_request")}
    from sparse_dsa_ops._cuda.selection import SPLIT_CAP, SPLIT_THREADS  # the op's split kernel

    split = compiled(selection.TopkSplitKey(**fields, threads=SPLIT_THREADS, cap=SPLIT_CAP))
    logits, lengths, optional, expect = inputs(key, out_width, gen)
    rows = logits.shape[0]
    tickets = torch.zeros(rows, dtype=torch.int32, device="cuda")
    cand = torch.full((rows, chunks, 2, selection.split_chunk(WIDTH, chunks)), POISON, dtype=torch.int32, device="cuda")
    cand_count = torch.full((rows, chunks), POISON, dtype=torch.int32, device="cuda")
    outs = []
    for _ in range(2):  # the second call runs on the tickets the first one left
        out = torch.full((rows, out_width), POISON, dtype=torch.int32, device="cuda")
        split(logits, lengths, *optional, tickets, cand, cand_count, out)
        outs.append(out.cpu())
        assert not tickets.any()  # a call leaves its tickets zero
    assert torch.equal(outs[0], expect)
    assert torch.equal(outs[1], outs[0])
