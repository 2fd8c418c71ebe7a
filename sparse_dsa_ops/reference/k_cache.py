"""The reference of the k_cache family's ops."""

from __future__ import annotations

import torch

from ..layout import FP8_MAX, QUANT_TILE, KCacheLayout

__all__ = [
    "flatten_pool",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
]


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
