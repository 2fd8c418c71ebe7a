"""GPU implementations of the packed FP8 K-cache ops (arguments already checked by the family's contract,
``sparse_dsa_ops.ops.k_cache``)."""

from __future__ import annotations

import torch

from csrc_tl import k_cache as builders

from ..layout import KCacheLayout
from ..ops import takes_checked
from .common import aligned, check_pool, pool_rows, pool_slots, slot_dtype
from .compile import kernel, register_builder

__all__ = [
    "cache_keys",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "bench_cases",
]

register_builder(builders.CacheKey, builders.build, builders.pass_configs)

# op -> the kernel it runs (the gathers and the store take slot ids, the quantizing kernels round_scale)
_KERNELS = {
    "quant_k_cache": "quant",
    "store_k_cache": "store",
    "dequant_k_cache": "dequant",
    "gather_k_cache": "gather",
    "gather_dequant_k_cache": "gather_dequant",
}


def cache_keys(
    op: str, layout: KCacheLayout, round_scale: bool = False, slot_dtype: str = "int32"
) -> list[builders.CacheKey]:
    """The kernels the cache op ``op`` runs for ``layout``."""
    kind = _KERNELS[op]
    slots = slot_dtype if kind in builders.SLOT_KERNELS else ""
    return [builders.CacheKey(kind, layout, round_scale and kind in builders.QUANT_KERNELS, slots)]


def warmup_keys(
    layout: KCacheLayout, round_scale=(False, True), slot_dtypes=("int32", "int64")
) -> list[builders.CacheKey]:
    """Every K-cache kernel of ``layout``."""
    keys = []
    for slot in slot_dtypes:
        for rs in round_scale:
            keys += cache_keys("quant_k_cache", layout, rs) + cache_keys("store_k_cache", layout, rs, slot)
        keys += cache_keys("gather_k_cache", layout, slot_dtype=slot)
        keys += cache_keys("gather_dequant_k_cache", layout, slot_dtype=slot)
    return keys + cache_keys("dequant_k_cache", layout)


def _check_quant_layout(op: str, lay: KCacheLayout) -> None:
    """Raise a ValueError for rows the quantizing kernels cannot write: their float32 scales and bf16 tail pairs
    are stored as 4-byte words, so a row must be a multiple of 4 bytes (an even d_rope)."""
    if lay.row_bytes % 4:
        raise ValueError(
            f"dsa.{op} on a GPU: k_rope must have an even width, got d_rope = {lay.d_rope} (rows of "
            f"{lay.row_bytes} bytes; the kernels store rows of a multiple of 4 bytes). The CPU "
            "reference takes any width."
        )


def quant_k_cache(k_nope, k_rope, round_scale=False):
    lay = KCacheLayout(k_nope.shape[1], 0 if k_rope is None else k_rope.shape[1])
    _check_quant_layout("quant_k_cache", lay)
    out = torch.empty(k_nope.shape[0], lay.row_bytes, dtype=torch.uint8, device=k_nope.device)
    if out.shape[0]:
        fn = kernel(cache_keys("quant_k_cache", lay, round_scale)[0])
        fn(aligned(k_nope), *([aligned(k_rope)] if lay.d_rope else []), out)
    return out


@takes_checked
def store_k_cache(args, k_nope, k_rope, cache, loc, round_scale=False):
    lay = args.layout
    _check_quant_layout("store_k_cache", lay)
    if k_nope.shape[0] and args.pool.slots:
        pool = pool_rows(cache, args.pool)
        check_pool("store_k_cache", "cache", pool, lay.row_bytes)
        fn = kernel(cache_keys("store_k_cache", lay, round_scale, slot_dtype(loc))[0])
        fn(aligned(k_nope), *([aligned(k_rope)] if lay.d_rope else []), aligned(pool_slots(loc, args.pool)), pool)


def dequant_k_cache(packed):
    lay = KCacheLayout.from_row_bytes(packed.shape[-1])
    rows = aligned(packed.reshape(-1, lay.row_bytes).view(torch.uint8))  # (read whole: a misaligned view is copied)
    out = torch.empty(rows.shape[0], lay.d_qk, dtype=torch.bfloat16, device=packed.device)
    if rows.shape[0]:
        kernel(cache_keys("dequant_k_cache", lay)[0])(rows, out)
    return out.reshape(*packed.shape[:-1], lay.d_qk)


