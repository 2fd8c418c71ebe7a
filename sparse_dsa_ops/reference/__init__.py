"""Pure-Torch implementations of every ``dsa`` op: the CPU backend and the oracle of the tests, one module per op
family (:data:`sparse_dsa_ops.ops.FAMILY_NAMES`).

Each function has its op's signature and trusts that the op's checker has checked the arguments. They gather the
selected rows (no dense masks), accumulate in float32 and run on any device.

Letters used in shapes: N rows to quantize or store, M gathered slots, T query tokens, H heads,
K top-k entries per token, S slots in the pool (pages x page size), D row width, B packed row bytes; for the
indexer Hi its heads, R query rows of a paged batch, P pages of ``page`` tokens, W logit columns of a row.
"""

from importlib import import_module

from ..ops import FAMILY_NAMES

_MODULES = [import_module(f".{name}", __name__) for name in FAMILY_NAMES]
globals().update((name, getattr(module, name)) for module in _MODULES for name in module.__all__)

__all__ = [name for module in _MODULES for name in module.__all__]
