"""The warp-specialized sparse-attention kernel for Hopper (:func:`build_attn_ws`): its shared buffers, barriers and
fragments, the work item of each CTA, and the dispatch of the warpgroups to the producer and consumer macros of its
plan (:mod:`csrc_tl.attention.plan`, :mod:`~csrc_tl.attention.ws_producer`,
:mod:`~csrc_tl.attention.ws_consumer`)."""

from types import SimpleNamespace

import tilelang.language as T

from .common import entry, valid_entries
from .geometry import AttnGeometry, partial_heads
from .plan import DEFAULT_CTAS, WsPlan, ws_plan
from .ws_consumer import consumer_macros
from .ws_producer import producer_macros
from .ws_work import work_helpers


def build_attn_ws(
    geo: AttnGeometry,
    *,
    split: bool = False,
    block_i: int | None = None,
    producers: int | None = None,
    nreg: tuple[int, int, int] | None = None,
    ctas: int = DEFAULT_CTAS,
    sink_max: bool = False,
    transposed: bool = False,
):
    """Warp-specialized prefill kernel for Hopper (sm_90, CUDA only: mbarriers and setmaxnreg): a
    producer warpgroup gathers (and for a packed pool dequantizes) the next top-k block into the
    other of two shared stages while two consumer warpgroups run the GEMMs and the softmax on the
    current one; the value width is split in halves between the two consumers. For the prefill of
    bf16 rows the stages hold a pair of blocks and each consumer scores one of them (the running max
    passes between them once per pair; over 64-row blocks each stage is filled and freed in halves,
    see ``halves``); elsewhere warpgroup 0 scores every block. ``nreg`` overrides the setmaxnreg
    budgets of :data:`WS_NREG`. A persistent kernel (:func:`ws_persistent`) launches at most ``ctas`` CTAs (the
    GPU's SM count: one CTA fills an SM), which walk the tokens in turn; its results do not depend on ``ctas``.

    Same arguments as ``build_attn(geo, split=...)``, with ``block_i`` from :func:`ws_block` unless
    given; needs ``ws_supported(geo)``. With ``split`` it is the decode kernel: the grid's second axis
    splits the top-k blocks and each split writes its normalized partial (bf16) and LSE (float32) for
    :func:`build_combine` (both launched as programmatic dependents, see ``attend``). The producer loads
    the indices of a top-k block one block ahead and issues every row load of a stage predicated, with
    no branches, so they are in flight together: bf16 rows by cp.async straight into shared memory (the
    copies arrive on the stage barrier when they land); staged FP8 rows by cp.async (packed rows of the
    prefill: one TMA bulk copy per row, :func:`ws_bulk`) into a raw stage of :data:`WS_RAW_ROWS` rows one
    producer block ahead (a 128-row stage takes two), then widened shared-to-shared; other FP8 rows by
    cp.async into their own bf16 stage and widened there (``produce_inplace``; over packed
    rows consumer warpgroup 1 fills the last pass of each block, see ``wg1_widens``).
    Rows of invalid entries are written as zeros (never dereferenced) and their scores are -inf, so
    they weigh 0. ``producers`` (1 or 2 warpgroups) defaults to 2 for staged rows, else 1.

    With ``sink_max`` (a prefill) the kernel also takes ``attn_sink [H]`` float32, whose term joins each row's
    denominator of ``out`` at the end, and writes ``max_logits [T, H]`` float32, each row's exact largest scaled
    score (the paired scheme's running max is lazy, so its warpgroups track the exact one beside it).

    Every choice above is made once, by :func:`~csrc_tl.attention.plan.ws_plan` (the :class:`WsPlan` record);
    the producer (:mod:`.ws_producer`) and consumer (:mod:`.ws_consumer`) macros read it.
    """
    plan = ws_plan(
        geo,
        split=split,
        block_i=block_i,
        producers=producers,
        nreg=nreg,
        ctas=ctas,
        sink_max=sink_max,
        transposed=transposed,
    )
    t_count, s_count, k_count, n_split = T.dynamic("t"), T.dynamic("s"), T.dynamic("k"), T.dynamic("ns")
    dims = (t_count, s_count, k_count, n_split)
    items = work_helpers(plan, dims)
    prod = producer_macros(plan, dims, items)
    cons = consumer_macros(plan, items, prod)
    attend = _attend_macro(plan, dims, prod, cons)
    heads, d_v, dtype, acc = geo.heads, geo.d_v, T.bfloat16, T.float32
    if split:
        part_t = T.Tensor((t_count, n_split, partial_heads(heads, ws=True), d_v), dtype)
        return entry(geo, attend, t_count, s_count, k_count, part_t, T.Tensor((t_count, n_split, heads), acc))
    out_t, lse_t = T.Tensor((t_count, heads, d_v), dtype), T.Tensor((t_count, heads), acc)
    return entry(geo, attend, t_count, s_count, k_count, out_t, lse_t, sink_max)


