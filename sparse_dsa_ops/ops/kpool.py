"""The k-pool indexer's ops (GLM-5.3-Flash's selection): schemas, argument checks, fake kernels and the public
functions of the family ``kpool``.

GLM-5.3-Flash's lightning indexer scores pools of ``kpool`` (16) consecutive tokens of a request, counted from its
first token, instead of single tokens. A complete pool's index key is a gated average of its tokens' keys, per
channel; the indexer scores pools with the logits ops over a cache of pool rows (``index_logits`` in prefill,
``paged_index_logits`` in decode), selects the best ``index_topk / kpool`` pools (128) and attends to their tokens,
plus the tokens of the current incomplete pool (0 to ``kpool - 1``): index rows of ``2048 + 15 = 2063`` entries,
padded with -1 to 2112 for ``sparse_attn``.

- :func:`kpool_store_index_k` compresses complete pools and writes their keys into the paged index-K cache of
  ``store_index_k`` (one row per pool, the same FP8 values and scale). Decode calls it once a step with one entry a
  request and ``loc = -1`` where no pool completed: it is capture-safe.
- :func:`kpool_topk` selects pools over pool logits exactly as ``topk`` selects tokens and writes their token
  positions (or token slots through a page table), then the tail. With ``kpool = 1`` it is ``topk``.

Letters: Np pools, kpool tokens a pool, D the indexer head dim, R rows of logits, Wp pool columns of a row, k pools
selected, P pages of ``page`` slots. The exact definitions are ``reference.kpool_*``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .core import Family, KernelSpec, _declare, _fail, _slots, _tensor
from .indexer import IndexCache, _index_cache, _index_rows
from .samples import Case, case
from .selection import check_topk

__all__ = [
    "KpoolTopkArgs",
    "kpool_width",
    "check_kpool_store_index_k",
    "check_kpool_topk",
    "kpool_store_index_k",
    "kpool_topk",
]

_GATE_DTYPES = (torch.bfloat16, torch.float32)


def kpool_width(k: int, kpool: int, tail: bool = True) -> int:
    """The entries a row of :func:`kpool_topk` can fill: ``k * kpool`` tokens of the pools, ``kpool - 1`` of the
    tail (2063 for GLM-5.3-Flash's 128 pools of 16)."""
    return k * kpool + (kpool - 1 if tail else 0)


def check_kpool_store_index_k(k, gate, ape, cache, loc, round_scale=False) -> IndexCache:
    op = "kpool_store_index_k"
    k = _index_rows(op, "k", k, (torch.bfloat16,), (3,))
    np_, kpool, dim = k.shape  # the pool count stays symbolic under torch.compile
    if kpool == 0:
        _fail(op, "k", "[Np, kpool, D] with kpool >= 1 tokens a pool", k)
    gate = _tensor(op, "gate", gate, _GATE_DTYPES, (3,), k.device)
    if gate.shape != k.shape:
        _fail(op, "gate", f"[Np, kpool, D] = {list(k.shape)} like k (one gate logit per key value)", gate)
    ape = _tensor(op, "ape", ape, _GATE_DTYPES, (2,), k.device)
    if tuple(ape.shape) != (kpool, dim):
        _fail(op, "ape", f"[kpool, D] = [{kpool}, {dim}] (one bias per position in the pool and channel)", ape)
    layout = _index_cache(op, cache, int(dim), k.device)
    _slots(op, "loc", loc, k.device, np_)
    return layout


@dataclass(frozen=True)
class KpoolTopkArgs:
    """What the checker learned about a ``kpool_topk`` call."""

    k: int  # pools selected
    kpool: int
    width: int  # the output width
    paged: bool


def check_kpool_topk(
    logits,
    lengths,
    k,
    kpool,
    starts=None,
    page_table=None,
    row_request=None,
    page_size=64,
    out_width=None,
    tail=True,
) -> KpoolTopkArgs:
    op = "kpool_topk"
    if not isinstance(kpool, int) or kpool < 1:
        exc = TypeError if not isinstance(kpool, int) else ValueError
        _fail(op, "kpool", "an int >= 1 (tokens a pool)", kpool, exc)
    if not isinstance(tail, bool):
        _fail(op, "tail", "a bool", tail, TypeError)
    if isinstance(k, int) and 1 <= k and out_width is not None:
        need = kpool_width(k, kpool, tail)
        if not isinstance(out_width, int) or out_width < need:
            _fail(op, "out_width", f"None or an int >= {need} (k * kpool{' + kpool - 1' if tail else ''})", out_width)
    try:  # the pool selection is topk's: the same arguments, the same limits
        args = check_topk(logits, lengths, k, starts, page_table, row_request, page_size, None)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("dsa.topk:", f"dsa.{op}:", 1)) from None
    return KpoolTopkArgs(k, kpool, out_width if out_width is not None else kpool_width(k, kpool, tail), args.paged)


