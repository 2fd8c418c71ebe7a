"""The ``dsa`` ops: schemas, argument checks, fake kernels, the public functions and the dispatch.

This is the only module with torch.library schemas. Every backend (``reference.py`` on the CPU,
``_cuda.py`` on GPUs) attaches its implementations through :func:`register_backend`, which runs the
same argument checker before the backend sees anything, so every backend raises the same errors;
the fake kernels run it too, so ``torch.compile`` reports bad input at trace time.

Letters used in shapes: N rows to quantize or store, M gathered slots, T query tokens, H heads,
K top-k entries per token, S slots in the pool (pages x page size), B packed row bytes
(``KCacheLayout.row_bytes``), d_qk = d_nope + d_rope the query/key width, d_v the value width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .layout import QUANT_TILE, KCacheLayout

__all__ = [
    "SCHEMAS",
    "TOPK_MULTIPLE",
    "AttnArgs",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "sparse_attn",
    "register_backend",
]

NAMESPACE = "dsa"
TOPK_MULTIPLE = 64  # top-k widths are padded to this multiple (pad with -1)

SCHEMAS = {
    "quant_k_cache": "(Tensor k_nope, Tensor? k_rope, bool round_scale=False) -> Tensor",
    "store_k_cache": "(Tensor k_nope, Tensor? k_rope, Tensor(a!) cache, Tensor loc, bool round_scale=False) -> ()",
    "dequant_k_cache": "(Tensor packed) -> Tensor",
    "gather_k_cache": "(Tensor cache, Tensor indices) -> Tensor",
    "gather_dequant_k_cache": "(Tensor cache, Tensor indices) -> Tensor",
    "sparse_attn": "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None)"
    " -> (Tensor, Tensor)",
}

_LIB = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)

_SLOT_DTYPES = (torch.int32, torch.int64)
_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8)


# ----------------------------------------------------------------------------------------------
# The argument checker shared by every backend and by the fake kernels.


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)} on {x.device}"
    return repr(x)


def _fail(op: str, name: str, need: str, got: object, exc: type[Exception] = ValueError) -> None:
    raise exc(f"dsa.{op}: {name} must be {need}, got {_describe(got)}")


def _tensor(
    op: str,
    name: str,
    x: object,
    dtypes: Sequence[torch.dtype],
    ranks: Sequence[int],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check the type, dtype, rank, device and inner stride of one tensor argument."""
    if not isinstance(x, torch.Tensor):
        _fail(op, name, "a Tensor", x, TypeError)
    if x.dtype not in dtypes:
        _fail(op, name, " or ".join(str(d).removeprefix("torch.") for d in dtypes), x, TypeError)
    if x.dim() not in ranks:
        _fail(op, name, " or ".join(f"{r}-d" for r in ranks), x)
    if device is not None and x.device != device:
        _fail(op, name, f"on {device} like the other tensors", x)
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        _fail(op, name, "contiguous in its last dim", f"{_describe(x)} with strides {x.stride()}")
    return x


def _pool(op: str, name: str, x: object, dtypes: Sequence[torch.dtype], device: torch.device | None) -> torch.Tensor:
    """A KV pool: ``[S, D]``, ``[S, 1, D]`` or paged ``[P, page, D]`` / ``[P, page, 1, D]``, contiguous."""
    pool = _tensor(op, name, x, dtypes, (2, 3, 4), device)
    if pool.dim() == 4 and pool.shape[2] != 1:
        _fail(op, name, "[P, page, 1, D] when 4-d (a single KV head)", pool)
    if not pool.is_contiguous():
        _fail(op, name, "contiguous (slots are addressed as rows of a flat pool)", f"strides {pool.stride()}")
    return pool


def _row_layout(op: str, name: str, row_bytes: int) -> KCacheLayout:
    try:
        return KCacheLayout.from_row_bytes(row_bytes)
    except ValueError as err:
        raise ValueError(f"dsa.{op}: {name} has rows of {row_bytes} bytes. {err}") from None


def _slots(op: str, name: str, x: object, device: torch.device, length: object = None) -> torch.Tensor:
    ids = _tensor(op, name, x, _SLOT_DTYPES, (1,), device)
    if length is not None and ids.shape[0] != length:
        _fail(op, name, f"of length {length} (one slot per row)", ids)
    return ids


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


def check_store_k_cache(k_nope, k_rope, cache, loc, round_scale=False) -> KCacheLayout:
    op = "store_k_cache"
    lay = _check_k(op, k_nope, k_rope)
    cache = _pool(op, "cache", cache, (torch.uint8,), k_nope.device)
    if cache.shape[-1] != lay.row_bytes:
        _fail(op, "cache", f"a pool of {lay.row_bytes}-byte rows to hold {lay} rows", cache)
    _slots(op, "loc", loc, k_nope.device, k_nope.shape[0])
    return lay