def _attend_macro(plan: WsPlan, dims, prod: SimpleNamespace, cons: SimpleNamespace):
    """The ``attend`` macro of ``plan``'s kernel: the allocations its schemes need, the CTA's work item and the
    dispatch of the warpgroups to the macros of ``prod`` (:func:`~csrc_tl.attention.ws_producer.producer_macros`)
    and ``cons`` (:func:`~csrc_tl.attention.ws_consumer.consumer_macros`).

    Each piece is a macro of its own, called in the order the kernel allocates and computes: the shared stages, the
    shared buffers the consumers exchange, the consumers' fragments, the barriers, the work item; each returns its
    buffers or values by name, and ``attend`` gathers them into the one namespace the warpgroups' macros read."""
    split, persist, groups, ctas = plan.split, plan.persist, plan.groups, plan.ctas
    t_count, _, _, n_split = dims
    stages, exchange, fragments = _stage_buffers(plan), _exchange_buffers(plan), _fragments(plan)
    barriers, work_item, dispatch = _barriers(plan), _work_item(plan, dims), _dispatch(plan, prod, cons)

    @T.macro
    def attend(q, kv, indices, topk_length, out, lse, attn_sink, max_logits):
        grid = (T.min(t_count * groups, ctas), 1) if persist else (t_count * groups, n_split if split else 1)
        with T.Kernel(*grid, threads=128 * (2 + plan.n_prod), prelude=plan.prelude) as (bx, by):
            if split:
                # Programmatic dependent launch (decode, where launches are a large part of the time):
                # this kernel may start while the kernel before it in the stream finishes, and waits
                # for it (and its memory) before it touches global memory. Warpgroup 0 lets the
                # combine launch once it has stored its partial (below), and the combine waits the same
                # way, so that launch overlaps this kernel's end instead of following it.
                T.pdl_sync()
            stage_bufs = stages()
            shared_bufs = exchange(stage_bufs["kt_s0"])
            frags = fragments()
            bars = barriers()
            item = work_item(bx, by, topk_length)
            tx = T.get_thread_binding()
            # every buffer and index of the kernel in one namespace, for the warpgroups' macros: a TIR variable passed
            # as a macro argument takes the parameter's name (in the generated source too); read as an attribute
            # it keeps its own
            c = SimpleNamespace(
                q=q,
                kv=kv,
                indices=indices,
                topk_length=topk_length,
                out=out,
                lse=lse,
                attn_sink=attn_sink,
                max_logits=max_logits,
                bx=bx,
                by=by,
                tx=tx,
                **item,
                **stage_bufs,
                **shared_bufs,
                **frags,
                **bars,
            )
            dispatch(c)

    return attend


