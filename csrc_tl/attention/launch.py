"""The launch plan of sparse attention: which kernels one geometry compiles on a target (:func:`attn_kernels`) and
how one call of T tokens runs on them (:func:`plan_launch`), decided once, from the geometry, the call's shape, the
GPU's SM count and whether the target is sm_90 CUDA. The backend asks the plan and launches; it decides nothing.

A call runs the prefill kernel over its first ``prefill_tokens`` tokens (one CTA per (token, head block), or a
persistent grid that walks them) and the split path over the rest: the split kernel over ``splits`` parts of each
remaining token's top-k range, then the combine that merges the parts. A decode (few tokens) takes the split path
only; a persistent prefill sends the tokens of its last, partial round there (:func:`plan_tail`). A grouped prefill
(:func:`plan_group`) runs the union kernel, then the prefill kernel over head blocks of several tokens, and plans its
last tokens, fewer than a group, as a call of their own (``rest``); an FP8 pool may be widened to bf16 first
(:func:`plan_widen_pool`).

Letters: T tokens, H heads, K top-k entries (see :mod:`csrc_tl.attention`).
"""

import dataclasses
import math
from dataclasses import dataclass

from .geometry import (
    DEFAULT_TILES,
    MAX_HEAD_BLOCK,
    TRANSPOSED_MAX_HEADS,
    AttnGeometry,
    head_block,
    partial_heads,
)
from .keys import AttnKey, CombineKey
from .plan import DEFAULT_CTAS, ws_persistent, ws_supported, ws_transposed
from .union import UNION_TABLES, UnionKey, union_table

__all__ = [
    "TOPK_BLOCK",
    "TAIL_SPLIT_BLOCKS",
    "TAIL_MIN_BLOCKS",
    "TAIL_MIN_SPLITS",
    "WIDEN_MIN_TOKENS",
    "WIDEN_REUSE",
    "WIDEN_BYTES",
    "WIDEN_COUNT_TOKENS",
    "GROUP_MIN_TOKENS",
    "GROUP_MAX_UNION",
    "AttnKernels",
    "AttnLaunch",
    "attn_kernels",
    "plan_launch",
    "plan_splits",
    "plan_tail",
    "plan_widen_pool",
    "plan_count_rows",
    "plan_group",
    "union_share",
    "widened_geometry",
    "grouped_geometry",
]

# Top-k rows of a block of either split kernel (the portable kernel's decode tile; the warp-specialized split kernel
# always takes 64-row blocks): a split is whole blocks of a token's top-k range, whose width is a multiple of it.
TOPK_BLOCK = DEFAULT_TILES["decode"]["block_i"]

# Top-k blocks a split of a persistent prefill's tail keeps at least: with two its producer has a next block to gather
# while the consumers compute. A decode's split kernels take one block a split or more: at T 1 and 4, 32 splits of
# one block of a 2048-wide top-k were faster than 16 of two (H100, DeepSeek packed T 1: 8 heads 8.8 -> 7.4 us,
# 16 heads 9.5 -> 7.7, 128 heads 12.0 -> 10.7; T 4: 9.6 -> 8.4 and 10.7 -> 9.4; BENCHMARKS.md).
TAIL_SPLIT_BLOCKS = 2

# The last, partial round of a persistent prefill (items not a multiple of its CTAs, one per SM) keeps a few SMs busy
# for a whole item while the others idle: its tokens take the split path instead, where that splits their top-k
# ranges in TAIL_MIN_SPLITS parts or more and they have TAIL_MIN_BLOCKS top-k blocks or more (a shorter item, or
# one split in two, takes about as long as the split path's own cost: a second kernel, the combine, the partials).
# Only the persistent prefill has such a round: the hardware starts the last CTAs of a prefill of one CTA per item
# as SMs come free, not all at once (BENCHMARKS.md, design decisions).
TAIL_MIN_BLOCKS = 16
TAIL_MIN_SPLITS = 3

