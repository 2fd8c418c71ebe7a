"""TileLang kernels of the k-pool indexer (GLM-5.3-Flash): ``kpool_store_index_k`` compresses each complete pool of
``kpool`` tokens into one index key and stores it into the paged index-K cache, in one launch; ``kpool_expand`` turns
the pools ``kpool_topk`` selected into the row's tokens (or their slots), in one launch after the selection.

Letters: Np pools, ``kpool`` tokens a pool, D the head dim (a multiple of 64), P pages of ``page`` slots. Np and P
are dynamic symbols: one compiled kernel serves every batch and cache.

Per pool and channel d, the model's roundings (``reference.kpool_compress`` is the exact definition): the logits
``l_i = gate[i, d] + ape[i, d]`` in float32; ``e_i = exp(l_i - max_i l_i)`` (``expf``, the accurate exponential)
and their sum ``s`` from token 0 up; the weight ``bf16(e_i / s)`` (the quotient rounded as the IEEE division
rounds it); the product ``bf16(w_i * k[i, d])``; the products summed from token 0 up in float32 and rounded to
bfloat16 once. The pooled row is then quantized with the indexer's own helpers (``csrc_tl.indexer``: amax,
``max(amax, 1e-4) / 448``, optionally rounded up to a power of two, the saturating round-to-nearest-even FP8 cast),
so its bytes are those ``store_index_k`` writes for the same row, into the same layout: page p holds ``page * D``
FP8 values token-major (slot ``p * page + o`` at byte ``o * D``), then ``page`` float32 scales (offset o's at byte
``page * D + 4 * o``).

The work is bound by memory bandwidth (a pool of 16 x 128 reads 8 KB of k and gate and writes 132 bytes) only as long
as the arithmetic keeps up: kpool * D exponentials, quotients and bfloat16 products a pool, about 1,800 instructions
a warp for GLM-5.3-Flash's pools, against some 2,900 cycles of an H100 scheduler's share of the bandwidth. So each
pool is read once, every load of a lane is issued before any arithmetic, the pool stays in registers with 12 warps
an SM (168 registers a thread; ptxas keeps 20 bytes in local memory at that budget), the quotients are products by
``1 / s`` corrected by one fused multiply-add rather than divisions, and the products are bfloat16 multiplies.

The expansion (``reference.kpool_expand`` is the exact definition) reads the selection's ``pools [R, k]`` int32
(ascending pool positions, then -1) and writes ``out [R, W']`` int32 whole: with n the row's selected pools, column e
holds token ``pools[r, e // kpool] * kpool + e % kpool`` below ``n * kpool``; with the tail, the ``L % kpool`` tokens
``L - L % kpool ..`` of the row's incomplete pool follow (L = max(lengths[r], 0)); then -1. With a page table each
token p of request b (``row_request[r]``, or ``r // (R / B)``) becomes the slot ``page_table[b, p // page_size] *
page_size + p % page_size``, computed in int64 and stored as int32; -1 where b lies outside ``[0, B)``, the page
index at or past ``max_pages``, or the entry is negative. R, k, W', B and max_pages are dynamic symbols. It moves a
few KB a row: what it costs is its launch and its chain of dependent loads (the pools, then a pool a column, then a
page-table entry), so a CTA takes a slice of a row's columns (rows of GLM-5.3-Flash's 2112 entries are spread over 5
CTAs) and finds n in one step, each thread testing its pools for the row's last valid one, instead of scanning.
"""

from dataclasses import dataclass

import tilelang.language as T

from .indexer import DIM_MULTIPLE, GROUP, SCALE_BYTES, SLOT_DTYPES, butterfly_max, fp8_value, row_amax, row_scale

__all__ = [
    "KpoolStoreKey",
    "KpoolExpandKey",
    "LanePlan",
    "GATE_DTYPES",
    "lane_plan",
    "build_kpool_store_index_k",
    "build_kpool_expand",
    "pass_configs",
]

