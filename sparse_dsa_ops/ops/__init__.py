"""The ``dsa`` ops' contracts: one module per op family, over a small core.

Each family module (``k_cache``, ``attention``, ``indexer``, ``selection``, ``kpool``) holds its ops' schemas,
argument checks, fake kernels, public functions and docstrings; :mod:`.core` declares them (recording each in
:data:`OPS`), attaches backends and holds the checks the families share. A family has the same name in every layer:
its contract ``sparse_dsa_ops.ops.<family>``, its reference ``sparse_dsa_ops.reference.<family>``, its GPU backend
``sparse_dsa_ops._cuda.<family>`` (its ``FAMILY`` record: kernels, warmup, sources, bench and check cases) and its
kernel builders under ``csrc_tl``. Adding a family is adding those modules and its name to :data:`FAMILY_NAMES`.
"""

from importlib import import_module

from .core import (
    MAX_TOPK,
    OPS,
    STRIDE_ALIGN,
    Family,
    KernelSpec,
    OpDef,
    PoolView,
    WarmupSpec,
    register_backend,
    takes_checked,
)

# The op families, in the order their ops are declared: the one registry the package, the CLI and the tests read.
FAMILY_NAMES = ("k_cache", "attention", "indexer", "selection", "kpool")

_MODULES = [import_module(f".{name}", __name__) for name in FAMILY_NAMES]
FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in _MODULES)
# each family's public names (its contract module's ``__all__``) are this package's
globals().update((name, getattr(module, name)) for module in _MODULES for name in module.__all__)

__all__ = [
    "FAMILY_NAMES",
    "FAMILIES",
    "Family",
    "KernelSpec",
    "WarmupSpec",
    "OPS",
    "SCHEMAS",
    "MAX_TOPK",
    "STRIDE_ALIGN",
    "OpDef",
    "PoolView",
    "register_backend",
    "takes_checked",
    *(name for module in _MODULES for name in module.__all__),
]

SCHEMAS = {name: op.schema for name, op in OPS.items()}
