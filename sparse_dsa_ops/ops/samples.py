"""The self-check's cases (``python -m sparse_dsa_ops check``): each family's contract module makes its own with
these pieces, and its :class:`~.core.Family` record lists them. On a GPU a case runs the op against the reference on
the CPU; on the CPU, where the ops are the reference, it checks the op's contract (its fake kernel's shapes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layout import KCacheLayout

__all__ = ["CHECK_GEOMETRIES", "Case", "case", "k_rows", "k_pool", "slot_ids", "sm_count"]

# The check's rows: DeepSeek-V3.2's and GLM-5.3-Flash's (its public config): d_nope, d_rope, heads
CHECK_GEOMETRIES = {"512+64 DeepSeek-V3.2": (512, 64, 128), "512+0 GLM-5.3-Flash": (512, 0, 64)}


@dataclass
class Case:
    op: str
    geometry: str
    make: Callable[[torch.Generator], tuple]  # CPU inputs
    run: Callable[..., object]  # the op
    ref: Callable[..., object]  # the reference on CPU inputs
    exact: bool  # bytes must match; otherwise -inf at the same places and a small relative L2 error elsewhere
    keys: Callable[[torch.device], list]  # the kernels the op runs for these inputs on a GPU (compiled up front)


def _in_place(op: Callable, arg: int) -> Callable:
    """``op`` (which writes its argument ``arg`` in place and returns nothing) as a function of a copy of its inputs
    that returns what it wrote."""

    def run(*args):
        target = args[arg].clone()
        op(*args[:arg], target, *args[arg + 1 :])
        return target

    return run


def _output(op: Callable, i: int) -> Callable:
    """``op`` returning only its output ``i``."""
    return lambda *args: op(*args)[i]


def case(op: str, geometry: str, make, keys, exact=True, writes: int | None = None, output=None, name="") -> Case:
    """A case of ``dsa.<op>`` against ``reference.<op>``; ``writes``: the argument the op writes in place;
    ``output``: the one output of several that is compared (default: the first)."""
    from .. import reference

    run, ref = getattr(torch.ops.dsa, op), getattr(reference, op)
    if writes is not None:
        run, ref = _in_place(run, writes), _in_place(ref, writes)
    if output is not None:
        run, ref = _output(run, output), _output(ref, output)
    return Case(name or op, geometry, make, run, ref, exact, keys)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_rows(gen: torch.Generator, n: int, lay: KCacheLayout) -> tuple:
    rope = torch.randn(n, lay.d_rope, generator=gen).bfloat16() if lay.d_rope else None
    return torch.randn(n, lay.d_nope, generator=gen).bfloat16(), rope


def k_pool(gen: torch.Generator, lay: KCacheLayout, slots: int) -> torch.Tensor:
    from .. import reference

    return reference.quant_k_cache(*k_rows(gen, slots, lay)).reshape(-1, 64, lay.row_bytes)


def slot_ids(gen: torch.Generator, m: int, slots: int) -> torch.Tensor:
    ids = torch.randint(0, slots, (m,), generator=gen, dtype=torch.int32)
    ids[::7] = -1
    return ids
