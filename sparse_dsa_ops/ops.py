"""The ``dsa`` ops: schemas, argument checks, fake kernels, the public functions and the dispatch.

This is the only module with torch.library schemas. Each op is declared once, by :func:`_declare` over its fake
kernel: the schema, the checker and the fake live together, and :data:`OPS` records them. A backend attaches its
implementations with :func:`register_backend`, which looks each declared op up by name in the backend's module
and runs the op's checker before the backend sees anything, so every backend raises the same errors; the fake
kernels run it too, so ``torch.compile`` reports bad input at trace time.

Letters used in shapes: N rows to quantize or store, M gathered slots, T query tokens, H heads, K top-k entries
per token, S slots in the pool (pages x page size), B packed row bytes (``KCacheLayout.row_bytes``),
d_qk = d_nope + d_rope the query/key width, d_v the value width; for the indexer D its head dim, Hi its heads,
R query rows of a paged batch, P pages of ``page`` tokens.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from .layout import QUANT_TILE, KCacheLayout

__all__ = [
    "OPS",
    "SCHEMAS",
    "TOPK_MULTIPLE",
    "AttnArgs",
    "PoolView",
    "register_backend",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "sparse_attn",
    "sparse_attn_with_max_logits",
    "attn_max_logits",
    "quant_index",
    "store_index_k",
    "gather_index_k",
    "index_logits",
    "paged_index_logits",
    "topk",
    "index_topk",
]

NAMESPACE = "dsa"
TOPK_MULTIPLE = 64  # sparse_attn's top-k widths are padded to this multiple (pad with -1)
INDEX_DIM_MULTIPLE = 64  # the indexer's head dim
INDEX_SCALE_BYTES = 4  # one float32 scale per index-K row
INDEX_HEAD_DIM = 128  # the indexer head dim of every known model: D of a 2-d index-K cache when not given
MAX_TOPK = 4096  # the largest k of dsa.topk
STRIDE_ALIGN = 16  # bytes: a pool that is only read may have rows or pages this far apart (or whole rows)
# sparse_attn's geometry limits, the GPU kernels' (a head block fills at most 128 MMA rows; V is read in 64-wide
# tiles; the RoPE tail in 16-wide MMA steps), checked for every backend so code that runs on a CPU runs on a GPU
MAX_HEADS = 128
D_V_MULTIPLE = 64
D_ROPE_MULTIPLE = 16

_LIB = torch.library.Library(NAMESPACE, "DEF")


@dataclass(frozen=True)
class OpDef:
    """One declared op: its schema (without the name) and the checker every backend and the fake run first."""

    name: str
    schema: str
    check: Callable[..., object]


OPS: dict[str, OpDef] = {}


def _declare(schema: str, check: Callable[..., object]) -> Callable:
    """Define ``dsa.<name>`` with ``schema``; the decorated ``_fake_<name>(checked, *args)`` is its fake kernel,
    called with the checker's result first."""

    def wrap(fake: Callable) -> Callable:
        name = fake.__name__.removeprefix("_fake_")
        _LIB.define(name + schema)

        def fake_kernel(*args, **kwargs):
            return fake(check(*args, **kwargs), *args, **kwargs)

        torch.library.register_fake(f"{NAMESPACE}::{name}", fake_kernel, lib=_LIB)
        OPS[name] = OpDef(name, schema, check)
        return fake

    return wrap


def takes_checked(impl: Callable) -> Callable:
    """Mark a backend implementation that wants the checker's result as its first argument."""
    impl.takes_checked = True
    return impl