@_declare(
    "(Tensor k, Tensor gate, Tensor ape, Tensor(a!) cache, Tensor loc, bool round_scale=False) -> ()",
    check_kpool_store_index_k,
)
def _fake_kpool_store_index_k(layout, k, gate, ape, cache, loc, round_scale=False):
    return None


@_declare(
    "(Tensor logits, Tensor lengths, int k, int kpool, Tensor? starts=None, Tensor? page_table=None, "
    "Tensor? row_request=None, int page_size=64, int? out_width=None, bool tail=True) -> Tensor",
    check_kpool_topk,
)
def _fake_kpool_topk(
    args,
    logits,
    lengths,
    k,
    kpool,
    starts=None,
    page_table=None,
    row_request=None,
    page_size=64,
    out_width=None,
    tail=True,
):
    return logits.new_empty((logits.shape[0], args.width), dtype=torch.int32)


def kpool_store_index_k(
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    cache: torch.Tensor,
    loc: torch.Tensor,
    round_scale: bool = False,
) -> None:
    """Compress complete pools into one index key each and write pool i's key into slot ``loc[i]`` of the paged
    index-K cache, in place.

    Parameters
    ----------
    k : [Np, kpool, D] bfloat16
        The index keys of each pool's tokens, in token order (D a multiple of 64; kpool >= 1).
    gate : [Np, kpool, D] bfloat16 or float32
        The tokens' gate logits (``hidden @ W_gate^T``).
    ape : [kpool, D] bfloat16 or float32
        The learned bias of each position in a pool.
    cache : [P, page * (D + 4)] uint8 (or its views [P, page, D + 4] / [P, page, 1, D + 4]), contiguous
        The index-K cache of :func:`~sparse_dsa_ops.store_index_k`, here holding one row per pool.
    loc : [Np] int32 or int64
        The slot of each pool; negative entries (no pool completed) and entries ``>= P * page`` are skipped, nothing
        else of the cache changes.
    round_scale : bool
        Round each key's scale up to a power of two, as in :func:`~sparse_dsa_ops.quant_index`.

    Notes
    -----
    Per channel d the pool's key is ``sum_i softmax_i(gate[i, d] + ape[i, d]) * k[i, d]`` (the softmax over the
    pool's tokens in float32, weights and products rounded to bfloat16, the sum to bfloat16 once), then it is
    quantized and stored exactly as ``store_index_k`` stores a token's key. Exact definition:
    ``reference.kpool_store_index_k``.
    """
    torch.ops.dsa.kpool_store_index_k(k, gate, ape, cache, loc, round_scale)


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
    """The k best complete pools of each row, expanded to their tokens, then the row's incomplete pool.

    Parameters
    ----------
    logits : [R, Wp] float32
        Pool logits (``index_logits`` or ``paged_index_logits`` over pool keys); column ``starts[r] + p`` is pool p
        of row r (tokens ``p * kpool .. p * kpool + kpool - 1``).
    lengths : [R] int32
        The tokens row r sees, L (a negative length counts as 0). Its candidates are its ``L // kpool`` complete
        pools (a pool is visible when its last token is), clipped to the columns of ``logits``.
    k : int
        Pools to select, 1 to 4096 (GLM-5.3-Flash: ``index_topk / kpool`` = 128).
    kpool : int
        Tokens a pool, >= 1; 1 makes this op :func:`~sparse_dsa_ops.topk`.
    starts : [R] int32 or None
        As in ``topk``: the column of row r's pool 0 (0 when None).
    page_table, row_request, page_size :
        As in ``topk``: with a page table each token position p becomes the slot
        ``page_table[b, p // page_size] * page_size + p % page_size`` of its request b (-1 where the entry is
        negative or past the table).
    out_width : int or None
        The output width, at least ``k * kpool`` plus ``kpool - 1`` with ``tail`` (2063 for 128 pools of 16; pass
        2112 for ``sparse_attn``); that minimum when None (:func:`kpool_width`).
    tail : bool
        Append the tokens of the row's incomplete pool, ``L - L % kpool .. L - 1`` (GLM-5.3-Flash's
        ``index_kpool_always_select_tail``).

    Returns
    -------
    [R, out_width] int32
        The selected pools chosen exactly as ``topk`` chooses (logit descending, then position ascending; NaN below
        ``-inf``), each expanded to its kpool token positions, in ascending order; then the tail's tokens; then -1.
        The whole row ascends. Exact definition: ``reference.kpool_topk``.
    """
    return torch.ops.dsa.kpool_topk(
        logits, lengths, k, kpool, starts, page_table, row_request, page_size, out_width, tail
    )


