"""Softmax steps, q loads and stores shared by the portable and the warp-specialized kernels, and the program entry
around a kernel's ``attend`` macro."""

import tilelang.language as T

from .geometry import LN2, LOG2E, AttnGeometry


def valid_entries(geo: AttnGeometry, topk_length, t, k_count):
    """The top-k entries of token ``t`` that count: ``topk_length[t]`` clamped into ``[0, K]``, or all ``K``."""
    return T.max(T.min(topk_length[t], k_count), 0) if geo.has_topk_length else k_count


@T.macro
def rescale(acc_o, alpha, flag=None):
    """``acc_o [hb, width]`` times ``alpha [hb]`` by rows; with a thread-local ``flag`` only in the threads
    whose rows have an ``alpha`` other than 1 (``lazy_gap`` in :func:`build_attn_ws`)."""
    hb, width = acc_o.shape
    if flag is None:
        for h, d in T.Parallel(hb, width):
            acc_o[h, d] = acc_o[h, d] * alpha[h]
    else:
        flag[0] = 0
        for h in T.Parallel(hb):
            if alpha[h] != 1.0:
                flag[0] = 1
        if flag[0] != 0:
            for h, d in T.Parallel(hb, width):
                acc_o[h, d] = acc_o[h, d] * alpha[h]


@T.macro
def exponentiate(acc_s, acc_o, m, alpha, sum_i, sumexp, scale2, flag=None):
    """Scores ``acc_s [hb, block_i]`` to probabilities against the max ``m``; the row sums ``sumexp`` and
    the output ``acc_o [hb, width]``, rescaled by ``alpha`` (the last max to ``m``), take them in."""
    hb, block_i = acc_s.shape
    for h, j in T.Parallel(hb, block_i):
        acc_s[h, j] = T.exp2(acc_s[h, j] * scale2 - m[h] * scale2)
    T.reduce_sum(acc_s, sum_i, dim=1)
    for h in T.Parallel(hb):
        sumexp[h] = sumexp[h] * alpha[h] + sum_i[h]
    rescale(acc_o, alpha, flag)


@T.macro
def online_softmax(acc_s, acc_o, m_i, m_prev, alpha, sum_i, sumexp, scale2):
    """Fold one block of raw scores ``acc_s [hb, block_i]`` into the running max ``m_i``, the running
    sum ``sumexp`` and the output accumulator ``acc_o [hb, width]``; ``acc_s`` becomes the block's
    unnormalized probabilities and ``alpha`` the factor the earlier blocks were rescaled by."""
    hb = acc_s.shape[0]
    T.copy(m_i, m_prev)
    T.reduce_max(acc_s, m_i, dim=1, clear=False)
    for h in T.Parallel(hb):
        m_i[h] = T.max(m_i[h], m_prev[h])
        alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale2)
    exponentiate(acc_s, acc_o, m_i, alpha, sum_i, sumexp, scale2)


@T.macro
def reciprocal(dst, sumexp, sink_w=None):
    """``dst[h] = 1 / (sumexp[h] + sink_w[h])`` (``sink_w`` 0 when None), or 0 for an empty row (sumexp 0)."""
    for h in T.Parallel(sumexp.shape[0]):
        if sink_w is None:
            dst[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0)
        else:
            dst[h] = T.if_then_else(sumexp[h] > 0, 1.0 / (sumexp[h] + sink_w[h]), 0)


@T.macro
def sink_weight(dst, attn_sink, m_i, h0, heads, scale2):
    """``dst[h] = exp(attn_sink[h0 + h] - m_i[h] * sm_scale)``: the sink's term of row h's denominator, relative to
    its running max ``m_i`` (raw score units) as the row sum is; 0 for a sink of -inf."""
    for h in T.Parallel(dst.shape[0]):
        dst[h] = T.exp2(attn_sink[T.min(h0 + h, heads - 1)] * LOG2E - m_i[h] * scale2)


