"""TileLang kernels of the lightning indexer: FP8 quantization of index keys (plain, or scattered into the paged
index-K cache), the gather of cached keys, the two logits kernels (ragged prefill and paged decode), and
``index_topk``'s filter (the prefill's CTA over every key of its tokens, listing each token's logits at or above a
guess in key order instead of storing them: :func:`build_index_filter`).

Letters: N keys (rows to quantize or store, or keys of the prefill), M gathered slots, T query tokens, R query rows
of a paged batch, B requests, P pages, ``page`` tokens per page, W = max_pages * page, D the head dim (a multiple
of 64), Hi indexer heads (1..128). Every count but D, Hi and ``page`` is a dynamic symbol: one compiled kernel
serves every batch.

The paged index-K cache is ``[P, page * (D + 4)]`` uint8: page p holds ``page * D`` float8_e4m3fn values token-major
(slot ``s = p * page + o`` at byte ``o * D``), then ``page`` float32 scales (that of offset o at byte
``page * D + 4 * o``). Quantization is per row: ``scale = max(amax |x|, 1e-4) / 448`` (``round_scale``: rounded up
to a power of two, exactly), ``values = fp8(clamp(x / scale, -448, 448))`` with the IEEE float32 division and the
round-to-nearest-even, saturating cast.

Logits: ``logits[t, j] = k_scale[j] * sum_h w[t, h] * relu(q[t, h] . k[j])``, the dot of the FP8 (or bf16) values in
float32, over each row's valid keys, -inf elsewhere. The work is a GEMM of a key block ``[64, D]`` (the tensor
core's M) by a query block ``[BT * Hp, D]`` (its N; Hp the heads padded to a power of two, BT tokens so that BT * Hp
= 128), whose accumulator each thread reduces over the heads it holds (the 4 lanes of a quad complete the sum: a
butterfly in the portable and decode kernels; in the warp-specialized prefill, whose query block pads the heads to
at least 8, a reduce-scatter after which each lane stores a quarter of its key row's tokens). On sm_90 (``ws`` keys)
the kernels are warp-specialized: a producer warp loads key blocks by TMA into shared stages, and the consumer
warpgroups run FP8 wgmma and the epilogue; the prefill's CTA holds two query blocks, one a consumer warpgroup, that
both read each key block from one shared stage (half the key loads a token), and the two order their GEMMs
(ping-pong) so that one's epilogue runs under the other's GEMM. Other targets (and bf16 queries) run a
portable kernel of the same tiling with ``T.gemm``.

Nothing is read or written out of bounds for any index value: slots outside ``[0, P * page)`` are skipped by stores
and give zeros (scale 0) in gathers; page-table entries outside ``[0, P)`` and positions at or past a row's length
give -inf, and pages that hold no position before the length are not read (the warp-specialized decode loads a page
that holds some whole, and masks the rest); key rows past N are zero-filled by the TMA unit (or not loaded) and
never stored.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import tilelang.language as T

__all__ = [
    "FP8_MAX",
    "SCALE_FLOOR",
    "QuantIndexKey",
    "GatherIndexKey",
    "IndexLogitsKey",
    "IndexFilterKey",
    "PagedLogitsKey",
    "head_padding",
    "default_split_pages",
    "index_logits_key",
    "paged_logits_key",
    "ws_supported",
    "paged_ws_supported",
    "row_amax",
    "butterfly_max",
    "row_scale",
    "fp8_value",
    "build_quant_index",
    "build_gather_index_k",
    "build_index_logits",
    "build_index_filter",
    "build_paged_index_logits",
    "pass_configs",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-4  # amax floor of a row: an all-zero row gets scale 1e-4 / 448, never 0
SCALE_BYTES = 4  # one float32 scale per cached token
POW2_ROUND_UP = 0x7FFFFF  # added to a positive normal float32's bits, then masked: round up to 2^k
EXPONENT_MASK = -0x800000  # 0xFF800000 as int32: sign and exponent bits
SLOT_DTYPES = ("int32", "int64")
Q_DTYPES = {"float8_e4m3fn": "fp8", "bfloat16": "bf16"}
DIM_MULTIPLE = 64  # head dims: whole wgmma / MFMA K steps and 16-byte row chunks
MAX_HEADS = 128

# Cache kernels: a group of 32 lanes handles whole rows, VEC values a lane (one 16-byte bf16 load).
THREADS = 128
GROUP = 32
VEC = 8
QUANT_ROW_SETS = 2  # row sets a group loads before it quantizes any (their loads in flight together)
GATHER_ROWS = 32  # rows per block of the gather

# Logits kernels.
BN = 64  # key rows per GEMM (one warpgroup's M)
QN = 128  # query rows (tokens x padded heads) per GEMM: its N
# Key columns a prefill CTA takes (grid: CTAs of tokens x column chunks; :func:`logits_cols`): at most LOGITS_CHUNK,
# fewer where the tokens' CTAs alone leave the GPU short of LOGITS_WAVES CTAs an SM, down to LOGITS_MIN_COLS.
LOGITS_CHUNK = 16384
LOGITS_MIN_COLS = 2048
LOGITS_WAVES = 2
WS_STAGES = 6  # shared key stages of the prefill (both consumer warpgroups read each)
# Heads of the warp-specialized prefill's query block at least (fewer are padded with zero weights): from 8 a column
# group of the accumulator lies in one token, which the epilogue's reduce-scatter over a key row's four lanes needs.
WS_MIN_HP = 8
# The warp-specialized prefill's epilogues (dsa_index_weights, dsa_index_block; the filter's dsa_filter_*), injected
# into their kernels' prelude.
WS_EPILOGUE = Path(__file__).with_name("indexer_epilogue.cuh").read_text()
WS_NREG = (216, 72)  # setmaxnreg budgets of the prefill: consumer warpgroups, producer warpgroup (3 x 168 at launch)
FILTER_BARRIER = 12  # the named barriers of the filter's consumer warpgroups: 12 and 13 (TileLang takes the first)
PAGED_SPLIT_TOKENS = 1024  # positions per decode CTA (at least): a 128K-token row spreads over 128 CTAs
PAGED_STAGES = 4  # shared tile stages of the decode consumer
PORTABLE_THREADS = 256


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def _lanes(dim: int) -> int:
    """Lanes of a group that share a row of ``dim`` values, VEC each: the largest power of two dividing
    ``dim / VEC``, at most 32 (a butterfly needs a power of two)."""
    chunks = dim // VEC
    return min(GROUP, chunks & -chunks)


def _check_dim(dim: int) -> None:
    assert isinstance(dim, int) and dim > 0 and dim % DIM_MULTIPLE == 0, (
        f"head dim must be a positive multiple of {DIM_MULTIPLE} (16-byte chunks, whole GEMM K steps), got {dim}"
    )


def _check_page(page: int) -> None:
    assert isinstance(page, int) and page > 0, f"page must be a positive number of tokens, got {page}"


def _slot_suffix(slot_dtype: str) -> str:
    return {"int32": "i32", "int64": "i64"}.get(slot_dtype, slot_dtype)


def pass_configs(key) -> dict:
    """TileLang pass configs of a kernel of this module: none (the quantization needs the IEEE division and the
    logits no transcendental function, so nothing asks for fast math)."""
    return {}


# ---------------------------------------------------------------------------------------------------------------
# Quantization and the index-K cache.


@dataclass(frozen=True)
class QuantIndexKey:
    """A quantizing kernel: ``quant_index`` (``page == 0``) or ``store_index_k`` into a cache of ``page`` tokens per
    page, over rows of ``dim`` values; ``round_scale`` rounds each scale up to a power of two; ``slot_dtype`` is the
    dtype of ``store_index_k``'s slot ids (unused by ``quant_index``)."""

    dim: int
    page: int = 0
    round_scale: bool = False
    slot_dtype: str = "int32"

    @property
    def name(self) -> str:
        pow2 = "_pow2" if self.round_scale else ""
        if self.page == 0:
            return f"quant_index_d{self.dim}{pow2}"
        return f"store_index_k_d{self.dim}_p{self.page}{pow2}_{_slot_suffix(self.slot_dtype)}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class GatherIndexKey:
    """The gather of cached index keys: ``dim`` values a token, ``page`` tokens a page, slot ids of ``slot_dtype``."""

    dim: int
    page: int
    slot_dtype: str = "int32"

    @property
    def name(self) -> str:
        return f"gather_index_k_d{self.dim}_p{self.page}_{_slot_suffix(self.slot_dtype)}"

    def __str__(self) -> str:
        return self.name