# A prefill over FP8 rows (packed or native) that gathers each pool row many times widens the whole pool to bf16 once
# and runs the bf16 kernels over the copy (``AttnLaunch.widen_pool``): the in-kernel widening of every gathered row,
# not the gather, bounds the FP8 kernels at every head count (BENCHMARKS.md), so widening each row once and gathering
# bf16 rows is faster where the pool is small beside what the call gathers. The plan widens the pool of a call of at
# least WIDEN_MIN_TOKENS tokens that gathers WIDEN_REUSE pool rows or more per row of the pool (T * K >= WIDEN_REUSE *
# S) and whose bf16 copy takes at most WIDEN_BYTES. H100, k 2048, DeepSeek packed rows, in the kernel -> widened:
# T 4096 over 8192 rows at 8 heads 2079 -> 1422 us, at 64 heads 2831 -> 2090; T 512 over 8192 rows at 16 heads 289
# -> 202; T 1024 over 65536 rows (T * K = 32 S) at 16 heads 596 -> 544; T 256 over 65536 rows (8 S) was slower
# widened. Fewer tokens are decode batches, whose pool is a serving pool: they keep the FP8 kernels.
WIDEN_MIN_TOKENS = 512
WIDEN_REUSE = 16
WIDEN_BYTES = 128 << 20
# A larger pool (a serving pool) is not widened whole; from WIDEN_COUNT_TOKENS tokens (a prefill chunk) an eager call
# counts the distinct rows it selects (a pass over the selections and a host sync: 215-310 us at T 4096 over a pool of
# 1M rows, H100) and widens those alone where they pass the rule above (one request's 8192 rows at 8 heads: 2199 ->
# 1775 us, at 64 heads 2816 -> 2543, counting included).
WIDEN_COUNT_TOKENS = 4096

# A prefill over bf16 rows (or its pool widened) at 8 to 32 heads (GROUP_HEADS) runs grouped head blocks: the 64 rows
# of a block hold the heads of 64 / H consecutive tokens, which walk the union of their selections, each row gathered
# once for all of them (AttnGeometry.group). At few heads the per-token kernels are bound by the gather of each token's
# rows, not by the tensor cores, so a block of several tokens trades the gathers their selections share for the scores
# of rows only some of them select (masked). A grouped call takes about (union_share + 0.03) times the 64-head time,
# the per-token kernels 0.64-0.72 / 0.70-0.79 / 0.85-0.97 of it at 8 / 16 / 32 heads (H100, T 4096 over 8192 rows,
# k 2048, two calls): the plan groups a call of at least GROUP_MIN_TOKENS tokens where the union of distinct
# selections drawn uniformly from the pool (union_share) would be at most GROUP_MAX_UNION[heads] of the selections. At
# 8 heads the bench put the crossover there: over 16384 rows (a union of 66%) grouped 1350 against 1397 us per token,
# over 65536 (90%) 2072 against 1524 (one H100 call). A causal prompt's tokens share more than uniform selections do
# (each early token selects its whole prefix): T 8192, packed rows widened, per token -> grouped at 8 / 16 / 32 heads
# 2791 / 3007 / 3683 -> 1148 / 1873 / 2823 us, 64 heads 4179; over uniform selections at 32 heads the two are within
# a few percent either way from call to call (1835 / 1863, 1908 / 1765).
GROUP_MIN_TOKENS = 512
GROUP_MAX_UNION = {8: 0.66, 16: 0.72, 32: 0.88}


@dataclass(frozen=True)
class AttnKernels:
    """The kernels of one geometry on one target, as kernel keys (made by :func:`attn_kernels`): the prefill kernel,
    the split kernel and the combine after it. Every call of the geometry runs some of them (:class:`AttnLaunch`)."""

    prefill: AttnKey  # portable, warp-specialized, or warp-specialized and persistent (a grid of prefill.ctas CTAs)
    split: AttnKey  # the split kernel: portable or warp-specialized
    combine: CombineKey  # reads the split kernel's partials of combine.partial_heads head rows (whole head blocks)

    def __post_init__(self):
        assert not self.prefill.split and self.split.split, "a prefill kernel and a split kernel"
        assert self.prefill.geo == self.split.geo, "the kernels of one geometry"

    @property
    def ctas(self) -> int:
        """The persistent prefill's grid (0: one CTA per token and head block)."""
        return self.prefill.ctas

    @property
    def partial_heads(self) -> int:
        return self.combine.partial_heads


