"""Pure-Torch implementations of every ``dsa`` op: the CPU backend and the oracle of the tests.

Each function has its op's signature and trusts that ``ops.py`` has checked the arguments. They
gather the selected rows (no dense masks), accumulate in float32 and run on any device.

Letters used in shapes: N rows to quantize or store, M gathered slots, T query tokens, H heads,
K top-k entries per token, S slots in the pool (pages x page size), D row width, B packed row bytes.
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
    "attn_max_logits",
    "flatten_pool",
]

# Bound on the float32 scratch of one sparse_attn chunk, so that a CPU call at DeepSeek geometry
# (T 64, H 128, top-k 2048) stays within a few hundred MB.
_ATTN_CHUNK_BYTES = 96 << 20


def flatten_pool(pool: torch.Tensor) -> torch.Tensor:
    """View a flat ``[S, D]``, ``[S, 1, D]`` or paged ``[P, page, (1,) D]`` pool as ``[S, D]``.

    Slot ``page * page_size + offset`` of a paged pool is row ``page * page_size + offset`` here. A pool whose
    pages lie further apart than a page comes back as a copy (for reading); :func:`store_k_cache` writes such a
    pool through its pages.
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
