"""GPU implementation of the k-pool indexer's ops (arguments already checked by ``ops/kpool.py``).

``kpool_store_index_k`` is one kernel of the family's own (``csrc_tl.kpool``, keys ``KpoolStoreKey``): it reads each
pool's k and gate once, compresses the pool with the model's roundings and quantizes and stores the key exactly as
``store_index_k`` does, so it never holds the compressed keys in memory. ``kpool_topk`` selects pools with the top-k
family's kernels (over each row's complete pools, one elementwise division before them) and expands them with one
kernel of the family's own (keys ``KpoolExpandKey``), which writes the output's every entry: the pools' tokens, the
tail, -1, or their slots through the page table. Both are free of host syncs (capture-safe).
``warmup(kpool=..., topk_k=...)`` compiles the store for bfloat16 gate and ape, the selection's top-k kernels and the
expansion with the tail, to positions and to slots; a store with a float32 gate or ape, or an expansion of another
page size or without the tail, compiles its own kernel on its first call (which inside a capture raises).
"""

from __future__ import annotations

import torch

from csrc_tl import kpool as builders

from ..ops import TopkArgs, takes_checked
from . import selection
from .common import aligned, slot_dtype
from .compile import kernel, register_builder, sm_count

__all__ = ["bench_cases", "warmup_keys", "store_key", "expand_key", "kpool_store_index_k", "kpool_topk"]

register_builder(builders.KpoolStoreKey, builders.build_kpool_store_index_k, builders.pass_configs)
register_builder(builders.KpoolExpandKey, builders.build_kpool_expand, builders.pass_configs)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}  # gate's and ape's dtypes as the keys name them
# GLM-5.3-Flash's indexer: pools of 16 tokens, 128 of them selected, 128-wide keys in pages of 64 rows; bfloat16 gate
# logits and ape, the (gate, ape) dtypes warmed up by default
KPOOL, DIM, PAGE, POOLS_SELECTED = 16, 128, 64, 128
MODEL_DTYPES = (("bfloat16", "bfloat16"),)


def store_key(layout, k, gate, ape, loc, round_scale=False) -> builders.KpoolStoreKey:
    """The store kernel of a checked call: pools of ``k.shape[1]`` tokens into ``layout``'s cache."""
    return builders.KpoolStoreKey(
        k.shape[1], layout.dim, layout.page, _DTYPES[gate.dtype], _DTYPES[ape.dtype], round_scale, slot_dtype(loc)
    )


@takes_checked
def kpool_store_index_k(layout, k, gate, ape, cache, loc, round_scale=False):
    if k.shape[0] and layout.slots:
        pages = cache.view(cache.shape[0], layout.page_bytes)  # (the checker made sure it is contiguous)
        key = store_key(layout, k, gate, ape, loc, round_scale)
        kernel(key)(aligned(k), aligned(gate), aligned(ape), aligned(loc), pages)


def select_pools(logits, pool_lengths, k, starts):
    """The top-k family's selection of k pools per row: ``[R, k]`` int32 ascending pool positions, then -1."""
    return selection.topk(TopkArgs(k, k, False), logits, pool_lengths, k, starts)


def expand_key(kpool: int, tail: bool, page_size: int = 0, has_row_request: bool = False) -> builders.KpoolExpandKey:
    """The expansion kernel of pools of ``kpool`` tokens (``page_size`` 0: positions out). A pool of one token has no
    incomplete pool, so kpool 1 shares the kernel without the tail."""
    return builders.KpoolExpandKey(kpool, tail and kpool > 1, page_size, has_row_request)


