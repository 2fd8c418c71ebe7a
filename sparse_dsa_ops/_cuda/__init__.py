"""The GPU backend: one module per op family (``k_cache``, ``attention``, ``indexer``, ``selection``, ``kpool``)
over the shared compile cache (``compile``). Each family module registers how its kernel keys are built and defines
the GPU implementation of each of its ops under the op's name; ``register_backend`` finds them here by name."""

from . import attention, indexer, k_cache, kpool, selection
from .attention import (
    AttnPlan,
    attn_keys,
    attn_max_logits,
    plan_attn,
    plan_splits,
    plan_tail,
    sparse_attn,
    sparse_attn_with_max_logits,
)
from .compile import TARGETS, kernel, lower_source, pass_configs, program, warmup
from .indexer import gather_index_k, index_logits, index_topk, paged_index_logits, quant_index, store_index_k
from .k_cache import (
    cache_keys,
    dequant_k_cache,
    gather_dequant_k_cache,
    gather_k_cache,
    quant_k_cache,
    store_k_cache,
)
from .kpool import kpool_store_index_k, kpool_topk
from .selection import topk

FAMILIES = (k_cache, attention, indexer, selection, kpool)

__all__ = [
    "FAMILIES",
    "TARGETS",
    "kernel",
    "lower_source",
    "pass_configs",
    "program",
    "warmup",
    "cache_keys",
    "attn_keys",
    "AttnPlan",
    "plan_attn",
    "plan_splits",
    "plan_tail",
    "quant_k_cache",
    "store_k_cache",
    "dequant_k_cache",
    "gather_k_cache",
    "gather_dequant_k_cache",
    "sparse_attn",
    "sparse_attn_with_max_logits",
    "attn_max_logits",
    "quant_index",
    "store_index_k",
    "gather_index_k",
    "index_logits",
    "paged_index_logits",
    "topk",
    "index_topk",
    "kpool_store_index_k",
    "kpool_topk",
]
