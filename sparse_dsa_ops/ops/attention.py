"""Sparse attention's ops (family ``attention``): ``sparse_attn``, ``sparse_attn_with_max_logits`` and
``attn_max_logits``. Schemas, argument checks, fake kernels and the public functions.

Letters: T query tokens, H heads, K top-k entries per token, S slots in the pool (pages x page size),
d_qk = d_nope + d_rope the query/key width, d_v the value width. The exact definitions are ``reference.<op>``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..layout import QUANT_TILE, KCacheLayout
from .core import (
    _FP8,
    _PACKED_DTYPES,
    Family,
    PoolView,
    _declare,
    _fail,
    _pool,
    _tensor,
    _vector,
)
from .samples import CHECK_GEOMETRIES, Case, case, k_pool, sm_count

__all__ = [
    "TOPK_MULTIPLE",
    "MAX_HEADS",
    "D_V_MULTIPLE",
    "D_ROPE_MULTIPLE",
    "AttnArgs",
    "check_sparse_attn",
    "check_attn_max_logits",
    "sparse_attn",
    "sparse_attn_with_max_logits",
    "attn_max_logits",
]

TOPK_MULTIPLE = 64  # sparse_attn's top-k widths are padded to this multiple (pad with -1)
# sparse_attn's geometry limits, the GPU kernels' (a head block fills at most 128 MMA rows; V is read in 64-wide
# tiles; the RoPE tail in 16-wide MMA steps), checked for every backend so code that runs on a CPU runs on a GPU
MAX_HEADS = 128
D_V_MULTIPLE = 64
D_ROPE_MULTIPLE = 16


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


def check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None, empty_lse=None) -> AttnArgs:
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
    if empty_lse is not None and (not isinstance(empty_lse, float) or math.isnan(empty_lse)):
        _fail(op, "empty_lse", "a float (not NaN) or None", empty_lse, TypeError)
    return AttnArgs(kind, d_qk, d_v, topk, layout, view, q.dtype == _FP8)


def check_attn_max_logits(q, kv, indices, sm_scale, d_v, topk_length=None) -> AttnArgs:
    return check_sparse_attn(q, kv, indices, sm_scale, d_v, topk_length)


@_declare(
    "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None, "
    "Tensor? attn_sink=None, float? empty_lse=None) -> (Tensor, Tensor)",
    check_sparse_attn,
)
def _fake_sparse_attn(args, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None, empty_lse=None):
    out = q.new_empty((q.shape[0], q.shape[1], d_v), dtype=torch.bfloat16)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


@_declare(
    "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? topk_length=None, "
    "Tensor? attn_sink=None, float? empty_lse=None) -> (Tensor, Tensor, Tensor)",
    check_sparse_attn,
)
def _fake_sparse_attn_with_max_logits(
    args, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None, empty_lse=None
):
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
    empty_lse: float | None = None,
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
    empty_lse : float or None
        The ``lse`` of a token with no valid entry: ``-inf`` when None; FlashMLA's convention is ``+inf``. A split
        decode writes it in its combine, so it costs no extra pass there.

    Returns
    -------
    out : [T, H, d_v] bfloat16
        ``softmax_j(sm_scale * q[t, h] . kv[idx[t, j]]) @ kv[idx[t, j], :d_v]`` over valid j.
    lse : [T, H] float32
        Natural-log log-sum-exp of the scaled scores over valid j.

    A token with no valid entry gets ``out = 0`` and ``lse = empty_lse`` (``-inf`` by default), never NaN. Exact
    definition: ``reference.sparse_attn``.
    """
    return torch.ops.dsa.sparse_attn(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, empty_lse)