@T.macro
def store_max(max_logits, m_i, sumexp, t, h0, heads, sm_scale):
    """``max_logits[t, h0 + h] = m_i[h] * sm_scale`` for the existing heads: the row's largest scaled score, where
    ``m_i`` is its exact max (raw score units); -inf for an empty row (sumexp 0)."""
    for h in T.Parallel(m_i.shape[0]):
        if h0 + h < heads:
            max_logits[t, h0 + h] = T.if_then_else(sumexp[h] > 0, m_i[h] * sm_scale, -T.infinity(T.float32))


@T.macro
def normalize(acc_o, lse, m_i, sumexp, scale2, sink_w=None):
    """Final output ``acc_o / (sumexp + sink_w)`` and natural-log ``lse`` (of ``sumexp`` alone: an attention sink
    joins the denominator of the output only); an empty row (sumexp 0) gives 0 and -inf.
    ``sumexp`` becomes the reciprocal: the output is scaled by one reciprocal per row, because a
    division per element (IEEE, each a dependent chain of several instructions) took about 2.5 us per
    block on an H200, which every block pays once at its end (BENCHMARKS.md). ``acc_o`` None: the rows are scaled
    where they are stored instead (``factor`` of :func:`store_rows`)."""
    hb = m_i.shape[0]
    for h in T.Parallel(hb):
        lse[h] = T.if_then_else(sumexp[h] > 0, (T.log2(sumexp[h]) + m_i[h] * scale2) * LN2, -T.infinity(T.float32))
    reciprocal(sumexp, sumexp, sink_w)
    if acc_o is not None:
        for h, d in T.Parallel(hb, acc_o.shape[1]):
            acc_o[h, d] = acc_o[h, d] * sumexp[h]


@T.macro
def store_rows(out, lse, acc_o, stage, row_lse, t, split_id, h0, col0, heads, group=None, factor=None):
    """Write this block's existing heads ``h0 + h < heads`` of ``acc_o [hb, width]`` to columns
    ``col0 + d`` of ``out`` and, unless ``lse`` is None, ``row_lse [hb]`` to ``lse``; a split kernel
    (``split_id`` not None) writes all ``hb`` rows into split ``split_id`` of its partial output, which
    has whole head blocks (:func:`partial_heads`). The rows are rounded to bf16 in the free shared tile
    ``stage`` first, for coalesced 16-byte stores: the split kernels' partials too (bf16 partials halve what the
    combine reads, and 16-byte stores take a quarter of the 8-byte ones' requests).

    ``group = (barrier id, threads)`` names the warpgroup of a warp-specialized split kernel that owns
    ``acc_o``: its partial goes through ``stage`` out of sight of TileLang's barrier planner
    (``T.address_of``), ordered by a named barrier of its own threads. Through ``T.copy`` the planner
    failed to lower several of these kernels (a sync "inside a divergent region", e.g. over packed
    256+0 rows at 100 heads); the kernel orders the stage's earlier readers itself (the consumers
    store after their last GEMM, the second warpgroup after the first's last score GEMM).

    ``factor [hb]`` (the transposed consumers'): ``acc_o`` is ``[width, hb]``, turned back into rows in ``stage`` times
    ``factor[h]`` (the normalization; see :func:`normalize`)."""
    hb, width = stage.shape
    if group is None:
        if factor is not None:
            for d, h in T.Parallel(width, hb):
                stage[h, d] = acc_o[d, h] * factor[h]
        else:
            T.copy(acc_o, stage)
    elif factor is not None:
        for d, h in T.Parallel(width, hb):
            T.call_extern("handle", "dsa_put_bf16", T.address_of(stage[h, d]), acc_o[d, h] * factor[h])
        T.call_extern("handle", "dsa_bar_sync", group[0], group[1])
    else:
        for h, d in T.Parallel(hb, width):
            T.call_extern("handle", "dsa_put_bf16", T.address_of(stage[h, d]), acc_o[h, d])
        T.call_extern("handle", "dsa_bar_sync", group[0], group[1])
    if split_id is None:
        for h, d in T.Parallel(hb, width):
            if h0 + h < heads:
                out[t, h0 + h, col0 + d] = stage[h, d]
    elif group is None:
        T.copy(stage, out[t, split_id, h0 : h0 + hb, col0 : col0 + width])
    else:
        per_row = width // 8
        tx = T.get_thread_binding() % group[1]
        for i in T.unroll(T.ceildiv(hb * per_row, group[1])):
            e = i * group[1] + tx
            h, d = e // per_row, e % per_row * 8
            if (hb * per_row) % group[1] == 0 or e < hb * per_row:
                T.call_extern(
                    "handle", "dsa_copy16", T.address_of(out[t, split_id, h0 + h, col0 + d]), T.address_of(stage[h, d])
                )
    if lse is not None:
        for h in T.Parallel(hb):
            if h0 + h < heads:
                if split_id is None:
                    lse[t, h0 + h] = row_lse[h]
                else:
                    lse[t, split_id, h0 + h] = row_lse[h]


