"""The plan of a warp-specialized sparse-attention kernel (:func:`csrc_tl.attention.build_attn_ws`): which producer
scheme gathers the top-k rows, how the consumer warpgroups share a block, the stages, the persistence and every size
derived from them, decided once by :func:`ws_plan` from the kernel's key. The kernel's modules read the plan and
decide nothing again. Which kernels a call runs (this one or the portable ones, over which tokens, in how many
splits) is the launch plan's, :mod:`csrc_tl.attention.launch`, which asks :func:`ws_supported` and
:func:`ws_persistent` here.

Producer schemes: bf16 rows are copied by cp.async straight into a stage (``copies_async``; over 64-row blocks of
paired consumers in stage halves, ``halves``); FP8 rows with room for raw stages are copied raw and widened
shared-to-shared (``staged``, packed rows of the prefill by TMA bulk copies, ``bulk``); other FP8 rows are widened in
their bf16 stage (``inplace``; over packed rows consumer warpgroup 1 widens the last pass (or passes) of each block,
``wg1_widens``). Consumer schemes: ``paired`` (the two consumer warpgroups score the blocks of a pair side by side)
or single (warpgroup 0 scores every block).
"""

from dataclasses import dataclass

from ..layout import QUANT_TILE
from . import device
from .geometry import LOG2E, MAX_HEAD_BLOCK, TRANSPOSED_MAX_HEADS, AttnGeometry, transposed_head_block

# setmaxnreg budgets per thread (consumer warpgroup 0, consumer warpgroup 1, each producer
# warpgroup), by consumer scheme (see build_attn_ws) and producer count. They must fit the registers
# the CTA launched with: 3 x 168 with one producer (a request beyond that hangs the kernel), 4 x 128
# with two; the consumers' budgets are increases from the launch count and the producers' decreases
# (a consumer budget below it is an illegal instruction: H200).
# The in-place producer (512+64 FP8 rows) keeps the copies of WS_INPLACE_AHEAD passes in flight: at 80
# registers ptxas spilled 12-16 bytes in its kernels with topk_length (CPU test), at 88 none. Where
# consumer warpgroup 1 widens a pass of each block too ("inplace_wg1", see build_attn_ws), it holds its
# 64 x 256 accumulator while it widens: at 168 it spilled, at 184 none (sm_90a, 16 and 128 heads); the
# producer spilled 20 bytes at 88 over 512+0 rows, at 96 none. The split kernels over 512+0 rows keep the old scheme:
# with topk_length their producer spilled 20 bytes at 96, and every other split of the 504 registers spilled in some
# geometry (216 / 184 / 104 and 224 / 176 / 104: 4-8 bytes in the 512+64 split kernels).
WS_NREG = {
    ("paired", 1): (208, 224, 72),
    ("single", 1): (240, 168, 80),
    ("single", 2): (208, 144, 80),
    ("inplace", 1): (240, 168, 88),
    ("inplace_wg1", 1): (224, 184, 96),
}


# The transposed consumers' budgets where they differ from WS_NREG: their accumulators are small (a [d_v / 2, hb]
# output half, a [64, hb] score tile), so the in-place producer over packed rows takes registers from warpgroup 0
# (at (224, 184, 96) ptxas spilled 24 bytes in the 512+0 prefill at 16 heads, sm_90a)
WS_NREG_TRANSPOSED = {("inplace_wg1", 1): (208, 184, 112)}
# ... and where the producer gathers the rows through registers (``direct``): it holds a block's share of each row
# (row_words registers a row and pass it fills) while the next one's loads are in flight. H100, GLM-5.3-Flash packed
# prefill at 8 heads: 2019.7 us at (208, 184, 112) (no spills), 1869.6 at (200, 184, 120), on two machines whose
# DeepSeek packed prefill at 8 heads took 2073.5 and 2083.6 us.
WS_NREG_DIRECT = {("inplace_wg1", 1): (200, 184, 120)}


