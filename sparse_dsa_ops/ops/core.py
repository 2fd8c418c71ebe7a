"""The core of the ``dsa`` ops' contracts: how an op is declared (:func:`_declare`: schema, checker and fake kernel
together, recorded in :data:`OPS`), how a backend attaches its implementations (:func:`register_backend`), and the
pieces of the argument checkers every family shares (tensors, pools, slot ids, selection widths).

A backend attaches its implementations with :func:`register_backend`, which looks each declared op up by name and
runs the op's checker before the backend sees anything, so every backend raises the same errors; the fake kernels
run it too, so ``torch.compile`` reports bad input at trace time.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..layout import KCacheLayout

NAMESPACE = "dsa"
MAX_TOPK = 4096  # the largest k of dsa.topk
STRIDE_ALIGN = 16  # bytes: a pool that is only read may have rows or pages this far apart (or whole rows)

_LIB = torch.library.Library(NAMESPACE, "DEF")


@dataclass(frozen=True)
class OpDef:
    """One declared op: its schema (without the name) and the checker every backend and the fake run first."""

    name: str
    schema: str
    check: Callable[..., object]
    family: str  # the family whose contract module declares it (``sparse_dsa_ops.ops.<family>``)


OPS: dict[str, OpDef] = {}


@dataclass(frozen=True)
class KernelSpec:
    """A geometry typed once for every family's kernel keys (what ``python -m sparse_dsa_ops source`` takes): each
    family's GPU module reads the fields its ops depend on in ``source_keys(op, spec)``."""

    kv: str = "bf16"  # sparse_attn's pool: "bf16", "fp8" (float8_e4m3fn values) or "packed" (FP8 rows)
    q: str = "bf16"  # sparse_attn's q: "bf16" or "fp8"
    d_nope: int = 512  # the latent (= value) width
    d_rope: int = 64  # the RoPE tail (0: none)
    heads: int = 128  # query heads, or the indexer's heads
    sm_scale: float | None = None  # None: (d_nope + d_rope) ** -0.5
    topk_length: bool = False
    attn_sink: bool = False
    index_dim: int = 128
    page: int = 64  # tokens a page of the index-K cache, or of top-k's page table (0: none)
    k: int = 2048  # k of topk
    round_scale: bool = False
    slot_dtype: str = "int32"
    target: str = "cuda"  # "cuda" (sm_90a) or "hip" (gfx950)

    @property
    def scale(self) -> float:
        return self.sm_scale if self.sm_scale is not None else (self.d_nope + self.d_rope) ** -0.5


@dataclass(frozen=True)
class WarmupSpec:
    """What :func:`sparse_dsa_ops.warmup` compiles for (its arguments, typed): each family's GPU module turns it into
    its kernel keys in ``warmup_keys_of(spec)``, empty where the spec asks nothing of the family."""

    heads: int
    d_nope: int
    d_rope: int
    sm_scale: float
    kv_kinds: tuple[str, ...] = ("bf16", "packed")
    fp8_q: tuple[bool, ...] = (False,)
    topk_length: tuple[bool, ...] = (False, True)
    attn_sink: tuple[bool, ...] = (False,)
    cache_ops: bool = True
    round_scale: tuple[bool, ...] = (False, True)
    slot_dtypes: tuple[str, ...] = ("int32", "int64")
    index_heads: int | None = None
    index_dim: int = 128
    index_page: int = 64
    topk_k: int | None = None
    kpool: int | None = None
    kpool_dtypes: tuple[tuple[str, str], ...] = (("bfloat16", "bfloat16"),)  # (gate, ape) dtypes of the pool store


@dataclass(frozen=True)
class Family:
    """One op family: its name, the same in every layer (contract ``sparse_dsa_ops.ops.<name>``, reference
    ``sparse_dsa_ops.reference.<name>``, GPU backend ``sparse_dsa_ops._cuda.<name>``, kernel builders under
    ``csrc_tl``), and its self-check cases. Its ops are those its contract module declares; its GPU module defines,
    by name, each op's implementation and ``SOURCE_OPS`` (the ops with kernels of their own),
    ``source_keys(op, KernelSpec)``, ``warmup_keys_of(WarmupSpec)`` and ``bench_cases()``."""

    name: str
    check_cases: Callable[[bool], list]  # (on_cpu) -> the self-check's cases (``sparse_dsa_ops.ops.samples.Case``)

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(name for name, op in OPS.items() if op.family == self.name)

    def gpu(self):
        """The family's GPU module (importing it loads TileLang)."""
        return importlib.import_module(f"{__package__.rpartition('.')[0]}._cuda.{self.name}")


def _declare(schema: str, check: Callable[..., object]) -> Callable:
    """Define ``dsa.<name>`` with ``schema``; the decorated ``_fake_<name>(checked, *args)`` is its fake kernel,
    called with the checker's result first."""

    def wrap(fake: Callable) -> Callable:
        name = fake.__name__.removeprefix("_fake_")
        _LIB.define(name + schema)

        def fake_kernel(*args, **kwargs):
            return fake(check(*args, **kwargs), *args, **kwargs)

        torch.library.register_fake(f"{NAMESPACE}::{name}", fake_kernel, lib=_LIB)
        OPS[name] = OpDef(name, schema, check, fake.__module__.rpartition(".")[2])
        return fake

    return wrap


def takes_checked(impl: Callable) -> Callable:
    """Mark a backend implementation that wants the checker's result as its first argument."""
    impl.takes_checked = True
    return impl


def register_backend(device_type: str, package: str) -> None:
    """Attach, for ``device_type``, each declared op's implementation: the function of the op's name in the module
    of its family in ``package`` (``<package>.<family>``), imported on the op's first call on that device (the GPU
    backend imports TileLang, which a process that never runs an op there need not load).

    Each runs after the shared checker; a backend never checks arguments itself. A function marked with
    :func:`takes_checked` receives the checker's result (e.g. ``AttnArgs``) before the op's arguments. An op whose
    family module lacks it raises ``NotImplementedError`` when called.
    """
    key = device_type.upper() if device_type in ("cpu", "cuda") else device_type
    for name, op in OPS.items():
        load = functools.partial(_import_impl, f"{package}.{op.family}", name, device_type)
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


def _selection_width(op: str, name: str, k: object, out_width: object) -> int:
    """The output width of a selection of ``k`` (the argument ``name``) entries a row, checked."""
    if not isinstance(k, int) or not 1 <= k <= MAX_TOPK:
        _fail(op, name, f"an int in [1, {MAX_TOPK}]", k, TypeError if not isinstance(k, int) else ValueError)
    if out_width is not None and (not isinstance(out_width, int) or out_width < k):
        _fail(op, "out_width", f"None or an int >= {name} = {k}", out_width)
    return out_width or k
