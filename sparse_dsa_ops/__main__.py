"""``python -m sparse_dsa_ops [check | source | bench]``.

* ``check`` (the default): the environment, then every op at the DeepSeek V3.2 and GLM-5.3-Flash
  geometries, as a table. On a CUDA GPU each op's kernels are checked against the reference run on the CPU.
  On the CPU the ops *are* the reference, so there it checks only each op's contract: that it is registered,
  accepts valid inputs, and that its fake kernel (what ``torch.compile`` traces) gives the shapes and dtypes it
  returns.
* ``source``: the generated TileLang kernel source of an op for one geometry, for CUDA (sm_90a) or
  HIP (gfx950); needs no GPU.
* ``bench``: GPU timings with CUDA-graph replay beside a bf16 matmul and a device copy measured in
  the same run, and each target of docs/design.md met or missed by how much (``--rounds N``: the median and the
  range of N timings).

A mistake in the arguments ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import ops, reference
from .kpool import kpool_width
from .layout import QUANT_TILE, KCacheLayout

# DeepSeek-V3.2 and GLM-5.3-Flash (its public config): d_nope, d_rope, heads
GEOMETRIES = {"deepseek": (512, 64, 128), "glm": (512, 0, 64)}


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def environment() -> list[tuple[str, str]]:
    try:
        import tilelang

        tl = tilelang.__version__
    except Exception as err:  # a broken install should not stop the report
        tl = f"not importable ({type(err).__name__}: {err})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        device = "no CUDA device; ops run the pure-Torch reference on the CPU"
    return [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("tilelang", tl),
        ("device", device),
    ]


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


def _case(op: str, geometry: str, make, keys, exact=True, writes: int | None = None, output=None, name="") -> Case:
    """A case of ``dsa.<op>`` against ``reference.<op>``; ``writes``: the argument the op writes in place;
    ``output``: the one output of several that is compared (default: the first)."""
    run, ref = getattr(torch.ops.dsa, op), getattr(reference, op)
    if writes is not None:
        run, ref = _in_place(run, writes), _in_place(ref, writes)
    if output is not None:
        run, ref = _output(run, output), _output(ref, output)
    return Case(name or op, geometry, make, run, ref, exact, keys)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cache_keys(op: str, lay: KCacheLayout, round_scale: bool, device: torch.device) -> list:
    """The kernel of the K-cache op ``op`` for rows of ``lay`` and int32 slot ids (every case's)."""
    from ._cuda import k_cache

    return k_cache.cache_keys(op, lay, round_scale)


def _attn_keys(kind: str, lay: KCacheLayout, heads: int, tokens: int, topk: int, device, max_logits=False) -> list:
    """The kernels of sparse_attn's launch plan (with ``max_logits``: sparse_attn_with_max_logits's) for the inputs
    of :func:`_attn_inputs` on ``device``."""
    from ._cuda import attention

    scale, q_fp8, sms = lay.d_qk**-0.5, kind == "fp8", _sms(device)
    plan = attention.plan_attn(
        kind, lay.d_nope, lay.d_rope, heads, scale, False, q_fp8, tokens, topk, sms, max_logits=max_logits
    )
    # the split path's tokens get their maxima from attn_max_logits, which gathers packed rows with a kernel
    gather = max_logits and plan.split and kind == "packed"
    return list(plan.keys) + (_cache_keys("gather_dequant_k_cache", lay, False, device) if gather else [])


def _index_keys(op: str, device: torch.device) -> list:
    """The kernel of the indexer op ``op`` for the inputs of :func:`_indexer_cases` (FP8 queries, unrounded scales,
    int32 slot ids), as ``source`` picks it for those arguments."""
    from ._cuda import indexer
    from ._cuda.compile import target

    args = dict(index_dim=INDEX_DIM, page=INDEX_PAGE, heads=INDEX_HEADS, q="fp8", round_scale=False, slot_dtype="int32")
    return indexer.source_keys(op, argparse.Namespace(**args, target=target()))


def _index_topk_keys(tokens: int, keys: int, device: torch.device) -> list:
    """The kernels of index_topk for the inputs of :func:`_indexer_cases`."""
    from ._cuda import indexer

    return indexer.index_topk_keys(INDEX_HEADS, INDEX_DIM, "float8_e4m3fn", tokens, keys, INDEX_TOPK, _sms(device))


def _topk_keys(rows: int, width: int, k: int, page: int, device: torch.device) -> list:
    """The kernels of topk's plan for ``rows`` rows of ``width`` (to slots of ``page``-token pages, 0: positions)."""
    from ._cuda import selection

    return selection.plan_topk(rows, width, _sms(device)).keys(k, page, False, False)


def _k_rows(gen: torch.Generator, n: int, lay: KCacheLayout) -> tuple:
    rope = torch.randn(n, lay.d_rope, generator=gen).bfloat16() if lay.d_rope else None
    return torch.randn(n, lay.d_nope, generator=gen).bfloat16(), rope


def _k_pool(gen: torch.Generator, lay: KCacheLayout, slots: int) -> torch.Tensor:
    return reference.quant_k_cache(*_k_rows(gen, slots, lay)).reshape(-1, 64, lay.row_bytes)


def _slot_ids(gen: torch.Generator, m: int, slots: int) -> torch.Tensor:
    ids = torch.randint(0, slots, (m,), generator=gen, dtype=torch.int32)
    ids[::7] = -1
    return ids


def _cache_cases(geo: str, n_rows: int, slots: int) -> list[Case]:
    """The K-cache ops at ``geo``'s rows. The quantizer runs with unrounded scales, the store with scales rounded to
    powers of two: either op has a kernel for each, and the check compiles one of each op's."""
    lay = KCacheLayout(*GEOMETRIES[geo][:2])

    def store(g):
        return (
            *_k_rows(g, n_rows, lay),
            _k_pool(g, lay, slots),
            torch.randperm(slots, generator=g)[:n_rows].int(),
            True,
        )

    def gather(g):
        return _k_pool(g, lay, slots), _slot_ids(g, n_rows, slots)

    def keys(op, round_scale=False):
        return functools.partial(_cache_keys, op, lay, round_scale)

    return [
        _case("quant_k_cache", geo, lambda g: (*_k_rows(g, n_rows, lay), False), keys("quant_k_cache")),
        _case("store_k_cache", geo, store, keys("store_k_cache", True), writes=2),
        _case("dequant_k_cache", geo, lambda g: (_k_pool(g, lay, slots),), keys("dequant_k_cache")),
        _case("gather_k_cache", geo, gather, keys("gather_k_cache")),
        _case("gather_dequant_k_cache", geo, gather, keys("gather_dequant_k_cache")),
    ]


# The kv kinds of sparse_attn's cases at each geometry, over the check's tokens (the prefill path on a GPU) and over
# DECODE_TOKENS (the split decode path): packed rows, the serving cache, at both geometries and in both paths, bf16
# and native FP8 rows in DeepSeek's prefill. Not every kind at every geometry and path: each attention kernel takes
# seconds to lower, one after another, before the first case.
PREFILL_KV = {"deepseek": ("bf16", "fp8"), "glm": ("packed",)}
DECODE_KV = {"deepseek": ("packed",), "glm": ("packed",)}
DECODE_TOKENS = 2


def _attn_inputs(gen, kind: str, lay: KCacheLayout, heads: int, tokens: int, topk: int, slots: int) -> tuple:
    q = torch.randn(tokens, heads, lay.d_qk, generator=gen).bfloat16()
    kv = _k_pool(gen, lay, slots)
    if kind == "bf16":
        kv = reference.dequant_k_cache(kv)
    elif kind == "fp8":  # native FP8: float8 q over float8 rows
        q, kv = q.to(torch.float8_e4m3fn), reference.dequant_k_cache(kv).to(torch.float8_e4m3fn)
    idx = torch.randint(-1, slots, (tokens, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx, lay.d_qk**-0.5, lay.d_nope, None


def _attn_cases(geo: str, tokens: int, topk: int, slots: int) -> list[Case]:
    """sparse_attn at ``geo`` (PREFILL_KV, DECODE_KV), then attn_max_logits and sparse_attn_with_max_logits's maxima
    over the decode's packed inputs. Those two add no kernel: the gather of packed rows (the cache cases') and the
    decode's kernels; sparse_attn_with_max_logits's prefill kernel (the ``sink_max`` variant) would be one more
    attention kernel to lower."""
    d_nope, d_rope, heads = GEOMETRIES[geo]
    lay = KCacheLayout(d_nope, d_rope)

    def make(kind, t_count, n_args=6):
        return lambda g: _attn_inputs(g, kind, lay, heads, t_count, topk, slots)[:n_args]

    def attn(kind, t_count):
        name = f"sparse_attn {kind}" if t_count == tokens else f"sparse_attn T{t_count} {kind}"
        keys = functools.partial(_attn_keys, kind, lay, heads, t_count, topk)
        return _case("sparse_attn", geo, make(kind, t_count), keys, exact=False, name=name)

    cases = [attn(kind, tokens) for kind in PREFILL_KV[geo]] + [attn(kind, DECODE_TOKENS) for kind in DECODE_KV[geo]]
    decode = make("packed", DECODE_TOKENS)
    gather = functools.partial(_cache_keys, "gather_dequant_k_cache", lay, False)
    with_max = functools.partial(_attn_keys, "packed", lay, heads, DECODE_TOKENS, topk, max_logits=True)
    return cases + [
        _case("attn_max_logits", geo, make("packed", DECODE_TOKENS, 5), gather, exact=False),
        _case("sparse_attn_with_max_logits", geo, decode, with_max, exact=False, output=2),
    ]


def _cache_and_attention_cases(n_rows: int, tokens: int, topk: int, slots: int) -> list[Case]:
    """The K-cache ops and sparse attention at DeepSeek-V3.2's and GLM-5.3-Flash's rows."""
    return [c for geo in GEOMETRIES for c in _cache_cases(geo, n_rows, slots) + _attn_cases(geo, tokens, topk, slots)]


INDEX_DIM, INDEX_PAGE = 128, 64
INDEX_HEADS = 64  # DeepSeek-V3.2's indexer heads
INDEX_TOPK = 256  # index_topk's k in the check (below every case's key count)


def _indexer_cases(n_rows: int, tokens: int, keys: int, batch: int) -> list[Case]:
    """The indexer's six ops at DeepSeek-V3.2's indexer (64 heads of 128; the cache ops do not depend on heads)."""
    geo, heads = "deepseek", INDEX_HEADS
    pages = -(-keys // INDEX_PAGE)

    def cache(gen, pages=pages):
        c = torch.zeros(pages, INDEX_PAGE * (INDEX_DIM + 4), dtype=torch.uint8)
        k = torch.randn(pages * INDEX_PAGE, INDEX_DIM, generator=gen).bfloat16()
        reference.store_index_k(k, c, torch.arange(pages * INDEX_PAGE, dtype=torch.int32))
        return c

    def quant_inputs(gen):
        return torch.randn(n_rows, INDEX_DIM, generator=gen).bfloat16(), False

    def fp8(gen, *shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(torch.float8_e4m3fn)

    def slot_ids(gen):
        ids = torch.randint(0, pages * INDEX_PAGE, (n_rows,), generator=gen, dtype=torch.int32)
        ids[::7] = -1
        return ids

    def store_inputs(gen):
        store_pages = 2 * n_rows // INDEX_PAGE  # half the slots written
        loc = torch.randperm(store_pages * INDEX_PAGE, generator=gen)[:n_rows].int()
        return torch.randn(n_rows, INDEX_DIM, generator=gen).bfloat16(), cache(gen, store_pages), loc, False

    def logits_inputs(gen):
        ke = torch.randint(0, keys + 1, (tokens,), generator=gen, dtype=torch.int32)
        ks = (ke - torch.randint(0, keys // 2, (tokens,), generator=gen, dtype=torch.int32)).clamp_min(0)
        k = fp8(gen, keys, INDEX_DIM)
        return (
            fp8(gen, tokens, heads, INDEX_DIM),
            k,
            torch.rand(keys, generator=gen) + 0.5,
            torch.randn(tokens, heads, generator=gen),
            ks,
            ke,
        )

    def paged_inputs(gen):
        max_pages = pages // batch
        table = torch.randperm(pages, generator=gen)[: batch * max_pages].int().reshape(batch, max_pages)
        lengths = torch.randint(0, max_pages * INDEX_PAGE + 1, (batch * 2,), generator=gen, dtype=torch.int32)
        q = fp8(gen, batch, 2, heads, INDEX_DIM)
        return q, cache(gen), torch.randn(batch * 2, heads, generator=gen), lengths, table

    def topk_inputs(gen):
        # small integers and powers of two: every logit is exact on any device, so the selections match bit for bit
        def ints(*shape):
            return torch.randint(-3, 4, shape, generator=gen).float()

        ke = torch.arange(tokens, dtype=torch.int32) + (keys - tokens + 1)  # causal
        ks = torch.randint(-2, keys // 4, (tokens,), generator=gen, dtype=torch.int32)
        k_scale = torch.exp2(torch.randint(-4, 2, (keys,), generator=gen).float())
        q, k = ints(tokens, heads, INDEX_DIM).to(torch.float8_e4m3fn), ints(keys, INDEX_DIM).to(torch.float8_e4m3fn)
        return q, k, k_scale, ints(tokens, heads), ks, ke, INDEX_TOPK, INDEX_TOPK + 64

    def kernels(op):
        return functools.partial(_index_keys, op)

    return [
        _case("quant_index", geo, quant_inputs, kernels("quant_index")),
        _case("store_index_k", geo, store_inputs, kernels("store_index_k"), writes=1),
        _case("gather_index_k", geo, lambda g: (cache(g), slot_ids(g), INDEX_DIM), kernels("gather_index_k")),
        _case("index_logits", geo, logits_inputs, kernels("index_logits"), exact=False),
        _case("paged_index_logits", geo, paged_inputs, kernels("paged_index_logits"), exact=False),
        _case("index_topk", geo, topk_inputs, functools.partial(_index_topk_keys, tokens, keys)),
    ]


def _topk_cases(rows: int, width: int, k: int) -> list[Case]:
    """Exact top-k: a few long rows (a row split over CTAs on a GPU) and many short rows to pool slots."""
    long_rows, long_width, page = 4, width * 8, 64  # (page: topk's default page_size, which the slot case keeps)

    def few_long(gen):
        logits = torch.randn(long_rows, long_width, generator=gen)
        return logits, torch.randint(0, long_width + 1, (long_rows,), generator=gen, dtype=torch.int32), k

    def many_paged(gen):
        logits = torch.randn(rows, width, generator=gen)
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
        table = torch.randperm(rows * width // page, generator=gen).int().reshape(rows, width // page)
        table[:, ::5] = -1
        return logits, lengths, k, None, table

    split_keys = functools.partial(_topk_keys, long_rows, long_width, k, 0)
    slot_keys = functools.partial(_topk_keys, rows, width, k, page)
    return [
        _case("topk", "few long rows", few_long, split_keys),
        _case("topk", "many rows", many_paged, slot_keys, name="topk to slots"),
    ]


def _kpool_cases(pools: int, rows: int, width: int, k: int) -> list[Case]:
    """GLM-5.3-Flash's k-pool ops: pools of 16 tokens compressed into the index-K cache (on a GPU, softmax rounds
    its last float32 bit otherwise than the CPU's now and then, which may move one FP8 code: not exact), and k pools of
    each row selected and expanded to token slots through a page table, with the tail."""
    from ._cuda import kpool

    geo, kp, page = "glm", kpool.KPOOL, INDEX_PAGE

    def store(gen):
        k_rows = torch.randn(pools, kp, INDEX_DIM, generator=gen).bfloat16()
        gate = torch.randn(pools, kp, INDEX_DIM, generator=gen).bfloat16()
        ape = torch.randn(kp, INDEX_DIM, generator=gen).bfloat16()
        cache = torch.zeros(2 * pools // page, page * (INDEX_DIM + 4), dtype=torch.uint8)
        loc = torch.randperm(cache.shape[0] * page, generator=gen)[:pools].int()  # distinct slots, half the cache
        loc[::7] = -1
        return k_rows, gate, ape, cache, loc, False

    def select(gen):
        logits = torch.randn(rows, width, generator=gen)
        lengths = torch.randint(0, width * kp + kp, (rows,), generator=gen, dtype=torch.int32)
        token_pages = width * kp // page + 1
        table = torch.randperm(rows * token_pages, generator=gen).int().reshape(rows, token_pages)
        return logits, lengths, k, kp, None, table, None, page, -(-kpool_width(k, kp) // 64) * 64

    def keys(op, device):
        args = argparse.Namespace(index_dim=INDEX_DIM, page=page, round_scale=False, slot_dtype="int32", k=k)
        return kpool.source_keys(op, args)

    return [
        _case("kpool_store_index_k", geo, store, functools.partial(keys, "kpool_store_index_k"), False, writes=3),
        _case("kpool_topk", geo, select, functools.partial(keys, "kpool_topk"), name="kpool_topk to slots"),
    ]


def _check_cases(on_cpu: bool) -> list[Case]:
    """Every op's cases; on a GPU, at sizes where 256 tokens take the attention prefill path at both geometries,
    2 tokens the split decode path, and a few long top-k rows are split over CTAs."""
    if on_cpu:
        return (
            _cache_and_attention_cases(n_rows=4096, tokens=4, topk=2048, slots=16384)
            + _indexer_cases(n_rows=4096, tokens=8, keys=1024, batch=2)
            + _topk_cases(rows=8, width=1024, k=256)
            + _kpool_cases(pools=256, rows=8, width=512, k=16)
        )
    return (
        _cache_and_attention_cases(n_rows=65536, tokens=256, topk=2048, slots=65536)
        + _indexer_cases(n_rows=65536, tokens=128, keys=4096, batch=4)
        + _topk_cases(rows=256, width=8192, k=2048)
        + _kpool_cases(pools=65536, rows=64, width=8192, k=128)
    )


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _to(args: tuple, device: torch.device) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _warm_up_check(cases: list[Case], device: torch.device) -> None:
    """Compile the kernels ``cases`` run on ``device`` (each case names its own), in parallel, before the first case
    (one after another they take minutes); the progress line says what it is doing."""
    print("compiling the check's kernels in parallel (TileLang's disk cache makes the next run fast)", flush=True)
    from csrc_tl.sparse_attn.keys import AttnKey

    from . import _cuda

    # the attention kernels first: their nvcc compiles are the longest, and they run beside the lowering of the rest
    keys = sorted((key for case in cases for key in case.keys(device)), key=lambda k: not isinstance(k, AttnKey))
    _cuda.warmup(keys, workers=16)


def _compare(got: torch.Tensor, want: torch.Tensor, exact: bool) -> tuple[bool, str]:
    """Whether ``got`` matches the reference's ``want``: the same bytes, or infinities at the same places and a
    relative L2 error of at most 1e-2 over the finite entries."""
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)}, reference {list(want.shape)}"
    if exact:
        ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return ok, "bytes equal" if ok else "bytes differ"
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        return False, "inf or NaN at other places"
    err = ((got[finite] - want[finite]).norm() / want[finite].norm().clamp_min(1e-30)).item()
    return err <= 1e-2, f"rel L2 {err:.1e}"


def _fake_matches(case: Case, inputs: tuple, got: torch.Tensor) -> tuple[bool, str]:
    """Whether the op's fake kernel, run on fake copies of ``inputs``, gives ``got``'s shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = _first(case.run(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs)))
    if (fake.shape, fake.dtype) != (got.shape, got.dtype):
        return False, f"fake kernel gives {fake.dtype} {list(fake.shape)}, the op {got.dtype} {list(got.shape)}"
    return True, "fake kernel agrees"


def check(device: torch.device) -> int:
    """Run every op on ``device`` against the reference on the CPU (on the CPU, where the ops are the reference,
    against their fake kernels); print a table; return failures."""
    for key, value in environment():
        print(f"{key:<10}{value}")
    print()
    on_cpu = device.type == "cpu"
    if on_cpu:
        print(
            "No GPU: the ops run the reference itself, so this checks each op's contract on the CPU (it is\n"
            "registered, accepts these inputs, and its fake kernel, what torch.compile traces, gives the shapes and\n"
            "dtypes it returns), not the GPU kernels. Run it on a GPU to check those against the reference.\n"
        )
    cases = _check_cases(on_cpu)
    if not on_cpu:
        _warm_up_check(cases, device)
    rows, failures = [], 0
    for case in cases:
        gen = torch.Generator().manual_seed(0)
        inputs = case.make(gen)
        try:
            got = _first(case.run(*_to(inputs, device))).cpu()
            ok, detail = (
                _fake_matches(case, inputs, got) if on_cpu else _compare(got, _first(case.ref(*inputs)), case.exact)
            )
            dev_inputs = _to(inputs, device)
            ms = _time_ms(lambda c=case, a=dev_inputs: c.run(*a), device, 3 if on_cpu else 20)
            status = f"{'ok' if ok else 'FAIL'} ({detail})"
        except Exception as err:  # report every op, even after one fails
            ok, ms, status = False, float("nan"), f"ERROR {type(err).__name__}: {err}"
        failures += not ok
        rows.append([case.op, case.geometry, str(device), status, f"{ms:.3f}"])
    print(format_table(["op", "geometry", "device", "status", "ms"], rows))
    print(f"\n{len(rows) - failures} of {len(rows)} ok")
    return failures


def _source_families() -> dict:
    """Each op with kernels -> its family's GPU module (each family declares its ``SOURCE_OPS``)."""
    from . import _cuda

    return {op: family for family in _cuda.FAMILIES for op in family.SOURCE_OPS}


def _source_errors(args: argparse.Namespace) -> str | None:
    """What is wrong with ``source``'s geometry arguments (the ops' limits), or None."""
    if args.d_nope <= 0 or args.d_nope % QUANT_TILE:
        return f"--d-nope must be a positive multiple of {QUANT_TILE}, got {args.d_nope}"
    if args.d_rope < 0 or args.d_rope % ops.D_ROPE_MULTIPLE:
        return f"--d-rope must be 0 or a positive multiple of {ops.D_ROPE_MULTIPLE}, got {args.d_rope}"
    if not 1 <= args.heads <= ops.MAX_HEADS:
        return f"--heads must be in 1..{ops.MAX_HEADS}, got {args.heads}"
    if args.index_dim <= 0 or args.index_dim % ops.INDEX_DIM_MULTIPLE:
        return f"--index-dim must be a positive multiple of {ops.INDEX_DIM_MULTIPLE}, got {args.index_dim}"
    if args.page < 0:
        return f"--page must be 0 or more, got {args.page}"
    if not 1 <= args.k <= ops.MAX_TOPK:
        return f"--k must be in 1..{ops.MAX_TOPK}, got {args.k}"
    if args.op == "sparse_attn" and args.q == "fp8" and args.kv == "bf16":
        return "--q fp8 needs --kv fp8 or --kv packed"
    return None


def source(args: argparse.Namespace) -> int:
    """Print the generated source of every kernel the op runs for the geometry."""
    from . import _cuda

    for key in _source_families()[args.op].source_keys(args.op, args):
        print(f"// ===== {key.name}, target {args.target} ({_cuda.TARGETS[args.target]}) =====")
        print(_cuda.lower_source(key, args.target))
    return 0


# ----------------------------------------------------------------------------------------------
# bench


def _graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Microseconds per call of ``fn``: a CUDA graph that holds ``reps`` calls is replayed five times, and
    the fastest replay's mean per call is returned (BENCHMARKS.md: "the best of 5 replays")."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) * 1e3 / reps)
    return best


def _ceilings() -> dict[str, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = _graph_time_us(lambda: torch.mm(a, b, out=c), reps=5)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # the best of a byte copy and a word copy of the same 1 GiB (torch picks different kernels)
    copy_us = min(
        _graph_time_us(lambda: dst.copy_(src), reps=5),
        _graph_time_us(lambda: dst.view(torch.int64).copy_(src.view(torch.int64)), reps=5),
    )
    fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # (column-major b, as cuBLASLt needs)
    one = torch.ones((), device="cuda")
    fp8_us = _graph_time_us(lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16), reps=5)
    return {
        "matmul_tflops": 2 * 8192**3 / mm_us / 1e6,
        "fp8_matmul_tflops": 2 * 8192**3 / fp8_us / 1e6,
        "copy_gbps": 2 * (1 << 30) / copy_us / 1e3,
    }


def bench_cases() -> list[dict]:
    """Every family's bench cases (each family's GPU module declares its own, with their targets)."""
    from . import _cuda

    return [case for family in _cuda.FAMILIES for case in family.bench_cases()]


def targets() -> dict[str, tuple]:
    """The target of each bench case that has one: (bound, value, unit)."""
    return {c["name"]: c["target"] for c in bench_cases() if c.get("target")}


def target_status(target: tuple | None, us: float, rate: float, ratio: float) -> str:
    """The bench's target cell for a case with ``target`` (bound, value, unit) timed at ``us`` microseconds (``rate``
    in TFLOPS or GB/s, ``ratio`` to its ceiling, or its time over its roof for the unit "x roof"): the target and
    whether it is met, by how much, or by how much it is missed; "" for a case without a target."""
    if not target:
        return ""
    bound, value, unit = target
    got = {"TFLOPS": rate, "us": us, "of copy": ratio, "x roof": ratio}[unit]
    margin = value / got - 1 if bound == "<=" else got / value - 1
    text = f"{bound} {value:.0%} {unit}" if unit == "of copy" else f"{bound} {value:g} {unit}"
    # (a margin under 0.1% in two decimals: "missed by 0.0%" beside a rate that rounds to the target says nothing)
    by = f"{abs(margin):.2%}" if abs(margin) < 0.001 else f"{abs(margin):.1%}"
    return f"{text}: met by {by}" if margin >= 0 else f"{text}: missed by {by}"


def bench_row(case: dict, times_us: list[float], ceil: dict[str, float]) -> tuple[list[str], dict]:
    """The table row and the JSON record of ``case`` timed ``times_us`` (one time per round): the median time, its
    rate against the ceilings ``ceil`` of the same run (for a case with a ``roof``, its time over the roof:
    max(FLOPs / FP8 matmul ceiling, bytes / copy ceiling)), the range over the rounds, and the target's status."""
    times = sorted(times_us)
    us = statistics.median(times)
    if case.get("roof"):
        roof_us = max(case["flops"] / (ceil["fp8_matmul_tflops"] * 1e6), case["bytes"] / (ceil["copy_gbps"] * 1e3))
        rate, unit = case["flops"] / us / 1e6, "TFLOPS"
        ratio, share = us / roof_us, f"{us / roof_us:.2f}x roof ({roof_us:.1f} us)"
    else:
        if case["flops"]:
            rate, unit, ceiling = case["flops"] / us / 1e6, "TFLOPS", ceil["matmul_tflops"]
        else:
            rate, unit, ceiling = case["bytes"] / us / 1e3, "GB/s", ceil["copy_gbps"]
        ratio = rate / ceiling
        share = f"{ratio:.0%}"
    spread = f"{times[0]:.1f}-{times[-1]:.1f}" if len(times) > 1 else ""
    status = target_status(case.get("target"), us, rate, ratio)
    row = [case["name"], case["path"], f"{us:.1f}", spread, f"{rate:.0f} {unit}", share, status]
    record = dict(
        case=case["name"],
        path=case["path"],
        us=us,
        us_rounds=list(times_us),
        rate=rate,
        unit=unit,
        ratio_to_ceiling=ratio,
        target=status,
    )
    return row, record


def bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    for key, value in environment():
        print(f"{key:<10}{value}")
    ceil = _ceilings()
    print(
        f"ceilings  bf16 matmul 8192^3: {ceil['matmul_tflops']:.0f} TFLOPS; FP8 matmul 8192^3: "
        f"{ceil['fp8_matmul_tflops']:.0f} TFLOPS; device copy 1 GiB: {ceil['copy_gbps']:.0f} GB/s (read + write)\n"
    )
    from . import _cuda

    wanted = [f for f in (args.filter or "").split(",") if f]
    cases = [c for c in bench_cases() if not wanted or any(f in c["name"] for f in wanted)]
    _cuda.warmup([k for c in cases for k in c["keys"]], workers=16)
    rows, records = [], []
    for case in cases:
        inputs = case["make"]()
        op = case.get("run") or getattr(torch.ops.dsa, case["op"])
        try:
            op(*inputs)  # compiles outside the capture
            # each round captures and times a graph of its own
            times = [_graph_time_us(lambda op=op, inputs=inputs: op(*inputs)) for _ in range(args.rounds)]
        except Exception as err:  # keep measuring the other cases
            rows.append([case["name"], case["path"], "ERROR", "", f"{type(err).__name__}: {err}"[:80], "", ""])
            continue
        row, record = bench_row(case, times, ceil)
        rows.append(row)
        records.append(record)
        del inputs
    headers = ["case", "kernels", "us", f"range ({args.rounds} rounds)", "rate", "of ceiling", "target"]
    if args.rounds == 1:  # (no range column)
        headers.pop(3)
        rows = [r[:3] + r[4:] for r in rows]
    print(format_table(headers, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=dict(environment()), ceilings=ceil, rows=records), f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_dsa_ops",
        description="DeepSeek sparse attention ops: a self-check, the generated kernel sources and GPU timings.",
    )
    sub = parser.add_subparsers(dest="command")
    p_check = sub.add_parser("check", help="environment and a self-check of every op (the default)")
    p_check.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p_src = sub.add_parser("source", help="print the generated kernel source of an op (no GPU needed)")
    p_src.add_argument("--op", required=True, choices=tuple(_source_families()))
    p_src.add_argument(
        "--kv",
        default="bf16",
        choices=("bf16", "fp8", "packed"),
        help="kv of sparse_attn: bf16, fp8 (float8_e4m3fn values) or packed (uint8 FP8 rows)",
    )
    p_src.add_argument(
        "--q", default="bf16", choices=("bf16", "fp8"), help="q dtype of sparse_attn (fp8 needs fp8 or packed kv)"
    )
    p_src.add_argument("--d-nope", type=int, default=512, help="latent (= value) width")
    p_src.add_argument("--d-rope", type=int, default=64, help="RoPE tail width (0 for none)")
    p_src.add_argument("--heads", type=int, default=128, help="query heads, or the indexer's heads")
    p_src.add_argument("--sm-scale", type=float, default=None, help="default: d_qk ** -0.5")
    p_src.add_argument("--topk-length", action="store_true", help="the variant that takes topk_length")
    p_src.add_argument("--attn-sink", action="store_true", help="the variant that takes an attention sink")
    p_src.add_argument("--index-dim", type=int, default=128, help="the indexer's head dim")
    p_src.add_argument(
        "--page", type=int, default=64, help="tokens a page of the index-K cache, or of top-k's page table (0: none)"
    )
    p_src.add_argument("--k", type=int, default=2048, help="k of topk")
    p_src.add_argument(
        "--round-scale", action="store_true", help="the cache ops' variant that rounds scales up to powers of two"
    )
    p_src.add_argument(
        "--slot-dtype", default="int32", choices=("int32", "int64"), help="dtype of the slot ids the cache ops take"
    )
    p_src.add_argument("--target", default="cuda", choices=("cuda", "hip"), help="cuda = sm_90a, hip = gfx950")
    p_bench = sub.add_parser("bench", help="GPU timings with CUDA-graph replay")
    p_bench.add_argument("--json", default=None, help="also write the rows to this file")
    p_bench.add_argument(
        "--filter", default=None, help="only cases whose name contains one of these comma-separated strings"
    )
    p_bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each case this many times (a graph captured for each) and report the median and the range",
    )
    args = parser.parse_args(argv)
    if args.command == "bench" and args.rounds < 1:
        p_bench.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.command in (None, "check"):
        name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            p_check.error("--device cuda: torch sees no CUDA GPU here (use --device cpu)")
        return 1 if check(torch.device(name)) else 0
    if args.command == "source":
        if problem := _source_errors(args):
            p_src.error(problem)
        try:
            return source(args)
        except (AssertionError, ValueError) as err:  # a kernel's own precondition, with its reason
            p_src.error(f"no {args.op} kernel for these arguments: {err}")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
