"""TileLang kernels of DeepSeek-style sparse attention over one latent KV head.

Two paths share one builder:

* prefill (``split=False``): one block per (token, head block); it walks the token's top-k list in
  blocks of ``block_i`` rows, gathers those rows into shared memory (zeros for invalid entries,
  which are never dereferenced), and runs an online softmax with exp2.
* decode (``split=True``): for few tokens one block per token leaves the GPU idle, so the top-k
  blocks are also split ``NS`` ways over the grid's second axis; each split writes a normalized
  partial output and its natural-log LSE, and :func:`build_combine` merges them.

Shapes (T tokens, H heads, K top-k entries, S pool rows, NS splits; all dynamic but H):
``q [T, H, d_qk]`` bf16 or float8_e4m3fn, ``kv [S, d_qk]`` bf16 or float8_e4m3fn (raw values) or packed
``[S, B] uint8``, ``indices [T, K] int32``
(K a multiple of ``block_i``), optional ``topk_length [T] int32``; prefill writes
``out [T, H, d_v] bf16`` and ``lse [T, H] float32``, decode writes ``part_out [T, NS, P, d_v] bf16`` (P =
:func:`partial_heads`: H rounded up to whole head blocks)
(normalized partials: their rounding adds at most one bf16 rounding, 2^-9 relative, to the merged
output, which the combine rounds once more) and ``part_lse [T, NS, H] float32``.

With ``d_rope == 0`` the tail is compiled out: no tail buffers, copies or GEMMs exist.

On Hopper, :func:`build_attn_ws` builds the same two paths warp-specialized, over blocks of 64 heads
(fewer heads are padded with zero rows of q, whose results are never stored): a
producer warpgroup gathers the next top-k block into one of two shared stages while warpgroup 0
runs the score GEMMs, the softmax and the left half of PV and warpgroup 1 the right half of PV;
for the prefill of bf16 rows the two consumer warpgroups instead score the two blocks of a pair side
by side (over 64-row blocks in FlashMLA's pipeline: stages in halves with barriers of their own, the
next pair's scores issued under the last PV GEMM). Where FP8 rows are staged raw (:func:`ws_staged`),
two producer warpgroups widen them; wider FP8 rows are copied raw into their own bf16 stage and
widened there. The prefill over bulk-copied packed rows (GLM's) is persistent: one CTA per SM walks tokens one
after another (:func:`ws_persistent`).

FP8 inputs (native float8_e4m3fn q or kv, and the values of a packed row) are widened to bf16 on
their way into shared memory and the GEMMs run in bf16: every e4m3 value is exactly a bf16 value,
so this adds no error. The FP8 tensor-core path is not used: it would need the probabilities in
FP8 for the PV product (3 mantissa bits, about 6% per entry), and with FP8 rows the kernels are
bound by the producer's gather and widening, not by the tensor cores (BENCHMARKS.md).
"""

from dataclasses import dataclass

import tilelang.language as T

from .layout import QUANT_TILE, KCacheLayout