def _stage_buffers(plan: WsPlan):
    """The macro that allocates the stages the producer fills and the consumers read: q's halves and tail, two
    stages of value halves and tails, the raw FP8 stages of the staged producer, and each stage's flags of valid
    rows. Returns them by name (``raw0`` and ``raw1`` as ``(values, tail, landed barrier)``)."""
    geo, block_i, half, hb, block_p = plan.geo, plan.block_i, plan.half, plan.hb, plan.block_p
    d_tail, staged, packed, bulk, raw_w = geo.d_rope, plan.staged, plan.packed, plan.bulk, plan.raw_w
    dtype = T.bfloat16

    @T.macro
    def stages():
        q_l = T.alloc_shared((hb, half), dtype)
        q_r = T.alloc_shared((hb, half), dtype)
        kv_l0 = T.alloc_shared((block_i, half), dtype)
        kv_r0 = T.alloc_shared((block_i, half), dtype)
        kv_l1 = T.alloc_shared((block_i, half), dtype)
        kv_r1 = T.alloc_shared((block_i, half), dtype)
        if d_tail:
            qt_s = T.alloc_shared((hb, d_tail), dtype)
            kt_s0 = T.alloc_shared((block_i, d_tail), dtype)
            kt_s1 = T.alloc_shared((block_i, d_tail), dtype)
        else:
            qt_s = kt_s0 = kt_s1 = None
        if staged:
            raw_v0 = T.alloc_shared((block_p, raw_w), T.float8_e4m3fn)
            raw_v1 = T.alloc_shared((block_p, raw_w), T.float8_e4m3fn)
            raw_t0 = T.alloc_shared((block_p, d_tail), dtype if packed else T.float8_e4m3fn) if d_tail else None
            raw_t1 = T.alloc_shared((block_p, d_tail), dtype if packed else T.float8_e4m3fn) if d_tail else None
            landed0 = T.alloc_barrier(arrive_count=block_p) if bulk else None  # (a row's first lane)
            landed1 = T.alloc_barrier(arrive_count=block_p) if bulk else None
            raw0, raw1 = (raw_v0, raw_t0, landed0), (raw_v1, raw_t1, landed1)
        else:
            raw0 = raw1 = None
        ok0 = T.alloc_shared((block_i,), T.int32)
        ok1 = T.alloc_shared((block_i,), T.int32)
        return dict(
            q_l=q_l,
            q_r=q_r,
            kv_l0=kv_l0,
            kv_r0=kv_r0,
            kv_l1=kv_l1,
            kv_r1=kv_r1,
            qt_s=qt_s,
            kt_s0=kt_s0,
            kt_s1=kt_s1,
            raw0=raw0,
            raw1=raw1,
            ok0=ok0,
            ok1=ok1,
        )

    return stages


def _exchange_buffers(plan: WsPlan):
    """The macro that allocates the shared buffers through which the consumer warpgroups pass probabilities and
    softmax statistics to each other: paired, each one's probabilities and the running max handed between them
    (warpgroup 0's probabilities in its stage's tail ``kt_s0`` where that is as wide as a block); single, warpgroup
    0's probabilities, rescale factors and sums for warpgroup 1; transposed, the column statistics besides."""
    block_i, hb, paired, p0_in_tail, transposed = plan.block_i, plan.hb, plan.paired, plan.p0_in_tail, plan.transposed
    dtype, acc = T.bfloat16, T.float32

    @T.macro
    def exchange(kt_s0):
        if paired:
            # probabilities each consumer shares with the other (bf16, relative to the pair's final max)
            p0_s = kt_s0 if p0_in_tail else T.alloc_shared((hb, block_i), dtype)
            p1_s = T.alloc_shared((hb, block_i), dtype)
            m_s = T.alloc_shared((hb,), acc)  # running max, handed from one warpgroup to the other
            p_s = alpha_s = sum_s = None
        else:
            p_s = T.alloc_shared((hb, block_i), dtype)
            alpha_s = T.alloc_shared((hb,), acc)
            sum_s = T.alloc_shared((hb,), acc)
            p0_s = p1_s = m_s = None
        # the transposed consumers' column statistics: two reduction buffers of the four warps, the running max
        # and the running sum (see stats_t in ws_consumer)
        col_s = T.alloc_shared((10 * hb,), acc) if transposed else None
        return dict(p0_s=p0_s, p1_s=p1_s, m_s=m_s, p_s=p_s, col_s=col_s, alpha_s=alpha_s, sum_s=sum_s)

    return exchange