@dataclass(frozen=True)
class AttnLaunch:
    """What one call of ``tokens`` tokens launches (made by :func:`plan_launch`): the prefill kernel of ``kernels``
    over the first ``prefill_tokens`` tokens (none in a decode), then, where tokens remain (``split_tokens``: a
    decode's, or a persistent prefill's last partial round, :func:`plan_tail`), the split kernel over ``splits``
    parts of their top-k ranges and the combine."""

    kernels: AttnKernels
    tokens: int
    prefill_tokens: int
    splits: int = 1  # parts of each split-path token's top-k range; 1 where no token takes the split path
    widen_pool: bool = False  # the pool is widened to bf16 first and ``kernels`` are the bf16 rows' (plan_widen_pool)
    count_rows: bool = False  # eagerly, count the rows the call selects: widened alone where they pass plan_widen_pool
    union: UnionKey | None = None  # grouped head blocks (plan_group): the kernel that makes each group's union first
    rest: "AttnLaunch | None" = None  # grouped: the launch of the last tokens, fewer than a group

    def __post_init__(self):
        assert 0 <= self.prefill_tokens <= self.tokens, "the prefill takes some of the call's tokens"
        assert (self.splits > 1) == (self.split_tokens > 0), "the split path runs where tokens remain"
        assert not self.union or self.prefill_tokens % self.group == 0, "grouped blocks take whole groups"
        assert self.rest is None or self.rest.tokens == self.tokens - self.prefill_tokens, "the rest: the last tokens"

    @property
    def group(self) -> int:
        """Tokens of a grouped head block (1: a block holds one token's heads)."""
        return self.union.tokens if self.union else 1

    @property
    def rest_tokens(self) -> int:
        return self.rest.tokens if self.rest else 0

    @property
    def split_tokens(self) -> int:
        """The last tokens, which take the split path (0 where the prefill, and a grouped launch's rest, take them)."""
        return self.tokens - self.prefill_tokens - self.rest_tokens

    @property
    def prefill(self) -> AttnKey | None:
        """The prefill kernel, where it runs (None in a decode)."""
        return self.kernels.prefill if self.prefill_tokens else None

    @property
    def split(self) -> tuple:
        """``(split kernel, combine)`` where tokens take the split path, else ``()``."""
        return (self.kernels.split, self.kernels.combine) if self.split_tokens else ()

    @property
    def partial_heads(self) -> int:
        return self.kernels.partial_heads

    @property
    def keys(self) -> tuple:
        """Every kernel the call launches, in order."""
        union = (self.union,) if self.union and self.prefill else ()
        return union + ((self.prefill,) if self.prefill else ()) + self.split + (self.rest.keys if self.rest else ())

    def __str__(self) -> str:
        split = f"{self.kernels.split.family} x{self.splits} + combine" if self.split else ""
        if not self.prefill:
            return split
        widen_pool = "pool to bf16 + " if self.widen_pool else ""
        if self.union:
            rest = f" + {self.rest} (last {self.rest_tokens} tokens)" if self.rest else ""
            return f"{widen_pool}union of {self.group} tokens + {self.prefill.family} (grouped){rest}"
        if not self.split:
            return widen_pool + self.prefill.family
        return f"{widen_pool}{self.prefill.family} + {split} (last {self.split_tokens} tokens)"


def attn_kernels(
    geo: AttnGeometry,
    sm90: bool,
    sm_count: int | None = None,
    transposed: bool | None = None,
    sink: bool = False,
    max_logits: bool = False,
) -> AttnKernels:
    """The kernels of ``geo`` on a target, sm_90 CUDA where ``sm90``. There, where the geometry allows
    (:func:`csrc_tl.attention.ws_supported`, any head count), the prefill and the split kernel are warp-specialized,
    else both are portable. A warp-specialized prefill that :func:`csrc_tl.attention.ws_persistent` builds persistent
    launches one CTA per SM: ``sm_count`` of them, or :data:`csrc_tl.attention.DEFAULT_CTAS` (an H200's) where
    None. After a warp-specialized split kernel the combine is its programmatic dependent. At
    :data:`~csrc_tl.attention.geometry.TRANSPOSED_MAX_HEADS` heads or fewer (a tensor-parallel shard) the
    warp-specialized kernels run the transposed few-heads consumers where they apply
    (:func:`csrc_tl.attention.ws_transposed`); ``transposed=False`` asks for the plain ones, ``True`` for the
    transposed ones wherever they are built (up to TRANSPOSED_MAX_HEADS heads): the bench's same-run comparison.
    With ``sink`` the prefill kernel and the combine take an attention sink, with ``max_logits`` the prefill kernel
    writes the row maxima (its ``sink_max`` variant does both)."""
    ws = sm90 and ws_supported(geo)
    ctas = (DEFAULT_CTAS if sm_count is None else sm_count) if ws and ws_persistent(geo, split=False) else 0
    few = ws and transposed is not False
    most = TRANSPOSED_MAX_HEADS if transposed else None
    prefill = AttnKey(
        "prefill_ws" if ws else "prefill", geo, ctas, sink or max_logits, few and ws_transposed(geo, False, most)
    )
    split = AttnKey("decode_ws" if ws else "decode", geo, transposed=few and ws_transposed(geo, True, most))
    return AttnKernels(prefill, split, CombineKey(geo.d_v, geo.heads, partial_heads(geo.heads, ws), ws, sink))


