"""DeepSeek-style sparse attention (DSA) — the lightning indexer, top-k selection, sparse attention and their
FP8 caches — as ``torch.ops.dsa`` ops.

The ops run pure-Torch code on the CPU (``reference``, also the test oracle) and TileLang kernels on GPUs. See
``ops`` (one module per op family) for the contract of each op and ``flash_mla`` for FlashMLA's sparse entry points
over them.
"""

import importlib

from . import ops, reference  # noqa: F401  (reference: the CPU backend, ``sparse_dsa_ops.reference``)
from .layout import KCacheLayout
from .ops import OPS, register_backend

# every declared op's public function (its contract module's, of the op's name)
globals().update((name, getattr(ops, name)) for name in OPS)

register_backend("cpu", f"{__name__}.reference")
# Also serves ROCm builds of torch (device type "cuda"). Imported on the first op on a GPU: it loads TileLang.
register_backend("cuda", f"{__name__}._cuda")


def __getattr__(name: str):
    if name == "_cuda":  # ``sparse_dsa_ops._cuda`` without importing it first
        return importlib.import_module(f"{__name__}._cuda")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def warmup(
    *,
    heads: int,
    d_nope: int,
    d_rope: int,
    sm_scale: float,
    kv_kinds: tuple[str, ...] = ("bf16", "packed"),
    fp8_q: tuple[bool, ...] = (False,),
    topk_length: tuple[bool, ...] = (False, True),
    attn_sink: tuple[bool, ...] = (False,),
    cache_ops: bool = True,
    round_scale: tuple[bool, ...] = (False, True),
    slot_dtypes: tuple[str, ...] = ("int32", "int64"),
    index_heads: int | None = None,
    index_dim: int = 128,
    index_page: int = 64,
    topk_k: int | None = None,
    kpool: int | None = None,
    kpool_dtypes: tuple[tuple[str, str], ...] = (("bfloat16", "bfloat16"),),
    progress: bool = True,
    workers: int = 8,
) -> None:
    """Compile, in parallel and ahead of time, every GPU kernel one model geometry can use.

    Call it before capturing CUDA graphs: compiling inside a capture raises. TileLang's disk cache
    (``TILELANG_CACHE_DIR``) makes the next process's warmup fast. ``sm_scale`` is compiled into
    the attention kernels, so pass the model's exact value.

    ``kv_kinds`` are the pools attention will read: "bf16", "fp8" (float8_e4m3fn values) and/or
    "packed" (FP8 rows); ``fp8_q`` whether q is bf16 (False), float8_e4m3fn (True) or either
    ``(False, True)`` (a float8 q only goes with "fp8" or "packed" kv). ``topk_length`` and ``attn_sink`` say
    whether calls pass lengths and sinks (``attn_sink=(False, True)`` also covers ``sparse_attn_with_max_logits``
    and FlashMLA's face with or without a sink); ``cache_ops``, ``round_scale`` and ``slot_dtypes`` pick the cache
    kernels.
    ``index_heads`` (with ``index_dim`` and the index-K cache's ``index_page``) adds the indexer's kernels, and
    ``topk_k`` the top-k kernels of that k (``index_topk`` runs kernels of both); ``kpool`` (GLM-5.3-Flash: 16)
    adds the k-pool ops' kernels, the pool selection's of ``topk_k // kpool`` pools, and the pool store's for each
    ``(gate, ape)`` dtype pair of ``kpool_dtypes`` ("bfloat16" or "float32"). ``workers`` threads build kernels at
    once.
    """
    from . import _cuda

    spec = ops.WarmupSpec(
        heads,
        d_nope,
        d_rope,
        sm_scale,
        tuple(kv_kinds),
        tuple(fp8_q),
        tuple(topk_length),
        tuple(attn_sink),
        cache_ops,
        tuple(round_scale),
        tuple(slot_dtypes),
        index_heads,
        index_dim,
        index_page,
        topk_k,
        kpool,
        tuple(tuple(pair) for pair in kpool_dtypes),
    )
    keys = [key for family in ops.FAMILIES for key in family.gpu().warmup_keys_of(spec)]
    _cuda.warmup(list(dict.fromkeys(keys)), workers=workers, progress=progress)


__version__ = "0.2.0"

__all__ = ["KCacheLayout", *OPS, "warmup"]
