"""The reference of the indexer family's ops."""

from __future__ import annotations

import torch

from ..layout import FP8_MAX
from .selection import topk as _select_topk  # (index_topk's argument ``topk`` hides the function)

__all__ = [
    "index_cache_slots",
    "quant_index",
    "store_index_k",
    "gather_index_k",
    "index_logits",
    "paged_index_logits",
    "index_topk",
    "INDEX_SCALE_MIN",
    "INDEX_SCALE_BYTES",
    "INDEX_HEAD_DIM",
]

# The same bound for one chunk of the indexer's logits (keys and per-head scores) and of top-k (keys and sort).
_INDEX_CHUNK_BYTES = 96 << 20
# The float32 logits of the query tokens index_topk selects from at once (beside the two bounds above).
_INDEX_TOPK_CHUNK_BYTES = 64 << 20

INDEX_SCALE_MIN = 1e-4  # floor of an indexer row's amax: an all-zero row gets scale 1e-4 / 448, never 0
INDEX_SCALE_BYTES = 4  # one float32 scale per index-K token
INDEX_HEAD_DIM = 128  # D of a 2-d index-K cache when not given (every known model's)


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= scale`` (positive float32), exactly: scale = m * 2^e with m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def index_cache_slots(cache: torch.Tensor, head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot byte views of a paged index-K cache -> ``(values [P, page, D] uint8, scales [P, page, 4] uint8)``.

    ``cache`` is ``[P, page * (D + 4)]`` (``head_dim`` = D, 128 when None) or its views ``[P, page, D + 4]`` /
    ``[P, page, 1, D + 4]``, contiguous. Page p holds its ``page * D`` FP8 bytes token-major, then ``page``
    little-endian float32 scales. Both results are views: writing them writes the cache.
    """
    pages = cache.shape[0]
    if cache.dim() > 2:
        page, dim = cache.shape[1], cache.shape[-1] - INDEX_SCALE_BYTES
    else:
        dim = INDEX_HEAD_DIM if head_dim is None else head_dim
        page = cache.shape[1] // (dim + INDEX_SCALE_BYTES)
    flat = cache.view(pages, page * (dim + INDEX_SCALE_BYTES))  # [P, page * (D + 4)], a view of the pages
    values = flat[:, : page * dim].unflatten(1, (page, dim))  # [P, page, D]
    scales = flat[:, page * dim :].unflatten(1, (page, INDEX_SCALE_BYTES))  # [P, page, 4]
    return values, scales


def quant_index(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` bf16 -> ``(values [..., D] float8_e4m3fn, scale [...] float32)``, one scale per row.

    ``scale = max(amax(|row|), 1e-4) / 448`` (rounded up to a power of two with ``round_scale``) and
    ``values = saturate_to_±448(x / scale)``, the float32 quotient rounded to nearest even.
    """
    xf = x.float()  # [..., D], exact
    scale = xf.abs().amax(dim=-1).clamp_min(INDEX_SCALE_MIN) / FP8_MAX  # [...], IEEE float32 division
    if round_scale:
        scale = _pow2_ceil(scale)
    values = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [..., D], RNE
    return values, scale


def store_index_k(k: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, round_scale: bool = False) -> None:
    """Quantize ``k [N, D]`` bf16 and write row i into slot ``loc[i]`` of the index-K cache; invalid slots skipped.

    Slot ``p * page + o`` takes the D FP8 bytes at byte ``o * D`` of page p and the scale at byte
    ``page * D + 4 * o``; no other byte of the cache changes.
    """
    values, scales = index_cache_slots(cache, k.shape[1])  # [P, page, D], [P, page, 4], views of cache
    page = values.shape[1]
    loc = loc.long()
    valid = (loc >= 0) & (loc < values.shape[0] * page)  # [N]
    rows, scale = quant_index(k[valid], round_scale)  # [n, D] float8, [n] float32
    slot = loc[valid]  # [n]
    values[slot // page, slot % page] = rows.view(torch.uint8)
    scales[slot // page, slot % page] = scale.view(torch.uint8).reshape(-1, INDEX_SCALE_BYTES)  # little-endian


def gather_index_k(
    cache: torch.Tensor, indices: torch.Tensor, head_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 keys and scales of the slots ``indices [M]`` -> ``(values [M, D] float8_e4m3fn, scale [M] float32)``.

    Ids outside ``[0, P * page)`` give zero values and scale 0; they are clamped before the gather, so
    nothing outside the cache is read.
    """
    values, scales = index_cache_slots(cache, head_dim)  # [P, page, D], [P, page, 4]
    pages, page, dim = values.shape
    ids = indices.long()  # [M]
    out = torch.zeros(ids.shape[0], dim, dtype=torch.uint8, device=cache.device)  # [M, D]
    out_scale = torch.zeros(ids.shape[0], dtype=torch.float32, device=cache.device)  # [M]
    if pages == 0 or ids.shape[0] == 0:
        return out.view(torch.float8_e4m3fn), out_scale
    valid = (ids >= 0) & (ids < pages * page)  # [M]
    safe = torch.where(valid, ids, 0)  # [M], inside the cache
    rows = values[safe // page, safe % page]  # [M, D] uint8
    scale_bytes = scales[safe // page, safe % page]  # [M, 4] uint8
    out = torch.where(valid.unsqueeze(-1), rows, out)  # [M, D]
    scale_bytes = torch.where(valid.unsqueeze(-1), scale_bytes, 0)  # [M, 4]
    return out.view(torch.float8_e4m3fn), scale_bytes.view(torch.float32).reshape(-1)


def _weighted_relu(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_h weights[..., h] * relu(scores[..., h, j])``: ``[..., Hi, W]`` and ``[..., Hi]`` -> ``[..., W]``."""
    return torch.einsum("...hw,...h->...w", scores.relu_(), weights)


def _index_chunks(heads: int, dim: int, num_keys: int) -> tuple[int, int]:
    """The keys and the query tokens of one chunk of :func:`index_logits`."""
    key_chunk = min(num_keys, max(1, _INDEX_CHUNK_BYTES // (4 * (dim + heads))))  # float32 keys, one token's scores
    token_chunk = max(1, _INDEX_CHUNK_BYTES // (4 * heads * (key_chunk + dim)))  # float32 scores and queries
    return key_chunk, token_chunk


def index_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits ``[T, N]`` float32 of ``q [T, Hi, D]`` against the FP8 keys ``k [N, D]``.

    ``logits[t, j] = k_scale[j] * sum_h weights[t, h] * relu(q[t, h] . k[j])`` (float32 dot of the
    fp8/bf16 values) for ``max(ks[t], 0) <= j < min(ke[t], N)``, ``-inf`` elsewhere. Keys are processed
    in chunks, so memory stays bounded at any N.
    """
    t_count, heads, dim = q.shape
    num_keys = k.shape[0]
    out = torch.full((t_count, num_keys), float("-inf"), dtype=torch.float32, device=q.device)  # [T, N]
    if t_count == 0 or num_keys == 0:
        return out
    key_chunk, token_chunk = _index_chunks(heads, dim, num_keys)
    begin, end = ks.long().unsqueeze(-1), ke.long().unsqueeze(-1)  # [T, 1]
    for j0 in range(0, num_keys, key_chunk):
        j1 = min(j0 + key_chunk, num_keys)
        keys = k[j0:j1].float()  # [n, D], exact
        column = torch.arange(j0, j1, device=q.device)  # [n]
        for t0 in range(0, t_count, token_chunk):
            t1 = min(t0 + token_chunk, t_count)
            scores = torch.einsum("thd,nd->thn", q[t0:t1].float(), keys)  # [t, Hi, n]
            logits = _weighted_relu(scores, weights[t0:t1]) * k_scale[j0:j1]  # [t, n]
            inside = (column >= begin[t0:t1]) & (column < end[t0:t1])  # [t, n]
            out[t0:t1, j0:j1] = torch.where(inside, logits, float("-inf"))
    return out


def paged_index_logits(
    q: torch.Tensor,
    cache: torch.Tensor,
    weights: torch.Tensor,
    lengths: torch.Tensor,
    page_table: torch.Tensor,
) -> torch.Tensor:
    """The indexer's logits ``[R, max_pages * page]`` float32 of ``q [B, n, Hi, D]`` over each request's pages.

    Row ``r = b * n + i`` sees positions ``0 <= p < lengths[r]``; position p is slot
    ``page_table[b, p // page] * page + p % page`` of the index-K cache and scores as in
    :func:`index_logits`. Past a row's length, and where the page-table entry is outside ``[0, P)``, the logit
    is ``-inf``; such entries are clamped before the gather, so no page outside the cache is read.
    """
    b_count, n_rows, heads, dim = q.shape
    values, scales = index_cache_slots(cache, dim)  # [P, page, D], [P, page, 4]
    pages, page = values.shape[0], values.shape[1]
    max_pages = page_table.shape[1]
    width = max_pages * page
    out = torch.full((b_count * n_rows, width), float("-inf"), dtype=torch.float32, device=q.device)  # [R, W]
    if out.numel() == 0 or pages == 0:
        return out
    out_rows = out.view(b_count, n_rows, width)  # [B, n, W]
    w = weights.reshape(b_count, n_rows, heads)  # [B, n, Hi]
    limit = lengths.long().reshape(b_count, n_rows, 1)  # [B, n, 1]
    cost = 4 * page * (dim + n_rows * heads)  # float32 keys and scores of one page of one request
    page_chunk = min(max_pages, max(1, _INDEX_CHUNK_BYTES // cost))
    request_chunk = max(1, _INDEX_CHUNK_BYTES // (cost * page_chunk + 4 * n_rows * heads * dim))  # + float32 queries
    offset = torch.arange(page, device=q.device)  # [page]
    for b0 in range(0, b_count, request_chunk):
        b1 = min(b0 + request_chunk, b_count)
        qf = q[b0:b1].float()  # [b, n, Hi, D]
        for p0 in range(0, max_pages, page_chunk):
            p1 = min(p0 + page_chunk, max_pages)
            entry = page_table[b0:b1, p0:p1].long()  # [b, pc]
            page_ok = (entry >= 0) & (entry < pages)  # [b, pc]
            safe = torch.where(page_ok, entry, 0).unsqueeze(-1)  # [b, pc, 1], inside the cache
            keys = values[safe, offset].view(torch.float8_e4m3fn).float().flatten(1, 2)  # [b, w, D]
            k_scale = scales[safe, offset].view(torch.float32).flatten(1)  # [b, w]
            scores = torch.einsum("bihd,bwd->bihw", qf, keys)  # [b, n, Hi, w]
            logits = _weighted_relu(scores, w[b0:b1]) * k_scale.unsqueeze(1)  # [b, n, w]
            position = torch.arange(p0 * page, p1 * page, device=q.device)  # [w]
            valid = page_ok.repeat_interleave(page, dim=1).unsqueeze(1) & (position < limit[b0:b1])  # [b, n, w]
            out_rows[b0:b1, :, p0 * page : p1 * page] = torch.where(valid, logits, float("-inf"))
    return out


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
    """The ``topk`` best keys of each query token -> ``[T, out_width or topk]`` int32: by definition
    ``topk(index_logits(q, k, k_scale, weights, ks, ke), ke - ks, topk, starts=ks, out_width=out_width)``.

    The tokens run in chunks of whole chunks of :func:`index_logits` (so every logit comes from the same
    computation as in the composition, bit for bit), as many as keep a chunk's logits within
    ``_INDEX_TOPK_CHUNK_BYTES``: the ``[T, N]`` logits are never held at once.
    """
    t_count, heads, dim = q.shape
    num_keys = k.shape[0]
    out = torch.full((t_count, topk if out_width is None else out_width), -1, dtype=torch.int32, device=q.device)
    if t_count == 0 or num_keys == 0:
        return out  # [T, W'], no candidates
    lengths = ke - ks  # [T] int32, as the composition computes it
    unit = _index_chunks(heads, dim, num_keys)[1]
    chunk = unit * max(1, _INDEX_TOPK_CHUNK_BYTES // (4 * num_keys * unit))
    for t0 in range(0, t_count, chunk):
        t1 = min(t0 + chunk, t_count)
        logits = index_logits(q[t0:t1], k, k_scale, weights[t0:t1], ks[t0:t1], ke[t0:t1])  # [t, N]
        out[t0:t1] = _select_topk(logits, lengths[t0:t1], topk, ks[t0:t1], out_width=out_width)  # [t, W']
    return out