def _store_width(page: int) -> int:
    """Bytes a lane stores (or loads) at once inside a cache page: pages of ``page * (D + 4)`` bytes keep 16-byte
    alignment for ``page`` a multiple of 4, 8 for an even ``page``, else 4 (D + 4 is a multiple of 4)."""
    return 16 if page % 4 == 0 else 8 if page % 2 == 0 else 4


# The row quantization every kernel that writes index keys shares (``quant_index``, ``store_index_k`` and the k-pool
# family's store), so that a key's FP8 bytes and scale come out the same whichever kernel wrote it.


def row_amax(x, start: int, count: int):
    """``max |x[start + i]|`` over ``i < count`` as a tree of pairwise maxima (any count: head dims such as 192
    give a lane 3 chunks)."""
    if count == 1:
        return T.abs(x[start])
    half = count // 2
    return T.max(row_amax(x, start, half), row_amax(x, start + half, count - half))


@T.macro
def butterfly_max(acc, lanes: int):
    """``acc[0]`` = its maximum over the aligned runs of ``lanes`` threads (a power of two up to 32)."""
    for delta in tuple(lanes >> k for k in range(1, lanes.bit_length())):
        acc[0] = T.max(acc[0], T.shfl_xor(acc[0], delta, GROUP))


def row_scale(amax, round_scale: bool):
    """``max(amax, 1e-4) / 448`` (float32 division), rounded up to a power of two when ``round_scale`` (exact:
    the scale is a positive normal float, at least 1e-4 / 448)."""
    scale = T.max(amax, T.float32(SCALE_FLOOR)) / T.float32(FP8_MAX)
    if round_scale:
        scale = T.reinterpret((T.reinterpret(scale, T.int32) + POW2_ROUND_UP) & EXPONENT_MASK, T.float32)
    return scale


def fp8_value(x, scale):
    """``x / scale`` (the IEEE float32 division) saturated to +-448 and rounded to the nearest even FP8 value."""
    return T.cast(T.clamp(x / scale, -FP8_MAX, FP8_MAX), T.float8_e4m3fn)


