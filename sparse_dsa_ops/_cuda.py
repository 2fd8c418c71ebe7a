"""The GPU backend: picks, compiles, caches and launches the TileLang kernels of ``csrc_tl``.

Kernels are compiled once per specialization (a ``KernelKey``: family + frozen geometry record +
flags), kept in this process, and on disk by TileLang's own cache, so a second process starts
fast. Row and token counts are dynamic in every program, so batches of any size reuse the same
binary. Compiling inside a CUDA graph capture is an error: call :func:`warmup` first.

TileLang is imported only when a kernel is built, so importing the package stays cheap.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .layout import KCacheLayout
from .ops import TOPK_MULTIPLE

__all__ = ["IMPLS", "KernelKey", "AttnPlan", "lower_source", "warmup", "attn_keys", "plan_attn", "cache_keys"]

TARGETS = {"cuda": {"kind": "cuda", "arch": "sm_90a"}, "hip": {"kind": "hip", "mcpu": "gfx950"}}


@dataclass(frozen=True)
class KernelKey:
    """One compiled kernel: ``family`` names the builder, ``spec`` is its frozen geometry record."""

    family: str  # quant | store | dequant | gather_dequant | gather | attn_prefill(_ws) | attn_decode(_ws) | combine
    spec: object  # KCacheLayout, csrc_tl.sparse_attn.AttnGeometry or (d_v, heads, partial head rows)
    flags: tuple = ()  # family-specific: round_scale, slot dtype; "pdl" for a combine launched as a dependent; the CTAs
    # of a persistent prefill kernel

    @property
    def name(self) -> str:
        flags = "_".join(str(f) for f in self.flags)
        return f"{self.family}[{self.spec}{'; ' + flags if flags else ''}]"


def program(key: KernelKey):
    """The TileLang program of ``key`` (a pure function of the key)."""
    from csrc_tl import k_cache, sparse_attn

    fam, spec, flags = key.family, key.spec, key.flags
    if fam == "quant":
        return k_cache.build_quant(spec, round_scale=flags[0], scatter=False)
    if fam == "store":
        return k_cache.build_quant(spec, round_scale=flags[0], scatter=True, slot_dtype=flags[1])
    if fam == "dequant":
        return k_cache.build_dequant(spec, gather=False)
    if fam == "gather_dequant":
        return k_cache.build_dequant(spec, gather=True, slot_dtype=flags[0])
    if fam == "gather":
        return k_cache.build_gather_bytes(spec, slot_dtype=flags[0])
    if fam in ("attn_prefill_ws", "attn_decode_ws"):
        return sparse_attn.build_attn_ws(spec, split=fam == "attn_decode_ws", **({"ctas": flags[0]} if flags else {}))
    if fam in ("attn_prefill", "attn_decode"):
        path = fam.removeprefix("attn_")
        return sparse_attn.build_attn(spec, split=path == "decode", **sparse_attn.DEFAULT_TILES[path])
    if fam == "combine":
        return sparse_attn.build_combine(*spec, pdl="pdl" in flags)
    raise KeyError(fam)


def cache_keys(op: str, layout: KCacheLayout, round_scale: bool = False, slot_dtype: str = "int32") -> list[KernelKey]:
    """The kernels a cache op runs for ``layout``."""
    return {
        "quant_k_cache": [KernelKey("quant", layout, (round_scale,))],
        "store_k_cache": [KernelKey("store", layout, (round_scale, slot_dtype))],
        "dequant_k_cache": [KernelKey("dequant", layout)],
        "gather_dequant_k_cache": [KernelKey("gather_dequant", layout, (slot_dtype,))],
        "gather_k_cache": [KernelKey("gather", layout, (slot_dtype,))],
    }[op]


def attn_keys(kv_kind: str, d_v: int, d_rope: int, heads: int, sm_scale: float, has_topk_length: bool,
              paths: Iterable[str] = ("prefill", "decode"), target: str | None = None,
              q_fp8: bool = False, sm_count: int | None = None) -> list[KernelKey]:
    """The kernels ``sparse_attn`` runs for one geometry on ``target`` (default: this machine's), in
    this order: the prefill kernel; the split decode kernels; the decode's combine (last).

    Where the geometry allows on sm_90 CUDA (any head count), prefill and split decode are
    warp-specialized, else both are the portable kernels. ``kv_kind`` is "bf16", "fp8" or "packed";
    ``q_fp8`` picks the kernels for a float8_e4m3fn q. A persistent prefill kernel
    (:func:`csrc_tl.sparse_attn.ws_persistent`) is compiled for ``sm_count`` CTAs: by default the current GPU's SM
    count, or :data:`csrc_tl.sparse_attn.DEFAULT_CTAS` (an H200's) for another target or without a GPU."""
    from csrc_tl.sparse_attn import DEFAULT_CTAS, AttnGeometry, partial_heads, ws_persistent, ws_supported

    geo = AttnGeometry(d_v, d_rope, heads, kv_kind, has_topk_length, float(sm_scale), q_fp8)
    geo.check()
    hopper = target == "cuda" if target else _is_hopper()
    ws = hopper and ws_supported(geo)
    keys = []
    if "prefill" in paths:
        if ws and ws_persistent(geo, split=False):
            if sm_count is None:
                here = target is None and torch.cuda.is_available()
                sm_count = _sm_count(torch.device("cuda", torch.cuda.current_device())) if here else DEFAULT_CTAS
            keys.append(KernelKey("attn_prefill_ws", geo, (sm_count,)))
        else:
            keys.append(KernelKey("attn_prefill_ws" if ws else "attn_prefill", geo))
    if "decode" in paths:
        keys.append(KernelKey("attn_decode_ws" if ws else "attn_decode", geo))
        # after a warp-specialized split kernel the combine is its programmatic dependent (sm_90)
        keys.append(KernelKey("combine", (d_v, heads, partial_heads(heads, ws)), ("pdl",) if ws else ()))
    return keys


def pass_configs(key: KernelKey) -> dict:
    """TileLang pass configs the kernel of ``key`` is compiled with."""
    from csrc_tl import sparse_attn

    return dict(sparse_attn.WS_PASS_CONFIGS) if key.family in ("attn_prefill_ws", "attn_decode_ws") else {}


def lower_source(key: KernelKey, target: str) -> str:
    """Generated kernel source of ``key`` for ``target`` ('cuda' = sm_90a, 'hip' = gfx950); needs no GPU."""
    import tilelang
    from tilelang import tvm

    tgt = tvm.target.Target(TARGETS[target])
    with tgt:
        return tilelang.lower(program(key), target=tgt).kernel_source


# ----------------------------------------------------------------------------------------------
# Compilation and the in-process cache.

_KERNELS: dict[KernelKey, Callable] = {}
_LOCK = threading.Lock()


def _target() -> str:
    return "hip" if torch.version.hip else "cuda"


@functools.cache
def _is_hopper() -> bool:
    """The current process runs CUDA on sm_90 (the warp-specialized kernels' target)."""
    return _target() == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def _compile(key: KernelKey, func=None) -> Callable:
    """Lower and build ``key`` (from its already elaborated program ``func`` if given)."""
    import tilelang

    return tilelang.compile(program(key) if func is None else func, target=_target(), pass_configs=pass_configs(key))


def kernel(key: KernelKey) -> Callable:
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


def warmup(keys: Iterable[KernelKey], workers: int = 8, progress: bool = True) -> None:
    """Compile ``keys`` ahead of time, in parallel, with a progress line on stderr."""
    todo = [k for k in dict.fromkeys(keys) if k not in _KERNELS]
    if not todo:
        return
    done = 0
    # Programs are elaborated here, one after another: TileLang's frontend builder keeps global
    # state and is not safe to run in several threads. Lowering and nvcc run in parallel threads
    # (as tilelang.par_compile does).
    programs = [(key, program(key)) for key in todo]

    def build(item):
        key, func = item
        fn = _compile(key, func)
        with _LOCK:
            _KERNELS[key] = fn
        return key

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        for key in pool.map(build, programs):
            done += 1
            if progress:
                print(f"\rsparse_dsa_ops: compiled {done}/{len(todo)} kernels ({key.name})".ljust(100), end="",
                      file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# The op implementations (arguments already checked by ops.py).


# The kernels address their inputs from the tensors' data pointers and load up to 16 bytes at once (8
# bf16 values of q, four int32 indices); a pool's rows are read from its start, each with vectors of up to
# 16 bytes that its row width keeps aligned (so 8 for the 264- and 392-byte packed rows).
ALIGN = 16


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte-aligned data pointer: ``x`` itself where it is both, else a copy (the
    caching allocator's blocks are aligned). Only for inputs the kernels read whole, never for pools."""
    x = x.contiguous()
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


def _check_pool(op: str, name: str, pool: torch.Tensor, row_bytes: int) -> None:
    """Raise a ValueError where the kernels cannot address pool ``pool`` (rows of ``row_bytes`` bytes): it
    must start where a row of a 16-byte-aligned pool could (a whole pool, or a slice of one by rows). A
    misaligned load would be a sticky CUDA error that ends the process's use of the device; copying a
    pool per call would cost its whole size, and ``store_k_cache`` must write into the caller's."""
    need = math.gcd(row_bytes, ALIGN)
    if pool.data_ptr() % need:
        raise ValueError(
            f"dsa.{op} on {pool.device.type}: {name} (rows of {row_bytes} bytes) must start at an address that "
            f"is a multiple of {need} bytes, as every row of a {ALIGN}-byte-aligned pool does; its data pointer "
            f"is {pool.data_ptr() % need} bytes past one (a view at a byte offset?). Pass a pool allocated by "
            "torch, or a slice of one by whole rows or pages.")


def _slot_dtype(ids: torch.Tensor) -> str:
    return "int64" if ids.dtype == torch.int64 else "int32"


def _check_quant_layout(op: str, lay: KCacheLayout) -> None:
    """Raise a ValueError for rows the quantizing kernels cannot write: their float32 scales and bf16 tail pairs
    are stored as 4-byte words, so a row must be a multiple of 4 bytes (an even d_rope)."""
    if lay.row_bytes % 4:
        raise ValueError(f"dsa.{op} on a GPU: k_rope must have an even width, got d_rope = {lay.d_rope} (rows of "
                         f"{lay.row_bytes} bytes; the kernels store rows of a multiple of 4 bytes). The CPU "
                         "reference takes any width.")


def quant_k_cache(k_nope, k_rope, round_scale=False):
    lay = KCacheLayout(k_nope.shape[1], 0 if k_rope is None else k_rope.shape[1])
    _check_quant_layout("quant_k_cache", lay)
    out = torch.empty(k_nope.shape[0], lay.row_bytes, dtype=torch.uint8, device=k_nope.device)
    if out.shape[0]:
        fn = kernel(cache_keys("quant_k_cache", lay, round_scale)[0])
        fn(_aligned(k_nope), *([_aligned(k_rope)] if lay.d_rope else []), out)
    return out


def store_k_cache(k_nope, k_rope, cache, loc, round_scale=False):
    lay = KCacheLayout(k_nope.shape[1], 0 if k_rope is None else k_rope.shape[1])
    _check_quant_layout("store_k_cache", lay)
    pool = cache.view(-1, lay.row_bytes)
    if k_nope.shape[0] and pool.shape[0]:
        _check_pool("store_k_cache", "cache", pool, lay.row_bytes)
        fn = kernel(cache_keys("store_k_cache", lay, round_scale, _slot_dtype(loc))[0])
        fn(_aligned(k_nope), *([_aligned(k_rope)] if lay.d_rope else []), _aligned(loc), pool)


def dequant_k_cache(packed):
    lay = KCacheLayout.from_row_bytes(packed.shape[-1])
    rows = _aligned(packed.reshape(-1, lay.row_bytes))  # (read whole: a misaligned view is copied)
    out = torch.empty(rows.shape[0], lay.d_qk, dtype=torch.bfloat16, device=packed.device)
    if rows.shape[0]:
        kernel(cache_keys("dequant_k_cache", lay)[0])(rows, out)
    return out.reshape(*packed.shape[:-1], lay.d_qk)


def _gather(op: str, cache, indices, width: int, dtype: torch.dtype):
    lay = KCacheLayout.from_row_bytes(cache.shape[-1])
    pool = cache.view(-1, lay.row_bytes)
    out = torch.empty(indices.shape[0], width, dtype=dtype, device=cache.device)
    if out.shape[0] and not pool.shape[0]:
        out.zero_()  # every id is out of range of an empty pool
    elif out.shape[0]:
        _check_pool(op, "cache", pool, lay.row_bytes)
        kernel(cache_keys(op, lay, slot_dtype=_slot_dtype(indices))[0])(pool, _aligned(indices), out)
    return out


def gather_k_cache(cache, indices):
    return _gather("gather_k_cache", cache, indices, cache.shape[-1], torch.uint8)


def gather_dequant_k_cache(cache, indices):
    return _gather("gather_dequant_k_cache", cache, indices, KCacheLayout.from_row_bytes(cache.shape[-1]).d_qk,
                   torch.bfloat16)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Split decode on sm_90 (H200 measurements, BENCHMARKS.md): the warp-specialized split kernel wants
# two top-k blocks per split or more (one block leaves it nothing to overlap).
WS_SPLIT_BLOCKS = 2


def plan_splits(tokens: int, heads: int, topk: int, sm_count: int, min_blocks: int = 1) -> int:
    """Splits of the top-k range per (token, head block): 1 (the prefill path) once the grid fills the
    GPU, else as many as keep the whole grid in one wave of one block per SM (a second wave of a few
    blocks doubles the time) while every split keeps at least ``min_blocks`` top-k blocks; then the
    fewest splits with as few blocks per split. GLM decode T 17 (33 blocks) takes 7 splits of 5 blocks
    (the last one 3): the split kernels walk no padding block (H200: 18.1 against 18.8 us over packed
    rows for 6 splits of 3 pairs; BENCHMARKS.md, eleventh session). (Head blocks are counted the same
    for the portable kernels and for the warp-specialized ones, whose blocks are always 64 heads: both
    give one block per token up to 32 heads and 64-head blocks above.)"""
    from csrc_tl.sparse_attn import head_block

    blocks = tokens * math.ceil(heads / head_block(heads))
    if blocks >= sm_count:
        return 1
    n_blocks = topk // TOPK_MULTIPLE
    if n_blocks <= 1:
        return 1
    splits = max(1, min(n_blocks // min_blocks, sm_count // blocks))
    # the fewest splits with as few blocks per split
    return math.ceil(n_blocks / math.ceil(n_blocks / splits))


# The last, partial round of a persistent prefill (items not a multiple of its CTAs, one per SM) keeps a few SMs busy
# for a whole item while the others idle: its tokens take the split path instead, where that splits their top-k
# ranges in TAIL_MIN_SPLITS parts or more and they have TAIL_MIN_BLOCKS top-k blocks or more (a shorter item, or
# one split in two, takes about as long as the split path's own cost: a second kernel, the combine, the partials).
# Measured (H200, BENCHMARKS.md, thirty-first session, runs GL, GP and GQ), GLM packed prefill: T 4096 at 64 heads
# (last 4 tokens in 16 splits) 1435-1440 against 1464-1474 us, at 8 heads 1379-1382 against 1413-1414; T 8192 (last
# 8) 2889-2946 against 2901-2975 in five rounds; top-k 1024 762-763 against 768-774; top-k 512 425-427 against
# 426-427; T 4136 (last 44 in 3 splits) 1462-1489 against 1471-1476; T 4150 (last 58 in 2) 1476-1500 against
# 1473-1489. The prefills of one CTA per item gained nothing measurable (the hardware starts their last CTAs as SMs
# come free, not all at once): DeepSeek bf16 4167-4209 against 4190-4244 us, DeepSeek native FP8 5103-5114 against
# 5095-5143.
TAIL_MIN_BLOCKS = 16
TAIL_MIN_SPLITS = 3


def plan_tail(tokens: int, heads: int, topk: int, ctas: int, sm_count: int) -> tuple[int, int]:
    """``(prefill tokens, splits)`` for a persistent prefill of ``tokens`` on ``ctas`` CTAs: the tokens whose
    (token, head block) items fill whole rounds of the CTAs go to the prefill kernel, and the rest, if any, to the
    split path in ``splits`` parts. ``(tokens, 1)`` where nothing is split off: no partial round, too few tokens for
    one round, or a rest that :func:`plan_splits` would split in fewer than :data:`TAIL_MIN_SPLITS` parts or whose
    items are shorter than :data:`TAIL_MIN_BLOCKS` top-k blocks. GLM packed prefill T 4096 at 64 heads on 132 SMs:
    4092 tokens in 31 rounds, the last 4 in 16 splits."""
    from csrc_tl.sparse_attn import head_block

    per_token = math.ceil(heads / head_block(heads))
    step = ctas // math.gcd(ctas, per_token)  # the fewest tokens whose head blocks fill whole rounds
    main = tokens // step * step
    if main in (0, tokens) or topk // TOPK_MULTIPLE < TAIL_MIN_BLOCKS:
        return tokens, 1
    splits = plan_splits(tokens - main, heads, topk, sm_count, WS_SPLIT_BLOCKS)
    return (main, splits) if splits >= TAIL_MIN_SPLITS else (tokens, 1)


@dataclass(frozen=True)
class AttnPlan:
    """What ``sparse_attn`` launches for one call of ``tokens`` tokens: the prefill kernel over the first
    ``prefill_tokens`` of them (none in a decode), then, where tokens remain (a decode, or a persistent prefill's
    last partial round: :func:`plan_tail`), a split kernel over ``splits`` parts of their top-k ranges followed by
    the combine."""

    tokens: int
    prefill: KernelKey | None  # None in a decode
    prefill_tokens: int
    split: tuple = ()  # (split kernel, combine) where tokens take the split path
    splits: int = 1
    partial_heads: int = 0  # head rows of the split kernel's partial output (the combine's spec[2])

    @property
    def keys(self) -> tuple:
        """Every kernel the call launches, in order."""
        return ((self.prefill,) if self.prefill else ()) + self.split

    def __str__(self) -> str:
        split = f"{self.split[0].family} x{self.splits} + combine" if self.split else ""
        if not self.prefill:
            return split
        if not self.split:
            return self.prefill.family
        return f"{self.prefill.family} + {split} (last {self.tokens - self.prefill_tokens} tokens)"


@functools.lru_cache(maxsize=4096)
def plan_attn(kv_kind: str, d_v: int, d_rope: int, heads: int, sm_scale: float, has_topk_length: bool, q_fp8: bool,
              tokens: int, topk: int, sm_count: int, target: str | None = None) -> AttnPlan:
    """The kernels and split count for one call (``target`` as in :func:`attn_keys`)."""
    geo = (kv_kind, d_v, d_rope, heads, sm_scale, has_topk_length)
    split = tuple(attn_keys(*geo, paths=("decode",), target=target, q_fp8=q_fp8))  # split kernel, combine
    ws = split[0].family == "attn_decode_ws"
    splits = plan_splits(tokens, heads, topk, sm_count, WS_SPLIT_BLOCKS if ws else 1)
    if splits > 1:
        return AttnPlan(tokens, None, 0, split, splits, split[1].spec[2])
    prefill, = attn_keys(*geo, paths=("prefill",), target=target, q_fp8=q_fp8, sm_count=sm_count)
    persistent = prefill.family == "attn_prefill_ws" and bool(prefill.flags)  # (flags: its CTAs)
    main, splits = plan_tail(tokens, heads, topk, prefill.flags[0], sm_count) if persistent else (tokens, 1)
    if splits > 1:
        return AttnPlan(tokens, prefill, main, split, splits, split[1].spec[2])
    return AttnPlan(tokens, prefill, tokens)


def sparse_attn(q, kv, indices, sm_scale, d_v, topk_length=None):
    t_count, heads, d_qk = q.shape
    d_rope = d_qk - d_v
    kind = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.uint8: "packed"}[kv.dtype]
    if heads > 128 or d_v % 64 or d_rope % 16:
        raise NotImplementedError(
            f"dsa.sparse_attn on {q.device.type}: no kernel for heads={heads}, d_v={d_v}, d_rope={d_rope} "
            "(needs heads <= 128, d_v a multiple of 64, d_rope a multiple of 16)")
    out = torch.empty(t_count, heads, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(t_count, heads, dtype=torch.float32, device=q.device)
    pool = kv.reshape(-1, kv.shape[-1])
    idx = indices.reshape(t_count, indices.shape[-1])
    topk = idx.shape[1]
    if t_count == 0:
        return out, lse
    if topk == 0 or pool.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    _check_pool("sparse_attn", "kv", pool, pool.shape[1] * pool.element_size())
    plan = plan_attn(kind, d_v, d_rope, heads, sm_scale, topk_length is not None, q.dtype == torch.float8_e4m3fn,
                     t_count, topk, _sm_count(q.device))
    inputs = (q, idx) if topk_length is None else (q, idx, topk_length)
    main = plan.prefill_tokens
    if main:  # the prefill's tokens
        rows = [_aligned(_rows(x, 0, main)) for x in inputs]
        kernel(plan.prefill)(rows[0], pool, *rows[1:], _rows(out, 0, main), _rows(lse, 0, main))
    if plan.split:  # the rest (a decode's tokens, or a persistent prefill's last round)
        rows = [_aligned(_rows(x, main, t_count)) for x in inputs]
        part_out = torch.empty(t_count - main, plan.splits, plan.partial_heads, d_v, dtype=torch.bfloat16,
                               device=q.device)
        part_lse = torch.empty(t_count - main, plan.splits, heads, dtype=torch.float32, device=q.device)
        kernel(plan.split[0])(rows[0], pool, *rows[1:], part_out, part_lse)
        kernel(plan.split[1])(part_out, part_lse, _rows(out, main, t_count), _rows(lse, main, t_count))
    return out, lse


def _rows(x: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Rows ``[first, end)`` of ``x``: ``x`` itself where they are all of it (no view made per launch)."""
    return x if first == 0 and end == x.shape[0] else x[first:end]


IMPLS = {
    "quant_k_cache": quant_k_cache,
    "store_k_cache": store_k_cache,
    "dequant_k_cache": dequant_k_cache,
    "gather_k_cache": gather_k_cache,
    "gather_dequant_k_cache": gather_dequant_k_cache,
    "sparse_attn": sparse_attn,
}