@takes_checked
def kpool_topk(
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
    out = torch.empty(logits.shape[0], args.width, dtype=torch.int32, device=logits.device)  # [R, W']
    if not logits.shape[0]:
        return out
    # [R] complete pools a row sees; a negative length floors to a negative count, which the selection takes as no
    # candidates, as it takes 0 (so no clamp: one launch less)
    pool_lengths = lengths if kpool == 1 else torch.div(lengths, kpool, rounding_mode="floor")
    pools = select_pools(logits, pool_lengths, k, starts)  # [R, k]
    key = expand_key(kpool, tail, page_size if args.paged else 0, row_request is not None)
    optional = [aligned(t) for t in (page_table, row_request) if t is not None]
    kernel(key)(pools, aligned(lengths), *optional, out)
    return out


def warmup_keys(
    k=None, dim=DIM, page=PAGE, round_scale=(False,), slot_dtypes=("int32",), kpool=KPOOL, dtypes=MODEL_DTYPES
) -> list:
    """The kernels of the k-pool ops: the store of pools of ``kpool`` tokens of ``dim``-wide keys into pages of
    ``page`` pool rows, for each pair of (gate, ape) ``dtypes``; with ``k``, the top-k kernels of k pools (both
    schemes, with and without ``starts``) and the expansion of pools of ``kpool`` with the tail, to positions and to
    slots of a page table of ``page`` tokens (with and without ``row_request``)."""
    keys = [
        builders.KpoolStoreKey(kpool, dim, page, gate, ape, rs, sd)
        for gate, ape in dtypes
        for rs in round_scale
        for sd in slot_dtypes
    ]
    if k:
        keys += selection.warmup_keys(k, page, paged=(False,))
        keys += [expand_key(kpool, True)] + [expand_key(kpool, True, page, request) for request in (False, True)]
    return keys


SOURCE_OPS = ("kpool_store_index_k", "kpool_topk")  # the ops ``python -m sparse_dsa_ops source`` prints kernels of


def source_keys(op: str, spec) -> list:
    """The kernels ``op`` runs for ``spec`` (a ``KernelSpec``): the store of GLM-5.3-Flash's pools (KPOOL tokens,
    bfloat16 gate and ape: the spec names none of these) for ``index_dim``, ``page``, ``round_scale`` and
    ``slot_dtype``; the pool selection's top-k kernels of k pools (both schemes), then the expansion of KPOOL-token
    pools with the tail to slots of a page table of ``page`` tokens (positions where ``page`` is 0)."""
    if op == "kpool_store_index_k":
        return [
            builders.KpoolStoreKey(
                KPOOL, spec.index_dim, spec.page, round_scale=spec.round_scale, slot_dtype=spec.slot_dtype
            )
        ]
    pools = selection.TopkPlan(1, 0).keys(spec.k, 0, False, False) + selection.TopkPlan(2, 0).keys(
        spec.k, 0, False, False
    )
    return pools + [expand_key(KPOOL, True, spec.page)]


# ----------------------------------------------------------------------------------------------
# Bench cases (GLM-5.3-Flash's indexer: pools of 16 tokens, 128 selected, 128-wide keys, 64-row pages).

STORE_TARGET = (">=", 0.80, "of copy")
ROW_TARGET = ("<=", 10.0, "us")
ROWS_TARGET = (">=", 0.60, "of copy")


def _store_case(pools: int) -> dict:
    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(pools, KPOOL, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        gate = torch.randn(pools, KPOOL, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        ape = torch.randn(KPOOL, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        pages = -(-pools // PAGE)
        cache = torch.zeros(pages, PAGE * (DIM + 4), dtype=torch.uint8, device="cuda")
        loc = torch.randperm(pages * PAGE, device="cuda", generator=gen)[:pools].int()
        return k, gate, ape, cache, loc, False

    key = builders.KpoolStoreKey(KPOOL, DIM, PAGE)
    moved = pools * (2 * 2 * KPOOL * DIM + DIM + 4 + 4)  # k and gate read, the row and its scale written, the slot
    return dict(
        name=f"kpool_store_index_k {pools >> 10}K pools of {KPOOL}",
        op="kpool_store_index_k",
        make=make,
        flops=None,
        bytes=moved,
        keys=[key],
        path=key.name,
        target=STORE_TARGET,
    )


def _topk_case(rows: int, pools: int) -> dict:
    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(rows, pools, device="cuda", generator=gen)
        lengths = torch.full((rows,), pools * KPOOL + KPOOL - 1, dtype=torch.int32, device="cuda")
        return logits, lengths, POOLS_SELECTED, KPOOL, None, None, None, PAGE, 2112

    sms = sm_count(torch.device("cuda")) if torch.cuda.is_available() else selection.DEFAULT_SMS
    plan = selection.plan_topk(rows, pools, sms)
    expand = expand_key(KPOOL, True)
    keys = plan.keys(POOLS_SELECTED, 0, False, False) + [expand]
    # the selection's top-k kernels, named as the top-k cases name them, then the expansion by its own name
    selected = f"{plan.chunks} CTAs a row" if plan.chunks > 1 else "a CTA a row"
    path = f"{selected} + {expand.name}"
    return dict(
        name=f"kpool_topk k{POOLS_SELECTED} of {pools} pools of {KPOOL}, {rows} rows",
        op="kpool_topk",
        make=make,
        flops=None,
        bytes=rows * pools * 4,
        keys=keys,
        path=path,
        target=ROW_TARGET if rows == 1 else ROWS_TARGET,
    )


def bench_cases() -> list[dict]:
    """The k-pool cases of ``python -m sparse_dsa_ops bench``: the store of 64K pools, the selection of 128 of the
    8192 pools of a 128K context for 1 and 64 rows."""
    return [_store_case(1 << 16), _topk_case(1, 8192), _topk_case(64, 8192)]


def warmup_keys_of(spec) -> list:
    """The k-pool ops' kernels :func:`sparse_dsa_ops.warmup` compiles for ``spec`` (a ``WarmupSpec``): none without
    ``kpool``; the store's for pools of ``kpool`` tokens for each (gate, ape) dtype pair of ``kpool_dtypes``, and the
    pool selection's of ``topk_k // kpool`` pools."""
    if not spec.kpool:
        return []
    pools = spec.topk_k // spec.kpool if spec.topk_k else None
    return warmup_keys(
        pools, spec.index_dim, spec.index_page, spec.round_scale, spec.slot_dtypes, spec.kpool, spec.kpool_dtypes
    )