def _fragments(plan: WsPlan):
    """The macro that allocates the consumers' register fragments: the output halves, the scores and the softmax
    statistics of warpgroup 0, and where the consumers are paired warpgroup 1's own scores, probabilities and
    statistics (with ``sink_max`` each one's exact row max besides)."""
    block_i, half, hb, paired, transposed = plan.block_i, plan.half, plan.hb, plan.paired, plan.transposed
    sink_max, dtype, acc = plan.sink_max, T.bfloat16, T.float32

    @T.macro
    def fragments():
        # each consumer warpgroup has its own fragments (their layouts bind its own threads)
        # (transposed: the output as [half, hb], the scores as [block_i, hb]; see ws_transposed)
        o_shape = (half, hb) if transposed else (hb, half)
        acc_o = T.alloc_fragment(o_shape, acc)  # warpgroup 0: left half of the output
        acc_o_r = T.alloc_fragment(o_shape, acc)  # warpgroup 1: right half
        acc_s = T.alloc_fragment((block_i, hb) if transposed else (hb, block_i), acc)  # warpgroup 0: scores
        m_i = T.alloc_fragment((hb,), acc)
        m_prev = T.alloc_fragment((hb,), acc)
        alpha = T.alloc_fragment((hb,), acc)
        sum_i = T.alloc_fragment((hb,), acc)
        sumexp = T.alloc_fragment((hb,), acc)
        if paired:
            p_0 = T.alloc_fragment((hb, block_i), dtype)  # warpgroup 0's probabilities (GEMM A operand)
            acc_s_r = T.alloc_fragment((hb, block_i), acc)  # warpgroup 1: scores of stage 1, and so on
            p_1 = T.alloc_fragment((hb, block_i), dtype)
            m_r = T.alloc_fragment((hb,), acc)
            m_prev_r = T.alloc_fragment((hb,), acc)
            alpha_r = T.alloc_fragment((hb,), acc)
            sum_r = T.alloc_fragment((hb,), acc)
            sumexp_r = T.alloc_fragment((hb,), acc)
        else:
            p_0 = acc_s_r = p_1 = m_r = m_prev_r = alpha_r = sum_r = sumexp_r = None
        if paired and sink_max:
            # each warpgroup's exact max of its blocks' rows (the running max may lag it: lazy_gap)
            mx = T.alloc_fragment((hb,), acc)
            mx_r = T.alloc_fragment((hb,), acc)
        else:
            mx = mx_r = None
        return dict(
            acc_o=acc_o,
            acc_o_r=acc_o_r,
            acc_s=acc_s,
            m_i=m_i,
            m_prev=m_prev,
            alpha=alpha,
            sum_i=sum_i,
            sumexp=sumexp,
            p_0=p_0,
            acc_s_r=acc_s_r,
            p_1=p_1,
            m_r=m_r,
            m_prev_r=m_prev_r,
            alpha_r=alpha_r,
            sum_r=sum_r,
            sumexp_r=sumexp_r,
            mx=mx,
            mx_r=mx_r,
        )

    return fragments


def _barriers(plan: WsPlan):
    """The macro that allocates the kernel's mbarriers: each stage's ready and free barriers (per stage half with
    ``halves``), the consumers' hand-offs (paired: the running max and each one's probabilities; single: warpgroup
    0's probabilities), their end of a block, and q's arrival. Every name is returned; those of the other schemes
    are None."""
    halves, paired, ready_count = plan.halves, plan.paired, plan.ready_count

    @T.macro
    def barriers():
        if halves:
            # the left value half of a stage is last read by warpgroup 0, the right one with the
            # tail by warpgroup 1
            ready_l0 = T.alloc_barrier(arrive_count=ready_count)
            ready_r0 = T.alloc_barrier(arrive_count=ready_count)
            ready_l1 = T.alloc_barrier(arrive_count=ready_count)
            ready_r1 = T.alloc_barrier(arrive_count=ready_count)
            free_l0 = T.alloc_barrier(arrive_count=128)
            free_r0 = T.alloc_barrier(arrive_count=128)
            free_l1 = T.alloc_barrier(arrive_count=128)
            free_r1 = T.alloc_barrier(arrive_count=128)
            ready0 = ready1 = free0 = free1 = None
        else:
            ready0 = T.alloc_barrier(arrive_count=ready_count)
            ready1 = T.alloc_barrier(arrive_count=ready_count)
            free0 = T.alloc_barrier(arrive_count=256)
            free1 = T.alloc_barrier(arrive_count=256)
            ready_l0 = ready_r0 = ready_l1 = ready_r1 = free_l0 = free_r0 = free_l1 = free_r1 = None
        if paired:
            m0_ready = T.alloc_barrier(arrive_count=128)  # m_s holds warpgroup 0's max of the pair
            m1_ready = T.alloc_barrier(arrive_count=128)  # ... the pair's final max (warpgroup 1's)
            p0_ready = T.alloc_barrier(arrive_count=128)
            p1_ready = T.alloc_barrier(arrive_count=128)
            done0 = T.alloc_barrier(arrive_count=128)
            done1 = T.alloc_barrier(arrive_count=128)
            p_ready = p_free = done = None
        else:
            p_ready = T.alloc_barrier(arrive_count=128)
            p_free = T.alloc_barrier(arrive_count=128)
            done = T.alloc_barrier(arrive_count=128)
            m0_ready = m1_ready = p0_ready = p1_ready = done0 = done1 = None
        q_ready = T.alloc_barrier(arrive_count=256)
        return dict(
            ready_l0=ready_l0,
            ready_r0=ready_r0,
            ready_l1=ready_l1,
            ready_r1=ready_r1,
            free_l0=free_l0,
            free_r0=free_r0,
            free_l1=free_l1,
            free_r1=free_r1,
            ready0=ready0,
            ready1=ready1,
            free0=free0,
            free1=free1,
            m0_ready=m0_ready,
            m1_ready=m1_ready,
            p0_ready=p0_ready,
            p1_ready=p1_ready,
            done0=done0,
            done1=done1,
            p_ready=p_ready,
            p_free=p_free,
            done=done,
            q_ready=q_ready,
        )

    return barriers


