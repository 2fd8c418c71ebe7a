"""The reference of the attention family's ops."""

from __future__ import annotations

import torch

from .k_cache import dequant_k_cache, flatten_pool

__all__ = [
    "sparse_attn",
    "sparse_attn_with_max_logits",
    "attn_max_logits",
]

# Bound on the float32 scratch of one sparse_attn chunk, so that a CPU call at DeepSeek geometry
# (T 64, H 128, top-k 2048) stays within a few hundred MB.
_ATTN_CHUNK_BYTES = 96 << 20


def _kv_rows(kv: torch.Tensor, ids: torch.Tensor, d_v: int, d_qk: int) -> torch.Tensor:
    """Selected rows of the pool as float32 ``[t, K, d_qk]`` for slot ids ``[t, K]`` already clamped in range."""
    pool = flatten_pool(kv)  # [S, D] or [S, B]
    rows = pool[ids.reshape(-1)]  # [t * K, D]
    if kv.dtype != torch.bfloat16 and pool.shape[1] != d_qk:  # packed rows (of any 1-byte dtype) are wider
        rows = dequant_k_cache(rows)  # same values as the packed-cache contract: bf16 rows
    return rows.float().reshape(*ids.shape, d_qk)


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
    """Sparse attention of ``q [T, H, d_qk]`` over the rows ``indices [T, K]`` of ``kv``.

    Returns ``out [T, H, d_v]`` bf16 and the natural-log ``lse [T, H]`` float32. Entries outside
    ``[0, S)`` or at positions ``>= topk_length[t]`` count for nothing and their rows are not used;
    a token with no valid entry gets ``out = 0`` and ``lse = empty_lse`` (``-inf`` when None). A pool of packed
    rows (uint8, int8 or float8_e4m3fn, wider than d_qk) is read as ``dequant_k_cache(kv)``; a float8_e4m3fn pool of
    width d_qk is used as its raw values. ``attn_sink [H]`` joins each row's denominator: ``out`` is the
    softmax-weighted sum times ``1 / (1 + exp(attn_sink[h] - lse))``, and ``lse`` leaves the sink out.
    """
    t_count, heads, d_qk = q.shape
    indices = indices.reshape(t_count, indices.shape[-1])  # [T, K]
    topk = indices.shape[1]
    num_slots = flatten_pool(kv).shape[0]
    out = torch.zeros(t_count, heads, d_v, dtype=torch.bfloat16, device=q.device)  # [T, H, d_v]
    empty = float("-inf") if empty_lse is None else empty_lse
    lse = torch.full((t_count, heads), empty, dtype=torch.float32, device=q.device)  # [T, H]
    if t_count == 0 or topk == 0 or num_slots == 0:
        return out, lse

    per_token = 4 * topk * (d_qk + 3 * heads)  # float32 rows, scores and probabilities of one token
    chunk = max(1, _ATTN_CHUNK_BYTES // per_token)
    position = torch.arange(topk, device=q.device)  # [K]
    for start in range(0, t_count, chunk):
        stop = min(start + chunk, t_count)
        ids = indices[start:stop].long()  # [t, K]
        valid = (ids >= 0) & (ids < num_slots)  # [t, K]
        if topk_length is not None:
            valid &= position < topk_length[start:stop, None].long()
        rows = _kv_rows(kv, torch.where(valid, ids, 0), d_v, d_qk)  # [t, K, d_qk]
        rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # rows of invalid entries are never used
        scores = torch.einsum("thd,tkd->thk", q[start:stop].float(), rows) * sm_scale  # [t, H, K]
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))  # [t, H, K]
        row_max = scores.amax(dim=-1, keepdim=True)  # [t, H, 1]
        row_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # empty rows: exp(-inf - 0) = 0
        probs = torch.exp(scores - row_max)  # [t, H, K]
        total = probs.sum(dim=-1, keepdim=True)  # [t, H, 1]
        acc = torch.einsum("thk,tkd->thd", probs, rows[..., :d_v])  # [t, H, d_v]
        if attn_sink is not None:  # exp(sink) joins the denominator: sum + exp(sink) = total + exp(sink - row_max)
            total_out = total + torch.exp(attn_sink.float()[None, :, None] - row_max)  # [t, H, 1]
            total_out = torch.where(total == 0, 1.0, total_out)  # empty rows keep out = 0
        else:
            total_out = torch.where(total == 0, 1.0, total)
        out[start:stop] = (acc / total_out).to(torch.bfloat16)
        lse[start:stop] = torch.where(total == 0, empty, row_max + torch.log(total)).squeeze(-1)  # [t, H]
    return out, lse


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
    """:func:`sparse_attn`'s ``(out, lse)`` and :func:`attn_max_logits`'s ``max_logits [T, H]`` of the same call."""
    out, lse = sparse_attn(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, empty_lse)
    return out, lse, attn_max_logits(q, kv, indices, sm_scale, d_v, topk_length)


def attn_max_logits(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest valid scaled score ``max_j sm_scale * q[t, h] . kv[idx[t, j]]`` -> ``[T, H]`` float32; ``-inf`` for
    a token with no valid entry. Validity and pools as in :func:`sparse_attn`."""
    t_count, heads, d_qk = q.shape
    indices = indices.reshape(t_count, indices.shape[-1])  # [T, K]
    topk = indices.shape[1]
    num_slots = flatten_pool(kv).shape[0]
    best = torch.full((t_count, heads), float("-inf"), dtype=torch.float32, device=q.device)  # [T, H]
    if t_count == 0 or topk == 0 or num_slots == 0:
        return best
    chunk = max(1, _ATTN_CHUNK_BYTES // (4 * topk * (d_qk + heads)))
    position = torch.arange(topk, device=q.device)  # [K]
    for start in range(0, t_count, chunk):
        stop = min(start + chunk, t_count)
        ids = indices[start:stop].long()  # [t, K]
        valid = (ids >= 0) & (ids < num_slots)  # [t, K]
        if topk_length is not None:
            valid &= position < topk_length[start:stop, None].long()
        rows = _kv_rows(kv, torch.where(valid, ids, 0), d_v, d_qk)  # [t, K, d_qk]
        scores = torch.einsum("thd,tkd->thk", q[start:stop].float(), rows) * sm_scale  # [t, H, K]
        best[start:stop] = scores.masked_fill(~valid.unsqueeze(1), float("-inf")).amax(dim=-1)  # [t, H]
    return best
