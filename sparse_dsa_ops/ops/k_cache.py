"""The packed FP8 K cache's ops (family ``k_cache``): quantize latent rows into packed FP8 rows, store them into a
paged pool, dequantize and gather them. Schemas, argument checks, fake kernels and the public functions.

Letters: N rows to quantize or store, M gathered slots, S slots in the pool (pages x page size), B packed row bytes
(``KCacheLayout.row_bytes``). The exact definitions are ``reference.<op>``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..layout import QUANT_TILE, KCacheLayout
from .core import (
    _PACKED_DTYPES,
    Family,
    PoolView,
    _declare,
    _fail,
    _pool,
    _row_layout,
    _slots,
    _tensor,
)
from .samples import CHECK_GEOMETRIES, Case, case, k_pool, k_rows, slot_ids

__all__ = [
    "check_quant_k_cache",
    "CacheArgs",
    "check_store_k_cache",
    "check_dequant_k_cache",
    "check_gather_k_cache",
    "check_gather_dequant_k_cache",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
]


def _check_k(op: str, k_nope: object, k_rope: object) -> KCacheLayout:
    """``k_nope [N, d_nope]`` bf16 and ``k_rope [N, d_rope]`` bf16 or None -> their row layout."""
    k_nope = _tensor(op, "k_nope", k_nope, (torch.bfloat16,), (2,))
    d_nope = int(k_nope.shape[1])
    if d_nope == 0 or d_nope % QUANT_TILE:
        _fail(op, "k_nope", f"[N, d_nope] with d_nope a positive multiple of {QUANT_TILE}", k_nope)
    d_rope = 0
    if k_rope is not None:
        k_rope = _tensor(op, "k_rope", k_rope, (torch.bfloat16,), (2,), k_nope.device)
        if k_rope.shape[0] != k_nope.shape[0]:
            _fail(op, "k_rope", f"[N, d_rope] with N = {k_nope.shape[0]} like k_nope", k_rope)
        d_rope = int(k_rope.shape[1])
    return KCacheLayout(d_nope, d_rope)


def check_quant_k_cache(k_nope, k_rope, round_scale=False) -> KCacheLayout:
    return _check_k("quant_k_cache", k_nope, k_rope)


@dataclass(frozen=True)
class CacheArgs:
    """What the checker learned about a K-cache op's pool."""

    layout: KCacheLayout
    pool: PoolView


def check_store_k_cache(k_nope, k_rope, cache, loc, round_scale=False) -> CacheArgs:
    op = "store_k_cache"
    lay = _check_k(op, k_nope, k_rope)
    view = _pool(op, "cache", cache, _PACKED_DTYPES, k_nope.device)
    if view.width * cache.element_size() != lay.row_bytes:
        _fail(op, "cache", f"a pool of {lay.row_bytes}-byte rows to hold {lay} rows", cache)
    _slots(op, "loc", loc, k_nope.device, k_nope.shape[0])
    return CacheArgs(lay, view)


def check_dequant_k_cache(packed) -> KCacheLayout:
    op = "dequant_k_cache"
    packed = _tensor(op, "packed", packed, _PACKED_DTYPES, (1, 2, 3, 4))
    return _row_layout(op, "packed", int(packed.shape[-1]))


def _check_gather(op: str, cache, indices) -> CacheArgs:
    view = _pool(op, "cache", cache, _PACKED_DTYPES, None, any_stride=True)
    _slots(op, "indices", indices, cache.device)
    return CacheArgs(_row_layout(op, "cache", view.width), view)


def check_gather_k_cache(cache, indices) -> CacheArgs:
    return _check_gather("gather_k_cache", cache, indices)


def check_gather_dequant_k_cache(cache, indices) -> CacheArgs:
    return _check_gather("gather_dequant_k_cache", cache, indices)


@_declare("(Tensor k_nope, Tensor? k_rope, bool round_scale=False) -> Tensor", check_quant_k_cache)
def _fake_quant_k_cache(lay, k_nope, k_rope, round_scale=False):
    return k_nope.new_empty((k_nope.shape[0], lay.row_bytes), dtype=torch.uint8)


@_declare(
    "(Tensor k_nope, Tensor? k_rope, Tensor(a!) cache, Tensor loc, bool round_scale=False) -> ()", check_store_k_cache
)
def _fake_store_k_cache(args, k_nope, k_rope, cache, loc, round_scale=False):
    return None


@_declare("(Tensor packed) -> Tensor", check_dequant_k_cache)
def _fake_dequant_k_cache(lay, packed):
    return packed.new_empty((*packed.shape[:-1], lay.d_qk), dtype=torch.bfloat16)


@_declare("(Tensor cache, Tensor indices) -> Tensor", check_gather_k_cache)
def _fake_gather_k_cache(args, cache, indices):
    return cache.new_empty((indices.shape[0], args.layout.row_bytes), dtype=torch.uint8)


@_declare("(Tensor cache, Tensor indices) -> Tensor", check_gather_dequant_k_cache)
def _fake_gather_dequant_k_cache(args, cache, indices):
    return cache.new_empty((indices.shape[0], args.layout.d_qk), dtype=torch.bfloat16)