__all__ = ["AttnGeometry", "DEFAULT_TILES", "DEFAULT_CTAS", "head_block", "partial_heads", "ws_supported", "ws_block",
           "ws_persistent", "ws_inplace_raw_col", "ws_quarters", "build_attn", "build_attn_ws", "build_combine"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_START = -(2.0**30)  # running max before any valid score: exp2 of (-inf - NEG_START) is 0, never NaN
MAX_HEAD_BLOCK = 64  # heads one block (one GEMM M tile) handles
MIN_HEAD_BLOCK = 16  # smallest M tile of the tensor-core GEMMs


@dataclass(frozen=True)
class AttnGeometry:
    """Everything a sparse-attention kernel is specialized on (besides tile parameters)."""

    d_v: int  # value / NoPE width: a multiple of 64 (of 128 for packed kv)
    d_rope: int  # RoPE tail width, 0 for none
    heads: int  # 1..128
    kv_kind: str  # "bf16", "fp8" (raw float8_e4m3fn values) or "packed" (uint8 FP8 rows)
    has_topk_length: bool
    sm_scale: float
    q_fp8: bool = False  # q is float8_e4m3fn (allowed with fp8 or packed kv) instead of bf16

    @property
    def d_qk(self) -> int:
        return self.d_v + self.d_rope

    @property
    def layout(self) -> KCacheLayout | None:
        """The packed row of a ``packed`` pool (d_nope = d_v); None for bf16 rows."""
        return KCacheLayout(self.d_v, self.d_rope) if self.kv_kind == "packed" else None

    @property
    def kv_row_width(self) -> int:
        """Elements (bf16, fp8) or bytes (packed) in one pool row."""
        return self.layout.row_bytes if self.kv_kind == "packed" else self.d_qk

    @property
    def kv_dtype(self):
        return {"bf16": T.bfloat16, "fp8": T.float8_e4m3fn, "packed": T.uint8}[self.kv_kind]

    def __str__(self) -> str:
        tail = ("_len" if self.has_topk_length else "") + ("_qfp8" if self.q_fp8 else "")
        return f"{self.kv_kind}_{self.d_v}p{self.d_rope}_h{self.heads}{tail}"

    def check(self):
        assert self.kv_kind in ("bf16", "fp8", "packed"), f"unknown kv kind {self.kv_kind}"
        assert not (self.q_fp8 and self.kv_kind == "bf16"), "float8 q needs fp8 or packed kv"
        assert 1 <= self.heads <= 128, "heads must be in 1..128"
        assert self.d_v % 64 == 0, "d_v must be a multiple of 64 (GEMM N/K tiles)"
        assert self.d_rope % 16 == 0, "d_rope must be a multiple of 16 (GEMM K tile)"


# Default tile parameters, by path; (block_i, threads, num_stages).
DEFAULT_TILES = {"prefill": dict(block_i=64, threads=256, num_stages=2), "decode": dict(block_i=64, threads=256,
                                                                                       num_stages=2)}


def head_block(heads: int) -> int:
    """Heads per block: the next power of two, at least 16 (a tensor-core M tile), at most 64."""
    block = MIN_HEAD_BLOCK
    while block < min(heads, MAX_HEAD_BLOCK):
        block *= 2
    return block


def partial_heads(heads: int, ws: bool) -> int:
    """Head rows of a split kernel's partial output: whole head blocks (the heads rounded up to a
    multiple of :func:`head_block`, or of 64 for the warp-specialized kernel ``ws``), so that every
    block stores its whole tile unguarded; the combine reads the first ``heads`` rows."""
    block = MAX_HEAD_BLOCK if ws else head_block(heads)
    return -(-heads // block) * block


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
def reciprocal(dst, sumexp):
    """``dst[h] = 1 / sumexp[h]``, or 0 for an empty row (sumexp 0)."""
    for h in T.Parallel(sumexp.shape[0]):
        dst[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0)


@T.macro
def normalize(acc_o, lse, m_i, sumexp, scale2):
    """Final output ``acc_o / sumexp`` and natural-log ``lse``; an empty row (sumexp 0) gives 0 and -inf.
    ``sumexp`` becomes its reciprocal: the output is scaled by one reciprocal per row, because a
    division per element (IEEE, each a dependent chain of several instructions) took about 2.5 us per
    block on an H200, which every block pays once at its end (BENCHMARKS.md, tenth session)."""
    hb, width = acc_o.shape
    for h in T.Parallel(hb):
        lse[h] = T.if_then_else(sumexp[h] > 0, (T.log2(sumexp[h]) + m_i[h] * scale2) * LN2,
                                -T.infinity(T.float32))
    reciprocal(sumexp, sumexp)
    for h, d in T.Parallel(hb, width):
        acc_o[h, d] = acc_o[h, d] * sumexp[h]


@T.macro
def store_rows(out, lse, acc_o, stage, row_lse, t, split_id, h0, col0, heads, group=None):
    """Write this block's existing heads ``h0 + h < heads`` of ``acc_o [hb, width]`` to columns
    ``col0 + d`` of ``out`` and, unless ``lse`` is None, ``row_lse [hb]`` to ``lse``; a split kernel
    (``split_id`` not None) writes all ``hb`` rows into split ``split_id`` of its partial output, which
    has whole head blocks (:func:`partial_heads`). The rows are rounded to bf16 in the free shared tile
    ``stage`` first, for coalesced 16-byte stores: the split kernels' partials too (stored from the
    fragment in float32, 8 bytes per thread and row, they and the combine's reads of them took ~1.5 us
    of a GLM decode at T 17 on an H200: BENCHMARKS.md, sixteenth session).

    ``group = (barrier id, threads)`` names the warpgroup of a warp-specialized split kernel that owns
    ``acc_o``: its partial goes through ``stage`` out of sight of TileLang's barrier planner
    (``T.address_of``), ordered by a named barrier of its own threads. Through ``T.copy`` the planner
    failed to lower several of these kernels (a sync "inside a divergent region", e.g. over packed
    256+0 rows at 100 heads); the kernel orders the stage's earlier readers itself (the consumers
    store after their last GEMM, the second warpgroup after the first's last score GEMM)."""
    hb, width = acc_o.shape
    if group is None:
        T.copy(acc_o, stage)
    else:
        for h, d in T.Parallel(hb, width):
            T.call_extern("handle", "dsa_put_bf16", T.address_of(stage[h, d]), acc_o[h, d])
        T.call_extern("handle", "dsa_bar_sync", group[0], group[1])
    if split_id is None:
        for h, d in T.Parallel(hb, width):
            if h0 + h < heads:
                out[t, h0 + h, col0 + d] = stage[h, d]
    elif group is None:
        T.copy(stage, out[t, split_id, h0:h0 + hb, col0:col0 + width])
    else:
        per_row = width // 8
        tx = T.get_thread_binding() % group[1]
        for i in T.unroll(T.ceildiv(hb * per_row, group[1])):
            e = i * group[1] + tx
            h, d = e // per_row, e % per_row * 8
            if (hb * per_row) % group[1] == 0 or e < hb * per_row:
                T.call_extern("handle", "dsa_copy16", T.address_of(out[t, split_id, h0 + h, col0 + d]),
                              T.address_of(stage[h, d]))
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
                dst[h, d + v] = T.if_then_else(h0 + h < heads, T.cast(q[t, T.min(h0 + h, heads - 1), col0 + d + v],
                                                                      dst.dtype), 0)


def ws_supported(geo: AttnGeometry) -> bool:
    """Whether :func:`build_attn_ws` handles ``geo`` (it also needs an sm_90 CUDA target). Any head
    count: under 64 heads (tensor-parallel shards: 8 or 16 heads) the block is padded with zero rows of
    q, and the kernel still takes the time of a 64-head block, which its producer's per-row gather and
    widening bound, not the GEMMs. The portable kernels over 8- or 16-head blocks took up to 3.7 times as
    long (in nine of ten cases longer; 1-4% shorter at DeepSeek packed T 1, 16 heads: H200,
    BENCHMARKS.md, nineteenth session)."""
    # each half of a row takes whole 16-byte chunks of the eight threads of a row: 2 x 8 x 8 bf16
    # values or 2 x 8 x 16 FP8 values (a narrower FP8 row would leave the producer nothing to do)
    width = 128 if geo.kv_kind == "bf16" else 256
    return geo.d_v % width == 0 and geo.d_rope in (0, 64)


def build_attn(geo: AttnGeometry, *, split: bool, block_i: int = 64, threads: int = 256, num_stages: int = 2):
    """The sparse-attention program for ``geo``; see the module docstring for its arguments."""
    geo.check()
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
    def attend(q, kv, indices, topk_length, out, lse):
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
                    qt_s[h, d] = T.if_then_else(h0 + h < heads, T.cast(q[t, T.min(h0 + h, heads - 1), d_v + d], dtype),
                                                0)

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
                            T.cast(T.cast(values[idx_s[j], d], acc) * scales[idx_s[j], scale_word + d // QUANT_TILE],
                                   dtype), 0)
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
            normalize(acc_o, sum_i, m_i, sumexp, scale2)
            store_rows(out, lse, acc_o, q_s, sum_i, t, by if split else None, h0, 0, heads)  # q_s is free now

    if split:
        out_t = T.Tensor((t_count, n_split, partial_heads(heads, ws=False), d_v), dtype)
        lse_t = T.Tensor((t_count, n_split, heads), acc)
    else:
        out_t = T.Tensor((t_count, heads, d_v), dtype)
        lse_t = T.Tensor((t_count, heads), acc)
    return _entry(geo, attend, t_count, s_count, k_count, out_t, lse_t)


def _entry(geo: AttnGeometry, attend, t_count, s_count, k_count, out_t, lse_t):
    """The program ``(q, kv, indices, [topk_length,] out, lse)`` around the ``attend`` macro."""
    q_t = T.Tensor((t_count, geo.heads, geo.d_qk), T.float8_e4m3fn if geo.q_fp8 else T.bfloat16)
    kv_t = T.Tensor((s_count, geo.kv_row_width), geo.kv_dtype)
    idx_t = T.Tensor((t_count, k_count), T.int32)
    len_t = T.Tensor((t_count,), T.int32)
    if geo.has_topk_length:

        @T.prim_func
        def sparse_attn(q: q_t, kv: kv_t, indices: idx_t, topk_length: len_t, out: out_t, lse: lse_t):
            attend(q, kv, indices, topk_length, out, lse)

        return sparse_attn

    @T.prim_func
    def sparse_attn(q: q_t, kv: kv_t, indices: idx_t, out: out_t, lse: lse_t):
        attend(q, kv, indices, None, out, lse)

    return sparse_attn


COMBINE_THREADS = 128
COMBINE_VEC = 8  # bf16 partial columns a combine thread loads at once (16 bytes)
# Splits whose partials a combine thread loads before it uses any (per chunk of splits): the loads of a
# chunk are in flight together, so a decode of up to this many splits reads its partials in one memory
# round trip. The first combine looped over the splits one load after another (H200: ~2-3.5 us of a
# GLM decode after the split kernel; BENCHMARKS.md, sixteenth session).
COMBINE_CHUNK = 16


def build_combine(d_v: int, heads: int, part_heads: int, pdl: bool = False):
    """Merge split partials: ``(part_out [T, NS, part_heads, d_v] bf16, part_lse [T, NS, H] f32,
    out [T, H, d_v] bf16, lse [T, H] f32)``; splits with lse -inf weigh nothing, and if all are -inf out
    is 0 and lse -inf.

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

    @T.prim_func
    def combine(part_out: T.Tensor((t_count, n_split, part_heads, d_v), T.bfloat16),
                part_lse: T.Tensor((t_count, n_split, heads), T.float32),
                out: T.Tensor((t_count, heads, d_v), T.bfloat16), lse: T.Tensor((t_count, heads), T.float32)):
        with T.Kernel(T.ceildiv(heads, per_block), t_count, threads=COMBINE_THREADS) as (hx, t):
            if pdl:
                T.pdl_sync()
                # the kernel after this one may launch now (the next decode's split kernel, which waits
                # for this one's completion and memory before it reads anything). Measured (H200,
                # BENCHMARKS.md, eighteenth session, with the split kernel's trigger after its stores):
                # GLM packed decode T 17 14.5-14.7 against 14.8-15.2 us, T 1 8.0-8.2 against 8.3-8.5
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
            total[0] = T.if_then_else(top[0] != neg_inf, 1.0 / total[0], 0.0)
            if h < heads:
                for c in T.unroll(vecs):
                    col = (c * row_threads + lane) * COMBINE_VEC
                    if col < d_v:
                        for v in T.vectorized(COMBINE_VEC):
                            out[t, h, col + v] = T.cast(acc[c, v] * total[0], T.bfloat16)
                if lane == 0:
                    lse[t, h] = T.if_then_else(top[0] != neg_inf, top[0] - T.log(total[0]), neg_inf)

    return combine


# setmaxnreg budgets per thread (consumer warpgroup 0, consumer warpgroup 1, each producer
# warpgroup), by consumer scheme (see build_attn_ws) and producer count. They must fit the registers
# the CTA launched with: 3 x 168 with one producer (a request beyond that hangs the kernel), 4 x 128
# with two; the consumers' budgets are increases from the launch count and the producers' decreases
# (a consumer budget below it is an illegal instruction: H200, eighteenth session).
# The in-place producer (512+64 FP8 rows) keeps the copies of WS_INPLACE_AHEAD passes in flight: at 80
# registers ptxas spilled 12-16 bytes in its kernels with topk_length (CPU test), at 88 none. Where
# consumer warpgroup 1 widens a pass of each block too ("inplace_wg1", see build_attn_ws), it holds its
# 64 x 256 accumulator while it widens: at 168 it spilled, at 184 none (sm_90a, 16 and 128 heads); the
# producer spilled 20 bytes at 88 over 512+0 rows, at 96 none. The split kernels over 512+0 rows keep the old scheme:
# with topk_length their producer spilled 20 bytes at 96, and every other split of the 504 registers spilled in some
# geometry (216 / 184 / 104 and 224 / 176 / 104: 4-8 bytes in the 512+64 split kernels).
WS_NREG = {("paired", 1): (208, 224, 72), ("single", 1): (240, 168, 80), ("single", 2): (208, 144, 80),
           ("inplace", 1): (240, 168, 88), ("inplace_wg1", 1): (224, 184, 96)}


def check_ws_nreg(nreg: tuple[int, int, int], producers: int) -> None:
    """Assert that setmaxnreg budgets ``nreg`` (see :data:`WS_NREG`) fit a CTA of two consumer
    warpgroups and ``producers`` producer warpgroups: each a multiple of 8 in [24, 256], the consumers'
    at least and the producers' at most the registers a thread launches with, and their total within
    the CTA's."""
    launch = 65536 // (128 * (2 + producers)) // 8 * 8  # registers a thread of the CTA launches with
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in nreg), f"budgets {nreg}: multiples of 8 in [24, 256]"
    assert nreg[0] >= launch and nreg[1] >= launch and nreg[2] <= launch, f"budgets {nreg} against {launch}"
    assert nreg[0] + nreg[1] + producers * nreg[2] <= (2 + producers) * launch, f"budgets {nreg} exceed the CTA's"
WS_THREADS_PER_ROW = 8


def ws_row_lane(tx, quarters: bool):
    """``(row, lane)`` of producer thread ``tx`` in one pass of :func:`build_attn_ws` (an int or a TIR
    expression): each row of a pass has eight lanes. Eight consecutive threads take one row, or with
    ``quarters`` a quarter warp (the eight threads one 16-byte shared-memory access serves at once) takes
    lanes 0-3 or 4-7 of two adjacent rows.

    Why quarters: a lane of an FP8 row widens 16-value chunks into 32 bytes of the bf16 stage, whose
    128-byte swizzle puts lanes 0-3 and 4-7 of a row (two 64-wide atoms) on the same banks, so the eight
    lanes of one row store each 16-byte half in two wavefronts (ncu, GLM packed prefill: STS.128 at
    twice their ideal wavefronts, 13% of the kernel's shared-memory wavefronts); lanes 0-3 of two rows,
    which differ in the swizzle's lowest bit, store it in one."""
    if quarters:
        return tx // 16 * 2 + tx // 4 % 2, tx % 4 + tx // 8 % 2 * 4
    return tx // WS_THREADS_PER_ROW, tx % WS_THREADS_PER_ROW


def ws_inplace_raw_col(group: int, lane):
    """Stage column where lane ``lane`` (0-7; an int or a TIR expression) of a row copies its 16 raw FP8
    values of 128-value ``group`` of a value half, for the in-place producer of :func:`build_attn_ws`.
    Lane ``l`` widens values ``128 * group + 16 * l`` to ``+ 16`` into the columns of the same numbers, so a
    group takes two 64-column (128-byte) lines of its row widened; its 128 raw bytes go into the second
    line, the eight lanes' side by side, and lanes 4-7 widen over them once every lane of the warp has
    loaded its own (``dsa_widen`` with ``kSync``; the eight lanes of a row are in one warp).

    Why: with each lane's raw bytes in the second half of its own 32 widened bytes, every 16-byte copy
    took a shared-memory wavefront of its own (ncu, DeepSeek packed decode T 256: 32 wavefronts per
    warp-wide cp.async where 4 carry its 512 bytes); contiguous, the copies take whole lines. Measured
    (H200, BENCHMARKS.md, twenty-first session, run EG): DeepSeek packed decode T 256 381-385 against
    426-427 us, DeepSeek native FP8 prefill 5092-5148 against 5628-5634 us."""
    line = 8 * WS_THREADS_PER_ROW  # bf16 columns of one 128-byte line
    return group * 2 * line + line + lane * 8


def ws_block(geo: AttnGeometry, split: bool) -> int:
    """Top-k rows per block of :func:`build_attn_ws`: 128 for the prefill of narrow bf16 or native FP8
    rows (two bf16 stages of 128 rows still fit beside q, and for FP8 rows two raw stages of
    :data:`WS_RAW_ROWS`; halves the score GEMMs' re-reads of q per row) and of narrow packed rows copied
    by the TMA unit (:func:`ws_bulk`), else 64. The split kernel keeps 64: its splits are whole blocks of
    the top-k range.

    Measured (H200, BENCHMARKS.md, twenty-second session, run EK, two rounds): GLM native FP8 prefill
    1288 against 1422-1424 us at 128-row blocks; GLM packed prefill with cp.async copies 1632-1633 against
    1582-1585 (at 8 heads 1601-1602 against 1555-1556), so packed rows copied that way keep 64."""
    if split or geo.d_qk > 256:
        return 64
    if geo.kv_kind == "packed":
        return 128 if ws_bulk(geo, split, 128) else 64
    return 128 if geo.kv_kind == "bf16" or ws_staged(geo, 128) else 64


# Paired consumer warpgroups hand each other their final row sums through a static shared array that
# TileLang does not see: its barrier planner would try to separate the two warpgroups' accesses with
# a barrier inside one of them, which it fails to lower for some kernels; the done mbarriers order
# them instead.
WS_PRELUDE = """
__device__ __forceinline__ float* dsa_row_sums() { __shared__ float sums[2 * 64]; return sums; }
__device__ __forceinline__ void dsa_put_row_sum(int i, float v) { dsa_row_sums()[i] = v; }
__device__ __forceinline__ float dsa_row_sum(int i) { return dsa_row_sums()[i]; }
"""

# The conversion of FP8 values to bf16 in the producers of build_attn_ws (WS_WIDEN, WS_BULK): e4m3 -> f16 is
# exact, f16 -> f32 too; the scale multiply and the rounding to bf16 are those of the reference's
# dequantization.
WS_CONVERT = """
__device__ __forceinline__ unsigned dsa_bf16x2(unsigned short fp8x2, float scale, bool scaled) {
  unsigned h, r;
  float lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(fp8x2));
  asm("{.reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b;}" : "=f"(lo), "=f"(hi) : "r"(h));
  if (scaled) { lo *= scale; hi *= scale; }
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 8 FP8 values (two 32-bit words) to 8 bf16 values (16 bytes)
__device__ __forceinline__ uint4 dsa_widen8(unsigned w0, unsigned w1, float scale, bool scaled) {
  return make_uint4(dsa_bf16x2(w0 & 0xffff, scale, scaled), dsa_bf16x2(w0 >> 16, scale, scaled),
                    dsa_bf16x2(w1 & 0xffff, scale, scaled), dsa_bf16x2(w1 >> 16, scale, scaled));
}
"""

# The widening of FP8 rows in the producer of build_attn_ws (staged rows: from their raw stage; other
# rows in place, where the raw values of a row's 128-value group lie in the second of the two lines the
# group takes widened: see ws_inplace_raw_col), through WS_CONVERT.
WS_WIDEN = """
// Chunks of 16 FP8 values, each given as (raw, d0, d1, scale): raw points to its 16 raw values, d0 and
// d1 to the two 8-value bf16 halves it takes widened in a stage.
// Every chunk's raw values are loaded before any chunk is stored, so the shared-memory loads are in
// flight together. kSync: in place, where other lanes of the warp widen over a chunk's raw values
// (ws_inplace_raw_col), the warp synchronizes between its lanes' loads and their stores.
template <bool kScaled, bool kSync>
__device__ __forceinline__ void dsa_widen() {
  if constexpr (kSync) __syncwarp();
}
template <bool kScaled, bool kSync, typename... Rest>
__device__ __forceinline__ void dsa_widen(const void* raw, void* d0, void* d1, float scale, Rest... rest) {
  uint4 v = *reinterpret_cast<const uint4*>(raw);
  dsa_widen<kScaled, kSync>(rest...);
  *reinterpret_cast<uint4*>(d0) = dsa_widen8(v.x, v.y, scale, kScaled);
  *reinterpret_cast<uint4*>(d1) = dsa_widen8(v.z, v.w, scale, kScaled);
}
// wait until at most n of this thread's cp.async groups are pending (n a constant after unrolling)
__device__ __forceinline__ void dsa_cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
  }
}
// the 8 raw FP8 tail values at the start of a 16-byte tail chunk, widened over it
__device__ __forceinline__ void dsa_widen_tail_inplace(void* t) {
  uint2 raw = *reinterpret_cast<const uint2*>(t);
  *reinterpret_cast<uint4*>(t) = dsa_widen8(raw.x, raw.y, 1.0f, false);
}
"""

WS_COPY = """
// Stores and copies of the in-place and halves producers addressed with T.address_of, out of sight
// of TileLang's barrier planner (see produce_inplace): a flag, and a cp.async of N bytes (zeros where
// pred is false).
__device__ __forceinline__ void dsa_put_flag(int* p, int v) { *p = v; }
template <int N>
__device__ __forceinline__ void dsa_cp_async(void* smem, const void* gmem, bool pred) {
  unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(gmem), "r"(pred ? 16 : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                 :: "r"(a), "l"(gmem), "n"(N), "r"(pred ? N : 0) : "memory");
  }
}
"""

# The staged producer's copies of packed rows by the TMA unit (ws_bulk): one bulk copy per row, issued by the
# row's first lane, completing on the raw stage's mbarrier; other lanes only zero their chunks of an invalid
# row (no copy lands there).
WS_BULK = """
// A packed row's kBytes FP8 values (rows 8-byte aligned, at least 8 bytes of scales after the values) by
// one bulk copy into its raw slot (16-byte aligned). A row whose start lies 8 bytes past a 16-byte
// boundary is copied from that boundary, kBytes + 16 bytes (the previous row's scales first, its own
// last), so its values land 8 bytes into the slot; the pool's first row has no row before it (a pool that
// starts 8 bytes past a boundary): its first 8 values are stored by the issuing lane itself and the copy
// starts 8 bytes into the row. The issuing lane arrives on `bar` expecting the copy's bytes (an invalid
// row: a plain arrival). Every lane returns its row's flag: 0 invalid, 1 + (values 8 bytes in).
template <int kBytes, int kRowBytes>
__device__ __forceinline__ int dsa_bulk_row(void* slot, const void* pool, int index, void* bar, bool issuer, bool ok) {
  const char* row = reinterpret_cast<const char*>(pool) + (long long)index * kRowBytes;
  unsigned shift = (unsigned)(reinterpret_cast<unsigned long long>(row) & 15);
  if (issuer) {
    unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    if (ok) {
      unsigned s = (unsigned)__cvta_generic_to_shared(slot), n = kBytes + 2 * shift;
      // (selects, not a branch: with a branch here the prefill took 1545 against 1529 us, BENCHMARKS.md run EZ)
      bool head = shift != 0 && index == 0;
      const char* src = head ? row + 8 : row - shift;
      s += head ? 16 : 0;
      n = head ? kBytes : n;
      if (head) *reinterpret_cast<uint2*>(reinterpret_cast<char*>(slot) + 8) = *reinterpret_cast<const uint2*>(row);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(n) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(s), "l"(src), "r"(n), "r"(b) : "memory");
    } else {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
    }
  }
  return ok ? 1 + int(shift >> 3) : 0;
}
// 16 zero bytes where a lane widens a chunk of an invalid row (its slot holds stale bytes, maybe NaN codes)
__device__ __forceinline__ void dsa_zero16(void* p, bool ok) {
  if (!ok) *reinterpret_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
}
// 16 FP8 values at raw (8-byte aligned: the row may lie 8 bytes into its slot) times scale, widened into 8
// bf16 values at d0 and 8 at d1 (WS_CONVERT)
__device__ __forceinline__ void dsa_widen_bulk(const void* raw, void* d0, void* d1, float scale) {
  const uint2* r = reinterpret_cast<const uint2*>(raw);
  uint2 a = r[0], b = r[1];
  *reinterpret_cast<uint4*>(d0) = dsa_widen8(a.x, a.y, scale, true);
  *reinterpret_cast<uint4*>(d1) = dsa_widen8(b.x, b.y, scale, true);
}
// The lanes of a warp (which hold whole rows) are done reading their raw slots through the generic proxy
// before the bulk copies (async proxy) refill them.
__device__ __forceinline__ void dsa_bulk_reuse() {
  __syncwarp();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
"""

# The split kernels' partial stores (store_rows with a warpgroup): bf16 values into a shared tile, a named
# barrier of one warpgroup, 16-byte copies to global memory.
# A named barrier of ``n`` threads (the split kernels' stores, the persistent kernels' consumers between items).
WS_BAR_SYNC = """__device__ __forceinline__ void dsa_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
"""
WS_STORE = """
__device__ __forceinline__ void dsa_put_bf16(void* p, float v) {
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  *reinterpret_cast<unsigned short*>(p) = b;
}
""" + WS_BAR_SYNC + """__device__ __forceinline__ void dsa_copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""
# (named barrier id, threads) of the two consumer warpgroups together, between the work items of a persistent kernel
WS_CONSUMER_BARRIER = (13, 256)
# Helpers of the persistent kernels: the consumers' barrier between work items, and an index load at a computed offset
# (load_index).
WS_PERSIST = ("\n" + WS_BAR_SYNC + "__device__ __forceinline__ int dsa_ld_index(const int* indices, long long offset) "
              "{ return indices[offset]; }\n")
# CTAs of a persistent kernel (build_attn_ws) unless given: the SM count of an H200 or H100 SXM
DEFAULT_CTAS = 132
# (named barrier id, threads) of the two consumer warpgroups' partial stores: ids above the few TileLang
# numbers its own partial syncs with (1-5 in these kernels)
WS_STORE_BARRIERS = ((14, 128), (15, 128))

SMEM_LIMIT = 227 * 1024  # dynamic shared memory one sm_90 block may use
# Passes of a block whose copies the in-place producer (produce_inplace in build_attn_ws) issues before it
# widens the first: the issue of a block's copies takes about as long as their widening (clock64 stamps,
# DeepSeek packed T 256: 2290 and 2730 cycles a block). Measured (H200, BENCHMARKS.md, twentieth session,
# one call, two rounds): DeepSeek packed decode T 256 440 against 447 us with every pass issued first,
# DeepSeek fp8 prefill 5517-5518 against 5572-5589 us; one pass ahead 448 / 5569.
WS_INPLACE_AHEAD = 2
# Bytes after each row of a raw FP8 stage (with `quarters` in build_attn_ws): the two rows a quarter
# warp reads or writes at once then lie on different banks.
RAW_PAD = 64
# Rows of a raw FP8 stage: the staged producer fills a bf16 stage of 128 rows from two 64-row raw copies
# (the second copied while the first is widened), so that two 128-row stages fit beside q.
WS_RAW_ROWS = 64


def ws_staged(geo: AttnGeometry, block_i: int = 64) -> bool:
    """Whether :func:`build_attn_ws` stages FP8 rows raw, for blocks of ``block_i`` rows: the producer
    copies the next :data:`WS_RAW_ROWS` rows (or the next block, if smaller) into one of two raw shared
    buffers by cp.async (no registers, no wait) while it widens the current ones shared-to-shared, so
    the gather runs behind the widening. Needs the raw stages to fit beside q and the two bf16 stages:
    the 256-wide rows fit (at 128-row blocks too), the 512+64 rows do not (they are widened in place, in
    their bf16 stage)."""
    if geo.kv_kind == "bf16":
        return False
    hb, d_qk = MAX_HEAD_BLOCK, geo.d_qk
    # scales go to registers; RAW_PAD is counted for every kernel, though only those with quarters pad
    raw_row = geo.d_v + RAW_PAD + geo.d_rope * (2 if geo.kv_kind == "packed" else 1)
    raw_rows = min(block_i, WS_RAW_ROWS)
    return 2 * hb * d_qk + 2 * 2 * block_i * d_qk + 2 * raw_rows * raw_row + 2 * hb * block_i + 4096 <= SMEM_LIMIT


def ws_quarters(geo: AttnGeometry, split: bool, block_i: int = 64) -> bool:
    """Whether the producer of :func:`build_attn_ws` maps its threads to rows by quarter warps
    (:func:`ws_row_lane`): for every FP8 kernel but the prefill over staged packed rows copied by
    ``cp.async`` (:func:`ws_bulk`). bf16 rows are copied straight into the stage, 16 bytes per lane: no
    conflict either way.

    Measured (H200, BENCHMARKS.md): quarters are faster for native FP8 rows (twelfth session: GLM prefill
    375 against 358 TFLOPS, DeepSeek 404 against 388; GLM decode T 17 16.6 against 17.0 us), for the split
    kernel over packed rows (GLM T 1 9.8 against 10.1 us, T 17 17.6 against 18.0) and for the in-place
    prefill over packed rows (twenty-second session, run EI, two rounds: DeepSeek packed decode T 256
    361-362 against 378-379 us, at 16 heads 177 against 184) and for the prefill over bulk-copied packed
    rows (twenty-fourth session, run ET: GLM 1610-1614 against 1645-1646 us at 64-row blocks); slower for
    the prefill over staged packed rows copied by ``cp.async`` (twelfth session, GLM: 333 against 339
    TFLOPS)."""
    if geo.kv_kind == "bf16":
        return False
    return split or geo.kv_kind != "packed" or not ws_staged(geo, block_i) or ws_bulk(geo, split, block_i)


def ws_bulk(geo: AttnGeometry, split: bool, block_i: int = 64) -> bool:
    """Whether the staged producer of :func:`build_attn_ws` copies each packed row into its raw stage by one
    bulk copy of the TMA unit (``dsa_bulk_row``: one lane per row issues it) instead of every lane's
    ``cp.async`` pieces (four of 8 bytes a lane and row: the rows are only 8-byte aligned): for the
    prefill over staged packed rows without a tail (GLM's 264-byte rows), whose values are whole 16-byte
    pieces from a start that is 16-byte aligned or 8 bytes past it.

    Measured (H200, BENCHMARKS.md, twenty-fourth session, runs ES to EU, two rounds a call): GLM packed
    prefill 1518-1525 against 1583-1585 us (at 8 heads 1487-1491 against 1555-1570) with quarters
    (:func:`ws_quarters`) and 128-row blocks (:func:`ws_block`); at 64-row blocks 1610-1614 with quarters,
    1643-1646 without. The split kernels keep ``cp.async``: with bulk copies GLM packed decode T 17 took
    15.0-15.4 against 14.4-14.7 us, T 1 8.3-8.6 against 8.0-8.1."""
    return (not split and geo.kv_kind == "packed" and geo.d_rope == 0 and ws_staged(geo, block_i)
            and geo.kv_row_width % 8 == 0 and geo.kv_row_width - geo.d_v >= 8)


def ws_persistent(geo: AttnGeometry, split: bool) -> bool:
    """Whether :func:`build_attn_ws` builds ``geo``'s kernel persistent (``ctas`` CTAs): the prefill over staged packed
    rows copied by the TMA unit (:func:`ws_bulk`, GLM's 264-byte rows). Each CTA walks work items (token, head block)
    one after another, its producer gathering the next item's first blocks while the consumers finish an item,
    instead of the SM idling through one CTA's end and the next one's start.

    Measured (H200, BENCHMARKS.md, twenty-eighth session): a CTA of the GLM packed prefill at H 64 took about 4.4 us
    beyond its blocks' 16 x 2.72 us (run FP, times against top-k). Persistent (run FR, two rounds): 1467-1474 against
    1545 us at H 64, 1409-1426 against 1495-1509 at H 8. The other FP8 prefills gained nothing so, and keep one CTA
    per item: DeepSeek packed decode T 256 (in-place rows) 356-358 against 356-363 us, GLM native FP8 1285-1288
    against 1292, DeepSeek native FP8 5121-5166 against 5107-5128."""
    return not split and geo.kv_kind == "packed" and ws_bulk(geo, split, ws_block(geo, split))


def ws_paired_fits(geo: AttnGeometry, block_i: int) -> bool:
    """Whether the paired scheme of :func:`build_attn_ws` fits in shared memory: q, two stages and two
    probability tiles (warpgroup 0's in its stage's tail where that is as wide as a block)."""
    hb, d_qk = MAX_HEAD_BLOCK, geo.d_qk
    tiles = 1 if geo.d_rope == block_i else 2
    return 2 * (hb * d_qk + 2 * block_i * d_qk + tiles * hb * block_i) + 2048 <= SMEM_LIMIT  # + flags, barriers


# TileLang pass configs of the build_attn_ws kernels: nvcc's fast math, so each exp2f / log2f is one
# ex2 / lg2.approx.ftz instruction (TileLang compiles IEEE-accurate forms by default, with extra
# instructions around each for subnormal results); divisions are approximate and subnormal float32
# values flush to zero too (the GPU suite's comparisons with the reference hold). Measured (H200,
# BENCHMARKS.md, fifteenth session, one call): GLM bf16 prefill 511 against 495 TFLOPS, GLM packed
# prefill 345 against 340, GLM fp8 prefill 383 against 375, GLM packed decode T 17 17.3 against
# 17.6 us; DeepSeek bf16 prefill 560 both.
WS_PASS_CONFIGS = {"tl.enable_fast_math": True}


def build_attn_ws(geo: AttnGeometry, *, split: bool = False, block_i: int | None = None,
                  producers: int | None = None, nreg: tuple[int, int, int] | None = None, ctas: int = DEFAULT_CTAS):
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
    """
    geo.check()
    assert ws_supported(geo), "needs d_v a multiple of 128 (256 for FP8 rows), d_rope 0 or 64"
    block_i = ws_block(geo, split) if block_i is None else block_i
    assert block_i == 64 or not split, "a split kernel works on 64-row blocks"
    d_v, d_tail, heads = geo.d_v, geo.d_rope, geo.heads
    half = d_v // 2
    hb = MAX_HEAD_BLOCK
    groups = T.ceildiv(heads, hb)
    scale2 = geo.sm_scale * LOG2E
    packed, row_w = geo.kv_kind == "packed", geo.kv_row_width
    if packed:
        scale_word, rope_half = geo.layout.scale_offset // 4, geo.layout.rope_offset // 2
    vec = 8 if geo.kv_kind == "bf16" else 16  # elements one producer thread moves at once (16 bytes read)
    chunks = d_v // (vec * WS_THREADS_PER_ROW)  # per thread and row, half of them in each half of the row
    tail_chunks = d_tail // (8 * WS_THREADS_PER_ROW)
    dtype, acc = T.bfloat16, T.float32
    t_count, s_count, k_count, n_split = T.dynamic("t"), T.dynamic("s"), T.dynamic("k"), T.dynamic("ns")
    copies_async = geo.kv_kind == "bf16"  # bf16 rows go to shared memory as they are, by cp.async
    staged = ws_staged(geo, block_i)
    inplace = geo.kv_kind != "bf16" and not staged  # FP8 rows without room for raw stages: widened in place
    # two producer warpgroups where staged FP8 rows are widened: the widening bounds the kernel
    n_prod = (2 if staged else 1) if producers is None else producers
    # the prefill of bf16 rows: the two consumer warpgroups score the blocks of a pair side by side;
    # elsewhere warpgroup 0 scores each block as soon as it is ready (measured: BENCHMARKS.md; pairs
    # were slower where the producer bounds the kernel, over FP8 rows)
    paired = geo.kv_kind == "bf16" and not split and ws_paired_fits(geo, block_i)
    # where the tail is as wide as a block, warpgroup 0's shared probabilities take its stage's tail
    # (read by its score GEMM only; refilled after warpgroup 1's last PV GEMM of the pair, as FlashMLA)
    p0_in_tail = paired and d_tail == block_i
    # Paired over 64-row blocks (rows wider than 256): FlashMLA's pipeline. Each stage has two halves with
    # barriers of their own (the left value half; the right one with the tail), refilled as soon as their
    # last reader is done, and warpgroup 0 issues the next pair's score GEMMs under its last PV GEMM.
    # Measured (H200, BENCHMARKS.md, fourteenth session): DeepSeek bf16 prefill 557 against 516 TFLOPS
    # in one call (run BK; its earlier forms 527-556 against 513-521); over 128-row blocks (GLM) 472-476
    # against 493 for the whole-stage scheme, which they keep.
    halves = paired and block_i == 64
    # The running max moves only when a row's max grows by more than 2^8 in the exp2 domain, so most
    # blocks rescale nothing (probabilities stay below 2^8: exact in float32, the same relative
    # precision in bf16); threads whose rows' max did not move skip the rescale (544 against 527).
    lazy_gap = 8.0 / scale2 if halves else None
    rows_per_pass = 128 * n_prod // WS_THREADS_PER_ROW  # rows the producer threads fill at once
    # rows of a producer block: the staged producer fills a stage from raw copies of WS_RAW_ROWS rows
    block_p = min(block_i, WS_RAW_ROWS) if staged else block_i
    subs = block_i // block_p  # producer blocks per stage
    passes = block_p // rows_per_pass
    # The in-place kernels over packed rows: consumer warpgroup 1, which otherwise waits most of the time
    # for warpgroup 0's probabilities (ncu: 65% of its samples; the producer paces the kernel), gathers
    # and widens the last pass of each block, the next block's before it waits for the current one's
    # probabilities. Measured (H200, BENCHMARKS.md, one call each): DeepSeek packed decode T 256 350-354
    # against 363-364 us at 128 heads, 173.5 against 183 at 16 (twenty-seventh session); in the split
    # kernel, DeepSeek packed decode T 1 at 16 heads 11.3 against 11.8-11.9 us in five rounds (twenty-eighth
    # session, run FP).
    wg1_widens = inplace and packed and passes > 1 and (not split or d_tail > 0)
    inplace_scheme = "inplace_wg1" if wg1_widens else "inplace"
    scheme = ("paired" if paired else inplace_scheme if inplace else "single", n_prod)
    assert nreg is not None or scheme in WS_NREG, f"no register budgets for {scheme}; pass nreg"
    nreg = WS_NREG[scheme] if nreg is None else nreg
    check_ws_nreg(nreg, n_prod)

    # A persistent prefill (ws_persistent): a grid of at most `ctas` CTAs, each of which walks the work items (token,
    # head block) bx, bx + ctas, ... one after another, its producer running on into the next item's first blocks
    # while the consumers finish an item (see `work`). The consumers meet at a named barrier between items (q's
    # tiles hold their stores' rows) and count the stages' phases over all the CTA's blocks.
    persist = ws_persistent(geo, split)
    assert not persist or (staged and not paired), "a persistent kernel runs the staged producer"
    assert ctas >= 1, "a persistent kernel needs at least one CTA"

    quarters = ws_quarters(geo, split, block_i)  # which producer threads share a row
    bulk = ws_bulk(geo, split, block_i)  # staged packed rows by one TMA bulk copy each
    assert not bulk or (staged and packed and not d_tail), "bulk copies: staged packed rows without a tail"
    # (a persistent kernel's items have a multiple of 4 producer blocks there, so the landing phases restart with each)
    assert not (bulk and persist) or subs % 2 == 0, "persistent bulk copies need stages of an even number of raw blocks"
    # bytes of a raw slot: a bulk-copied row may land 8 bytes in, with 8 more bytes after its values
    raw_w = d_v + (16 if bulk else RAW_PAD if quarters else 0)

    def prow(tx):
        return ws_row_lane(tx, quarters)[0]

    def plane(tx):
        return ws_row_lane(tx, quarters)[1]
    # arrivals on a stage's ready barrier: each producer thread once, or twice with cp.async; and
    # warpgroup 1's threads where they widen a pass
    ready_count = 128 * n_prod * (2 if copies_async else 1) + (128 if wg1_widens else 0)
    # the passes of a block each side widens in place
    prod_passes, wg1_passes = (tuple(range(passes - 1)), (passes - 1,)) if wg1_widens else (None, None)
    n_tiles = d_v // QUANT_TILE
    piece = 16 if row_w % 16 == 0 else 8  # bytes of one cp.async of FP8 values (row starts are piece-aligned)
    # elements of one cp.async of the tail of a staged row: bf16 of a packed row (8 bytes where the
    # rows or the tail offset are not 16-byte aligned, as in the 392-byte 256+64 row), FP8 values
    tail_piece = (8 if row_w % 16 == 0 and geo.layout.rope_offset % 16 == 0 else 4) if packed else 8

    def work(bx, by, i, topk_length, *item0):
        """``(t, h0, first, stop, n_blk, pairs, walk)`` of work item ``i`` of the CTA ``(bx, by)``: its token, first
        head and first top-k block, the end of its valid entries, its blocks, the pairs of them and the blocks it walks.
        A kernel that is not persistent has one item, ``item0``. A persistent kernel walks at least one pair for an
        empty row too, so that every item fills both stages and the stages' phases alternate with the pairs."""
        if not persist:
            return item0
        w = bx + i * ctas
        t = w // groups
        n_valid = valid_entries(geo, topk_length, t, k_count)
        n_blk = T.ceildiv(n_valid, block_i)
        pairs = T.max(T.ceildiv(n_blk, 2), 1)
        return t, w % groups * hb, 0, n_valid, n_blk, pairs, 2 * pairs

    def next_token(bx, i, t):
        """The token of a persistent CTA's work item after ``i`` (the last token if there is none), else ``t``."""
        return T.min((bx + (i + 1) * ctas) // groups, t_count - 1) if persist else t

    def next_stop(bx, i, t_n, topk_length):
        """The end of the valid entries of a persistent CTA's work item after ``i`` (token ``t_n``), 0 if there is
        none."""
        if not persist:
            return 0
        return T.if_then_else(bx + (i + 1) * ctas < t_count * groups, valid_entries(geo, topk_length, t_n, k_count), 0)

    def work_items(n_items):
        """The loop over a CTA's work items: one (item 0, a Python loop) unless persistent."""
        return T.serial(n_items) if persist else (0,)

    def pair_phase(base, pair):
        """The stages' phase in pair ``pair`` of the current work item (``base[0]`` blocks before it)."""
        return (base[0] // 2 + pair) & 1 if persist else pair & 1

    def global_block(base, it):
        """Block ``it`` of the current work item counted over the CTA's items (``base[0]`` blocks before it)."""
        return base[0] + it if persist else it

    @T.macro
    def set_after(after, b, nb, t, stop, nx):
        """Persistent kernels: ``after`` (registers) of :func:`produce_staged` for producer block ``b`` of a work item
        of ``nb`` producer blocks (token ``t``, end ``stop``; the next item's token and end in ``nx``): the next
        producer block and its end, and the token and producer block after that."""
        after[0] = T.if_then_else(b + 1 < nb, b + 1, b + 1 - nb)
        after[1] = T.if_then_else(b + 1 < nb, stop, nx[1])
        after[2] = T.if_then_else(b + 2 < nb, t, nx[0])
        after[3] = T.if_then_else(b + 2 < nb, b + 2, b + 2 - nb)

    def row_views(kv):
        """The FP8 values, float32 scales and bf16 tails of packed rows ``kv``."""
        return (T.view(kv, (s_count, row_w), T.float8_e4m3fn), T.view(kv, (s_count, row_w // 4), T.float32),
                T.view(kv, (s_count, row_w // 2), dtype))

    def entry_ok(blk, j, stop, raw):
        """Whether entry ``j`` of producer block ``blk`` (``block_p`` rows), raw index ``raw``, is valid:
        before ``stop`` and a row of the pool."""
        return (blk * block_p + j < stop) & (raw >= 0) & (raw < s_count)

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
                slot[k] = T.call_extern("int32", "dsa_ld_index", T.address_of(indices[0, 0]),
                                        T.cast(t, "int64") * k_count + pos)
        elif mine is None:
            for p in T.unroll(passes):
                pos = blk * block_p + p * rows_per_pass + prow(tx)
                slot[p] = indices[t, T.min(pos, k_count - 1)]
        else:
            for k in tuple(range(len(mine))):
                pos = blk * block_p + mine[k] * rows_per_pass + prow(tx)
                slot[k] = indices[t, T.min(pos, k_count - 1)]

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
            slot[p] = T.if_then_else(ok, nxt[p], -1)
            ok_s[j] = T.if_then_else(ok, 1, 0)
        load_index(indices, t, blk + 1, nxt)
        for p in T.unroll(passes):
            j = p * rows_per_pass + prow(tx)
            ok = slot[p] >= 0
            row = T.max(slot[p], 0)
            # cp.async straight into shared memory: the whole stage is in flight without registers
            for c in T.unroll(chunks // 2):
                col = (c * WS_THREADS_PER_ROW + lane) * vec
                T.ptx_cp_async(T.access_ptr(dst_l[j, col], "w", vec), T.access_ptr(kv[row, col], "r", vec), vec,
                               predicate=ok)
                T.ptx_cp_async(T.access_ptr(dst_r[j, col], "w", vec), T.access_ptr(kv[row, half + col], "r", vec),
                               vec, predicate=ok)
            if d_tail:
                for c in T.unroll(tail_chunks):
                    col = (c * WS_THREADS_PER_ROW + lane) * 8
                    T.ptx_cp_async(T.access_ptr(dst_t[j, col], "w", 8), T.access_ptr(kv[row, d_v + col], "r", 8),
                                   8, predicate=ok)
        T.fence_proxy_async()
        T.barrier_arrive(ready)
        # a second arrival per thread once its cp.async copies have landed; no wait here, so TileLang
        # inserts no warpgroup sync into the producer (a named barrier id it would share with the
        # first consumer warpgroup: a deadlock)
        T.cp_async_barrier_noinc(ready)

    def cp_async(dst, src, nbytes, pred):
        """cp.async of ``nbytes`` from ``src`` to ``dst`` (zeros where ``pred`` is false), out of sight of
        TileLang's barrier planner (``T.address_of``; the in-place producer, see there). The whole-stage
        bf16 and the staged producers keep ``T.ptx_cp_async`` and the barriers TileLang adds: through
        this helper they ran no faster or slower (GLM bf16 prefill 460 -> 450, GLM packed 319 -> 307
        TFLOPS; BENCHMARKS.md, seventh session). The halves producer (``fill_half``) uses it: TileLang
        put four producer-wide barriers in every half there."""
        return T.call_extern("handle", f"dsa_cp_async<{nbytes}>", T.address_of(dst), T.address_of(src), pred)

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
            row = T.if_then_else(ok, raw[p], 0)
            if ok_s is not None:
                T.call_extern("handle", "dsa_put_flag", T.address_of(ok_s[j]), T.if_then_else(ok, 1, 0))
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
                args += [raw, T.address_of(dst[off + j, col]), T.address_of(dst[off + j, col + 8]),
                         sc[p, tile] if packed else 1.0]
        flags = f"{'true' if packed else 'false'}, {'false' if raw_v is not None else 'true'}"  # kScaled, kSync
        return T.call_extern("handle", f"dsa_widen<{flags}>", *args)

    def widen_bulk(raw, dst, row, col, scale):
        """The call that widens the 16 FP8 values at ``raw`` (8-byte aligned), times ``scale``, into columns
        ``[col, col + 16)`` of ``dst``'s row ``row`` (``bulk``)."""
        return T.call_extern("handle", "dsa_widen_bulk", T.address_of(raw), T.address_of(dst[row, col]),
                             T.address_of(dst[row, col + 8]), scale)

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
            ok[p] = T.call_extern("int32", f"dsa_bulk_row<{d_v}, {row_w}>", T.address_of(raw_v[j, 0]),
                                  T.address_of(kv[0, 0]), row, T.address_of(landed[0]), lane == 0, valid)
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
                        T.ptx_cp_async(T.access_ptr(raw_v[j, base + at], "w", piece), T.access_ptr(src, "r", piece),
                                       piece, predicate=ok[p] != 0)
            if packed:
                # the row's scales into registers (eight lanes of a row read the same 8 bytes: one
                # request; copied to shared memory per lane they cost 8-way bank conflicts). In one
                # 8-byte load, as the in-place producer loads them, GLM packed prefill took 1645 against
                # 1583-1586 us (H200, BENCHMARKS.md, twenty-first session)
                for i in range(n_tiles):
                    raw_sc[p, i] = T.if_then_else(ok[p] != 0, scales[row, scale_word + i], 0.0)
            if d_tail:
                for c in T.unroll(tail_chunks):
                    for k in T.unroll(8 // tail_piece):
                        kk = (k ^ odd) if quarters and tail_piece < 8 else k
                        col = (c * WS_THREADS_PER_ROW + lane) * 8 + kk * tail_piece
                        src = tails[row, rope_half + col] if packed else kv[row, d_v + col]
                        T.ptx_cp_async(T.access_ptr(raw_t[j, col], "w", tail_piece),
                                       T.access_ptr(src, "r", tail_piece), tail_piece, predicate=ok[p] != 0)
        T.ptx_commit_group()

    @T.macro
    def issue_raw(kv, slot, blk, stop, ok, raw_v, raw_t, raw_sc, landed):
        """Start the copy of top-k block ``blk`` into a raw stage: :func:`issue_bulk` or
        :func:`issue_cp_async`."""
        if bulk:
            issue_bulk(kv, slot, blk, stop, ok, raw_v, raw_sc, landed)
        else:
            issue_cp_async(kv, slot, blk, stop, ok, raw_v, raw_t, raw_sc)

    @T.macro
    def widen_raw(ok, raw_v, raw_t, raw_sc, landed, dst_l, dst_r, dst_t, ok_s, off):
        """Widen this thread's bytes of a raw stage into rows ``[off, off + block_p)`` of the bf16 stage
        (zeros stay zeros)."""
        tx = T.get_thread_binding() - 2 * 128
        lane = plane(tx)
        # Measured (H200, BENCHMARKS.md): the rows of a packed pool widen faster through TileLang's
        # per-chunk casts (GLM prefill 322 against 293 TFLOPS), native FP8 rows through `widen` (343
        # against 299).
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
    def produce_staged(kv, indices, t, blk, stop, nxt, ok_now, ok_next, raw_next, raw_now, dst_l, dst_r, dst_t, ok_s,
                       ready, free, phase, sub, landed_phase, after=None):
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

    @T.macro
    def produce_inplace(kv, indices, t, blk, stop, nxt, sc, dst_l, dst_r, dst_t, ok_s, ready, free, phase, base=256,
                        mine=None):
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
                                cp_async(dst_t[j, col + k * tail_piece], words[row, rope_half + col + k * tail_piece],
                                         2 * tail_piece, ok)
                        else:  # 8 FP8 values into the first half of their 16-byte chunk
                            cp_async(dst_t[j, col], words[row, (d_v + col) // 2], 8, ok)
                if packed:
                    # the row's scales in one vector load (the row is valid: row 0 for invalid entries),
                    # then zero for invalid entries (TileLang picks the widest load the row width aligns).
                    # Measured (H200, BENCHMARKS.md, twentieth session, run DI): DeepSeek packed decode
                    # T 256 427-429 us against 453-454 with four scalar loads at the same budgets
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

    @T.macro
    def score(q_l, q_r, qt_s, k_l, k_r, k_t, ok_s, acc_s):
        """``acc_s [hb, block_i]``: the raw scores of the block in stage ``(k_l, k_r, k_t)`` (-inf for
        invalid entries, whose rows are zeros); the GEMMs are issued back to back and waited for once."""
        if copies_async:
            T.fence_proxy_async()  # cp.async wrote the stage; wgmma reads it through the async proxy
        for h, j in T.Parallel(hb, block_i):
            acc_s[h, j] = T.if_then_else(ok_s[j] != 0, 0, -T.infinity(acc))
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

    calls_widen = inplace or (staged and not packed)  # (see widen_raw)
    prelude = ((WS_PRELUDE if paired else "") + (WS_COPY if inplace or halves or bulk else "")
               + (WS_CONVERT if calls_widen or bulk else "") + (WS_WIDEN if calls_widen else "")
               + (WS_BULK if bulk else "") + (WS_STORE if split else "") + (WS_PERSIST if persist else "")) or None

    @T.macro
    def attend(q, kv, indices, topk_length, out, lse):
        grid = (T.min(t_count * groups, ctas), 1) if persist else (t_count * groups, n_split if split else 1)
        with T.Kernel(*grid, threads=128 * (2 + n_prod), prelude=prelude) as (bx, by):
            if split:
                # Programmatic dependent launch (decode, where launches are a large part of the time):
                # this kernel may start while the kernel before it in the stream finishes, and waits
                # for it (and its memory) before it touches global memory. Warpgroup 0 lets the
                # combine launch once it has stored its partial (below), and the combine waits the same
                # way, so that launch overlaps this kernel's end instead of following it.
                T.pdl_sync()
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
            ok0 = T.alloc_shared((block_i,), T.int32)
            ok1 = T.alloc_shared((block_i,), T.int32)
            if paired:
                # probabilities each consumer shares with the other (bf16, relative to the pair's final max)
                p0_s = kt_s0 if p0_in_tail else T.alloc_shared((hb, block_i), dtype)
                p1_s = T.alloc_shared((hb, block_i), dtype)
                m_s = T.alloc_shared((hb,), acc)  # running max, handed from one warpgroup to the other
            else:
                p_s = T.alloc_shared((hb, block_i), dtype)
                alpha_s = T.alloc_shared((hb,), acc)
                sum_s = T.alloc_shared((hb,), acc)

            # each consumer warpgroup has its own fragments (their layouts bind its own threads)
            acc_o = T.alloc_fragment((hb, half), acc)  # warpgroup 0: left half of the output
            acc_o_r = T.alloc_fragment((hb, half), acc)  # warpgroup 1: right half
            acc_s = T.alloc_fragment((hb, block_i), acc)  # warpgroup 0: scores (of stage 0 when paired)
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
            else:
                ready0 = T.alloc_barrier(arrive_count=ready_count)
                ready1 = T.alloc_barrier(arrive_count=ready_count)
                free0 = T.alloc_barrier(arrive_count=256)
                free1 = T.alloc_barrier(arrive_count=256)
            if paired:
                m0_ready = T.alloc_barrier(arrive_count=128)  # m_s holds warpgroup 0's max of the pair
                m1_ready = T.alloc_barrier(arrive_count=128)  # ... the pair's final max (warpgroup 1's)
                p0_ready = T.alloc_barrier(arrive_count=128)
                p1_ready = T.alloc_barrier(arrive_count=128)
                done0 = T.alloc_barrier(arrive_count=128)
                done1 = T.alloc_barrier(arrive_count=128)
            else:
                p_ready = T.alloc_barrier(arrive_count=128)
                p_free = T.alloc_barrier(arrive_count=128)
                done = T.alloc_barrier(arrive_count=128)
            q_ready = T.alloc_barrier(arrive_count=256)

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
                # pairs of blocks, one in each stage. A prefill kernel walks whole pairs: a last odd block has
                # an empty padding partner (without it, the packed prefill ran 4% slower: BENCHMARKS.md,
                # eleventh session). A split kernel walks its blocks only: GLM decode T 17 takes 7 splits of
                # 5 blocks, not 6 of 6 (H200: 18.1 against 18.8 us over packed rows).
                pairs = T.ceildiv(n_blk, 2)
                walk = n_blk if split else 2 * pairs
            n_items = T.ceildiv(t_count * groups - bx, ctas) if persist else 1  # work items of this CTA (see work)

            # setmaxnreg moves registers between the warpgroups of the CTA (budgets: WS_NREG). Paired
            # (the prefill of narrow bf16 rows): warpgroup 0 scores the block in stage 0 and warpgroup 1
            # the one in stage 1, at the same time; each then runs PV for its half of the value width
            # over both blocks, its own probabilities from registers and the other's from shared
            # memory. The running max passes 0 -> 1 -> 0 once per pair (m_s), so each softmax overlaps
            # the other warpgroup's GEMMs. Otherwise warpgroup 0 scores every block and runs the
            # softmax, and warpgroup 1 only its half of PV: a block is consumed as soon as it is ready,
            # not a pair at a time. Measured slower over the 256-wide FP8 rows (H200, BENCHMARKS.md,
            # thirteenth to twenty-first sessions): pairs; a column split (each warpgroup scoring half of
            # a block's rows); q or the probabilities in registers; the next block's score GEMMs issued
            # before this block's softmax (two stages or three).
            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                if paired:
                    stage_q(q, q_l, q_r, qt_s, t, h0, tx, q_ready)
                    T.fill(acc_o, 0)
                    T.fill(sumexp, 0)
                    T.fill(m_i, NEG_START)
                    T.barrier_wait(q_ready, 0)
                    # Halves: the scores of the first pair's block here; those of each later pair are issued
                    # under the last PV GEMM of the pair before. ptxas serializes every wgmma of the
                    # kernel (C7515) if an accumulator is written by other instructions while a GEMM is
                    # in flight, or if a GEMM is in flight across the loop's entry or back-edge: so the
                    # first score GEMM clears the accumulator, invalid entries are masked after the
                    # wait, and every GEMM is waited for before the loop's next step.
                    flag = T.alloc_local((1,), T.int32) if halves else None  # (see lazy_gap)
                    if halves and pairs > 0:
                        score_half(ready_l0, 0, q_l, kv_l0, acc_s, True)
                        score_half(ready_r0, 0, q_r, kv_r0, acc_s, False, qt_s, kt_s0)
                        T.wait_wgmma(0)
                    for pair in T.serial(pairs):
                        phase = pair & 1
                        if halves:
                            for h, j in T.Parallel(hb, block_i):
                                acc_s[h, j] = T.if_then_else(ok0[j] != 0, acc_s[h, j], -T.infinity(acc))
                        else:
                            T.barrier_wait(ready0, phase)
                            score(q_l, q_r, qt_s, kv_l0, kv_r0, kt_s0, ok0, acc_s)
                        # softmax against this warpgroup's max so far; warpgroup 1 takes it from m_s
                        T.copy(m_i, m_prev)
                        T.reduce_max(acc_s, m_i, dim=1, clear=False)
                        for h in T.Parallel(hb):
                            if halves:
                                m_i[h] = T.if_then_else(m_i[h] > m_prev[h] + lazy_gap, m_i[h], m_prev[h])
                            m_s[h] = m_i[h]
                        T.barrier_arrive(m0_ready)
                        for h in T.Parallel(hb):
                            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale2)
                        exponentiate(acc_s, acc_o, m_i, alpha, sum_i, sumexp, scale2, flag)
                        T.copy(acc_s, p_0)
                        T.wgmma_gemm(p_0, kv_l0, acc_o)
                        # the pair's final max from warpgroup 1: rescale to it and hand over this block's
                        # probabilities
                        T.barrier_wait(m1_ready, phase)
                        for h in T.Parallel(hb):
                            alpha[h] = T.exp2((m_i[h] - m_s[h]) * scale2)
                            m_i[h] = m_s[h]
                            sumexp[h] = sumexp[h] * alpha[h]
                        if halves:  # (stmatrix)
                            for h, j in T.Parallel(hb, block_i):
                                acc_s[h, j] = acc_s[h, j] * alpha[h]
                            T.copy(acc_s, p0_s)
                        else:
                            for h, j in T.Parallel(hb, block_i):
                                p0_s[h, j] = T.cast(acc_s[h, j] * alpha[h], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(p0_ready)
                        T.wait_wgmma(0)
                        if halves:
                            T.barrier_arrive(free_l0)  # the producer refills it with the next pair's block
                        else:
                            T.barrier_arrive(free0)
                        rescale(acc_o, alpha, flag)
                        T.barrier_wait(p1_ready, phase)
                        if not halves:
                            T.gemm(p1_s, kv_l1, acc_o)
                            T.barrier_arrive(free1)
                        else:
                            T.wgmma_gemm(p1_s, kv_l1, acc_o)
                            if pair + 1 < pairs:
                                # the next pair's scores, issued while the last PV GEMM runs
                                score_half(ready_l0, phase ^ 1, q_l, kv_l0, acc_s, True)
                                T.wait_wgmma(1)
                                T.barrier_arrive(free_l1)
                                score_half(ready_r0, phase ^ 1, q_r, kv_r0, acc_s, False, qt_s, kt_s0)
                                T.wait_wgmma(0)
                            else:
                                T.wait_wgmma(0)
                                T.barrier_arrive(free_l1)
                    for h in T.Parallel(hb):
                        T.call_extern("handle", "dsa_put_row_sum", h, sumexp[h])
                    T.barrier_arrive(done0)
                    T.barrier_wait(done1, 0)
                    for h in T.Parallel(hb):
                        sumexp[h] = sumexp[h] + T.call_extern(acc, "dsa_row_sum", hb + h)
                    normalize(acc_o, sum_i, m_i, sumexp, scale2)
                    store_rows(out, None, acc_o, q_l, None, t, by if split else None, h0, 0, heads)
                else:
                    base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
                    if persist:
                        base[0] = 0
                    for i in work_items(n_items):
                        t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                            bx, by, i, topk_length, t, h0, first, stop, n_blk, pairs, walk)
                        if i > 0:
                            # both consumer warpgroups have stored the last item's rows through q's tiles
                            T.call_extern("handle", "dsa_bar_sync", *WS_CONSUMER_BARRIER)
                        stage_q(q, q_l, q_r, qt_s, t_i, h0_i, tx, q_ready)
                        T.fill(acc_o, 0)
                        T.fill(sumexp, 0)
                        T.fill(m_i, NEG_START)
                        T.barrier_wait(q_ready, i & 1)
                        for it in T.serial(walk_i):
                            # (base is even: the stage of a block is that of it)
                            phase = (global_block(base, it) // 2) & 1
                            if it % 2 == 0:
                                T.barrier_wait(ready0, phase)
                            else:
                                T.barrier_wait(ready1, phase)
                            if copies_async:
                                T.fence_proxy_async()  # cp.async wrote the stage; wgmma reads it (async proxy)
                            for h, j in T.Parallel(hb, block_i):
                                ok = T.if_then_else(it % 2 == 0, ok0[j], ok1[j])
                                acc_s[h, j] = T.if_then_else(ok != 0, 0, -T.infinity(acc))
                            # the score GEMMs are issued back to back and waited for once
                            if it % 2 == 0:
                                T.wgmma_gemm(q_l, kv_l0, acc_s, transpose_B=True)
                                T.wgmma_gemm(q_r, kv_r0, acc_s, transpose_B=True)
                                if d_tail:
                                    T.wgmma_gemm(qt_s, kt_s0, acc_s, transpose_B=True)
                            else:
                                T.wgmma_gemm(q_l, kv_l1, acc_s, transpose_B=True)
                                T.wgmma_gemm(q_r, kv_r1, acc_s, transpose_B=True)
                                if d_tail:
                                    T.wgmma_gemm(qt_s, kt_s1, acc_s, transpose_B=True)
                            T.wait_wgmma(0)
                            if global_block(base, it) > 0:  # warpgroup 1 is done with p_s and alpha_s
                                T.barrier_wait(p_free, (global_block(base, it) - 1) & 1)
                            online_softmax(acc_s, acc_o, m_i, m_prev, alpha, sum_i, sumexp, scale2)
                            T.copy(alpha, alpha_s)
                            T.copy(acc_s, p_s)
                            # warpgroup 1 may start its half of PV now, beside this warpgroup's half
                            T.fence_proxy_async()
                            T.barrier_arrive(p_ready)
                            if it % 2 == 0:
                                T.gemm(p_s, kv_l0, acc_o)
                            else:
                                T.gemm(p_s, kv_l1, acc_o)
                            if it % 2 == 0:
                                T.barrier_arrive(free0)
                            else:
                                T.barrier_arrive(free1)
                        reciprocal(sum_s, sumexp)  # warpgroup 1 scales its half by it
                        T.barrier_arrive(done)
                        normalize(acc_o, sum_i, m_i, sumexp, scale2)
                        store_rows(out, lse, acc_o, q_l, sum_i, t_i, by if split else None, h0_i, 0, heads,
                                   WS_STORE_BARRIERS[0] if split else None)
                        if split:
                            # the combine may launch now (the first thread's trigger counts for the CTA).
                            # Measured (H200, BENCHMARKS.md, eighteenth session, both with the combine's own
                            # trigger): GLM packed decode T 17 14.5-14.7 us against 14.7-14.9 with the trigger
                            # at this kernel's start
                            T.pdl_trigger()
                        if persist:
                            base[0] = base[0] + walk_i
            elif tx >= 128 and tx < 256:
                T.set_max_nreg(nreg[1], 1)
                if paired:
                    stage_q(q, q_l, q_r, qt_s, t, h0, tx, q_ready)
                    T.fill(acc_o_r, 0)
                    flag_r = T.alloc_local((1,), T.int32) if halves else None
                    T.fill(sumexp_r, 0)
                    T.fill(m_r, NEG_START)
                    T.barrier_wait(q_ready, 0)
                    for pair in T.serial(pairs):
                        phase = pair & 1
                        if halves:
                            # the right half (and tail) first: the producer fills it before the left one
                            score_half(ready_r1, phase, q_r, kv_r1, acc_s_r, True, qt_s, kt_s1)
                            score_half(ready_l1, phase, q_l, kv_l1, acc_s_r, False)
                            T.wait_wgmma(0)
                            for h, j in T.Parallel(hb, block_i):
                                acc_s_r[h, j] = T.if_then_else(ok1[j] != 0, acc_s_r[h, j], -T.infinity(acc))
                        else:
                            T.barrier_wait(ready1, phase)
                            score(q_l, q_r, qt_s, kv_l1, kv_r1, kt_s1, ok1, acc_s_r)
                        T.reduce_max(acc_s_r, sum_r, dim=1, clear=True)  # sum_r: this block's row max, for now
                        T.barrier_wait(m0_ready, phase)
                        # the pair's final max (at least warpgroup 0's, which is at least this one's last)
                        for h in T.Parallel(hb):
                            m_prev_r[h] = m_r[h]
                            m_r[h] = T.max(m_s[h], sum_r[h])
                            if halves:
                                m_r[h] = T.if_then_else(m_r[h] > m_s[h] + lazy_gap, m_r[h], m_s[h])
                            alpha_r[h] = T.exp2((m_prev_r[h] - m_r[h]) * scale2)
                        for h in T.Parallel(hb):
                            m_s[h] = m_r[h]
                        T.barrier_arrive(m1_ready)
                        exponentiate(acc_s_r, acc_o_r, m_r, alpha_r, sum_r, sumexp_r, scale2, flag_r)
                        T.copy(acc_s_r, p_1)
                        T.wgmma_gemm(p_1, kv_r1, acc_o_r)
                        T.copy(acc_s_r, p1_s)
                        T.fence_proxy_async()
                        T.barrier_wait(p0_ready, phase)
                        T.wgmma_gemm(p0_s, kv_r0, acc_o_r)
                        # warpgroup 0's PV GEMM over these probabilities only after this one, whose
                        # end frees the stage (half) warpgroup 0 scores next (FlashMLA's order; H200,
                        # BENCHMARKS.md: DeepSeek 550-557 against 544-551 TFLOPS, GLM 518-522
                        # against 503-506)
                        T.barrier_arrive(p1_ready)
                        if halves:
                            T.wait_wgmma(1)
                            T.barrier_arrive(free_r1)
                            T.wait_wgmma(0)
                            T.barrier_arrive(free_r0)
                        else:
                            T.wait_wgmma(0)
                            T.barrier_arrive(free1)
                            T.barrier_arrive(free0)
                    for h in T.Parallel(hb):
                        T.call_extern("handle", "dsa_put_row_sum", hb + h, sumexp_r[h])
                    T.barrier_arrive(done1)
                    T.barrier_wait(done0, 0)
                    for h in T.Parallel(hb):
                        sumexp_r[h] = sumexp_r[h] + T.call_extern(acc, "dsa_row_sum", h)
                    # both warpgroups end on the same max; this one writes the LSE
                    normalize(acc_o_r, sum_r, m_r, sumexp_r, scale2)
                    store_rows(out, lse, acc_o_r, q_r, sum_r, t, by if split else None, h0, half, heads)
                else:
                    base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
                    if persist:
                        base[0] = 0
                    if wg1_widens:
                        nxt1 = T.alloc_local((1,), T.int32)
                        sc1 = T.alloc_local((1, n_tiles), acc)
                    for i in work_items(n_items):
                        t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                            bx, by, i, topk_length, t, h0, first, stop, n_blk, pairs, walk)
                        if i > 0:
                            T.call_extern("handle", "dsa_bar_sync", *WS_CONSUMER_BARRIER)  # (see warpgroup 0)
                        stage_q(q, q_l, q_r, qt_s, t_i, h0_i, tx, q_ready)
                        T.fill(acc_o_r, 0)
                        if wg1_widens:  # (a kernel of one work item: see persist)
                            load_index(indices, t_i, first_i, nxt1, 128, wg1_passes)
                            if walk_i > 0:
                                produce_inplace(kv, indices, t_i, first_i, stop_i, nxt1, sc1, kv_l0, kv_r0, kt_s0, ok0,
                                                ready0, free0, 0, 128, wg1_passes)
                        for it in T.serial(walk_i):
                            if wg1_widens:
                                # this warpgroup's rows of the next block, before it waits for this one's probabilities
                                if it + 1 < walk_i:
                                    if (it + 1) % 2 == 0:
                                        produce_inplace(kv, indices, t_i, first_i + it + 1, stop_i, nxt1, sc1, kv_l0,
                                                        kv_r0, kt_s0, ok0, ready0, free0, ((it + 1) // 2) & 1, 128,
                                                        wg1_passes)
                                    else:
                                        produce_inplace(kv, indices, t_i, first_i + it + 1, stop_i, nxt1, sc1, kv_l1,
                                                        kv_r1, kt_s1, ok1, ready1, free1, ((it + 1) // 2) & 1, 128,
                                                        wg1_passes)
                            T.barrier_wait(p_ready, global_block(base, it) & 1)
                            if copies_async:
                                T.fence_proxy_async()
                            for h, d in T.Parallel(hb, half):
                                acc_o_r[h, d] = acc_o_r[h, d] * alpha_s[h]
                            if it % 2 == 0:
                                T.gemm(p_s, kv_r0, acc_o_r)
                                T.barrier_arrive(free0)
                            else:
                                T.gemm(p_s, kv_r1, acc_o_r)
                                T.barrier_arrive(free1)
                            T.barrier_arrive(p_free)
                        T.barrier_wait(done, i & 1)
                        for h, d in T.Parallel(hb, half):
                            acc_o_r[h, d] = acc_o_r[h, d] * sum_s[h]
                        store_rows(out, None, acc_o_r, q_r, None, t_i, by if split else None, h0_i, half, heads,
                                   WS_STORE_BARRIERS[1] if split else None)
                        if persist:
                            base[0] = base[0] + walk_i
            elif tx >= 256:
                T.set_max_nreg(nreg[2], 0)
                if inplace:
                    n_own = passes if prod_passes is None else len(prod_passes)
                    nxt = T.alloc_local((n_own,), T.int32)
                    sc = T.alloc_local((n_own, n_tiles), acc) if packed else None  # the rows' scales
                    load_index(indices, t, first, nxt, 256, prod_passes)
                    for pair in T.serial(pairs):
                        produce_inplace(kv, indices, t, first + 2 * pair, stop, nxt, sc, kv_l0, kv_r0, kt_s0, ok0,
                                        ready0, free0, pair & 1, 256, prod_passes)
                        if not split or 2 * pair + 1 < n_blk:  # (a split kernel walks no padding block)
                            produce_inplace(kv, indices, t, first + 2 * pair + 1, stop, nxt, sc, kv_l1, kv_r1, kt_s1,
                                            ok1, ready1, free1, pair & 1, 256, prod_passes)
                elif staged:
                    nxt = T.alloc_local((passes,), T.int32)
                    ok_a = T.alloc_local((passes,), T.int32)  # valid rows of the block in raw0
                    ok_b = T.alloc_local((passes,), T.int32)  # ... in raw1
                    # the packed rows' scales of the blocks in raw0 and raw1
                    raw_a = (*raw0[:2], T.alloc_local((passes, n_tiles), acc) if packed else None, raw0[2])
                    raw_b = (*raw1[:2], T.alloc_local((passes, n_tiles), acc) if packed else None, raw1[2])
                    # the indices of the first two blocks are loaded together: the first block's raw
                    # copy waits for its own, and the second's (issued before the first is widened)
                    # then has its indices at hand instead of a load round trip later
                    nxt2 = T.alloc_local((passes,), T.int32)
                    # (producer blocks: `subs` per stage; their raw stages alternate, raw0 first in a pair)
                    t_0, h0_0, first_0, stop_0, n_blk_0, pairs_0, walk_0 = work(bx, by, 0, topk_length, t, h0, first,
                                                                                stop, n_blk, pairs, walk)
                    load_index(indices, t_0, first_0 * subs, nxt)
                    load_index(indices, t_0, first_0 * subs + 1, nxt2)
                    issue_raw(kv, nxt, first_0 * subs, stop_0, ok_a, *raw_a)
                    for p in T.unroll(passes):
                        nxt[p] = nxt2[p]
                    parts = ((ok_a, ok_b, raw_b, raw_a), (ok_b, ok_a, raw_a, raw_b))  # (now, next) by parity
                    base = T.alloc_local((1,), T.int32) if persist else None  # blocks of the earlier work items
                    if persist:
                        base[0] = 0
                    # (persistent) the next work item's token and end, and the two producer blocks after the current one
                    nx = T.alloc_local((2,), T.int32) if persist else None
                    after = T.alloc_local((4,), T.int32) if persist else None
                    for i in work_items(n_items):
                        t_i, h0_i, first_i, stop_i, n_blk_i, pairs_i, walk_i = work(
                            bx, by, i, topk_length, t, h0, first, stop, n_blk, pairs, walk)
                        if persist:
                            nx[0] = next_token(bx, i, t_i)
                            nx[1] = next_stop(bx, i, nx[0], topk_length)
                        for pair in T.serial(pairs_i):
                            blk = (first_i + 2 * pair) * subs
                            phase = pair_phase(base, pair)
                            # producer block k of the CTA (2 * subs a pair) is raw stage k % 2's use k // 2 (the
                            # blocks of a work item are a multiple of 4)
                            for sub in tuple(range(subs)):
                                if persist:
                                    set_after(after, blk + sub, walk_i * subs, t_i, stop_i, nx)
                                produce_staged(kv, indices, t_i, blk + sub, stop_i, nxt, *parts[sub % 2], kv_l0, kv_r0,
                                               kt_s0, ok0, ready0, free0, phase, sub, (pair * subs + sub // 2) & 1,
                                               (after[0], after[1], after[2], after[3]) if persist else None)
                            if not split or 2 * pair + 1 < n_blk_i:  # (a split kernel walks no padding block)
                                for sub in tuple(range(subs)):
                                    if persist:
                                        set_after(after, blk + subs + sub, walk_i * subs, t_i, stop_i, nx)
                                    produce_staged(kv, indices, t_i, blk + subs + sub, stop_i, nxt,
                                                   *parts[(subs + sub) % 2], kv_l1, kv_r1, kt_s1, ok1, ready1, free1,
                                                   phase, sub, (pair * subs + (subs + sub) // 2) & 1,
                                                   (after[0], after[1], after[2], after[3]) if persist else None)
                        if persist:
                            base[0] = base[0] + walk_i
                    if not bulk:
                        T.call_extern("handle", "tl::cp_async_wait<0>")  # the last (empty) copies land before exit
                elif halves:
                    # the halves of a pair in the order the consumers free them (FlashMLA's): stage 0's
                    # left half, stage 1's right, stage 0's right, stage 1's left. The indices of the
                    # next pair are loaded as a pair starts (loaded after a block's last half, they
                    # left the producer waiting for them: ncu)
                    cur_a = T.alloc_local((passes,), T.int32)  # raw indices of stage 0's block
                    cur_b = T.alloc_local((passes,), T.int32)  # ... of stage 1's
                    nxt_a = T.alloc_local((passes,), T.int32)  # ... of the next pair's
                    nxt_b = T.alloc_local((passes,), T.int32)
                    load_index(indices, t, first, cur_a)
                    load_index(indices, t, first + 1, cur_b)
                    for pair in T.serial(pairs):
                        blk, phase = first + 2 * pair, pair & 1
                        load_index(indices, t, blk + 2, nxt_a)
                        load_index(indices, t, blk + 3, nxt_b)
                        fill_half(kv, blk, stop, cur_a, 0, kv_l0, None, ok0, ready_l0, free_l0, phase)
                        fill_half(kv, blk + 1, stop, cur_b, half, kv_r1, kt_s1, ok1, ready_r1, free_r1, phase)
                        fill_half(kv, blk, stop, cur_a, half, kv_r0, kt_s0, None, ready_r0, free_r0, phase)
                        fill_half(kv, blk + 1, stop, cur_b, 0, kv_l1, None, None, ready_l1, free_l1, phase)
                        for p in T.unroll(passes):
                            cur_a[p] = nxt_a[p]
                            cur_b[p] = nxt_b[p]
                else:
                    nxt = T.alloc_local((passes,), T.int32)
                    slot = T.alloc_local((passes,), T.int32)
                    load_index(indices, t, first, nxt)
                    for pair in T.serial(pairs):
                        produce(kv, indices, t, first + 2 * pair, stop, nxt, slot, kv_l0, kv_r0, kt_s0, ok0, ready0,
                                free0, pair & 1)
                        if not split or 2 * pair + 1 < n_blk:  # (a split kernel walks no padding block)
                            produce(kv, indices, t, first + 2 * pair + 1, stop, nxt, slot, kv_l1, kv_r1, kt_s1, ok1,
                                    ready1, free1, pair & 1)

    if split:
        part_t = T.Tensor((t_count, n_split, partial_heads(heads, ws=True), d_v), dtype)
        return _entry(geo, attend, t_count, s_count, k_count, part_t, T.Tensor((t_count, n_split, heads), acc))
    return _entry(geo, attend, t_count, s_count, k_count, T.Tensor((t_count, heads, d_v), dtype),
                  T.Tensor((t_count, heads), acc))