GATE_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}  # the dtypes of gate and ape, and their short names
THREADS = 128
CH = 4  # channels a lane takes at once: one 8-byte bf16 load of k per token, 4 FP8 bytes stored
# A lane's pool values (tokens x channels): up to FEW_VALUES (GLM-5.3-Flash's 16 x 4) the kernel asks for MIN_BLOCKS
# blocks an SM (168 registers a thread); up to MAX_UNROLLED the token loops are unrolled (registers, the block count
# left to ptxas); past that they loop through local memory (correct, for pools the model does not have; HIP's
# compile step counts that scratch as a failure, so the lowering sweep keeps to unrolled keys).
FEW_VALUES = 64
MIN_BLOCKS = 3
MAX_UNROLLED = 128
FLT_MIN = 2.0**-126  # the smallest normal float32
# The expansion: a CTA of EXPAND_THREADS takes EXPAND_COLUMNS of a row, EXPAND_PER_THREAD columns a thread, each
# step's columns consecutive across the threads (every store coalesced, for any W': no vector stores that W' would
# have to keep aligned).
EXPAND_THREADS = 128
EXPAND_PER_THREAD = 4
EXPAND_COLUMNS = EXPAND_THREADS * EXPAND_PER_THREAD


@dataclass(frozen=True)
class KpoolStoreKey:
    """The k-pool store: pools of ``kpool`` tokens of ``dim``-value keys, into a cache of ``page`` slots a page;
    gate and ape of ``gate_dtype`` and ``ape_dtype`` ("bfloat16" or "float32", each read as it is: a cast on the
    host would be a launch of its own); ``round_scale`` rounds each scale up to a power of two; slot ids of
    ``slot_dtype``."""

    kpool: int
    dim: int
    page: int
    gate_dtype: str = "bfloat16"
    ape_dtype: str = "bfloat16"
    round_scale: bool = False
    slot_dtype: str = "int32"

    @property
    def name(self) -> str:
        gate = GATE_DTYPES.get(self.gate_dtype, self.gate_dtype)
        ape = GATE_DTYPES.get(self.ape_dtype, self.ape_dtype)
        pow2 = "_pow2" if self.round_scale else ""
        slot = {"int32": "i32", "int64": "i64"}.get(self.slot_dtype, self.slot_dtype)
        return f"kpool_store_index_k_pool{self.kpool}_d{self.dim}_p{self.page}_g{gate}_a{ape}{pow2}_{slot}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class KpoolExpandKey:
    """The k-pool expansion: pools of ``kpool`` tokens; ``tail`` appends the row's incomplete pool (nothing to append
    where kpool is 1); ``page_size`` the tokens a page of the page table that maps tokens to slots, 0 for positions
    out; ``has_row_request`` a ``row_request`` argument (needs a page table)."""

    kpool: int
    tail: bool = True
    page_size: int = 0
    has_row_request: bool = False

    @property
    def name(self) -> str:
        tail = "_tail" if self.tail else ""
        paged = f"_page{self.page_size}" if self.page_size else "_positions"
        request = "_rowreq" if self.has_row_request else ""
        return f"kpool_expand_pool{self.kpool}{tail}{paged}{request}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class LanePlan:
    """How the store's threads share the pools: ``lanes`` lanes of a warp take one pool, each ``per_lane`` channels
    (``passes`` of CH), so a warp takes ``pools_per_warp`` pools and a block ``pools_per_block``."""

    kpool: int
    lanes: int
    passes: int

    @property
    def per_lane(self) -> int:
        return self.passes * CH

    @property
    def values(self) -> int:
        """A lane's token x channel values (its keys, and its logits)."""
        return self.kpool * self.per_lane

    @property
    def pools_per_warp(self) -> int:
        return GROUP // self.lanes

    @property
    def pools_per_block(self) -> int:
        return THREADS // GROUP * self.pools_per_warp

    @property
    def unrolled(self) -> bool:
        return self.values <= MAX_UNROLLED

    @property
    def min_blocks(self) -> int:
        return MIN_BLOCKS if self.values <= FEW_VALUES else 1

    def tokens(self, count: int):
        """A loop over ``count`` tokens: unrolled while the pool fits in registers."""
        return T.unroll(count) if self.unrolled else T.serial(count)

    def col(self, p, sub):
        """The first channel of pass ``p`` of the lane at ``sub`` among its pool's."""
        return (p * self.lanes + sub) * CH