def sparse_attn_with_max_logits(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    empty_lse: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_attn` (same arguments) that also returns each row's largest scaled score, as FlashMLA's prefill
    does: ``(out [T, H, d_v] bf16, lse [T, H] fp32, max_logits [T, H] fp32)``.

    ``max_logits[t, h] = max_j sm_scale * q[t, h] . kv[idx[t, j]]`` over valid j (the sink left out), ``-inf`` for a
    token with no valid entry. On a GPU the prefill kernels keep the exact row max beside the running one and write
    it; tokens that take the split decode path get it from :func:`attn_max_logits`. Exact definition:
    ``reference.sparse_attn_with_max_logits``.
    """
    return torch.ops.dsa.sparse_attn_with_max_logits(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, empty_lse)


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
# Self-check cases (``python -m sparse_dsa_ops check``).

# The kv kinds of sparse_attn's cases at each geometry, over the check's tokens (the prefill path on a GPU) and over
# DECODE_TOKENS (the split decode path): packed rows, the serving cache, at both geometries and in both paths, bf16
# and native FP8 rows in DeepSeek's prefill. Not every kind at every geometry and path: each attention kernel takes
# seconds to lower, one after another, before the first case.
PREFILL_KV = {"512+64 DeepSeek-V3.2": ("bf16", "fp8"), "512+0 GLM-5.3-Flash": ("packed",)}
DECODE_KV = {"512+64 DeepSeek-V3.2": ("packed",), "512+0 GLM-5.3-Flash": ("packed",)}
DECODE_TOKENS = 2


def _attn_keys(kind: str, lay: KCacheLayout, heads: int, tokens: int, topk: int, device, max_logits=False) -> list:
    """The kernels of sparse_attn's launch plan (with ``max_logits``: sparse_attn_with_max_logits's) for the inputs
    of :func:`_attn_inputs` on ``device``."""
    from .._cuda import attention, k_cache

    scale, q_fp8 = lay.d_qk**-0.5, kind == "fp8"
    plan = attention.plan_attn(
        kind, lay.d_nope, lay.d_rope, heads, scale, False, q_fp8, tokens, topk, sm_count(device), max_logits=max_logits
    )
    # the split path's tokens get their maxima from attn_max_logits, which gathers packed rows with a kernel
    gather = max_logits and plan.split and kind == "packed"
    return list(plan.keys) + (k_cache.cache_keys("gather_dequant_k_cache", lay) if gather else [])


def _attn_inputs(gen, kind: str, lay: KCacheLayout, heads: int, tokens: int, topk: int, slots: int) -> tuple:
    from .. import reference

    q = torch.randn(tokens, heads, lay.d_qk, generator=gen).bfloat16()
    kv = k_pool(gen, lay, slots)
    if kind == "bf16":
        kv = reference.dequant_k_cache(kv)
    elif kind == "fp8":  # native FP8: float8 q over float8 rows
        q, kv = q.to(torch.float8_e4m3fn), reference.dequant_k_cache(kv).to(torch.float8_e4m3fn)
    idx = torch.randint(-1, slots, (tokens, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx, lay.d_qk**-0.5, lay.d_nope, None


def _geometry_cases(geo: str, tokens: int, topk: int, slots: int) -> list[Case]:
    """sparse_attn at ``geo`` (PREFILL_KV, DECODE_KV), then attn_max_logits and sparse_attn_with_max_logits's maxima
    over the decode's packed inputs. Those two add no kernel: the gather of packed rows (the cache cases') and the
    decode's kernels; sparse_attn_with_max_logits's prefill kernel (the ``sink_max`` variant) would be one more
    attention kernel to lower."""
    d_nope, d_rope, heads = CHECK_GEOMETRIES[geo]
    lay = KCacheLayout(d_nope, d_rope)

    def make(kind, t_count, n_args=6):
        return lambda g: _attn_inputs(g, kind, lay, heads, t_count, topk, slots)[:n_args]

    def attn(kind, t_count):
        name = f"sparse_attn {kind}" if t_count == tokens else f"sparse_attn T{t_count} {kind}"
        keys = functools.partial(_attn_keys, kind, lay, heads, t_count, topk)
        return case("sparse_attn", geo, make(kind, t_count), keys, exact=False, name=name)

    def gather(device):
        from .._cuda import k_cache

        return k_cache.cache_keys("gather_dequant_k_cache", lay)

    cases = [attn(kind, tokens) for kind in PREFILL_KV[geo]] + [attn(kind, DECODE_TOKENS) for kind in DECODE_KV[geo]]
    decode = make("packed", DECODE_TOKENS)
    with_max = functools.partial(_attn_keys, "packed", lay, heads, DECODE_TOKENS, topk, max_logits=True)
    return cases + [
        case("attn_max_logits", geo, make("packed", DECODE_TOKENS, 5), gather, exact=False),
        case("sparse_attn_with_max_logits", geo, decode, with_max, exact=False, output=2),
    ]


def check_cases(on_cpu: bool) -> list[Case]:
    """On a GPU, 256 tokens take the attention prefill path at both geometries, 2 tokens the split decode path."""
    tokens, slots = (4, 16384) if on_cpu else (256, 65536)
    return [c for geo in CHECK_GEOMETRIES for c in _geometry_cases(geo, tokens, 2048, slots)]


FAMILY = Family("attention", check_cases)