def build_quant_index(key: QuantIndexKey):
    """Quantize rows of ``dim`` bf16 values to FP8 with one float32 scale a row.

    ``page == 0`` (``quant_index``), called as ``fn(x, values, scale)``:

    - ``x`` : ``[N, D]`` bfloat16, contiguous
    - ``values`` : ``[N, D]`` float8_e4m3fn, written
    - ``scale`` : ``[N]`` float32, written

    ``page > 0`` (``store_index_k``), called as ``fn(k, loc, cache)``:

    - ``k`` : ``[N, D]`` bfloat16, contiguous
    - ``loc`` : ``[N]`` ``slot_dtype`` (int32 or int64), slot ids; ids outside ``[0, P * page)`` are skipped
    - ``cache`` : ``[P, page * (D + 4)]`` uint8, 16-byte aligned; row i goes to slot ``loc[i]`` (its values and
      its scale), and no other byte changes

    A group of 32 lanes quantizes ``32 / lanes`` rows at once (``lanes``: VEC = 8 values a lane, one 16-byte load),
    two such sets before it computes on any, so that their loads are in flight together; the row's amax is a
    butterfly among its lanes. Grid: ``ceil(N / rows_per_block)``.
    """
    dim, page, round_scale, slot_dtype = key.dim, key.page, key.round_scale, key.slot_dtype
    _check_dim(dim)
    assert isinstance(page, int) and page >= 0, f"page must be 0 (quant_index) or a positive count, got {page}"
    assert slot_dtype in SLOT_DTYPES, f"slot ids are int32 or int64, got {slot_dtype}"
    lanes = _lanes(dim)
    passes = dim // (lanes * VEC)  # VEC-value chunks a lane takes of its row
    rows_per_set = GROUP // lanes  # rows a group quantizes at once
    sets = QUANT_ROW_SETS
    rows_per_block = (THREADS // GROUP) * rows_per_set * sets
    per_lane = passes * VEC
    scatter = page > 0
    row_bytes = page * (dim + SCALE_BYTES)  # bytes of one cache page
    sw = _store_width(page) if scatter else VEC  # FP8 bytes stored at once (alignment inside a page)
    scale_word = page * dim // SCALE_BYTES  # float32 index of a page's first scale
    n = T.dynamic("n")
    p_count = T.dynamic("p")

    @T.macro
    def quantize(x, loc, values, scale, cache):
        with T.Kernel(T.ceildiv(n, rows_per_block), threads=THREADS) as bx:
            if scatter:
                vals = T.view(cache, (p_count, row_bytes), T.float8_e4m3fn)
                scales = T.view(cache, (p_count, row_bytes // SCALE_BYTES), T.float32)
            tx = T.get_thread_binding()
            lane = tx % GROUP
            sub = lane % lanes  # this lane's place in its row
            xs = T.alloc_local((sets * per_lane,), T.float32)
            slots = T.alloc_local((sets,), T.int64)
            qv = T.alloc_local((VEC,), T.float8_e4m3fn)
            sc = T.alloc_local((1,), T.float32)
            # every load of the group's rows first, so that they are in flight together
            for s in T.unroll(sets):
                row = ((bx * (THREADS // GROUP) + tx // GROUP) * sets + s) * rows_per_set + lane // lanes
                src = T.min(row, n - 1)  # (rows past n load row n - 1 and store nothing)
                if scatter:
                    slots[s] = T.if_then_else(row < n, T.cast(loc[src], T.int64), T.int64(-1))
                else:
                    slots[s] = T.if_then_else(row < n, T.cast(row, T.int64), T.int64(-1))
                for p in T.unroll(passes):
                    for v in T.vectorized(VEC):
                        xs[s * per_lane + p * VEC + v] = T.cast(x[src, (p * lanes + sub) * VEC + v], T.float32)
            for s in T.unroll(sets):
                slot = slots[s]
                sc[0] = row_amax(xs, s * per_lane, per_lane)
                butterfly_max(sc, lanes)
                sc[0] = row_scale(sc[0], round_scale)
                limit = T.cast(p_count, T.int64) * page if scatter else T.cast(n, T.int64)
                if slot >= 0 and slot < limit:
                    for p in T.unroll(passes):
                        col = (p * lanes + sub) * VEC
                        for v in T.vectorized(VEC):
                            qv[v] = fp8_value(xs[s * per_lane + p * VEC + v], sc[0])
                        if scatter:
                            pg = slot // page
                            off = slot % page
                            for h in T.unroll(VEC // sw if sw < VEC else 1):
                                for v in T.vectorized(min(sw, VEC)):
                                    vals[pg, off * dim + col + h * sw + v] = qv[h * sw + v]
                        else:
                            for v in T.vectorized(VEC):
                                values[slot, col + v] = qv[v]
                    if sub == 0:
                        if scatter:
                            scales[slot // page, scale_word + slot % page] = sc[0]
                        else:
                            scale[slot] = sc[0]

    x_t = T.Tensor((n, dim), T.bfloat16)
    if scatter:

        @T.prim_func
        def store_index_k(k: x_t, loc: T.Tensor((n,), slot_dtype), cache: T.Tensor((p_count, row_bytes), T.uint8)):
            quantize(k, loc, None, None, cache)

        return store_index_k

    @T.prim_func
    def quant_index(x: x_t, values: T.Tensor((n, dim), T.float8_e4m3fn), scale: T.Tensor((n,), T.float32)):
        quantize(x, None, values, scale, None)

    return quant_index


def build_gather_index_k(key: GatherIndexKey):
    """Gather cached index keys, called as ``fn(cache, indices, values, scale)``:

    - ``cache`` : ``[P, page * (D + 4)]`` uint8, 16-byte aligned
    - ``indices`` : ``[M]`` ``slot_dtype`` (int32 or int64), slot ids
    - ``values`` : ``[M, D]`` float8_e4m3fn, written: the FP8 bytes of slot ``indices[i]``, zeros for an id outside
      ``[0, P * page)`` (which is not dereferenced)
    - ``scale`` : ``[M]`` float32, written: the slot's scale, 0 for an invalid id

    Threads take consecutive chunks of rows (:func:`_store_width` bytes each, 16 for pages of a multiple of 4
    tokens), the last chunk of a row being its 4-byte scale. Grid: ``ceil(M / 32)``.
    """
    dim, page, slot_dtype = key.dim, key.page, key.slot_dtype
    _check_dim(dim)
    _check_page(page)
    assert slot_dtype in SLOT_DTYPES, f"slot ids are int32 or int64, got {slot_dtype}"
    cb = _store_width(page)
    chunks = dim // cb  # value chunks of a row; item `chunks` of a row is its scale
    items = GATHER_ROWS * (chunks + 1)
    steps = -(-items // THREADS)
    row_bytes = page * (dim + SCALE_BYTES)
    scale_word = page * dim // SCALE_BYTES
    m = T.dynamic("m")
    p_count = T.dynamic("p")

    @T.prim_func
    def gather_index_k(
        cache: T.Tensor((p_count, row_bytes), T.uint8),
        indices: T.Tensor((m,), slot_dtype),
        values: T.Tensor((m, dim), T.float8_e4m3fn),
        scale: T.Tensor((m,), T.float32),
    ):
        with T.Kernel(T.ceildiv(m, GATHER_ROWS), threads=THREADS) as bx:
            vals = T.view(cache, (p_count, row_bytes), T.float8_e4m3fn)
            scales = T.view(cache, (p_count, row_bytes // SCALE_BYTES), T.float32)
            tx = T.get_thread_binding()
            buf = T.alloc_local((cb,), T.float8_e4m3fn)
            slot_v = T.alloc_local((1,), T.int64)
            for st in T.unroll(steps):
                item = st * THREADS + tx
                row = bx * GATHER_ROWS + item // (chunks + 1)
                part = item % (chunks + 1)
                if item < items and row < m:
                    slot_v[0] = T.cast(indices[row], T.int64)
                    slot = slot_v[0]
                    ok = (slot >= 0) & (slot < T.cast(p_count, T.int64) * page)
                    if part < chunks:
                        if ok:
                            for v in T.vectorized(cb):
                                buf[v] = vals[slot // page, (slot % page) * dim + part * cb + v]
                        else:
                            for v in T.vectorized(cb):
                                buf[v] = T.cast(0, T.float8_e4m3fn)
                        for v in T.vectorized(cb):
                            values[row, part * cb + v] = buf[v]
                    else:
                        if ok:
                            scale[row] = scales[slot // page, scale_word + slot % page]
                        else:
                            scale[row] = T.float32(0)

    return gather_index_k


# ---------------------------------------------------------------------------------------------------------------
# Logits.


@dataclass(frozen=True)
class IndexLogitsKey:
    """The ragged prefill logits kernel: head dim ``dim``, ``heads`` indexer heads, queries of ``q_dtype``
    ("float8_e4m3fn" or "bfloat16"); ``ws`` picks the warp-specialized sm_90 kernel (FP8 queries only)."""

    dim: int
    heads: int
    q_dtype: str = "float8_e4m3fn"
    ws: bool = True
    # False: -inf only where ``topk(logits, ke - ks, starts=ks)`` reads a column outside the token's logits range
    # (``index_topk``'s chunks: a causal prompt's columns past each token are never written), not the whole row
    fill_all: bool = True

    @property
    def name(self) -> str:
        q = Q_DTYPES.get(self.q_dtype, self.q_dtype)
        fill = "" if self.fill_all else "_cand"
        return f"index_logits_d{self.dim}_h{self.heads}_q{q}{'_ws' if self.ws else ''}{fill}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class IndexFilterKey:
    """``index_topk``'s filter kernel (sm_90, FP8 queries; :func:`build_index_filter`): head dim ``dim``, ``heads``
    indexer heads."""

    dim: int
    heads: int
    ws = True  # (the warp-specialized sm_90 kernels': no portable form)

    @property
    def name(self) -> str:
        return f"index_filter_d{self.dim}_h{self.heads}_ws"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PagedLogitsKey:
    """The paged decode logits kernel: head dim ``dim``, ``heads`` indexer heads, ``page`` tokens per cache page,
    queries of ``q_dtype``; ``ws`` picks the warp-specialized sm_90 kernel; each CTA takes ``split_pages`` pages
    of one row (0: :func:`default_split_pages`)."""

    dim: int
    heads: int
    page: int
    q_dtype: str = "float8_e4m3fn"
    ws: bool = True
    split_pages: int = 0

    @property
    def pages_per_cta(self) -> int:
        return self.split_pages or default_split_pages(self.page)

    @property
    def name(self) -> str:
        return (
            f"paged_index_logits_d{self.dim}_h{self.heads}_p{self.page}_q{Q_DTYPES.get(self.q_dtype, self.q_dtype)}"
            f"{'_ws' if self.ws else ''}_s{self.pages_per_cta}"
        )

    def __str__(self) -> str:
        return self.name


def default_split_pages(page: int) -> int:
    """Pages a decode CTA takes by default: the fewest whole 64-row tiles that hold at least PAGED_SPLIT_TOKENS
    positions (16 pages of 64 tokens: a 128K-token row spreads over 128 CTAs)."""
    unit = BN // math.gcd(page, BN)  # pages of the smallest whole number of tiles
    return unit * max(1, -(-PAGED_SPLIT_TOKENS // (unit * page)))


def head_padding(heads: int, ws: bool = False) -> tuple[int, int]:
    """``(hp, bt)``: the heads padded to a power of two (at least WS_MIN_HP for the warp-specialized prefill,
    ``ws``), and the tokens of a query block (``bt * hp = 128``)."""
    hp = max(_pow2_at_least(heads), WS_MIN_HP if ws else 1)
    return hp, max(1, QN // hp)


def cta_tokens(heads: int, ws: bool) -> int:
    """The query tokens of a prefill CTA: a query block of :func:`head_padding`, two in the warp-specialized kernel
    (one a consumer warpgroup)."""
    return head_padding(heads, ws)[1] * (2 if ws else 1)


def ws_supported(dim: int, heads: int, q_dtype: str) -> bool:
    """Whether the warp-specialized prefill kernel takes this geometry: FP8 queries, and key rows the TMA unit
    moves in one box (at most 256 bytes)."""
    return q_dtype == "float8_e4m3fn" and dim % DIM_MULTIPLE == 0 and dim <= 256 and 1 <= heads <= MAX_HEADS


def paged_ws_supported(dim: int, heads: int, page: int, q_dtype: str) -> bool:
    """Whether the warp-specialized decode kernel takes this geometry: FP8 queries, TMA boxes of at most 256 bytes a
    row, pages of a multiple of 64 tokens (whole 64-row tiles a GEMM; with several pages a tile, at 16 tokens a
    page, the kernel stopped on a misaligned address on an H200, so smaller pages take the portable kernel)."""
    fits = page % BN == 0
    return ws_supported(dim, heads, q_dtype) and fits


def logits_cols(tokens: int, heads: int, keys: int, sms: int, ws: bool) -> int:
    """The ``cols`` argument of the prefill kernel (warp-specialized where ``ws``, else the portable one: the tokens of
    their CTAs, :func:`cta_tokens`) for ``tokens`` queries of ``heads`` heads against ``keys`` keys on ``sms`` SMs:
    LOGITS_CHUNK where the tokens' CTAs fill the GPU; fewer (a multiple of 64, at least LOGITS_MIN_COLS) where they do
    not (a chunk of ``index_topk``, a short prompt), so that the CTAs number about LOGITS_WAVES an SM."""
    blocks = -(-max(tokens, 1) // cta_tokens(heads, ws))
    cols = -(-blocks * max(keys, 1) // (LOGITS_WAVES * max(sms, 1)))
    return min(LOGITS_CHUNK, max(LOGITS_MIN_COLS, -(-cols // BN) * BN))


def index_logits_key(dim: int, heads: int, q_dtype: str, target: str, fill_all: bool = True) -> IndexLogitsKey:
    """The prefill kernel for ``target`` ("cuda" = sm_90, or "hip"): warp-specialized where supported; ``fill_all``
    as :class:`IndexLogitsKey`."""
    ws = target == "cuda" and ws_supported(dim, heads, q_dtype)
    return IndexLogitsKey(dim, heads, q_dtype, ws=ws, fill_all=fill_all)


def paged_logits_key(dim: int, heads: int, page: int, q_dtype: str, target: str) -> PagedLogitsKey:
    """The decode kernel for ``target`` ("cuda" = sm_90, or "hip"): warp-specialized where supported."""
    return PagedLogitsKey(
        dim, heads, page, q_dtype, ws=target == "cuda" and paged_ws_supported(dim, heads, page, q_dtype)
    )


def _check_logits_key(dim: int, heads: int, q_dtype: str) -> None:
    _check_dim(dim)
    assert isinstance(heads, int) and 1 <= heads <= MAX_HEADS, f"heads must be in 1..{MAX_HEADS}, got {heads}"
    assert q_dtype in Q_DTYPES, f"queries are float8_e4m3fn or bfloat16, got {q_dtype}"


@T.macro
def _token_bounds(ks, ke, t0, c0, c1, t_count, bt, tok_lo, tok_hi, rng):
    """Each token's key range within the columns ``[c0, c1)`` of this CTA into the shared ``tok_lo / tok_hi [bt]``
    (``max(ks, 0, c0)`` and ``min(ke, c1)``; an empty range for a token past T), then in every thread
    ``rng [4]``: the union ``[rng[0], rng[1])`` of the non-empty ranges (``rng[0] >= rng[1]`` when there is none) and
    the intersection ``[rng[2], rng[3])`` of the ranges of the tokens that exist."""
    tx = T.get_thread_binding()
    if tx < bt:
        t = T.min(t0 + tx, t_count - 1)
        tok_lo[tx] = T.if_then_else(t0 + tx < t_count, T.max(T.max(ks[t], 0), c0), c1)
        tok_hi[tx] = T.if_then_else(t0 + tx < t_count, T.min(ke[t], c1), c0)
    rng[0] = c1
    rng[1] = c0
    rng[2] = c0
    rng[3] = c1
    for i in T.unroll(bt):
        if tok_lo[i] < tok_hi[i]:
            rng[0] = T.min(rng[0], tok_lo[i])
            rng[1] = T.max(rng[1], tok_hi[i])
        if t0 + i < t_count:
            rng[2] = T.max(rng[2], tok_lo[i])
            rng[3] = T.min(rng[3], tok_hi[i])


@T.macro
def _relu_weigh_reduce(acc, w, lg, bt: int, hp: int):
    """``lg [BN, bt] = sum_h w[t, h] * relu(acc [BN, bt * hp])``: each thread over the heads it holds, then a
    butterfly over the lanes that share a row."""
    acc3 = T.reshape(acc, (BN, bt, hp))
    for j, i, h in T.Parallel(BN, bt, hp):
        acc3[j, i, h] = T.max(acc3[j, i, h], 0) * w[i, h]
    T.reduce_sum(acc3, lg, dim=2)


@T.macro
def _store_block(logits, lg, sc, tok_lo, tok_hi, rng, t0, j0, t_count, bt: int):
    """Write one key block's logits ``lg [BN, bt] * sc [BN]`` at columns ``j0 + j`` of tokens ``t0 + i``: where the
    block lies inside every token's range (``rng[2:4]``) without per-column masks, else -inf outside each token's
    ``[tok_lo, tok_hi)``; nothing at or past N or T. A CTA's blocks never cross its last column ``c0 + cols``
    (``cols`` is a multiple of 64), so N is the one column bound: a bound of the CTA's own (``min(c0 + cols, N)``)
    made the compiler compare every value (23% slower at 8 heads)."""
    if j0 >= rng[2] and j0 + BN <= rng[3]:
        for j, i in T.Parallel(BN, bt):
            if t0 + i < t_count:
                logits[t0 + i, j0 + j] = lg[j, i] * sc[j]
    else:
        for j, i in T.Parallel(BN, bt):
            if t0 + i < t_count and j0 + j < logits.shape[1]:
                logits[t0 + i, j0 + j] = T.if_then_else(
                    (j0 + j >= tok_lo[i]) & (j0 + j < tok_hi[i]), lg[j, i] * sc[j], -T.infinity(T.float32)
                )


@T.macro
def _fill_outside(logits, ks, ke, t0, c0, c1, b0, nb, t_count, lane, lanes: int, bt: int, fill_all: bool):
    """-inf outside the GEMM range ``[b0 * 64, (b0 + nb) * 64)`` (all of it when ``nb == 0``) for each of this
    CTA's tokens, by ``lanes`` threads (``lane`` is this one's place): into the CTA's columns ``[c0, c1)`` where
    ``fill_all``; else only into the token's top-k candidates ``[ks, ks + (ke - ks))`` (the length wrapped to int32
    as the composition computes it, the sum in int64), which lie outside its logits range only where that length
    wraps."""
    edge = T.alloc_local((4,), T.int32)  # the GEMM range, then a token's columns to fill
    edge[0] = T.if_then_else(nb > 0, b0 * BN, c1)
    edge[1] = T.if_then_else(nb > 0, T.min((b0 + nb) * BN, c1), c1)
    gs = edge[0]
    ge = edge[1]
    for i in T.serial(bt):
        if t0 + i < t_count:
            if fill_all:
                for c in T.serial(T.ceildiv(gs - c0, lanes)):
                    if c0 + c * lanes + lane < gs:
                        logits[t0 + i, c0 + c * lanes + lane] = -T.infinity(T.float32)
                for c in T.serial(T.ceildiv(c1 - ge, lanes)):
                    if ge + c * lanes + lane < c1:
                        logits[t0 + i, ge + c * lanes + lane] = -T.infinity(T.float32)
            else:
                t = t0 + i
                wrapped = T.cast(T.cast(ke[t], T.uint32) - T.cast(ks[t], T.uint32), T.int32)
                stop = T.cast(ks[t], T.int64) + T.cast(wrapped, T.int64)
                edge[2] = T.max(T.max(ks[t], 0), c0)
                edge[3] = T.cast(T.max(T.min(stop, T.cast(c1, T.int64)), T.cast(c0, T.int64)), T.int32)
                lo = edge[2]
                hi = edge[3]
                for c in T.serial(T.ceildiv(T.max(T.min(gs, hi) - lo, 0), lanes)):
                    if lo + c * lanes + lane < T.min(gs, hi):
                        logits[t0 + i, lo + c * lanes + lane] = -T.infinity(T.float32)
                for c in T.serial(T.ceildiv(T.max(hi - T.max(ge, lo), 0), lanes)):
                    if T.max(ge, lo) + c * lanes + lane < hi:
                        logits[t0 + i, T.max(ge, lo) + c * lanes + lane] = -T.infinity(T.float32)


def build_index_logits(key: IndexLogitsKey):
    """The ragged prefill logits, called as ``fn(q, k, k_scale, weights, ks, ke, logits)``:

    - ``q`` : ``[T, Hi, D]`` ``q_dtype`` (float8_e4m3fn or bfloat16), contiguous
    - ``k`` : ``[N, D]`` float8_e4m3fn, contiguous, 16-byte aligned
    - ``k_scale`` : ``[N]`` float32, 16-byte aligned
    - ``weights`` : ``[T, Hi]`` float32
    - ``ks``, ``ke`` : ``[T]`` int32, any values
    - ``logits`` : ``[T, N]`` float32, written whole: ``k_scale[j] * sum_h weights[t, h] * relu(q[t, h] . k[j])``
      for ``max(ks[t], 0) <= j < min(ke[t], N)``, -inf elsewhere (without ``fill_all``: -inf only inside the key
      blocks the CTA scores and where ``topk(logits, ke - ks, starts=ks)`` reads past that range)
    - ``cols`` : int, the key columns of a CTA: a positive multiple of 64 (:func:`logits_cols`), any value
      giving the same logits

    Grid: ``(ceil(T / bt), ceil(N / cols))`` (:func:`head_padding`): a CTA takes ``bt`` tokens and ``cols`` key
    columns, runs the GEMMs over the key blocks of the union of its tokens' ranges and writes -inf elsewhere
    without a GEMM.
    """
    _check_logits_key(key.dim, key.heads, key.q_dtype)
    if key.ws:
        assert ws_supported(key.dim, key.heads, key.q_dtype), f"{key.name}: no warp-specialized kernel for it"
        return _build_logits_ws(key)
    return _build_logits_portable(key)


def build_index_filter(key: IndexFilterKey):
    """``index_topk``'s filter, called as ``fn(q, k, k_scale, weights, lo, hi, pos_base, guess, vals, pos, count)``:

    - ``q``, ``k``, ``k_scale``, ``weights``: as :func:`build_index_logits` (FP8 queries)
    - ``lo``, ``hi`` : ``[T]`` int32, each token's candidate keys ``[lo, hi)`` (any values; clipped to ``[0, N)``)
    - ``pos_base`` : ``[T]`` int32, a candidate's position is its key minus ``pos_base`` (``ks``)
    - ``guess`` : ``[T]`` float32, the least logit a candidate may have
    - ``vals``, ``pos`` : ``[T, cap]`` float32 / int32, each token's list: the logits of :func:`build_index_logits`
      at or above its guess (never NaN) inside its range, and their positions, in key order; the first ``cap``
      of them (nothing is written past ``count`` or ``cap``)
    - ``count`` : ``[T]`` int32, written whole: the number of such keys, also past ``cap``

    Grid: ``ceil(T / bt)`` (:func:`cta_tokens`), a CTA over every key of its tokens so that one warpgroup appends
    to a token's list in key order.
    """
    _check_logits_key(key.dim, key.heads, "float8_e4m3fn")
    assert ws_supported(key.dim, key.heads, "float8_e4m3fn"), f"{key.name}: no warp-specialized kernel for it"
    return _build_filter_ws(key)


def _build_logits_ws(key: IndexLogitsKey):
    """Warp-specialized prefill (sm_90). A CTA takes two query blocks (:func:`cta_tokens`): warpgroups 0 and 1 score
    every key block of 64 rows against the first and the second, reading it from one of ``WS_STAGES`` shared stages
    that both release; warpgroup 2 is the producer: its threads stage the query blocks (zero rows for padded heads and
    tokens past T), its first warp loads the key blocks and their scales by TMA (rows past N zero-filled), its other
    three write -inf outside the GEMM range. The consumers order their GEMMs: warpgroup 0's i-th after warpgroup 1's
    (i-1)-th is issued, warpgroup 1's i-th after warpgroup 0's i-th, so that each one's epilogue (relu, weights, the
    sum over heads, stores) overlaps the other's GEMM. Sharing a key block between two query blocks halves the key
    loads a token (against a query block a CTA, each warpgroup taking alternate key blocks)."""
    dim, heads = key.dim, key.heads
    bt = cta_tokens(heads, ws=True)
    t_count, n_count = T.dynamic("t"), T.dynamic("n")
    cta = _ws_cta(key, t_count, _ws_consumer(key, t_count, _logits_epilogue(key, t_count)))

    @T.prim_func
    def index_logits(
        q: T.Tensor((t_count, heads, dim), T.float8_e4m3fn),
        k: T.Tensor((n_count, dim), T.float8_e4m3fn),
        k_scale: T.Tensor((n_count,), T.float32),
        weights: T.Tensor((t_count, heads), T.float32),
        ks: T.Tensor((t_count,), T.int32),
        ke: T.Tensor((t_count,), T.int32),
        logits: T.Tensor((t_count, n_count), T.float32),
        cols: T.int32,
    ):
        with T.Kernel(T.ceildiv(t_count, bt), T.ceildiv(n_count, cols), threads=384, prelude=WS_EPILOGUE) as (bx, by):
            c0 = by * cols
            cta(q, k, k_scale, weights, ks, ke, SimpleNamespace(logits=logits), bx * bt, c0, T.min(c0 + cols, n_count))

    return index_logits


def _build_filter_ws(key: IndexFilterKey):
    """``index_topk``'s filter (sm_90): the CTA of :func:`_build_logits_ws` over every key of its tokens (grid: the
    token blocks alone), whose consumers append each token's logits at or above its guess to the token's list in key
    order (``dsa_filter_block``) instead of storing them; the producer writes nothing."""
    dim, heads = key.dim, key.heads
    bt = cta_tokens(heads, ws=True)
    t_count, n_count, cap = T.dynamic("t"), T.dynamic("n"), T.dynamic("cap")
    cta = _ws_cta(key, t_count, _ws_consumer(key, t_count, _filter_epilogue(key, t_count)))

    @T.prim_func
    def index_filter(
        q: T.Tensor((t_count, heads, dim), T.float8_e4m3fn),
        k: T.Tensor((n_count, dim), T.float8_e4m3fn),
        k_scale: T.Tensor((n_count,), T.float32),
        weights: T.Tensor((t_count, heads), T.float32),
        lo: T.Tensor((t_count,), T.int32),
        hi: T.Tensor((t_count,), T.int32),
        pos_base: T.Tensor((t_count,), T.int32),
        guess: T.Tensor((t_count,), T.float32),
        vals: T.Tensor((t_count, cap), T.float32),
        pos: T.Tensor((t_count, cap), T.int32),
        count: T.Tensor((t_count,), T.int32),
    ):
        with T.Kernel(T.ceildiv(t_count, bt), threads=384, prelude=WS_EPILOGUE) as bx:
            out = SimpleNamespace(pos_base=pos_base, guess=guess, vals=vals, pos=pos, count=count)
            cta(q, k, k_scale, weights, lo, hi, out, bx * bt, 0, n_count)

    return index_filter


def _ws_cta(key, t_count, consume):
    """The body of a warp-specialized prefill CTA (:func:`_build_logits_ws`) of tokens from ``t0`` over the key
    columns ``[c0, c1)``: its shared stages, barriers and registers, the tokens' ranges, then the producer and the two
    ``consume`` warpgroups. ``out``: the output buffers, read by the warpgroups as attributes of ``c``."""
    dim, stages = key.dim, WS_STAGES
    bt, bq = cta_tokens(key.heads, ws=True), head_padding(key.heads, ws=True)[1]
    produce = _ws_producer(key, t_count)
    held = max(1, bq // 2)

    @T.macro
    def no_filter():
        return ({}, {}), {}

    @T.macro
    def filter_registers():
        g0 = T.alloc_local((held,), T.float32)
        g1 = T.alloc_local((held,), T.float32)
        base0 = T.alloc_local((held,), T.int32)
        base1 = T.alloc_local((held,), T.int32)
        cnt0 = T.alloc_local((held,), T.int32)
        cnt1 = T.alloc_local((held,), T.int32)
        totals = T.alloc_shared((2, 32), T.int32)  # a warpgroup's: 2 halves x 2 lane groups x 4 warps, 64 bits
        regs = (dict(g=g0, base=base0, cnt=cnt0), dict(g=g1, base=base1, cnt=cnt1))
        return regs, dict(totals=totals)

    alloc_filter = filter_registers if isinstance(key, IndexFilterKey) else no_filter

    @T.macro
    def cta(q, k, k_scale, weights, ks, ke, out, t0, c0, c1):
        q_s = T.alloc_shared((2 * QN, dim), T.float8_e4m3fn)
        k_s = T.alloc_shared((stages, BN, dim), T.float8_e4m3fn)
        sc_s = T.alloc_shared((stages, BN), T.float32)
        tok_lo = T.alloc_shared((bt,), T.int32)
        tok_hi = T.alloc_shared((bt,), T.int32)
        full = T.alloc_barrier([32] * stages)  # the producer warp's lanes (and the TMA bytes)
        empty = T.alloc_barrier([256] * stages)  # both consumer warpgroups
        turn = T.alloc_barrier([128, 128])  # turn[g]: warpgroup g may issue its next GEMM
        q_ready = T.alloc_barrier(128)
        acc0 = T.alloc_fragment((BN, QN), T.float32)
        acc1 = T.alloc_fragment((BN, QN), T.float32)
        w0 = T.alloc_local((QN // 4,), T.float32)  # the weights of a thread's accumulator columns
        w1 = T.alloc_local((QN // 4,), T.float32)
        scale0 = T.alloc_local((1,), T.float32)
        scale1 = T.alloc_local((1,), T.float32)
        # each consumer warpgroup's own registers (the filter's: a thread's tokens' guesses, position bases and
        # counts), the filter's warps' counts of a block by token
        regs, extra = alloc_filter()
        wg = (
            SimpleNamespace(acc=acc0, w=w0, scale=scale0, **regs[0]),
            SimpleNamespace(acc=acc1, w=w1, scale=scale1, **regs[1]),
        )
        rng = T.alloc_local((4,), T.int32)
        _token_bounds(ks, ke, t0, c0, c1, t_count, bt, tok_lo, tok_hi, rng)
        b0 = rng[0] // BN
        nb = T.if_then_else(rng[0] < rng[1], T.ceildiv(rng[1], BN) - b0, 0)
        # what both kinds of warpgroup read (as attributes, which keep their names in the generated source)
        c = SimpleNamespace(
            q_s=q_s,
            k_s=k_s,
            sc_s=sc_s,
            full=full,
            empty=empty,
            turn=turn,
            q_ready=q_ready,
            weights=weights,
            ks=ks,
            ke=ke,
            tok_lo=tok_lo,
            tok_hi=tok_hi,
            rng=rng,
            n=c1,
            **vars(out),
            **extra,
        )
        tx = T.get_thread_binding()
        if tx >= 256:
            T.set_max_nreg(WS_NREG[1], 0)
            produce(q, k, k_scale, c, t0, c0, c1, b0, nb)
        elif tx < 128:
            T.set_max_nreg(WS_NREG[0], 1)
            consume(0, wg[0], c, t0, b0, nb)
        else:
            T.set_max_nreg(WS_NREG[0], 1)
            consume(1, wg[1], c, t0, b0, nb)

    return cta


def _ws_producer(key, t_count):
    """The producer warpgroup of :func:`_ws_cta` (threads 256-383): both query blocks into ``c.q_s``, then warp 0
    every key block and its scales into the stages ``c.k_s`` / ``c.sc_s`` in turn, warps 1-3 the -inf outside the
    GEMM range (the logits kernels; the filter writes no logits)."""
    dim, heads, stages = key.dim, key.heads, WS_STAGES
    hp, bt = head_padding(heads, ws=True)[0], cta_tokens(heads, ws=True)
    fill_lanes = 96  # the producer's warps 1-3
    q_chunks = 2 * QN * dim // 16  # 16-byte chunks of the query blocks
    assert q_chunks % 128 == 0, "the producer warpgroup stages the query blocks in whole 16-byte chunks"
    fills = isinstance(key, IndexLogitsKey)

    @T.macro
    def produce(q, k, k_scale, c, t0, c0, c1, b0, nb):
        ptx = T.get_thread_binding() - 256
        for it in T.serial(q_chunks // 128):
            r = (it * 128 + ptx) // (dim // 16)
            col = (it * 128 + ptx) % (dim // 16) * 16
            ok = (r % hp < heads) & (t0 + r // hp < t_count)
            for v in T.vectorized(16):
                c.q_s[r, col + v] = T.if_then_else(
                    ok,
                    q[T.min(t0 + r // hp, t_count - 1), T.min(r % hp, heads - 1), col + v],
                    T.cast(0, T.float8_e4m3fn),
                )
        T.fence_proxy_async()  # generic stores, read by wgmma through the async proxy
        T.barrier_arrive(c.q_ready)
        if ptx < 32:
            for i in T.serial(nb):
                s = i % stages
                j0 = (b0 + i) * BN
                T.barrier_wait(c.empty[s], ((i // stages) & 1) ^ 1)
                T.tma_copy(k[j0 : j0 + BN, :], c.k_s[s, :, :], barrier=c.full[s])
                T.tma_copy(k_scale[j0 : j0 + BN], c.sc_s[s, :], barrier=c.full[s])
                T.barrier_arrive(c.full[s])
        elif fills:
            _fill_outside(c.logits, c.ks, c.ke, t0, c0, c1, b0, nb, t_count, ptx - 32, fill_lanes, bt, key.fill_all)

    return produce


def _ws_consumer(key, t_count, epilogue):
    """Consumer warpgroup ``g`` of :func:`_ws_cta`: every key block's GEMM against the g-th query block (its tokens
    from ``t0 + g * bq``, ``bq`` the tokens of a query block), in turn with the other warpgroup's, each followed by
    ``epilogue`` (its ``begin`` before the first block, ``block`` after each GEMM, ``end`` after the last)."""
    hp, bq = head_padding(key.heads, ws=True)
    heads, stages = key.heads, WS_STAGES

    @T.macro
    def consume(g, wg, c, t0, b0, nb):
        # (buffers read as attributes keep their own names in the generated source)
        tw = t0 + g * bq
        T.call_extern("handle", f"dsa_index_weights<{hp}>", c.weights.data, heads, tw, t_count, wg.w.data)
        epilogue.begin(g, wg, c, tw)
        T.barrier_wait(c.q_ready, 0)
        for it in T.serial(nb):
            s = it % stages
            T.barrier_wait(c.full[s], (it // stages) & 1)
            if g == 1:
                T.barrier_wait(c.turn[1], it & 1)
            elif it > 0:
                T.barrier_wait(c.turn[0], (it - 1) & 1)
            T.wgmma_gemm(c.k_s[s, :, :], c.q_s[g * QN : g * QN + QN, :], wg.acc, transpose_B=True, clear_accum=True)
            T.barrier_arrive(c.turn[1 - g])
            T.wait_wgmma(0)
            # the scale of the key row this thread stores, read before the stage is released
            wg.scale[0] = c.sc_s[s, T.call_extern(T.int32, "dsa_index_row")]
            T.barrier_arrive(c.empty[s])
            j0 = (b0 + it) * BN
            epilogue.block(g, wg, c, tw, it, j0, (j0 >= c.rng[2]) & (j0 + BN <= c.rng[3]))
        epilogue.end(g, wg, c, tw)

    return consume


def _logits_epilogue(key: IndexLogitsKey, t_count) -> SimpleNamespace:
    """The logits kernel's epilogue (``dsa_index_block``): each key block's logits stored."""
    hp, bq = head_padding(key.heads, ws=True)

    @T.macro
    def nothing(g, wg, c, tw):
        pass

    @T.macro
    def block(g, wg, c, tw, it, j0, full):
        T.call_extern(
            "handle",
            f"dsa_index_block<{hp}>",
            wg.acc.data,
            wg.w.data,
            wg.scale[0],
            c.logits.data,
            T.cast(c.logits.shape[1], T.int64),
            tw,
            t_count,
            j0,
            T.address_of(c.tok_lo[g * bq]),
            T.address_of(c.tok_hi[g * bq]),
            full,
        )

    return SimpleNamespace(begin=nothing, block=block, end=nothing)


def _filter_epilogue(key: IndexFilterKey, t_count) -> SimpleNamespace:
    """The filter's epilogue: the tokens' guesses and position bases loaded (``dsa_filter_init``), each key block's
    candidates appended (``dsa_filter_block``, the warpgroup's named barrier FILTER_BARRIER + g), the counts
    stored (``dsa_filter_counts``)."""
    hp, bq = head_padding(key.heads, ws=True)

    @T.macro
    def begin(g, wg, c, tw):
        T.call_extern(
            "handle",
            f"dsa_filter_init<{hp}>",
            c.guess.data,
            c.pos_base.data,
            tw,
            t_count,
            wg.g.data,
            wg.base.data,
            wg.cnt.data,
        )

    @T.macro
    def block(g, wg, c, tw, it, j0, full):
        T.call_extern(
            "handle",
            f"dsa_filter_block<{hp}>",
            wg.acc.data,
            wg.w.data,
            wg.scale[0],
            wg.g.data,
            wg.base.data,
            wg.cnt.data,
            c.vals.access_ptr("w"),
            c.pos.access_ptr("w"),
            c.vals.shape[1],
            tw,
            t_count,
            j0,
            T.cast(c.n, T.int64),
            T.address_of(c.tok_lo[g * bq]),
            T.address_of(c.tok_hi[g * bq]),
            full,
            T.address_of(c.totals[g, 0]),
            it & 1,
            FILTER_BARRIER + g,
        )

    @T.macro
    def end(g, wg, c, tw):
        T.call_extern("handle", f"dsa_filter_counts<{hp}>", wg.cnt.data, c.count.access_ptr("w"), tw, t_count)

    return SimpleNamespace(begin=begin, block=block, end=end)


def _build_logits_portable(key: IndexLogitsKey):
    """Portable prefill (HIP, and bf16 queries on CUDA): the tiling of the warp-specialized kernel, one key block of
    64 rows after another with ``T.gemm`` (FP8 x FP8, or bf16 x bf16 with the keys widened on their way into shared
    memory: every e4m3 value is a bf16 value), all threads writing -inf outside the GEMM range first."""
    dim, heads = key.dim, key.heads
    hp, bt = head_padding(heads)
    dtype = T.float8_e4m3fn if key.q_dtype == "float8_e4m3fn" else T.bfloat16
    threads = PORTABLE_THREADS
    t_count, n_count = T.dynamic("t"), T.dynamic("n")

    @T.prim_func
    def index_logits(
        q: T.Tensor((t_count, heads, dim), dtype),
        k: T.Tensor((n_count, dim), T.float8_e4m3fn),
        k_scale: T.Tensor((n_count,), T.float32),
        weights: T.Tensor((t_count, heads), T.float32),
        ks: T.Tensor((t_count,), T.int32),
        ke: T.Tensor((t_count,), T.int32),
        logits: T.Tensor((t_count, n_count), T.float32),
        cols: T.int32,
    ):
        with T.Kernel(T.ceildiv(t_count, bt), T.ceildiv(n_count, cols), threads=threads) as (bx, by):
            q_s = T.alloc_shared((QN, dim), dtype)
            k_s = T.alloc_shared((BN, dim), dtype)
            tok_lo = T.alloc_shared((bt,), T.int32)
            tok_hi = T.alloc_shared((bt,), T.int32)
            acc = T.alloc_fragment((BN, QN), T.float32)
            lg = T.alloc_fragment((BN, bt), T.float32)
            w = T.alloc_fragment((bt, hp), T.float32)
            sc = T.alloc_fragment((BN,), T.float32)
            rng = T.alloc_local((4,), T.int32)
            t0 = bx * bt
            c0 = by * cols
            c1 = T.min(c0 + cols, n_count)
            _token_bounds(ks, ke, t0, c0, c1, t_count, bt, tok_lo, tok_hi, rng)
            b0 = rng[0] // BN
            nb = T.if_then_else(rng[0] < rng[1], T.ceildiv(rng[1], BN) - b0, 0)
            tx = T.get_thread_binding()
            _fill_outside(logits, ks, ke, t0, c0, c1, b0, nb, t_count, tx, threads, bt, key.fill_all)
            for r, d in T.Parallel(QN, dim):
                q_s[r, d] = T.if_then_else(
                    (r % hp < heads) & (t0 + r // hp < t_count),
                    q[T.min(t0 + r // hp, t_count - 1), T.min(r % hp, heads - 1), d],
                    T.cast(0, dtype),
                )
            for i, h in T.Parallel(bt, hp):
                w[i, h] = T.if_then_else(
                    (h < heads) & (t0 + i < t_count), weights[T.min(t0 + i, t_count - 1), T.min(h, heads - 1)], 0.0
                )
            for blk in T.serial(nb):
                j0 = (b0 + blk) * BN
                T.copy(k[j0 : j0 + BN, :], k_s)
                for j in T.Parallel(BN):
                    sc[j] = T.if_then_else(j0 + j < n_count, k_scale[T.min(j0 + j, n_count - 1)], 0.0)
                T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                _relu_weigh_reduce(acc, w, lg, bt, hp)
                _store_block(logits, lg, sc, tok_lo, tok_hi, rng, t0, j0, t_count, bt)

    return index_logits


def _paged_geometry(key: PagedLogitsKey) -> tuple[int, int, int, int]:
    """``(hp, tiles, ppt, row_bytes)`` of a decode kernel: the heads padded to a power of two of at least 8 (the
    GEMM's N), the 64-row tiles of a CTA, the pages a tile holds (``64 / page``, or 1 for pages of 64 tokens or
    more) and the bytes of a cache page."""
    _check_logits_key(key.dim, key.heads, key.q_dtype)
    _check_page(key.page)
    split = key.pages_per_cta
    assert split > 0 and split * key.page % BN == 0, (
        f"a CTA's {split} pages of {key.page} tokens must be whole 64-row tiles"
    )
    # the GEMM's N: wgmma takes multiples of 8, the portable kernels' MMA tiles (HIP's MFMA) 16
    hp = max(8 if key.ws else 16, _pow2_at_least(key.heads))
    ppt = BN // key.page if key.page < BN else 1
    return hp, split * key.page // BN, ppt, key.page * (key.dim + SCALE_BYTES)


def build_paged_index_logits(key: PagedLogitsKey):
    """The paged decode logits, called as ``fn(q, cache, weights, lengths, page_table, logits)``:

    - ``q`` : ``[R, Hi, D]`` ``q_dtype`` (float8_e4m3fn or bfloat16), contiguous; row r belongs to request
      ``b = r // (R / B)``
    - ``cache`` : ``[P, page * (D + 4)]`` uint8, 16-byte aligned
    - ``weights`` : ``[R, Hi]`` float32
    - ``lengths`` : ``[R]`` int32: row r sees positions ``0 <= p < lengths[r]`` (clamped into ``[0, W]``)
    - ``page_table`` : ``[B, max_pages]`` int32, contiguous; position p of request b is the slot
      ``page_table[b, p // page] * page + p % page``
    - ``logits`` : ``[R, W]`` float32 with ``W = max_pages * page``, written whole:
      ``k_scale(slot) * sum_h weights[r, h] * relu(q[r, h] . k(slot))``, -inf at positions at or past the row's
      length and where the page-table entry is outside ``[0, P)`` (those pages are not read)

    Grid: ``(R, ceil(max_pages / split_pages))``: a CTA takes ``split_pages`` pages of one row, as 64-row tiles
    (several pages a tile when ``page < 64``); tiles past the row's length are written -inf without a load.
    """
    if key.ws:
        assert paged_ws_supported(key.dim, key.heads, key.page, key.q_dtype), f"{key.name}: no warp-specialized kernel"
        return _build_paged_ws(key)
    return _build_paged_portable(key)


@T.macro
def _paged_row(r, r_count, b_count, lengths, w_len, by, split_tokens, row):
    """``row [4]`` of CTA ``(r, by)``: its request, the row's length clamped into ``[0, W]``, its first position,
    and its tiles that start before the length (the others are -inf only)."""
    n_per = T.max(r_count // T.max(b_count, 1), 1)  # rows per request
    row[0] = T.min(r // n_per, b_count - 1)
    row[1] = T.min(T.max(lengths[r], 0), w_len)
    row[2] = by * split_tokens
    row[3] = T.min(T.max(T.ceildiv(row[1] - row[2], BN), 0), split_tokens // BN)


def _build_paged_ws(key: PagedLogitsKey):
    """Warp-specialized decode (sm_90): warpgroup 0 consumes 64-row tiles from ``PAGED_STAGES`` shared stages (FP8
    wgmma, then relu, weights, the sum over heads and the stores), one producer warp loads each tile's pages and
    their scales by TMA (a page-table entry outside ``[0, P)`` or a page past the length loads nothing, and its
    rows are written -inf) and flags the pages it loaded. 160 threads and no register reallocation, so that
    several CTAs share an SM and keep more loads in flight."""
    dim, heads, page = key.dim, key.heads, key.page
    hp, _, ppt, row_bytes = _paged_geometry(key)
    stages = PAGED_STAGES
    split = key.pages_per_cta
    split_tokens = split * page
    r_count, b_count, p_count, max_pages = T.dynamic("r"), T.dynamic("b"), T.dynamic("p"), T.dynamic("max_pages")
    w_len = max_pages * page
    produce, consume = _paged_producer(key, p_count, max_pages), _paged_consumer(key, w_len)

    @T.prim_func
    def paged_index_logits(
        q: T.Tensor((r_count, heads, dim), T.float8_e4m3fn),
        cache: T.Tensor((p_count, row_bytes), T.uint8),
        weights: T.Tensor((r_count, heads), T.float32),
        lengths: T.Tensor((r_count,), T.int32),
        page_table: T.Tensor((b_count, max_pages), T.int32),
        logits: T.Tensor((r_count, w_len), T.float32),
    ):
        with T.Kernel(r_count, T.ceildiv(max_pages, key.pages_per_cta), threads=160) as (bx, by):
            # the FP8 values of each page as [page, D] rows, pages row_bytes apart (the scales lie between them)
            vals = T.StridedTensor((p_count, page, dim), (row_bytes, dim, 1), T.float8_e4m3fn, data=cache.data)
            scales = T.view(cache, (p_count, row_bytes // SCALE_BYTES), T.float32)
            q_s = T.alloc_shared((hp, dim), T.float8_e4m3fn)
            k_s = T.alloc_shared((stages, BN, dim), T.float8_e4m3fn)
            sc_s = T.alloc_shared((stages, BN), T.float32)
            ok_s = T.alloc_shared((stages, ppt), T.int32)  # which pages of a stage's tile were loaded
            ent_s = T.alloc_shared((split,), T.int32)  # the CTA's page-table entries
            full = T.alloc_barrier([32] * stages)
            empty = T.alloc_barrier([128] * stages)
            q_ready = T.alloc_barrier(128)
            acc = T.alloc_fragment((BN, hp), T.float32)
            lg = T.alloc_fragment((BN, 1), T.float32)
            w = T.alloc_fragment((1, hp), T.float32)
            sc = T.alloc_fragment((BN,), T.float32)
            row = T.alloc_local((4,), T.int32)
            ent = T.alloc_local((1,), T.int32)
            _paged_row(bx, r_count, b_count, lengths, w_len, by, split_tokens, row)
            tx = T.get_thread_binding()
            # the buffers both kinds of warp read (as attributes, which keep their names in the generated source)
            sh = SimpleNamespace(
                q_s=q_s, k_s=k_s, sc_s=sc_s, ok_s=ok_s, full=full, empty=empty, q_ready=q_ready, row=row, logits=logits
            )
            if tx >= 128:
                produce(vals, scales, page_table, sh, ent_s, ent, by)
            else:
                consume(q, weights, sh, acc, lg, w, sc, bx)

    return paged_index_logits


def _paged_producer(key: PagedLogitsKey, p_count, max_pages):
    """The producer warp of :func:`_build_paged_ws` over a cache of ``p_count`` pages and page tables of ``max_pages``
    entries."""
    dim, page = key.dim, key.page
    _, _, ppt, row_bytes = _paged_geometry(key)
    stages, split = PAGED_STAGES, key.pages_per_cta
    sub_rows = min(page, BN)  # rows of one TMA copy: a page, or a 64-row part of one
    scale_word = page * dim // SCALE_BYTES

    @T.macro
    def produce(vals, scales, page_table, sh, ent_s, ent, by):
        """The producer warp (threads 128-159): the CTA's page-table entries, then each tile's pages and scales."""
        tx = T.get_thread_binding()
        # the CTA's page-table entries first, all at once (-1 past max_pages): read one by one inside the loop, each
        # load's latency would stall the next TMA issue
        for c in T.serial(T.ceildiv(split, 32)):
            if c * 32 + tx - 128 < split:
                pg = by * split + c * 32 + tx - 128
                ent_s[c * 32 + tx - 128] = T.if_then_else(
                    pg < max_pages, page_table[sh.row[0], T.min(pg, max_pages - 1)], -1
                )
        for ti in T.serial(sh.row[3]):
            s = ti % stages
            T.barrier_wait(sh.empty[s], ((ti // stages) & 1) ^ 1)
            for k in T.unroll(ppt):
                pos = sh.row[2] + ti * BN + k * sub_rows  # first position of this copy
                ent[0] = ent_s[pos // page - by * split]
                ok = (pos < sh.row[1]) & (ent[0] >= 0) & (ent[0] < p_count)
                if ok:
                    off = pos % page
                    T.tma_copy(
                        vals[ent[0], off : off + sub_rows, :],
                        sh.k_s[s, k * sub_rows : (k + 1) * sub_rows, :],
                        barrier=sh.full[s],
                    )
                    T.tma_copy(
                        scales[ent[0], scale_word + off : scale_word + off + sub_rows],
                        sh.sc_s[s, k * sub_rows : (k + 1) * sub_rows],
                        barrier=sh.full[s],
                    )
                if tx == 128:
                    sh.ok_s[s, k] = T.if_then_else(ok, 1, 0)
            T.barrier_arrive(sh.full[s])

    return produce


def _paged_consumer(key: PagedLogitsKey, w_len):
    """The consumer warpgroup of :func:`_build_paged_ws`, writing rows of ``w_len`` logits."""
    dim, heads = key.dim, key.heads
    hp, tiles, _, _ = _paged_geometry(key)
    stages = PAGED_STAGES
    sub_rows = min(key.page, BN)
    q_chunks = hp * dim // 16

    @T.macro
    def consume(q, weights, sh, acc, lg, w, sc, bx):
        """The consumer warpgroup (threads 0-127): the query row and weights, then each tile's GEMM and epilogue."""
        tx = T.get_thread_binding()
        for c in T.serial(q_chunks // 128 if q_chunks >= 128 else 1):
            i = c * 128 + tx
            if i < q_chunks:
                h = i // (dim // 16)
                col = i % (dim // 16) * 16
                for v in T.vectorized(16):
                    sh.q_s[h, col + v] = T.if_then_else(
                        h < heads, q[bx, T.min(h, heads - 1), col + v], T.cast(0, T.float8_e4m3fn)
                    )
        for i, h in T.Parallel(1, hp):
            w[i, h] = T.if_then_else(h < heads, weights[bx, T.min(h, heads - 1)], 0.0)
        T.fence_proxy_async()  # generic stores, read by wgmma through the async proxy
        T.barrier_arrive(sh.q_ready)
        T.barrier_wait(sh.q_ready, 0)
        for ti in T.serial(tiles):
            pos0 = sh.row[2] + ti * BN
            if ti < sh.row[3]:
                s = ti % stages
                T.barrier_wait(sh.full[s], (ti // stages) & 1)
                T.wgmma_gemm(sh.k_s[s, :, :], sh.q_s, acc, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                for j in T.Parallel(BN):
                    sc[j] = T.if_then_else(
                        (sh.ok_s[s, j // sub_rows] != 0) & (pos0 + j < sh.row[1]), sh.sc_s[s, j], -T.infinity(T.float32)
                    )
                T.barrier_arrive(sh.empty[s])
                _relu_weigh_reduce(acc, w, lg, 1, hp)
                for j, i in T.Parallel(BN, 1):
                    if pos0 + j < w_len:
                        sh.logits[bx, pos0 + j] = T.if_then_else(
                            sc[j] == -T.infinity(T.float32), sc[j], lg[j, i] * sc[j]
                        )
            else:
                for j in T.Parallel(BN):
                    if pos0 + j < w_len:
                        sh.logits[bx, pos0 + j] = -T.infinity(T.float32)

    return consume


def _build_paged_portable(key: PagedLogitsKey):
    """Portable decode (HIP, bf16 queries, pages the TMA path does not take): the tiling of the warp-specialized
    kernel, each tile's rows gathered into shared memory by all threads (zeros for positions that are not read),
    ``T.gemm``, the same epilogue."""
    dim, heads, page = key.dim, key.heads, key.page
    hp, tiles, _, row_bytes = _paged_geometry(key)
    dtype = T.float8_e4m3fn if key.q_dtype == "float8_e4m3fn" else T.bfloat16
    scale_word = page * dim // SCALE_BYTES
    split_tokens = key.pages_per_cta * page
    threads = 128
    r_count, b_count, p_count, max_pages = T.dynamic("r"), T.dynamic("b"), T.dynamic("p"), T.dynamic("max_pages")
    w_len = max_pages * page

    @T.prim_func
    def paged_index_logits(
        q: T.Tensor((r_count, heads, dim), dtype),
        cache: T.Tensor((p_count, row_bytes), T.uint8),
        weights: T.Tensor((r_count, heads), T.float32),
        lengths: T.Tensor((r_count,), T.int32),
        page_table: T.Tensor((b_count, max_pages), T.int32),
        logits: T.Tensor((r_count, w_len), T.float32),
    ):
        with T.Kernel(r_count, T.ceildiv(max_pages, key.pages_per_cta), threads=threads) as (bx, by):
            vals = T.view(cache, (p_count, row_bytes), T.float8_e4m3fn)
            scales = T.view(cache, (p_count, row_bytes // SCALE_BYTES), T.float32)
            q_s = T.alloc_shared((hp, dim), dtype)
            k_s = T.alloc_shared((BN, dim), dtype)
            slot_s = T.alloc_shared((BN,), T.int64)  # a tile row's cache byte offset / D, or -1 where not read
            acc = T.alloc_fragment((BN, hp), T.float32)
            lg = T.alloc_fragment((BN, 1), T.float32)
            w = T.alloc_fragment((1, hp), T.float32)
            sc = T.alloc_fragment((BN,), T.float32)
            row = T.alloc_local((4,), T.int32)
            ent = T.alloc_local((1,), T.int32)
            _paged_row(bx, r_count, b_count, lengths, w_len, by, split_tokens, row)
            tx = T.get_thread_binding()
            for h, d in T.Parallel(hp, dim):
                q_s[h, d] = T.if_then_else(h < heads, q[bx, T.min(h, heads - 1), d], T.cast(0, dtype))
            for i, h in T.Parallel(1, hp):
                w[i, h] = T.if_then_else(h < heads, weights[bx, T.min(h, heads - 1)], 0.0)
            for ti in T.serial(tiles):
                pos0 = row[2] + ti * BN
                if ti < row[3]:
                    if tx < BN:
                        pg = (pos0 + tx) // page
                        ent[0] = page_table[row[0], T.min(pg, max_pages - 1)]
                        ok = (pos0 + tx < row[1]) & (pg < max_pages) & (ent[0] >= 0) & (ent[0] < p_count)
                        slot_s[tx] = T.if_then_else(
                            ok, T.cast(ent[0], T.int64) * page + (pos0 + tx) % page, T.int64(-1)
                        )
                    for j, d in T.Parallel(BN, dim):
                        if slot_s[j] >= 0:
                            k_s[j, d] = T.cast(vals[slot_s[j] // page, slot_s[j] % page * dim + d], dtype)
                        else:
                            k_s[j, d] = T.cast(0, dtype)
                    for j in T.Parallel(BN):
                        if slot_s[j] >= 0:
                            sc[j] = scales[slot_s[j] // page, scale_word + slot_s[j] % page]
                        else:
                            sc[j] = -T.infinity(T.float32)
                    T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    _relu_weigh_reduce(acc, w, lg, 1, hp)
                    for j, i in T.Parallel(BN, 1):
                        if pos0 + j < w_len:
                            logits[bx, pos0 + j] = T.if_then_else(
                                sc[j] == -T.infinity(T.float32), sc[j], lg[j, i] * sc[j]
                            )
                else:
                    for j in T.Parallel(BN):
                        if pos0 + j < w_len:
                            logits[bx, pos0 + j] = -T.infinity(T.float32)

    return paged_index_logits