def lane_plan(kpool: int, dim: int) -> LanePlan:
    """The thread mapping of pools of ``kpool`` tokens of ``dim`` values: the most lanes (up to a warp, a power of
    two for the amax butterfly) that split D into CH-channel chunks evenly, 32 where D is a multiple of 128, else 16."""
    chunks = dim // CH
    lanes = min(GROUP, chunks & -chunks)
    return LanePlan(kpool, lanes, chunks // lanes)


def pass_configs(key) -> dict:
    """TileLang pass configs of the k-pool kernels: no fast math (the store's weights need the accurate ``expf`` and
    correctly rounded quotients to round as the model's softmax does); the expansion places its one barrier itself."""
    if isinstance(key, KpoolExpandKey):
        return {"tl.disable_thread_storage_sync": True}
    return {}


def _exp(x):
    """``expf(x)``, the accurate float32 exponential, on every target (TileLang lowers ``T.exp`` to the fast
    ``__expf`` for HIP)."""
    return T.call_extern(T.float32, "expf", x)


def _fma(a, b, c):
    """``a * b + c`` rounded once: the compiler builtin, which nvcc and clang both know (TileLang lowers ``T.fma``
    for CUDA only, and the compile-only HIP headers declare no ``fmaf``)."""
    return T.call_extern(T.float32, "__builtin_fmaf", a, b, c)


def _quotient(e, s, inv):
    """``e / s`` from ``inv = 1 / s`` (correctly rounded): ``q = e * inv``, then ``q + (e - q * s) * inv`` with the
    remainder exact in one fused multiply-add. By Markstein's theorem this is the correctly rounded quotient wherever
    the quotient is a normal float (three instructions where the IEEE division takes about ten)."""
    q = e * inv
    return _fma(_fma(-q, s, e), inv, q)


def _bf16(x):
    """``x`` rounded to the nearest even bfloat16, back in float32."""
    return T.cast(T.cast(x, T.bfloat16), T.float32)


def _product(weight, key):
    """``bf16(bf16(weight) * key)`` in float32, ``key`` a bfloat16: the product of two bfloat16 values is exact in
    float32, so the bfloat16 multiply (one instruction on sm_90, the float product rounded elsewhere) rounds it the
    same way."""
    return T.cast(T.cast(weight, T.bfloat16) * key, T.float32)


@T.macro
def _load_pool(plan: LanePlan, k, gate, ape, src, sub, keys, ex):
    """The lane's channels of every token of pool ``src``: ``keys`` as bf16, ``ex`` the float32 logits
    ``gate + ape``; every load issued before the first is used (k and gate stream from memory once; ape is the same
    for every pool, read from the caches)."""
    w = plan.per_lane
    for i in plan.tokens(plan.kpool):
        for p in T.unroll(plan.passes):
            for c in T.vectorized(CH):
                keys[i * w + p * CH + c] = k[src, i, plan.col(p, sub) + c]
    for i in plan.tokens(plan.kpool):
        for p in T.unroll(plan.passes):
            for c in T.vectorized(CH):
                ex[i * w + p * CH + c] = T.cast(gate[src, i, plan.col(p, sub) + c], T.float32) + T.cast(
                    ape[i, plan.col(p, sub) + c], T.float32
                )


@T.macro
def _exponentials(plan: LanePlan, ex, top, den):
    """Per channel j: ``top[j]`` the largest logit, ``ex`` the exponentials ``exp(l_i - top[j])`` in place, ``den[j]``
    their sum from token 0 up."""
    w = plan.per_lane
    for j in T.unroll(w):
        top[j] = ex[j]
        den[j] = T.float32(0)
    for i in plan.tokens(plan.kpool - 1):
        for j in T.unroll(w):
            top[j] = T.max(top[j], ex[(i + 1) * w + j])
    for i in plan.tokens(plan.kpool):
        for j in T.unroll(w):
            ex[i * w + j] = _exp(ex[i * w + j] - top[j])
            den[j] = den[j] + ex[i * w + j]


@T.macro
def _weighted_sum(plan: LanePlan, ex, den, keys, inv, tiny, pooled):
    """``pooled[j] = bf16(sum_i bf16(bf16(e_i / s) * k_i))``, the sum from token 0 up in float32. The quotients come
    from :func:`_quotient`; a lane with one below the normal range (an exponential that underflowed to 0 included),
    where the correction may miss by an ulp, sums again with divisions."""
    w = plan.per_lane
    for j in T.unroll(w):
        inv[j] = T.float32(1) / den[j]
        pooled[j] = T.float32(0)
    tiny[0] = T.float32(FLT_MIN)
    for i in plan.tokens(plan.kpool):
        for j in T.unroll(w):
            quotient = _quotient(ex[i * w + j], den[j], inv[j])
            tiny[0] = T.min(tiny[0], quotient)
            pooled[j] = pooled[j] + _product(quotient, keys[i * w + j])
    if tiny[0] < T.float32(FLT_MIN):
        for j in T.unroll(w):
            pooled[j] = T.float32(0)
        for i in plan.tokens(plan.kpool):
            for j in T.unroll(w):
                pooled[j] = pooled[j] + _product(ex[i * w + j] / den[j], keys[i * w + j])
    for j in T.unroll(w):
        pooled[j] = _bf16(pooled[j])


def build_kpool_store_index_k(key: KpoolStoreKey):
    """Compress pools and store their keys, called as ``fn(k, gate, ape, loc, cache)``:

    - ``k`` : ``[Np, kpool, D]`` bfloat16, contiguous
    - ``gate`` : ``[Np, kpool, D]`` ``gate_dtype``, contiguous
    - ``ape`` : ``[kpool, D]`` ``ape_dtype``, contiguous
    - ``loc`` : ``[Np]`` ``slot_dtype``, slot ids; ids outside ``[0, P * page)`` are skipped
    - ``cache`` : ``[P, page * (D + 4)]`` uint8, 4-byte aligned; pool i's FP8 values and scale go to slot
      ``loc[i]``, and no other byte changes

    Threads (:func:`lane_plan`): a pool takes ``lanes`` lanes of a warp (32 for D = 128: a warp a pool), each lane CH
    = 4 channels a pass: lane j owns channels ``(p * lanes + j) * CH + c``, so each pass of a pool's lanes reads
    whole spans of each token row. A lane loads its channels of every token of k, gate and ape, then runs the
    softmax and the weighted sum over the tokens alone; only the row's amax is shared, by a butterfly among the
    pool's lanes. Grid: ``ceil(Np / pools_per_block)`` blocks of 4 warps.
    """
    kpool, dim, page = key.kpool, key.dim, key.page
    assert isinstance(kpool, int) and kpool >= 1, f"kpool must be a positive number of tokens a pool, got {kpool}"
    assert isinstance(dim, int) and dim > 0 and dim % DIM_MULTIPLE == 0, (
        f"head dim must be a positive multiple of {DIM_MULTIPLE} (the indexer's keys), got {dim}"
    )
    assert isinstance(page, int) and page > 0, f"page must be a positive number of slots, got {page}"
    assert key.gate_dtype in GATE_DTYPES, f"gate is bfloat16 or float32, got {key.gate_dtype}"
    assert key.ape_dtype in GATE_DTYPES, f"ape is bfloat16 or float32, got {key.ape_dtype}"
    assert key.slot_dtype in SLOT_DTYPES, f"slot ids are int32 or int64, got {key.slot_dtype}"
    plan = lane_plan(kpool, dim)
    w, lanes = plan.per_lane, plan.lanes
    row_bytes = page * (dim + SCALE_BYTES)  # bytes of one cache page
    scale_word = page * dim // SCALE_BYTES  # float32 index of a page's first scale
    n = T.dynamic("n")
    p_count = T.dynamic("p")

    @T.prim_func
    def kpool_store_index_k(
        k: T.Tensor((n, kpool, dim), T.bfloat16),
        gate: T.Tensor((n, kpool, dim), key.gate_dtype),
        ape: T.Tensor((kpool, dim), key.ape_dtype),
        loc: T.Tensor((n,), key.slot_dtype),
        cache: T.Tensor((p_count, row_bytes), T.uint8),
    ):
        with T.Kernel(T.ceildiv(n, plan.pools_per_block), threads=THREADS) as bx:
            T.annotate_min_blocks_per_sm(plan.min_blocks)
            vals = T.view(cache, (p_count, row_bytes), T.float8_e4m3fn)
            scales = T.view(cache, (p_count, row_bytes // SCALE_BYTES), T.float32)
            tx = T.get_thread_binding()
            lane = tx % GROUP
            sub = lane % lanes  # this lane's place among its pool's
            pool = (bx * (THREADS // GROUP) + tx // GROUP) * plan.pools_per_warp + lane // lanes
            src = T.min(pool, n - 1)  # (lanes past the last pool read its inputs and store nothing)
            keys = T.alloc_local((plan.values,), T.bfloat16)  # [kpool, w]
            ex = T.alloc_local((plan.values,), T.float32)  # [kpool, w]: the logits, then their exponentials
            top = T.alloc_local((w,), T.float32)
            den = T.alloc_local((w,), T.float32)
            inv = T.alloc_local((w,), T.float32)
            tiny = T.alloc_local((1,), T.float32)
            pooled = T.alloc_local((w,), T.float32)
            qv = T.alloc_local((CH,), T.float8_e4m3fn)
            sc = T.alloc_local((1,), T.float32)
            slot_v = T.alloc_local((1,), T.int64)
            slot_v[0] = T.if_then_else(pool < n, T.cast(loc[src], T.int64), T.int64(-1))
            _load_pool(plan, k, gate, ape, src, sub, keys, ex)
            _exponentials(plan, ex, top, den)
            _weighted_sum(plan, ex, den, keys, inv, tiny, pooled)
            # the row's quantization, store_index_k's (every lane of the warp takes part in the butterfly)
            sc[0] = row_amax(pooled, 0, w)
            butterfly_max(sc, lanes)
            sc[0] = row_scale(sc[0], key.round_scale)
            slot = slot_v[0]
            if slot >= 0 and slot < T.cast(p_count, T.int64) * page:
                pg = slot // page
                off = slot % page
                for p in T.unroll(plan.passes):
                    for c in T.vectorized(CH):
                        qv[c] = fp8_value(pooled[p * CH + c], sc[0])
                    for c in T.vectorized(CH):
                        vals[pg, off * dim + plan.col(p, sub) + c] = qv[c]
                if sub == 0:
                    scales[pg, scale_word + off] = sc[0]

    return kpool_store_index_k


def _request_of(r, rows, row_request, requests):
    """The page-table row of row r: ``row_request[r]``, or ``r // (R / B)`` (B dividing R, which the contract checks;
    guarded against B = 0, whose rows map to no slot)."""
    if row_request is not None:
        return row_request[r]
    return r // T.max(rows // T.max(requests, 1), 1)


def build_kpool_expand(key: KpoolExpandKey):
    """Expand selected pools into tokens (or slots), called as ``fn(pools, lengths, [page_table,] [row_request,]
    out)``, the bracketed ones present when the key says so (``page_size > 0``; ``has_row_request``):

    - ``pools`` : ``[R, k]`` int32, contiguous: each row's selected pool positions ascending, then -1 (as the top-k
      kernels write them; every position below ``2^31 / kpool``, as the pools of a row of int32 length are)
    - ``lengths`` : ``[R]`` int32, the tokens row r sees (a negative length counts as 0)
    - ``page_table`` : ``[B, max_pages]`` int32, any entries (B > 0 dividing R when there is no row_request)
    - ``row_request`` : ``[R]`` int32, any values
    - ``out`` : ``[R, W']`` int32 with ``W' >= k * kpool`` (plus ``kpool - 1`` with the tail): every element written,
      nothing else

    Threads: grid (R, ``ceil(W' / EXPAND_COLUMNS)``) CTAs of EXPAND_THREADS. A CTA first finds n, the row's selected
    pools, as the one place where a valid pool is followed by -1 (or the row's end; n = 0 where pool 0 is -1): each
    thread tests the pools ``tx, tx + EXPAND_THREADS, ..`` and the one that holds the row's last valid pool writes n to
    shared memory, read by all after one barrier. Then CTA (r, y) writes the columns ``y * EXPAND_COLUMNS + i *
    EXPAND_THREADS + tx`` (i < EXPAND_PER_THREAD) of row r: a thread's loads of their pools are independent, so they
    are in flight together, and each step's stores are consecutive.
    """
    kpool, page = key.kpool, key.page_size
    assert isinstance(kpool, int) and kpool >= 1, f"kpool must be a positive number of tokens a pool, got {kpool}"
    assert isinstance(page, int) and page >= 0, f"page_size is 0 (positions) or a page size, got {page}"
    assert not key.has_row_request or page, "row_request maps rows to page-table rows: needs a page table"
    tail = key.tail and kpool > 1  # a pool of one token leaves no incomplete pool
    rows, k, width = T.dynamic("rows"), T.dynamic("k"), T.dynamic("width")
    requests, max_pages = T.dynamic("requests"), T.dynamic("max_pages")

    @T.macro
    def expand(pools, lengths, page_table, row_request, out):
        with T.Kernel(rows, T.ceildiv(width, EXPAND_COLUMNS), threads=EXPAND_THREADS) as (r, by):
            tx = T.get_thread_binding()
            selected = T.alloc_shared((1,), T.int32)  # n
            count = T.alloc_local((1,), T.int32)
            seen = T.max(lengths[r], 0)
            partial = T.truncmod(seen, kpool)  # tokens of the incomplete pool (seen >= 0: no floor to correct)
            request = _request_of(r, rows, row_request, requests) if page else 0
            for i in T.serial(T.ceildiv(k, EXPAND_THREADS)):
                j = i * EXPAND_THREADS + tx
                if j < k:
                    valid = pools[r, j] >= 0
                    follows = T.if_then_else(j + 1 < k, pools[r, T.min(j + 1, k - 1)] >= 0, False)
                    if valid and not follows:
                        selected[0] = j + 1
                    if j == 0 and not valid:
                        selected[0] = 0
            T.sync_threads()
            count[0] = selected[0]
            for i in T.unroll(EXPAND_PER_THREAD):
                e = by * EXPAND_COLUMNS + i * EXPAND_THREADS + tx
                if e < width:
                    token = T.alloc_var(T.int64)
                    token = T.int64(-1)
                    if e < k * kpool:
                        pool = pools[r, e // kpool]
                        if pool >= 0:
                            token = T.cast(pool, T.int64) * kpool + e % kpool
                    if tail:
                        step = e - count[0] * kpool  # the column's place after the row's pools
                        if step >= 0 and step < kpool - 1:
                            token = T.if_then_else(step < partial, T.cast(seen - partial + step, T.int64), T.int64(-1))
                    if page:
                        slot = T.alloc_var(T.int64)
                        slot = T.int64(-1)
                        if token >= 0:
                            page_index = T.truncdiv(token, page)
                            if request >= 0 and request < requests and page_index < T.cast(max_pages, T.int64):
                                entry = T.alloc_var(T.int32)
                                entry = page_table[request, page_index]
                                if entry >= 0:
                                    slot = T.cast(entry, T.int64) * page + T.truncmod(token, page)
                        token = slot
                    out[r, e] = T.cast(token, T.int32)

    pools_t = T.Tensor((rows, k), T.int32)
    lengths_t = T.Tensor((rows,), T.int32)
    request_t = T.Tensor((rows,), T.int32)  # (a type of its own: arguments of one type become one buffer)
    table_t = T.Tensor((requests, max_pages), T.int32)
    out_t = T.Tensor((rows, width), T.int32)
    if not page:

        @T.prim_func
        def kpool_expand(pools: pools_t, lengths: lengths_t, out: out_t):
            expand(pools, lengths, None, None, out)

    elif not key.has_row_request:

        @T.prim_func
        def kpool_expand(pools: pools_t, lengths: lengths_t, page_table: table_t, out: out_t):
            expand(pools, lengths, page_table, None, out)

    else:

        @T.prim_func
        def kpool_expand(pools: pools_t, lengths: lengths_t, page_table: table_t, row_request: request_t, out: out_t):
            expand(pools, lengths, page_table, row_request, out)

    return kpool_expand