def plan_launch(
    geo: AttnGeometry,
    tokens: int,
    topk: int,
    sm_count: int,
    sm90: bool,
    transposed: bool | None = None,
    sink: bool = False,
    max_logits: bool = False,
    slots: int | None = None,
    widen_pool: bool | None = None,
    group: bool | None = None,
) -> AttnLaunch:
    """The launch of one call over ``tokens`` tokens (T >= 1) of top-k width ``topk`` (K, a multiple of
    :data:`TOPK_BLOCK`) on a GPU of ``sm_count`` SMs, on sm_90 CUDA where ``sm90``, with the kernels of
    :func:`attn_kernels` (a persistent prefill on ``sm_count`` CTAs). The split path takes every token where
    :func:`plan_splits` splits their top-k ranges (a decode: too few (token, head block) items to fill the GPU),
    else the prefill takes them, all but a persistent prefill's last partial round (:func:`plan_tail`).
    GLM packed prefill T 4096 at 64 heads on 132 SMs, sm_90: the persistent prefill over 4092 tokens, the last 4
    in 16 splits; a decode T 1 at 64 heads: 32 splits of one top-k block each. Over a pool of ``slots`` rows (S;
    None: unknown, never widened) of FP8 rows, :func:`plan_widen_pool` decides whether the pool is widened to bf16
    first, and the call then runs the kernels of :func:`widened_geometry`; ``widen_pool`` forces either (the bench's
    and the tests' same-run comparison; True needs FP8 rows on sm_90). Over bf16 rows (or the pool widened),
    :func:`plan_group` decides whether head blocks hold several tokens (the union kernel, then the prefill kernel of
    :func:`grouped_geometry` over whole groups, the last tokens in ``rest``); ``group`` forces either (True: where the
    heads allow), and a forced ``transposed`` keeps one token a block."""
    assert tokens >= 1, "a call of no tokens launches nothing"
    common = dict(transposed=transposed, sink=sink, max_logits=max_logits, slots=slots, group=group)
    if widen_pool is None:
        widen_pool = slots is not None and plan_widen_pool(geo, tokens, topk, slots, sm90)
        count = slots is not None and not widen_pool and plan_count_rows(geo, tokens, sm90)
        launch = plan_launch(geo, tokens, topk, sm_count, sm90, widen_pool=widen_pool, **common)
        return dataclasses.replace(launch, count_rows=count) if count else launch
    if widen_pool:
        assert sm90 and geo.kv_kind != "bf16", "widening the pool takes FP8 rows and the sm_90 bf16 kernels"
        bf16 = plan_launch(widened_geometry(geo), tokens, topk, sm_count, sm90, widen_pool=False, **common)
        return dataclasses.replace(bf16, widen_pool=True)
    if group is None:
        group = transposed is None and slots is not None and plan_group(geo, tokens, topk, slots, sm90) > 1
    if group and _groupable(geo, tokens, slots, sm90):
        return _grouped_launch(geo, tokens, topk, sm_count, sink, max_logits, union_table(slots))
    kernels = attn_kernels(geo, sm90, sm_count, transposed, sink, max_logits)
    splits = plan_splits(tokens, geo.heads, topk, sm_count)
    if splits > 1:
        return AttnLaunch(kernels, tokens, 0, splits)
    if kernels.ctas:  # a persistent prefill
        prefill_tokens, splits = plan_tail(tokens, geo.heads, topk, kernels.ctas, sm_count)
        return AttnLaunch(kernels, tokens, prefill_tokens, splits)
    return AttnLaunch(kernels, tokens, tokens)


