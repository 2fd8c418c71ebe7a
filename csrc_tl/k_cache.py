"""TileLang kernels of the packed FP8 K cache: quantize (+ scatter into the pool), dequantize
(+ gather from the pool) and the byte gather of packed rows.

A pool is addressed as ``[S, B]`` uint8 rows (``KCacheLayout.row_bytes`` = B). Inside a kernel the
same bytes are read through typed views: float8_e4m3fn ``[S, B]`` for the values, float32
``[S, B / 4]`` for the scales and bfloat16 ``[S, B / 2]`` for the RoPE tail. Row counts (N, M, S)
are dynamic: one compiled kernel serves every batch. Slot ids outside ``[0, S)`` are never
dereferenced: stores skip them, gathers return zero rows.

Work split: a *group* of 32 threads handles whole rows, ROWS_PER_GROUP at a time, and loads all of them before
it computes on any. Quantizing and dequantizing, a lane takes 8 values of a row at once where rows stay 8-byte
aligned (else 4), so 16 (or 32) lanes share a 128-wide tile; quantizing, they reduce the tile's amax with a
butterfly among themselves. Shuffles stay within 32 lanes (portable to 64-wide AMD wavefronts). Each builder
is a pure function of the layout (a frozen ``KCacheLayout``) and a few flags; :class:`CacheKey` names one kernel
and :func:`build` makes it.
"""

from dataclasses import dataclass

import tilelang.language as T

from .layout import FP8_MAX, QUANT_TILE, KCacheLayout

__all__ = [
    "CacheKey",
    "build",
    "pass_configs",
    "KINDS",
    "QUANT_KERNELS",
    "SLOT_KERNELS",
    "build_quant",
    "build_dequant",
    "build_gather_bytes",
    "quant_vector",
    "THREADS",
    "ROWS_PER_BLOCK",
    "ROWS_PER_GROUP",
]

KINDS = ("quant", "store", "dequant", "gather", "gather_dequant")
QUANT_KERNELS = ("quant", "store")  # the kernels that take round_scale
SLOT_KERNELS = ("store", "gather", "gather_dequant")  # the kernels that take slot ids
SLOT_DTYPES = ("int32", "int64")


@dataclass(frozen=True)
class CacheKey:
    """A K-cache kernel: ``kind`` (one of :data:`KINDS`: quantize, quantize and store at slots, dequantize, gather
    packed rows, gather and dequantize) over rows of ``layout``; ``round_scale`` (power-of-two scales) for the
    quantizing kernels, ``slot_dtype`` the dtype of the slot ids of the kernels that take them ("" for the others).
    """

    kind: str
    layout: KCacheLayout
    round_scale: bool = False
    slot_dtype: str = ""

    def __post_init__(self):
        assert self.kind in KINDS, f"kind is one of {KINDS}, got {self.kind!r}"
        assert not self.round_scale or self.kind in QUANT_KERNELS, f"{self.kind}: round_scale is the quantizers'"
        if self.kind in SLOT_KERNELS:
            assert self.slot_dtype in SLOT_DTYPES, f"{self.kind}: slot_dtype is one of {SLOT_DTYPES}"
        else:
            assert not self.slot_dtype, f"{self.kind} takes no slot ids"

    @property
    def family(self) -> str:
        return self.kind

    @property
    def name(self) -> str:
        lay = self.layout
        pow2 = "_pow2" if self.round_scale else ""
        slots = f"_{self.slot_dtype}" if self.slot_dtype else ""
        return f"{self.kind}_k_cache_{lay.d_nope}p{lay.d_rope}{pow2}{slots}"

    def __str__(self) -> str:
        return self.name


def build(key: CacheKey):
    """The TileLang program of ``key``."""
    slots = {"slot_dtype": key.slot_dtype} if key.slot_dtype else {}
    if key.kind in QUANT_KERNELS:
        return build_quant(key.layout, round_scale=key.round_scale, scatter=key.kind == "store", **slots)
    if key.kind == "gather":
        return build_gather_bytes(key.layout, **slots)
    return build_dequant(key.layout, gather=key.kind == "gather_dequant", **slots)


