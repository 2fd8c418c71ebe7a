"""DeepSeek-style sparse attention (DSA) and its packed FP8 K cache as ``torch.ops.dsa`` ops.

The ops run pure-Torch code on the CPU (``reference.py``, also the test oracle) and TileLang
kernels on GPUs where they exist. See ``ops.py`` for the contract of each op.
"""

from . import _cuda, reference
from .layout import KCacheLayout
from .ops import (
    dequant_k_cache,
    gather_dequant_k_cache,
    gather_k_cache,
    quant_k_cache,
    register_backend,
    sparse_attn,
    store_k_cache,
)

register_backend(
    "cpu",
    {
        "quant_k_cache": reference.quant_k_cache,
        "store_k_cache": reference.store_k_cache,
        "dequant_k_cache": reference.dequant_k_cache,
        "gather_k_cache": reference.gather_k_cache,
        "gather_dequant_k_cache": reference.gather_dequant_k_cache,
        "sparse_attn": reference.sparse_attn,
    },
)

register_backend("cuda", _cuda.IMPLS)  # also serves ROCm builds of torch (device type "cuda")


def warmup(
    *,
    heads: int,
    d_nope: int,
    d_rope: int,
    sm_scale: float,
    kv_kinds: tuple[str, ...] = ("bf16", "packed"),
    fp8_q: tuple[bool, ...] = (False,),
    topk_length: tuple[bool, ...] = (False, True),
    cache_ops: bool = True,
    round_scale: tuple[bool, ...] = (False, True),
    slot_dtypes: tuple[str, ...] = ("int32", "int64"),
    progress: bool = True,
    workers: int = 8,
) -> None:
    """Compile, in parallel and ahead of time, every GPU kernel one model geometry can use.

    Call it before capturing CUDA graphs: compiling inside a capture raises. TileLang's disk cache
    (``TILELANG_CACHE_DIR``) makes the next process's warmup fast. ``sm_scale`` is compiled into
    the attention kernels, so pass the model's exact value.

    ``kv_kinds`` are the pools attention will read: "bf16", "fp8" (float8_e4m3fn values) and/or
    "packed" (uint8 FP8 rows); ``fp8_q`` whether q is bf16 (False), float8_e4m3fn (True) or either
    ``(False, True)`` (a float8 q only goes with "fp8" or "packed" kv). ``topk_length`` says whether
    calls pass lengths; ``cache_ops``, ``round_scale`` and ``slot_dtypes`` pick the cache kernels.
    ``workers`` threads lower and build kernels at once (``workers=1``: one at a time).
    """
    lay = KCacheLayout(d_nope, d_rope)
    keys = []
    for kind in kv_kinds:
        for has_len in topk_length:
            for q_fp8 in fp8_q:
                if not (q_fp8 and kind == "bf16"):  # float8 q only goes with fp8 or packed kv
                    keys += _cuda.attn_keys(kind, d_nope, d_rope, heads, sm_scale, has_len, q_fp8=q_fp8)
    if cache_ops:
        for slot in slot_dtypes:
            for rs in round_scale:
                keys += _cuda.cache_keys("quant_k_cache", lay, rs) + _cuda.cache_keys("store_k_cache", lay, rs, slot)
            keys += _cuda.cache_keys("gather_k_cache", lay, slot_dtype=slot)
            keys += _cuda.cache_keys("gather_dequant_k_cache", lay, slot_dtype=slot)
        keys += _cuda.cache_keys("dequant_k_cache", lay)
    _cuda.warmup(keys, workers=workers, progress=progress)


__version__ = "0.1.0"

__all__ = [
    "KCacheLayout",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "sparse_attn",
    "warmup",
]