def _grouped_launch(geo, tokens, topk, sm_count, sink, max_logits, table) -> AttnLaunch:
    """The grouped launch of :func:`plan_launch` (its arguments; ``table`` the union kernel's, at least the pool)."""
    assert table is not None, f"grouped blocks take pools of at most {UNION_TABLES[-1]} rows"
    grouped = grouped_geometry(geo)
    per = grouped.group_tokens
    kernels = attn_kernels(grouped, True, sm_count, False, sink, max_logits)
    main = tokens // per * per
    rest = None
    if main < tokens:
        rest = plan_launch(geo, tokens - main, topk, sm_count, True, sink=sink, max_logits=max_logits, group=False)
    union = UnionKey(per, table, geo.has_topk_length)
    return AttnLaunch(kernels, tokens, main, union=union, rest=rest)


def grouped_geometry(geo: AttnGeometry) -> AttnGeometry:
    """The kernels' geometry of a grouped call over ``geo``'s bf16 rows: 64-row head blocks of ``64 / geo.heads`` tokens
    each, walking their union to its length (:mod:`csrc_tl.attention.union`)."""
    return dataclasses.replace(geo, heads=MAX_HEAD_BLOCK, group=geo.heads, has_topk_length=True)


def union_share(tokens: int, topk: int, slots: int) -> float:
    """The expected size of the union of ``tokens`` selections of ``topk`` distinct rows each, drawn uniformly from
    ``slots`` rows, over their total size: ``S (1 - (1 - K / S)^G) / (G K)``."""
    if slots <= topk:
        return slots / (tokens * topk)
    return slots * (1 - (1 - topk / slots) ** tokens) / (tokens * topk)


def plan_group(geo: AttnGeometry, tokens: int, topk: int, slots: int, sm90: bool) -> int:
    """Tokens a head block holds in a call over a pool of ``slots`` bf16 rows (see :data:`GROUP_MAX_UNION`): ``64 /
    heads`` on sm_90 CUDA at :data:`~csrc_tl.attention.geometry.GROUP_HEADS` heads (the warp-specialized kernels),
    from :data:`GROUP_MIN_TOKENS` tokens, over a pool the union kernel's table holds, where :func:`union_share`
    is at most :data:`GROUP_MAX_UNION`; else 1. GLM-5 at 8 heads, T 4096, K 2048 over 8192 rows: 8 tokens (a union of
    45% of the selections); over 65536 rows: 1 (90%); DeepSeek at 32 heads over 8192 rows: 2 tokens (88%)."""
    if not _groupable(geo, tokens, slots, sm90) or tokens < GROUP_MIN_TOKENS or topk <= 0:
        return 1
    per = MAX_HEAD_BLOCK // geo.heads
    return per if union_share(per, topk, slots) <= GROUP_MAX_UNION[geo.heads] else 1


def _groupable(geo: AttnGeometry, tokens: int, slots: int | None, sm90: bool) -> bool:
    """Whether a call can run grouped head blocks at all (forced or planned): the warp-specialized kernels of bf16
    rows on sm_90 at a head count of :data:`GROUP_MAX_UNION`, a pool the union kernel's table holds, one whole group
    of tokens or more."""
    if not sm90 or geo.kv_kind != "bf16" or geo.heads not in GROUP_MAX_UNION or not ws_supported(geo):
        return False
    return slots is not None and union_table(slots) is not None and tokens >= MAX_HEAD_BLOCK // geo.heads


def widened_geometry(geo: AttnGeometry) -> AttnGeometry:
    """The kernels' geometry of a call over its pool widened: ``geo`` over bf16 rows and a bf16 q (every FP8 value
    widens exactly)."""
    return dataclasses.replace(geo, kv_kind="bf16", q_fp8=False)


