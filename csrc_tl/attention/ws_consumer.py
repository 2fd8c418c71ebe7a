"""The consumer warpgroups of a warp-specialized kernel: macros that score the stages, run the online softmax and
the two halves of PV and store the rows, for the paired and the single consumer schemes of the plan
(:class:`csrc_tl.attention.plan.WsPlan`)."""

from types import SimpleNamespace

import tilelang.language as T

from .common import (
    exponentiate,
    load_q,
    normalize,
    online_softmax,
    reciprocal,
    rescale,
    sink_weight,
    store_max,
    store_rows,
)
from .geometry import NEG_START
from .plan import WS_COL_BARRIER, WS_CONSUMER_BARRIER, WS_STORE_BARRIERS, WsPlan

# offsets, in units of hb floats, of the running max and sum in the transposed consumers' col_s (after the two
# four-warp reduction buffers of dsa_col_max_update and dsa_col_sum_update)
COL_MAX, COL_SUM = 8, 9


def selects(flag, h, group: int):
    """Whether the entry of a stage row whose flag is ``flag`` (0 for an invalid entry) counts for row ``h`` of the
    head block: any valid entry, or in a grouped block (``group`` heads a token) an entry whose flag has the bit of
    the token of row ``h``."""
    if group:
        return T.bitwise_and(T.shift_right(flag, h // group), 1) != 0
    return flag != 0


def _score_macros(plan: WsPlan) -> SimpleNamespace:
    """The score GEMMs of a stage (whole or by halves) and the staging of q."""
    geo, block_i, half, hb, copies_async = plan.geo, plan.block_i, plan.half, plan.hb, plan.copies_async
    d_v, d_tail, heads = geo.d_v, geo.d_rope, geo.heads
    acc = T.float32

    @T.macro
    def score(q_l, q_r, qt_s, k_l, k_r, k_t, ok_s, acc_s):
        """``acc_s [hb, block_i]``: the raw scores of the block in stage ``(k_l, k_r, k_t)`` (-inf for
        invalid entries, whose rows are zeros); the GEMMs are issued back to back and waited for once."""
        if copies_async:
            T.fence_proxy_async()  # cp.async wrote the stage; wgmma reads it through the async proxy
        for h, j in T.Parallel(hb, block_i):
            acc_s[h, j] = T.if_then_else(selects(ok_s[j], h, plan.geo.group), 0, -T.infinity(acc))
        T.wgmma_gemm(q_l, k_l, acc_s, transpose_B=True)
        T.wgmma_gemm(q_r, k_r, acc_s, transpose_B=True)
        if d_tail:
            T.wgmma_gemm(qt_s, k_t, acc_s, transpose_B=True)
        T.wait_wgmma(0)

    @T.macro
    def score_half(ready, phase, q_part, k_part, acc_s, clear, qt_s=None, k_t=None):
        """Halves: once stage half ``k_part`` (and the tail ``k_t``, where given) is ready, issue its score
        GEMMs into ``acc_s``, not waited for; ``clear`` for a block's first, which zeroes the accumulator."""
        T.barrier_wait(ready, phase)
        T.fence_proxy_async()  # cp.async wrote the half; wgmma reads it through the async proxy
        T.wgmma_gemm(q_part, k_part, acc_s, transpose_B=True, clear_accum=clear)
        if k_t is not None:
            T.wgmma_gemm(qt_s, k_t, acc_s, transpose_B=True)

    @T.macro
    def stage_q(q, q_l, q_r, qt_s, t, h0, tx, q_ready):
        """The 256 consumer threads copy this block's q to shared memory (vectorized; the producer
        starts gathering meanwhile) and arrive on ``q_ready``."""
        load_q(q, q_l, t, h0, 0, heads, tx, 256)
        load_q(q, q_r, t, h0, half, heads, tx, 256)
        if d_tail:
            load_q(q, qt_s, t, h0, d_v, heads, tx, 256)
        T.fence_proxy_async()  # generic stores, read by wgmma through the async proxy
        T.barrier_arrive(q_ready)

    @T.macro
    def score_stage(c, k_l, k_r, k_t):
        """Issue the score GEMMs of the stage ``(k_l, k_r, k_t)`` into ``c.acc_s``, not waited for: ``[hb,
        block_i]``, or transposed ``[block_i, hb]`` (the stage's rows as M, the heads as N)."""
        if plan.transposed:
            T.wgmma_gemm(k_l, c.q_l, c.acc_s, transpose_B=True)
            T.wgmma_gemm(k_r, c.q_r, c.acc_s, transpose_B=True)
            if d_tail:
                T.wgmma_gemm(k_t, c.qt_s, c.acc_s, transpose_B=True)
        else:
            T.wgmma_gemm(c.q_l, k_l, c.acc_s, transpose_B=True)
            T.wgmma_gemm(c.q_r, k_r, c.acc_s, transpose_B=True)
            if d_tail:
                T.wgmma_gemm(c.qt_s, k_t, c.acc_s, transpose_B=True)

    @T.macro
    def pv_half(p_s, v_half, acc_o):
        """``acc_o += P . V`` over one value half ``v_half [block_i, half]`` of a stage; transposed, ``acc_o [half,
        hb] += V^T . P^T`` (V^T: the stage read as an MN-major operand; P^T: ``p_s [hb, block_i]``, K-major)."""
        if plan.transposed:
            T.gemm(v_half, p_s, acc_o, transpose_A=True, transpose_B=True)
        else:
            T.gemm(p_s, v_half, acc_o)

    return SimpleNamespace(
        score=score, score_half=score_half, stage_q=stage_q, score_stage=score_stage, pv_half=pv_half
    )


def _consume0_paired(plan: WsPlan, items: SimpleNamespace, scores: SimpleNamespace) -> SimpleNamespace:
    """Consumer warpgroup 0 of the paired scheme (``paired``)."""
    geo, split, block_i, hb, halves, scale2 = plan.geo, plan.split, plan.block_i, plan.hb, plan.halves, plan.scale2
    lazy_gap, sink_max = plan.lazy_gap, plan.sink_max
    heads = geo.heads
    dtype, acc = T.bfloat16, T.float32
    score, score_half, stage_q = scores.score, scores.score_half, scores.stage_q

    @T.macro
    def consume0_paired(c):
        """Consumer warpgroup 0 of the paired scheme: scores stage 0's block of each pair, its half of PV."""
        stage_q(c.q, c.q_l, c.q_r, c.qt_s, c.t, c.h0, c.tx, c.q_ready)
        T.fill(c.acc_o, 0)
        T.fill(c.sumexp, 0)
        T.fill(c.m_i, NEG_START)
        if sink_max:
            T.fill(c.mx, NEG_START)
        T.barrier_wait(c.q_ready, 0)
        # Halves: the scores of the first pair's block here; those of each later pair are issued
        # under the last PV GEMM of the pair before. ptxas serializes every wgmma of the
        # kernel (C7515) if an accumulator is written by other instructions while a GEMM is
        # in flight, or if a GEMM is in flight across the loop's entry or back-edge: so the
        # first score GEMM clears the accumulator, invalid entries are masked after the
        # wait, and every GEMM is waited for before the loop's next step.
        flag = T.alloc_local((1,), T.int32) if halves else None  # (see lazy_gap)
        if halves and c.pairs > 0:
            score_half(c.ready_l0, 0, c.q_l, c.kv_l0, c.acc_s, True)
            score_half(c.ready_r0, 0, c.q_r, c.kv_r0, c.acc_s, False, c.qt_s, c.kt_s0)
            T.wait_wgmma(0)
        for pair in T.serial(c.pairs):
            phase = pair & 1
            if halves:
                for h, j in T.Parallel(hb, block_i):
                    c.acc_s[h, j] = T.if_then_else(
                        selects(c.ok0[j], h, plan.geo.group), c.acc_s[h, j], -T.infinity(acc)
                    )
            else:
                T.barrier_wait(c.ready0, phase)
                score(c.q_l, c.q_r, c.qt_s, c.kv_l0, c.kv_r0, c.kt_s0, c.ok0, c.acc_s)
            # softmax against this warpgroup's max so far; warpgroup 1 takes it from m_s
            T.copy(c.m_i, c.m_prev)
            T.reduce_max(c.acc_s, c.m_i, dim=1, clear=False)
            for h in T.Parallel(hb):
                if sink_max:
                    c.mx[h] = T.max(c.mx[h], c.m_i[h])
                if halves:
                    c.m_i[h] = T.if_then_else(c.m_i[h] > c.m_prev[h] + lazy_gap, c.m_i[h], c.m_prev[h])
                c.m_s[h] = c.m_i[h]
            T.barrier_arrive(c.m0_ready)
            for h in T.Parallel(hb):
                c.alpha[h] = T.exp2((c.m_prev[h] - c.m_i[h]) * scale2)
            exponentiate(c.acc_s, c.acc_o, c.m_i, c.alpha, c.sum_i, c.sumexp, scale2, flag)
            T.copy(c.acc_s, c.p_0)
            T.wgmma_gemm(c.p_0, c.kv_l0, c.acc_o)
            # the pair's final max from warpgroup 1: rescale to it and hand over this block's
            # probabilities
            T.barrier_wait(c.m1_ready, phase)
            for h in T.Parallel(hb):
                c.alpha[h] = T.exp2((c.m_i[h] - c.m_s[h]) * scale2)
                c.m_i[h] = c.m_s[h]
                c.sumexp[h] = c.sumexp[h] * c.alpha[h]
            if halves:  # (stmatrix)
                for h, j in T.Parallel(hb, block_i):
                    c.acc_s[h, j] = c.acc_s[h, j] * c.alpha[h]
                T.copy(c.acc_s, c.p0_s)
            else:
                for h, j in T.Parallel(hb, block_i):
                    c.p0_s[h, j] = T.cast(c.acc_s[h, j] * c.alpha[h], dtype)
            T.fence_proxy_async()
            T.barrier_arrive(c.p0_ready)
            T.wait_wgmma(0)
            if halves:
                T.barrier_arrive(c.free_l0)  # the producer refills it with the next pair's block
            else:
                T.barrier_arrive(c.free0)
            rescale(c.acc_o, c.alpha, flag)
            T.barrier_wait(c.p1_ready, phase)
            if not halves:
                T.gemm(c.p1_s, c.kv_l1, c.acc_o)
                T.barrier_arrive(c.free1)
            else:
                T.wgmma_gemm(c.p1_s, c.kv_l1, c.acc_o)
                if pair + 1 < c.pairs:
                    # the next pair's scores, issued while the last PV GEMM runs
                    score_half(c.ready_l0, phase ^ 1, c.q_l, c.kv_l0, c.acc_s, True)
                    T.wait_wgmma(1)
                    T.barrier_arrive(c.free_l1)
                    score_half(c.ready_r0, phase ^ 1, c.q_r, c.kv_r0, c.acc_s, False, c.qt_s, c.kt_s0)
                    T.wait_wgmma(0)
                else:
                    T.wait_wgmma(0)
                    T.barrier_arrive(c.free_l1)
        if sink_max:
            # this warpgroup's exact max for warpgroup 1, which read m_s last before this one's last read of it
            for h in T.Parallel(hb):
                c.m_s[h] = c.mx[h]
        for h in T.Parallel(hb):
            T.call_extern("handle", "dsa_put_row_sum", h, c.sumexp[h])
        T.barrier_arrive(c.done0)
        T.barrier_wait(c.done1, 0)
        for h in T.Parallel(hb):
            c.sumexp[h] = c.sumexp[h] + T.call_extern(acc, "dsa_row_sum", hb + h)
        if sink_max:
            sink_weight(c.alpha, c.attn_sink, c.m_i, c.h0, heads, scale2)
            normalize(c.acc_o, c.sum_i, c.m_i, c.sumexp, scale2, c.alpha)
        else:
            normalize(c.acc_o, c.sum_i, c.m_i, c.sumexp, scale2)
        store_rows(c.out, None, c.acc_o, c.q_l, None, c.t, c.by if split else None, c.h0, 0, heads)

    return SimpleNamespace(consume0_paired=consume0_paired)


def _transposed_macros(plan: WsPlan) -> SimpleNamespace:
    """Consumer warpgroup 0's softmax steps in the transposed consumers (:func:`~csrc_tl.attention.ws_transposed`)."""
    block_i, hb, scale2 = plan.block_i, plan.hb, plan.scale2

    @T.macro
    def stats_t(c, start):
        """The transposed consumers' running statistics in shared memory: at the ``start`` of a work item the max
        and the sum of every head reset (then a barrier: the device helpers read them); at its end, after a barrier,
        copied into ``m_i`` and ``sumexp`` for the normalization and the stores."""
        if start:
            for h in T.Parallel(hb):
                c.col_s[COL_MAX * hb + h] = NEG_START
                c.col_s[COL_SUM * hb + h] = 0
            T.call_extern("handle", "dsa_bar_sync", *WS_COL_BARRIER)
        else:
            T.call_extern("handle", "dsa_bar_sync", *WS_COL_BARRIER)
            for h in T.Parallel(hb):
                c.m_i[h] = c.col_s[COL_MAX * hb + h]
                c.sumexp[h] = c.col_s[COL_SUM * hb + h]

    @T.macro
    def softmax_t(c):
        """The online softmax of the transposed consumers over this block's scores ``c.acc_s [block_i, hb]``: the
        column statistics by the device helpers (warp shuffles, one barrier per statistic and block; the running max
        and sum and the rescale factor ``alpha_s`` in shared memory), the probabilities in place, ``acc_o`` rescaled,
        and P^T into ``p_s [hb, block_i]`` for both warpgroups' PV GEMMs."""
        bar = WS_COL_BARRIER[0]
        T.call_extern(
            "handle",
            f"dsa_col_max_update<{hb}>",
            c.acc_s.data,
            T.address_of(c.col_s[0]),
            T.address_of(c.col_s[COL_MAX * hb]),
            T.address_of(c.alpha_s[0]),
            scale2,
            bar,
        )
        for j, h in T.Parallel(block_i, hb):
            c.acc_s[j, h] = T.exp2(c.acc_s[j, h] * scale2 - c.col_s[COL_MAX * hb + h] * scale2)
        T.call_extern(
            "handle",
            f"dsa_col_sum_update<{hb}>",
            c.acc_s.data,
            T.address_of(c.col_s[4 * hb]),
            T.address_of(c.col_s[COL_SUM * hb]),
            T.address_of(c.alpha_s[0]),
            bar,
        )
        for d, h in T.Parallel(plan.half, hb):
            c.acc_o[d, h] = c.acc_o[d, h] * c.alpha_s[h]
        for j, h in T.Parallel(block_i, hb):
            c.p_s[h, j] = c.acc_s[j, h]

    return SimpleNamespace(stats_t=stats_t, softmax_t=softmax_t)


def _consume0_single(plan: WsPlan, items: SimpleNamespace, scores: SimpleNamespace) -> SimpleNamespace:
    """Consumer warpgroup 0 of the single scheme (plain or transposed: :func:`~csrc_tl.attention.ws_transposed`)."""
    geo, split, block_i, hb, persist = plan.geo, plan.split, plan.block_i, plan.hb, plan.persist
    copies_async, scale2, sink_max, transposed = plan.copies_async, plan.scale2, plan.sink_max, plan.transposed
    heads = geo.heads
    acc = T.float32
    work, work_items, global_block = items.work, items.work_items, items.global_block
    stage_q, score_stage, pv_half = scores.stage_q, scores.score_stage, scores.pv_half
    tr = _transposed_macros(plan) if transposed else None

    @T.macro
    def consume0_single(c):
        """Consumer warpgroup 0 of the single scheme: scores every block, runs the softmax and its half of PV."""
        base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
        if persist:
            base[0] = 0
        for i in work_items(c.n_items):
            t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                c.bx, c.by, i, c.topk_length, c.t, c.h0, c.first, c.stop, c.n_blk, c.pairs, c.walk
            )
            if i > 0:
                # both consumer warpgroups have stored the last item's rows through q's tiles
                T.call_extern("handle", "dsa_bar_sync", *WS_CONSUMER_BARRIER)
            stage_q(c.q, c.q_l, c.q_r, c.qt_s, t_i, h0_i, c.tx, c.q_ready)
            T.fill(c.acc_o, 0)
            T.fill(c.sumexp, 0)
            T.fill(c.m_i, NEG_START)
            if transposed:
                tr.stats_t(c, True)
            T.barrier_wait(c.q_ready, i & 1)
            for it in T.serial(walk_i):
                # (base is even: the stage of a block is that of it)
                phase = (global_block(base, it) // 2) & 1
                if it % 2 == 0:
                    T.barrier_wait(c.ready0, phase)
                else:
                    T.barrier_wait(c.ready1, phase)
                if copies_async:
                    T.fence_proxy_async()  # cp.async wrote the stage; wgmma reads it (async proxy)
                if transposed:
                    for j, h in T.Parallel(block_i, hb):
                        ok = T.if_then_else(it % 2 == 0, c.ok0[j], c.ok1[j])
                        c.acc_s[j, h] = T.if_then_else(ok != 0, 0, -T.infinity(acc))
                else:
                    for h, j in T.Parallel(hb, block_i):
                        ok = T.if_then_else(it % 2 == 0, c.ok0[j], c.ok1[j])
                        c.acc_s[h, j] = T.if_then_else(ok != 0, 0, -T.infinity(acc))
                # the score GEMMs are issued back to back and waited for once
                if it % 2 == 0:
                    score_stage(c, c.kv_l0, c.kv_r0, c.kt_s0)
                else:
                    score_stage(c, c.kv_l1, c.kv_r1, c.kt_s1)
                T.wait_wgmma(0)
                if global_block(base, it) > 0:  # warpgroup 1 is done with p_s and alpha_s
                    T.barrier_wait(c.p_free, (global_block(base, it) - 1) & 1)
                if transposed:
                    tr.softmax_t(c)
                else:
                    online_softmax(c.acc_s, c.acc_o, c.m_i, c.m_prev, c.alpha, c.sum_i, c.sumexp, scale2)
                    T.copy(c.alpha, c.alpha_s)
                    T.copy(c.acc_s, c.p_s)
                # warpgroup 1 may start its half of PV now, beside this warpgroup's half
                T.fence_proxy_async()
                T.barrier_arrive(c.p_ready)
                if it % 2 == 0:
                    pv_half(c.p_s, c.kv_l0, c.acc_o)
                else:
                    pv_half(c.p_s, c.kv_l1, c.acc_o)
                if it % 2 == 0:
                    T.barrier_arrive(c.free0)
                else:
                    T.barrier_arrive(c.free1)
            if transposed:
                tr.stats_t(c, False)
            if sink_max:
                store_max(c.max_logits, c.m_i, c.sumexp, t_i, h0_i, heads, geo.sm_scale)  # (m_i is exact here)
                sink_weight(c.alpha, c.attn_sink, c.m_i, h0_i, heads, scale2)
                reciprocal(c.sum_s, c.sumexp, c.alpha)  # warpgroup 1 scales its half by it
                T.barrier_arrive(c.done)
                normalize(None if transposed else c.acc_o, c.sum_i, c.m_i, c.sumexp, scale2, c.alpha)
            else:
                reciprocal(c.sum_s, c.sumexp)  # warpgroup 1 scales its half by it
                T.barrier_arrive(c.done)
                normalize(None if transposed else c.acc_o, c.sum_i, c.m_i, c.sumexp, scale2)
            store_rows(
                c.out,
                c.lse,
                c.acc_o,
                c.q_l,
                c.sum_i,
                t_i,
                c.by if split else None,
                h0_i,
                0,
                heads,
                WS_STORE_BARRIERS[0] if split else None,
                factor=c.sum_s if transposed else None,
            )
            if split:
                # the combine may launch now (the first thread's trigger counts for the CTA): after the
                # stores, so that its blocks do not take SMs from this kernel's while they still run
                T.pdl_trigger()
            if persist:
                base[0] = base[0] + walk_i

    return SimpleNamespace(consume0_single=consume0_single)


def _consume1_paired(plan: WsPlan, items: SimpleNamespace, scores: SimpleNamespace) -> SimpleNamespace:
    """Consumer warpgroup 1 of the paired scheme (``paired``)."""
    geo, split, block_i, half, hb, halves = plan.geo, plan.split, plan.block_i, plan.half, plan.hb, plan.halves
    scale2, lazy_gap, sink_max = plan.scale2, plan.lazy_gap, plan.sink_max
    heads = geo.heads
    acc = T.float32
    score, score_half, stage_q = scores.score, scores.score_half, scores.stage_q

    @T.macro
    def consume1_paired(c):
        """Consumer warpgroup 1 of the paired scheme: scores stage 1's block of each pair, its half of PV."""
        stage_q(c.q, c.q_l, c.q_r, c.qt_s, c.t, c.h0, c.tx, c.q_ready)
        T.fill(c.acc_o_r, 0)
        flag_r = T.alloc_local((1,), T.int32) if halves else None
        T.fill(c.sumexp_r, 0)
        T.fill(c.m_r, NEG_START)
        if sink_max:
            T.fill(c.mx_r, NEG_START)
        T.barrier_wait(c.q_ready, 0)
        for pair in T.serial(c.pairs):
            phase = pair & 1
            if halves:
                # the right half (and tail) first: the producer fills it before the left one
                score_half(c.ready_r1, phase, c.q_r, c.kv_r1, c.acc_s_r, True, c.qt_s, c.kt_s1)
                score_half(c.ready_l1, phase, c.q_l, c.kv_l1, c.acc_s_r, False)
                T.wait_wgmma(0)
                for h, j in T.Parallel(hb, block_i):
                    c.acc_s_r[h, j] = T.if_then_else(
                        selects(c.ok1[j], h, plan.geo.group), c.acc_s_r[h, j], -T.infinity(acc)
                    )
            else:
                T.barrier_wait(c.ready1, phase)
                score(c.q_l, c.q_r, c.qt_s, c.kv_l1, c.kv_r1, c.kt_s1, c.ok1, c.acc_s_r)
            T.reduce_max(c.acc_s_r, c.sum_r, dim=1, clear=True)  # sum_r: this block's row max, for now
            T.barrier_wait(c.m0_ready, phase)
            # the pair's final max (at least warpgroup 0's, which is at least this one's last)
            for h in T.Parallel(hb):
                if sink_max:
                    c.mx_r[h] = T.max(c.mx_r[h], c.sum_r[h])
                c.m_prev_r[h] = c.m_r[h]
                c.m_r[h] = T.max(c.m_s[h], c.sum_r[h])
                if halves:
                    c.m_r[h] = T.if_then_else(c.m_r[h] > c.m_s[h] + lazy_gap, c.m_r[h], c.m_s[h])
                c.alpha_r[h] = T.exp2((c.m_prev_r[h] - c.m_r[h]) * scale2)
            for h in T.Parallel(hb):
                c.m_s[h] = c.m_r[h]
            T.barrier_arrive(c.m1_ready)
            exponentiate(c.acc_s_r, c.acc_o_r, c.m_r, c.alpha_r, c.sum_r, c.sumexp_r, scale2, flag_r)
            T.copy(c.acc_s_r, c.p_1)
            T.wgmma_gemm(c.p_1, c.kv_r1, c.acc_o_r)
            T.copy(c.acc_s_r, c.p1_s)
            T.fence_proxy_async()
            T.barrier_wait(c.p0_ready, phase)
            T.wgmma_gemm(c.p0_s, c.kv_r0, c.acc_o_r)
            # warpgroup 0's PV GEMM over these probabilities only after this one, whose
            # end frees the stage (half) warpgroup 0 scores next (FlashMLA's order): the stage
            # is refilled one GEMM sooner
            T.barrier_arrive(c.p1_ready)
            if halves:
                T.wait_wgmma(1)
                T.barrier_arrive(c.free_r1)
                T.wait_wgmma(0)
                T.barrier_arrive(c.free_r0)
            else:
                T.wait_wgmma(0)
                T.barrier_arrive(c.free1)
                T.barrier_arrive(c.free0)
        for h in T.Parallel(hb):
            T.call_extern("handle", "dsa_put_row_sum", hb + h, c.sumexp_r[h])
        T.barrier_arrive(c.done1)
        T.barrier_wait(c.done0, 0)
        for h in T.Parallel(hb):
            c.sumexp_r[h] = c.sumexp_r[h] + T.call_extern(acc, "dsa_row_sum", h)
        # both warpgroups end on the same max; this one writes the LSE (and the exact max)
        if sink_max:
            for h in T.Parallel(hb):
                c.mx_r[h] = T.max(c.mx_r[h], c.m_s[h])
            store_max(c.max_logits, c.mx_r, c.sumexp_r, c.t, c.h0, heads, geo.sm_scale)
            sink_weight(c.alpha_r, c.attn_sink, c.m_r, c.h0, heads, scale2)
            normalize(c.acc_o_r, c.sum_r, c.m_r, c.sumexp_r, scale2, c.alpha_r)
        else:
            normalize(c.acc_o_r, c.sum_r, c.m_r, c.sumexp_r, scale2)
        store_rows(c.out, c.lse, c.acc_o_r, c.q_r, c.sum_r, c.t, c.by if split else None, c.h0, half, heads)

    return SimpleNamespace(consume1_paired=consume1_paired)


def _consume1_single(
    plan: WsPlan, items: SimpleNamespace, scores: SimpleNamespace, prod: SimpleNamespace
) -> SimpleNamespace:
    """Consumer warpgroup 1 of the single scheme."""
    geo, split, half, hb, persist = plan.geo, plan.split, plan.half, plan.hb, plan.persist
    wg1_passes, copies_async, wg1_widens = plan.wg1_passes, plan.copies_async, plan.wg1_widens
    transposed = plan.transposed
    heads = geo.heads
    work, work_items, global_block = items.work, items.work_items, items.global_block
    stage_q, pv_half = scores.stage_q, scores.pv_half
    load_index, produce_inplace = prod.load_index, prod.produce_inplace

    @T.macro
    def scale_rows(acc_o_r, factor):
        """Each head's row of ``acc_o_r`` (``[hb, half]``, or transposed ``[half, hb]``) times ``factor[h]``."""
        if transposed:
            for d, h in T.Parallel(half, hb):
                acc_o_r[d, h] = acc_o_r[d, h] * factor[h]
        else:
            for h, d in T.Parallel(hb, half):
                acc_o_r[h, d] = acc_o_r[h, d] * factor[h]

    @T.macro
    def consume1_single(c):
        """Consumer warpgroup 1 of the single scheme: its half of PV (and, with ``wg1_widens``, its passes of each
        block, ``wg1_passes``)."""
        base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
        if persist:
            base[0] = 0
        if wg1_widens:
            nxt1 = T.alloc_local((len(wg1_passes),), T.int32)
            sc1 = prod.row_regs(len(wg1_passes))
        for i in work_items(c.n_items):
            t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                c.bx, c.by, i, c.topk_length, c.t, c.h0, c.first, c.stop, c.n_blk, c.pairs, c.walk
            )
            if i > 0:
                T.call_extern("handle", "dsa_bar_sync", *WS_CONSUMER_BARRIER)  # (see warpgroup 0)
            stage_q(c.q, c.q_l, c.q_r, c.qt_s, t_i, h0_i, c.tx, c.q_ready)
            T.fill(c.acc_o_r, 0)
            if wg1_widens:  # (a kernel of one work item: see persist)
                load_index(c.indices, t_i, first_i, nxt1, 128, wg1_passes)
                if plan.direct:
                    prod.prime_direct(c.kv, c.indices, t_i, first_i, stop_i, nxt1, sc1, 128, wg1_passes)
                if walk_i > 0:
                    produce_inplace(
                        c.kv,
                        c.indices,
                        t_i,
                        first_i,
                        stop_i,
                        nxt1,
                        sc1,
                        c.kv_l0,
                        c.kv_r0,
                        c.kt_s0,
                        c.ok0,
                        c.ready0,
                        c.free0,
                        0,
                        128,
                        wg1_passes,
                    )
            for it in T.serial(walk_i):
                if wg1_widens:
                    # this warpgroup's rows of the next block, before it waits for this one's probabilities
                    if it + 1 < walk_i:
                        if (it + 1) % 2 == 0:
                            produce_inplace(
                                c.kv,
                                c.indices,
                                t_i,
                                first_i + it + 1,
                                stop_i,
                                nxt1,
                                sc1,
                                c.kv_l0,
                                c.kv_r0,
                                c.kt_s0,
                                c.ok0,
                                c.ready0,
                                c.free0,
                                ((it + 1) // 2) & 1,
                                128,
                                wg1_passes,
                            )
                        else:
                            produce_inplace(
                                c.kv,
                                c.indices,
                                t_i,
                                first_i + it + 1,
                                stop_i,
                                nxt1,
                                sc1,
                                c.kv_l1,
                                c.kv_r1,
                                c.kt_s1,
                                c.ok1,
                                c.ready1,
                                c.free1,
                                ((it + 1) // 2) & 1,
                                128,
                                wg1_passes,
                            )
                T.barrier_wait(c.p_ready, global_block(base, it) & 1)
                if copies_async:
                    T.fence_proxy_async()
                scale_rows(c.acc_o_r, c.alpha_s)
                if it % 2 == 0:
                    pv_half(c.p_s, c.kv_r0, c.acc_o_r)
                    T.barrier_arrive(c.free0)
                else:
                    pv_half(c.p_s, c.kv_r1, c.acc_o_r)
                    T.barrier_arrive(c.free1)
                T.barrier_arrive(c.p_free)
            T.barrier_wait(c.done, i & 1)
            if not transposed:  # (transposed, store_rows scales them)
                scale_rows(c.acc_o_r, c.sum_s)
            store_rows(
                c.out,
                None,
                c.acc_o_r,
                c.q_r,
                None,
                t_i,
                c.by if split else None,
                h0_i,
                half,
                heads,
                WS_STORE_BARRIERS[1] if split else None,
                factor=c.sum_s if transposed else None,
            )
            if persist:
                base[0] = base[0] + walk_i

    return SimpleNamespace(consume1_single=consume1_single)


def consumer_macros(plan: WsPlan, items: SimpleNamespace, prod: SimpleNamespace) -> SimpleNamespace:
    """The consumer macros of ``plan`` over the work items ``items`` (:func:`csrc_tl.attention.ws_work.work_helpers`)
    and the producer macros ``prod`` (consumer warpgroup 1 widens with them where ``plan.wg1_widens``): the whole body
    of each consumer warpgroup per consumer scheme (``consume0_paired``, ``consume0_single``, ``consume1_paired``,
    ``consume1_single``), each taking the kernel's buffers and indices ``c``."""
    scores = _score_macros(plan)
    return SimpleNamespace(
        consume0_paired=_consume0_paired(plan, items, scores).consume0_paired,
        consume0_single=_consume0_single(plan, items, scores).consume0_single,
        consume1_paired=_consume1_paired(plan, items, scores).consume1_paired,
        consume1_single=_consume1_single(plan, items, scores, prod).consume1_single,
    )