def check_ws_nreg(nreg: tuple[int, int, int], producers: int) -> None:
    """Assert that setmaxnreg budgets ``nreg`` (see :data:`WS_NREG`) fit a CTA of two consumer
    warpgroups and ``producers`` producer warpgroups: each a multiple of 8 in [24, 256], the consumers'
    at least and the producers' at most the registers a thread launches with, and their total within
    the CTA's."""
    launch = 65536 // (128 * (2 + producers)) // 8 * 8  # registers a thread of the CTA launches with
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in nreg), f"budgets {nreg}: multiples of 8 in [24, 256]"
    assert nreg[0] >= launch and nreg[1] >= launch and nreg[2] <= launch, f"budgets {nreg} against {launch}"
    assert nreg[0] + nreg[1] + producers * nreg[2] <= (2 + producers) * launch, f"budgets {nreg} exceed the CTA's"


WS_THREADS_PER_ROW = 8


def ws_row_lane(tx, quarters: bool):
    """``(row, lane)`` of producer thread ``tx`` in one pass of :func:`build_attn_ws` (an int or a TIR
    expression): each row of a pass has eight lanes. Eight consecutive threads take one row, or with
    ``quarters`` a quarter warp (the eight threads one 16-byte shared-memory access serves at once) takes
    lanes 0-3 or 4-7 of two adjacent rows.

    Why quarters: a lane of an FP8 row widens 16-value chunks into 32 bytes of the bf16 stage, whose
    128-byte swizzle puts lanes 0-3 and 4-7 of a row (two 64-wide atoms) on the same banks, so the eight
    lanes of one row store each 16-byte half in two wavefronts (ncu, GLM packed prefill: STS.128 at
    twice their ideal wavefronts, 13% of the kernel's shared-memory wavefronts); lanes 0-3 of two rows,
    which differ in the swizzle's lowest bit, store it in one."""
    if quarters:
        return tx // 16 * 2 + tx // 4 % 2, tx % 4 + tx // 8 % 2 * 4
    return tx // WS_THREADS_PER_ROW, tx % WS_THREADS_PER_ROW


def ws_inplace_raw_col(group: int, lane):
    """Stage column where lane ``lane`` (0-7; an int or a TIR expression) of a row copies its 16 raw FP8
    values of 128-value ``group`` of a value half, for the in-place producer of :func:`build_attn_ws`.
    Lane ``l`` widens values ``128 * group + 16 * l`` to ``+ 16`` into the columns of the same numbers, so a
    group takes two 64-column (128-byte) lines of its row widened; its 128 raw bytes go into the second
    line, the eight lanes' side by side, and lanes 4-7 widen over them once every lane of the warp has
    loaded its own (``dsa_widen`` with ``kSync``; the eight lanes of a row are in one warp).

    Why: with each lane's raw bytes in the second half of its own 32 widened bytes, every 16-byte copy
    took a shared-memory wavefront of its own (ncu, DeepSeek packed decode T 256: 32 wavefronts per
    warp-wide cp.async where 4 carry its 512 bytes); contiguous, the copies take whole lines (BENCHMARKS.md,
    design decisions)."""
    line = 8 * WS_THREADS_PER_ROW  # bf16 columns of one 128-byte line
    return group * 2 * line + line + lane * 8


def ws_block(geo: AttnGeometry, split: bool) -> int:
    """Top-k rows per block of :func:`build_attn_ws`: 128 for the prefill of narrow bf16 or native FP8
    rows (two bf16 stages of 128 rows still fit beside q, and for FP8 rows two raw stages of
    :data:`WS_RAW_ROWS`; halves the score GEMMs' re-reads of q per row) and of narrow packed rows copied
    by the TMA unit (:func:`ws_bulk`), else 64. The split kernel keeps 64: its splits are whole blocks of
    the top-k range. Packed rows copied by ``cp.async`` keep 64, which measured faster for them (BENCHMARKS.md,
    design decisions)."""
    if split or geo.d_qk > 256:
        return 64
    if geo.kv_kind == "packed":
        return 128 if ws_bulk(geo, split, 128) else 64
    return 128 if geo.kv_kind == "bf16" or ws_staged(geo, 128) else 64


