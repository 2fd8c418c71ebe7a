"""The portable sparse-attention kernel (any TileLang target): one block per (token, head block) and, for decode,
per split of the top-k blocks; see :mod:`csrc_tl.attention` for the arguments."""

import tilelang.language as T

from ..layout import QUANT_TILE
from .common import entry, normalize, online_softmax, sink_weight, store_max, store_rows, valid_entries
from .geometry import LOG2E, NEG_START, AttnGeometry, head_block, partial_heads


def build_attn(
    geo: AttnGeometry,
    *,
    split: bool,
    block_i: int = 64,
    threads: int = 256,
    num_stages: int = 2,
    sink_max: bool = False,
):
    """The sparse-attention program for ``geo``; see the module docstring for its arguments (``sink_max``: the
    prefill variant with an attention sink and the row maxima, :class:`~csrc_tl.attention.keys.AttnKey`)."""
    geo.check()
    assert not (sink_max and split), "sink_max: the prefill kernel's"
    d_v, d_tail, heads = geo.d_v, geo.d_rope, geo.heads
    hb = head_block(heads)
    groups = T.ceildiv(heads, hb)
    scale2 = geo.sm_scale * LOG2E  # scores in the exp2 domain
    packed, row_w = geo.kv_kind == "packed", geo.kv_row_width
    if packed:
        scale_word, rope_half = geo.layout.scale_offset // 4, geo.layout.rope_offset // 2
    dtype, acc = T.bfloat16, T.float32

    t_count, s_count, k_count, n_split = T.dynamic("t"), T.dynamic("s"), T.dynamic("k"), T.dynamic("ns")

    @T.macro
    def attend(q, kv, indices, topk_length, out, lse, attn_sink, max_logits):
        with T.Kernel(t_count * groups, n_split if split else 1, threads=threads) as (bx, by):
            q_s = T.alloc_shared((hb, d_v), dtype)
            kv_s = T.alloc_shared((block_i, d_v), dtype)
            if d_tail:
                qt_s = T.alloc_shared((hb, d_tail), dtype)
                kt_s = T.alloc_shared((block_i, d_tail), dtype)
            p_s = T.alloc_shared((hb, block_i), dtype)
            idx_s = T.alloc_shared((block_i,), T.int32)
            ok_s = T.alloc_shared((block_i,), T.int32)
            acc_o = T.alloc_fragment((hb, d_v), acc)
            acc_s = T.alloc_fragment((hb, block_i), acc)
            m_i = T.alloc_fragment((hb,), acc)
            m_prev = T.alloc_fragment((hb,), acc)
            alpha = T.alloc_fragment((hb,), acc)
            sum_i = T.alloc_fragment((hb,), acc)
            sumexp = T.alloc_fragment((hb,), acc)

            t = bx // groups
            h0 = (bx % groups) * hb
            n_valid = valid_entries(geo, topk_length, t, k_count)
            n_blocks = T.ceildiv(n_valid, block_i)
            if split:
                per_split = T.ceildiv(k_count // block_i, n_split)
                first = by * per_split
                last = T.max(T.min(first + per_split, n_blocks), first)
            else:
                first, last = 0, n_blocks

            T.fill(acc_o, 0)
            T.fill(sumexp, 0)
            T.fill(m_i, NEG_START)
            for h, d in T.Parallel(hb, d_v):
                q_s[h, d] = T.if_then_else(h0 + h < heads, T.cast(q[t, T.min(h0 + h, heads - 1), d], dtype), 0)
            if d_tail:
                for h, d in T.Parallel(hb, d_tail):
                    qt_s[h, d] = T.if_then_else(
                        h0 + h < heads, T.cast(q[t, T.min(h0 + h, heads - 1), d_v + d], dtype), 0
                    )

            for blk in T.Pipelined(first, last, num_stages=num_stages):
                for j in T.Parallel(block_i):
                    raw = indices[t, blk * block_i + j]
                    ok = (raw >= 0) & (raw < s_count) & (blk * block_i + j < n_valid)
                    ok_s[j] = T.if_then_else(ok, 1, 0)
                    idx_s[j] = T.if_then_else(ok, raw, 0)
                if packed:
                    values = T.view(kv, (s_count, row_w), T.float8_e4m3fn)
                    scales = T.view(kv, (s_count, row_w // 4), T.float32)
                    for j, d in T.Parallel(block_i, d_v):
                        kv_s[j, d] = T.if_then_else(
                            ok_s[j] != 0,
                            T.cast(
                                T.cast(values[idx_s[j], d], acc) * scales[idx_s[j], scale_word + d // QUANT_TILE], dtype
                            ),
                            0,
                        )
                    if d_tail:
                        tails = T.view(kv, (s_count, row_w // 2), dtype)
                        for j, d in T.Parallel(block_i, d_tail):
                            kt_s[j, d] = T.if_then_else(ok_s[j] != 0, tails[idx_s[j], rope_half + d], 0)
                else:
                    for j, d in T.Parallel(block_i, d_v):
                        kv_s[j, d] = T.if_then_else(ok_s[j] != 0, T.cast(kv[idx_s[j], d], dtype), 0)
                    if d_tail:
                        for j, d in T.Parallel(block_i, d_tail):
                            kt_s[j, d] = T.if_then_else(ok_s[j] != 0, T.cast(kv[idx_s[j], d_v + d], dtype), 0)

                for h, j in T.Parallel(hb, block_i):
                    acc_s[h, j] = T.if_then_else(ok_s[j] != 0, 0, -T.infinity(acc))
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if d_tail:
                    T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                online_softmax(acc_s, acc_o, m_i, m_prev, alpha, sum_i, sumexp, scale2)
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # An empty row (sumexp 0) gives out 0 and lse -inf.
            if sink_max:
                store_max(max_logits, m_i, sumexp, t, h0, heads, geo.sm_scale)  # (m_i is exact here)
                sink_weight(alpha, attn_sink, m_i, h0, heads, scale2)
                normalize(acc_o, sum_i, m_i, sumexp, scale2, alpha)
            else:
                normalize(acc_o, sum_i, m_i, sumexp, scale2)
            store_rows(out, lse, acc_o, q_s, sum_i, t, by if split else None, h0, 0, heads)  # q_s is free now

    if split:
        out_t = T.Tensor((t_count, n_split, partial_heads(heads, ws=False), d_v), dtype)
        lse_t = T.Tensor((t_count, n_split, heads), acc)
    else:
        out_t = T.Tensor((t_count, heads, d_v), dtype)
        lse_t = T.Tensor((t_count, heads), acc)
    return entry(geo, attend, t_count, s_count, k_count, out_t, lse_t, sink_max)
