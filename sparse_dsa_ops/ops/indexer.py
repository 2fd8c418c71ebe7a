"""The lightning indexer's ops (family ``indexer``): its FP8 keys, the paged index-K cache, the logits, and the
prefill indexer and top-k as one op (``index_topk``). Schemas, argument checks, fake kernels and the public
functions.

Letters: D the indexer head dim, Hi its heads, T query tokens, N keys, R query rows of a paged batch, P pages of
``page`` tokens. The exact definitions are ``reference.<op>``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .core import (
    _FP8,
    Family,
    KernelSpec,
    _declare,
    _describe,
    _fail,
    _selection_width,
    _slots,
    _tensor,
    _vector,
)
from .samples import Case, case, slot_ids, sm_count

__all__ = [
    "INDEX_DIM_MULTIPLE",
    "INDEX_SCALE_BYTES",
    "INDEX_HEAD_DIM",
    "IndexCache",
    "check_quant_index",
    "check_store_index_k",
    "check_gather_index_k",
    "check_index_logits",
    "check_paged_index_logits",
    "quant_index",
    "store_index_k",
    "gather_index_k",
    "index_logits",
    "paged_index_logits",
    "check_index_topk",
    "index_topk",
]

INDEX_DIM_MULTIPLE = 64  # the indexer's head dim
INDEX_SCALE_BYTES = 4  # one float32 scale per index-K row
INDEX_HEAD_DIM = 128  # the indexer head dim of every known model: D of a 2-d index-K cache when not given


def _index_rows(
    op: str,
    name: str,
    x: object,
    dtypes: Sequence[torch.dtype],
    ranks: Sequence[int],
    device: torch.device | None = None,
) -> torch.Tensor:
    """A tensor whose last dim is the indexer head dim D, a positive multiple of 64."""
    x = _tensor(op, name, x, dtypes, ranks, device)
    d = int(x.shape[-1])
    if d == 0 or d % INDEX_DIM_MULTIPLE:
        _fail(op, name, f"[..., D] with the index head dim D a positive multiple of {INDEX_DIM_MULTIPLE}", x)
    return x


@dataclass(frozen=True)
class IndexCache:
    """A paged index-K cache: ``pages`` pages of ``page`` tokens, each page ``page * dim`` FP8 bytes (token-major)
    followed by ``page`` float32 scales."""

    pages: int
    page: int
    dim: int

    @property
    def slots(self) -> int:
        return self.pages * self.page

    @property
    def page_bytes(self) -> int:
        return self.page * (self.dim + INDEX_SCALE_BYTES)


def _index_cache(op: str, cache: object, dim: int | None, device: torch.device | None) -> IndexCache:
    """``[P, page * (D + 4)]`` uint8, or its views ``[P, page, D + 4]`` / ``[P, page, 1, D + 4]``, contiguous.
    ``dim`` is D when the caller knows it (for the 2-d form, 128 when not given)."""
    cache = _tensor(op, "cache", cache, (torch.uint8,), (2, 3, 4), device)
    if cache.dim() == 4 and cache.shape[2] != 1:
        _fail(op, "cache", "[P, page, 1, D + 4] when 4-d", cache)
    if not cache.is_contiguous():
        _fail(
            op,
            "cache",
            "contiguous (pages of FP8 rows, then their scales)",
            f"{_describe(cache)} with strides {cache.stride()}",
        )
    pages, row = cache.shape[0], int(cache.shape[-1])  # the page count stays symbolic under torch.compile
    if cache.dim() > 2:
        page, d = int(cache.shape[1]), row - INDEX_SCALE_BYTES
        if dim is not None and d != dim:
            _fail(op, "cache", f"rows of D + 4 = {dim + INDEX_SCALE_BYTES} bytes for D = {dim}", cache)
    else:
        d = INDEX_HEAD_DIM if dim is None else dim  # a 2-d cache does not say D: every known model's unless given
        if row % (d + INDEX_SCALE_BYTES):
            hint = " (the default head_dim; pass head_dim for another D)" if dim is None else ""
            _fail(
                op,
                "cache",
                f"[P, page * (D + 4)] with D = {d}{hint}: a whole number of {d + INDEX_SCALE_BYTES}-byte tokens "
                "per page",
                cache,
            )
        page = row // (d + INDEX_SCALE_BYTES)
    if d <= 0 or d % INDEX_DIM_MULTIPLE or page == 0:
        _fail(
            op,
            "cache",
            f"pages of at least one token of D + 4 bytes, D a positive multiple of {INDEX_DIM_MULTIPLE}",
            cache,
        )
    return IndexCache(pages, page, d)


def check_quant_index(x, round_scale=False) -> int:
    return int(_index_rows("quant_index", "x", x, (torch.bfloat16,), (1, 2, 3, 4)).shape[-1])


def check_store_index_k(k, cache, loc, round_scale=False) -> IndexCache:
    op = "store_index_k"
    k = _index_rows(op, "k", k, (torch.bfloat16,), (2,))
    layout = _index_cache(op, cache, int(k.shape[1]), k.device)
    _slots(op, "loc", loc, k.device, k.shape[0])
    return layout


def check_gather_index_k(cache, indices, head_dim=None) -> IndexCache:
    op = "gather_index_k"
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0):
        _fail(op, "head_dim", "a positive int or None", head_dim, TypeError)
    layout = _index_cache(op, cache, head_dim, None)
    _slots(op, "indices", indices, cache.device)
    return layout


def _check_logit_query(op: str, q: object, weights: object, rank: int) -> torch.Tensor:
    q = _index_rows(op, "q", q, (_FP8, torch.bfloat16), (rank,))
    rows = math.prod(q.shape[:-2])
    w = _tensor(op, "weights", weights, (torch.float32,), (2,), q.device)
    if tuple(w.shape) != (rows, q.shape[-2]):
        _fail(op, "weights", f"[{rows}, Hi = {q.shape[-2]}] (one weight per query row and indexer head)", w)
    return q


def check_index_logits(q, k, k_scale, weights, ks, ke) -> None:
    _check_prefill_logits("index_logits", q, k, k_scale, weights, ks, ke)


def _check_prefill_logits(op: str, q, k, k_scale, weights, ks, ke) -> None:
    """The arguments of :func:`index_logits`, which :func:`index_topk` shares."""
    q = _check_logit_query(op, q, weights, 3)
    k = _index_rows(op, "k", k, (_FP8,), (2,), q.device)
    if k.shape[1] != q.shape[2]:
        _fail(op, "k", f"[N, D] with D = {q.shape[2]} like q", k)
    _vector(op, "k_scale", k_scale, torch.float32, k.shape[0], q.device, "key")
    _vector(op, "ks", ks, torch.int32, q.shape[0], q.device, "query token")
    _vector(op, "ke", ke, torch.int32, q.shape[0], q.device, "query token")


def check_paged_index_logits(q, cache, weights, lengths, page_table) -> IndexCache:
    op = "paged_index_logits"
    q = _check_logit_query(op, q, weights, 4)
    layout = _index_cache(op, cache, int(q.shape[-1]), q.device)
    _vector(op, "lengths", lengths, torch.int32, q.shape[0] * q.shape[1], q.device, "query row")
    table = _tensor(op, "page_table", page_table, (torch.int32,), (2,), q.device)
    if table.shape[0] != q.shape[0]:
        _fail(op, "page_table", f"[B, max_pages] with B = {q.shape[0]} like q", table)
    return layout


@_declare("(Tensor x, bool round_scale=False) -> (Tensor, Tensor)", check_quant_index)
def _fake_quant_index(dim, x, round_scale=False):
    return x.new_empty(x.shape, dtype=_FP8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@_declare("(Tensor k, Tensor(a!) cache, Tensor loc, bool round_scale=False) -> ()", check_store_index_k)
def _fake_store_index_k(layout, k, cache, loc, round_scale=False):
    return None


@_declare("(Tensor cache, Tensor indices, int? head_dim=None) -> (Tensor, Tensor)", check_gather_index_k)
def _fake_gather_index_k(layout, cache, indices, head_dim=None):
    m = indices.shape[0]
    return cache.new_empty((m, layout.dim), dtype=_FP8), cache.new_empty((m,), dtype=torch.float32)


@_declare("(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke) -> Tensor", check_index_logits)
def _fake_index_logits(none, q, k, k_scale, weights, ks, ke):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


@_declare(
    "(Tensor q, Tensor cache, Tensor weights, Tensor lengths, Tensor page_table) -> Tensor", check_paged_index_logits
)
def _fake_paged_index_logits(layout, q, cache, weights, lengths, page_table):
    return q.new_empty((q.shape[0] * q.shape[1], page_table.shape[1] * layout.page), dtype=torch.float32)


def quant_index(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize indexer rows to FP8 with one scale per row.

    Parameters
    ----------
    x : [..., D] bfloat16
        D a multiple of 64 (128 in every known model).
    round_scale : bool
        Round each scale up to a power of two (ue8m0-style).

    Returns
    -------
    values : [..., D] float8_e4m3fn
        ``saturate_to_±448(x / scale)``, rounded to nearest even.
    scale : [...] float32
        ``max(amax(|row|), 1e-4) / 448``.

    Exact definition: ``reference.quant_index``. For q, a model folds ``scale`` into its head weights.
    """
    return torch.ops.dsa.quant_index(x, round_scale)