def check_dequant_k_cache(packed) -> KCacheLayout:
    op = "dequant_k_cache"
    packed = _tensor(op, "packed", packed, (torch.uint8,), (1, 2, 3, 4))
    return _row_layout(op, "packed", int(packed.shape[-1]))


def _check_gather(op: str, cache, indices) -> KCacheLayout:
    cache = _pool(op, "cache", cache, (torch.uint8,), None)
    _slots(op, "indices", indices, cache.device)
    return _row_layout(op, "cache", int(cache.shape[-1]))


def check_gather_k_cache(cache, indices) -> KCacheLayout:
    return _check_gather("gather_k_cache", cache, indices)


def check_gather_dequant_k_cache(cache, indices) -> KCacheLayout:
    return _check_gather("gather_dequant_k_cache", cache, indices)


@dataclass(frozen=True)
class AttnArgs:
    """What the checker learned about a ``sparse_attn`` call; backends pick kernels from it."""

    kv_kind: str  # "bf16", "fp8" (raw float8_e4m3fn values) or "packed" (uint8 FP8 rows)
    d_qk: int
    d_v: int
    topk: int
    layout: KCacheLayout | None  # the packed row layout when kv_kind == "packed"

    @property
    def d_rope(self) -> int:
        return self.d_qk - self.d_v


def check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length=None) -> AttnArgs:
    op = "sparse_attn"
    kv = _pool(op, "kv", kv, _KV_DTYPES, None)
    kind = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.uint8: "packed"}[kv.dtype]
    q_dtypes = (torch.bfloat16,) if kind == "bf16" else (torch.bfloat16, torch.float8_e4m3fn)
    q = _tensor(op, "q", q, q_dtypes, (3,), kv.device)
    d_qk = int(q.shape[2])
    if not isinstance(d_v, int) or not 0 < d_v <= d_qk:
        _fail(op, "d_v", f"an int in [1, d_qk = {d_qk}]", d_v)
    if not isinstance(sm_scale, float) or not math.isfinite(sm_scale):
        _fail(op, "sm_scale", "a finite float", sm_scale, TypeError if not isinstance(sm_scale, float) else ValueError)
    layout = None
    if kind == "packed":
        if d_v % QUANT_TILE:
            _fail(op, "d_v", f"a multiple of {QUANT_TILE} for a packed FP8 kv (d_v = d_nope)", d_v)
        layout = KCacheLayout(d_v, d_qk - d_v)
        if kv.shape[-1] != layout.row_bytes:
            _fail(op, "kv", f"packed rows of {layout.row_bytes} bytes for q of width {d_qk} and d_v {d_v} "
                  f"({layout})", kv)
    elif kv.shape[-1] != d_qk:
        _fail(op, "kv", f"rows of width d_qk = {d_qk} like q", kv)
    indices = _tensor(op, "indices", indices, (torch.int32,), (2, 3), kv.device)
    if indices.shape[0] != q.shape[0] or (indices.dim() == 3 and indices.shape[1] != 1):
        _fail(op, "indices", f"[T, K] or [T, 1, K] with T = {q.shape[0]} like q", indices)
    topk = int(indices.shape[-1])
    if topk % TOPK_MULTIPLE:
        _fail(op, "indices", f"K a multiple of {TOPK_MULTIPLE} (pad with -1)", indices)
    if topk_length is not None:
        lengths = _tensor(op, "topk_length", topk_length, (torch.int32,), (1,), kv.device)
        if lengths.shape[0] != q.shape[0]:
            _fail(op, "topk_length", f"[T] with T = {q.shape[0]} like q", lengths)
    return AttnArgs(kind, d_qk, d_v, topk, layout)


CHECKS: dict[str, Callable[..., object]] = {
    "quant_k_cache": check_quant_k_cache,
    "store_k_cache": check_store_k_cache,
    "dequant_k_cache": check_dequant_k_cache,
    "gather_k_cache": check_gather_k_cache,
    "gather_dequant_k_cache": check_gather_dequant_k_cache,
    "sparse_attn": check_sparse_attn,
}


# ----------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and devices only.


@torch.library.register_fake("dsa::quant_k_cache")
def _(k_nope, k_rope, round_scale=False):
    lay = check_quant_k_cache(k_nope, k_rope)
    return k_nope.new_empty((k_nope.shape[0], lay.row_bytes), dtype=torch.uint8)


@torch.library.register_fake("dsa::store_k_cache")
def _(k_nope, k_rope, cache, loc, round_scale=False):
    check_store_k_cache(k_nope, k_rope, cache, loc)


@torch.library.register_fake("dsa::dequant_k_cache")
def _(packed):
    lay = check_dequant_k_cache(packed)
    return packed.new_empty((*packed.shape[:-1], lay.d_qk), dtype=torch.bfloat16)