def register_backend(device_type: str, module: ModuleType | str) -> None:
    """Attach, for ``device_type``, each declared op's implementation: the function of the op's name in ``module``.

    Each runs after the shared checker; a backend never checks arguments itself. A function marked with
    :func:`takes_checked` receives the checker's result (e.g. :class:`AttnArgs`) before the op's arguments.
    ``module`` given by its import name is imported on the first call of one of its ops (the GPU backend imports
    TileLang, which a process that never runs an op on that device need not load); every declared op is then
    attached, and one the module lacks raises ``NotImplementedError`` when called.
    """
    key = device_type.upper() if device_type in ("cpu", "cuda") else device_type
    for name, op in OPS.items():
        if isinstance(module, str):
            load = functools.partial(_import_impl, module, name, device_type)
        elif getattr(module, name, None) is not None:
            load = functools.partial(getattr, module, name)
        else:
            continue
        _LIB.impl(name, _checked(op, load, f"{name}_{device_type}"), key)


def _import_impl(module: str, name: str, device_type: str) -> Callable:
    impl = getattr(importlib.import_module(module), name, None)
    if impl is None:
        raise NotImplementedError(f"dsa.{name}: no implementation on {device_type} ({module} has none)")
    return impl


def _checked(op: OpDef, load: Callable[[], Callable], name: str) -> Callable:
    """The implementation ``load()`` returns (looked up on the first call) behind ``op``'s checker."""
    impl, pass_checked = None, False

    def checked(*args, **kwargs):
        nonlocal impl, pass_checked
        info = op.check(*args, **kwargs)
        if impl is None:
            impl = load()
            pass_checked = getattr(impl, "takes_checked", False)
        return impl(info, *args, **kwargs) if pass_checked else impl(*args, **kwargs)

    checked.__name__ = name
    return checked


# ----------------------------------------------------------------------------------------------
# Pieces of the argument checker shared by every op.

_SLOT_DTYPES = (torch.int32, torch.int64)
_PACKED_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)  # views of packed FP8 rows serving stacks pass
_FP8 = torch.float8_e4m3fn


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{_dtype_name(x.dtype)} {list(x.shape)} on {x.device}"
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
        _fail(op, name, " or ".join(_dtype_name(d) for d in dtypes), x, TypeError)
    if x.dim() not in ranks:
        _fail(op, name, " or ".join(f"{r}-d" for r in ranks), x)
    if device is not None and x.device != device:
        _fail(op, name, f"on {device} like the other tensors", x)
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        _fail(op, name, "contiguous in its last dim", f"{_describe(x)} with strides {x.stride()}")
    return x


@dataclass(frozen=True)
class PoolView:
    """How a pool's slots sit in memory: ``pages`` pages of ``page`` rows of ``width`` elements, a page
    ``page_stride`` elements after the one before (``page * width`` when the pool is contiguous; larger for a
    per-layer view into a bigger buffer), a row ``row_stride`` elements after the one before within a page (None:
    ``width``, rows packed; larger for a slice of wider rows). Slot ``s`` is row ``s % page`` of page ``s // page``."""

    pages: int
    page: int
    width: int
    page_stride: int
    row_stride: int | None = None

    @property
    def slots(self) -> int:
        return self.pages * self.page

    @property
    def row_step(self) -> int:
        """Elements from one row of a page to the next."""
        return self.width if self.row_stride is None else self.row_stride

    @property
    def contiguous(self) -> bool:
        return (self.pages <= 1 or self.page_stride == self.page * self.width) and (
            self.page <= 1 or self.row_step == self.width
        )

    @property
    def whole_rows(self) -> bool:
        """Every slot starts a whole number of rows after the first: the pool is rows of one ``[rows, width]``
        tensor (with gaps nobody addresses), so kernels that address rows by id read it in place."""
        return self.width > 0 and self.page_stride % self.width == 0 and self.row_step % self.width == 0


