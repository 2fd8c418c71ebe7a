"""The reference of the selection family's ops."""

from __future__ import annotations

import torch

__all__ = [
    "topk",
]

# The same bound for one chunk of top-k (keys and sort).
_TOPK_CHUNK_BYTES = 96 << 20
_TOPK_BYTES_PER_COLUMN = 32  # key, candidate flag, sorted keys and their int64 columns of one logit
# Top-k order keys (int32, larger ranks first): finite and infinite logits map monotonically onto
# [-1 - 0x7F800000, 0x7F800000]; NaN ranks just below -inf, and a column that is no candidate below that.
_FLOAT_MAGNITUDE = 0x7FFFFFFF
_NAN_KEY = -1 - 0x7F800000 - 1
_NOT_A_CANDIDATE = _NAN_KEY - 1


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