def pass_configs(key: CacheKey) -> dict:
    """TileLang pass configs of ``key``'s kernel (none but the defaults)."""
    return {}


THREADS = 128
GROUP = 32  # threads of a group
GROUPS = THREADS // GROUP
STEPS = 4  # rows each group of the byte gather copies in turn
ROWS_PER_GROUP = 2  # rows a group (de)quantizes at once, their loads in flight together (stores: 2 and 4 measured
# alike at GLM rows, 4 slower at DeepSeek rows on an H200)
ROWS_PER_BLOCK = GROUPS * STEPS  # rows per block (byte gather)
POW2_ROUND_UP = 0x7FFFFF  # added to a positive float32's bits, then masked: round up to 2^k
EXPONENT_MASK = -0x800000  # 0xFF800000 as int32: sign and exponent bits


@T.macro
def _group_max(acc, lanes: int = GROUP):
    """``acc[0] = max over the `lanes` threads of a tile`` (a butterfly within aligned runs of ``lanes`` threads,
    ``lanes`` a power of two up to 32) for a local ``[1]`` buffer."""
    for delta in _halvings(lanes):
        acc[0] = T.max(acc[0], T.shfl_xor(acc[0], delta, GROUP))


def _amax(x, start: int, count: int):
    """``max |x[start + i]|`` over ``i < count`` (a power of two) as a tree of pairwise maxima."""
    if count == 1:
        return T.abs(x[start])
    return T.max(_amax(x, start, count // 2), _amax(x, start + count // 2, count // 2))


def _halvings(lanes: int) -> tuple[int, ...]:
    """``lanes / 2, lanes / 4, ..., 1``: the shuffle distances of a butterfly over ``lanes`` threads."""
    return tuple(lanes >> k for k in range(1, lanes.bit_length()))


def quant_vector(layout: KCacheLayout) -> int:
    """Values of a row that one lane of :func:`build_quant` quantizes at once: 8 (an 8-byte store) where rows keep
    8-byte alignment, else 4."""
    return 8 if layout.row_bytes % 8 == 0 else 4


def _row_split(layout: KCacheLayout) -> tuple[int, int, int, int, bool, int]:
    """How a group of :func:`build_quant` and :func:`build_dequant` covers a row: ``(vec, lanes, per_pass, passes,
    whole, rope_steps)``, the values a lane takes at once, the lanes of a tile, the tiles of a pass, the passes,
    whether every pass has a tile for every lane, and the steps of 2 tail values (4 bytes) a lane."""
    assert layout.row_bytes % 4 == 0, "scales and tails move in 4-byte words: d_rope must be even"
    vec = quant_vector(layout)
    lanes = QUANT_TILE // vec
    per_pass = GROUP // lanes
    return (
        vec,
        lanes,
        per_pass,
        -(-layout.num_scales // per_pass),
        layout.num_scales % per_pass == 0,
        -(-layout.d_rope // (2 * GROUP)),
    )


def _group_row(bx, tx, r):
    """Row ``r`` of the group of thread ``tx`` in block ``bx`` (:data:`ROWS_PER_GROUP` rows a group)."""
    return (bx * GROUPS + tx // GROUP) * ROWS_PER_GROUP + r


def build_quant(layout: KCacheLayout, *, round_scale: bool, scatter: bool, slot_dtype: str = "int32"):  # noqa: C901 (one body, layout cases)
    """Quantize K rows into packed rows.

    scatter=False (``quant_k_cache``): ``(k_nope [N, d_nope] bf16, [k_rope [N, d_rope] bf16,]
    out [N, B] uint8)``, row i into out row i.
    scatter=True (``store_k_cache``): ``(k_nope, [k_rope,] loc [N] slot_dtype, pool [S, B] uint8)``,
    row i into pool row ``loc[i]``; ids outside ``[0, S)`` are skipped.
    The k_rope argument exists only when d_rope > 0; B must be a multiple of 4 (d_rope even).

    A group of 32 lanes writes whole rows, :data:`ROWS_PER_GROUP` of them, whose k rows (and slot ids) it loads
    before it quantizes any: :func:`quant_vector` values a lane (so 16 or 32 lanes a tile), one tile's amax by a
    butterfly among its lanes: whole rows a group keep its stores contiguous and the loads of several rows in
    flight (a group per tile was slower: BENCHMARKS.md, design decisions). Grid: ``ceil(N / (4 *
    ROWS_PER_GROUP))``.
    """
    d_nope, d_rope, row_bytes = layout.d_nope, layout.d_rope, layout.row_bytes
    n_tiles = layout.num_scales
    vec, lanes, per_pass, passes, whole, rope_steps = _row_split(layout)
    scale_word = layout.scale_offset // 4  # float32 index of the first scale in a row
    rope_half = layout.rope_offset // 2  # bfloat16 index of the first tail element in a row
    rpg = ROWS_PER_GROUP
    n = T.dynamic("n")
    s = T.dynamic("s") if scatter else n

    @T.macro
    def quantize(k_nope, k_rope, loc, pool):
        with T.Kernel(T.ceildiv(n, GROUPS * rpg), threads=THREADS) as bx:
            values = T.view(pool, (s, row_bytes), T.float8_e4m3fn)
            scales = T.view(pool, (s, row_bytes // 4), T.float32)
            tx = T.get_thread_binding()
            lane = tx % GROUP
            sub = lane % lanes  # this lane's place in its tile
            x = T.alloc_local((rpg * passes * vec,), T.float32)
            slots = T.alloc_local((rpg,), T.int64)
            q = T.alloc_local((vec,), T.float8_e4m3fn)
            scale = T.alloc_local((1,), T.float32)
            if d_rope:
                tails = T.view(pool, (s, row_bytes // 2), T.bfloat16)
                rope = T.alloc_local((rpg * rope_steps * 2,), T.bfloat16)
            # every load of the group's rows first, so that they are in flight together
            for r in T.unroll(rpg):
                row = _group_row(bx, tx, r)
                src = T.min(row, n - 1)  # (rows past n load row n - 1 and store nothing)
                if scatter:
                    slots[r] = T.if_then_else(row < n, T.cast(loc[src], T.int64), T.int64(-1))
                else:
                    slots[r] = T.if_then_else(row < n, T.cast(row, T.int64), T.int64(-1))
                for p in T.unroll(passes):
                    tile = p * per_pass + lane // lanes
                    if whole or tile < n_tiles:
                        for v in T.vectorized(vec):
                            x[(r * passes + p) * vec + v] = T.cast(
                                k_nope[src, tile * QUANT_TILE + sub * vec + v], T.float32
                            )
                if d_rope:
                    for c in T.unroll(rope_steps):
                        col = (c * GROUP + lane) * 2
                        if col < d_rope:
                            for v in T.vectorized(2):
                                rope[(r * rope_steps + c) * 2 + v] = k_rope[src, col + v]
            for r in T.unroll(rpg):
                slot = slots[r]
                for p in T.unroll(passes):
                    tile = p * per_pass + lane // lanes
                    b = (r * passes + p) * vec
                    scale[0] = _amax(x, b, vec)
                    _group_max(scale, lanes)
                    scale[0] = scale[0] / FP8_MAX
                    if scale[0] == 0.0:  # an all-zero (or underflowing) tile
                        scale[0] = 1.0
                    if round_scale:
                        scale[0] = T.reinterpret(
                            (T.reinterpret(scale[0], T.int32) + POW2_ROUND_UP) & EXPONENT_MASK, T.float32
                        )
                    if slot >= 0 and slot < s and (whole or tile < n_tiles):
                        for v in T.vectorized(vec):
                            q[v] = T.cast(T.clamp(x[b + v] / scale[0], -FP8_MAX, FP8_MAX), T.float8_e4m3fn)
                        for v in T.vectorized(vec):
                            values[slot, tile * QUANT_TILE + sub * vec + v] = q[v]
                        if sub == 0:
                            scales[slot, scale_word + tile] = scale[0]
                if d_rope:
                    for c in T.unroll(rope_steps):
                        col = (c * GROUP + lane) * 2
                        if slot >= 0 and slot < s and col < d_rope:
                            for v in T.vectorized(2):
                                tails[slot, rope_half + col + v] = rope[(r * rope_steps + c) * 2 + v]

    k_nope_t = T.Tensor((n, d_nope), T.bfloat16)
    pool_t = T.Tensor((s, row_bytes), T.uint8)
    loc_t = T.Tensor((n,), slot_dtype)
    rope_t = T.Tensor((n, max(d_rope, 1)), T.bfloat16)
    if d_rope and scatter:

        @T.prim_func
        def store_k_cache(k_nope: k_nope_t, k_rope: rope_t, loc: loc_t, pool: pool_t):
            quantize(k_nope, k_rope, loc, pool)

        return store_k_cache
    if scatter:

        @T.prim_func
        def store_k_cache(k_nope: k_nope_t, loc: loc_t, pool: pool_t):
            quantize(k_nope, None, loc, pool)

        return store_k_cache
    if d_rope:

        @T.prim_func
        def quant_k_cache(k_nope: k_nope_t, k_rope: rope_t, out: pool_t):
            quantize(k_nope, k_rope, None, out)

        return quant_k_cache

    @T.prim_func
    def quant_k_cache(k_nope: k_nope_t, out: pool_t):
        quantize(k_nope, None, None, out)

    return quant_k_cache


def build_dequant(layout: KCacheLayout, *, gather: bool, slot_dtype: str = "int32"):
    """Dequantize packed rows into ``[M, d_nope + d_rope]`` bf16: ``bf16(float32(fp8) * scale)``.

    gather=False (``dequant_k_cache``): ``(packed [M, B] uint8, out [M, d_qk] bf16)``.
    gather=True (``gather_dequant_k_cache``): ``(pool [S, B] uint8, ids [M] slot_dtype, out)``;
    ids outside ``[0, S)`` give zero rows and are not dereferenced.

    As :func:`build_quant`: a group of 32 lanes reads whole rows, :func:`quant_vector` values a lane, and loads the
    values, scales and tails of :data:`ROWS_PER_GROUP` rows before it widens any; an invalid id loads nothing.
    Grid: ``ceil(M / (4 * ROWS_PER_GROUP))`` (a group per tile was slower: BENCHMARKS.md, design decisions).
    """
    d_nope, d_rope, d_qk, row_bytes = layout.d_nope, layout.d_rope, layout.d_qk, layout.row_bytes
    n_tiles = layout.num_scales
    vec, lanes, per_pass, passes, whole, rope_steps = _row_split(layout)
    scale_word = layout.scale_offset // 4
    rope_half = layout.rope_offset // 2
    rpg = ROWS_PER_GROUP
    m = T.dynamic("m")
    s = T.dynamic("s") if gather else m

    @T.macro
    def dequantize(pool, ids, out):
        with T.Kernel(T.ceildiv(m, GROUPS * rpg), threads=THREADS) as bx:
            values = T.view(pool, (s, row_bytes), T.float8_e4m3fn)
            scales = T.view(pool, (s, row_bytes // 4), T.float32)
            tx = T.get_thread_binding()
            lane = tx % GROUP
            sub = lane % lanes
            q = T.alloc_local((rpg * passes * vec,), T.float8_e4m3fn)
            sc = T.alloc_local((rpg * passes,), T.float32)
            ok = T.alloc_local((rpg,), T.int32)
            y = T.alloc_local((vec,), T.bfloat16)
            if d_rope:
                tails = T.view(pool, (s, row_bytes // 2), T.bfloat16)
                rope = T.alloc_local((rpg * rope_steps * 2,), T.bfloat16)
            # every load of the group's rows first, so that they are in flight together
            for r in T.unroll(rpg):
                row = _group_row(bx, tx, r)
                slot = T.cast(ids[T.min(row, m - 1)], T.int64) if gather else T.cast(row, T.int64)
                ok[r] = T.if_then_else((row < m) & (slot >= 0) & (slot < s), 1, 0)
                if ok[r] == 1:  # (the same for the whole group: no divergence)
                    for p in T.unroll(passes):
                        tile = p * per_pass + lane // lanes
                        if whole or tile < n_tiles:
                            for v in T.vectorized(vec):
                                q[(r * passes + p) * vec + v] = values[slot, tile * QUANT_TILE + sub * vec + v]
                            sc[r * passes + p] = scales[slot, scale_word + tile]
                    if d_rope:
                        for c in T.unroll(rope_steps):
                            col = (c * GROUP + lane) * 2
                            if col < d_rope:
                                for v in T.vectorized(2):
                                    rope[(r * rope_steps + c) * 2 + v] = tails[slot, rope_half + col + v]
            for r in T.unroll(rpg):
                row = _group_row(bx, tx, r)
                if row < m:
                    for p in T.unroll(passes):
                        tile = p * per_pass + lane // lanes
                        if whole or tile < n_tiles:
                            b = (r * passes + p) * vec
                            for v in T.vectorized(vec):
                                y[v] = T.if_then_else(
                                    ok[r] == 1,
                                    T.cast(T.cast(q[b + v], T.float32) * sc[r * passes + p], T.bfloat16),
                                    T.cast(0.0, T.bfloat16),
                                )
                            for v in T.vectorized(vec):
                                out[row, tile * QUANT_TILE + sub * vec + v] = y[v]
                    if d_rope:
                        for c in T.unroll(rope_steps):
                            col = (c * GROUP + lane) * 2
                            if col < d_rope:
                                for v in T.vectorized(2):
                                    out[row, d_nope + col + v] = T.if_then_else(
                                        ok[r] == 1, rope[(r * rope_steps + c) * 2 + v], T.cast(0.0, T.bfloat16)
                                    )

    pool_t = T.Tensor((s, row_bytes), T.uint8)
    out_t = T.Tensor((m, d_qk), T.bfloat16)
    if gather:

        @T.prim_func
        def gather_dequant_k_cache(pool: pool_t, ids: T.Tensor((m,), slot_dtype), out: out_t):
            dequantize(pool, ids, out)

        return gather_dequant_k_cache

    @T.prim_func
    def dequant_k_cache(packed: pool_t, out: out_t):
        dequantize(packed, None, out)

    return dequant_k_cache


def build_gather_bytes(layout: KCacheLayout, *, slot_dtype: str = "int32"):
    """Copy packed rows: ``(pool [S, B] uint8, ids [M] slot_dtype, out [M, B] uint8)``.

    Rows move as 4-byte words (B is a multiple of 4); ids outside ``[0, S)`` give zero rows.
    """
    words = layout.row_bytes // 4
    steps = T.ceildiv(words, GROUP)
    m, s = T.dynamic("m"), T.dynamic("s")

    @T.prim_func
    def gather_k_cache(
        pool: T.Tensor((s, layout.row_bytes), T.uint8),
        ids: T.Tensor((m,), slot_dtype),
        out: T.Tensor((m, layout.row_bytes), T.uint8),
    ):
        with T.Kernel(T.ceildiv(m, ROWS_PER_BLOCK), threads=THREADS) as bx:
            src = T.view(pool, (s, words), T.int32)
            dst = T.view(out, (m, words), T.int32)
            tx = T.get_thread_binding()
            lane = tx % GROUP
            slot_var = T.alloc_local((1,), T.int64)
            for step in T.serial(STEPS):
                row = bx * ROWS_PER_BLOCK + step * GROUPS + tx // GROUP
                if row < m:
                    slot_var[0] = T.cast(ids[row], T.int64)
                    slot = slot_var[0]
                    for c in T.serial(steps):
                        col = c * GROUP + lane
                        if col < words:
                            if slot >= 0 and slot < s:
                                dst[row, col] = src[slot, col]
                            else:
                                dst[row, col] = 0

    return gather_k_cache