def _pool(
    op: str,
    name: str,
    x: object,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None,
    any_stride: bool = False,
) -> PoolView:
    """A KV pool: ``[S, D]``, ``[S, 1, D]`` or paged ``[P, page, D]`` / ``[P, page, 1, D]``, each row contiguous.

    A pool an op writes keeps its rows contiguous within a page; the pages of a paged pool may lie further apart
    than a page (``stride(0) > page * D``), a whole number of rows apart. A pool an op only reads (``any_stride``)
    may have its rows and its pages any distance apart that is a whole number of rows or a multiple of
    :data:`STRIDE_ALIGN` bytes (a slice of wider rows, as FlashMLA's callers pass: each row starts where the
    kernels' 16-byte vector loads can reach it)."""
    pool = _tensor(op, name, x, dtypes, (2, 3, 4), device)
    if pool.dim() == 4 and pool.shape[2] != 1:
        _fail(op, name, "[P, page, 1, D] when 4-d (a single KV head)", pool)
    width = int(pool.shape[-1])
    flat = pool.dim() == 2
    pages, page = (1, int(pool.shape[0])) if flat else (int(pool.shape[0]), int(pool.shape[1]))
    row_stride = int(pool.stride(0 if flat else 1)) if page > 1 else width
    page_stride = int(pool.stride(0)) if pages > 1 else page * row_stride
    strides = f"{_describe(pool)} with strides {pool.stride()}"
    if any_stride:
        for what, stride in (("rows", row_stride), ("rows" if page == 1 else "pages", page_stride)):
            if width and stride % width and stride * pool.element_size() % STRIDE_ALIGN:
                _fail(
                    op,
                    name,
                    f"{what} a whole number of {width}-element rows or a multiple of {STRIDE_ALIGN} bytes apart",
                    strides,
                )
        return PoolView(pages, page, width, page_stride, None if row_stride == width else row_stride)
    if flat and row_stride != width:
        _fail(op, name, "contiguous when 2-d (slots are addressed as rows of a flat pool)", strides)
    if row_stride != width:
        _fail(op, name, "contiguous within a page (slots are addressed as rows of a page)", strides)
    if page_stride < page * width or (width and page_stride % width):
        _fail(
            op,
            name,
            f"pages a whole number of {width}-element rows apart and at least a page of {page} rows",
            strides,
        )
    return PoolView(pages, page, width, page_stride)


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


def _vector(
    op: str, name: str, x: object, dtype: torch.dtype, length: int, device: torch.device, what: str
) -> torch.Tensor:
    """A ``[length]`` tensor of ``dtype``, one entry per ``what``."""
    v = _tensor(op, name, x, (dtype,), (1,), device)
    if v.shape[0] != length:
        _fail(op, name, f"[{length}] (one per {what})", v)
    return v


# ----------------------------------------------------------------------------------------------
# The packed FP8 K cache.


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
# Sparse attention.


@dataclass(frozen=True)
class AttnArgs:
    """What the checker learned about a ``sparse_attn`` call; backends pick kernels from it."""

    kv_kind: str  # "bf16", "fp8" (raw float8_e4m3fn values) or "packed" (FP8 rows as uint8, int8 or float8)
    d_qk: int
    d_v: int
    topk: int
    layout: KCacheLayout | None  # the packed row layout when kv_kind == "packed"
    pool: PoolView
    q_fp8: bool

    @property
    def d_rope(self) -> int:
        return self.d_qk - self.d_v


def _kv_kind(kv: torch.Tensor, d_qk: int) -> str:
    """bf16 rows; float8 rows of width d_qk are raw values; any other float8, uint8 or int8 pool holds packed rows
    (a packed row is always wider than d_qk, so the width decides)."""
    if kv.dtype == torch.bfloat16:
        return "bf16"
    return "fp8" if kv.dtype == _FP8 and kv.shape[-1] == d_qk else "packed"