@torch.library.register_fake("dsa::gather_k_cache")
def _(cache, indices):
    lay = check_gather_k_cache(cache, indices)
    return cache.new_empty((indices.shape[0], lay.row_bytes))


@torch.library.register_fake("dsa::gather_dequant_k_cache")
def _(cache, indices):
    lay = check_gather_dequant_k_cache(cache, indices)
    return cache.new_empty((indices.shape[0], lay.d_qk), dtype=torch.bfloat16)


@torch.library.register_fake("dsa::sparse_attn")
def _(q, kv, indices, sm_scale, d_v, topk_length=None):
    check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length)
    out = q.new_empty((q.shape[0], q.shape[1], d_v), dtype=torch.bfloat16)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backends.


def register_backend(device_type: str, impls: dict[str, Callable[..., object]]) -> None:
    """Attach ``impls`` (op name -> function with the op's signature) for ``device_type``.

    Each function runs after the shared checker; a backend never checks arguments itself.
    """
    for name, impl in impls.items():
        check = CHECKS[name]

        def checked(*args, _check=check, _impl=impl):
            _check(*args)
            return _impl(*args)

        checked.__name__ = f"{name}_{device_type}"
        _LIB.impl(name, checked, device_type.upper() if device_type in ("cpu", "cuda") else device_type)


# ----------------------------------------------------------------------------------------------
# Public functions.


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
    cache : [S, B] or [P, page, B] or [P, page, 1, B] uint8, contiguous
        The pool; slot ``page * page_size + offset``. Written in place.
    loc : [N] int32 or int64
        Slot of each row. Entries that are negative (padding) or ``>= S`` are skipped; nothing
        else of the pool changes. Valid entries must be distinct (with duplicates, one of the
        rows lands, unspecified which).
    round_scale : bool
        As in :func:`quant_k_cache`.
    """
    torch.ops.dsa.store_k_cache(k_nope, k_rope, cache, loc, round_scale)


def dequant_k_cache(packed: torch.Tensor) -> torch.Tensor:
    """Dequantize packed rows ``[..., B]`` uint8 into ``[..., d_nope + d_rope]`` bfloat16.

    The layout is inferred from B (``KCacheLayout.from_row_bytes``). Each value is
    ``bf16(float32(fp8) * scale)``; the tail is copied. Exact definition: ``reference.dequant_k_cache``.
    """
    return torch.ops.dsa.dequant_k_cache(packed)


def gather_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Copy the packed rows of slots ``indices [M]`` (int32 or int64) out of the pool -> ``[M, B]`` uint8.

    ``cache`` is ``[S, B]``, ``[S, 1, B]`` or paged ``[P, page, (1,) B]`` uint8. Ids outside
    ``[0, S)`` give zero rows (which dequantize to zeros); nothing outside the pool is read.
    """
    return torch.ops.dsa.gather_k_cache(cache, indices)


def gather_dequant_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather and dequantize the rows of slots ``indices [M]`` -> ``[M, d_nope + d_rope]`` bfloat16.

    Equal to ``dequant_k_cache(gather_k_cache(cache, indices))``: invalid ids give zero rows.
    """
    return torch.ops.dsa.gather_dequant_k_cache(cache, indices)


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style sparse attention: each token attends to its own top-k rows of one latent KV head.

    Parameters
    ----------
    q : [T, H, d_qk] bfloat16 (or float8_e4m3fn when kv is FP8)
    kv : the pool, flat ``[S, D]`` / ``[S, 1, D]`` or paged ``[P, page, D]`` / ``[P, page, 1, D]``
        bfloat16 with D = d_qk; float8_e4m3fn with D = d_qk (raw values, unit scale); or uint8
        packed FP8 rows with D = ``KCacheLayout(d_v, d_qk - d_v).row_bytes`` (d_v = d_nope).
    indices : [T, K] or [T, 1, K] int32
        Slot ids, K a multiple of 64. Entries outside ``[0, S)`` (-1 padding, other negatives,
        values ``>= S``) count for nothing and their rows are never read.
    sm_scale : float
        Softmax scale applied to ``q . k`` (natural-log base, not pre-multiplied by log2 e).
    d_v : int
        Value width: V is the first d_v columns of each selected row.
    topk_length : [T] int32 or None
        Only the first ``topk_length[t]`` entries of row t count.

    Returns
    -------
    out : [T, H, d_v] bfloat16
        ``softmax_j(sm_scale * q[t, h] . kv[idx[t, j]]) @ kv[idx[t, j], :d_v]`` over valid j.
    lse : [T, H] float32
        Natural-log log-sum-exp of the scaled scores over valid j.

    A token with no valid entry gets ``out = 0`` and ``lse = -inf``, never NaN. Exact definition:
    ``reference.sparse_attn``.
    """
    return torch.ops.dsa.sparse_attn(q, kv, indices, sm_scale, d_v, topk_length)