# ----------------------------------------------------------------------------------------------
# Self-check cases (``python -m sparse_dsa_ops check``): GLM-5.3-Flash's indexer, pools of 16 tokens, 128-wide keys.

CHECK_KPOOL, CHECK_DIM, CHECK_PAGE = 16, 128, 64
CHECK_GEOMETRY = "kpool 16 D128 GLM-5.3-Flash"


def check_cases(on_cpu: bool) -> list[Case]:
    """Pools of 16 tokens compressed into the index-K cache (on a GPU, softmax rounds its last float32 bit otherwise
    than the CPU's now and then, which may move one FP8 code: not exact), and k pools of each row selected and
    expanded to token slots through a page table, with the tail."""
    pools, rows, width, k = (256, 8, 512, 16) if on_cpu else (65536, 64, 8192, 128)
    geo, kp, dim, page = CHECK_GEOMETRY, CHECK_KPOOL, CHECK_DIM, CHECK_PAGE

    def store(gen):
        k_rows = torch.randn(pools, kp, dim, generator=gen).bfloat16()
        gate = torch.randn(pools, kp, dim, generator=gen).bfloat16()
        ape = torch.randn(kp, dim, generator=gen).bfloat16()
        cache = torch.zeros(2 * pools // page, page * (dim + 4), dtype=torch.uint8)
        loc = torch.randperm(cache.shape[0] * page, generator=gen)[:pools].int()  # distinct slots, half the cache
        loc[::7] = -1
        return k_rows, gate, ape, cache, loc, False

    def select(gen):
        logits = torch.randn(rows, width, generator=gen)
        lengths = torch.randint(0, width * kp + kp, (rows,), generator=gen, dtype=torch.int32)
        token_pages = width * kp // page + 1
        table = torch.randperm(rows * token_pages, generator=gen).int().reshape(rows, token_pages)
        return logits, lengths, k, kp, None, table, None, page, -(-kpool_width(k, kp) // 64) * 64

    def keys(op, device):
        from .._cuda import kpool

        return kpool.source_keys(op, KernelSpec(index_dim=dim, page=page, k=k))

    return [
        case("kpool_store_index_k", geo, store, functools.partial(keys, "kpool_store_index_k"), False, writes=3),
        case("kpool_topk", geo, select, functools.partial(keys, "kpool_topk"), name="kpool_topk to slots"),
    ]


FAMILY = Family("kpool", check_cases)