def check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None) -> AttnArgs:
    op = "sparse_attn"
    view = _pool(op, "kv", kv, (torch.bfloat16, *_PACKED_DTYPES), None, any_stride=True)
    if not isinstance(q, torch.Tensor):
        _fail(op, "q", "a Tensor", q, TypeError)
    if kv.dtype == torch.bfloat16 and q.dtype == _FP8:
        _fail(op, "q", "bfloat16 for a bfloat16 kv (a float8_e4m3fn q needs an FP8 or packed kv)", q, TypeError)
    q = _tensor(op, "q", q, (torch.bfloat16, _FP8), (3,), kv.device)
    d_qk = int(q.shape[2])
    kind = _kv_kind(kv, d_qk)
    if not isinstance(d_v, int) or not 0 < d_v <= d_qk:
        _fail(op, "d_v", f"an int in [1, d_qk = {d_qk}]", d_v)
    if not isinstance(sm_scale, float) or not math.isfinite(sm_scale):
        _fail(op, "sm_scale", "a finite float", sm_scale, TypeError if not isinstance(sm_scale, float) else ValueError)
    layout = None
    if kind == "packed":
        if d_v % QUANT_TILE:
            _fail(op, "d_v", f"a multiple of {QUANT_TILE} for a packed FP8 kv (d_v = d_nope)", d_v)
        layout = KCacheLayout(d_v, d_qk - d_v)
        if view.width != layout.row_bytes:
            _fail(
                op, "kv", f"packed rows of {layout.row_bytes} bytes for q of width {d_qk} and d_v {d_v} ({layout})", kv
            )
    elif view.width != d_qk:
        _fail(op, "kv", f"rows of width d_qk = {d_qk} like q", kv)
    if q.shape[1] > MAX_HEADS:
        _fail(op, "q", f"[T, H, d_qk] with at most {MAX_HEADS} heads H (split the heads over calls)", q)
    if d_v % D_V_MULTIPLE:
        _fail(op, "d_v", f"a multiple of {D_V_MULTIPLE}", d_v)
    if (d_qk - d_v) % D_ROPE_MULTIPLE:
        _fail(op, "q", f"[T, H, d_qk] with the RoPE tail d_qk - d_v = {d_qk - d_v} a multiple of {D_ROPE_MULTIPLE}", q)
    indices = _tensor(op, "indices", indices, (torch.int32,), (2, 3), kv.device)
    if indices.shape[0] != q.shape[0] or (indices.dim() == 3 and indices.shape[1] != 1):
        _fail(op, "indices", f"[T, K] or [T, 1, K] with T = {q.shape[0]} like q", indices)
    topk = int(indices.shape[-1])
    if topk % TOPK_MULTIPLE:
        _fail(op, "indices", f"[T, K] with the top-k width K a multiple of {TOPK_MULTIPLE} (pad with -1)", indices)
    if topk_length is not None:
        _vector(op, "topk_length", topk_length, torch.int32, q.shape[0], kv.device, "token of q")
    if attn_sink is not None:
        _vector(op, "attn_sink", attn_sink, torch.float32, q.shape[1], kv.device, "head of q")
    return AttnArgs(kind, d_qk, d_v, topk, layout, view, q.dtype == _FP8)


def check_attn_max_logits(q, kv, indices, sm_scale, d_v, topk_length=None) -> AttnArgs:
    return check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length)


@_declare(
    "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None, "
    "Tensor? attn_sink=None) -> (Tensor, Tensor)",
    check_sparse_attn,
)
def _fake_sparse_attn(args, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None):
    out = q.new_empty((q.shape[0], q.shape[1], d_v), dtype=torch.bfloat16)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@_declare(
    "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None, "
    "Tensor? attn_sink=None) -> (Tensor, Tensor, Tensor)",
    check_sparse_attn,
)
def _fake_sparse_attn_with_max_logits(args, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None):
    out, lse = _fake_sparse_attn(args, q, kv, indices, sm_scale, d_v)
    return out, lse, torch.empty_like(lse)