# (named barrier id, threads) of consumer warpgroup 0's column statistics in the transposed consumers (dsa_col_stats)
WS_COL_BARRIER = (12, 128)
# (named barrier id, threads) of the two consumer warpgroups together, between the work items of a persistent kernel
WS_CONSUMER_BARRIER = (13, 256)
# CTAs of a persistent kernel (build_attn_ws, and the launch plan's) unless given: the SM count of an H200 or H100 SXM
DEFAULT_CTAS = 132
# (named barrier id, threads) of the two consumer warpgroups' partial stores: ids above the few TileLang
# numbers its own partial syncs with (1-5 in these kernels)
WS_STORE_BARRIERS = ((14, 128), (15, 128))

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one sm_90 block may use
# Passes of a block whose copies the in-place producer (produce_inplace in build_attn_ws) issues before it
# widens the first: the issue of a block's copies takes about as long as their widening (clock64 stamps,
# DeepSeek packed T 256: 2290 and 2730 cycles a block), so two passes ahead keep the copies of the next passes in
# flight while the first ones widen; one pass ahead, or every pass issued first, was slower.
WS_INPLACE_AHEAD = 2
# Bytes after each row of a raw FP8 stage (with `quarters` in build_attn_ws): the two rows a quarter
# warp reads or writes at once then lie on different banks.
RAW_PAD = 64
# Rows of a raw FP8 stage: the staged producer fills a bf16 stage of 128 rows from two 64-row raw copies
# (the second copied while the first is widened), so that two 128-row stages fit beside q.
WS_RAW_ROWS = 64


def ws_supported(geo: AttnGeometry) -> bool:
    """Whether :func:`build_attn_ws` handles ``geo`` (it also needs an sm_90 CUDA target). Any head
    count: under 64 heads (tensor-parallel shards: 8 or 16 heads) the block is padded with zero rows of
    q, and the kernel still takes the time of a 64-head block, which its producer's per-row gather and
    widening bound, not the GEMMs. The portable kernels over 8- or 16-head blocks took up to 3.7 times as
    long (in nine of ten cases longer; 1-4% shorter at DeepSeek packed T 1, 16 heads: H200,
    BENCHMARKS.md)."""
    # each half of a row takes whole 16-byte chunks of the eight threads of a row: 2 x 8 x 8 bf16
    # values or 2 x 8 x 16 FP8 values (a narrower FP8 row would leave the producer nothing to do)
    width = 128 if geo.kv_kind == "bf16" else 256
    return geo.d_v % width == 0 and geo.d_rope in (0, 64)


def ws_staged(geo: AttnGeometry, block_i: int = 64) -> bool:
    """Whether :func:`build_attn_ws` stages FP8 rows raw, for blocks of ``block_i`` rows: the producer
    copies the next :data:`WS_RAW_ROWS` rows (or the next block, if smaller) into one of two raw shared
    buffers by cp.async (no registers, no wait) while it widens the current ones shared-to-shared, so
    the gather runs behind the widening. Needs the raw stages to fit beside q and the two bf16 stages:
    the 256-wide rows fit (at 128-row blocks too), the 512+64 rows do not (they are widened in place, in
    their bf16 stage)."""
    if geo.kv_kind == "bf16":
        return False
    hb, d_qk = MAX_HEAD_BLOCK, geo.d_qk
    # scales go to registers; RAW_PAD is counted for every kernel, though only those with quarters pad
    raw_row = geo.d_v + RAW_PAD + geo.d_rope * (2 if geo.kv_kind == "packed" else 1)
    raw_rows = min(block_i, WS_RAW_ROWS)
    return 2 * hb * d_qk + 2 * 2 * block_i * d_qk + 2 * raw_rows * raw_row + 2 * hb * block_i + 4096 <= SMEM_LIMIT


def ws_quarters(geo: AttnGeometry, split: bool, block_i: int = 64) -> bool:
    """Whether the producer of :func:`build_attn_ws` maps its threads to rows by quarter warps
    (:func:`ws_row_lane`): for every FP8 kernel but the prefill over staged packed rows copied by
    ``cp.async`` (:func:`ws_bulk`). bf16 rows are copied straight into the stage, 16 bytes per lane: no
    conflict either way. Quarters spread a warp's shared-memory stores over four rows' banks; for the staged
    packed rows copied by ``cp.async`` they measured slower (BENCHMARKS.md, design decisions)."""
    if geo.kv_kind == "bf16":
        return False
    return split or geo.kv_kind != "packed" or not ws_staged(geo, block_i) or ws_bulk(geo, split, block_i)


