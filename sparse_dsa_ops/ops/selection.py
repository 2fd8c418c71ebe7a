"""Exact top-k selection (family ``selection``): ``topk``. Schema, argument check, fake kernel and the public
function.

Letters: R rows of logits, W columns, k the entries selected, B requests of a page table. The exact definition is
``reference.topk``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .core import (
    Family,
    _declare,
    _fail,
    _selection_width,
    _tensor,
    _vector,
)
from .samples import Case, case, sm_count

__all__ = [
    "TopkArgs",
    "check_topk",
    "topk",
]


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
# Self-check cases (``python -m sparse_dsa_ops check``).


def _topk_keys(rows: int, width: int, k: int, page: int, device: torch.device) -> list:
    """The kernels of topk's plan for ``rows`` rows of ``width`` (to slots of ``page``-token pages, 0: positions)."""
    from .._cuda import selection

    return selection.plan_topk(rows, width, sm_count(device)).keys(k, page, False, False)


def check_cases(on_cpu: bool) -> list[Case]:
    """Exact top-k: a few long rows (on a GPU, a row split over CTAs) and many short rows to pool slots."""
    rows, width, k = (8, 1024, 256) if on_cpu else (256, 8192, 2048)
    long_rows, long_width, page = 4, width * 8, 64  # (page: topk's default page_size, which the slot case keeps)

    def few_long(gen):
        logits = torch.randn(long_rows, long_width, generator=gen)
        return logits, torch.randint(0, long_width + 1, (long_rows,), generator=gen, dtype=torch.int32), k

    def many_paged(gen):
        logits = torch.randn(rows, width, generator=gen)
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
        table = torch.randperm(rows * width // page, generator=gen).int().reshape(rows, width // page)
        table[:, ::5] = -1
        return logits, lengths, k, None, table

    split_keys = functools.partial(_topk_keys, long_rows, long_width, k, 0)
    slot_keys = functools.partial(_topk_keys, rows, width, k, page)
    return [
        case("topk", "few long rows", few_long, split_keys),
        case("topk", "many rows", many_paged, slot_keys, name="topk to slots"),
    ]


FAMILY = Family("selection", check_cases)
