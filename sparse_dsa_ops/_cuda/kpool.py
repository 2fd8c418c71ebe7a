"""GPU implementation of the k-pool indexer's ops (arguments already checked by ``ops/kpool.py``).

``kpool_store_index_k`` is one kernel of the family's own (``csrc_tl.kpool``, keys ``KpoolStoreKey``): it reads each
pool's k and gate once, compresses the pool with the model's roundings and quantizes and stores the key exactly as
``store_index_k`` does, so it never holds the compressed keys in memory. ``kpool_topk`` is a composition: it selects
pools with the top-k family's kernels and expands them with ``reference.kpool_expand`` (a few elementwise launches and
one scatter for the tails). Both are free of host syncs (capture-safe). ``warmup(kpool=..., topk_k=...)`` compiles
the store for bfloat16 gate and ape and the selection's top-k kernels; a store with a float32 gate or ape compiles
its own kernel on its first call (which inside a capture raises).
"""

from __future__ import annotations

import torch

from csrc_tl import kpool as builders

from ..ops import TopkArgs, takes_checked
from ..reference import kpool_expand
from . import selection
from .common import aligned, slot_dtype
from .compile import kernel, register_builder, sm_count

__all__ = ["bench_cases", "warmup_keys", "store_key", "kpool_store_index_k", "kpool_topk"]

register_builder(builders.KpoolStoreKey, builders.build_kpool_store_index_k, builders.pass_configs)

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
    pool_lengths = torch.div(lengths.clamp_min(0), kpool, rounding_mode="floor")  # [R] complete pools a row sees
    pools = select_pools(logits, pool_lengths, k, starts)  # [R, k]
    return kpool_expand(pools, lengths, kpool, args.width, tail, page_table, row_request, page_size)


def warmup_keys(
    k=None, dim=DIM, page=PAGE, round_scale=(False,), slot_dtypes=("int32",), kpool=KPOOL, dtypes=MODEL_DTYPES
) -> list:
    """The kernels of the k-pool ops: the store of pools of ``kpool`` tokens of ``dim``-wide keys into pages of
    ``page`` pool rows, for each pair of (gate, ape) ``dtypes``, and the top-k kernels of k pools (both schemes, with
    and without ``starts``)."""
    keys = [
        builders.KpoolStoreKey(kpool, dim, page, gate, ape, rs, sd)
        for gate, ape in dtypes
        for rs in round_scale
        for sd in slot_dtypes
    ]
    if k:
        keys += selection.warmup_keys(k, page, paged=(False,))
    return keys


SOURCE_OPS = ("kpool_store_index_k", "kpool_topk")  # the ops ``python -m sparse_dsa_ops source`` prints kernels of


def source_keys(op: str, spec) -> list:
    """The kernels ``op`` runs for ``spec`` (a ``KernelSpec``): the store of GLM-5.3-Flash's pools (KPOOL tokens,
    bfloat16 gate and ape: the spec names none of these) for ``index_dim``, ``page``, ``round_scale`` and
    ``slot_dtype``; the pool selection's top-k kernels of k pools (both schemes)."""
    if op == "kpool_store_index_k":
        return [
            builders.KpoolStoreKey(
                KPOOL, spec.index_dim, spec.page, round_scale=spec.round_scale, slot_dtype=spec.slot_dtype
            )
        ]
    return selection.TopkPlan(1, 0).keys(spec.k, 0, False, False) + selection.TopkPlan(2, 0).keys(
        spec.k, 0, False, False
    )


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
    keys = plan.keys(POOLS_SELECTED, 0, False, False)
    path = f"{plan.chunks} CTAs a row" if plan.chunks > 1 else "a CTA a row"
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
    ``kpool``; the store's for pools of ``kpool`` tokens with bfloat16 gate and ape (the spec names no dtypes), and
    the pool selection's of ``topk_k // kpool`` pools."""
    if not spec.kpool:
        return []
    pools = spec.topk_k // spec.kpool if spec.topk_k else None
    return warmup_keys(pools, spec.index_dim, spec.index_page, spec.round_scale, spec.slot_dtypes, spec.kpool)