def ws_bulk(geo: AttnGeometry, split: bool, block_i: int = 64) -> bool:
    """Whether the staged producer of :func:`build_attn_ws` copies each packed row into its raw stage by one
    bulk copy of the TMA unit (``dsa_bulk_row``: one lane per row issues it) instead of every lane's
    ``cp.async`` pieces (four of 8 bytes a lane and row: the rows are only 8-byte aligned): for the
    prefill over staged packed rows without a tail (GLM's 264-byte rows), whose values are whole 16-byte
    pieces from a start that is 16-byte aligned or 8 bytes past it: one lane's request instead of 32 a row. The
    split kernels keep ``cp.async``, which measured faster there (BENCHMARKS.md, design decisions)."""
    return (
        not split
        and geo.kv_kind == "packed"
        and geo.d_rope == 0
        and ws_staged(geo, block_i)
        and geo.kv_row_width % 8 == 0
        and geo.kv_row_width - geo.d_v >= 8
    )


def ws_persistent(geo: AttnGeometry, split: bool) -> bool:
    """Whether :func:`build_attn_ws` builds ``geo``'s kernel persistent (``ctas`` CTAs): the prefill over staged packed
    rows copied by the TMA unit (:func:`ws_bulk`, GLM's 264-byte rows). Each CTA walks work items (token, head block)
    one after another, its producer gathering the next item's first blocks while the consumers finish an item,
    instead of the SM idling through one CTA's end and the next one's start (about 4 us a CTA in the GLM packed
    prefill, more than a block's time). The other FP8 prefills gained nothing so and keep one CTA per item
    (BENCHMARKS.md, design decisions)."""
    return not split and geo.kv_kind == "packed" and ws_bulk(geo, split, ws_block(geo, split))


# Most heads at which the launch plan runs the transposed consumers: (prefill kernel, split kernel). They were faster
# than the plain consumers at 8, 16 and 32 heads in every case of the bench (BENCHMARKS.md, tensor-parallel shards);
# at 64 heads the plain consumers' M = 64 has no padding left to save.
TRANSPOSED_PLAN_HEADS = (32, 32)


def ws_transposed(geo: AttnGeometry, split: bool, most: int | None = None) -> bool:
    """Whether the warp-specialized kernels of ``geo`` run the transposed consumers: at most
    :data:`~csrc_tl.attention.geometry.TRANSPOSED_MAX_HEADS` heads (a tensor-parallel shard: 8 to 32 heads per GPU).

    Why: the plain consumers put the heads in the GEMMs' M dimension, whose wgmma tile is 64 rows, so 8 or 16 heads
    cost what 64 cost. Transposed, the block's keys are M (``S^T = K . Q^T``, 64 keys by ``hb`` heads, ``hb`` the
    heads rounded up to a multiple of 8) and the output is ``O^T += V^T . P^T`` (``d_v`` by ``hb``, V^T read from the
    same bf16 stage as an MN-major operand), so the tensor cores do the work of the real heads and the softmax becomes
    a reduction over the rows of the scores. The producers are unchanged: at few heads they bound the kernel.

    Needs 64-row blocks (:func:`ws_block`): TileLang 0.1.15 cannot reduce the rows of a 128-row transposed score
    fragment (two M tiles per thread), so the prefills of 256-wide rows keep the plain consumers. Used up to
    :data:`TRANSPOSED_PLAN_HEADS` heads (prefill, split kernel), the measured crossover, or ``most``."""
    most = TRANSPOSED_PLAN_HEADS[1 if split else 0] if most is None else most
    return geo.heads <= most and ws_supported(geo) and ws_block(geo, split) == 64


