"""Pure-Torch implementations of every ``dsa`` op: the CPU backend and the oracle of the tests.

Each function has its op's signature and trusts that ``ops.py`` has checked the arguments. They
gather the selected rows (no dense masks), accumulate in float32 and run on any device.

Letters used in shapes: N rows to quantize or store, M gathered slots, T query tokens, H heads,
K top-k entries per token, S slots in the pool (pages x page size), D row width, B packed row bytes; for the
indexer Hi its heads, R query rows of a paged batch, P pages of ``page`` tokens, W logit columns of a row.
"""

from __future__ import annotations

import torch

from .layout import FP8_MAX, QUANT_TILE, KCacheLayout

__all__ = [
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
    "kpool_store_index_k",
    "kpool_topk",
    "kpool_compress",
    "kpool_expand",
    "flatten_pool",
    "index_cache_slots",
]

# Bound on the float32 scratch of one sparse_attn chunk, so that a CPU call at DeepSeek geometry
# (T 64, H 128, top-k 2048) stays within a few hundred MB.
_ATTN_CHUNK_BYTES = 96 << 20
# The same bound for one chunk of the indexer's logits (keys and per-head scores) and of top-k (keys and sort).
_INDEX_CHUNK_BYTES = 96 << 20
_TOPK_CHUNK_BYTES = 96 << 20
_TOPK_BYTES_PER_COLUMN = 32  # key, candidate flag, sorted keys and their int64 columns of one logit
# The float32 logits of the query tokens index_topk selects from at once (beside the two bounds above).
_INDEX_TOPK_CHUNK_BYTES = 64 << 20

INDEX_SCALE_MIN = 1e-4  # floor of an indexer row's amax: an all-zero row gets scale 1e-4 / 448, never 0
INDEX_SCALE_BYTES = 4  # one float32 scale per index-K token
INDEX_HEAD_DIM = 128  # D of a 2-d index-K cache when not given (every known model's)
# Top-k order keys (int32, larger ranks first): finite and infinite logits map monotonically onto
# [-1 - 0x7F800000, 0x7F800000]; NaN ranks just below -inf, and a column that is no candidate below that.
_FLOAT_MAGNITUDE = 0x7FFFFFFF
_NAN_KEY = -1 - 0x7F800000 - 1
_NOT_A_CANDIDATE = _NAN_KEY - 1


def flatten_pool(pool: torch.Tensor) -> torch.Tensor:
    """View a flat ``[S, D]``, ``[S, 1, D]`` or paged ``[P, page, (1,) D]`` pool as ``[S, D]``.

    Slot ``page * page_size + offset`` of a paged pool is row ``page * page_size + offset`` here. A pool whose
    pages or rows lie further apart (any strides) comes back as a copy (for reading); :func:`store_k_cache` writes
    a pool with pages apart through its pages.
    """
    return pool.reshape(-1, pool.shape[-1])


def _scales(x: torch.Tensor, round_scale: bool) -> torch.Tensor:
    """Per-tile scales of ``x [N, n_tiles, 128]`` float32 -> ``[N, n_tiles]`` float32."""
    scale = x.abs().amax(dim=-1) / FP8_MAX  # [N, n_tiles], IEEE float32 division
    # An all-zero tile (or one so small that amax / 448 underflows) gets scale 1: no 0/0 anywhere.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if round_scale:
        # Round up to a power of two, exactly: scale = m * 2^e with m in [0.5, 1).
        mantissa, exponent = torch.frexp(scale)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        scale = torch.ldexp(torch.ones_like(scale), exponent)
    return scale


