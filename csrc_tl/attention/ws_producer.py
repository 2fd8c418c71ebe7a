"""The producer warpgroups of a warp-specialized kernel: macros that gather the top-k rows of each block into the
stages, one scheme per plan (:class:`csrc_tl.attention.plan.WsPlan`): bf16 rows by cp.async into whole stages or
stage halves, FP8 rows staged raw and widened shared-to-shared (cp.async or TMA bulk copies), or widened in place
(packed rows of the transposed prefill at few heads: through registers, ``direct``)."""

from types import SimpleNamespace

import tilelang.language as T

from ..layout import QUANT_TILE
from .geometry import GROUP_ROW_BITS as ROW_BITS
from .plan import WS_INPLACE_AHEAD, WS_THREADS_PER_ROW, WsPlan, ws_inplace_raw_col, ws_row_lane

ROW_MASK = (1 << ROW_BITS) - 1  # the row of a grouped block's entry
TOKEN_MASK = 0xFF  # ... and the bits of its tokens, above it


def _lane_macros(plan: WsPlan, dims) -> SimpleNamespace:
    """What every producer scheme uses: the row and lane of a producer thread, index loads, validity, cp.async
    and widening calls."""
    half, packed, row_w, vec, chunks = plan.half, plan.packed, plan.row_w, plan.vec, plan.chunks
    quarters, persist, rows_per_pass, block_p = plan.quarters, plan.persist, plan.rows_per_pass, plan.block_p
    passes, group = plan.passes, plan.geo.group
    dtype = T.bfloat16
    _, s_count, k_count, _ = dims

    def prow(tx):
        return ws_row_lane(tx, quarters)[0]

    def plane(tx):
        return ws_row_lane(tx, quarters)[1]

    def row_views(kv):
        """The FP8 values, float32 scales and bf16 tails of packed rows ``kv``."""
        return (
            T.view(kv, (s_count, row_w), T.float8_e4m3fn),
            T.view(kv, (s_count, row_w // 4), T.float32),
            T.view(kv, (s_count, row_w // 2), dtype),
        )

    def entry_ok(blk, j, stop, raw):
        """Whether entry ``j`` of producer block ``blk`` (``block_p`` rows), raw index ``raw``, is valid:
        before ``stop`` and a row of the pool (in a grouped block, an entry of the union: its row in the low 24 bits,
        some token's bit in the high 8)."""
        if group:
            return (blk * block_p + j < stop) & (entry_tokens(raw) != 0) & (entry_row(raw) < s_count)
        return (blk * block_p + j < stop) & (raw >= 0) & (raw < s_count)

    def entry_row(raw):
        """The pool row of raw index ``raw`` (of a valid entry)."""
        return T.bitwise_and(raw, ROW_MASK) if group else raw

    def entry_tokens(raw):
        """The flag a valid entry ``raw`` leaves for the consumers: 1, or in a grouped block the bits of the tokens
        that select its row."""
        return T.bitwise_and(T.shift_right(raw, ROW_BITS), TOKEN_MASK) if group else 1

    @T.macro
    def load_index(indices, t, blk, slot, base=256, mine=None):
        """``slot[p]``: the raw index of this thread's row in pass ``p`` of producer block ``blk`` (clamped
        into the row, unchecked). Nothing here reads the loaded values, so the loads stay in flight
        until :func:`issue_raw` checks them, a block later. With ``mine`` (passes of the block), ``slot[k]``
        is that of pass ``mine[k]``; ``base`` is the first thread of the warpgroup that loads.

        A persistent kernel loads through ``dsa_ld_index`` at an offset it computes (``t`` is a token TileLang cannot
        bound there, and it wrapped each load in a bounds check of its own)."""
        tx = T.get_thread_binding() - base
        if persist:
            for k in tuple(range(passes if mine is None else len(mine))):
                pos = T.min(blk * block_p + (k if mine is None else mine[k]) * rows_per_pass + prow(tx), k_count - 1)
                slot[k] = T.call_extern(
                    "int32", "dsa_ld_index", T.address_of(indices[0, 0]), T.cast(t, "int64") * k_count + pos
                )
        elif mine is None:
            for p in T.unroll(passes):
                pos = blk * block_p + p * rows_per_pass + prow(tx)
                slot[p] = indices[t, T.min(pos, k_count - 1)]
        else:
            for k in tuple(range(len(mine))):
                pos = blk * block_p + mine[k] * rows_per_pass + prow(tx)
                slot[k] = indices[t, T.min(pos, k_count - 1)]

    def cp_async(dst, src, nbytes, pred):
        """cp.async of ``nbytes`` from ``src`` to ``dst`` (zeros where ``pred`` is false), out of sight of
        TileLang's barrier planner (``T.address_of``; the in-place producer, see there). The whole-stage
        bf16 and the staged producers keep ``T.ptx_cp_async`` and the barriers TileLang adds: through
        this helper they ran no faster (a little slower, if anything). The halves producer (``fill_half``) uses
        it: TileLang put four producer-wide barriers in every half there."""
        return T.call_extern("handle", f"dsa_cp_async<{nbytes}>", T.address_of(dst), T.address_of(src), pred)

    def widen(raw_v, dst_l, dst_r, sc, p, j, lane, off=0):
        """The call that widens this thread's chunks of row ``j`` (pass ``p``) into ``dst_l`` / ``dst_r``,
        from the raw stage ``raw_v`` or, if it is None, in place (raw values at :func:`ws_inplace_raw_col`,
        widened after a warp sync); ``sc[p, :]`` the row's tile scales (packed rows). Chunk ``c`` of a half
        lies in tile ``c`` of that half. The addresses are taken with ``T.address_of``: TileLang would
        separate accesses it sees through ``T.access_ptr`` by a barrier among the producer threads between
        every two chunks, though each thread reads only bytes it copied itself."""
        args = []
        for c in range(chunks // 2):
            col = (c * WS_THREADS_PER_ROW + lane) * vec
            for dst, base, tile in ((dst_l, 0, c), (dst_r, half, half // QUANT_TILE + c)):
                raw = T.address_of(dst[j, ws_inplace_raw_col(c, lane)] if raw_v is None else raw_v[j, base + col])
                args += [
                    raw,
                    T.address_of(dst[off + j, col]),
                    T.address_of(dst[off + j, col + 8]),
                    sc[p, tile] if packed else 1.0,
                ]
        flags = f"{'true' if packed else 'false'}, {'false' if raw_v is not None else 'true'}"  # kScaled, kSync
        return T.call_extern("handle", f"dsa_widen<{flags}>", *args)

    def widen_bulk(raw, dst, row, col, scale):
        """The call that widens the 16 FP8 values at ``raw`` (8-byte aligned), times ``scale``, into columns
        ``[col, col + 16)`` of ``dst``'s row ``row`` (``bulk``)."""
        return T.call_extern(
            "handle",
            "dsa_widen_bulk",
            T.address_of(raw),
            T.address_of(dst[row, col]),
            T.address_of(dst[row, col + 8]),
            scale,
        )

    return SimpleNamespace(
        prow=prow,
        plane=plane,
        row_views=row_views,
        entry_ok=entry_ok,
        entry_row=entry_row,
        entry_tokens=entry_tokens,
        load_index=load_index,
        cp_async=cp_async,
        widen=widen,
        widen_bulk=widen_bulk,
    )


def _bf16_macros(plan: WsPlan, lanes: SimpleNamespace) -> SimpleNamespace:
    """The producers of bf16 rows (``copies_async``): whole stages (``bf16``) or stage halves (``halves``)."""
    geo, split, half, vec, chunks = plan.geo, plan.split, plan.half, plan.vec, plan.chunks
    tail_chunks, rows_per_pass, passes = plan.tail_chunks, plan.rows_per_pass, plan.passes
    d_v, d_tail = geo.d_v, geo.d_rope
    prow, plane, entry_ok, load_index = lanes.prow, lanes.plane, lanes.entry_ok, lanes.load_index
    cp_async, entry_row, entry_tokens = lanes.cp_async, lanes.entry_row, lanes.entry_tokens

    @T.macro
    def produce(kv, indices, t, blk, stop, nxt, slot, dst_l, dst_r, dst_t, ok_s, ready, free, phase):
        """Gather top-k block ``blk`` of bf16 rows into a stage by cp.async; its raw indices ``nxt`` were
        loaded one block earlier, and this loads those of ``blk + 1`` into ``nxt`` (in flight while it
        gathers)."""
        T.barrier_wait(free, phase ^ 1)
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        # all slot ids of the stage first, then every row copy (branch-free, predicated: invalid rows
        # become zeros and are never dereferenced), so the copies of a stage are all in flight at once
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            ok = entry_ok(blk, j, stop, nxt[p])
            slot[p] = T.if_then_else(ok, entry_row(nxt[p]), -1)
            ok_s[j] = T.if_then_else(ok, entry_tokens(nxt[p]), 0)
        load_index(indices, t, blk + 1, nxt)
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            ok = slot[p] >= 0
            row = T.max(slot[p], 0)
            # cp.async straight into shared memory: the whole stage is in flight without registers
            for c in T.unroll(chunks // 2):
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                T.ptx_cp_async(
                    T.access_ptr(dst_l[j, col], "w", vec), T.access_ptr(kv[row, col], "r", vec), vec, predicate=ok
                )
                T.ptx_cp_async(
                    T.access_ptr(dst_r[j, col], "w", vec),
                    T.access_ptr(kv[row, half + col], "r", vec),
                    vec,
                    predicate=ok,
                )
            if d_tail:
                for c in T.unroll(tail_chunks):
                    col = (c * WS_THREADS_PER_ROW + lane) * 8
                    T.ptx_cp_async(
                        T.access_ptr(dst_t[j, col], "w", 8), T.access_ptr(kv[row, d_v + col], "r", 8), 8, predicate=ok
                    )
        T.fence_proxy_async()
        T.barrier_arrive(ready)
        # a second arrival per thread once its cp.async copies have landed; no wait here, so TileLang
        # inserts no warpgroup sync into the producer (a named barrier id it would share with the
        # first consumer warpgroup: a deadlock)
        T.cp_async_barrier_noinc(ready)

    @T.macro
    def fill_half(kv, blk, stop, raw, base, dst, dst_t, ok_s, ready, free, phase):
        """Halves (see ``halves``): once its readers have freed it, gather value columns ``[base, base +
        half)`` (and the tail into ``dst_t``, where given) of this thread's rows of top-k block ``blk``
        (raw indices ``raw``) into a stage half by cp.async, predicated as in :func:`produce`; the rows'
        valid flags go to ``ok_s`` where given."""
        T.barrier_wait(free, phase ^ 1)
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            ok = entry_ok(blk, j, stop, raw[p])
            row = T.if_then_else(ok, entry_row(raw[p]), 0)
            if ok_s is not None:
                T.call_extern(
                    "handle", "dsa_put_flag", T.address_of(ok_s[j]), T.if_then_else(ok, entry_tokens(raw[p]), 0)
                )
            for c in T.unroll(chunks // 2):
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                cp_async(dst[j, col], kv[row, base + col], 16, ok)
            if dst_t is not None:
                for c in T.unroll(tail_chunks):
                    col = (c * WS_THREADS_PER_ROW + lane) * 8
                    cp_async(dst_t[j, col], kv[row, d_v + col], 16, ok)
        T.fence_proxy_async()
        T.barrier_arrive(ready)
        T.cp_async_barrier_noinc(ready)  # (see produce)

    @T.macro
    def produce_halves_wg(c):
        """The producer warpgroup of the halves scheme (``halves``): the four stage halves of each pair."""
        # the halves of a pair in the order the consumers free them (FlashMLA's): stage 0's
        # left half, stage 1's right, stage 0's right, stage 1's left. The indices of the
        # next pair are loaded as a pair starts (loaded after a block's last half, they
        # left the producer waiting for them: ncu)
        cur_a = T.alloc_local((passes,), T.int32)  # raw indices of stage 0's block
        cur_b = T.alloc_local((passes,), T.int32)  # ... of stage 1's
        nxt_a = T.alloc_local((passes,), T.int32)  # ... of the next pair's
        nxt_b = T.alloc_local((passes,), T.int32)
        load_index(c.indices, c.t, c.first, cur_a)
        load_index(c.indices, c.t, c.first + 1, cur_b)
        for pair in T.serial(c.pairs):
            blk, phase = c.first + 2 * pair, pair & 1
            load_index(c.indices, c.t, blk + 2, nxt_a)
            load_index(c.indices, c.t, blk + 3, nxt_b)
            fill_half(c.kv, blk, c.stop, cur_a, 0, c.kv_l0, None, c.ok0, c.ready_l0, c.free_l0, phase)
            fill_half(c.kv, blk + 1, c.stop, cur_b, half, c.kv_r1, c.kt_s1, c.ok1, c.ready_r1, c.free_r1, phase)
            fill_half(c.kv, blk, c.stop, cur_a, half, c.kv_r0, c.kt_s0, None, c.ready_r0, c.free_r0, phase)
            fill_half(c.kv, blk + 1, c.stop, cur_b, 0, c.kv_l1, None, None, c.ready_l1, c.free_l1, phase)
            for p in T.unroll(passes):
                cur_a[p] = nxt_a[p]
                cur_b[p] = nxt_b[p]

    @T.macro
    def produce_bf16_wg(c):
        """The producer warpgroup of whole bf16 stages (``copies_async``): each pair's blocks by cp.async."""
        nxt = T.alloc_local((passes,), T.int32)
        slot = T.alloc_local((passes,), T.int32)
        load_index(c.indices, c.t, c.first, nxt)
        for pair in T.serial(c.pairs):
            produce(
                c.kv,
                c.indices,
                c.t,
                c.first + 2 * pair,
                c.stop,
                nxt,
                slot,
                c.kv_l0,
                c.kv_r0,
                c.kt_s0,
                c.ok0,
                c.ready0,
                c.free0,
                pair & 1,
            )
            if not split or 2 * pair + 1 < c.n_blk:  # (a split kernel walks no padding block)
                produce(
                    c.kv,
                    c.indices,
                    c.t,
                    c.first + 2 * pair + 1,
                    c.stop,
                    nxt,
                    slot,
                    c.kv_l1,
                    c.kv_r1,
                    c.kt_s1,
                    c.ok1,
                    c.ready1,
                    c.free1,
                    pair & 1,
                )

    return SimpleNamespace(
        produce=produce, fill_half=fill_half, produce_halves_wg=produce_halves_wg, produce_bf16_wg=produce_bf16_wg
    )


def _raw_macros(plan: WsPlan, dims, lanes: SimpleNamespace) -> SimpleNamespace:
    """The raw copies of the staged scheme: TMA bulk copies (``bulk``) or cp.async pieces."""
    geo, half, packed, row_w, scale_word = plan.geo, plan.half, plan.packed, plan.row_w, plan.scale_word
    rope_half, vec, chunks, tail_chunks, n_tiles = plan.rope_half, plan.vec, plan.chunks, plan.tail_chunks, plan.n_tiles
    piece, tail_piece, quarters, bulk = plan.piece, plan.tail_piece, plan.quarters, plan.bulk
    rows_per_pass, passes = plan.rows_per_pass, plan.passes
    d_v, d_tail = geo.d_v, geo.d_rope
    prow, plane, row_views, entry_ok = lanes.prow, lanes.plane, lanes.row_views, lanes.entry_ok

    @T.macro
    def issue_bulk(kv, slot, blk, stop, ok, raw_v, raw_sc, landed):
        """``bulk``: the rows of top-k block ``blk`` (raw indices in ``slot``) into a raw stage, one bulk copy
        per row issued by its first lane, landing on ``landed``; each lane zeros its chunks of an invalid
        row. ``ok[p]``: 0 if this thread's row of pass ``p`` is invalid, else 1 plus 1 where its values lie 8
        bytes into the slot; ``raw_sc[p, :]`` its scales (registers, 0 for an invalid row)."""
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        scales = row_views(kv)[1]
        T.call_extern("handle", "dsa_bulk_reuse")
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            valid = entry_ok(blk, j, stop, slot[p])
            row = T.if_then_else(valid, slot[p], 0)
            ok[p] = T.call_extern(
                "int32",
                f"dsa_bulk_row<{d_v}, {row_w}>",
                T.address_of(raw_v[j, 0]),
                T.address_of(kv[0, 0]),
                row,
                T.address_of(landed[0]),
                lane == 0,
                valid,
            )
            for c in T.unroll(chunks // 2):
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                T.call_extern("handle", "dsa_zero16", T.address_of(raw_v[j, col]), valid)
                T.call_extern("handle", "dsa_zero16", T.address_of(raw_v[j, half + col]), valid)
            for i in range(n_tiles):
                raw_sc[p, i] = T.if_then_else(valid, scales[row, scale_word + i], 0.0)

    @T.macro
    def issue_cp_async(kv, slot, blk, stop, ok, raw_v, raw_t, raw_sc):
        """cp.async of the bytes this thread will widen for top-k block ``blk`` (its chunks of its rows;
        raw indices in ``slot``) into a raw stage, zeros for invalid entries; ``ok[p]`` whether its row
        of pass ``p`` is valid and, for a packed row, ``raw_sc[p, :]`` its scales (registers). One
        commit group, also when every entry is invalid (the waits count groups)."""
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        if packed:
            values, scales, tails = row_views(kv)
        # copies of 8 bytes are served per sixteen threads (two rows, whose lanes use the same banks):
        # with `quarters`, rows of odd index copy the two pieces of a chunk in the other order, so that
        # they take one wavefront, not two (ncu: LDGSTS.64 at 2.3 times their ideal wavefronts before)
        odd = prow(tx) % 2
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            ok[p] = T.if_then_else(entry_ok(blk, j, stop, slot[p]), 1, 0)
            row = T.if_then_else(ok[p] != 0, slot[p], 0)
            for c in T.unroll(chunks // 2):
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                for k in T.unroll(vec // piece):
                    at = col + (k ^ odd) * piece if quarters and piece < vec else col + k * piece
                    for base in (0, half):
                        src = values[row, base + at] if packed else kv[row, base + at]
                        T.ptx_cp_async(
                            T.access_ptr(raw_v[j, base + at], "w", piece),
                            T.access_ptr(src, "r", piece),
                            piece,
                            predicate=ok[p] != 0,
                        )
            if packed:
                # the row's scales into registers (eight lanes of a row read the same 8 bytes: one
                # request; copied to shared memory per lane they cost 8-way bank conflicts), one scalar load
                # each: in this staged producer one vector load of them (the in-place producer's) was slower
                for i in range(n_tiles):
                    raw_sc[p, i] = T.if_then_else(ok[p] != 0, scales[row, scale_word + i], 0.0)
            if d_tail:
                for c in T.unroll(tail_chunks):
                    for k in T.unroll(8 // tail_piece):
                        kk = (k ^ odd) if quarters and tail_piece < 8 else k
                        col = (c * WS_THREADS_PER_ROW + lane) * 8 + kk * tail_piece
                        src = tails[row, rope_half + col] if packed else kv[row, d_v + col]
                        T.ptx_cp_async(
                            T.access_ptr(raw_t[j, col], "w", tail_piece),
                            T.access_ptr(src, "r", tail_piece),
                            tail_piece,
                            predicate=ok[p] != 0,
                        )
        T.ptx_commit_group()

    @T.macro
    def issue_raw(kv, slot, blk, stop, ok, raw_v, raw_t, raw_sc, landed):
        """Start the copy of top-k block ``blk`` into a raw stage: :func:`issue_bulk` or
        :func:`issue_cp_async`."""
        if bulk:
            issue_bulk(kv, slot, blk, stop, ok, raw_v, raw_sc, landed)
        else:
            issue_cp_async(kv, slot, blk, stop, ok, raw_v, raw_t, raw_sc)

    return SimpleNamespace(issue_bulk=issue_bulk, issue_cp_async=issue_cp_async, issue_raw=issue_raw)


def _staged_macros(plan: WsPlan, lanes: SimpleNamespace, raw: SimpleNamespace) -> SimpleNamespace:
    """The staged scheme (``staged``): one producer block's raw copy started, the one before widened."""
    geo, half, packed, vec, chunks = plan.geo, plan.half, plan.packed, plan.vec, plan.chunks
    tail_chunks, bulk, rows_per_pass, block_p = plan.tail_chunks, plan.bulk, plan.rows_per_pass, plan.block_p
    subs, passes = plan.subs, plan.passes
    d_tail = geo.d_rope
    dtype, acc = T.bfloat16, T.float32
    prow, plane, load_index, widen = lanes.prow, lanes.plane, lanes.load_index, lanes.widen
    widen_bulk = lanes.widen_bulk
    issue_raw = raw.issue_raw

    @T.macro
    def set_after(after, b, nb, t, stop, nx):
        """Persistent kernels: ``after`` (registers) of :func:`produce_staged` for producer block ``b`` of a work item
        of ``nb`` producer blocks (token ``t``, end ``stop``; the next item's token and end in ``nx``): the next
        producer block and its end, and the token and producer block after that."""
        after[0] = T.if_then_else(b + 1 < nb, b + 1, b + 1 - nb)
        after[1] = T.if_then_else(b + 1 < nb, stop, nx[1])
        after[2] = T.if_then_else(b + 2 < nb, t, nx[0])
        after[3] = T.if_then_else(b + 2 < nb, b + 2, b + 2 - nb)

    @T.macro
    def widen_raw(ok, raw_v, raw_t, raw_sc, landed, dst_l, dst_r, dst_t, ok_s, off):
        """Widen this thread's bytes of a raw stage into rows ``[off, off + block_p)`` of the bf16 stage
        (zeros stay zeros)."""
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        # The rows of a packed pool widen through TileLang's per-chunk casts, native FP8 rows through `widen`:
        # each the faster of the two for its rows (the casts fold a packed row's scale into the conversion).
        if not packed:
            for p in T.unroll(passes):
                j = p * rows_per_pass + prow(tx)
                widen(raw_v, dst_l, dst_r, raw_sc, p, j, lane, off)
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            if not bulk:
                ok_s[off + j] = ok[p]
            if packed and bulk:
                # the row's values lie 8 bytes into its slot where ok is 2 (8-byte loads). Flag and widening
                # through T.address_of: TileLang put two producer-wide barriers in every pass around them
                T.call_extern("handle", "dsa_put_flag", T.address_of(ok_s[off + j]), ok[p])
                at = ok[p] // 2 * 8
                for c in T.unroll(chunks // 2):  # a thread's chunk c of each half lies in tile c of that half
                    col = (c * WS_THREADS_PER_ROW + lane) * vec
                    widen_bulk(raw_v[j, at + col], dst_l, off + j, col, raw_sc[p, c])
                    widen_bulk(raw_v[j, at + half + col], dst_r, off + j, col, raw_sc[p, half // QUANT_TILE + c])
            elif packed:
                for c in T.unroll(chunks // 2):  # a thread's chunk c of each half lies in tile c of that half
                    col = (c * WS_THREADS_PER_ROW + lane) * vec
                    sc_l = raw_sc[p, c]
                    sc_r = raw_sc[p, half // QUANT_TILE + c]
                    for v in T.vectorized(vec):
                        dst_l[off + j, col + v] = T.cast(T.cast(raw_v[j, col + v], acc) * sc_l, dtype)
                    for v in T.vectorized(vec):
                        dst_r[off + j, col + v] = T.cast(T.cast(raw_v[j, half + col + v], acc) * sc_r, dtype)
            if d_tail:
                for c in T.unroll(tail_chunks):
                    col = (c * WS_THREADS_PER_ROW + lane) * 8
                    for v in T.vectorized(8):
                        dst_t[off + j, col + v] = T.cast(raw_t[j, col + v], dtype)

    @T.macro
    def produce_staged(
        kv,
        indices,
        t,
        blk,
        stop,
        nxt,
        ok_now,
        ok_next,
        raw_next,
        raw_now,
        dst_l,
        dst_r,
        dst_t,
        ok_s,
        ready,
        free,
        phase,
        sub,
        landed_phase,
        after=None,
    ):
        """One producer block (``block_p`` rows) of the staged producer: start the raw copy of block
        ``blk + 1`` (its indices ``nxt`` were loaded one block earlier) and the index loads of ``blk + 2``,
        then widen block ``blk``, whose raw copy was started one block earlier, into part ``sub`` of
        its stage (rows ``sub * block_p`` on): the first part waits for the stage to be free, the last
        one marks it ready. A persistent kernel passes ``after = (blk1, stop1, t2, blk2)``: the two
        producer blocks after this one, which may be the next work item's (see ``persist``)."""
        blk1, stop1, t2, blk2 = (blk + 1, stop, t, blk + 2) if after is None else after
        issue_raw(kv, nxt, blk1, stop1, ok_next, *raw_next)
        load_index(indices, t2, blk2, nxt)
        if bulk:
            T.barrier_wait(raw_now[3], landed_phase)  # the bulk copies of block blk have landed
        else:
            # this thread's copies of block blk have landed (its own bytes only, so no barrier; and
            # T.ptx_wait_group would add a block-wide one)
            T.call_extern("handle", "tl::cp_async_wait<1>")
        if sub == 0:
            T.barrier_wait(free, phase ^ 1)
        widen_raw(ok_now, *raw_now, dst_l, dst_r, dst_t, ok_s, sub * block_p)
        if sub == subs - 1:
            T.fence_proxy_async()
            T.barrier_arrive(ready)

    return SimpleNamespace(set_after=set_after, widen_raw=widen_raw, produce_staged=produce_staged)


def _staged_wg_macros(
    plan: WsPlan, lanes: SimpleNamespace, raw: SimpleNamespace, staged: SimpleNamespace, items: SimpleNamespace
) -> SimpleNamespace:
    """The producer warpgroups of the staged scheme over every work item of the CTA."""
    split, packed, n_tiles, bulk, persist = plan.split, plan.packed, plan.n_tiles, plan.bulk, plan.persist
    subs, passes = plan.subs, plan.passes
    acc = T.float32
    load_index = lanes.load_index
    issue_raw = raw.issue_raw
    set_after, produce_staged = staged.set_after, staged.produce_staged
    work, next_token, next_stop, work_items = items.work, items.next_token, items.next_stop, items.work_items
    pair_phase = items.pair_phase

    @T.macro
    def produce_staged_wg(c):
        """The producer warpgroups of the staged scheme (``staged``): raw copies one producer block ahead, widened
        shared-to-shared, over every work item of the CTA."""
        nxt = T.alloc_local((passes,), T.int32)
        ok_a = T.alloc_local((passes,), T.int32)  # valid rows of the block in raw0
        ok_b = T.alloc_local((passes,), T.int32)  # ... in raw1
        # the packed rows' scales of the blocks in raw0 and raw1
        raw_a = (*c.raw0[:2], T.alloc_local((passes, n_tiles), acc) if packed else None, c.raw0[2])
        raw_b = (*c.raw1[:2], T.alloc_local((passes, n_tiles), acc) if packed else None, c.raw1[2])
        # the indices of the first two blocks are loaded together: the first block's raw
        # copy waits for its own, and the second's (issued before the first is widened)
        # then has its indices at hand instead of a load round trip later
        nxt2 = T.alloc_local((passes,), T.int32)
        # (producer blocks: `subs` per stage; their raw stages alternate, raw0 first in a pair)
        t_0, h0_0, first_0, stop_0, n_blk_0, pairs_0, walk_0 = work(
            c.bx, c.by, 0, c.topk_length, c.t, c.h0, c.first, c.stop, c.n_blk, c.pairs, c.walk
        )
        load_index(c.indices, t_0, first_0 * subs, nxt)
        load_index(c.indices, t_0, first_0 * subs + 1, nxt2)
        issue_raw(c.kv, nxt, first_0 * subs, stop_0, ok_a, *raw_a)
        for p in T.unroll(passes):
            nxt[p] = nxt2[p]
        parts = ((ok_a, ok_b, raw_b, raw_a), (ok_b, ok_a, raw_a, raw_b))  # (now, next) by parity
        base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
        if persist:
            base[0] = 0
        # (persistent) the next work item's token and end, and the two producer blocks after the current one
        nx = T.alloc_local((2,), T.int32) if persist else None
        after = T.alloc_local((4,), T.int32) if persist else None
        for i in work_items(c.n_items):
            t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                c.bx, c.by, i, c.topk_length, c.t, c.h0, c.first, c.stop, c.n_blk, c.pairs, c.walk
            )
            if persist:
                nx[0] = next_token(c.bx, i, t_i)
                nx[1] = next_stop(c.bx, i, nx[0], c.topk_length)
            for pair in T.serial(pairs_i):
                blk = (first_i + 2 * pair) * subs
                phase = pair_phase(base, pair)
                # producer block k of the CTA (2 * subs a pair) is raw stage k % 2's use k // 2 (the
                # blocks of a work item are a multiple of 4)
                for sub in tuple(range(subs)):
                    if persist:
                        set_after(after, blk + sub, walk_i * subs, t_i, stop_i, nx)
                    produce_staged(
                        c.kv,
                        c.indices,
                        t_i,
                        blk + sub,
                        stop_i,
                        nxt,
                        *parts[sub % 2],
                        c.kv_l0,
                        c.kv_r0,
                        c.kt_s0,
                        c.ok0,
                        c.ready0,
                        c.free0,
                        phase,
                        sub,
                        (pair * subs + sub // 2) & 1,
                        (after[0], after[1], after[2], after[3]) if persist else None,
                    )
                if not split or 2 * pair + 1 < n_blk_i:  # (a split kernel walks no padding block)
                    for sub in tuple(range(subs)):
                        if persist:
                            set_after(after, blk + subs + sub, walk_i * subs, t_i, stop_i, nx)
                        produce_staged(
                            c.kv,
                            c.indices,
                            t_i,
                            blk + subs + sub,
                            stop_i,
                            nxt,
                            *parts[(subs + sub) % 2],
                            c.kv_l1,
                            c.kv_r1,
                            c.kt_s1,
                            c.ok1,
                            c.ready1,
                            c.free1,
                            phase,
                            sub,
                            (pair * subs + (subs + sub) // 2) & 1,
                            (after[0], after[1], after[2], after[3]) if persist else None,
                        )
            if persist:
                base[0] = base[0] + walk_i
        if not bulk:
            T.call_extern("handle", "tl::cp_async_wait<0>")  # the last (empty) copies land before exit

    return SimpleNamespace(produce_staged_wg=produce_staged_wg)


def _direct_macros(plan: WsPlan, lanes: SimpleNamespace) -> SimpleNamespace:
    """The in-place scheme's gather through registers (``direct``): packed rows (without a tail) loaded into
    registers, widened from there into their bf16 stage."""
    half, vec, chunks, scale_word = plan.half, plan.vec, plan.chunks, plan.scale_word
    rows_per_pass, passes = plan.rows_per_pass, plan.passes
    prow, plane, entry_ok, load_index = lanes.prow, lanes.plane, lanes.entry_ok, lanes.load_index
    ld_row = f"dsa_ld_row<{chunks // 2}, {half}, {4 * scale_word}>"

    @T.macro
    def load_row(kv, blk, stop, nxt, regs, k, own, base):
        """Start the loads of this thread's bytes of its row of pass ``own[k]`` of block ``blk`` (raw index
        ``nxt[k]``) into ``regs[k, :]`` (``dsa_ld_row``; row 0's bytes, flagged invalid, for an invalid entry)."""
        tx = T.get_thread_binding() - base
        j = own[k] * rows_per_pass + prow(tx)
        ok = entry_ok(blk, j, stop, nxt[k])
        T.call_extern(
            "handle",
            ld_row,
            T.address_of(regs[k, 0]),
            T.address_of(kv[T.if_then_else(ok, nxt[k], 0), 0]),
            plane(tx),
            T.if_then_else(ok, 1, 0),
        )

    @T.macro
    def prime_direct(kv, indices, t, blk, stop, nxt, regs, base=256, mine=None):
        """Before a warpgroup's first :func:`produce_direct`: the loads of block ``blk``'s rows (raw indices ``nxt``)
        into ``regs``, then block ``blk + 1``'s indices into ``nxt``."""
        own = tuple(range(passes)) if mine is None else mine
        for k in tuple(range(len(own))):
            load_row(kv, blk, stop, nxt, regs, k, own, base)
        load_index(indices, t, blk + 1, nxt, base, mine)

    @T.macro
    def produce_direct(
        kv, indices, t, blk, stop, nxt, regs, dst_l, dst_r, _dst_t, ok_s, ready, free, phase, base=256, mine=None
    ):
        """Fill a stage with top-k block ``blk``, whose rows the previous call (or :func:`prime_direct`) loaded into
        ``regs`` (``[passes it fills, row_words]``, ``dsa_ld_row``): wait for the stage, store each row widened with
        its flag, and as soon as a row's registers are free start the loads of the same row of block ``blk + 1``
        (raw indices ``nxt``); then load block ``blk + 2``'s indices. The loads of a block are so in flight while the
        one before it is widened and while the producer waits for its stage. ``base`` and ``mine`` as
        :func:`produce_inplace`."""
        T.barrier_wait(free, phase ^ 1)
        tx = T.get_thread_binding() - base
        lane = plane(tx)
        own = tuple(range(passes)) if mine is None else mine
        flag = plan.row_words - 1
        for k in tuple(range(len(own))):
            j = own[k] * rows_per_pass + prow(tx)
            T.call_extern("handle", f"dsa_put_row_flag<{flag}>", T.address_of(ok_s[j]), T.address_of(regs[k, 0]))
            for c in T.unroll(chunks // 2):  # chunk c of each half lies in tile c of that half
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                for dst, at, tile in ((dst_l, c, c), (dst_r, chunks // 2 + c, half // QUANT_TILE + c)):
                    T.call_extern(
                        "handle",
                        f"dsa_widen_regs<{flag}>",
                        T.address_of(regs[k, 4 * at]),
                        T.address_of(regs[k, 0]),
                        tile,
                        T.address_of(dst[j, col]),
                        T.address_of(dst[j, col + 8]),
                    )
            load_row(kv, blk + 1, stop, nxt, regs, k, own, base)
        load_index(indices, t, blk + 2, nxt, base, mine)
        T.fence_proxy_async()
        T.barrier_arrive(ready)

    return SimpleNamespace(prime_direct=prime_direct, produce_direct=produce_direct)


def _inplace_macros(plan: WsPlan, dims, lanes: SimpleNamespace, direct: SimpleNamespace) -> SimpleNamespace:
    """The in-place scheme (``inplace``): FP8 rows copied raw into their bf16 stage and widened there, or with
    ``direct`` (:func:`_direct_macros`) loaded into registers and widened into it from there."""
    geo, split, half, packed, row_w = plan.geo, plan.split, plan.half, plan.packed, plan.row_w
    scale_word, rope_half, vec, chunks = plan.scale_word, plan.rope_half, plan.vec, plan.chunks
    tail_chunks, n_tiles, piece, tail_piece = plan.tail_chunks, plan.n_tiles, plan.piece, plan.tail_piece
    rows_per_pass, passes, prod_passes = plan.rows_per_pass, plan.passes, plan.prod_passes
    d_v, d_tail = geo.d_v, geo.d_rope
    dtype, acc = T.bfloat16, T.float32
    _, s_count, _, _ = dims
    prow, plane, entry_ok, load_index = lanes.prow, lanes.plane, lanes.entry_ok, lanes.load_index
    cp_async, widen = lanes.cp_async, lanes.widen

    @T.macro
    def produce_inplace(
        kv, indices, t, blk, stop, nxt, sc, dst_l, dst_r, dst_t, ok_s, ready, free, phase, base=256, mine=None
    ):
        """Gather top-k block ``blk`` (raw indices ``nxt``, loaded one block earlier) into a stage and
        widen it there. Each thread copies the raw bytes of each of its 16-value chunks by cp.async into
        the row's stage, the eight lanes of a row side by side (:func:`ws_inplace_raw_col`), waits for
        its own copies only (one group per pass, each widened as soon as it lands), loads them, and
        widens them in place once the warp (which holds the row's eight lanes) has loaded its own: no
        raw buffer and no barrier among the producer threads is needed. The copies and the valid flags
        (the eight threads of a row store the same one) take their addresses with ``T.address_of``, so
        that TileLang puts none either (through ``T.ptx_cp_async`` it put three per pass and block). The
        copies of a pass are issued :data:`WS_INPLACE_AHEAD` passes before it is widened, so that the
        widening of the first passes runs while the copies of the later ones are still being issued.

        ``base`` is the first thread of the warpgroup that runs it (the producer's, or consumer warpgroup
        1's) and ``mine`` the passes of the block it fills (default all); ``nxt`` and ``sc`` hold its
        passes only."""
        T.barrier_wait(free, phase ^ 1)
        tx = T.get_thread_binding() - base
        lane = plane(tx)
        own = tuple(range(passes)) if mine is None else mine  # the passes this warpgroup fills
        n_own = len(own)
        words = T.view(kv, (s_count, row_w // 2), dtype)  # the rows in 2-byte words, as the stage counts them
        w = piece // 2  # words per cp.async of FP8 values
        if packed:
            scales = T.view(kv, (s_count, row_w // 4), T.float32)
        ahead = min(WS_INPLACE_AHEAD, n_own)
        for step in tuple(range(n_own + ahead)):  # (a Python loop: unrolled as the pass schedule is built)
            if step < n_own:
                p = step
                j = own[p] * rows_per_pass + prow(tx)
                ok = entry_ok(blk, j, stop, nxt[p])
                T.call_extern("handle", "dsa_put_flag", T.address_of(ok_s[j]), T.if_then_else(ok, 1, 0))
                row = T.if_then_else(ok, nxt[p], 0)
                for c in T.unroll(chunks // 2):
                    col = (c * WS_THREADS_PER_ROW + lane) * vec
                    at = ws_inplace_raw_col(c, lane)  # (contiguous with the other lanes' of the row)
                    for k in T.unroll(vec // piece):
                        cp_async(dst_l[j, at + k * w], words[row, (col + k * piece) // 2], piece, ok)
                        cp_async(dst_r[j, at + k * w], words[row, (half + col + k * piece) // 2], piece, ok)
                if d_tail:
                    for c in T.unroll(tail_chunks):
                        col = (c * WS_THREADS_PER_ROW + lane) * 8
                        if packed:  # bf16 already: copied as they are
                            for k in T.unroll(8 // tail_piece):
                                cp_async(
                                    dst_t[j, col + k * tail_piece],
                                    words[row, rope_half + col + k * tail_piece],
                                    2 * tail_piece,
                                    ok,
                                )
                        else:  # 8 FP8 values into the first half of their 16-byte chunk
                            cp_async(dst_t[j, col], words[row, (d_v + col) // 2], 8, ok)
                if packed:
                    # the row's scales in one vector load (the row is valid: row 0 for invalid entries),
                    # then zero for invalid entries (TileLang picks the widest load the row width aligns): one
                    # request instead of four
                    for i in T.vectorized(n_tiles):
                        sc[p, i] = scales[row, scale_word + i]
                    for i in T.unroll(n_tiles):
                        sc[p, i] = T.if_then_else(ok, sc[p, i], 0.0)
                T.ptx_commit_group()  # one group per pass: the widening of a pass starts when its copies land
            if step == n_own - 1:
                load_index(indices, t, blk + 1, nxt, base, mine)
            if step >= ahead:
                q = step - ahead
                j = own[q] * rows_per_pass + prow(tx)
                # this thread's own copies of pass q (T.ptx_wait_group would add a barrier)
                T.call_extern("handle", "dsa_cp_async_wait", min(step + 1, n_own) - 1 - q)
                widen(None, dst_l, dst_r, sc, q, j, lane)
                if d_tail and not packed:
                    for c in T.unroll(tail_chunks):
                        col = (c * WS_THREADS_PER_ROW + lane) * 8
                        T.call_extern("handle", "dsa_widen_tail_inplace", T.address_of(dst_t[j, col]))
        T.fence_proxy_async()
        T.barrier_arrive(ready)

    fill = direct.produce_direct if direct else produce_inplace

    def row_regs(n_own: int):
        """Registers for the rows of ``n_own`` passes: their words (``direct``), or the packed rows' scales."""
        if plan.direct:
            return T.alloc_local((n_own, plan.row_words), T.uint32)
        return T.alloc_local((n_own, n_tiles), acc) if packed else None

    @T.macro
    def produce_inplace_wg(c):
        """The producer warpgroup of the in-place scheme (``inplace``): each pair's blocks widened in their stages."""
        n_own = passes if prod_passes is None else len(prod_passes)
        nxt = T.alloc_local((n_own,), T.int32)
        sc = row_regs(n_own)
        load_index(c.indices, c.t, c.first, nxt, 256, prod_passes)
        if plan.direct:
            direct.prime_direct(c.kv, c.indices, c.t, c.first, c.stop, nxt, sc, 256, prod_passes)
        for pair in T.serial(c.pairs):
            fill(
                c.kv,
                c.indices,
                c.t,
                c.first + 2 * pair,
                c.stop,
                nxt,
                sc,
                c.kv_l0,
                c.kv_r0,
                c.kt_s0,
                c.ok0,
                c.ready0,
                c.free0,
                pair & 1,
                256,
                prod_passes,
            )
            if not split or 2 * pair + 1 < c.n_blk:  # (a split kernel walks no padding block)
                fill(
                    c.kv,
                    c.indices,
                    c.t,
                    c.first + 2 * pair + 1,
                    c.stop,
                    nxt,
                    sc,
                    c.kv_l1,
                    c.kv_r1,
                    c.kt_s1,
                    c.ok1,
                    c.ready1,
                    c.free1,
                    pair & 1,
                    256,
                    prod_passes,
                )

    return SimpleNamespace(
        fill=fill, prime=direct and direct.prime_direct, row_regs=row_regs, produce_inplace_wg=produce_inplace_wg
    )


def producer_macros(plan: WsPlan, dims, items: SimpleNamespace) -> SimpleNamespace:
    """The producer macros of ``plan`` over the dynamic sizes ``dims`` and the work items ``items``
    (:func:`csrc_tl.attention.ws_work.work_helpers`): ``load_index``, ``produce_inplace``, ``row_regs`` and (with
    ``plan.direct``) ``prime_direct``, which consumer warpgroup 1 also runs where ``plan.wg1_widens``, and per scheme
    the whole body of the producer warpgroups
    (``inplace``, ``staged``, ``halves``, ``bf16``), each taking the kernel's buffers and indices ``c``."""
    lanes = _lane_macros(plan, dims)
    bf16 = _bf16_macros(plan, lanes)
    raw = _raw_macros(plan, dims, lanes)
    staged = _staged_wg_macros(plan, lanes, raw, _staged_macros(plan, lanes, raw), items)
    inplace = _inplace_macros(plan, dims, lanes, _direct_macros(plan, lanes) if plan.direct else None)
    return SimpleNamespace(
        load_index=lanes.load_index,
        produce_inplace=inplace.fill,
        prime_direct=inplace.prime,
        row_regs=inplace.row_regs,
        inplace=inplace.produce_inplace_wg,
        staged=staged.produce_staged_wg,
        halves=bf16.produce_halves_wg,
        bf16=bf16.produce_bf16_wg,
    )
