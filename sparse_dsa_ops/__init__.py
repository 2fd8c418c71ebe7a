"""DeepSeek-style sparse attention (DSA) and its packed FP8 K cache as ``torch.ops.dsa`` ops.

The ops run pure-Torch code on the CPU (``reference.py``, also the test oracle) and TileLang
kernels on GPUs where they exist. See ``ops.py`` for the contract of each op.
"""

from . import reference
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

__version__ = "0.1.0"

__all__ = [
    "KCacheLayout",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "sparse_attn",
]