def ws_direct(geo: AttnGeometry, split: bool, block_i: int = 64) -> bool:
    """Whether the transposed consumers' prefill over the in-place packed rows of ``geo`` gathers them ``direct``:
    each producer thread loads its bytes of a row (16-byte chunks, four tile scales) into registers and stores them
    widened into the bf16 stage, where the in-place producer copies them raw into the stage by cp.async, reads them
    back and stores them widened. A row crosses shared memory three times instead of five.

    Where: GLM-5.3-Flash's 528-byte rows (no tail) at 8 heads or fewer, the one case it made faster (H100, T 4096:
    2043 -> 1870 us). Elsewhere it was slower, so fewer crossings are not what bounds those kernels: DeepSeek's
    656-byte rows at 8 / 16 / 32 heads 2074 / 2229 / 2401 -> 2199 / 2416 / 2702 us, 512+0 at 16 / 32 heads
    2170 / 2342 -> 2303 / 2626 us (BENCHMARKS.md, design decisions)."""
    if split or geo.kv_kind != "packed" or geo.d_rope or ws_staged(geo, block_i) or geo.d_v != 4 * QUANT_TILE:
        return False
    layout = geo.layout
    return transposed_head_block(geo.heads) <= 8 and geo.kv_row_width % 16 == 0 and layout.scale_offset % 16 == 0


def ws_paired_fits(geo: AttnGeometry, block_i: int) -> bool:
    """Whether the paired scheme of :func:`build_attn_ws` fits in shared memory: q, two stages and two
    probability tiles (warpgroup 0's in its stage's tail where that is as wide as a block)."""
    hb, d_qk = MAX_HEAD_BLOCK, geo.d_qk
    tiles = 1 if geo.d_rope == block_i else 2
    return 2 * (hb * d_qk + 2 * block_i * d_qk + tiles * hb * block_i) + 2048 <= SMEM_LIMIT  # + flags, barriers


# TileLang pass configs of the build_attn_ws kernels: nvcc's fast math, so each exp2f / log2f is one
# ex2 / lg2.approx.ftz instruction (TileLang compiles IEEE-accurate forms by default, with extra
# instructions around each for subnormal results); divisions are approximate and subnormal float32
# values flush to zero too (the GPU suite's comparisons with the reference hold). The softmax's exponentials are on
# the consumers' serial path between GEMMs, so their instructions count (BENCHMARKS.md, design decisions).
WS_PASS_CONFIGS = {"tl.enable_fast_math": True}


# How a warp-specialized kernel's rows reach the bf16 stages its GEMMs read (WsPlan.rows): "async" (bf16 rows by
# cp.async straight into a stage), "staged" (FP8 rows raw into raw stages by cp.async, widened shared-to-shared),
# "bulk" (staged, each raw row by one TMA bulk copy), "inplace" (FP8 rows copied raw into their bf16 stage and widened
# there), "direct" (in place, loaded into registers and widened from there, no raw copy in shared memory)
ROW_SCHEMES = ("async", "staged", "bulk", "inplace", "direct")
# How its consumer warpgroups share a block (WsPlan.consumers): "single" (warpgroup 0 scores each block, both take a
# value half of the output), "paired" (each scores one block of a pair), "halves" (paired over 64-row blocks:
# FlashMLA's pipeline of stage halves), "transposed" (the few-heads consumers: scores transposed, see ws_transposed)
CONSUMER_SCHEMES = ("single", "paired", "halves", "transposed")


