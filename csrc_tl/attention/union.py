"""The union of a group of tokens' selections, which a grouped head block walks (``AttnGeometry.group``): the 64 rows
of the block are the heads of G consecutive tokens (8 tokens of 8 heads, 4 of 16, 2 of 32), so each row of the union
is gathered once for all of them, and each entry carries the bits of the tokens that select its row.

An entry of the union is ``row | bits << 24`` (:data:`~csrc_tl.attention.geometry.GROUP_ROW_BITS`): bit ``j`` of the
high byte set where token ``j`` of the group selects ``row``. Each distinct valid row appears once, with every
selecting token's bit, where no token of the group selects a row twice; a group where some token does (duplicates
count as often as they appear) lists every valid entry alone, with its token's bit, so that each counts once per
appearance as in the per-token kernels. The union lists its entries in the order of the selections they come from
(token by token, position by position), so results repeat bit for bit.

How: one CTA a group. Every valid entry sets its token's bit in a shared byte per pool row (``atomicOr``, which also
finds a token's duplicate); then each entry of the token of lowest bit of its row's byte emits the row, at its rank:
each warp takes a run of consecutive positions of every token, counts what it emits of each token's, and writes it
after the counts before it (of the tokens before, and of the warps before of the same token), a lane's place among
its warp's by a shuffle scan, so the union's reads and writes coalesce.

Shapes (G tokens a group, N groups, K top-k entries, S pool rows; all dynamic but G): ``indices [N * G, K] int32``
(any values: valid those in ``[0, S)`` before ``topk_length[t]``), ``topk_length [N * G] int32`` (with ``lengths``),
``slots`` (S, an int32 scalar; rows past the table are never valid), ``union [N, W] int32`` (``W >= G * K``; entries
at and past ``lengths[g]`` are not written), ``lengths [N] int32``.
"""

from dataclasses import dataclass

from .geometry import GROUP_ROW_BITS

UNION_THREADS = 512
# Pool rows of a CTA's shared byte table: 16 KB, where several CTAs share an SM, or 128 KB (the plan groups tokens over
# small pools; the larger table is for wide selections)
UNION_TABLES = (1 << 14, 1 << 17)
WARP = 32
SHUFFLE_DELTAS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class UnionKey:
    """The union kernel of groups of ``tokens`` tokens over pools of at most ``table`` rows (one of
    :data:`UNION_TABLES`); ``lengths``: it takes ``topk_length``."""

    tokens: int
    table: int
    lengths: bool = False

    family = "union"

    def __post_init__(self):
        assert 2 <= self.tokens <= 8, "a union of 2 to 8 tokens (a bit each in an entry's high byte)"
        assert self.table in UNION_TABLES, f"a table of one of {UNION_TABLES} rows"

    @property
    def name(self) -> str:
        return f"attn_union_g{self.tokens}_t{self.table}" + ("_len" if self.lengths else "")

    def __str__(self) -> str:
        return self.name


def union_table(slots: int) -> int | None:
    """The table of a pool of ``slots`` rows: the smallest of :data:`UNION_TABLES` that holds them (None: none)."""
    return next((t for t in UNION_TABLES if slots <= t), None)


def _warp_scan():
    """The macro ``warp_scan(flag, incl, tmp)``: ``incl[0]``, the sum of ``flag`` over this lane and the lanes below
    it in its warp (shuffles: portable to 64-wide wavefronts, which shuffle in groups of 32)."""
    import tilelang.language as T

    @T.macro
    def warp_scan(flag, incl, tmp):
        lane = T.get_thread_binding() % WARP
        incl[0] = flag
        for delta in SHUFFLE_DELTAS:
            tmp[0] = T.shfl_up(incl[0], delta, WARP)
            if lane >= delta:
                incl[0] = incl[0] + tmp[0]

    return warp_scan


