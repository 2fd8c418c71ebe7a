"""GPU implementation of sparse attention: the kernel keys of the launch plan (:mod:`csrc_tl.attention.launch`:
which kernels, how many splits) and the launches."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from csrc_tl.attention import AttnGeometry
from csrc_tl.attention import keys as builders
from csrc_tl.attention.geometry import GROUP_HEADS
from csrc_tl.attention.keys import AttnKey, CombineKey
from csrc_tl.attention.launch import (
    AttnLaunch,
    attn_kernels,
    grouped_geometry,
    plan_launch,
    plan_splits,
    plan_tail,
)
from csrc_tl.attention.plan import ws_supported
from csrc_tl.attention.rows import RowsKey
from csrc_tl.attention.union import UNION_TABLES, UnionKey

from ..layout import KCacheLayout
from ..ops import OPS, AttnArgs, check_gather_dequant_k_cache, takes_checked
from . import k_cache
from .common import aligned, check_pool, pool_rows, pool_slots
from .compile import is_hopper, kernel, register_builder, sm_count

__all__ = [
    "SOURCE_OPS",
    "source_keys",
    "attn_keys",
    "widen_pool_keys",
    "group_keys",
    "warmup_keys",
    "plan_splits",
    "plan_tail",
    "plan_attn",
    "sparse_attn",
    "sparse_attn_with_max_logits",
    "attn_max_logits",
    "bench_cases",
]


register_builder(AttnKey, builders.build, builders.pass_configs)
register_builder(CombineKey, builders.build, builders.pass_configs)
register_builder(RowsKey, builders.build, builders.pass_configs)
register_builder(UnionKey, builders.build, builders.pass_configs)


def _geometry(
    kv_kind: str, d_v: int, d_rope: int, heads: int, sm_scale: float, has_topk_length: bool, q_fp8: bool
) -> AttnGeometry:
    geo = AttnGeometry(d_v, d_rope, heads, kv_kind, has_topk_length, float(sm_scale), q_fp8)
    geo.check()
    return geo


def _sm90(target: str | None) -> bool:
    """Whether ``target`` (default: this machine's) is sm_90 CUDA, where the warp-specialized kernels run."""
    return target == "cuda" if target else is_hopper()


def attn_keys(
    kv_kind: str,
    d_v: int,
    d_rope: int,
    heads: int,
    sm_scale: float,
    has_topk_length: bool,
    paths: Iterable[str] = ("prefill", "decode"),
    target: str | None = None,
    q_fp8: bool = False,
    sm_count: int | None = None,
    sink: bool = False,
    max_logits: bool = False,
) -> list[AttnKey | CombineKey]:
    """The kernels ``sparse_attn`` runs for one geometry on ``target`` (default: this machine's), in
    this order: the prefill kernel; the split decode kernels; the decode's combine (last).

    The launch plan picks them (:func:`csrc_tl.attention.launch.attn_kernels`): warp-specialized where the
    geometry allows on sm_90 CUDA, else portable. ``kv_kind`` is "bf16", "fp8" or "packed"; ``q_fp8`` picks the
    kernels for a float8_e4m3fn q, ``sink`` those of calls with an ``attn_sink``, ``max_logits`` those of
    :func:`sparse_dsa_ops.sparse_attn_with_max_logits` (both: the prefill kernel's ``sink_max`` variant, and with
    ``sink`` the combine that folds the sink in). A persistent prefill kernel
    is compiled for ``sm_count`` CTAs: by default the current GPU's SM count, or
    :data:`csrc_tl.attention.DEFAULT_CTAS` (an H200's) for another target or without a GPU."""
    geo = _geometry(kv_kind, d_v, d_rope, heads, sm_scale, has_topk_length, q_fp8)
    if sm_count is None and target is None and torch.cuda.is_available():
        sm_count = _sm_count_here()
    kernels = attn_kernels(geo, _sm90(target), sm_count, sink=sink, max_logits=max_logits)
    return ([kernels.prefill] if "prefill" in paths else []) + (
        [kernels.split, kernels.combine] if "decode" in paths else []
    )


def widen_pool_keys(
    kv_kind: str,
    d_v: int,
    d_rope: int,
    heads: int,
    sm_scale: float,
    has_topk_length: bool,
    target: str | None = None,
    sm_count: int | None = None,
    sink: bool = False,
    max_logits: bool = False,
) -> list:
    """The kernels a call over FP8 rows of ``kv_kind`` runs where the plan widens its pool (see :func:`plan_attn`):
    the row maps of a serving pool's selected rows, the widening of a packed pool or of its selected rows (native
    FP8 rows widen by a cast), then the bf16 rows' kernels (:func:`attn_keys`); none where pools are never widened
    (bf16 rows, a target other than sm_90 CUDA)."""
    if kv_kind == "bf16" or not _sm90(target):
        return []
    geo = _geometry(kv_kind, d_v, d_rope, heads, sm_scale, has_topk_length, False)
    widen = [RowsKey("mark"), RowsKey("remap")]  # a serving pool's selected rows (plan_count_rows)
    if kv_kind == "packed":  # the whole pool, or the selected rows
        widen += k_cache.cache_keys("dequant_k_cache", geo.layout)
        widen += k_cache.cache_keys("gather_dequant_k_cache", geo.layout)
    bf16 = attn_keys(
        "bf16",
        d_v,
        d_rope,
        heads,
        sm_scale,
        has_topk_length,
        target=target,
        sm_count=sm_count,
        sink=sink,
        max_logits=max_logits,
    )
    return widen + bf16


def group_keys(
    kv_kind: str,
    d_v: int,
    d_rope: int,
    heads: int,
    sm_scale: float,
    has_topk_length: bool,
    target: str | None = None,
    sm_count: int | None = None,
    sink: bool = False,
    max_logits: bool = False,
) -> list:
    """The kernels a call runs where the plan groups its tokens in head blocks (see :func:`plan_attn`): the union
    kernels (each table) and the grouped prefill kernel, over bf16 rows or the pool widened; none at head counts or on
    targets that never group."""
    geo = _geometry("bf16", d_v, d_rope, heads, sm_scale, has_topk_length, False)
    if not _sm90(target) or heads not in GROUP_HEADS or not ws_supported(geo):  # (FP8 rows group once widened)
        return []
    per = grouped_geometry(geo).group_tokens
    kernels = attn_kernels(grouped_geometry(geo), True, sm_count, False, sink, max_logits)
    return [UnionKey(per, table, has_topk_length) for table in UNION_TABLES] + [kernels.prefill]


@functools.lru_cache(maxsize=4096)
def plan_attn(
    kv_kind: str,
    d_v: int,
    d_rope: int,
    heads: int,
    sm_scale: float,
    has_topk_length: bool,
    q_fp8: bool,
    tokens: int,
    topk: int,
    sm_count: int,
    target: str | None = None,
    sink: bool = False,
    max_logits: bool = False,
    transposed: bool | None = None,
    slots: int | None = None,
    widen_pool: bool | None = None,
    group: bool | None = None,
) -> AttnLaunch:
    """The launch plan of one call (:func:`csrc_tl.attention.launch.plan_launch`: its kernel keys and split count;
    ``target``, ``sink`` and ``max_logits`` as in :func:`attn_keys`; ``transposed=False``: the plain consumers at any
    head count, for the bench's same-run comparison). Over a pool of ``slots`` FP8 rows the plan may widen the pool
    to bf16 first and run the bf16 rows' kernels (:func:`csrc_tl.attention.launch.plan_widen_pool`;
    ``widen_pool`` forces either), and over bf16 rows group tokens in head blocks
    (:func:`csrc_tl.attention.launch.plan_group`; ``group`` forces either)."""
    geo = _geometry(kv_kind, d_v, d_rope, heads, sm_scale, has_topk_length, q_fp8)
    return plan_launch(
        geo, tokens, topk, sm_count, _sm90(target), transposed, sink, max_logits, slots, widen_pool, group
    )


def warmup_keys(
    heads: int,
    d_nope: int,
    d_rope: int,
    sm_scale: float,
    kv_kinds=("bf16", "packed"),
    fp8_q=(False,),
    topk_length=(False, True),
    attn_sink=(False,),
) -> list[AttnKey | CombineKey]:
    """Every attention kernel of one model geometry (a float8 q only goes with fp8 or packed kv); ``attn_sink``
    whether calls pass a sink (False), do (True) or either; with the kernels of calls over FP8 rows that the plan
    widens (:func:`widen_pool_keys`). :func:`sparse_dsa_ops.sparse_attn_with_max_logits` (and
    FlashMLA's prefill, :mod:`sparse_dsa_ops.flash_mla`) runs the prefill kernel of calls with a sink and the combine
    of its own calls: ``(False, True)`` covers it with or without a sink."""
    keys = []
    for kind in kv_kinds:
        for has_len in topk_length:
            for q_fp8 in fp8_q:
                for sink in attn_sink:
                    if not (q_fp8 and kind == "bf16"):
                        keys += attn_keys(kind, d_nope, d_rope, heads, sm_scale, has_len, q_fp8=q_fp8, sink=sink)
                        keys += widen_pool_keys(kind, d_nope, d_rope, heads, sm_scale, has_len, sink=sink)
                        keys += group_keys(kind, d_nope, d_rope, heads, sm_scale, has_len, sink=sink)
    return list(dict.fromkeys(keys))


# the ops ``python -m sparse_dsa_ops source`` prints this family's kernels of
SOURCE_OPS = ("sparse_attn", "sparse_attn_with_max_logits")


def source_keys(op: str, args) -> list[AttnKey | CombineKey]:
    """The kernels of ``op`` for the command line's geometry ``args`` (``kv``, ``q``, ``d_nope``, ``d_rope``,
    ``heads``, ``sm_scale``, ``topk_length``, ``attn_sink``, ``target``)."""
    scale = args.sm_scale if args.sm_scale is not None else (args.d_nope + args.d_rope) ** -0.5
    return attn_keys(
        args.kv,
        args.d_nope,
        args.d_rope,
        args.heads,
        scale,
        args.topk_length,
        target=args.target,
        q_fp8=args.q == "fp8",
        sink=args.attn_sink,
        max_logits=op == "sparse_attn_with_max_logits",
    )


def _sm_count_here() -> int:
    return sm_count(torch.device("cuda", torch.cuda.current_device()))


@takes_checked
def sparse_attn(args: AttnArgs, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None, empty_lse=None):
    return _attend(args, q, kv, indices, sm_scale, d_v, topk_length, attn_sink, None, empty_lse)


@takes_checked
def sparse_attn_with_max_logits(
    args: AttnArgs, q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None, empty_lse=None
):
    max_logits = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    out, lse = _attend(args, q, kv, indices, sm_scale, d_v, topk_length, attn_sink, max_logits, empty_lse)
    return out, lse, max_logits


def _attend(
    args: AttnArgs,
    q,
    kv,
    indices,
    sm_scale,
    d_v,
    topk_length,
    attn_sink,
    max_logits,
    empty_lse=None,
    transposed=None,
    widen_pool=None,
    group=None,
):
    """``(out, lse)`` of ``sparse_attn``, and ``max_logits`` filled in place where given (``transposed=False``: the
    plain consumers at any head count; ``widen_pool``: the pool widened to bf16 first, or not; ``group``: tokens
    grouped in head blocks, or not; each for the bench's same-run comparisons and the tests, see :func:`plan_attn`).
    Empty rows' lse is ``empty_lse`` (-inf when None): the combine writes it; after a prefill kernel (which writes
    -inf) one pass."""
    t_count, heads, d_qk = q.shape
    empty = -math.inf if empty_lse is None else empty_lse
    out = torch.empty(t_count, heads, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(t_count, heads, dtype=torch.float32, device=q.device)
    if t_count == 0:
        return out, lse
    if args.topk == 0 or args.pool.slots == 0:
        if max_logits is not None:
            max_logits.fill_(float("-inf"))
        return out.zero_(), lse.fill_(empty)
    pool = pool_rows(kv, args.pool, args.kv_kind == "packed")
    check_pool("sparse_attn", "kv", pool, pool.shape[1] * pool.element_size())
    idx = pool_slots(indices.reshape(t_count, args.topk), args.pool)
    ask = functools.partial(  # the launch plan of this call, over a pool of a given number of rows
        plan_attn,
        args.kv_kind,
        d_v,
        args.d_rope,
        heads,
        sm_scale,
        topk_length is not None,
        args.q_fp8,
        t_count,
        args.topk,
        sm_count(q.device),
        sink=attn_sink is not None,
        max_logits=max_logits is not None,
        transposed=transposed,
        group=group,
    )
    plan = ask(slots=pool.shape[0], widen_pool=widen_pool)
    if plan.widen_pool:  # the bf16 rows' kernels over the pool widened once (every FP8 value widens exactly)
        pool = k_cache.dequant_k_cache(pool) if args.kv_kind == "packed" else pool.to(torch.bfloat16)
        q = q.to(torch.bfloat16)
    elif plan.count_rows and not torch.cuda.is_current_stream_capturing():
        flags, rows = _selected_rows(pool, idx)  # (one sync)
        if ask(slots=rows.shape[0]).widen_pool:  # the selected rows alone, widened, and the selections remapped
            plan = ask(slots=rows.shape[0], widen_pool=True)
            pool, idx = _widen_rows(args, pool, rows), _remap(idx, flags)
            q = q.to(torch.bfloat16)

    def redo_max(first: int, stop: int) -> torch.Tensor:  # the row maxima of tokens [first, stop), a second pass
        lengths = None if topk_length is None else topk_length[first:stop]
        return attn_max_logits(args, q[first:stop], kv, indices[first:stop], sm_scale, d_v, lengths)

    _launch(plan, q, pool, idx, topk_length, attn_sink, out, lse, max_logits, empty, redo_max)
    return out, lse


def _launch(plan: AttnLaunch, q, pool, idx, topk_length, attn_sink, out, lse, max_logits, empty: float, redo_max):
    """Run ``plan`` over ``q [T, H, d_qk]`` and the selections ``idx [T, K]`` of ``pool`` (its rows as the kernels
    read them), writing ``out``, ``lse`` and ``max_logits`` (where given); ``redo_max(first, stop)``: the row maxima of
    tokens ``[first, stop)``, for the split path's tokens (its kernels keep none)."""
    t_count, heads = q.shape[:2]
    inputs = (q, idx) if topk_length is None else (q, idx, topk_length)
    main = plan.prefill_tokens
    if main and plan.union:  # whole groups of tokens in grouped head blocks
        _attend_grouped(plan, q, pool, idx, topk_length, attn_sink, out, lse, max_logits)
    elif main:  # the prefill's tokens
        rows = [aligned(_rows(x, 0, main)) for x in inputs]
        if plan.prefill.sink_max:
            sink = aligned(attn_sink) if attn_sink is not None else q.new_full((heads,), float("-inf"), dtype=lse.dtype)
            best = _rows(max_logits, 0, main) if max_logits is not None else torch.empty_like(_rows(lse, 0, main))
            kernel(plan.prefill)(rows[0], pool, *rows[1:], sink, _rows(out, 0, main), _rows(lse, 0, main), best)
        else:
            kernel(plan.prefill)(rows[0], pool, *rows[1:], _rows(out, 0, main), _rows(lse, 0, main))
    if main and empty != -math.inf:  # one elementwise pass (a compare and a fill are two)
        _rows(lse, 0, main).nan_to_num_(nan=math.nan, posinf=math.inf, neginf=empty)
    if plan.split:  # the rest (a decode's tokens, or a persistent prefill's last round)
        rows = [aligned(_rows(x, main, t_count)) for x in inputs]
        part_out = torch.empty(
            t_count - main, plan.splits, plan.partial_heads, out.shape[-1], dtype=torch.bfloat16, device=q.device
        )
        part_lse = torch.empty(t_count - main, plan.splits, heads, dtype=torch.float32, device=q.device)
        sink = () if attn_sink is None else (aligned(attn_sink),)  # the combine folds it into its normalization
        kernel(plan.split[0])(rows[0], pool, *rows[1:], part_out, part_lse)
        kernel(plan.split[1])(part_out, part_lse, *sink, _rows(out, main, t_count), _rows(lse, main, t_count), empty)
        if max_logits is not None:
            _rows(max_logits, main, t_count).copy_(redo_max(main, t_count))
    if plan.rest:  # a grouped launch's last tokens, fewer than a group
        views = [None if x is None else x[main:] for x in (q, idx, topk_length)]
        rest_max = None if max_logits is None else max_logits[main:]
        _launch(
            plan.rest,
            views[0],
            pool,
            views[1],
            views[2],
            attn_sink,
            out[main:],
            lse[main:],
            rest_max,
            empty,
            lambda first, stop: redo_max(main + first, main + stop),
        )


def _attend_grouped(plan: AttnLaunch, q, pool, idx, topk_length, attn_sink, out, lse, max_logits):
    """The grouped head blocks of ``plan`` over its first ``plan.prefill_tokens`` tokens (see :func:`_launch`): the
    union kernel lists each group's selections once (:mod:`csrc_tl.attention.union`), and the grouped prefill kernel
    reads the group's q, out, lse and max_logits as one token of ``64`` head rows (their memory is the same)."""
    main, per, topk = plan.prefill_tokens, plan.group, idx.shape[1]
    groups, rows = main // per, per * q.shape[1]
    union = torch.empty(groups, per * topk, dtype=torch.int32, device=q.device)
    lengths = torch.empty(groups, dtype=torch.int32, device=q.device)
    cut = () if topk_length is None else (aligned(topk_length[:main]),)
    kernel(plan.union)(aligned(idx[:main]), *cut, pool.shape[0], union, lengths)
    q_g = aligned(q[:main]).view(groups, rows, q.shape[-1])  # (contiguous: the group's heads are one block)
    out_g, lse_g = out[:main].view(groups, rows, out.shape[-1]), lse[:main].view(groups, rows)
    if plan.prefill.sink_max:
        sink = (
            aligned(attn_sink).repeat(per) if attn_sink is not None else q.new_full((rows,), -math.inf, dtype=lse.dtype)
        )
        best = max_logits[:main].view(groups, rows) if max_logits is not None else torch.empty_like(lse_g)
        kernel(plan.prefill)(q_g, pool, union, lengths, sink, out_g, lse_g, best)
    else:
        kernel(plan.prefill)(q_g, pool, union, lengths, out_g, lse_g)


def _selected_rows(pool: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flags [S] int32, rows [U] int32)``: 1 where some entry of ``idx [T, K]`` selects a row of ``pool``, and
    the selected rows ascending (a host sync, for U)."""
    flags = torch.zeros(pool.shape[0], dtype=torch.int32, device=pool.device)
    kernel(RowsKey("mark"))(aligned(idx.reshape(-1)), flags)
    return flags, torch.nonzero(flags).flatten().to(torch.int32)


def _remap(idx: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``idx [T, K]`` as places among the selected rows ``flags`` marks (-1 where invalid)."""
    out = torch.empty(idx.shape, dtype=torch.int32, device=idx.device)
    pos = torch.cumsum(flags, 0, dtype=torch.int32)
    kernel(RowsKey("remap"))(aligned(idx.reshape(-1)), pos, out.view(-1))
    return out


def _widen_rows(args: AttnArgs, pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[U, d_qk]`` bf16: the pool's ``rows``, widened exactly."""
    if args.kv_kind != "packed":
        return pool[rows.long()].to(torch.bfloat16)
    out = torch.empty(rows.shape[0], args.layout.d_qk, dtype=torch.bfloat16, device=pool.device)
    kernel(k_cache.cache_keys("gather_dequant_k_cache", args.layout)[0])(pool, rows, out)
    return out


def _rows(x: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Rows ``[first, end)`` of ``x``: ``x`` itself where they are all of it (no view made per launch)."""
    return x if first == 0 and end == x.shape[0] else x[first:end]


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q [t, H, D] @ keys [t, K, D]^T`` in float32 from bf16 operands: a bf16 GEMM that returns float32 where torch
    has it (2.8 and later), else a float32 GEMM of the widened operands."""
    try:
        return torch.bmm(q, keys.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, NotImplementedError):  # no such argument, or no such kernel on this device
        return torch.bmm(q.float(), keys.float().transpose(1, 2))


# Bytes of selected rows (bf16) and their scores (float32) that attn_max_logits holds at once.
MAX_LOGITS_CHUNK_BYTES = 1 << 30


@takes_checked
def attn_max_logits(args: AttnArgs, q, kv, indices, sm_scale, d_v, topk_length=None):
    """No kernel of its own: each chunk of tokens gathers its selected rows as bf16 (packed rows dequantized by the
    gather kernel, FP8 values widened exactly) and scores them with one batched bf16 GEMM that accumulates and
    returns float32, as the reference's float32 product of the same bf16 values does up to summation order."""
    t_count, heads, d_qk = q.shape
    best = torch.full((t_count, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if t_count == 0 or args.topk == 0 or args.pool.slots == 0:
        return best
    packed = args.kv_kind == "packed"
    rows = None if packed else pool_rows(kv, args.pool, packed=False)  # [rows, d_qk], a view
    idx = indices.reshape(t_count, args.topk)
    position = torch.arange(args.topk, device=q.device)
    chunk = max(1, MAX_LOGITS_CHUNK_BYTES // (args.topk * (2 * d_qk + 4 * heads)))
    for start in range(0, t_count, chunk):
        stop = min(start + chunk, t_count)
        ids = idx[start:stop]  # [t, K]
        valid = (ids >= 0) & (ids < args.pool.slots)
        if topk_length is not None:
            valid &= position < topk_length[start:stop, None]
        if packed:
            flat = ids.reshape(-1)  # the K-cache family's gather, its checker run directly (not the dispatcher)
            keys = k_cache.gather_dequant_k_cache(check_gather_dequant_k_cache(kv, flat), kv, flat)  # [t * K, d_qk]
        else:
            safe = torch.where(valid, pool_slots(ids, args.pool), 0)  # [t, K], rows inside the pool
            keys = rows[safe.reshape(-1)].to(torch.bfloat16)  # [t * K, d_qk]
        keys = keys.view(stop - start, args.topk, d_qk)
        scores = _scores(q[start:stop].to(torch.bfloat16), keys)  # [t, H, K] float32
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))  # [t, H, K]
        if sm_scale > 0:  # rounding is monotonic: the scaled maximum is the maximum of the scaled scores
            best[start:stop] = scores.amax(dim=-1) * sm_scale
        else:
            best[start:stop] = (scores * sm_scale).amax(dim=-1)
    return best


# ----------------------------------------------------------------------------------------------
# Bench cases.


def _causal_indices(tokens: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, topk]`` int32 indices of one causal prefill of ``tokens`` tokens over slots ``0..T-1``: token i selects
    ``topk`` distinct positions among its first ``i + 1`` (its whole prefix while that is shorter, -1 after it)."""
    position = torch.arange(tokens, device="cuda")
    noise = torch.rand(tokens, tokens, device="cuda", generator=gen)
    noise.masked_fill_(position[None, :] > position[:, None], -1.0)  # [T, T], -1 past each token
    best, idx = noise.topk(topk, dim=1)
    return torch.where(best >= 0, idx, -1).int()


def _random_indices(tokens: int, topk: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, topk]`` int32 indices of ``topk`` distinct slots each, drawn uniformly from ``slots`` (as a top-k selects
    them; at most ``slots``, the rest -1), in random order."""
    idx = torch.full((tokens, topk), -1, dtype=torch.int32, device="cuda")
    take = min(topk, slots)
    for first in range(0, tokens, 1024):  # (a [1024, S] float32 draw at a time)
        noise = torch.rand(min(1024, tokens - first), slots, device="cuda", generator=gen)
        idx[first : first + noise.shape[0], :take] = noise.topk(take, dim=1, sorted=False).indices.int()
    return idx


def attn_case(
    name, kind, d_nope, d_rope, heads, tokens, slots, topk, target=None, variant="", causal=False, scheme=None, run=None
):
    """One attention case; ``variant``: "" (the core op), "sink" (with an ``attn_sink``) or "flash_mla" (the same
    call through FlashMLA's face, ``run``: its prefill for bf16 kv, its paged FP8 decode for packed kv, whose bench
    cases the face makes);
    ``causal``: the indices of one causal prefill (:func:`_causal_indices`, ``slots`` = ``tokens``) instead of
    distinct random ones over the whole pool (:func:`_random_indices`); ``scheme``: the schemes' same-run comparisons
    (None: the plan's): the consumers of a few-heads case over FP8 rows in the kernel (the pool never widened),
    "plain" or "transposed"; the plan's consumers over FP8 rows "in-kernel" or "widened" (tokens grouped where the
    plan groups them); "per-token" (the pool widened as the plan would, one token a head block) or "grouped" (tokens
    grouped in head blocks wherever the heads allow; see :func:`plan_attn`)"""

    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        d_qk = d_nope + d_rope
        q = torch.randn(tokens, heads, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(slots, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen)
        if kind == "packed":
            kv = torch.ops.dsa.quant_k_cache(
                kv[:, :d_nope].contiguous(), kv[:, d_nope:].contiguous() if d_rope else None
            )
        elif kind == "fp8":
            q, kv = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
        if causal:
            idx = _causal_indices(tokens, topk, gen)
        else:
            idx = _random_indices(tokens, topk, slots, gen)
        if variant == "sink":
            return (q, kv, idx, d_qk**-0.5, d_nope, None, torch.randn(heads, device="cuda", generator=gen))
        if variant == "flash_mla" and kind == "packed":  # b = T requests of one token, pages of 64 slots
            return (q.unsqueeze(1), kv.view(slots // 64, 64, 1, kv.shape[-1]), idx.unsqueeze(1))
        if variant == "flash_mla":
            return (q, kv.unsqueeze(1), idx.unsqueeze(1))
        return (q, kv, idx, d_qk**-0.5, d_nope)

    flops = 2 * tokens * heads * topk * (2 * d_nope + d_rope)
    transposed = {"transposed": True, "plain": False}.get(scheme)
    group = {"per-token": False, "grouped": True}.get(scheme)
    fp8 = kind != "bf16"
    widen_pool = None if scheme is None else fp8 and scheme not in ("in-kernel", "transposed", "plain")
    plan = plan_attn(
        kind,
        d_nope,
        d_rope,
        heads,
        (d_nope + d_rope) ** -0.5,
        False,
        kind == "fp8",
        tokens,
        topk,
        torch.cuda.get_device_properties(0).multi_processor_count,
        sink=variant == "sink",
        max_logits=variant == "flash_mla" and kind != "packed",  # (flash_mla_sparse_fwd returns them)
        transposed=transposed,
        slots=slots,
        widen_pool=widen_pool,
        group=group,
    )
    if scheme is not None:
        run = functools.partial(_scheme_run, transposed, widen_pool, group)
    widen = plan.widen_pool and kind == "packed"  # the pool's widening kernel, after the attention kernels
    return dict(
        name=name,
        op="sparse_attn",
        run=run,
        make=make,
        flops=flops,
        bytes=None,
        keys=list(plan.keys) + (k_cache.cache_keys("dequant_k_cache", KCacheLayout(d_nope, d_rope)) * widen),
        path=str(plan),
        target=target,
    )


def _scheme_run(transposed: bool | None, widen_pool: bool, group: bool | None, q, kv, indices, sm_scale, d_v):
    """``sparse_attn`` on the transposed or the plain consumers (None: the plan's), the pool widened first or not,
    tokens grouped in head blocks or not (None: the plan's; see :func:`plan_attn`)."""
    args = OPS["sparse_attn"].check(q, kv, indices, sm_scale, d_v)
    kw = dict(transposed=transposed, widen_pool=widen_pool, group=group)
    return _attend(args, q, kv, indices, sm_scale, d_v, None, None, None, **kw)


def bench_cases() -> list[dict]:
    """The attention cases of ``python -m sparse_dsa_ops bench``, with their targets (bound, value, unit)."""
    cases = [
        attn_case(
            "prefill deepseek bf16 T4096 S8192 H128 k2048",
            "bf16",
            512,
            64,
            128,
            4096,
            8192,
            2048,
            (">=", 600.0, "TFLOPS"),
        ),
        attn_case(
            "prefill 256+0 bf16 T4096 S8192 H64 k2048", "bf16", 256, 0, 64, 4096, 8192, 2048, (">=", 450.0, "TFLOPS")
        ),
        attn_case("decode 256+0 bf16 T1 S65536 H64 k2048", "bf16", 256, 0, 64, 1, 65536, 2048, ("<=", 15.0, "us")),
        attn_case("decode 256+0 bf16 T17 S65536 H64 k2112", "bf16", 256, 0, 64, 17, 65536, 2112, ("<=", 20.0, "us")),
        attn_case(
            "decode deepseek bf16 T1 S65536 H128 k2048", "bf16", 512, 64, 128, 1, 65536, 2048, ("<=", 20.0, "us")
        ),
        attn_case(
            "decode deepseek packed T256 S65536 H128 k2048",
            "packed",
            512,
            64,
            128,
            256,
            65536,
            2048,
            (">=", 400.0, "TFLOPS"),
        ),
        attn_case("decode 256+0 packed T1 S65536 H64 k2048", "packed", 256, 0, 64, 1, 65536, 2048, ("<=", 10.0, "us")),
        attn_case(
            "decode 256+0 packed T17 S65536 H64 k2112", "packed", 256, 0, 64, 17, 65536, 2112, ("<=", 15.0, "us")
        ),
        attn_case(
            "prefill 256+0 packed T4096 S8192 H64 k2048",
            "packed",
            256,
            0,
            64,
            4096,
            8192,
            2048,
            (">=", 400.0, "TFLOPS"),
        ),
        attn_case("prefill deepseek fp8 T4096 S8192 H128 k2048", "fp8", 512, 64, 128, 4096, 8192, 2048),
        attn_case("prefill 256+0 fp8 T4096 S8192 H64 k2048", "fp8", 256, 0, 64, 4096, 8192, 2048),
        attn_case("decode 256+0 fp8 T1 S65536 H64 k2048", "fp8", 256, 0, 64, 1, 65536, 2048),
        attn_case("decode 256+0 fp8 T17 S65536 H64 k2112", "fp8", 256, 0, 64, 17, 65536, 2112),
        # tensor-parallel shards: DeepSeek over 8 GPUs has 16 heads per GPU, GLM 8
        attn_case("prefill deepseek bf16 T4096 S8192 H16 k2048", "bf16", 512, 64, 16, 4096, 8192, 2048),
        attn_case("decode deepseek packed T1 S65536 H16 k2048", "packed", 512, 64, 16, 1, 65536, 2048),
        attn_case("decode deepseek packed T256 S65536 H16 k2048", "packed", 512, 64, 16, 256, 65536, 2048),
        attn_case("prefill 256+0 packed T4096 S8192 H8 k2048", "packed", 256, 0, 8, 4096, 8192, 2048),
        attn_case("decode 256+0 packed T1 S65536 H8 k2048", "packed", 256, 0, 8, 1, 65536, 2048),
        attn_case("decode 256+0 packed T17 S65536 H8 k2112", "packed", 256, 0, 8, 17, 65536, 2112),
    ]
    cases += _shard_cases()
    cases += variant_cases("sink")  # beside their core cases above
    cases.append(attn_case("decode deepseek packed T1 S65536 H128 k2048", "packed", 512, 64, 128, 1, 65536, 2048))
    return cases


def variant_cases(variant: str, run=None) -> list[dict]:
    """Three DeepSeek cases (a bf16 prefill, packed decodes of 256 and 1 tokens) of ``variant`` (see
    :func:`attn_case`; ``run(kind)``: the call of each kv kind, where not the core op's): the sink's and FlashMLA's
    face beside their core cases."""
    shapes = (("prefill", "bf16", 4096, 8192), ("decode", "packed", 256, 65536), ("decode", "packed", 1, 65536))
    return [
        attn_case(
            f"{path} deepseek {kind} T{tokens} S{slots} H128 k2048 {variant}",
            kind,
            512,
            64,
            128,
            tokens,
            slots,
            2048,
            variant=variant,
            run=run(kind) if run else None,
        )
        for path, kind, tokens, slots in shapes
    ]


def _prefill_schemes(kind: str, heads: int) -> tuple:
    """The schemes a shard prefill case is timed on (see :func:`attn_case`): the plan's (tokens grouped in head blocks
    over these small pools; for FP8 rows the pool widened first), and beside it one token a head block (the
    transposed consumers over bf16 rows or the widened pool), and FP8 rows widened in the kernel on the transposed and
    on the plain consumers (the plain ones: what padding to 64 heads costs)."""
    if heads >= 64:
        return (None,) if kind == "bf16" else (None, "in-kernel")
    other = "transposed" if kind == "bf16" else "per-token"
    return (None, other, "plain") if kind == "bf16" else (None, other, "transposed", "plain")


def _shard_cases() -> list[dict]:
    """Tensor-parallel shards (8, 16, 32 heads per GPU) on their schemes side by side, beside 64 and 128 heads of the
    same geometry: prefill and decode, random and causal indices; FP8 rows widened as a pool and in the kernel, tokens
    grouped in head blocks or not, and where grouping and widening the pool start to pay (tokens and pool rows)."""
    cases = []
    for model, d_nope, d_rope in (("deepseek", 512, 64), ("glm5.3-flash", 512, 0)):
        for kind in ("bf16", "packed"):
            for heads in (8, 16, 32, 64):
                shape = f"{model} {kind} T4096 S8192 H{heads} k2048"
                for scheme in _prefill_schemes(kind, heads):
                    name = f"tp prefill {shape}" + (f" {scheme}" if scheme else "")
                    cases.append(attn_case(name, kind, d_nope, d_rope, heads, 4096, 8192, 2048, scheme=scheme))
    for kind in ("bf16", "packed"):
        for heads in (8, 16, 32, 64):
            other = ("transposed" if kind == "bf16" else "per-token",) if heads < 64 else ()
            for scheme in (None, *other) + (("in-kernel",) if kind == "packed" else ()):
                name = f"tp prefill causal deepseek {kind} T8192 H{heads} k2048" + (f" {scheme}" if scheme else "")
                cases.append(attn_case(name, kind, 512, 64, heads, 8192, 8192, 2048, causal=True, scheme=scheme))
    for slots in (16384, 65536):  # where the plan stops grouping (8 heads): one token a block against grouped
        for scheme in (None, "grouped"):
            name = f"tp prefill deepseek bf16 T4096 S{slots} H8 k2048" + (f" {scheme}" if scheme else "")
            cases.append(attn_case(name, "bf16", 512, 64, 8, 4096, slots, 2048, scheme=scheme))
    for tokens, slots in ((512, 8192), (1024, 65536)):
        for heads in (16, 128):
            for scheme in ("widened", "in-kernel"):
                name = f"tp prefill deepseek packed T{tokens} S{slots} H{heads} k2048 {scheme}"
                cases.append(attn_case(name, "packed", 512, 64, heads, tokens, slots, 2048, scheme=scheme))
    for heads in (8, 128):
        for scheme in (None, "in-kernel"):
            name = f"tp prefill deepseek fp8 T4096 S8192 H{heads} k2048" + (f" {scheme}" if scheme else "")
            cases.append(attn_case(name, "fp8", 512, 64, heads, 4096, 8192, 2048, scheme=scheme))
    for tokens in (1, 4, 64, 256):
        for heads in (8, 16, 128):
            for scheme in ("transposed", "plain") if heads < 64 else (None,):
                name = f"tp decode deepseek packed T{tokens} S65536 H{heads} k2048" + (f" {scheme}" if scheme else "")
                cases.append(attn_case(name, "packed", 512, 64, heads, tokens, 65536, 2048, scheme=scheme))
    return cases


def warmup_keys_of(spec) -> list[AttnKey | CombineKey]:
    """The attention kernels :func:`sparse_dsa_ops.warmup` compiles for ``spec`` (a ``WarmupSpec``)."""
    return warmup_keys(
        spec.heads,
        spec.d_nope,
        spec.d_rope,
        spec.sm_scale,
        spec.kv_kinds,
        spec.fp8_q,
        spec.topk_length,
        spec.attn_sink,
    )
