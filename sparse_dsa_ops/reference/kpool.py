"""The reference of the kpool family's ops."""

from __future__ import annotations

import torch

from .indexer import store_index_k
from .selection import _slots_of, topk

__all__ = [
    "kpool_compress",
    "kpool_store_index_k",
    "kpool_expand",
    "kpool_topk",
]


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
