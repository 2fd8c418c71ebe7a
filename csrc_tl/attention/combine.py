"""The combine of a split decode: merges the normalized partials and LSEs of the splits."""

import tilelang.language as T

COMBINE_THREADS = 128
COMBINE_VEC = 8  # bf16 partial columns a combine thread loads at once (16 bytes)
# Splits whose partials a combine thread loads before it uses any (per chunk of splits): the loads of a
# chunk are in flight together, so a decode of up to this many splits reads its partials in one memory
# round trip rather than one per split.
COMBINE_CHUNK = 16


def build_combine(d_v: int, heads: int, part_heads: int, pdl: bool = False, sink: bool = False):  # noqa: C901 (one kernel body: its loads, folds and stores)
    """Merge split partials: ``(part_out [T, NS, part_heads, d_v] bf16, part_lse [T, NS, H] f32,
    [attn_sink [H] f32,] out [T, H, d_v] bf16, lse [T, H] f32, empty_lse f32)``; splits with lse -inf weigh nothing,
    and if all are -inf out is 0 and lse ``empty_lse`` (-inf in the ops' own convention, +inf in FlashMLA's).
    With ``sink``, ``exp(attn_sink[h])`` joins the denominator of ``out`` (not ``lse``):
    ``out = sum / (sum + exp(attn_sink - lse))`` in the merged terms, still 0 for an empty row.

    A head's row takes ``d_v / 8`` threads (several heads per block where that is under a block), each
    loading 8 columns; a thread loads the LSEs and columns of :data:`COMBINE_CHUNK` splits at once and
    folds the chunks into a running max (any NS works; splits past NS in the last chunk load nothing and
    weigh 0). With ``pdl`` (sm_90 CUDA only) the kernel is launched as a programmatic
    dependent of the split kernel before it (see :func:`build_attn_ws`) and waits for it to complete
    before it reads; then it lets the kernel after it launch (a programmatic dependent must wait
    likewise before it reads this one's output; kernels launched plainly wait for completion anyway)."""
    assert d_v % COMBINE_VEC == 0, "d_v must be a multiple of 8"
    assert part_heads >= heads, f"partials of {part_heads} head rows cannot hold {heads} heads"
    t_count, n_split = T.dynamic("t"), T.dynamic("ns")
    lanes = d_v // COMBINE_VEC  # 16-byte column vectors in a row
    row_threads = min(lanes, COMBINE_THREADS)
    vecs = T.ceildiv(lanes, row_threads)  # column vectors per thread
    per_block = COMBINE_THREADS // row_threads  # heads per block
    chunk = max(1, COMBINE_CHUNK // vecs)  # keeps a thread's loaded columns at 64 registers or fewer
    neg_inf = -T.infinity(T.float32)

    part_out_t = T.Tensor((t_count, n_split, part_heads, d_v), T.bfloat16)
    part_lse_t = T.Tensor((t_count, n_split, heads), T.float32)
    out_t = T.Tensor((t_count, heads, d_v), T.bfloat16)
    lse_t = T.Tensor((t_count, heads), T.float32)

    @T.macro
    def merge(part_out, part_lse, attn_sink, out, lse, empty_lse):
        with T.Kernel(T.ceildiv(heads, per_block), t_count, threads=COMBINE_THREADS) as (hx, t):
            if pdl:
                T.pdl_sync()
                # the kernel after this one may launch now (the next decode's split kernel, which waits
                # for this one's completion and memory before it reads anything): its launch overlaps this
                # kernel's loads
                T.pdl_trigger()
            tx = T.get_thread_binding()
            h = hx * per_block + tx // row_threads
            lane = tx % row_threads
            hc = T.min(h, heads - 1)  # threads past the last head (or row) load a real row and store nothing
            top = T.alloc_local((1,), T.float32)  # running max of the LSEs
            new_top = T.alloc_local((1,), T.float32)
            total = T.alloc_local((1,), T.float32)  # sum of exp(lse - top)
            acc = T.alloc_local((vecs, COMBINE_VEC), T.float32)
            w = T.alloc_local((chunk,), T.float32)
            vals = T.alloc_local((chunk, vecs, COMBINE_VEC), T.bfloat16)
            top[0] = neg_inf
            total[0] = 0.0
            for c in T.unroll(vecs):
                for v in T.unroll(COMBINE_VEC):
                    acc[c, v] = 0.0
            for ck in T.serial(T.ceildiv(n_split, chunk)):
                # every load of the chunk first
                for i in T.unroll(chunk):
                    sp = ck * chunk + i
                    w[i] = neg_inf
                    for c in T.unroll(vecs):
                        for v in T.unroll(COMBINE_VEC):
                            vals[i, c, v] = 0.0  # weighs 0: must not be a NaN left in a register
                    if sp < n_split:
                        w[i] = part_lse[t, sp, hc]
                        for c in T.unroll(vecs):
                            col = T.min((c * row_threads + lane) * COMBINE_VEC, d_v - COMBINE_VEC)
                            for v in T.vectorized(COMBINE_VEC):
                                vals[i, c, v] = part_out[t, sp, hc, col + v]
                new_top[0] = top[0]
                for i in T.unroll(chunk):
                    new_top[0] = T.max(new_top[0], w[i])
                if new_top[0] != neg_inf:  # else every split so far is empty: nothing to add
                    # exp(-inf - finite) is 0: the first non-empty chunk rescales the empty start to 0
                    total[0] = total[0] * T.exp(top[0] - new_top[0])
                    for c in T.unroll(vecs):
                        for v in T.unroll(COMBINE_VEC):
                            acc[c, v] = acc[c, v] * T.exp(top[0] - new_top[0])
                    for i in T.unroll(chunk):
                        w[i] = T.exp(w[i] - new_top[0])
                        total[0] = total[0] + w[i]
                        for c in T.unroll(vecs):
                            for v in T.unroll(COMBINE_VEC):
                                acc[c, v] = acc[c, v] + w[i] * T.cast(vals[i, c, v], T.float32)
                    top[0] = new_top[0]
            # one reciprocal per row (total is at least 1 unless every split is empty)
            if attn_sink is not None:  # the sink's term, exp(sink - top) in the merged scale, for out only
                scale = T.alloc_local((1,), T.float32)
                scale[0] = T.if_then_else(top[0] != neg_inf, 1.0 / (total[0] + T.exp(attn_sink[hc] - top[0])), 0.0)
            total[0] = T.if_then_else(top[0] != neg_inf, 1.0 / total[0], 0.0)
            if h < heads:
                for c in T.unroll(vecs):
                    col = (c * row_threads + lane) * COMBINE_VEC
                    if col < d_v:
                        for v in T.vectorized(COMBINE_VEC):
                            out[t, h, col + v] = T.cast(
                                acc[c, v] * (total[0] if attn_sink is None else scale[0]), T.bfloat16
                            )
                if lane == 0:
                    lse[t, h] = T.if_then_else(top[0] != neg_inf, top[0] - T.log(total[0]), empty_lse)

    if sink:

        @T.prim_func
        def combine(
            part_out: part_out_t,
            part_lse: part_lse_t,
            attn_sink: T.Tensor((heads,), T.float32),
            out: out_t,
            lse: lse_t,
            empty_lse: T.float32,
        ):
            merge(part_out, part_lse, attn_sink, out, lse, empty_lse)

        return combine

    @T.prim_func
    def combine(part_out: part_out_t, part_lse: part_lse_t, out: out_t, lse: lse_t, empty_lse: T.float32):
        merge(part_out, part_lse, None, out, lse, empty_lse)

    return combine