def store_index_k(k: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, round_scale: bool = False) -> None:
    """Quantize indexer keys and write row i into slot ``loc[i]`` of the paged index-K cache, in place.

    Parameters
    ----------
    k : [N, D] bfloat16
    cache : [P, page * (D + 4)] uint8 (or its views [P, page, D + 4] / [P, page, 1, D + 4]), contiguous
        Page p holds ``page * D`` FP8 bytes, token-major (slot ``p * page + o`` at byte ``o * D``), then ``page``
        float32 scales (slot ``p * page + o`` at byte ``page * D + 4 * o``) — the layout serving stacks allocate.
        Any page size of at least 1.
    loc : [N] int32 or int64
        Slot of each row; negative entries and entries ``>= P * page`` are skipped, nothing else changes.
    round_scale : bool
        As in :func:`quant_index`.
    """
    torch.ops.dsa.store_index_k(k, cache, loc, round_scale)


def gather_index_k(
    cache: torch.Tensor, indices: torch.Tensor, head_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 keys and scales of slots ``indices [M]`` (int32 or int64) of a paged index-K cache.

    ``cache`` as in :func:`store_index_k`; ``head_dim`` (D) is checked against a 3-d or 4-d view, and says how the
    2-d form splits into tokens: 128 (every known model's) when None, an error only where the width is no whole
    number of ``D + 4``-byte tokens. Returns ``values [M, D]`` float8_e4m3fn and ``scale [M]`` float32; ids outside
    ``[0, P * page)`` give zero values and scale 0, and nothing outside the cache is read.
    """
    return torch.ops.dsa.gather_index_k(cache, indices, head_dim)


def index_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits over a ragged range of keys per query token (prefill).

    Parameters
    ----------
    q : [T, Hi, D] float8_e4m3fn or bfloat16
    k : [N, D] float8_e4m3fn
    k_scale : [N] float32
    weights : [T, Hi] float32
        Per-token head weights (a model folds q's scale into them).
    ks, ke : [T] int32
        Token t scores the keys ``max(ks[t], 0) <= j < min(ke[t], N)``.

    Returns
    -------
    [T, N] float32
        ``k_scale[j] * sum_h weights[t, h] * relu(q[t, h] . k[j])`` inside each token's range, ``-inf``
        everywhere else. Exact definition: ``reference.index_logits``.
    """
    return torch.ops.dsa.index_logits(q, k, k_scale, weights, ks, ke)


def paged_index_logits(
    q: torch.Tensor,
    cache: torch.Tensor,
    weights: torch.Tensor,
    lengths: torch.Tensor,
    page_table: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits over each request's pages of the index-K cache (decode and speculative verify).

    Parameters
    ----------
    q : [B, n, Hi, D] float8_e4m3fn or bfloat16
        n query rows per request; row ``r = b * n + i``.
    cache : the paged index-K cache of :func:`store_index_k` (its page size from its shape)
    weights : [B * n, Hi] float32
    lengths : [B * n] int32
        Row r sees positions ``0 <= p < lengths[r]``.
    page_table : [B, max_pages] int32
        Position p of request b is slot ``page_table[b, p // page] * page + p % page``.

    Returns
    -------
    [B * n, max_pages * page] float32
        The logit of each position as in :func:`index_logits`; positions past a row's length, and positions whose
        page-table entry lies outside ``[0, P)``, are ``-inf`` and never read. Exact definition:
        ``reference.paged_index_logits``.
    """
    return torch.ops.dsa.paged_index_logits(q, cache, weights, lengths, page_table)


def check_index_topk(q, k, k_scale, weights, ks, ke, topk, out_width=None) -> int:
    """-> the output width."""
    op = "index_topk"
    _check_prefill_logits(op, q, k, k_scale, weights, ks, ke)
    return _selection_width(op, "topk", topk, out_width)


@_declare(
    "(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, int topk, int? out_width=None) "
    "-> Tensor",
    check_index_topk,
)
def _fake_index_topk(width, q, k, k_scale, weights, ks, ke, topk, out_width=None):
    return q.new_empty((q.shape[0], width), dtype=torch.int32)


def index_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    out_width: int | None = None,
) -> torch.Tensor:
    """The indexer's ``topk`` best keys of each query token (prefill), without ever holding the ``[T, N]`` logits.

    Parameters
    ----------
    q : [T, Hi, D] float8_e4m3fn or bfloat16
    k : [N, D] float8_e4m3fn
    k_scale : [N] float32
    weights : [T, Hi] float32
        As in :func:`index_logits`.
    ks, ke : [T] int32
        Token t's candidates are the keys ``ks[t] <= j < ke[t]`` clipped to ``[0, N)`` (``ke - ks`` in int32).
    topk : int
        1 to 4096.
    out_width : int or None
        The output width (``>= topk``, e.g. a multiple of 64 for :func:`sparse_attn`); topk when None.

    Returns
    -------
    [T, out_width or topk] int32
        Token t's ``topk`` first candidates in the order (logit descending, then key ascending; NaN ranks below
        ``-inf``) — all of them when it has fewer — as ascending positions ``j - ks[t]``, then -1. Bit for bit
        ``topk(index_logits(q, k, k_scale, weights, ks, ke), ke - ks, topk, starts=ks, out_width=out_width)`` on
        the same device. Exact definition: ``reference.index_topk``.

    Notes
    -----
    The query tokens run in chunks, each chunk's logits scored into one reused buffer and selected from there, so
    the memory held beyond the inputs and the output is bounded whatever T (on a GPU at most 64 MB, the buffer and
    top-k's scratch; one token at a time where a single row's logits and scratch exceed that): a 128K-token prompt
    runs in one call. The logits are still written and read back once; a kernel that keeps only each token's
    running candidates and never writes them is future work.
    """
    return torch.ops.dsa.index_topk(q, k, k_scale, weights, ks, ke, topk, out_width)


# ----------------------------------------------------------------------------------------------
# Self-check cases (``python -m sparse_dsa_ops check``): DeepSeek-V3.2's indexer (64 heads of 128; the cache ops do
# not depend on heads).

CHECK_DIM, CHECK_PAGE, CHECK_HEADS = 128, 64, 64
CHECK_TOPK = 256  # index_topk's k in the check (below every case's key count)
CHECK_GEOMETRY = "Hi64 D128 DeepSeek-V3.2"


def _index_keys(op: str, device: torch.device) -> list:
    """The kernel of the indexer op ``op`` for the check's inputs (FP8 queries, unrounded scales, int32 slot ids)."""
    from .._cuda import indexer
    from .._cuda.compile import target

    spec = KernelSpec(heads=CHECK_HEADS, q="fp8", index_dim=CHECK_DIM, page=CHECK_PAGE, target=target())
    return indexer.source_keys(op, spec)


def _index_topk_keys(tokens: int, keys: int, device: torch.device) -> list:
    from .._cuda import indexer

    return indexer.index_topk_keys(CHECK_HEADS, CHECK_DIM, "float8_e4m3fn", tokens, keys, CHECK_TOPK, sm_count(device))


def _fp8(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 0.5).to(_FP8)


def _cache(gen, pages: int) -> torch.Tensor:
    from .. import reference

    c = torch.zeros(pages, CHECK_PAGE * (CHECK_DIM + 4), dtype=torch.uint8)
    k = torch.randn(pages * CHECK_PAGE, CHECK_DIM, generator=gen).bfloat16()
    reference.store_index_k(k, c, torch.arange(pages * CHECK_PAGE, dtype=torch.int32))
    return c


def _topk_inputs(gen, tokens: int, keys: int) -> tuple:
    """Small integers and powers of two: every logit is exact on any device, so the selections match bit for bit."""

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=gen).float()

    heads = CHECK_HEADS
    ke = torch.arange(tokens, dtype=torch.int32) + (keys - tokens + 1)  # causal
    ks = torch.randint(-2, keys // 4, (tokens,), generator=gen, dtype=torch.int32)
    k_scale = torch.exp2(torch.randint(-4, 2, (keys,), generator=gen).float())
    q, k = ints(tokens, heads, CHECK_DIM).to(_FP8), ints(keys, CHECK_DIM).to(_FP8)
    return q, k, k_scale, ints(tokens, heads), ks, ke, CHECK_TOPK, CHECK_TOPK + 64


def check_cases(on_cpu: bool) -> list[Case]:
    n_rows, tokens, keys, batch = (4096, 8, 1024, 2) if on_cpu else (65536, 128, 4096, 4)
    geo, heads, dim, page = CHECK_GEOMETRY, CHECK_HEADS, CHECK_DIM, CHECK_PAGE
    pages = -(-keys // page)

    def store_inputs(gen):
        store_pages = 2 * n_rows // page  # half the slots written
        loc = torch.randperm(store_pages * page, generator=gen)[:n_rows].int()
        return torch.randn(n_rows, dim, generator=gen).bfloat16(), _cache(gen, store_pages), loc, False

    def logits_inputs(gen):
        ke = torch.randint(0, keys + 1, (tokens,), generator=gen, dtype=torch.int32)
        ks = (ke - torch.randint(0, keys // 2, (tokens,), generator=gen, dtype=torch.int32)).clamp_min(0)
        weights = torch.randn(tokens, heads, generator=gen)
        return (
            _fp8(gen, tokens, heads, dim),
            _fp8(gen, keys, dim),
            torch.rand(keys, generator=gen) + 0.5,
            weights,
            ks,
            ke,
        )

    def paged_inputs(gen):
        max_pages = pages // batch
        table = torch.randperm(pages, generator=gen)[: batch * max_pages].int().reshape(batch, max_pages)
        lengths = torch.randint(0, max_pages * page + 1, (batch * 2,), generator=gen, dtype=torch.int32)
        q = _fp8(gen, batch, 2, heads, dim)
        return q, _cache(gen, pages), torch.randn(batch * 2, heads, generator=gen), lengths, table

    def kernels(op):
        return functools.partial(_index_keys, op)

    return [
        case(
            "quant_index",
            geo,
            lambda g: (torch.randn(n_rows, dim, generator=g).bfloat16(), False),
            kernels("quant_index"),
        ),
        case("store_index_k", geo, store_inputs, kernels("store_index_k"), writes=1),
        case(
            "gather_index_k",
            geo,
            lambda g: (_cache(g, pages), slot_ids(g, n_rows, pages * page), dim),
            kernels("gather_index_k"),
        ),
        case("index_logits", geo, logits_inputs, kernels("index_logits"), exact=False),
        case("paged_index_logits", geo, paged_inputs, kernels("paged_index_logits"), exact=False),
        case(
            "index_topk",
            geo,
            lambda g: _topk_inputs(g, tokens, keys),
            functools.partial(_index_topk_keys, tokens, keys),
        ),
    ]


FAMILY = Family("indexer", check_cases)
