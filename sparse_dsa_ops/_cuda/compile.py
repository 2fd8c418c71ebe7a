"""Compiling, caching and warming up the TileLang kernels of ``csrc_tl``.

A kernel is named by a key: a frozen record that spells out its whole specialization. Each op family's GPU module
registers, once, how a key of its own becomes a TileLang program (:func:`register_builder`); this module lowers and
builds it, keeps it for the process (TileLang's disk cache keeps it across processes) and refuses to compile inside
a CUDA graph capture. Row and token counts are dynamic in every program, so batches of any size reuse the binary.

TileLang is imported only when a kernel is built, so importing the package stays cheap.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch

__all__ = [
    "TARGETS",
    "register_builder",
    "program",
    "pass_configs",
    "lower",
    "lower_source",
    "device_target",
    "kernel",
    "warmup",
]

# The targets ``source`` and CI lower for; the runtime builds for its kind's entry with the current GPU's arch.
TARGETS = {"cuda": {"kind": "cuda", "arch": "sm_90a"}, "hip": {"kind": "hip", "mcpu": "gfx950"}}


@dataclass(frozen=True)
class _Builder:
    build: Callable[[object], object]  # key -> TileLang program
    pass_configs: Callable[[object], dict]


_BUILDERS: dict[Hashable, _Builder] = {}


def register_builder(
    kind: Hashable, build: Callable[[object], object], configs: Callable[[object], dict] | None = None
) -> None:
    """Register how keys of type ``kind`` (a family's typed key: a frozen dataclass with a ``name``) become
    programs."""
    _BUILDERS[kind] = _Builder(build, configs or (lambda key: {}))


def _builder(key) -> _Builder:
    return _BUILDERS[type(key)]


def program(key):
    """The TileLang program of ``key`` (a pure function of the key)."""
    return _builder(key).build(key)


def pass_configs(key) -> dict:
    """TileLang pass configs the kernel of ``key`` is compiled with."""
    return _builder(key).pass_configs(key)


def lower(key, target: str):
    """TileLang's lowering of ``key`` for ``target`` ('cuda' = sm_90a, 'hip' = gfx950) exactly as the build lowers
    it (a ``CompiledArtifact``); needs no GPU."""
    import tilelang
    from tilelang import tvm

    func = program(key)
    # the context TileLang's JIT lowers in (tilelang/jit/kernel.py): optimization level 3, the kernel's pass configs,
    # the target current
    configs = tvm.transform.PassContext(opt_level=3, config=pass_configs(key))
    with configs, tvm.target.Target(TARGETS[target]) as tgt:
        return tilelang.lower(func, target=tgt)


def lower_source(key, target: str) -> str:
    """Generated kernel source of ``key`` for ``target`` ('cuda' = sm_90a, 'hip' = gfx950), the source the build
    compiles; needs no GPU."""
    return lower(key, target).kernel_source


_KERNELS: dict[Hashable, Callable] = {}
_LOCK = threading.Lock()


def target() -> str:
    """This process's kernel target: 'hip' on ROCm builds of torch, else 'cuda'."""
    return "hip" if torch.version.hip else "cuda"


def device_target() -> dict:
    """The TileLang target this process builds for: its kind's :data:`TARGETS` entry with the current GPU's arch,
    named as TileLang's own detection names it (sm_90a on an H100 or H200, gfx950 on an MI350 or MI355)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if target() == "hip":
        return {**TARGETS["hip"], "mcpu": props.gcnArchName.split(":")[0]}
    from tilelang.contrib import nvcc

    return {**TARGETS["cuda"], "arch": f"sm_{nvcc.get_target_arch((props.major, props.minor))}"}


@functools.cache
def is_hopper() -> bool:
    """The current process runs CUDA on sm_90 (the warp-specialized kernels' target)."""
    return target() == "cuda" and torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _compile(key, func=None) -> Callable:
    """Lower and build ``key`` (from its already elaborated program ``func`` if given)."""
    import tilelang

    func = program(key) if func is None else func
    return tilelang.compile(func, target=device_target(), pass_configs=pass_configs(key))


def kernel(key) -> Callable:
    """The compiled kernel of ``key``, compiled now if this process has not yet (never inside a graph capture)."""
    fn = _KERNELS.get(key)
    if fn is not None:
        return fn
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"sparse_dsa_ops: kernel {key.name} is not compiled yet and cannot be compiled inside a CUDA graph "
            "capture; call sparse_dsa_ops.warmup(...) for this geometry (or run the op once) before capturing"
        )
    with _LOCK:
        if key not in _KERNELS:
            _KERNELS[key] = _compile(key)
    return _KERNELS[key]


def warmup(keys: Iterable, workers: int = 8, progress: bool = True) -> None:
    """Compile ``keys`` ahead of time in ``workers`` threads, with a progress line on stderr."""
    todo = [k for k in dict.fromkeys(keys) if k not in _KERNELS]
    if not todo:
        return

    def build(key, func):
        fn = _compile(key, func)
        with _LOCK:
            _KERNELS[key] = fn
        return key

    def show(text: str) -> None:
        if progress:
            print(f"\rsparse_dsa_ops: {text}".ljust(110), end="", file=sys.stderr, flush=True)

    # Programs are elaborated here, one after another: TileLang's frontend builder keeps global state and is not
    # safe to run in several threads. Each program is handed to a thread as soon as it exists, so that nvcc runs
    # while the next one is elaborated (lowering holds the GIL; compile processes were slower still: BENCHMARKS.md).
    # TileLang's per-kernel log lines would break the progress line: it says only warnings meanwhile.
    tl_log = logging.getLogger("tilelang")
    level = tl_log.level
    tl_log.setLevel(max(level, logging.WARNING))
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            pending = []
            for i, key in enumerate(todo):
                show(f"elaborating kernel {i + 1}/{len(todo)} ({key.name})")
                pending.append(pool.submit(build, key, program(key)))
            for done, future in enumerate(as_completed(pending), 1):
                show(f"compiled {done}/{len(todo)} kernels ({future.result().name})")
    finally:
        tl_log.setLevel(level)
    if progress:
        print(file=sys.stderr)