def _gather(op: str, args, cache, indices, width: int, dtype: torch.dtype):
    lay = args.layout
    out = torch.empty(indices.shape[0], width, dtype=dtype, device=cache.device)
    if out.shape[0] and not args.pool.slots:
        out.zero_()  # every id is out of range of an empty pool
    elif out.shape[0]:
        pool = pool_rows(cache, args.pool)
        check_pool(op, "cache", pool, lay.row_bytes)
        ids = aligned(pool_slots(indices, args.pool))
        kernel(cache_keys(op, lay, slot_dtype=slot_dtype(indices))[0])(pool, ids, out)
    return out


@takes_checked
def gather_k_cache(args, cache, indices):
    return _gather("gather_k_cache", args, cache, indices, args.layout.row_bytes, torch.uint8)


@takes_checked
def gather_dequant_k_cache(args, cache, indices):
    return _gather("gather_dequant_k_cache", args, cache, indices, args.layout.d_qk, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Bench cases.


def _cache_case(name, op, d_nope, d_rope, rows, target=None):
    lay = KCacheLayout(d_nope, d_rope)

    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(rows, d_nope, device="cuda", dtype=torch.bfloat16, generator=gen)
        r = torch.randn(rows, d_rope, device="cuda", dtype=torch.bfloat16, generator=gen) if d_rope else None
        if op == "quant_k_cache":
            return (k, r, False)
        pool = torch.ops.dsa.quant_k_cache(k, r)
        ids = torch.randperm(rows, device="cuda", generator=gen).int()
        if op == "store_k_cache":
            return (k, r, pool, ids, False)
        if op == "dequant_k_cache":
            return (pool,)
        return (pool, ids)

    in_bytes = {
        "quant_k_cache": 2 * lay.d_qk,
        "store_k_cache": 2 * lay.d_qk + 4,
        "dequant_k_cache": lay.row_bytes,
        "gather_k_cache": lay.row_bytes + 4,
        "gather_dequant_k_cache": lay.row_bytes + 4,
    }[op]
    out_bytes = 2 * lay.d_qk if "dequant" in op else lay.row_bytes
    keys = cache_keys(op, lay, slot_dtype="int32")
    return dict(
        name=name,
        op=op,
        make=make,
        flops=None,
        bytes=rows * (in_bytes + out_bytes),
        keys=keys,
        path=keys[0].family,
        target=target,
    )


CACHE_OPS = ("quant_k_cache", "store_k_cache", "dequant_k_cache", "gather_k_cache", "gather_dequant_k_cache")
SOURCE_OPS = CACHE_OPS  # the ops ``python -m sparse_dsa_ops source`` prints this family's kernels of


def source_keys(op: str, args) -> list[builders.CacheKey]:
    """The kernels of ``op`` for the command line's ``args`` (``d_nope``, ``d_rope``, ``round_scale``,
    ``slot_dtype``)."""
    return cache_keys(op, KCacheLayout(args.d_nope, args.d_rope), args.round_scale, args.slot_dtype)


BENCH_GEOMETRIES = {"deepseek": (512, 64), "glm5.3-flash 512+0": (512, 0), "256+0": (256, 0)}  # d_nope, d_rope
COPY_TARGET = (">=", 0.85, "of copy")  # 1M rows of a cache op: a fraction of the device copy of the same run


def bench_cases() -> list[dict]:
    """The K-cache cases of ``python -m sparse_dsa_ops bench``, with their targets (bound, value, unit)."""
    cases = []
    for geo, (d_nope, d_rope) in BENCH_GEOMETRIES.items():
        for op in CACHE_OPS:
            cases.append(_cache_case(f"{op} {geo} 1M rows", op, d_nope, d_rope, 1 << 20, COPY_TARGET))
    cases.append(_cache_case("store_k_cache 256+0 16 rows", "store_k_cache", 256, 0, 16))
    return cases


def warmup_keys_of(spec) -> list[builders.CacheKey]:
    """The K-cache kernels :func:`sparse_dsa_ops.warmup` compiles for ``spec`` (a ``WarmupSpec``)."""
    if not spec.cache_ops:
        return []
    return warmup_keys(KCacheLayout(spec.d_nope, spec.d_rope), spec.round_scale, spec.slot_dtypes)