@dataclass(frozen=True)
class WsPlan:
    """Every choice of a warp-specialized kernel and every size derived from them (made by :func:`ws_plan`).

    The two schemes, ``rows`` (:data:`ROW_SCHEMES`) and ``consumers`` (:data:`CONSUMER_SCHEMES`), and what refines
    them: ``split`` (the decode kernel), ``p0_in_tail`` (warpgroup 0's shared probabilities in its stage's tail),
    ``wg1_widens`` (consumer warpgroup 1 widens the last passes of each in-place block, ``wg1_passes``), ``persist``
    (a persistent prefill of at most ``ctas`` CTAs), ``quarters`` (producer threads mapped to rows by quarter warps,
    :func:`ws_row_lane`), ``calls_widen`` (the producer widens through ``dsa_widen``). The schemes' flags
    (``copies_async``, ``staged``, ``bulk``, ``inplace``, ``direct``; ``paired``, ``halves``, ``transposed``) are
    properties of them."""

    geo: AttnGeometry
    split: bool
    rows: str  # ROW_SCHEMES
    consumers: str  # CONSUMER_SCHEMES
    sink_max: bool  # (a prefill) takes an attention sink, writes each row's max (AttnKey.sink_max)
    block_i: int  # top-k rows of a block (of a stage)
    n_prod: int  # producer warpgroups
    nreg: tuple[int, int, int]  # setmaxnreg budgets: consumer warpgroups 0 and 1, each producer warpgroup
    scheme: tuple[str, int]  # (consumer scheme, producers): the key of WS_NREG
    ctas: int
    p0_in_tail: bool
    lazy_gap: float | None  # (halves) the growth of a row's max, in its score units, that moves the running max
    wg1_widens: bool
    persist: bool
    quarters: bool
    calls_widen: bool
    half: int  # value columns of each consumer warpgroup's half
    hb: int  # heads of a block (the GEMMs' M tile)
    groups: int  # head blocks
    scale2: float  # sm_scale in the exp2 domain
    packed: bool
    row_w: int  # elements (bytes for packed rows) of a pool row
    scale_word: int | None  # (packed) float32 word of a row's first scale
    rope_half: int | None  # (packed) bf16 word of a row's tail
    vec: int  # elements one producer thread moves at once (16 bytes read)
    chunks: int  # vectors of a row's values per producer thread, half of them in each half of the row
    tail_chunks: int  # 8-element vectors of a row's tail per producer thread
    rows_per_pass: int  # rows the producer threads fill at once
    block_p: int  # rows of a producer block (a raw stage's rows when staged)
    subs: int  # producer blocks per stage
    passes: int  # passes of a producer block
    raw_w: int  # bytes of a raw slot
    ready_count: int  # arrivals on a stage's ready barrier
    prod_passes: tuple[int, ...] | None  # (wg1_widens) the passes of a block the producer widens
    wg1_passes: tuple[int, ...] | None  # ... and those consumer warpgroup 1 widens
    n_tiles: int  # quantization tiles of a packed row's values
    piece: int  # bytes of one cp.async of FP8 values (row starts are piece-aligned)
    tail_piece: int  # elements of one cp.async of a staged row's tail

    @property
    def copies_async(self) -> bool:
        return self.rows == "async"

    @property
    def staged(self) -> bool:
        return self.rows in ("staged", "bulk")

    @property
    def bulk(self) -> bool:
        return self.rows == "bulk"

    @property
    def inplace(self) -> bool:
        return self.rows in ("inplace", "direct")

    @property
    def direct(self) -> bool:
        return self.rows == "direct"

    @property
    def paired(self) -> bool:
        return self.consumers in ("paired", "halves")

    @property
    def halves(self) -> bool:
        return self.consumers == "halves"

    @property
    def transposed(self) -> bool:
        """Scores as ``[block_i, hb]`` (keys as the GEMM's M, heads as its N) and the output as ``[d_v, hb]``."""
        return self.consumers == "transposed"

    @property
    def prelude(self) -> str | None:
        """The device helpers the kernel calls (:mod:`csrc_tl.attention.device`), or None."""
        return device.prelude(
            self.paired,
            self.inplace,
            self.halves,
            self.bulk,
            self.calls_widen,
            self.split,
            self.persist,
            self.transposed,
            self.direct,
        )

    @property
    def row_words(self) -> int:
        """(``direct``) 32-bit registers that hold one row's share of a producer thread: its value chunks, the row's
        four tile scales, its flag (``dsa_ld_row``)."""
        return 4 * (self.chunks + 1) + 1