@_declare(
    "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None) -> Tensor",
    check_attn_max_logits,
)
def _fake_attn_max_logits(args, q, kv, indices, sm_scale, d_v, topk_length=None):
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style sparse attention: each token attends to its own top-k rows of one latent KV head.

    Parameters
    ----------
    q : [T, H, d_qk] bfloat16 (or float8_e4m3fn when kv is FP8 or packed)
        At most 128 heads; the RoPE tail d_qk - d_v a multiple of 16 (0 for none).
    kv : the pool, flat ``[S, D]`` / ``[S, 1, D]`` or paged ``[P, page, D]`` / ``[P, page, 1, D]``
        bfloat16 with D = d_qk; float8_e4m3fn with D = d_qk (raw values, unit scale); or packed FP8 rows
        (uint8, int8 or float8_e4m3fn) with D = ``KCacheLayout(d_v, d_qk - d_v).row_bytes`` (d_v = d_nope).
        Each row is contiguous; rows and pages may lie further apart, independently (a slice of wider rows, a
        per-layer view), by whole rows or by multiples of 16 bytes. Read in place where every stride is a whole
        number of rows; on a GPU a pool with other strides is read through a compact copy made per call.
    indices : [T, K] or [T, 1, K] int32
        Slot ids (``page * page_size + offset``), K a multiple of 64. Entries outside ``[0, S)`` (-1 padding,
        other negatives, values ``>= S``) count for nothing and their rows are never read.
    sm_scale : float
        Softmax scale applied to ``q . k`` (natural-log base, not pre-multiplied by log2 e).
    d_v : int
        Value width, a multiple of 64: V is the first d_v columns of each selected row.
    topk_length : [T] int32 or None
        Only the first ``topk_length[t]`` entries of row t count.
    attn_sink : [H] float32 or None
        A per-head logit that joins each row's softmax denominator only: ``out`` is scaled by
        ``1 / (1 + exp(attn_sink[h] - lse[t, h]))``; ``lse`` does not include it.

    Returns
    -------
    out : [T, H, d_v] bfloat16
        ``softmax_j(sm_scale * q[t, h] . kv[idx[t, j]]) @ kv[idx[t, j], :d_v]`` over valid j.
    lse : [T, H] float32
        Natural-log log-sum-exp of the scaled scores over valid j.

    A token with no valid entry gets ``out = 0`` and ``lse = -inf``, never NaN. Exact definition:
    ``reference.sparse_attn``.
    """
    return torch.ops.dsa.sparse_attn(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)


def sparse_attn_with_max_logits(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_attn` (same arguments) that also returns each row's largest scaled score, as FlashMLA's prefill
    does: ``(out [T, H, d_v] bf16, lse [T, H] fp32, max_logits [T, H] fp32)``.

    ``max_logits[t, h] = max_j sm_scale * q[t, h] . kv[idx[t, j]]`` over valid j (the sink left out), ``-inf`` for a
    token with no valid entry. On a GPU the prefill kernels keep the exact row max beside the running one and write
    it; tokens that take the split decode path get it from :func:`attn_max_logits`. Exact definition:
    ``reference.sparse_attn_with_max_logits``.
    """
    return torch.ops.dsa.sparse_attn_with_max_logits(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)


