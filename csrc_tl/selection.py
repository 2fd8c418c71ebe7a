"""TileLang kernels of the exact top-k selection ``dsa.topk``.

Letters: R rows, W columns of ``logits [R, W] float32`` (row stride ``ld >= W``), B requests and ``max_pages``
pages of ``page_table [B, max_pages] int32``, K = ``key.k``, W' the output's width; C chunks of CH columns for the
split kernels. All of R, W, ld, W', B, max_pages, C and CH are dynamic: one compiled kernel serves every size.

Row r's candidates are the columns ``[starts[r], starts[r] + lengths[r])`` clipped to ``[0, W)`` (starts 0 when
absent); a candidate's position is its column minus ``starts[r]``. The kernels select the K candidates first in
the order (logit descending, position ascending), all of them when a row has fewer, and write their positions
ascending, then -1 up to W'. With a page table each position p becomes the slot ``page_table[b, p // page_size]
* page_size + p % page_size`` (computed in int64, stored as int32), ``b = row_request[r]`` or ``r // (R / B)``;
-1 where b is outside ``[0, B)``, ``p // page_size >= max_pages`` or the entry is negative. Exact definition:
``sparse_dsa_ops.reference.topk``.

The selection is exact and deterministic: each logit becomes an unsigned 32-bit key with the logits' order
(:func:`order_key`: -0 equals +0, every NaN is key 0, below -inf), and a radix select finds the K-th largest key
``tau`` and how many candidates equal to it are taken (``take``) with three histogram passes over digits of 12, 10
and 10 bits. One in-order pass then writes every candidate whose key is larger than ``tau`` and the first ``take``
equal to it: block-wide prefix sums in position order place each one, so the output is ascending without a sort
and ties go to the lower position. Integer histograms and prefix sums give the same result in every run; no
floating-point value is ever compared or summed.

Where the candidates of the threshold's top digit and above (the *list*) fit in shared memory (``key.cap``
entries), the row is read twice: one histogram pass, then one pass that gathers the list (keys and columns), on
which the last two digits and the output pass run in shared memory. Rows of at most ``cap`` candidates are read
once, straight into the list. Rows of at most K candidates are copied. Otherwise (a huge threshold bin: e.g. many
equal logits) the last passes read the row again: slower, never inexact.

The one-CTA-per-row kernel reads a longer row of at most :data:`BITMAP_COLS` candidates once where it can: it
histograms the top digit of a sample (one column in :data:`SAMPLE_STEP`), takes the top digit of the sample key
whose rank scales to about twice k as a guessed threshold, and gathers every candidate at or above it into the
list. Where they are k or more (so the k-th largest key is among them) and fit the list, the list holds every
candidate at or above the k-th largest key's whole top-digit bin (the guess is a bin's floor), so its own
histogram gives the same top digit, and the same counts above it, as the row's: the selection finishes on the
list. Otherwise the row is read twice as above. Either way the list is gathered in no order: each candidate takes
its slot from a shared-memory atomic counter, so no tile of the pass waits for the others' counts (the in-order
gather needs two barriers a tile). The digits are order-free counts; the output then knows the set,
not its order: where every key equal to ``tau`` is taken (``take`` equals their count: always, for distinct
logits), each selected entry sets its column's bit in a bitmap held in the (then free) histogram, and one
block-wide prefix sum of the words' bit counts places each set bit, ascending. Where ties at ``tau`` are cut, the
output pass reads the row again in column order, which puts the first ``take`` of them out, as always.

Two schemes:

* :func:`build_topk_rows`: one CTA per row (grid R), no scratch. For many rows (the prefill: R in the hundreds
  or more), where R CTAs fill the GPU.
* :func:`build_topk_split`: C CTAs per row, each over a chunk of CH columns, in one launch, for few rows (decode
  batches: R * C >= the SM count). Every CTA of a row guesses the same threshold from the same samples, gathers its
  chunk's candidates at or above it in column order into ``cand`` and takes a ticket; the row's last CTA joins the
  chunks' entries in chunk order into the list (so the list is in column order) and, where the guess holds,
  finishes the row on it; where it fails (fewer than K at or above the guess, or more than the list holds: many
  equal logits, or a row that hides its largest logits from the samples) it reads the row alone as the
  one-CTA-per-row kernel does. Rows of at most ``cap`` candidates are done by the CTA of chunk 0 alone. The tickets
  make the last CTA of a row the only reader of what the others wrote, after a device-scope fence: no CTA ever
  waits for another, and the result does not depend on which CTA comes last. A call leaves its tickets all zero,
  so they are zeroed once, when allocated.

Kernels never read or write outside their buffers for any index value: starts and lengths of any int32 value,
page-table entries and request ids outside their ranges.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

__all__ = [
    "TopkKey",
    "TopkSplitKey",
    "MAX_K",
    "FIRST_BINS",
    "pass_configs",
    "split_chunk",
    "order_key",
    "build_topk_rows",
    "build_topk_split",
]

MAX_K = 4096  # the largest k of dsa.topk
WARP = 32  # lanes of a shuffle group (also 32 on 64-wide AMD wavefronts: shuffles take a width)
SHUFFLE_DELTAS = (1, 2, 4, 8, 16)  # the steps of a 32-lane inclusive scan
# The three radix digits of a key, most significant first: (shift, bits).
FIRST_SHIFT, FIRST_BITS = 20, 12  # sign, exponent and 3 mantissa bits
MID_SHIFT, MID_BITS = 10, 10
LOW_BITS = 10
FIRST_BINS = 1 << FIRST_BITS
LOW_BINS = 1 << MID_BITS  # bins of the second and third digits (both 10 bits)
LOW_MASK = LOW_BINS - 1
COUNT_BITS = 16  # an in-order pass sums (greater, equal) counts of a tile packed into one int32
COUNT_MASK = (1 << COUNT_BITS) - 1
SAMPLE_STEP = 128  # columns between the samples that guess a long row's threshold (one in 16 of its sectors)
BITMAP_COLS = 32 * FIRST_BINS  # candidates of a row whose selection can leave through a bitmap in the histogram
# Key bits (order_key).
SIGN = 0x80000000
MAGNITUDE = 0x7FFFFFFF
INF_BITS = 0x7F800000
ALL_ONES = 0xFFFFFFFF
NAN_KEY = 0  # below every number: -inf is key 0x007FFFFF
ZERO_KEY = SIGN  # +0 and -0
# Words of the shared `state` buffer: the result of a digit selection, then a broadcast ticket.
DIGIT, ABOVE, COUNT, TICKET = 0, 1, 2, 3
STATE_WORDS = 4


@dataclass(frozen=True)
class TopkKey:
    """A one-CTA-per-row top-k kernel (:func:`build_topk_rows`).

    k: the selection size (1 to :data:`MAX_K`; the output's width W' >= k is dynamic); page_size: the page of the
    page table, 0 for no page table (positions out); has_starts: a ``starts`` argument; has_row_request: a
    ``row_request`` argument (needs a page table). Tile parameters: threads per CTA, vec elements each thread takes
    of a tile (``threads * vec`` per tile), cap list entries in shared memory (8 bytes each).
    """

    k: int
    page_size: int = 0
    has_starts: bool = False
    has_row_request: bool = False
    threads: int = 512
    vec: int = 4
    cap: int = 8192

    def __post_init__(self):
        _check_key(self)

    @property
    def name(self) -> str:
        return f"topk_rows_{_spec_name(self)}"


@dataclass(frozen=True)
class TopkSplitKey:
    """The split top-k kernel (:func:`build_topk_split`); the fields as :class:`TopkKey`."""

    k: int
    page_size: int = 0
    has_starts: bool = False
    has_row_request: bool = False
    threads: int = 512
    vec: int = 4
    cap: int = 8192

    def __post_init__(self):
        _check_key(self)

    @property
    def name(self) -> str:
        return f"topk_split_{_spec_name(self)}"


def _check_key(key) -> None:
    assert 1 <= key.k <= MAX_K, f"k in [1, {MAX_K}], got {key.k}"
    assert key.page_size >= 0, "page_size is 0 (no page table) or a page size"
    assert not key.has_row_request or key.page_size, "row_request maps rows to page-table rows: needs a page table"
    assert key.threads % WARP == 0 and 2 * WARP <= key.threads <= 1024, "threads: a multiple of 32 in [64, 1024]"
    warps = key.threads // WARP
    assert warps <= WARP, "one warp scans the warps' totals"
    assert key.vec * warps % WARP == 0, "each lane of the tile scan takes whole (sub-tile, warp) counts"
    assert key.threads * key.vec <= COUNT_MASK, "a tile's counts fit 16 bits"
    assert FIRST_BINS % key.threads == 0 or key.threads % FIRST_BINS == 0
    assert key.cap >= 1


def _spec_name(key) -> str:
    paged = f"page{key.page_size}" if key.page_size else "positions"
    opts = ("_starts" if key.has_starts else "") + ("_rowreq" if key.has_row_request else "")
    return f"k{key.k}_{paged}{opts}_t{key.threads}_v{key.vec}_cap{key.cap}"


def pass_configs(key) -> dict:
    """TileLang pass configs of every top-k kernel: the barriers are placed by hand (TileLang's automatic ones would
    also land inside loops whose every thread already waits at one)."""
    return {"tl.disable_thread_storage_sync": True}


def split_chunk(width: int, chunks: int) -> int:
    """CH, the columns of each of ``chunks`` CTAs of a row of ``width`` columns in :func:`build_topk_split`: the
    chunks must cover the row (``C * CH >= W``)."""
    return max(1, -(-width // max(chunks, 1)))


def order_key(x):
    """The uint32 key of a float32 ``x``: larger logits give larger keys; -0 and +0 give one key; every NaN gives
    :data:`NAN_KEY`, below -inf. Pure integer operations on the bits: no floating-point comparison."""
    bits = T.reinterpret(x, T.uint32)
    mag = bits & T.uint32(MAGNITUDE)
    flipped = T.Select(bits >= T.uint32(SIGN), bits ^ T.uint32(ALL_ONES), bits | T.uint32(SIGN))
    number = T.Select(mag == T.uint32(0), T.uint32(ZERO_KEY), flipped)
    return T.Select(mag > T.uint32(INF_BITS), T.uint32(NAN_KEY), number)


@dataclass(frozen=True, eq=False)
class _Sizes:
    """The sizes a top-k kernel's macros are specialized on: those of its key and W' (``out_width``, dynamic)."""

    k: int
    cap: int
    page: int  # the page table's page size, 0 without one
    threads: int
    vec: int  # elements each thread takes of a tile
    out_width: object  # W', a TIR variable

    @classmethod
    def of(cls, key, out_width) -> "_Sizes":
        return cls(key.k, key.cap, key.page_size, key.threads, key.vec, out_width)

    @property
    def tile(self) -> int:
        """Elements of one tile: ``threads * vec``."""
        return self.threads * self.vec

    @property
    def warps(self) -> int:
        return self.threads // WARP

    @property
    def entries(self) -> int:
        """(sub-tile, warp) counts of one in-order tile."""
        return self.vec * self.warps

    @property
    def per_lane(self) -> int:
        """Of those, the counts each lane of the tile scan takes."""
        return self.entries // WARP


@dataclass(frozen=True)
class _Shared:
    """The shared buffers of a CTA that selects a row (allocated by :func:`_output_macros`' ``rows_shared`` or
    ``split_shared``): ``hist`` (a digit's histogram, ``[FIRST_BINS]``), the list ``lkey`` and ``lcol`` (keys and
    columns, ``[cap]``), ``cnt`` (the tile counts of :func:`_scan_macros`' ``tile_ranks``), ``sums`` (the warp totals
    of ``block_scan``), ``offs`` (the chunks' offsets in the split kernel's gather, ``[threads]``; else None)
    and ``state`` (a digit selection's result and a ticket, ``[STATE_WORDS]``)."""

    hist: object
    lkey: object
    lcol: object
    cnt: object
    sums: object
    offs: object
    state: object


@dataclass(frozen=True)
class _Row:
    """The row a CTA selects: ``logits`` and the row ``row`` of it (also the row of ``out`` it writes), its
    candidates' columns ``[lo, hi)`` and the column ``start`` of position 0, and the page-table arguments
    ``paging`` of :func:`_source_macros`' ``slot_of``."""

    logits: object
    row: object
    lo: object
    hi: object
    start: object
    out: object
    paging: tuple


@dataclass(frozen=True)
class _Source:
    """The source of a pass over a row's candidates: the list ``shared.lkey[:count]``, ``shared.lcol`` where
    ``use_list`` (a thread-invariant int32) is nonzero, else the logits columns ``[row.lo, row.hi)``."""

    use_list: object
    count: object
    row: _Row
    shared: _Shared


def _parts(key, out_width) -> SimpleNamespace:
    """The macros of a top-k kernel, specialized on its key and W' (``out_width``): the prefix sums and the digit
    selection (:func:`_scan_macros`), the passes over the logits (:func:`_logit_macros`, in column order, and
    :func:`_unordered_macros`), the passes over a pass's source (:func:`_source_macros`), those that write a row's
    output (:func:`_output_macros`, :func:`_bitmap_macro`) and those that bring a long row to its list
    (:func:`_long_row_macros`); and ``sizes`` (:class:`_Sizes`)."""
    sizes = _Sizes.of(key, out_width)
    scans = _scan_macros(sizes)
    logit_passes = _logit_macros(sizes, scans)
    any_order = _unordered_macros(sizes, logit_passes)
    sources = _source_macros(sizes, scans)
    outputs = _output_macros(sizes, scans, logit_passes, sources, _bitmap_macro(sizes, scans, logit_passes, sources))
    long_rows = _long_row_macros(sizes, scans, logit_passes, any_order)
    parts = (scans, logit_passes, any_order, sources, outputs, long_rows)
    return SimpleNamespace(sizes=sizes, **{name: m for part in parts for name, m in vars(part).items()})


def _scan_macros(sizes: _Sizes) -> SimpleNamespace:
    """Prefix sums over a warp, a block and an in-order tile, and the selection of a digit: ``warp_scan``,
    ``block_scan``, ``select_digit`` and ``tile_ranks``."""
    threads, vec, warps, entries, per_lane = sizes.threads, sizes.vec, sizes.warps, sizes.entries, sizes.per_lane

    @T.macro
    def warp_scan(acc, j, tmp):
        """``acc[j]``: its inclusive prefix sum over the 32 lanes of the thread's shuffle group."""
        lane = T.get_thread_binding() % WARP
        for delta in SHUFFLE_DELTAS:
            tmp[0] = T.shfl_up(acc[j], delta, WARP)
            if lane >= delta:
                acc[j] = acc[j] + tmp[0]

    @T.macro
    def block_scan(mine, excl, total, sums):
        """``excl[0]``: the sum of ``mine[0]`` over the threads before this one; ``total[0]``: over all. Reads
        ``sums`` (shared ``[warps]``) after the last barrier: callers pass a barrier before its next use."""
        tx = T.get_thread_binding()
        lane, warp = tx % WARP, tx // WARP
        tmp = T.alloc_local((1,), T.int32)
        excl[0] = mine[0]
        warp_scan(excl, 0, tmp)
        if lane == WARP - 1:
            sums[warp] = excl[0]
        T.sync_threads()
        if warp == 0:
            total[0] = T.Select(lane < warps, sums[T.min(lane, warps - 1)], 0)
            warp_scan(total, 0, tmp)
            if lane < warps:
                sums[lane] = total[0]
        T.sync_threads()
        excl[0] = excl[0] - mine[0] + T.Select(warp > 0, sums[T.max(warp - 1, 0)], 0)
        total[0] = sums[warps - 1]

    @T.macro
    def select_digit(hist, bins, need, state, sums):
        """Find the bin d of ``hist[bins]`` (shared) where the count from the top reaches ``need`` (a thread-
        invariant int32, 1 <= need <= the total): ``state[DIGIT] = d``, ``state[ABOVE]`` = the count of the
        bins above d, ``state[COUNT] = hist[d]``. Ends at a barrier."""
        tx = T.get_thread_binding()
        per = max(bins // threads, 1)  # bins a thread owns, consecutive
        owners = bins // per
        mine = T.alloc_local((1,), T.int32)
        excl = T.alloc_local((1,), T.int32)
        total = T.alloc_local((1,), T.int32)
        acc = T.alloc_local((1,), T.int32)
        mine[0] = 0
        if tx < owners:
            for i in T.unroll(per):
                mine[0] = mine[0] + hist[tx * per + i]
        block_scan(mine, excl, total, sums)
        acc[0] = total[0] - excl[0] - mine[0]  # the count of the bins of the threads after this one
        if tx < owners:
            for i in T.unroll(per):
                b = tx * per + (per - 1 - i)
                if acc[0] < need and acc[0] + hist[b] >= need:  # exactly one bin of one thread
                    state[DIGIT] = b
                    state[ABOVE] = acc[0]
                    state[COUNT] = hist[b]
                acc[0] = acc[0] + hist[b]
        T.sync_threads()

    @T.macro
    def tile_ranks(vals, ranks, cnt, parity, tile_total):
        """In-order prefix sums of one tile: element j of thread tx is element ``j * threads + tx`` of the
        tile; ``ranks[j]`` = the sum of ``vals`` over the tile's elements before it, ``tile_total[0]`` over all.
        ``cnt`` (shared ``[2, entries + 1]``) alternates halves with ``parity`` so that a tile's writes never
        meet the previous tile's reads: two barriers a tile suffice."""
        tx = T.get_thread_binding()
        lane, warp = tx % WARP, tx // WARP
        acc = T.alloc_local((vec,), T.int32)
        tmp = T.alloc_local((1,), T.int32)
        part = T.alloc_local((per_lane,), T.int32)
        run = T.alloc_local((1,), T.int32)
        own = T.alloc_local((1,), T.int32)
        for j in T.unroll(vec):
            acc[j] = vals[j]
            warp_scan(acc, j, tmp)
            if lane == WARP - 1:
                cnt[parity, j * warps + warp] = acc[j]
        T.sync_threads()
        if warp == 0:  # exclusive scan of the (sub-tile, warp) totals, in the tile's order
            run[0] = 0
            for i in T.unroll(per_lane):
                part[i] = run[0]
                run[0] = run[0] + cnt[parity, lane * per_lane + i]
            own[0] = run[0]
            warp_scan(run, 0, tmp)
            for i in T.unroll(per_lane):
                cnt[parity, lane * per_lane + i] = part[i] + run[0] - own[0]
            if lane == WARP - 1:
                cnt[parity, entries] = run[0]
        T.sync_threads()
        for j in T.unroll(vec):
            ranks[j] = cnt[parity, j * warps + warp] + acc[j] - vals[j]
        tile_total[0] = cnt[parity, entries]

    return SimpleNamespace(warp_scan=warp_scan, block_scan=block_scan, select_digit=select_digit, tile_ranks=tile_ranks)


def _logit_macros(sizes: _Sizes, scans: SimpleNamespace) -> SimpleNamespace:
    """The passes over a row's logits that count the top digit and gather the list, and their helpers: ``zero``,
    ``load_tile``, ``hist_first`` and ``collect``."""
    threads, vec, tile, tile_ranks = sizes.threads, sizes.vec, sizes.tile, scans.tile_ranks

    @T.macro
    def zero(buf, count):
        """``buf[:count] = 0`` (shared; no barrier)."""
        tx = T.get_thread_binding()
        for i in T.unroll(T.ceildiv(count, threads)):
            if count % threads == 0 or i * threads + tx < count:
                buf[i * threads + tx] = 0

    @T.macro
    def load_tile(logits, row, lo, hi, raw):
        """The tile from column ``lo``: ``raw[j] = logits[row, lo + j * threads + tx]``, clamped to column ``hi - 1``
        (hi > 0) so that every load is in bounds and none waits behind a branch."""
        tx = T.get_thread_binding()
        for j in T.unroll(vec):
            raw[j] = logits[row, T.min(lo + j * threads + tx, hi - 1)]

    @T.macro
    def hist_first(logits, row, lo, hi, hist):
        """Histogram the top digit of the keys of the logits columns ``[lo, hi)`` of ``row`` into ``hist``
        (shared, zeroed), loading the next tile before it counts this one. No barrier."""
        tx = T.get_thread_binding()
        raw = T.alloc_local((vec,), T.float32)
        nxt = T.alloc_local((vec,), T.float32)
        kv = T.alloc_local((vec,), T.uint32)
        load_tile(logits, row, lo, hi, nxt)
        for it in T.serial(T.ceildiv(hi - lo, tile)):
            for j in T.unroll(vec):
                raw[j] = nxt[j]
            load_tile(logits, row, lo + (it + 1) * tile, hi, nxt)
            for j in T.unroll(vec):
                kv[j] = order_key(raw[j])
            for j in T.unroll(vec):
                if lo + it * tile + j * threads + tx < hi:
                    T.atomic_add(hist[T.cast(kv[j] >> FIRST_SHIFT, T.int32)], 1)

    @T.macro
    def collect(logits, row, lo, hi, thr, dst_key, dst_col, dst_at, chunk, cnt, found):
        """Write the keys and columns of the candidates of ``[lo, hi)`` with ``key >= thr`` in column order to
        ``dst_key[i]`` and ``dst_col[i]`` (shared lists), or to ``dst_col[r, c, 0, i]`` (the key's bits) and
        ``dst_col[r, c, 1, i]`` when ``dst_at = (r, c)``, for i < chunk; ``found[0]`` = their count. Ends at a
        barrier."""
        tx = T.get_thread_binding()
        raw = T.alloc_local((vec,), T.float32)
        nxt = T.alloc_local((vec,), T.float32)
        kv = T.alloc_local((vec,), T.uint32)
        vals = T.alloc_local((vec,), T.int32)
        ranks = T.alloc_local((vec,), T.int32)
        tile_total = T.alloc_local((1,), T.int32)
        found[0] = 0
        load_tile(logits, row, lo, hi, nxt)
        for it in T.serial(T.ceildiv(hi - lo, tile)):
            for j in T.unroll(vec):
                raw[j] = nxt[j]
            load_tile(logits, row, lo + (it + 1) * tile, hi, nxt)
            for j in T.unroll(vec):
                kv[j] = order_key(raw[j])
                vals[j] = T.Select((lo + it * tile + j * threads + tx < hi) & (kv[j] >= thr), 1, 0)
            tile_ranks(vals, ranks, cnt, it % 2, tile_total)
            for j in T.unroll(vec):
                if vals[j] == 1 and found[0] + ranks[j] < chunk:
                    if dst_at is None:
                        dst_key[found[0] + ranks[j]] = kv[j]
                        dst_col[found[0] + ranks[j]] = lo + it * tile + j * threads + tx
                    else:
                        dst_col[dst_at[0], dst_at[1], 0, found[0] + ranks[j]] = T.reinterpret(kv[j], T.int32)
                        dst_col[dst_at[0], dst_at[1], 1, found[0] + ranks[j]] = lo + it * tile + j * threads + tx
            found[0] = found[0] + tile_total[0]
        T.sync_threads()

    return SimpleNamespace(zero=zero, load_tile=load_tile, hist_first=hist_first, collect=collect)


def _unordered_macros(sizes: _Sizes, logit_passes: SimpleNamespace) -> SimpleNamespace:
    """The passes over a row's logits of the list gathered in no order: ``hist_sample`` (the guess's sample) and
    ``collect_any``."""
    threads, vec, tile, load_tile = sizes.threads, sizes.vec, sizes.tile, logit_passes.load_tile

    @T.macro
    def hist_sample(logits, row, lo, count, hist):
        """Histogram the top digit of the keys of ``count`` sample columns of ``row``, ``lo + i * SAMPLE_STEP``,
        into ``hist`` (shared, zeroed). No barrier."""
        tx = T.get_thread_binding()
        for i in T.serial(T.ceildiv(count, threads)):
            if i * threads + tx < count:
                raw = logits[row, lo + (i * threads + tx) * SAMPLE_STEP]
                T.atomic_add(hist[T.cast(order_key(raw) >> FIRST_SHIFT, T.int32)], 1)

    @T.macro
    def collect_any(logits, row, lo, hi, thr, lkey, lcol, state):
        """Write the keys and columns of the candidates of ``[lo, hi)`` with ``key >= thr`` to ``lkey`` and ``lcol``
        (shared lists) in any order, each at the slot a shared-memory atomic on ``state[TICKET]`` (zeroed) hands it;
        ``state[TICKET]`` ends as their count, those past the lists' length left out. No barrier: unlike
        :func:`collect`, no tile waits for the others' counts."""
        tx = T.get_thread_binding()
        raw = T.alloc_local((vec,), T.float32)
        nxt = T.alloc_local((vec,), T.float32)
        kv = T.alloc_local((vec,), T.uint32)
        at = T.alloc_local((1,), T.int32)
        load_tile(logits, row, lo, hi, nxt)
        for it in T.serial(T.ceildiv(hi - lo, tile)):
            for j in T.unroll(vec):
                raw[j] = nxt[j]
            load_tile(logits, row, lo + (it + 1) * tile, hi, nxt)
            for j in T.unroll(vec):
                kv[j] = order_key(raw[j])
            for j in T.unroll(vec):
                if lo + it * tile + j * threads + tx < hi and kv[j] >= thr:
                    at[0] = T.atomic_add(state[TICKET], 1, return_prev=True)
                    if at[0] < sizes.cap:
                        lkey[at[0]] = kv[j]
                        lcol[at[0]] = lo + it * tile + j * threads + tx

    return SimpleNamespace(hist_sample=hist_sample, collect_any=collect_any)


def _source_macros(sizes: _Sizes, scans: SimpleNamespace) -> SimpleNamespace:
    """The two passes that read a row's :class:`_Source`, the list or the logits, and their helpers: a digit's
    histogram (``hist_digit``) and the output (``compact``), over ``source_tile``; ``slot_of``, the value written for
    a position."""
    threads, vec, tile, k, cap, page = sizes.threads, sizes.vec, sizes.tile, sizes.k, sizes.cap, sizes.page
    tile_ranks = scans.tile_ranks

    @T.macro
    def source_tile(src, it, kv, col, valid):
        """Tile ``it`` of ``src`` (a :class:`_Source`): ``kv[j]``, ``col[j]`` and ``valid[j]`` (1 or 0) of its
        element j."""
        tx = T.get_thread_binding()
        raw = T.alloc_local((1,), T.float32)
        for j in T.unroll(vec):
            if src.use_list != 0:
                kv[j] = src.shared.lkey[T.min(it * tile + j * threads + tx, cap - 1)]
                col[j] = src.shared.lcol[T.min(it * tile + j * threads + tx, cap - 1)]
                valid[j] = T.Select(it * tile + j * threads + tx < src.count, 1, 0)
            else:
                col[j] = src.row.lo + it * tile + j * threads + tx
                raw[0] = src.row.logits[src.row.row, T.min(col[j], src.row.hi - 1)]
                kv[j] = order_key(raw[0])
                valid[j] = T.Select(col[j] < src.row.hi, 1, 0)

    def source_tiles(src):
        """The tiles of ``src``: of its list's ``count`` entries or of its row's candidates."""
        return T.ceildiv(T.Select(src.use_list != 0, src.count, src.row.hi - src.row.lo), tile)

    @T.macro
    def hist_digit(src, flt_shift, prefix, dig_shift):
        """Histogram digit ``(key >> dig_shift) & LOW_MASK`` of the keys with ``key >> flt_shift == prefix``
        into ``src.shared.hist`` (zeroed), over the candidates of ``src``. No barrier."""
        kv = T.alloc_local((vec,), T.uint32)
        col = T.alloc_local((vec,), T.int32)
        valid = T.alloc_local((vec,), T.int32)
        for it in T.serial(source_tiles(src)):
            source_tile(src, it, kv, col, valid)
            for j in T.unroll(vec):
                if valid[j] == 1 and (kv[j] >> flt_shift) == prefix:
                    T.atomic_add(src.shared.hist[T.cast((kv[j] >> dig_shift) & LOW_MASK, T.int32)], 1)

    def slot_of(pos, page_table, request, n_req, max_pages):
        """The value written for position ``pos`` (>= 0): pos, or its page-table slot (-1 where invalid)."""
        if not page:
            return pos
        page_idx = pos // page
        ok = (request >= 0) & (request < n_req) & (page_idx < max_pages)
        entry = T.if_then_else(ok, page_table[T.max(T.min(request, n_req - 1), 0), T.min(page_idx, max_pages - 1)], -1)
        return T.Select(entry >= 0, T.cast(T.cast(entry, T.int64) * page + pos % page, T.int32), -1)

    @T.macro
    def compact(src, tau, take):
        """The output pass: in column order, write ``slot_of(column - start)`` of every candidate of ``src`` with
        key > ``tau`` and of the first ``take`` with key == ``tau`` to ``out[row, :k]`` of its row. Ends at a
        barrier."""
        kv = T.alloc_local((vec,), T.uint32)
        col = T.alloc_local((vec,), T.int32)
        vals = T.alloc_local((vec,), T.int32)
        ranks = T.alloc_local((vec,), T.int32)
        tile_total = T.alloc_local((1,), T.int32)
        base = T.alloc_local((2,), T.int32)  # greater, equal: counts before this tile
        greater = T.alloc_local((1,), T.int32)
        equal = T.alloc_local((1,), T.int32)
        base[0] = 0
        base[1] = 0
        for it in T.serial(source_tiles(src)):
            source_tile(src, it, kv, col, vals)
            for j in T.unroll(vec):
                vals[j] = T.Select(
                    vals[j] == 1, T.Select(kv[j] > tau, 1, T.Select(kv[j] == tau, 1 << COUNT_BITS, 0)), 0
                )
            tile_ranks(vals, ranks, src.shared.cnt, it % 2, tile_total)
            for j in T.unroll(vec):
                greater[0] = base[0] + (ranks[j] & COUNT_MASK)
                equal[0] = base[1] + (ranks[j] >> COUNT_BITS)
                if vals[j] == 1 or (vals[j] == 1 << COUNT_BITS and equal[0] < take):
                    src.row.out[src.row.row, T.min(greater[0] + T.min(equal[0], take), k - 1)] = slot_of(
                        col[j] - src.row.start, *src.row.paging
                    )
            base[0] = base[0] + (tile_total[0] & COUNT_MASK)
            base[1] = base[1] + (tile_total[0] >> COUNT_BITS)
        T.sync_threads()

    return SimpleNamespace(source_tile=source_tile, hist_digit=hist_digit, compact=compact, slot_of=slot_of)


def _bitmap_macro(sizes: _Sizes, scans: SimpleNamespace, logit_passes: SimpleNamespace, sources: SimpleNamespace):
    """``emit_bitmap``: the output pass of a list gathered in no order."""
    threads, vec, tile, k = sizes.threads, sizes.vec, sizes.tile, sizes.k
    zero, block_scan, source_tile, slot_of = logit_passes.zero, scans.block_scan, sources.source_tile, sources.slot_of

    @T.macro
    def emit_bitmap(src, tau):
        """The output pass of an unordered list whose every key >= ``tau`` is selected: each such entry sets the bit
        of its column (relative to ``row.lo``) in a bitmap in ``hist``, then each thread writes the set bits of
        its consecutive words at their block-wide rank, so the positions come out ascending without a sort.
        Needs ``row.hi - row.lo <= BITMAP_COLS``. Ends at a barrier."""
        tx = T.get_thread_binding()
        per = FIRST_BINS // threads  # bitmap words a thread owns, consecutive
        kv = T.alloc_local((vec,), T.uint32)
        col = T.alloc_local((vec,), T.int32)
        valid = T.alloc_local((vec,), T.int32)
        mine = T.alloc_local((1,), T.int32)
        excl = T.alloc_local((1,), T.int32)
        total = T.alloc_local((1,), T.int32)
        bits = T.alloc_local((1,), T.uint32)
        at = T.alloc_local((1,), T.int32)
        hist = src.shared.hist
        zero(hist, FIRST_BINS)
        T.sync_threads()
        for it in T.serial(T.ceildiv(src.count, tile)):
            source_tile(src, it, kv, col, valid)
            for j in T.unroll(vec):
                if valid[j] == 1 and kv[j] >= tau:
                    # (atomicOr itself: TileLang's AtomicOr is a global-memory reduction)
                    T.call_extern(
                        T.int32,
                        "atomicOr",
                        T.address_of(hist[(col[j] - src.row.lo) >> 5]),
                        T.int32(1) << ((col[j] - src.row.lo) & 31),
                    )
        T.sync_threads()
        mine[0] = 0
        for i in T.unroll(per):
            mine[0] = mine[0] + _popc(hist[tx * per + i])
        block_scan(mine, excl, total, src.shared.sums)
        at[0] = excl[0]
        for i in T.unroll(per):
            bits[0] = T.reinterpret(hist[tx * per + i], T.uint32)
            for _ in T.serial(_popc(hist[tx * per + i])):
                src.row.out[src.row.row, T.min(at[0], k - 1)] = slot_of(
                    src.row.lo + (tx * per + i) * 32 + _ffs(bits[0]) - 1 - src.row.start,
                    *src.row.paging,
                )
                bits[0] = bits[0] & (bits[0] - T.uint32(1))
                at[0] = at[0] + 1
        T.sync_threads()

    return emit_bitmap


def _output_macros(sizes: _Sizes, scans, logit_passes, sources, emit_bitmap) -> SimpleNamespace:
    """What a selecting CTA allocates and the passes that write a row's output: ``rows_shared`` and ``split_shared``
    (its :class:`_Shared` buffers in either scheme), ``finish`` (the last two digits and the output pass),
    ``whole_row`` (a row that fits the list), ``copy_row`` (a row of at most K candidates) and ``pad``."""
    threads, vec, tile, k, cap, out_width = sizes.threads, sizes.vec, sizes.tile, sizes.k, sizes.cap, sizes.out_width
    zero, load_tile, select_digit = logit_passes.zero, logit_passes.load_tile, scans.select_digit
    hist_digit, compact, slot_of = sources.hist_digit, sources.compact, sources.slot_of

    def shared_macro(with_offs: bool):
        @T.macro
        def shared():
            """The CTA's :class:`_Shared` buffers, ``offs`` only ``with_offs``."""
            hist = T.alloc_shared((FIRST_BINS,), T.int32)
            lkey = T.alloc_shared((cap,), T.uint32)
            lcol = T.alloc_shared((cap,), T.int32)
            cnt = T.alloc_shared((2, sizes.entries + 1), T.int32)
            sums = T.alloc_shared((sizes.warps,), T.int32)
            offs = T.alloc_shared((threads,), T.int32) if with_offs else None
            state = T.alloc_shared((STATE_WORDS,), T.int32)
            return _Shared(hist, lkey, lcol, cnt, sums, offs, state)

        return shared

    @T.macro
    def finish(use_list, count, top, above, row, shared, unordered):
        """Given the top digit ``top`` of the K-th largest key and the count ``above`` of keys of a larger top
        digit, find the last two digits over the :class:`_Source` ``(use_list, count, row, shared)`` (the list of
        ``count`` entries where ``use_list`` is nonzero) and write the selection of ``row`` (a :class:`_Row`) to its
        ``out[row, :k]``. Where ``unordered[0]`` (a thread-invariant int32) is nonzero the list is in no order
        (:func:`_logit_macros`' ``collect_any``, a row of at most :data:`BITMAP_COLS` candidates): the selection goes
        out through a bitmap of its columns (``emit_bitmap``), or where ties at the threshold are cut, from the
        row in column order. Starts after a barrier, ends at one."""
        src = _Source(use_list, count, row, shared)
        need = T.alloc_local((1,), T.int32)
        prefix = T.alloc_local((1,), T.uint32)
        tau = T.alloc_local((1,), T.uint32)
        ordered = T.alloc_local((1,), T.int32)  # the output pass reads the list (else the row)
        need[0] = k - above
        prefix[0] = T.cast(top, T.uint32)
        zero(shared.hist, LOW_BINS)
        T.sync_threads()
        hist_digit(src, FIRST_SHIFT, prefix[0], MID_SHIFT)
        T.sync_threads()
        select_digit(shared.hist, LOW_BINS, need[0], shared.state, shared.sums)
        need[0] = need[0] - shared.state[ABOVE]
        prefix[0] = (prefix[0] << MID_BITS) | T.cast(shared.state[DIGIT], T.uint32)
        T.sync_threads()  # every thread has read state before the next selection writes it
        zero(shared.hist, LOW_BINS)
        T.sync_threads()
        hist_digit(src, MID_SHIFT, prefix[0], 0)
        T.sync_threads()
        select_digit(shared.hist, LOW_BINS, need[0], shared.state, shared.sums)
        tau[0] = (prefix[0] << LOW_BITS) | T.cast(shared.state[DIGIT], T.uint32)
        need[0] = need[0] - shared.state[ABOVE]  # the keys equal to tau that are taken
        if unordered[0] != 0 and shared.state[COUNT] == need[0]:
            emit_bitmap(src, tau[0])  # every key equal to tau is taken: the set is known, not its order
        else:  # in column order: from the list where it is in order, else (ties at tau cut) from the row
            ordered[0] = T.Select(unordered[0] == 0, use_list, 0)
            compact(_Source(ordered[0], count, row, shared), tau[0], need[0])

    @T.macro
    def whole_row(row, n, shared):
        """A row of ``n <= cap`` candidates from column ``row.lo``: its keys and columns into the list and the top
        digit's histogram, then the selection of the top digit (state). Ends at a barrier."""
        tx = T.get_thread_binding()
        raw = T.alloc_local((vec,), T.float32)
        kv = T.alloc_local((vec,), T.uint32)
        zero(shared.hist, FIRST_BINS)
        T.sync_threads()
        for it in T.serial(T.ceildiv(n, tile)):
            load_tile(row.logits, row.row, row.lo + it * tile, row.lo + n, raw)
            for j in T.unroll(vec):
                kv[j] = order_key(raw[j])
            for j in T.unroll(vec):
                if it * tile + j * threads + tx < n:
                    shared.lkey[T.min(it * tile + j * threads + tx, cap - 1)] = kv[j]
                    shared.lcol[T.min(it * tile + j * threads + tx, cap - 1)] = row.lo + it * tile + j * threads + tx
                    T.atomic_add(shared.hist[T.cast(kv[j] >> FIRST_SHIFT, T.int32)], 1)
        T.sync_threads()
        select_digit(shared.hist, FIRST_BINS, k, shared.state, shared.sums)

    @T.macro
    def copy_row(row, n):
        """A row of ``n <= k`` candidates from column ``row.lo``: all of them, then -1 (the whole output row)."""
        tx = T.get_thread_binding()
        for i in T.serial(T.ceildiv(out_width, threads)):
            if i * threads + tx < out_width:
                row.out[row.row, i * threads + tx] = T.if_then_else(
                    i * threads + tx < n, slot_of(row.lo - row.start + i * threads + tx, *row.paging), -1
                )

    @T.macro
    def pad(out, orow):
        """``out[orow, k:] = -1``."""
        tx = T.get_thread_binding()
        if out_width > k:
            for i in T.serial(T.ceildiv(out_width - k, threads)):
                if k + i * threads + tx < out_width:
                    out[orow, k + i * threads + tx] = -1

    return SimpleNamespace(
        rows_shared=shared_macro(False),
        split_shared=shared_macro(True),
        finish=finish,
        whole_row=whole_row,
        copy_row=copy_row,
        pad=pad,
    )


def _long_row_macros(sizes: _Sizes, scans, logit_passes, any_order) -> SimpleNamespace:
    """How a CTA gets a row of more than ``cap`` candidates to its list: ``guess_list`` (one read, on a guessed
    threshold) and ``two_reads``; and their steps the split kernel shares, ``guess_digit`` (the guess) and
    ``list_digit`` (whether it holds)."""
    threads, k, cap = sizes.threads, sizes.k, sizes.cap
    zero, select_digit = logit_passes.zero, scans.select_digit

    # keys at or above the guessed threshold a guess aims at: twice k (k + 1024 at least), short of the list
    guess_target = min(max(2 * k, k + 1024), (k + cap) // 2)

    @T.macro
    def guess_digit(row, shared):
        """``shared.state[DIGIT]``: the guessed threshold's top digit for a row of more than ``cap`` candidates, the
        top digit of the ``guess_target``-th largest of its samples (one column in :data:`SAMPLE_STEP`). Ends at a
        barrier."""
        n = row.hi - row.lo
        samples = n // SAMPLE_STEP
        rank = T.alloc_local((1,), T.int32)
        zero(shared.hist, FIRST_BINS)
        T.sync_threads()
        any_order.hist_sample(row.logits, row.row, row.lo, samples, shared.hist)
        T.sync_threads()
        # (int64: samples * guess_target outgrows int32 past 2^31 / 2^13 * 128 columns)
        rank[0] = T.cast((T.cast(samples, T.int64) * guess_target + n - 1) // n, T.int32)
        rank[0] = T.max(T.min(rank[0], samples), 1)
        select_digit(shared.hist, FIRST_BINS, rank[0], shared.state, shared.sums)

    @T.macro
    def list_digit(shared, top):
        """Where the guess holds (the list's ``top[2]`` entries are k or more: the k-th largest key is at or above
        the guess; and they fit the list), ``top[0]`` and ``top[1]``: the top digit of the k-th largest and the
        keys above it, from the list's histogram, as the histogram of the whole row would give them; else
        ``top[2] = cap + 1``. Starts after a barrier, ends at one."""
        tx = T.get_thread_binding()
        if (top[2] >= k) & (top[2] <= cap):
            zero(shared.hist, FIRST_BINS)
            T.sync_threads()
            for i in T.serial(T.ceildiv(top[2], threads)):
                if i * threads + tx < top[2]:
                    T.atomic_add(shared.hist[T.cast(shared.lkey[i * threads + tx] >> FIRST_SHIFT, T.int32)], 1)
            T.sync_threads()
            select_digit(shared.hist, FIRST_BINS, k, shared.state, shared.sums)
            top[0] = shared.state[DIGIT]
            top[1] = shared.state[ABOVE]
        else:
            top[2] = cap + 1

    @T.macro
    def guess_list(row, shared, top):
        """One read of a row of more than ``cap`` and at most :data:`BITMAP_COLS` candidates, on a guess
        (``guess_digit``): every candidate at or above it gathered into the list in any order. ``top`` as
        ``list_digit`` leaves it. Ends at a barrier."""
        shared.state[TICKET] = 0  # (a word select_digit leaves alone) counts the list
        guess_digit(row, shared)
        thr = T.cast(shared.state[DIGIT], T.uint32) << FIRST_SHIFT
        any_order.collect_any(row.logits, row.row, row.lo, row.hi, thr, shared.lkey, shared.lcol, shared.state)
        T.sync_threads()
        top[2] = shared.state[TICKET]
        list_digit(shared, top)

    @T.macro
    def two_reads(row, shared, top, unordered, found):
        """A row of more than ``cap`` candidates read twice: the top digit's histogram, then the list (in any order
        where ``row`` has at most :data:`BITMAP_COLS` candidates: ``unordered[0] = 1``; else in column order) where
        it fits. ``top`` as :func:`guess_list` leaves it; ``top[2] > cap``: the list does not fit. Ends without a
        barrier."""
        zero(shared.hist, FIRST_BINS)
        T.sync_threads()
        logit_passes.hist_first(row.logits, row.row, row.lo, row.hi, shared.hist)
        T.sync_threads()
        select_digit(shared.hist, FIRST_BINS, k, shared.state, shared.sums)
        top[0] = shared.state[DIGIT]
        top[1] = shared.state[ABOVE]
        top[2] = shared.state[ABOVE] + shared.state[COUNT]
        thr = T.cast(top[0], T.uint32) << FIRST_SHIFT
        unordered[0] = T.Select((top[2] <= cap) & (row.hi - row.lo <= BITMAP_COLS), 1, 0)
        if unordered[0] == 1:
            shared.state[TICKET] = 0
            T.sync_threads()
            any_order.collect_any(row.logits, row.row, row.lo, row.hi, thr, shared.lkey, shared.lcol, shared.state)
        elif top[2] <= cap:
            logit_passes.collect(
                row.logits, row.row, row.lo, row.hi, thr, shared.lkey, shared.lcol, None, cap, shared.cnt, found
            )

    return SimpleNamespace(guess_digit=guess_digit, list_digit=list_digit, guess_list=guess_list, two_reads=two_reads)


@T.macro
def _row_bounds(lengths, starts, r, width, bounds):
    """``bounds = [start, lo, hi]`` (int32) of row r: its candidates are the columns ``[lo, hi)``, in int64 so that
    no start or length overflows."""
    start = T.cast(starts[r], T.int64) if starts is not None else T.int64(0)
    stop = start + T.cast(lengths[r], T.int64)
    lo = T.min(T.max(start, T.int64(0)), T.cast(width, T.int64))
    hi = T.max(T.min(stop, T.cast(width, T.int64)), lo)
    bounds[0] = T.cast(start, T.int32)
    bounds[1] = T.cast(lo, T.int32)
    bounds[2] = T.cast(hi, T.int32)


def _request_of(r, rows, row_request, n_req):
    """The page-table row of row r: ``row_request[r]``, or ``r // (R / B)`` (B > 0 and dividing R; guarded)."""
    if row_request is not None:
        return row_request[r]
    return r // T.max(rows // T.max(n_req, 1), 1)


def build_topk_rows(key: TopkKey):
    """The one-CTA-per-row top-k kernel of ``key`` (grid R, ``key.threads`` threads).

    Call: ``(logits, lengths, [starts,] [page_table,] [row_request,] out)``, the bracketed ones present when the key
    says so (``has_starts``; ``page_size > 0``; ``has_row_request``):

    logits : [R, W] float32, row stride ld >= W (any; inner stride 1)
    lengths : [R] int32
    starts : [R] int32
    page_table : [B, max_pages] int32 (B > 0 dividing R when there is no row_request)
    row_request : [R] int32
    out : [R, W'] int32, written whole (every entry of every row)

    Shared memory: ``4 * 4096 + 8 * cap`` bytes and a few hundred more (81 KiB at cap 8192). Reads each row once (at
    most ``cap`` candidates, or up to :data:`BITMAP_COLS` where the guessed threshold holds, after a sample of one
    column in :data:`SAMPLE_STEP`) or twice (the list fits), else up to four times.
    """
    dims = _Dims()
    return _rows_entry(_rows_stage(key, _parts(key, dims.out_width), dims), key, dims)


def _rows_stage(key: TopkKey, parts: SimpleNamespace, dims: "_Dims"):
    """The body of the one-CTA-per-row kernel: each CTA selects its row by the shortest path its candidates allow
    (copied, read once into the list, read twice, or read again by the last passes)."""
    rows, width, n_req, max_pages = dims.rows, dims.width, dims.requests, dims.max_pages
    k, cap, page = key.k, key.cap, key.page_size

    @T.macro
    def select_rows(logits, lengths, starts, page_table, row_request, out):
        with T.Kernel(rows, threads=key.threads) as bx:
            shared = parts.rows_shared()
            bounds = T.alloc_local((3,), T.int32)
            top = T.alloc_local((3,), T.int32)  # the top digit, the keys above it, the list's length
            found = T.alloc_local((1,), T.int32)
            req = T.alloc_local((1,), T.int32)
            use_list = T.alloc_local((1,), T.int32)
            unordered = T.alloc_local((1,), T.int32)  # the list was gathered in no order (collect_any)
            unordered[0] = 0
            row = T.cast(bx, T.int64)
            _row_bounds(lengths, starts, bx, width, bounds)
            start, lo, hi = bounds[0], bounds[1], bounds[2]
            req[0] = _request_of(bx, rows, row_request, n_req) if page else 0
            paging = (page_table, req[0], n_req, max_pages)
            this_row = _Row(logits, row, lo, hi, start, out, paging)
            if hi - lo <= k:
                parts.copy_row(this_row, hi - lo)
            else:
                if hi - lo <= cap:
                    parts.whole_row(this_row, hi - lo, shared)
                    top[0] = shared.state[DIGIT]
                    top[1] = shared.state[ABOVE]
                    top[2] = hi - lo
                else:
                    top[2] = cap + 1
                    if hi - lo <= BITMAP_COLS:
                        parts.guess_list(this_row, shared, top)
                        unordered[0] = 1
                    if top[2] > cap:
                        parts.two_reads(this_row, shared, top, unordered, found)
                T.sync_threads()  # state is read
                use_list[0] = T.Select(top[2] <= cap, 1, 0)
                parts.finish(use_list[0], top[2], top[0], top[1], this_row, shared, unordered)
                parts.pad(out, row)

    return select_rows


def _rows_entry(select_rows, key: TopkKey, dims: "_Dims"):
    """The prim_func of the one-CTA-per-row kernel with the arguments ``key`` asks for."""
    rows, width, ld, n_req, max_pages = dims.rows, dims.width, dims.ld, dims.requests, dims.max_pages
    page = key.page_size
    logits_t = T.StridedTensor((rows, width), (ld, 1), T.float32)
    vec_t, starts_t, request_t = _row_vectors(rows)
    table_t = T.Tensor((n_req, max_pages), T.int32)
    out_t = T.Tensor((rows, dims.out_width), T.int32)
    variant = (key.has_starts, bool(page), key.has_row_request)
    if variant == (False, False, False):

        @T.prim_func
        def topk_rows(logits: logits_t, lengths: vec_t, out: out_t):
            select_rows(logits, lengths, None, None, None, out)

    elif variant == (True, False, False):

        @T.prim_func
        def topk_rows(logits: logits_t, lengths: vec_t, starts: starts_t, out: out_t):
            select_rows(logits, lengths, starts, None, None, out)

    elif variant == (False, True, False):

        @T.prim_func
        def topk_rows(logits: logits_t, lengths: vec_t, page_table: table_t, out: out_t):
            select_rows(logits, lengths, None, page_table, None, out)

    elif variant == (True, True, False):

        @T.prim_func
        def topk_rows(logits: logits_t, lengths: vec_t, starts: starts_t, page_table: table_t, out: out_t):
            select_rows(logits, lengths, starts, page_table, None, out)

    elif variant == (False, True, True):

        @T.prim_func
        def topk_rows(logits: logits_t, lengths: vec_t, page_table: table_t, row_request: request_t, out: out_t):
            select_rows(logits, lengths, None, page_table, row_request, out)

    else:

        @T.prim_func
        def topk_rows(
            logits: logits_t, lengths: vec_t, starts: starts_t, page_table: table_t, row_request: request_t, out: out_t
        ):
            select_rows(logits, lengths, starts, page_table, row_request, out)

    return topk_rows


def _popc(word):
    """The set bits of a 32-bit word (``__popc``, on CUDA and HIP)."""
    return T.call_extern(T.int32, "__popc", T.reinterpret(word, T.uint32))


def _ffs(word):
    """One plus the index of the lowest set bit of a 32-bit word, 0 for none (``__ffs``, on CUDA and HIP)."""
    return T.call_extern(T.int32, "__ffs", T.reinterpret(word, T.int32))


@T.macro
def _fence():
    """A device-scope memory fence (``__threadfence``, on CUDA and HIP)."""
    T.call_extern("handle", "__threadfence")


@T.macro
def _ticket(tickets, r, state):
    """``state[TICKET]``: how many CTAs of row r took a ticket before this one, after this CTA's global writes are
    fenced. Ends at a barrier; the CTA whose ticket is C - 1 is the row's last."""
    tx = T.get_thread_binding()
    _fence()
    T.sync_threads()
    if tx == 0:
        _fence()
        state[TICKET] = T.atomic_add(tickets[r], 1, return_prev=True)
    T.sync_threads()


def build_topk_split(key: TopkSplitKey):
    """The split top-k kernel of ``key``: grid (C, R), ``key.threads`` threads; CTA (c, r) takes the columns
    ``[c * CH, (c + 1) * CH)`` of row r.

    Call: ``(logits, lengths, [starts,] [page_table,] [row_request,] tickets, cand, cand_count, out)``

    logits, lengths, starts, page_table, row_request, out : as :func:`build_topk_rows`
    tickets : [R] int32 scratch, all zero before the first call (e.g. ``torch.zeros`` when allocated); a call
        leaves it all zero again
    cand : [R, C, 2, CH] int32 scratch (any contents): each chunk's list entries, keys then columns
    cand_count : [R, C] int32 scratch (any contents)

    C (1 to ``key.threads``) and CH come from cand's shape and must cover the row: ``C * CH >= W``
    (:func:`split_chunk`). One call must not overlap another on the same scratch (another stream). Shared memory as
    :func:`build_topk_rows`, plus ``4 * threads`` bytes.
    """
    dims = _Dims()
    parts = _parts(key, dims.out_width)
    logits_t = T.StridedTensor((dims.rows, dims.width), (dims.ld, 1), T.float32)
    table_t = T.Tensor((dims.requests, dims.max_pages), T.int32)
    scratch = (
        T.Tensor((dims.rows,), T.int32),
        T.Tensor((dims.rows, dims.chunks, 2, dims.chunk), T.int32),
        T.Tensor((dims.rows, dims.chunks), T.int32),
    )
    out_t = T.Tensor((dims.rows, dims.out_width), T.int32)
    return _split_entry(_split_stage(key, parts, dims), key, logits_t, _row_vectors(dims.rows), table_t, scratch, out_t)


class _Dims:
    """The dynamic sizes of one program (each a TIR variable, shared by its buffers and its body)."""

    def __init__(self):
        self.rows, self.width, self.ld = T.dynamic("rows"), T.dynamic("width"), T.dynamic("ld")
        self.requests, self.max_pages = T.dynamic("requests"), T.dynamic("max_pages")
        self.chunks, self.chunk = T.dynamic("chunks"), T.dynamic("chunk")
        self.out_width = T.dynamic("out_width")


def _chunk_macro(dims):
    @T.macro
    def chunk_bounds(lo, hi, c, bounds):
        """``bounds[3:5]``: the candidates ``[lo, hi)`` that chunk c holds."""
        bounds[3] = T.cast(T.max(T.cast(lo, T.int64), T.cast(c, T.int64) * dims.chunk), T.int32)
        bounds[4] = T.cast(
            T.max(T.min(T.cast(hi, T.int64), (T.cast(c, T.int64) + 1) * dims.chunk), T.cast(bounds[3], T.int64)),
            T.int32,
        )

    return chunk_bounds


def _gather_macro(key: TopkSplitKey, parts: SimpleNamespace, dims: _Dims):
    threads, k, cap, chunks, chunk = key.threads, key.k, key.cap, dims.chunks, dims.chunk

    @T.macro
    def gather(cand, cand_count, r, top, shared):
        """``top[2]``: the chunks' entries of row r in all; where they are k to ``cap``, the list from them in chunk
        order (each thread finds the chunk of its entry by a binary search over the chunks' offsets). Ends at a
        barrier."""
        tx = T.get_thread_binding()
        mine = T.alloc_local((1,), T.int32)
        excl = T.alloc_local((1,), T.int32)
        total = T.alloc_local((1,), T.int32)
        c = T.alloc_local((1,), T.int32)
        mine[0] = 0
        if tx < chunks:
            mine[0] = T.atomic_load(cand_count[r, T.min(tx, chunks - 1)], memory_order="relaxed")
        parts.block_scan(mine, excl, total, shared.sums)
        shared.offs[tx] = excl[0]
        top[2] = total[0]
        T.sync_threads()
        if (top[2] >= k) & (top[2] <= cap):
            for it in T.serial(T.ceildiv(top[2], threads)):
                if it * threads + tx < top[2]:
                    c[0] = 0  # the last chunk whose entries start at or before this one (offsets never decrease)
                    for step in _lifts(threads):
                        if c[0] + step < chunks and shared.offs[T.min(c[0] + step, threads - 1)] <= it * threads + tx:
                            c[0] = c[0] + step
                    at = T.min(it * threads + tx - shared.offs[c[0]], chunk - 1)
                    shared.lkey[it * threads + tx] = T.reinterpret(
                        T.atomic_load(cand[r, c[0], 0, at], memory_order="relaxed"), T.uint32
                    )
                    shared.lcol[it * threads + tx] = T.atomic_load(cand[r, c[0], 1, at], memory_order="relaxed")
            T.sync_threads()

    return gather


def _split_stage(key: TopkSplitKey, parts: SimpleNamespace, dims: _Dims):
    """The body of the split kernel: each chunk's candidates at or above the guessed threshold into ``cand``; the
    row's last CTA gathers them and writes the row, or reads the row alone where the guess fails. Rows of at most
    ``cap`` candidates are done by chunk 0 alone."""
    k, cap, page, threads, chunks = key.k, key.cap, key.page_size, key.threads, dims.chunks
    chunk_bounds, gather = _chunk_macro(dims), _gather_macro(key, parts, dims)

    @T.macro
    def split_rows(logits, lengths, starts, page_table, row_request, tickets, cand, cand_count, out):
        with T.Kernel(chunks, dims.rows, threads=threads) as (bx, by):
            shared = parts.split_shared()
            bounds = T.alloc_local((5,), T.int32)
            top = T.alloc_local((3,), T.int32)  # the top digit, the keys above it, the list's length
            found = T.alloc_local((1,), T.int32)
            req = T.alloc_local((1,), T.int32)
            use_list = T.alloc_local((1,), T.int32)
            unordered = T.alloc_local((1,), T.int32)  # the list was gathered in no order (collect_any)
            finishes = T.alloc_local((1,), T.int32)  # this CTA writes the row's selection
            tx = T.get_thread_binding()
            row = T.cast(by, T.int64)
            _row_bounds(lengths, starts, by, dims.width, bounds)
            start, lo, hi = bounds[0], bounds[1], bounds[2]
            req[0] = _request_of(by, dims.rows, row_request, dims.requests) if page else 0
            paging = (page_table, req[0], dims.requests, dims.max_pages)
            this_row = _Row(logits, row, lo, hi, start, out, paging)
            finishes[0] = 0
            unordered[0] = 0
            if hi - lo <= k:
                if bx == 0:
                    parts.copy_row(this_row, hi - lo)
            elif hi - lo <= cap:
                if bx == 0:  # the row fits the list: chunk 0 selects it alone
                    parts.whole_row(this_row, hi - lo, shared)
                    top[0] = shared.state[DIGIT]
                    top[1] = shared.state[ABOVE]
                    top[2] = hi - lo
                    finishes[0] = 1
            else:
                parts.guess_digit(this_row, shared)  # (every CTA of the row: the same samples, the same guess)
                chunk_bounds(lo, hi, bx, bounds)
                found[0] = 0
                if bounds[4] > bounds[3]:
                    parts.collect(
                        logits,
                        row,
                        bounds[3],
                        bounds[4],
                        T.cast(shared.state[DIGIT], T.uint32) << FIRST_SHIFT,
                        None,
                        cand,
                        (by, bx),
                        dims.chunk,
                        shared.cnt,
                        found,
                    )
                if tx == 0:
                    cand_count[by, bx] = found[0]
                _ticket(tickets, by, shared.state)
                if shared.state[TICKET] == chunks - 1:  # the row's last CTA: every chunk's entries are written
                    _fence()
                    if tx == 0:
                        tickets[by] = 0
                    gather(cand, cand_count, by, top, shared)
                    parts.list_digit(shared, top)
                    if top[2] > cap:  # the guess failed: this CTA reads the row alone
                        parts.two_reads(this_row, shared, top, unordered, found)
                    finishes[0] = 1
            if finishes[0] != 0:
                T.sync_threads()  # state is read
                use_list[0] = T.Select(top[2] <= cap, 1, 0)
                parts.finish(use_list[0], top[2], top[0], top[1], this_row, shared, unordered)
                parts.pad(out, row)

    return split_rows


def _split_entry(split_rows, key, logits_t, vectors, table_t, scratch, out_t):
    """The prim_func of the split kernel with the arguments ``key`` asks for."""
    vec_t, starts_t, request_t = vectors
    tickets_t, cand_t, count_t = scratch
    variant = (key.has_starts, bool(key.page_size), key.has_row_request)
    if variant == (False, False, False):

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, None, None, None, tickets, cand, cand_count, out)

    elif variant == (True, False, False):

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            starts: starts_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, starts, None, None, tickets, cand, cand_count, out)

    elif variant == (False, True, False):

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            page_table: table_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, None, page_table, None, tickets, cand, cand_count, out)

    elif variant == (True, True, False):

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            starts: starts_t,
            page_table: table_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, starts, page_table, None, tickets, cand, cand_count, out)

    elif variant == (False, True, True):

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            page_table: table_t,
            row_request: request_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, None, page_table, row_request, tickets, cand, cand_count, out)

    else:

        @T.prim_func
        def topk_split(
            logits: logits_t,
            lengths: vec_t,
            starts: starts_t,
            page_table: table_t,
            row_request: request_t,
            tickets: tickets_t,
            cand: cand_t,
            cand_count: count_t,
            out: out_t,
        ):
            split_rows(logits, lengths, starts, page_table, row_request, tickets, cand, cand_count, out)

    return topk_split


def _row_vectors(rows) -> tuple:
    """The ``[R] int32`` types of ``lengths``, ``starts`` and ``row_request``: one per argument, since arguments
    annotated with one buffer type become one buffer (the kernel would read ``starts`` as ``lengths``)."""
    return tuple(T.Tensor((rows,), T.int32) for _ in range(3))


def _lifts(n: int) -> tuple[int, ...]:
    """The steps of a binary search over n entries by lifting: the powers of two below n, largest first."""
    return tuple(1 << b for b in reversed(range(max(n - 1, 1).bit_length())))
