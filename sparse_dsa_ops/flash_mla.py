"""FlashMLA's sparse entry points over the ``dsa`` ops: a serving stack switches by changing one import.

::

    import sparse_dsa_ops.flash_mla as flash_mla  # instead of: import flash_mla

The functions keep the names, arguments, defaults, shapes and return layouts of FlashMLA's last API that runs on
Hopper (the one with the schedule object, attention sinks and ``topk_length``):

- :func:`flash_mla_sparse_fwd`: sparse prefill over a bfloat16 KV, returning ``(out, max_logits, lse)``;
- :func:`get_mla_metadata`: the decode schedule, here a placeholder that nothing reads;
- :func:`flash_mla_with_kvcache`: sparse decode over a paged pool of packed FP8 rows, returning ``(out, lse)``.

Conventions of the results (those of FlashMLA's ``tests/ref.py``):

- ``lse`` is the natural-log log-sum-exp of the scaled scores ``sm_scale * q . k`` over the valid entries, without
  the sink. (FlashMLA's first Hopper release of ``flash_mla_sparse_fwd`` returned ``lse`` and ``max_logits`` in
  base 2, on scores premultiplied by log2 e; the later API followed here, and this module, use base e.)
- ``max_logits`` is the largest scaled score over the valid entries, base e.
- A row with no valid entry ("lonely": every index invalid, or ``topk_length`` 0) gets ``out = 0``,
  ``lse = +inf`` and ``max_logits = -inf``.
- ``attn_sink [h_q]`` multiplies ``out`` by ``exp(lse) / (exp(lse) + exp(attn_sink))``; ``-inf`` has no effect,
  ``+inf`` zeroes the head's output; ``lse`` and ``max_logits`` leave it out.

Beyond FlashMLA:

- any head count from 1 to 128 (FlashMLA: 64 or 128), any top-k width (padded inside with -1 to the ops' multiple
  of 64; FlashMLA's Hopper prefill needs a multiple of 128), a value width ``d_v`` of any multiple of 64;
- every packed row geometry (``KCacheLayout``: d_nope any multiple of 128, d_rope 0 or a multiple of 16), not only
  512 + 64;
  pools of dtype float8_e4m3fn, int8 or uint8;
- every pool (``kv``, ``k_cache``) may have its rows and its pages any distance apart, independently, that is a
  whole number of rows or a multiple of 16 bytes: a per-layer view into a bigger buffer, or a slice of wider rows
  as FlashMLA's own prefill test passes (``[s_kv, 1, d_qk]`` rows ``2 * (d_qk + 128)`` elements apart). The shim
  never copies a pool; the ops read one whose strides are whole rows in place, and on a GPU read any other through
  a compact copy made per call (the kernels take no row stride of their own);
- ``q``, ``indices`` and the other tensors may be any strided views whose last dim is contiguous;
- every index outside ``[0, pool size)`` is invalid, not only -1: any negative, ``>= s_kv``, INT_MIN, INT_MAX; such
  entries, and entries past ``topk_length``, are never read, so NaN in rows nobody selects never reaches a result;
- the prefill also takes the pools :func:`sparse_dsa_ops.sparse_attn` takes (FP8 values, packed FP8 rows).

Not supported (``NotImplementedError`` naming the argument): dense decoding (``indices=None``), a second KV segment
(``extra_k_cache``, ``extra_indices_in_kvcache``, ``extra_topk_length``), ``causal=True`` (FlashMLA rejects it in
sparse mode too), a bfloat16 pool in :func:`flash_mla_with_kvcache` (``is_fp8_kvcache=False``; FlashMLA's sparse
decode is FP8 only), FlashMLA's own 512-wide FP8 row (448 FP8 values, 64 bfloat16, ue8m0 scales per 64 values,
page-major; store such models' rows as ``KCacheLayout(512, 0)`` instead), and several KV heads (``h_kv > 1``).
FlashMLA's dense prefill and backward (``flash_attn_varlen_*``) are not offered.

Letters used in shapes: b requests, s_q query tokens (per request in decode), h_q query heads, s_kv KV rows,
d_qk = d_nope + d_rope the query/key width, d_v the value width, topk selected entries per token, num_blocks pages
of ``page_block_size`` rows, row_bytes the packed row width (``KCacheLayout.row_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import ops

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]

INVALID_INDEX = -1  # what the shim pads a top-k row with
# FlashMLA's FP8 row for d_qk 512 ("MODEL1"): 448 FP8 values, 64 bfloat16, 7 ue8m0 scales and one pad byte
FLASHMLA_MODEL1_ROW_BYTES = 448 + 2 * 64 + 7 + 1
_PACKED_POOL_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)


@dataclass
class FlashMLASchedMeta:
    """The placeholder :func:`get_mla_metadata` returns, with the fields of FlashMLA's schedule object.

    The ops plan their own launches on every call (no host sync, nothing cached between calls), so this object is
    never read or written: one instance may serve every shape, and callers may keep reusing theirs.
    """

    have_initialized: bool = False
    config: Any = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[FlashMLASchedMeta, None]:
    """FlashMLA's decode schedule: ``(FlashMLASchedMeta(), None)``, every argument ignored.

    Takes whatever FlashMLA's versions took (``cache_seqlens, num_q_tokens_per_head_k, num_heads_k,
    num_heads_q=None, is_fp8_kvcache=False, topk=None`` or nothing at all) and does no device work: no tensor is
    read, allocated or synchronized. Pass the first element on as ``tile_scheduler_metadata`` and the second as
    ``num_splits``; :func:`flash_mla_with_kvcache` ignores both. Callers that copy the old API's metadata
    tensors into buffers of their own have no tensors to copy here.
    """
    return FlashMLASchedMeta(), None


def _unsupported(name: str, why: str) -> None:
    raise NotImplementedError(f"sparse_dsa_ops.flash_mla: {name} is not supported: {why}")


def _pad_topk(indices: torch.Tensor) -> torch.Tensor:
    """``indices [..., topk]`` padded with -1 to the ops' top-k multiple (itself when already a multiple)."""
    pad = -indices.shape[-1] % ops.TOPK_MULTIPLE
    return indices if pad == 0 else F.pad(indices, (0, pad), value=INVALID_INDEX)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention prefill: token t attends to the rows ``indices[t, 0, :]`` of ``kv``.

    Parameters
    ----------
    q : [s_q, h_q, d_qk] bfloat16
        Any head count 1-128.
    kv : [s_kv, 1, d_qk] bfloat16
        One latent KV head (also ``[s_kv, d_qk]``, or any pool :func:`sparse_dsa_ops.sparse_attn` takes).
        Rows may lie further apart than d_qk, by whole rows or by a multiple of 16 bytes (a slice of a wider
        buffer, as FlashMLA's tests pass it).
    indices : [s_q, 1, topk] int32
        Rows of kv, any width topk. Entries outside ``[0, s_kv)`` are invalid (never read).
    sm_scale : float
        Scale of ``q . k`` before the softmax.
    d_v : int
        Value width: V is the first d_v columns of each row.
    attn_sink : [h_q] float32 or None
        Multiplies ``out`` by ``exp(lse) / (exp(lse) + exp(attn_sink))``; no effect on ``lse`` or ``max_logits``.
    topk_length : [s_q] int32 or None
        Only the first ``topk_length[t]`` entries of row t count.

    Returns
    -------
    out : [s_q, h_q, d_v] bfloat16
        Softmax-weighted sum of the valid rows' first d_v columns (times the sink factor); 0 for a lonely row.
    max_logits : [s_q, h_q] float32
        ``max_j sm_scale * q . kv[j]`` over valid j; ``-inf`` for a lonely row.
    lse : [s_q, h_q] float32
        Natural-log log-sum-exp of the scaled scores over valid j; ``+inf`` for a lonely row.

    One call of :func:`sparse_dsa_ops.sparse_attn_with_max_logits`: the prefill kernels write ``max_logits`` beside
    ``out`` (warm them up with ``sparse_dsa_ops.warmup(..., attn_sink=(False, True))``).
    """
    if isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[1] != 1:
        _unsupported("kv", f"one KV head (h_kv = 1) only, got kv of shape {list(kv.shape)}")
    scale = float(sm_scale)
    idx = _pad_topk(indices)
    out, lse, max_logits = ops.sparse_attn_with_max_logits(q, kv, idx, scale, d_v, topk_length, attn_sink, math.inf)
    return out, max_logits, lse


def _check_decode_mode(
    indices, causal, is_fp8_kvcache, extra_k_cache, extra_indices_in_kvcache, extra_topk_length
) -> None:
    """Raise for the FlashMLA modes this module does not implement, naming the argument."""
    if indices is None:
        _unsupported("indices=None", "dense decoding; only sparse attention (indices given) is implemented")
    for name, value in (
        ("extra_k_cache", extra_k_cache),
        ("extra_indices_in_kvcache", extra_indices_in_kvcache),
        ("extra_topk_length", extra_topk_length),
    ):
        if value is not None:
            _unsupported(name, "one KV segment per call; a second segment (extra_*) is not implemented")
    if causal:
        _unsupported("causal=True", "sparse attention has no causal mask (the indices decide what is attended)")
    if not is_fp8_kvcache:
        _unsupported(
            "is_fp8_kvcache=False",
            "sparse decoding reads packed FP8 rows (as FlashMLA's does); call "
            "sparse_dsa_ops.sparse_attn for a bfloat16 pool",
        )


def _packed_pool(k_cache: torch.Tensor, d_qk: int, head_dim_v: int) -> torch.Tensor:
    """The pool as a uint8 view of the same memory (same shape and strides: never a copy)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dtype not in _PACKED_POOL_DTYPES:
        got = k_cache.dtype if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise TypeError(
            f"sparse_dsa_ops.flash_mla: k_cache must hold packed FP8 rows as float8_e4m3fn, int8 or uint8, got {got}"
        )
    if d_qk == 512 and head_dim_v == 512 and k_cache.shape[-1] == FLASHMLA_MODEL1_ROW_BYTES:
        _unsupported(
            "k_cache",
            f"FlashMLA's {FLASHMLA_MODEL1_ROW_BYTES}-byte row for d_qk 512 (448 FP8 + 64 "
            "bfloat16, ue8m0 scales, page-major) is a different format; store rows as KCacheLayout(512, 0)",
        )
    return k_cache.view(torch.uint8)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: Any,
    num_splits: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decoding over a paged pool of packed FP8 rows (FlashMLA's sparse FP8 mode).

    Parameters
    ----------
    q : [b, s_q, h_q, d_qk] bfloat16
        Any head count 1-128.
    k_cache : [num_blocks, page_block_size, 1, row_bytes] float8_e4m3fn, int8 or uint8
        Packed FP8 rows ``KCacheLayout(head_dim_v, d_qk - head_dim_v)`` (656 bytes for DeepSeek's 512 + 64).
        Rows and pages may lie further apart, independently, by whole rows or multiples of 16 bytes (a per-layer
        view, a slice of wider rows). Never copied here.
    block_table, cache_seqlens : ignored
        The indices already name pool slots.
    head_dim_v : int
        d_v, the quantized width d_nope of the rows; d_qk - head_dim_v is the bfloat16 tail.
    tile_scheduler_metadata, num_splits : ignored
        Whatever :func:`get_mla_metadata` returned (or the old API's tensors).
    softmax_scale : float or None
        Scale of ``q . k``; None means ``d_qk ** -0.5``.
    causal : bool
        Must be False.
    is_fp8_kvcache : bool
        Must be True.
    indices : [b, s_q, topk] int32
        Pool slots ``block * page_block_size + offset``, any width topk. Entries outside
        ``[0, num_blocks * page_block_size)`` are invalid (never read).
    attn_sink : [h_q] float32 or None
        Multiplies ``out`` by ``exp(lse) / (exp(lse) + exp(attn_sink))``; no effect on ``lse``.
    extra_k_cache, extra_indices_in_kvcache, extra_topk_length : must be None
    topk_length : [b] int32 or None
        Only the first ``topk_length[i]`` entries of request i's rows count (for each of its s_q tokens).

    Returns
    -------
    out : [b, s_q, h_q, head_dim_v] bfloat16
        0 for a lonely row (no valid entry).
    lse : [b, h_q, s_q] float32
        Natural-log log-sum-exp over the valid entries, without the sink; ``+inf`` for a lonely row. A transposed
        view of a contiguous ``[b, s_q, h_q]`` tensor, like FlashMLA's.
    """
    _check_decode_mode(indices, causal, is_fp8_kvcache, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(
            f"sparse_dsa_ops.flash_mla: q must be [b, s_q, h_q, d_qk], got "
            f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    b, s_q, h_q, d_qk = q.shape
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or tuple(indices.shape[:2]) != (b, s_q):
        raise ValueError(
            f"sparse_dsa_ops.flash_mla: indices must be [b, s_q, topk] with b, s_q = {b}, {s_q} like "
            f"q, got {list(indices.shape) if isinstance(indices, torch.Tensor) else indices!r}"
        )
    if topk_length is not None and (not isinstance(topk_length, torch.Tensor) or tuple(topk_length.shape) != (b,)):
        raise ValueError(
            f"sparse_dsa_ops.flash_mla: topk_length must be [b] = [{b}] (one length per request), got "
            f"{list(topk_length.shape) if isinstance(topk_length, torch.Tensor) else topk_length!r}"
        )
    pool = _packed_pool(k_cache, d_qk, head_dim_v)
    scale = d_qk**-0.5 if softmax_scale is None else float(softmax_scale)
    rows = b * s_q
    idx = _pad_topk(indices.reshape(rows, indices.shape[2]))
    # FlashMLA's lengths are per request; the op's are per token: each request's length for each of its tokens
    lengths = None if topk_length is None else topk_length.reshape(b, 1).expand(b, s_q).reshape(rows)
    out, lse = ops.sparse_attn(q.reshape(rows, h_q, d_qk), pool, idx, scale, head_dim_v, lengths, attn_sink, math.inf)
    return out.view(b, s_q, h_q, head_dim_v), lse.view(b, s_q, h_q).transpose(1, 2)


def bench_cases() -> list[dict]:
    """The face's cases of ``python -m sparse_dsa_ops bench``: the core op's DeepSeek cases called as FlashMLA's
    callers call them (its prefill for bf16 kv, its paged FP8 decode for packed kv)."""
    from ._cuda import attention

    d_nope, d_rope = 512, 64
    scale = (d_nope + d_rope) ** -0.5

    def run(kind: str):
        if kind == "packed":
            meta, splits = get_mla_metadata()
            return lambda q, k_cache, idx: flash_mla_with_kvcache(
                q, k_cache, None, None, d_nope, meta, splits, is_fp8_kvcache=True, indices=idx
            )
        return lambda q, kv, idx: flash_mla_sparse_fwd(q, kv, idx, scale, d_nope)

    return attention.variant_cases("flash_mla", run)