def quant_k_cache(k_nope: torch.Tensor, k_rope: torch.Tensor | None = None, round_scale: bool = False) -> torch.Tensor:
    """Quantize K rows into packed FP8 rows.

    Parameters
    ----------
    k_nope : [N, d_nope] bfloat16
        The latent; d_nope a multiple of 128.
    k_rope : [N, d_rope] bfloat16 or None
        The RoPE tail, copied unquantized; None for a layout without tail.
    round_scale : bool
        Round each per-tile scale ``amax / 448`` up to a power of two (ue8m0-style).

    Returns
    -------
    [N, B] uint8
        Packed rows in the ``KCacheLayout(d_nope, d_rope)`` format. A tile whose scale would be 0
        (all zeros) gets scale 1. Exact definition: ``reference.quant_k_cache``.
    """
    return torch.ops.dsa.quant_k_cache(k_nope, k_rope, round_scale)


def store_k_cache(
    k_nope: torch.Tensor,
    k_rope: torch.Tensor | None,
    cache: torch.Tensor,
    loc: torch.Tensor,
    round_scale: bool = False,
) -> None:
    """Quantize K rows and write row i into slot ``loc[i]`` of the pool, in place.

    Parameters
    ----------
    k_nope : [N, d_nope] bfloat16
    k_rope : [N, d_rope] bfloat16 or None
    cache : [S, B] or [P, page, B] or [P, page, 1, B] uint8, int8 or float8_e4m3fn (views of packed rows)
        The pool; slot ``page * page_size + offset``. Written in place. Rows are contiguous within a page;
        pages may lie further apart (a per-layer view into a bigger buffer), a whole number of rows apart.
    loc : [N] int32 or int64
        Slot of each row. Entries that are negative (padding) or ``>= S`` are skipped; nothing
        else of the pool changes. Valid entries must be distinct (with duplicates, one of the
        rows lands, unspecified which).
    round_scale : bool
        As in :func:`quant_k_cache`.
    """
    torch.ops.dsa.store_k_cache(k_nope, k_rope, cache, loc, round_scale)


def dequant_k_cache(packed: torch.Tensor) -> torch.Tensor:
    """Dequantize packed rows ``[..., B]`` (uint8, int8 or float8_e4m3fn) into ``[..., d_nope + d_rope]`` bfloat16.

    The layout is inferred from B (``KCacheLayout.from_row_bytes``). Each value is
    ``bf16(float32(fp8) * scale)``; the tail is copied. Exact definition: ``reference.dequant_k_cache``.
    """
    return torch.ops.dsa.dequant_k_cache(packed)


def gather_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Copy the packed rows of slots ``indices [M]`` (int32 or int64) out of the pool -> ``[M, B]`` uint8.

    ``cache`` is ``[S, B]``, ``[S, 1, B]`` or paged ``[P, page, (1,) B]`` of packed rows (uint8, int8 or
    float8_e4m3fn), rows and pages strided as :func:`sparse_attn`'s ``kv`` may be. Ids outside ``[0, S)`` give
    zero rows (which dequantize to zeros); nothing outside the pool is read.
    """
    return torch.ops.dsa.gather_k_cache(cache, indices)


def gather_dequant_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather and dequantize the rows of slots ``indices [M]`` -> ``[M, d_nope + d_rope]`` bfloat16.

    Equal to ``dequant_k_cache(gather_k_cache(cache, indices))``: invalid ids give zero rows.
    """
    return torch.ops.dsa.gather_dequant_k_cache(cache, indices)


# ----------------------------------------------------------------------------------------------
# Self-check cases (``python -m sparse_dsa_ops check``).


def _cache_keys(op: str, lay: KCacheLayout, round_scale: bool, device: torch.device) -> list:
    """The kernel of the K-cache op ``op`` for rows of ``lay`` and int32 slot ids (every case's)."""
    from .._cuda import k_cache

    return k_cache.cache_keys(op, lay, round_scale)


def _geometry_cases(geo: str, n_rows: int, slots: int) -> list[Case]:
    """The K-cache ops at ``geo``'s rows. The quantizer runs with unrounded scales, the store with scales rounded to
    powers of two: either op has a kernel for each, and the check compiles one of each op's."""
    lay = KCacheLayout(*CHECK_GEOMETRIES[geo][:2])

    def store(g):
        return *k_rows(g, n_rows, lay), k_pool(g, lay, slots), torch.randperm(slots, generator=g)[:n_rows].int(), True

    def gather(g):
        return k_pool(g, lay, slots), slot_ids(g, n_rows, slots)

    def keys(op, round_scale=False):
        return functools.partial(_cache_keys, op, lay, round_scale)

    return [
        case("quant_k_cache", geo, lambda g: (*k_rows(g, n_rows, lay), False), keys("quant_k_cache")),
        case("store_k_cache", geo, store, keys("store_k_cache", True), writes=2),
        case("dequant_k_cache", geo, lambda g: (k_pool(g, lay, slots),), keys("dequant_k_cache")),
        case("gather_k_cache", geo, gather, keys("gather_k_cache")),
        case("gather_dequant_k_cache", geo, gather, keys("gather_dequant_k_cache")),
    ]


def check_cases(on_cpu: bool) -> list[Case]:
    n_rows, slots = (4096, 16384) if on_cpu else (65536, 65536)
    return [c for geo in CHECK_GEOMETRIES for c in _geometry_cases(geo, n_rows, slots)]


FAMILY = Family("k_cache", check_cases)