def attn_max_logits(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest scaled score of each row of :func:`sparse_attn` (same arguments) -> ``[T, H]`` float32.

    ``max_j sm_scale * q[t, h] . kv[idx[t, j]]`` over valid j; ``-inf`` for a token with no valid entry.
    A second pass over the selected rows (:func:`sparse_attn_with_max_logits` gets them with the attention instead).
    Exact definition: ``reference.attn_max_logits``.
    """
    return torch.ops.dsa.attn_max_logits(q, kv, indices, sm_scale, d_v, topk_length)


# ----------------------------------------------------------------------------------------------
# The lightning indexer: its FP8 keys, the paged index-K cache and the logits.


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


# ----------------------------------------------------------------------------------------------
# Top-k selection.


@dataclass(frozen=True)
class TopkArgs:
    """What the checker learned about a ``topk`` call."""

    k: int
    width: int  # the output width W'
    paged: bool


def check_topk(
    logits, lengths, k, starts=None, page_table=None, row_request=None, page_size=64, out_width=None
) -> TopkArgs:
    op = "topk"
    logits = _tensor(op, "logits", logits, (torch.float32,), (2,))
    rows, dev = logits.shape[0], logits.device  # symbolic under torch.compile: no int(), no specialization
    _vector(op, "lengths", lengths, torch.int32, rows, dev, "row of logits")
    width = _selection_width(op, "k", k, out_width)
    if starts is not None:
        _vector(op, "starts", starts, torch.int32, rows, dev, "row of logits")
    if not isinstance(page_size, int) or page_size < 1:
        _fail(op, "page_size", "a positive int", page_size)
    if page_table is None:
        if row_request is not None:
            _fail(op, "row_request", "None without a page_table", row_request)
        return TopkArgs(k, width, False)
    table = _tensor(op, "page_table", page_table, (torch.int32,), (2,), dev)
    if row_request is not None:
        _vector(op, "row_request", row_request, torch.int32, rows, dev, "row of logits")
    elif table.shape[0] == 0 or rows % table.shape[0]:
        _fail(op, "page_table", f"[B, max_pages] with B dividing R = {rows} (or pass row_request)", table)
    return TopkArgs(k, width, True)


def _selection_width(op: str, name: str, k: object, out_width: object) -> int:
    """The output width of a selection of ``k`` (the argument ``name``) entries a row, checked."""
    if not isinstance(k, int) or not 1 <= k <= MAX_TOPK:
        _fail(op, name, f"an int in [1, {MAX_TOPK}]", k, TypeError if not isinstance(k, int) else ValueError)
    if out_width is not None and (not isinstance(out_width, int) or out_width < k):
        _fail(op, "out_width", f"None or an int >= {name} = {k}", out_width)
    return out_width or k


@_declare(
    "(Tensor logits, Tensor lengths, int k, Tensor? starts=None, Tensor? page_table=None, "
    "Tensor? row_request=None, int page_size=64, int? out_width=None) -> Tensor",
    check_topk,
)
def _fake_topk(args, logits, lengths, k, starts=None, page_table=None, row_request=None, page_size=64, out_width=None):
    return logits.new_empty((logits.shape[0], args.width), dtype=torch.int32)


def topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    starts: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    row_request: torch.Tensor | None = None,
    page_size: int = 64,
    out_width: int | None = None,
) -> torch.Tensor:
    """The k best candidates of each row, exactly, as ascending positions or as pool slots.

    Parameters
    ----------
    logits : [R, W] float32
        Rows may be further apart than W (a row stride larger than W).
    lengths : [R] int32
    k : int
        1 to 4096.
    starts : [R] int32 or None
        Row r's candidates are the columns ``[starts[r], starts[r] + lengths[r])`` clipped to ``[0, W)``; a
        candidate's position is its column minus ``starts[r]`` (0 when None).
    page_table : [B, max_pages] int32 or None
        With a page table, position p becomes the slot ``page_table[b, p // page_size] * page_size +
        p % page_size``; a negative page-table entry gives -1.
    row_request : [R] int32 or None
        The request b of each row; when None, ``b = r // (R / B)``.
    page_size : int
    out_width : int or None
        The output width (``>= k``, e.g. a multiple of 64 for :func:`sparse_attn`); k when None.

    Returns
    -------
    [R, out_width or k] int32
        The k candidates first in the order (logit descending, then position ascending; NaN ranks below
        ``-inf``) — all of them when a row has fewer — in ascending order of position, then -1. Exact and
        deterministic. Exact definition: ``reference.topk``.
    """
    return torch.ops.dsa.topk(logits, lengths, k, starts, page_table, row_request, page_size, out_width)


# ----------------------------------------------------------------------------------------------
# The prefill indexer and top-k as one op.


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


SCHEMAS = {name: op.schema for name, op in OPS.items()}
