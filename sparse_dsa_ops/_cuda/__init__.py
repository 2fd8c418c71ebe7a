"""The GPU backend: one module per op family (the names of :data:`sparse_dsa_ops.ops.FAMILY_NAMES`) over the shared
compile cache (``compile``). Each family module registers how its kernel keys are built and defines the GPU
implementation of each of its ops under the op's name (``register_backend`` finds them there), its ``SOURCE_OPS``,
``source_keys``, ``warmup_keys_of`` and ``bench_cases``."""

from importlib import import_module

from ..ops import FAMILY_NAMES
from .attention import attn_keys, group_keys, plan_attn, plan_splits, plan_tail, widen_pool_keys
from .compile import TARGETS, kernel, lower_source, pass_configs, program, warmup
from .k_cache import cache_keys

# every family's module: importing one registers its kernel builders with the compile cache
for _name in FAMILY_NAMES:
    import_module(f".{_name}", __name__)

__all__ = [
    "TARGETS",
    "kernel",
    "lower_source",
    "pass_configs",
    "program",
    "warmup",
    "cache_keys",
    "attn_keys",
    "widen_pool_keys",
    "group_keys",
    "plan_attn",
    "plan_splits",
    "plan_tail",
]