def _work_item(plan: WsPlan, dims):
    """The macro that computes the work of CTA ``(bx, by)``: its token ``t``, first head ``h0``, the top-k blocks
    ``[first, first + walk)`` it walks (``n_blk`` of them hold entries before ``stop``, in ``pairs`` pairs) and its
    count of work items ``n_items``. A persistent kernel's warpgroups compute each item themselves (``work`` in
    :mod:`.ws_work`), so its item values are None."""
    geo, split, persist, block_i = plan.geo, plan.split, plan.persist, plan.block_i
    hb, groups, ctas = plan.hb, plan.groups, plan.ctas
    t_count, _, k_count, n_split = dims

    @T.macro
    def work_item(bx, by, topk_length):
        if persist:
            # each warpgroup walks the CTA's work items itself (see work): nothing here stays live into them
            t, h0, first, stop, n_blk, pairs, walk = None, None, None, None, None, None, None
        else:
            t = bx // groups
            h0 = (bx % groups) * hb
            n_valid = valid_entries(geo, topk_length, t, k_count)
            # this block's top-k blocks [first, first + 2 * pairs); entries at or past `stop` are invalid
            if split:
                per_split = T.ceildiv(k_count // block_i, n_split)
                first = by * per_split
                stop = T.min(n_valid, (first + per_split) * block_i)
            else:
                first, stop = 0, n_valid
            n_blk = T.max(T.ceildiv(stop, block_i) - first, 0)
            # pairs of blocks, one in each stage. A prefill kernel walks whole pairs: a last odd block has an empty
            # padding partner, so that its producer fills both stages of every pair with no branch on the block
            # count. A split kernel walks its blocks only (its producer tests each pair's second block): the splits
            # of a small top-k range are a few blocks each, where a padding block would be a large part of a split.
            pairs = T.ceildiv(n_blk, 2)
            walk = n_blk if split else 2 * pairs
        n_items = T.ceildiv(t_count * groups - bx, ctas) if persist else 1  # work items of this CTA (see work)
        return dict(t=t, h0=h0, first=first, stop=stop, n_blk=n_blk, pairs=pairs, walk=walk, n_items=n_items)

    return work_item


def _dispatch(plan: WsPlan, prod: SimpleNamespace, cons: SimpleNamespace):
    """The macro that sends each warpgroup of the CTA to its macro with its setmaxnreg budget (budgets: WS_NREG):
    threads 0-127 consumer warpgroup 0, 128-255 consumer warpgroup 1, the rest the producer warpgroups.

    Paired (the prefill of narrow bf16 rows): warpgroup 0 scores the block in stage 0 and warpgroup 1 the one in stage
    1, at the same time; each then computes PV for its half of the value width over both blocks, its own
    probabilities from registers and the other's from shared memory. The running max passes 0 -> 1 -> 0 once per pair
    (m_s), so each softmax overlaps the other warpgroup's GEMMs. Otherwise (single) warpgroup 0 scores every block and
    runs the softmax, and warpgroup 1 only its half of PV: a block is consumed as soon as it is ready, not a pair at a
    time. Over FP8 rows the producer paces the kernel, so the single scheme stays there: pairs, a column split (each
    warpgroup scoring half of a block's rows), q or the probabilities in registers, and the next block's score GEMMs
    issued before this block's softmax (two stages or three) do not make those kernels faster (BENCHMARKS.md)."""
    nreg = plan.nreg
    consume0 = cons.consume0_paired if plan.paired else cons.consume0_single
    consume1 = cons.consume1_paired if plan.paired else cons.consume1_single
    if plan.inplace:
        produce = prod.inplace
    elif plan.staged:
        produce = prod.staged
    elif plan.halves:
        produce = prod.halves
    else:
        produce = prod.bf16

    @T.macro
    def dispatch(c):
        if c.tx < 128:
            T.set_max_nreg(nreg[0], 1)
            consume0(c)
        elif c.tx >= 128 and c.tx < 256:
            T.set_max_nreg(nreg[1], 1)
            consume1(c)
        elif c.tx >= 256:
            T.set_max_nreg(nreg[2], 0)
            produce(c)

    return dispatch