def ws_plan(
    geo: AttnGeometry,
    *,
    split: bool = False,
    block_i: int | None = None,
    producers: int | None = None,
    nreg: tuple[int, int, int] | None = None,
    ctas: int = DEFAULT_CTAS,
    sink_max: bool = False,
    transposed: bool = False,
) -> WsPlan:
    """The plan of ``build_attn_ws(geo, split=split, ...)`` (same arguments; see there): pure, of the key only."""
    geo.check()
    assert not (sink_max and split), "sink_max: a prefill kernel's"
    assert ws_supported(geo), "needs d_v a multiple of 128 (256 for FP8 rows), d_rope 0 or 64"
    assert not transposed or geo.heads <= TRANSPOSED_MAX_HEADS, f"transposed: at most {TRANSPOSED_MAX_HEADS} heads"
    block_i = ws_block(geo, split) if block_i is None else block_i
    assert block_i == 64 or not split, "a split kernel works on 64-row blocks"
    d_v, d_tail, heads = geo.d_v, geo.d_rope, geo.heads
    assert not transposed or block_i == 64, "transposed consumers work on 64-row blocks (see ws_transposed)"
    hb = transposed_head_block(heads) if transposed else MAX_HEAD_BLOCK
    scale2 = geo.sm_scale * LOG2E
    packed, row_w = geo.kv_kind == "packed", geo.kv_row_width
    vec = 8 if geo.kv_kind == "bf16" else 16
    copies_async = geo.kv_kind == "bf16"  # bf16 rows go to shared memory as they are, by cp.async
    staged = ws_staged(geo, block_i)
    inplace = geo.kv_kind != "bf16" and not staged  # FP8 rows without room for raw stages: widened in place
    # two producer warpgroups where staged FP8 rows are widened: the widening bounds the kernel
    n_prod = (2 if staged else 1) if producers is None else producers
    # the prefill of bf16 rows: the two consumer warpgroups score the blocks of a pair side by side;
    # elsewhere warpgroup 0 scores each block as soon as it is ready (pairs wait for two blocks, which
    # costs where the producer bounds the kernel, over FP8 rows)
    # (the transposed consumers take every block in the single scheme: each block's GEMMs are a few wgmma of N = hb)
    paired = geo.kv_kind == "bf16" and not split and not transposed and ws_paired_fits(geo, block_i)
    # where the tail is as wide as a block, warpgroup 0's shared probabilities take its stage's tail
    # (read by its score GEMM only; refilled after warpgroup 1's last PV GEMM of the pair, as FlashMLA)
    p0_in_tail = paired and d_tail == block_i
    # Paired over 64-row blocks (rows wider than 256): FlashMLA's pipeline. Each stage has two halves with
    # barriers of their own (the left value half; the right one with the tail), refilled as soon as their
    # last reader is done, and warpgroup 0 issues the next pair's score GEMMs under its last PV GEMM.
    # Over 128-row blocks (GLM) the whole-stage scheme measured faster and stays.
    halves = paired and block_i == 64
    # The running max moves only when a row's max grows by more than 2^8 in the exp2 domain, so most
    # blocks rescale nothing (probabilities stay below 2^8: exact in float32, the same relative
    # precision in bf16); threads whose rows' max did not move skip the rescale.
    lazy_gap = 8.0 / scale2 if halves else None
    rows_per_pass = 128 * n_prod // WS_THREADS_PER_ROW
    # rows of a producer block: the staged producer fills a stage from raw copies of WS_RAW_ROWS rows
    block_p = min(block_i, WS_RAW_ROWS) if staged else block_i
    passes = block_p // rows_per_pass
    # The in-place kernels over packed rows: consumer warpgroup 1, which otherwise waits most of the time
    # for warpgroup 0's probabilities (ncu: 65% of its samples; the producer paces the kernel), gathers
    # and widens the last pass of each block, the next block's before it waits for the current one's
    # probabilities (BENCHMARKS.md, design decisions).
    wg1_widens = inplace and packed and passes > 1 and (not split or d_tail > 0)
    # At 8 heads the transposed consumers' GEMMs are the smallest (N = 8), and warpgroup 1 widens half the passes
    # (a 6% faster DeepSeek packed prefill); at 16 and 32 heads half was no faster than one pass, nor at 128 heads
    # in the plain consumers (BENCHMARKS.md, design decisions)
    wg1_share = passes // 2 if transposed and hb <= 8 else 1
    direct = transposed and ws_direct(geo, split, block_i)
    inplace_scheme = "inplace_wg1" if wg1_widens else "inplace"
    scheme = ("paired" if paired else inplace_scheme if inplace else "single", n_prod)
    assert nreg is not None or scheme in WS_NREG, f"no register budgets for {scheme}; pass nreg"
    if nreg is None:
        if direct:
            nreg = WS_NREG_DIRECT[scheme]
        else:
            nreg = WS_NREG_TRANSPOSED.get(scheme, WS_NREG[scheme]) if transposed else WS_NREG[scheme]
    check_ws_nreg(nreg, n_prod)

    # A persistent prefill (ws_persistent): a grid of at most `ctas` CTAs, each of which walks the work items (token,
    # head block) bx, bx + ctas, ... one after another, its producer running on into the next item's first blocks
    # while the consumers finish an item. The consumers meet at a named barrier between items (q's tiles hold their
    # stores' rows) and count the stages' phases over all the CTA's blocks.
    persist = ws_persistent(geo, split)
    assert not persist or (staged and not paired), "a persistent kernel runs the staged producer"
    assert ctas >= 1, "a persistent kernel needs at least one CTA"

    quarters = ws_quarters(geo, split, block_i)
    bulk = ws_bulk(geo, split, block_i)
    subs = block_i // block_p
    assert not bulk or (staged and packed and not d_tail), "bulk copies: staged packed rows without a tail"
    # (a persistent kernel's items have a multiple of 4 producer blocks there, so the landing phases restart with each)
    assert not (bulk and persist) or subs % 2 == 0, "persistent bulk copies need stages of an even number of raw blocks"
    rows = "async" if copies_async else ("bulk" if bulk else "staged") if staged else "direct" if direct else "inplace"
    consumers = "transposed" if transposed else ("halves" if halves else "paired") if paired else "single"
    assert not geo.group or paired, "a grouped head block runs the paired consumers (bf16 rows, a prefill)"
    return WsPlan(
        geo=geo,
        split=split,
        rows=rows,
        consumers=consumers,
        sink_max=sink_max,
        block_i=block_i,
        n_prod=n_prod,
        nreg=nreg,
        scheme=scheme,
        ctas=ctas,
        p0_in_tail=p0_in_tail,
        lazy_gap=lazy_gap,
        wg1_widens=wg1_widens,
        persist=persist,
        quarters=quarters,
        calls_widen=(inplace and not direct) or (staged and not packed),  # (see widen_raw)
        half=d_v // 2,
        hb=hb,
        groups=-(-heads // hb),
        scale2=scale2,
        packed=packed,
        row_w=row_w,
        scale_word=geo.layout.scale_offset // 4 if packed else None,
        rope_half=geo.layout.rope_offset // 2 if packed else None,
        vec=vec,
        chunks=d_v // (vec * WS_THREADS_PER_ROW),
        tail_chunks=d_tail // (8 * WS_THREADS_PER_ROW),
        rows_per_pass=rows_per_pass,
        block_p=block_p,
        subs=subs,
        passes=passes,
        # a bulk-copied row may land 8 bytes into its slot, with 8 more bytes after its values
        raw_w=d_v + (16 if bulk else RAW_PAD if quarters else 0),
        # each producer thread arrives once, or twice with cp.async; and warpgroup 1's threads where they widen
        ready_count=128 * n_prod * (2 if copies_async else 1) + (128 if wg1_widens else 0),
        prod_passes=tuple(range(passes - wg1_share)) if wg1_widens else None,
        wg1_passes=tuple(range(passes - wg1_share, passes)) if wg1_widens else None,
        n_tiles=d_v // QUANT_TILE,
        piece=16 if row_w % 16 == 0 else 8,
        # bf16 of a packed row (8 bytes where the rows or the tail offset are not 16-byte aligned, as in the
        # 392-byte 256+64 row), FP8 values
        tail_piece=(8 if row_w % 16 == 0 and geo.layout.rope_offset % 16 == 0 else 4) if packed else 8,
    )