def plan_widen_pool(geo: AttnGeometry, tokens: int, topk: int, slots: int, sm90: bool) -> bool:
    """Whether a call over a pool of ``slots`` FP8 rows (packed or native) widens the pool to bf16 first and runs the
    bf16 kernels (see :data:`WIDEN_REUSE`): on sm_90 CUDA, from :data:`WIDEN_MIN_TOKENS` tokens, where the call
    gathers at least ``WIDEN_REUSE`` rows per pool row and the bf16 copies (the pool's, and a float8 q's) take at most
    :data:`WIDEN_BYTES`. GLM-5 at 8 heads, T 4096, K 2048 over 8192 slots: widened; T 256 over 65536 slots: not;
    DeepSeek's float8 q at 128 heads, T 4096: not (its bf16 copy would take 604 MB)."""
    if not sm90 or geo.kv_kind == "bf16" or tokens < WIDEN_MIN_TOKENS or slots <= 0:
        return False
    copies = (slots + (tokens * geo.heads if geo.q_fp8 else 0)) * geo.d_qk * 2
    return tokens * topk >= WIDEN_REUSE * slots and copies <= WIDEN_BYTES


def plan_count_rows(geo: AttnGeometry, tokens: int, sm90: bool) -> bool:
    """Whether a call over FP8 rows whose whole pool is not widened (a serving pool, larger than the call gathers
    often or than :data:`WIDEN_BYTES`) counts the distinct rows it selects, eagerly (one sync), to widen those alone
    where :func:`plan_widen_pool` passes their count (a prefill chunk of one request selects rows of that request
    only): on sm_90 CUDA from :data:`WIDEN_COUNT_TOKENS` tokens. Inside a graph capture the call keeps the FP8
    kernels."""
    return sm90 and geo.kv_kind != "bf16" and tokens >= WIDEN_COUNT_TOKENS


def plan_splits(tokens: int, heads: int, topk: int, sm_count: int, min_blocks: int = 1) -> int:
    """Splits of the top-k range per (token, head block): 1 (the prefill path) once the grid fills the
    GPU, else as many as keep the whole grid in one wave of one block per SM (a second wave of a few
    blocks doubles the time) while every split keeps at least ``min_blocks`` top-k blocks; then the
    fewest splits with as few blocks per split. GLM decode T 17 (33 blocks) takes 7 splits of 5 blocks
    (the last one 3): the split kernels walk no padding block. (Head blocks are counted the same
    for the portable kernels and for the warp-specialized ones, whose blocks are always 64 heads: both
    give one block per token up to 32 heads and 64-head blocks above.)"""
    blocks = tokens * math.ceil(heads / head_block(heads))
    if blocks >= sm_count:
        return 1
    n_blocks = topk // TOPK_BLOCK
    if n_blocks <= 1:
        return 1
    splits = max(1, min(n_blocks // min_blocks, sm_count // blocks))
    # the fewest splits with as few blocks per split
    return math.ceil(n_blocks / math.ceil(n_blocks / splits))


def plan_tail(tokens: int, heads: int, topk: int, ctas: int, sm_count: int) -> tuple[int, int]:
    """``(prefill tokens, splits)`` for a persistent prefill of ``tokens`` on ``ctas`` CTAs: the tokens whose
    (token, head block) items fill whole rounds of the CTAs go to the prefill kernel, and the rest, if any, to the
    split path in ``splits`` parts. ``(tokens, 1)`` where nothing is split off: no partial round, too few tokens for
    one round, or a rest that :func:`plan_splits` would split in fewer than :data:`TAIL_MIN_SPLITS` parts or whose
    items are shorter than :data:`TAIL_MIN_BLOCKS` top-k blocks. GLM packed prefill T 4096 at 64 heads on 132 SMs:
    4092 tokens in 31 rounds, the last 4 in 16 splits."""
    per_token = math.ceil(heads / head_block(heads))
    step = ctas // math.gcd(ctas, per_token)  # the fewest tokens whose head blocks fill whole rounds
    main = tokens // step * step
    if main in (0, tokens) or topk // TOPK_BLOCK < TAIL_MIN_BLOCKS:
        return tokens, 1
    splits = plan_splits(tokens - main, heads, topk, sm_count, TAIL_SPLIT_BLOCKS)
    return (main, splits) if splits >= TAIL_MIN_SPLITS else (tokens, 1)