def build_union(key: UnionKey):
    """The TileLang program of ``key``: ``union(indices, [topk_length,] slots, union, lengths)`` (see the module)."""
    import tilelang.language as T  # here, so that planning a launch imports neither TileLang nor torch

    group, threads, words = key.tokens, UNION_THREADS, key.table // 4
    warps = threads // WARP
    warp_scan = _warp_scan()
    t_count, k_count, n_groups, width = T.dynamic("t"), T.dynamic("k"), T.dynamic("n"), T.dynamic("w")

    @T.macro
    def entry(indices, topk_length, slots, g, j, pos, x, ok):
        """``x[0]``: the index at ``pos`` of token ``j`` of group ``g`` (``pos`` past the row: -1), ``ok[0]`` whether
        it is valid."""
        tok = g * group + j
        x[0] = -1
        if pos < k_count:
            x[0] = indices[tok, pos]
        cut = topk_length[tok] if key.lengths else k_count
        ok[0] = T.if_then_else((pos < cut) & (x[0] >= 0) & (x[0] < T.min(slots, key.table)), 1, 0)

    @T.macro
    def emitted(indices, topk_length, slots, table, dup, g, j, pos, x, ok, value):
        """``value[0]``: what the entry at ``pos`` of token ``j`` of group ``g`` adds to the union once every entry has
        set its bit in ``table``: ``row | bits << 24``, or 0 where it adds nothing (invalid, or not the entry of the
        row's lowest token); in a group with a duplicate (``dup``) every valid entry, with its own token's bit."""
        entry(indices, topk_length, slots, g, j, pos, x, ok)
        row = T.if_then_else(ok[0] != 0, x[0], 0)
        bits = T.bitwise_and(T.shift_right(table[row // 4], (row % 4) * 8), 0xFF)
        first = T.bitwise_and(bits, T.shift_left(T.int32(1), j) - 1) == 0
        mine = T.if_then_else(dup[0] != 0, T.shift_left(T.int32(1), j), bits)
        value[0] = T.if_then_else(
            ok[0] != 0 and (dup[0] != 0 or first), T.bitwise_or(x[0], T.shift_left(mine, GROUP_ROW_BITS)), 0
        )

    @T.macro
    def body(indices, topk_length, slots, union, lengths):
        with T.Kernel(n_groups, threads=threads) as g:
            table = T.alloc_shared((words,), T.int32)  # a byte per pool row: the bits of the tokens that select it
            counts = T.alloc_shared((group * warps,), T.int32)  # entries a warp adds of a token's, token-major
            bases = T.alloc_shared((group * warps,), T.int32)  # where they go: the counts before them
            dup = T.alloc_shared((1,), T.int32)
            x = T.alloc_local((1,), T.int32)
            ok = T.alloc_local((1,), T.int32)
            old = T.alloc_local((1,), T.int32)
            value = T.alloc_local((1,), T.int32)
            incl = T.alloc_local((1,), T.int32)
            at = T.alloc_local((1,), T.int32)
            tmp = T.alloc_local((1,), T.int32)
            tx = T.get_thread_binding()
            lane, warp = tx % WARP, tx // WARP
            # each warp a run of consecutive positions of every token, a lane a position of each step: the reads and
            # the union's writes coalesce, and the union lists the entries it keeps in their order
            steps = T.ceildiv(k_count, threads)
            run = warp * steps * WARP + lane
            for i in T.serial(words // threads):
                table[i * threads + tx] = 0
            if tx == 0:
                dup[0] = 0
            T.sync_threads()
            for j, s in T.grid(group, steps):
                entry(indices, topk_length, slots, g, j, run + s * WARP, x, ok)
                if ok[0] != 0:
                    bit = T.shift_left(T.int32(1), (x[0] % 4) * 8 + j)
                    # (atomicOr itself: TileLang's AtomicOr is a global-memory reduction)
                    old[0] = T.call_extern(T.int32, "atomicOr", T.address_of(table[x[0] // 4]), bit)
                    if T.bitwise_and(old[0], bit) != 0:  # the token selected this row before
                        dup[0] = 1
            T.sync_threads()
            for j in T.serial(group):
                at[0] = 0
                for s in T.serial(steps):
                    emitted(indices, topk_length, slots, table, dup, g, j, run + s * WARP, x, ok, value)
                    at[0] = at[0] + T.if_then_else(value[0] != 0, 1, 0)
                for delta in SHUFFLE_DELTAS:  # the warp's count, in every lane
                    at[0] = at[0] + T.shfl_xor(at[0], delta, WARP)
                if lane == 0:
                    counts[j * warps + warp] = at[0]
            T.sync_threads()
            if tx < group * warps:
                at[0] = 0
                for u in T.serial(group * warps):
                    at[0] = at[0] + T.if_then_else(u < tx, counts[u], 0)
                bases[tx] = at[0]
                if tx == group * warps - 1:
                    lengths[g] = at[0] + counts[tx]
            T.sync_threads()
            for j in T.serial(group):  # the same entries again, each at its rank
                at[0] = bases[j * warps + warp]
                for s in T.serial(steps):
                    emitted(indices, topk_length, slots, table, dup, g, j, run + s * WARP, x, ok, value)
                    warp_scan(T.if_then_else(value[0] != 0, 1, 0), incl, tmp)
                    if value[0] != 0:
                        union[g, at[0] + incl[0] - 1] = value[0]
                    at[0] = at[0] + T.shfl_sync(incl[0], WARP - 1, WARP)

    idx_t, len_t = T.Tensor((t_count, k_count), T.int32), T.Tensor((t_count,), T.int32)
    union_t, lengths_t = T.Tensor((n_groups, width), T.int32), T.Tensor((n_groups,), T.int32)
    if key.lengths:

        @T.prim_func
        def union(indices: idx_t, topk_length: len_t, slots: T.int32, union: union_t, lengths: lengths_t):
            body(indices, topk_length, slots, union, lengths)

        return union

    @T.prim_func
    def union(indices: idx_t, slots: T.int32, union: union_t, lengths: lengths_t):
        body(indices, None, slots, union, lengths)

    return union