def quant_k_cache(k_nope: torch.Tensor, k_rope: torch.Tensor | None, round_scale: bool = False) -> torch.Tensor:
    """Quantize ``k_nope [N, d_nope]`` bf16 (+ ``k_rope [N, d_rope]`` bf16) into packed rows ``[N, B]`` uint8."""
    n, d_nope = k_nope.shape
    d_rope = 0 if k_rope is None else k_rope.shape[-1]
    x = k_nope.float().reshape(n, d_nope // QUANT_TILE, QUANT_TILE)  # [N, n_tiles, 128]
    scale = _scales(x, round_scale)  # [N, n_tiles]
    values = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # RNE
    parts = [
        values.reshape(n, d_nope).view(torch.uint8),  # [N, d_nope]
        scale.contiguous().view(torch.uint8),  # [N, 4 * n_tiles], little-endian float32
    ]
    if d_rope:
        parts.append(k_rope.contiguous().view(torch.uint8))  # [N, 2 * d_rope]
    return torch.cat(parts, dim=-1)  # [N, B]


def store_k_cache(
    k_nope: torch.Tensor,
    k_rope: torch.Tensor | None,
    cache: torch.Tensor,
    loc: torch.Tensor,
    round_scale: bool = False,
) -> None:
    """Quantize row i and write it into slot ``loc[i]`` of ``cache``; invalid slots are skipped."""
    paged = cache.reshape(cache.shape[0], -1, cache.shape[-1]) if cache.dim() > 2 else cache.unsqueeze(0)
    pages = paged.view(torch.uint8)  # [P, page, B], a view: writes land in cache (pages may lie apart)
    loc = loc.long()
    valid = (loc >= 0) & (loc < pages.shape[0] * pages.shape[1])  # [N]
    if valid.any():
        rows = quant_k_cache(k_nope[valid], None if k_rope is None else k_rope[valid], round_scale)
        slot = loc[valid]
        pages[slot // pages.shape[1], slot % pages.shape[1]] = rows


def dequant_k_cache(packed: torch.Tensor) -> torch.Tensor:
    """Dequantize packed rows ``[..., B]`` uint8 -> ``[..., d_nope + d_rope]`` bf16.

    Each value is ``bf16(float32(fp8) * scale)``, the product rounded once to float32, then to bf16.
    """
    lay = KCacheLayout.from_row_bytes(packed.shape[-1])
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, lay.row_bytes)  # [R, B]
    rows = rows.view(torch.uint8)  # int8 and float8_e4m3fn views of packed rows
    values = rows[:, : lay.scale_offset].contiguous().view(torch.float8_e4m3fn).float()  # [R, d_nope]
    scale = rows[:, lay.scale_offset : lay.rope_offset].contiguous().view(torch.float32)  # [R, n_tiles]
    nope = values.reshape(-1, lay.num_scales, QUANT_TILE) * scale.unsqueeze(-1)  # [R, n_tiles, 128]
    out = nope.reshape(-1, lay.d_nope).to(torch.bfloat16)  # [R, d_nope]
    if lay.d_rope:
        rope = rows[:, lay.rope_offset :].contiguous().view(torch.bfloat16)  # [R, d_rope]
        out = torch.cat([out, rope], dim=-1)  # [R, d_qk]
    return out.reshape(*lead, lay.d_qk)


def _gather_rows(pool: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``pool[indices]`` of a ``[S, D]`` pool for ``[M]`` ids; zero rows where an id is outside ``[0, S)``."""
    ids = indices.long()
    valid = (ids >= 0) & (ids < pool.shape[0])  # [M]
    out = pool.new_zeros(ids.shape[0], pool.shape[1])  # [M, D]
    out[valid] = pool[ids[valid]]
    return out


def gather_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Packed rows of the slots ``indices [M]`` -> ``[M, B]`` uint8; zero rows for invalid slots."""
    return _gather_rows(flatten_pool(cache).view(torch.uint8), indices)  # int8 or float8 views of packed rows


def gather_dequant_k_cache(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Dequantized rows of the slots ``indices [M]`` -> ``[M, d_nope + d_rope]`` bf16; zeros for invalid slots."""
    return dequant_k_cache(gather_k_cache(cache, indices))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of ``q [T, H, d_qk]`` over the rows ``indices [T, K]`` of ``kv``.

    Returns ``out [T, H, d_v]`` bf16 and the natural-log ``lse [T, H]`` float32. Entries outside
    ``[0, S)`` or at positions ``>= topk_length[t]`` count for nothing and their rows are not used;
    a token with no valid entry gets ``out = 0`` and ``lse = -inf``. A pool of packed rows (uint8, int8 or
    float8_e4m3fn, wider than d_qk) is read as ``dequant_k_cache(kv)``; a float8_e4m3fn pool of width d_qk is used
    as its raw values. ``attn_sink [H]`` joins each row's denominator: ``out`` is the softmax-weighted sum times
    ``1 / (1 + exp(attn_sink[h] - lse))``, and ``lse`` leaves the sink out.
    """
    t_count, heads, d_qk = q.shape
    indices = indices.reshape(t_count, indices.shape[-1])  # [T, K]
    topk = indices.shape[1]
    num_slots = flatten_pool(kv).shape[0]
    out = torch.zeros(t_count, heads, d_v, dtype=torch.bfloat16, device=q.device)  # [T, H, d_v]
    lse = torch.full((t_count, heads), float("-inf"), dtype=torch.float32, device=q.device)  # [T, H]
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
        lse[start:stop] = (row_max + torch.log(total)).squeeze(-1)  # log 0 = -inf for empty rows
    return out, lse


def sparse_attn_with_max_logits(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sparse_attn`'s ``(out, lse)`` and :func:`attn_max_logits`'s ``max_logits [T, H]`` of the same call."""
    out, lse = sparse_attn(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
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


# ----------------------------------------------------------------------------------------------
# The lightning indexer.


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


# ----------------------------------------------------------------------------------------------
# Top-k selection.


def _order_key(logits: torch.Tensor) -> torch.Tensor:
    """int32 keys ``[R, W]`` whose order is the logits' (larger first), -0 equal to +0 and NaN just below -inf."""
    x = torch.where(logits == 0, 0.0, logits)  # [R, W], -0 -> +0: equal logits tie on position
    bits = x.view(torch.int32)  # [R, W]
    key = torch.where(bits < 0, bits ^ _FLOAT_MAGNITUDE, bits)  # negative floats: larger magnitude, smaller key
    return torch.where(torch.isnan(x), _NAN_KEY, key)


def _slots_of(
    position: torch.Tensor,
    chosen: torch.Tensor,
    rows: torch.Tensor,
    page_table: torch.Tensor,
    row_request: torch.Tensor | None,
    num_rows: int,
    page_size: int,
) -> torch.Tensor:
    """Pool slots ``[r, K]`` int64 of the positions ``[r, K]`` of the rows ``rows [r]``; -1 where not ``chosen``,
    where the row's request lies outside the table, where ``p // page_size >= max_pages`` or the entry is negative."""
    b_count, max_pages = page_table.shape
    if b_count == 0 or max_pages == 0:
        return torch.full_like(position, -1)
    request = (row_request[rows].long() if row_request is not None else rows // (num_rows // b_count)).unsqueeze(-1)
    page_index = position // page_size  # [r, K]
    ok = chosen & (request >= 0) & (request < b_count) & (page_index < max_pages)  # [r, K]
    entry = page_table[torch.where(ok, request, 0), torch.where(ok, page_index, 0)].long()  # [r, K], inside the table
    ok &= entry >= 0
    return torch.where(ok, entry * page_size + position % page_size, -1)


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
    """The k best candidates of each row of ``logits [R, W]`` float32 -> ``[R, out_width or k]`` int32.

    Row r's candidates are the columns ``[starts[r], starts[r] + lengths[r])`` clipped to ``[0, W)``, at
    positions ``column - starts[r]``. The k first in the order (logit descending, position ascending; NaN
    below ``-inf``; -0 equal to +0) are selected, all candidates when fewer, and written as ascending
    positions, then -1. With ``page_table [B, max_pages]`` each position p of request
    ``b = row_request[r]`` (or ``r // (R / B)``) becomes the slot
    ``page_table[b, p // page_size] * page_size + p % page_size`` in place (in position order), -1 where the
    entry is negative, ``p // page_size >= max_pages`` or b lies outside ``[0, B)``; slots are computed in int64
    and stored as int32. Exact: a stable sort of an integer key.
    """
    num_rows, width = logits.shape
    out = torch.full(
        (num_rows, k if out_width is None else out_width), -1, dtype=torch.int32, device=logits.device
    )  # [R, W']
    if num_rows == 0 or width == 0:
        return out
    take = min(k, width)
    chunk = max(1, _TOPK_CHUNK_BYTES // (_TOPK_BYTES_PER_COLUMN * width))
    column = torch.arange(width, device=logits.device)  # [W]
    rank = torch.arange(take, device=logits.device)  # [K]
    for r0 in range(0, num_rows, chunk):
        r1 = min(r0 + chunk, num_rows)
        start = (
            torch.zeros(r1 - r0, dtype=torch.int64, device=logits.device) if starts is None else starts[r0:r1].long()
        ).unsqueeze(-1)  # [r, 1]
        stop = start + lengths[r0:r1].long().unsqueeze(-1)  # [r, 1], int64: no int32 overflow
        candidate = (column >= start) & (column < stop)  # [r, W]
        key = torch.where(candidate, _order_key(logits[r0:r1]), _NOT_A_CANDIDATE)  # [r, W] int32
        best = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :take]  # [r, K], ties: lower column
        chosen = rank < candidate.sum(dim=1, keepdim=True)  # [r, K], the first min(count, k) of the order
        last = torch.iinfo(torch.int64).max
        position = torch.where(chosen, best - start, last).sort(dim=1).values  # [r, K] ascending, unchosen last
        if page_table is not None:
            rows = torch.arange(r0, r1, device=logits.device)  # [r]
            position = _slots_of(position, chosen, rows, page_table, row_request, num_rows, page_size)
        out[r0:r1, :take] = torch.where(chosen, position, -1).to(torch.int32)
    return out


_select_topk = topk  # (index_topk's argument ``topk`` hides the function)


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


# ----------------------------------------------------------------------------------------------
# The k-pool indexer (GLM-5.3-Flash): pools of kpool consecutive tokens, scored as one index key each.


def kpool_compress(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """The keys ``[Np, D]`` bfloat16 of complete pools: ``k [Np, kpool, D]`` bfloat16, ``gate [Np, kpool, D]`` and
    ``ape [kpool, D]`` (bfloat16 or float32).

    Per channel d, ``pool_k[d] = sum_i p[i, d] * k[i, d]`` with ``p = softmax_i(gate[i, d] + ape[i, d])``, rounded as
    the model rounds it: the softmax in float32, its weights rounded to bfloat16, each product rounded to bfloat16,
    their sum accumulated in float32 and rounded once to bfloat16. Runs on any device without a host sync.
    """
    logits = gate.float() + ape.float()  # [Np, kpool, D]
    weights = logits.softmax(dim=1).to(torch.bfloat16)  # [Np, kpool, D]
    products = (weights.float() * k.float()).to(torch.bfloat16)  # [Np, kpool, D], one rounding per product
    return products.float().sum(dim=1).to(torch.bfloat16)  # [Np, D]


def kpool_store_index_k(
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    cache: torch.Tensor,
    loc: torch.Tensor,
    round_scale: bool = False,
) -> None:
    """Compress each complete pool (:func:`kpool_compress`) and store its key into slot ``loc[i]`` of the index-K
    cache exactly as :func:`store_index_k` stores a token's key; invalid slots are skipped."""
    store_index_k(kpool_compress(k, gate, ape), cache, loc, round_scale)


def kpool_expand(
    pools: torch.Tensor,
    lengths: torch.Tensor,
    kpool: int,
    width: int,
    tail: bool = True,
    page_table: torch.Tensor | None = None,
    row_request: torch.Tensor | None = None,
    page_size: int = 64,
) -> torch.Tensor:
    """Token positions (or slots) ``[R, width]`` int32 of selected pools ``pools [R, k]`` int32 (ascending pool
    positions, then -1) of rows that see ``lengths [R]`` tokens.

    Pool p becomes the tokens ``p * kpool .. p * kpool + kpool - 1``; with ``tail``, the ``lengths[r] % kpool``
    tokens of the row's incomplete pool follow; then -1. Every token lies after the tokens before it, so the row
    ascends. With ``page_table``, positions become slots as :func:`topk` maps them. No host sync: each row's tail is
    scattered to the column after its last selected pool.
    """
    rows, k = pools.shape
    offset = torch.arange(kpool, device=pools.device)  # [kpool]
    chosen = pools >= 0  # [R, k]
    tokens = pools.long().unsqueeze(-1) * kpool + offset  # [R, k, kpool]
    tokens = torch.where(chosen.unsqueeze(-1), tokens, -1).flatten(1)  # [R, k * kpool]
    out = torch.full((rows, width), -1, dtype=torch.int64, device=pools.device)  # [R, width]
    out[:, : k * kpool] = tokens
    if tail and kpool > 1:
        seen = lengths.long().clamp_min(0).unsqueeze(-1)  # [R, 1]
        partial = seen % kpool  # [R, 1], tokens of the incomplete pool
        step = offset[: kpool - 1]  # [kpool - 1]
        tail_tokens = torch.where(step < partial, seen - partial + step, -1)  # [R, kpool - 1]
        first = chosen.sum(dim=1, keepdim=True) * kpool  # [R, 1], the column after the last selected pool's tokens
        out.scatter_(1, first + step, tail_tokens)  # columns past the row's pools hold -1: unused tail entries keep it
    if page_table is not None:
        valid = out >= 0  # [R, width]
        rows_of = torch.arange(rows, device=pools.device)  # [R]
        out = _slots_of(torch.where(valid, out, 0), valid, rows_of, page_table, row_request, rows, page_size)
    return out.to(torch.int32)


def kpool_topk(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    kpool: int,
    starts: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    row_request: torch.Tensor | None = None,
    page_size: int = 64,
    out_width: int | None = None,
    tail: bool = True,
) -> torch.Tensor:
    """The k best complete pools of each row of pool logits ``logits [R, Wp]`` float32, expanded to their tokens
    -> ``[R, out_width]`` int32.

    Row r sees ``L = max(lengths[r], 0)`` tokens, so its candidates are its ``L // kpool`` complete pools: the
    columns ``[starts[r], starts[r] + L // kpool)`` clipped to ``[0, Wp)``, chosen exactly as :func:`topk` chooses
    (logit descending, position ascending, NaN below ``-inf``). :func:`kpool_expand` writes their tokens and, with
    ``tail``, the row's ``L % kpool`` newest tokens, then -1 (or slots through ``page_table``).
    """
    width = out_width if out_width is not None else k * kpool + (kpool - 1 if tail else 0)
    pools = topk(logits, torch.div(lengths.clamp_min(0), kpool, rounding_mode="floor"), k, starts)  # [R, k]
    return kpool_expand(pools, lengths, kpool, width, tail, page_table, row_request, page_size)