@T.macro
def load_q(q, dst, t, h0, col0, heads, tid, nthreads):
    """``dst[h, d] = q[t, h0 + h, col0 + d]`` as bf16 (0 for heads past the last one), one vector of 8
    elements per thread and step, by the ``nthreads`` threads numbered ``tid``."""
    hb, width = dst.shape
    vecs, per_row = hb * width // 8, width // 8
    for i in T.unroll(T.ceildiv(vecs, nthreads)):
        e = i * nthreads + tid
        h, d = e // per_row, e % per_row * 8
        if vecs % nthreads == 0 or e < vecs:
            for v in T.vectorized(8):
                dst[h, d + v] = T.if_then_else(
                    h0 + h < heads, T.cast(q[t, T.min(h0 + h, heads - 1), col0 + d + v], dst.dtype), 0
                )


def entry(geo: AttnGeometry, attend, t_count, s_count, k_count, out_t, lse_t, sink_max: bool = False):
    """The program ``(q, kv, indices, [topk_length,] [attn_sink,] out, lse[, max_logits])`` around the ``attend``
    macro; ``sink_max`` adds ``attn_sink [H]`` and ``max_logits [T, H]`` (float32)."""
    q_t = T.Tensor((t_count, geo.heads, geo.d_qk), T.float8_e4m3fn if geo.q_fp8 else T.bfloat16)
    kv_t = T.Tensor((s_count, geo.kv_row_width), geo.kv_dtype)
    idx_t = T.Tensor((t_count, k_count), T.int32)
    len_t = T.Tensor((t_count,), T.int32)
    if sink_max:
        return _entry_sink_max(geo, attend, q_t, kv_t, idx_t, len_t, out_t, lse_t)
    if geo.has_topk_length:

        @T.prim_func
        def sparse_attn(q: q_t, kv: kv_t, indices: idx_t, topk_length: len_t, out: out_t, lse: lse_t):
            attend(q, kv, indices, topk_length, out, lse, None, None)

        return sparse_attn

    @T.prim_func
    def sparse_attn(q: q_t, kv: kv_t, indices: idx_t, out: out_t, lse: lse_t):
        attend(q, kv, indices, None, out, lse, None, None)

    return sparse_attn


def _entry_sink_max(geo: AttnGeometry, attend, q_t, kv_t, idx_t, len_t, out_t, lse_t):
    """The ``sink_max`` programs of :func:`entry`."""
    sink_t = T.Tensor((geo.heads,), T.float32)
    max_t = T.Tensor(lse_t.shape, T.float32)
    if geo.has_topk_length:

        @T.prim_func
        def sparse_attn(
            q: q_t,
            kv: kv_t,
            indices: idx_t,
            topk_length: len_t,
            attn_sink: sink_t,
            out: out_t,
            lse: lse_t,
            max_logits: max_t,
        ):
            attend(q, kv, indices, topk_length, out, lse, attn_sink, max_logits)

        return sparse_attn

    @T.prim_func
    def sparse_attn(q: q_t, kv: kv_t, indices: idx_t, attn_sink: sink_t, out: out_t, lse: lse_t, max_logits: max_t):
        attend(q, kv, indices, None, out, lse, attn_sink, max_logits)

    return sparse_attn
