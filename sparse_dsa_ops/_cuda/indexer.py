"""GPU implementations of the lightning indexer's ops (arguments already checked by the family's
contract, ``sparse_dsa_ops.ops.indexer``).

The kernels (``csrc_tl.indexer``) take the paged index-K cache as ``[P, page * (D + 4)]`` uint8 whatever view the
caller passes, 2-d queries and weights, and write every output element, so outputs are never zero-filled first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from csrc_tl import indexer as builders

from ..ops import takes_checked
from .common import aligned, slot_dtype
from .compile import kernel, register_builder, sm_count, target
from .selection import DEFAULT_SMS, TopkPlan, plan_topk, scratch_bytes, select

__all__ = [
    "bench_cases",
    "warmup_keys",
    "quant_index",
    "store_index_k",
    "gather_index_k",
    "index_logits",
    "paged_index_logits",
    "index_topk",
    "index_topk_rows",
    "index_topk_keys",
]

register_builder(builders.QuantIndexKey, builders.build_quant_index, builders.pass_configs)
register_builder(builders.GatherIndexKey, builders.build_gather_index_k, builders.pass_configs)
register_builder(builders.IndexLogitsKey, builders.build_index_logits, builders.pass_configs)
register_builder(builders.PagedLogitsKey, builders.build_paged_index_logits, builders.pass_configs)
register_builder(builders.IndexFilterKey, builders.build_index_filter, builders.pass_configs)

_Q_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.bfloat16: "bfloat16"}


def _pages(cache: torch.Tensor, layout) -> torch.Tensor:
    """The cache as ``[P, page * (D + 4)]`` uint8 (a view: the checker made sure it is contiguous)."""
    return cache.view(cache.shape[0], layout.page_bytes)


def quant_index(x, round_scale=False):
    dim = x.shape[-1]
    rows = aligned(x.reshape(-1, dim))
    values = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        kernel(builders.QuantIndexKey(dim, 0, round_scale))(rows, values, scale)
    return values.reshape(x.shape), scale.reshape(x.shape[:-1])


@takes_checked
def store_index_k(layout, k, cache, loc, round_scale=False):
    if k.shape[0] and layout.slots:
        key = builders.QuantIndexKey(layout.dim, layout.page, round_scale, slot_dtype(loc))
        kernel(key)(aligned(k), aligned(loc), _pages(cache, layout))


@takes_checked
def gather_index_k(layout, cache, indices, head_dim=None):
    m = indices.shape[0]
    values = torch.empty(m, layout.dim, dtype=torch.float8_e4m3fn, device=cache.device)
    scale = torch.empty(m, dtype=torch.float32, device=cache.device)
    if m and not layout.slots:
        values.view(torch.uint8).zero_()  # every id is out of range of an empty cache
        scale.zero_()
    elif m:
        key = builders.GatherIndexKey(layout.dim, layout.page, slot_dtype(indices))
        kernel(key)(_pages(cache, layout), aligned(indices), values, scale)
    return values, scale


def index_logits(q, k, k_scale, weights, ks, ke):
    tokens, heads, dim = q.shape
    logits = torch.empty(tokens, k.shape[0], dtype=torch.float32, device=q.device)
    if not logits.numel():
        return logits
    if not k.shape[0]:
        return logits  # (no columns)
    key = builders.index_logits_key(dim, heads, _Q_DTYPES[q.dtype], target())
    cols = builders.logits_cols(tokens, heads, k.shape[0], sm_count(q.device), key.ws)
    kernel(key)(aligned(q), aligned(k), aligned(k_scale), aligned(weights), aligned(ks), aligned(ke), logits, cols)
    return logits


@takes_checked
def paged_index_logits(layout, q, cache, weights, lengths, page_table):
    b_count, n, heads, dim = q.shape
    logits = torch.empty(b_count * n, page_table.shape[1] * layout.page, dtype=torch.float32, device=q.device)
    if not logits.numel():
        return logits
    if not layout.slots:
        return logits.fill_(-math.inf)  # no page-table entry lies inside an empty cache
    key = builders.paged_logits_key(dim, heads, layout.page, _Q_DTYPES[q.dtype], target())
    kernel(key)(
        aligned(q.reshape(b_count * n, heads, dim)),
        _pages(cache, layout),
        aligned(weights),
        aligned(lengths),
        aligned(page_table),
        logits,
    )
    return logits


# index_topk: the query tokens run in chunks whose logits (and top-k's scratch) stay within this many bytes, so that a
# call holds at most 64 MB beyond its inputs and output with the lengths and the odd alignment copy.
INDEX_TOPK_BYTES = 56 << 20
ROW_ALIGN = 4  # tokens: chunks of a multiple keep each chunk's slices of ks, ke and weights 16-byte aligned
# The filtered scheme (:func:`plan_index_topk`): every step-th key's logits guess each token's threshold, the
# rank-th largest of them where rank * step keys are expected at or above it, GUESS_SIGMAS standard deviations of
# that count above k; a token's list holds as many more again.
FILTER_BYTES = 48 << 20  # a chunk's lists (or sample logits): with the call's vectors and the guesses', within 64 MB
FILTER_WAVE_BYTES = 128 << 20  # ... or one wave of the filter's CTAs where that holds more, up to this
SAMPLE_STEP = 16  # at least; doubled until a token samples at most SAMPLE_MAX keys
SAMPLE_MAX = 8192
GUESS_SIGMAS = 4.5
FILTER_ROW_BYTES = 8  # a list entry: the logit and its position
LIST_MAX = 8192  # entries of a token's list at most: the one-CTA top-k reads a row of them once (its list's size)
# keys a call has at least for the filtered scheme: below, most tokens' lists are a good part of their rows (a causal
# prompt of 16K tokens: 3255 us filtered against 2055 in the composition's chunks, H100)
FILTER_MIN_KEYS = 32768


@functools.lru_cache(maxsize=256)
def index_topk_rows(tokens: int, keys: int, sms: int, budget: int = INDEX_TOPK_BYTES) -> int:
    """The query tokens of a chunk of ``index_topk`` (all but the last, which has the rest): the most whose logits
    ``[rows, keys]`` float32 and the scratch of top-k's plan (for a whole chunk and for the last) fit in ``budget``
    bytes, a multiple of ROW_ALIGN unless fewer or all; 1 where not even one token's do. A function of the shapes
    alone, so that chunking needs no sync and a captured graph replays the same launches."""

    def held(rows: int) -> int:
        last = tokens - (-(-tokens // rows) - 1) * rows
        return 4 * rows * keys + max(scratch_bytes(rows, keys, sms), scratch_bytes(last, keys, sms))

    def fits(rows: int) -> bool:
        whole = rows == tokens or rows < ROW_ALIGN or rows % ROW_ALIGN == 0
        return whole and held(rows) <= budget

    rows = min(tokens, max(1, budget // (4 * keys)))
    while rows > 1 and not fits(rows):
        rows -= 1
    return rows


@dataclass(frozen=True)
class IndexTopkPlan:
    """What one ``index_topk`` call runs. ``filtered``: per chunk of ``rows`` tokens, the logits of every ``step``-th
    key, each token's guess (the ``rank``-th largest of them), the filter kernel (each token's list of at most ``cap``
    logits at or above its guess, in key order) and the top-k of the lists; tokens whose list cannot hold the answer
    then run through the composition. Else chunks of ``rows`` tokens of the composition, ``index_logits`` then
    ``topk``, each chunk's logits held at once."""

    filtered: bool
    rows: int
    step: int = 0
    rank: int = 0
    cap: int = 0


def plan_index_topk(tokens: int, keys: int, heads: int, dim: int, q_dtype: str, k: int, sms: int, target: str):
    """The :class:`IndexTopkPlan` of a call: filtered where the filter kernel runs (sm_90, FP8 queries), a token's
    list fits LIST_MAX entries and the keys are FILTER_MIN_KEYS or more, its chunks the most whole waves of the
    filter's CTAs (one an SM) whose lists fit FILTER_BYTES, one wave at least, which must fit FILTER_WAVE_BYTES (at
    few heads a CTA holds many tokens: 4224 lists of 3904 entries at 8 heads, 126 MB); else the composition's chunks
    (:func:`index_topk_rows`). The sample step grows with the keys (a token samples at most SAMPLE_MAX of them), the
    guess's rank and the lists with the step; the sampled logits take the lists' memory, a part of a chunk at a
    time."""
    step = SAMPLE_STEP
    while -(-keys // step) > SAMPLE_MAX:
        step *= 2
    rank, cap = _guess_rank(k, step)
    ws = builders.index_logits_key(dim, heads, q_dtype, target).ws
    wave = builders.cta_tokens(heads, ws=True) * sms  # (a multiple of ROW_ALIGN)
    row_bytes = FILTER_ROW_BYTES * int(cap)
    fits = min(wave, tokens) * row_bytes <= max(FILTER_BYTES, FILTER_WAVE_BYTES)
    if not ws or cap > LIST_MAX or keys < FILTER_MIN_KEYS or not fits:
        return IndexTopkPlan(False, index_topk_rows(tokens, keys, sms, INDEX_TOPK_BYTES))
    rows = max(1, FILTER_BYTES // row_bytes // wave) * wave
    return IndexTopkPlan(True, min(rows, tokens), step, rank, cap)


def _guess_rank(k: int, step: int) -> tuple[int, int]:
    """The guess's rank among a token's sampled logits (every ``step``-th key) for a selection of ``k``, and the
    entries of its list (a multiple of 64)."""
    rank = math.ceil(k / step + GUESS_SIGMAS * math.sqrt(k / step)) + 1
    return rank, int(-(-(rank * step + GUESS_SIGMAS * step * math.sqrt(rank) + step) // 64) * 64)


def index_topk(q, k, k_scale, weights, ks, ke, topk, out_width=None):
    tokens, heads, dim = q.shape
    num_keys = k.shape[0]
    if not tokens or not num_keys:  # no token has a candidate
        return torch.full((tokens, out_width or topk), -1, dtype=torch.int32, device=q.device)
    sms = sm_count(q.device)
    plan = plan_index_topk(tokens, num_keys, heads, dim, _Q_DTYPES[q.dtype], topk, sms, target())
    # (the composition's answers of tokens the filtered scheme does not hand it land in a spare last row)
    out = torch.empty(tokens + plan.filtered, out_width or topk, dtype=torch.int32, device=q.device)[:tokens]
    lengths = ke - ks  # [T] int32, as the composition computes them
    k, k_scale = aligned(k), aligned(k_scale)
    if not plan.filtered:
        _composed(out, q, k, k_scale, weights, ks, ke, lengths, topk, plan.rows)
        return out
    failed = _filtered(out, plan, q, k, k_scale, weights, ks, ke, lengths, topk)
    rows = index_topk_rows(tokens, num_keys, sms, INDEX_TOPK_BYTES)
    chunks = None  # a graph replays whatever failed: it holds every chunk of the composition
    if not _capturing(q):  # else only the chunks that hold a failed token (a sync)
        per_chunk = torch.nn.functional.pad(failed, (0, -tokens % rows)).view(-1, rows).any(dim=1)
        chunks = per_chunk.nonzero().flatten().tolist()
    if chunks is None or chunks:
        spare = out.as_strided((tokens + 1, out.shape[1]), out.stride())
        _composed(spare, q, k, k_scale, weights, ks, ke, lengths, topk, rows, failed, chunks)
    return out


def _sample_rows(flat_bytes: int, n_sample: int) -> int:
    """The tokens whose sampled logits (``n_sample`` a token) the ``flat_bytes`` of a chunk's lists hold at once."""
    return flat_bytes // (4 * n_sample) // ROW_ALIGN * ROW_ALIGN or 1


def _guess(sampled, starts, lengths, rank: int) -> torch.Tensor:
    """Each token's guess ``[t]`` float32: the ``rank``-th largest of its sampled logits ``sampled [t, S]`` (those of
    ``[starts, starts + lengths)``), -inf where it has fewer (all its keys are then listed), NaN where that rank's
    logit is NaN (its list then holds nothing and the composition answers it)."""
    picked = torch.empty(sampled.shape[0], rank, dtype=torch.int32, device=sampled.device)
    select(picked, sampled, lengths, rank, starts)  # [t, rank]: positions from starts, ascending, then -1
    at = (picked.long() + starts[:, None]).clamp(0, sampled.shape[1] - 1)
    least = sampled.gather(1, at).amin(dim=1)
    return torch.where(picked[:, -1] < 0, -math.inf, least)


def _capturing(q) -> bool:
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _composed(out, q, k, k_scale, weights, ks, ke, lengths, topk, rows, redo=None, chunks=None) -> None:
    """``topk(index_logits(...))`` into ``out`` in chunks of ``rows`` tokens: every token's, or where ``redo [T]``
    (bool) is given only those tokens' (the others' ranges emptied, their rows written into ``out``'s spare last
    row); ``chunks``: the indices of the chunks to run, all by default."""
    tokens, heads, dim = q.shape
    sms = sm_count(q.device)
    logits = torch.empty(min(rows, tokens), k.shape[0], dtype=torch.float32, device=q.device)  # every chunk's
    # (-inf only into columns the top-k reads: a causal prompt's logits past each token are never written)
    key = builders.index_logits_key(dim, heads, _Q_DTYPES[q.dtype], target(), fill_all=False)
    score = kernel(key)
    if redo is not None:
        ks, ke, lengths = (torch.where(redo, x, 0) for x in (ks, ke, lengths))
        dest = torch.where(redo, torch.arange(tokens, device=q.device), out.shape[0] - 1)
        found = torch.empty(min(rows, tokens), out.shape[1], dtype=torch.int32, device=q.device)
    for c in range(-(-tokens // rows)) if chunks is None else chunks:
        t0, t1 = c * rows, min(c * rows + rows, tokens)
        chunk = logits[: t1 - t0]  # [t, N], contiguous
        cols = builders.logits_cols(t1 - t0, heads, k.shape[0], sms, key.ws)
        ranges = aligned(ks[t0:t1]), aligned(ke[t0:t1])
        score(aligned(q[t0:t1]), k, k_scale, aligned(weights[t0:t1]), *ranges, chunk, cols)
        if redo is None:
            select(out[t0:t1], chunk, lengths[t0:t1], topk, ks[t0:t1])
        else:
            select(found[: t1 - t0], chunk, lengths[t0:t1], topk, ks[t0:t1])
            out.index_copy_(0, dest[t0:t1], found[: t1 - t0])


def _filtered(out, plan: IndexTopkPlan, q, k, k_scale, weights, ks, ke, lengths, topk) -> torch.Tensor:
    """The filtered scheme of :class:`IndexTopkPlan` into ``out``; returns the tokens it could not answer ``[T]``
    bool: a list that overflowed, fewer than ``topk`` logits at or above the guess (with more candidates than that;
    NaN logits count as none), or a length ``ke - ks`` that wraps past int32 (its top-k reads -inf logits)."""
    tokens, heads, dim = q.shape
    num_keys, step, cap = k.shape[0], plan.step, plan.cap
    dev = q.device
    lo = ks.clamp(0, num_keys)
    stop = ks.long() + lengths.long()
    hi = torch.maximum(stop.clamp(0, num_keys).int(), lo)
    wrapped = (stop != ke.long()) & (hi > lo)
    hi = torch.where(wrapped, lo, hi)
    sample_k, sample_scale = k[::step].contiguous(), k_scale[::step].contiguous()
    n_sample = sample_k.shape[0]
    sample_key = builders.index_logits_key(dim, heads, _Q_DTYPES[q.dtype], target())
    flat = torch.empty(max(plan.rows * FILTER_ROW_BYTES * cap, 4 * n_sample), dtype=torch.uint8, device=dev)
    sample_rows = _sample_rows(flat.numel(), n_sample)
    count = torch.empty(tokens, dtype=torch.int32, device=dev)
    guess = torch.empty(tokens, dtype=torch.float32, device=dev)
    s_lo, s_hi = (lo + step - 1) // step, (hi + step - 1) // step  # each token's sampled keys
    sms = sm_count(dev)
    for t0 in range(0, tokens, plan.rows):
        t1 = min(t0 + plan.rows, tokens)
        r = t1 - t0
        qc, wc, lo_c, hi_c = aligned(q[t0:t1]), aligned(weights[t0:t1]), lo[t0:t1], hi[t0:t1]
        for u0 in range(t0, t1, sample_rows):
            u1 = min(u0 + sample_rows, t1)
            sampled = flat[: 4 * (u1 - u0) * n_sample].view(torch.float32).view(u1 - u0, n_sample)
            cols = builders.logits_cols(u1 - u0, heads, n_sample, sms, sample_key.ws)
            starts, stops = s_lo[u0:u1], s_hi[u0:u1]
            kernel(sample_key)(
                aligned(q[u0:u1]), sample_k, sample_scale, aligned(weights[u0:u1]), starts, stops, sampled, cols
            )
            guess[u0:u1] = _guess(sampled, starts, stops - starts, plan.rank)
        lists = flat[: FILTER_ROW_BYTES * r * cap]
        vals = lists[: 4 * r * cap].view(torch.float32).view(r, cap)
        pos = lists[4 * r * cap :].view(torch.int32).view(r, cap)
        kernel(builders.IndexFilterKey(dim, heads))(
            qc, k, k_scale, wc, lo_c, hi_c, aligned(ks[t0:t1]), guess[t0:t1], vals, pos, count[t0:t1]
        )
        select(out[t0:t1], vals, count[t0:t1].clamp(max=cap), topk, page_table=pos, page=1)
    return (count > cap) | ((count < topk) & (count < hi - lo)) | wrapped


def index_topk_keys(heads: int, dim: int, q_dtype: str, tokens: int, keys: int, k: int, sms: int) -> list:
    """The kernels ``index_topk`` runs for ``tokens`` queries of ``heads`` x ``dim`` against ``keys`` keys on a GPU
    of ``sms`` SMs: the composition's logits kernel and top-k plans of its chunks (a whole chunk and the last: the
    same chunks where the filtered scheme hands them its failed tokens), and where filtered the sample's logits
    kernel, the filter and the guesses' and the lists' top-k."""
    plan = plan_index_topk(tokens, keys, heads, dim, q_dtype, k, sms, target())
    rows = index_topk_rows(tokens, keys, sms, INDEX_TOPK_BYTES)
    last = tokens - (-(-tokens // rows) - 1) * rows
    found = [builders.index_logits_key(dim, heads, q_dtype, target(), fill_all=False)]
    for r in (rows, last):
        found += plan_topk(r, keys, sms).keys(k, 0, True, False)
    if plan.filtered:
        found += [builders.index_logits_key(dim, heads, q_dtype, target())] + filtered_keys(heads, dim, k)
    return list(dict.fromkeys(found))


def warmup_keys(heads=(), dim=128, page=64, round_scale=(False,), slot_dtypes=("int32",)) -> list:
    """The indexer kernels for ``heads`` (an int or several) at head dim ``dim`` and cache pages of ``page``
    tokens: the quantizers, the gather, and the logits kernels for FP8 queries (the prefill's in both fills, the
    decode's)."""
    heads = (heads,) if isinstance(heads, int) else tuple(heads)
    if not heads:
        return []
    keys = [builders.QuantIndexKey(dim, 0, rs) for rs in round_scale]
    keys += [builders.QuantIndexKey(dim, page, rs, sd) for rs in round_scale for sd in slot_dtypes]
    keys += [builders.GatherIndexKey(dim, page, sd) for sd in slot_dtypes]
    for h in heads:
        keys += [
            builders.index_logits_key(dim, h, "float8_e4m3fn", target()),
            builders.index_logits_key(dim, h, "float8_e4m3fn", target(), fill_all=False),  # index_topk's
            builders.paged_logits_key(dim, h, page, "float8_e4m3fn", target()),
        ]
    return keys


# the ops ``python -m sparse_dsa_ops source`` prints this family's kernels of
SOURCE_OPS = ("quant_index", "store_index_k", "gather_index_k", "index_logits", "paged_index_logits", "index_topk")


def source_keys(op: str, args) -> list:
    """The kernel of ``op`` for the command line's ``args`` (``heads`` indexer heads, ``index_dim``, ``page``,
    ``q``, ``round_scale``, ``slot_dtype``, ``target``; ``k`` for ``index_topk``)."""
    dim, page, q_dtype = args.index_dim, args.page, "float8_e4m3fn" if args.q == "fp8" else "bfloat16"
    if op == "index_topk":  # the chunks' logits kernel and top-k's two schemes with starts, then the filtered scheme's
        schemes = TopkPlan(1, 0).keys(args.k, 0, True, False) + TopkPlan(2, 0).keys(args.k, 0, True, False)
        chunks = [builders.index_logits_key(dim, args.heads, q_dtype, args.target, fill_all=False), *schemes]
        return chunks + (filtered_keys(args.heads, dim, args.k, args.target) if q_dtype == "float8_e4m3fn" else [])
    return [
        {
            "quant_index": lambda: builders.QuantIndexKey(dim, 0, args.round_scale),
            "store_index_k": lambda: builders.QuantIndexKey(dim, page, args.round_scale, args.slot_dtype),
            "gather_index_k": lambda: builders.GatherIndexKey(dim, page, args.slot_dtype),
            "index_logits": lambda: builders.index_logits_key(dim, args.heads, q_dtype, args.target),
            "paged_index_logits": lambda: builders.paged_logits_key(dim, args.heads, page, q_dtype, args.target),
        }[op]()
    ]


# ----------------------------------------------------------------------------------------------
# Bench cases: the roof of a logits case is max(FLOPs / FP8 matmul ceiling, bytes / copy ceiling), FLOPs of the
# in-range (token, key) pairs only, bytes the keys read once plus the logits written.

DIM = 128
PAGE = 64
LOGITS_TARGET = ("<=", 1.4, "x roof")
PAGED_BATCH_TARGET = ("<=", 1.0, "x roof")
PAGED_ROW_TARGET = ("<=", 12.0, "us")
STORE_TARGET = (">=", 0.85, "of copy")
SMALL_STORE_TARGET = ("<=", 3.0, "us")


def _gen():
    return torch.Generator(device="cuda").manual_seed(0)


INDEX_TOPK_K = 2048  # the bench's index_topk selection (every model's top-k)


def _fp8(shape, gen):
    return (torch.randn(shape, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)


def _logits_case(heads: int, tokens: int, keys: int, causal: bool) -> dict:
    def make():
        gen = _gen()
        q = _fp8((tokens, heads, DIM), gen)
        k = _fp8((keys, DIM), gen)
        k_scale = torch.rand(keys, device="cuda", generator=gen) + 0.5
        w = torch.randn(tokens, heads, device="cuda", generator=gen)
        ks = torch.zeros(tokens, dtype=torch.int32, device="cuda")
        # causal: the last token sees every key, the first keys - tokens + 1
        ke = (
            torch.arange(tokens, device="cuda", dtype=torch.int32) + (keys - tokens + 1)
            if causal
            else torch.full((tokens,), keys, dtype=torch.int32, device="cuda")
        )
        return q, k, k_scale, w, ks, ke

    pairs = tokens * keys - (tokens * (tokens - 1) // 2 if causal else 0)
    key = builders.index_logits_key(DIM, heads, "float8_e4m3fn", "cuda")
    return dict(
        name=f"index_logits h{heads} T{tokens} N{keys // 1024}K{' causal' if causal else ''}",
        op="index_logits",
        make=make,
        flops=2 * pairs * heads * DIM,
        roof=True,
        bytes=keys * (DIM + 4) + tokens * keys * 4,
        keys=[key],
        path=key.name,
        target=LOGITS_TARGET,
    )


def _index_topk_case(heads: int, tokens: int, keys: int, causal: bool, fused: bool) -> dict:
    """``index_topk`` (``fused``) or the same selection as ``topk(index_logits(...))`` beside it in the same run: the
    prefill's selection with and without the [T, N] logits in memory."""
    logits = _logits_case(heads, tokens, keys, causal)

    def make():
        return (*logits["make"](), INDEX_TOPK_K)

    def composed(q, k, k_scale, w, ks, ke, topk):
        return torch.ops.dsa.topk(torch.ops.dsa.index_logits(q, k, k_scale, w, ks, ke), ke - ks, topk, ks)

    sms = sm_count(torch.device("cuda")) if torch.cuda.is_available() else 132
    if fused:
        kernels = index_topk_keys(heads, DIM, "float8_e4m3fn", tokens, keys, INDEX_TOPK_K, sms)
    else:
        kernels = [builders.index_logits_key(DIM, heads, "float8_e4m3fn", "cuda")]
        kernels += plan_topk(tokens, keys, sms).keys(INDEX_TOPK_K, 0, True, False)
    plan = plan_index_topk(tokens, keys, heads, DIM, "float8_e4m3fn", INDEX_TOPK_K, sms, "cuda")
    if not fused:
        path = f"{builders.index_logits_key(DIM, heads, 'float8_e4m3fn', 'cuda').name} + top-k (one call)"
    elif plan.filtered:
        path = f"sample, {builders.IndexFilterKey(DIM, heads).name} (lists of {plan.cap}), top-k of the lists"
        path += f" ({plan.rows} tokens a chunk)"
    else:
        path = f"{kernels[0].name} + top-k (chunks of {plan.rows} tokens)"
    what = "index_topk" if fused else "index_logits + topk"
    return dict(
        logits,
        name=f"{what} h{heads} T{tokens} N{keys // 1024}K k{INDEX_TOPK_K}{' causal' if causal else ''}",
        op="index_topk",
        make=make,
        bytes=keys * (DIM + 4) + tokens * INDEX_TOPK_K * 4,
        keys=kernels,
        path=path,
        target=None,
        **({} if fused else {"run": composed}),
    )


def _paged_case(heads: int, batch: int, context: int) -> dict:
    max_pages = context // PAGE

    def make():
        gen = _gen()
        pages = batch * max_pages
        cache = torch.randint(0, 120, (pages, PAGE * (DIM + 4)), dtype=torch.uint8, device="cuda", generator=gen)
        cache[:, PAGE * DIM :].view(torch.float32).fill_(0.01)  # the scales
        q = _fp8((batch, 1, heads, DIM), gen)
        w = torch.randn(batch, heads, device="cuda", generator=gen)
        lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        table = torch.randperm(pages, device="cuda", generator=gen).int().reshape(batch, max_pages)
        return q, cache, w, lengths, table

    key = builders.paged_logits_key(DIM, heads, PAGE, "float8_e4m3fn", "cuda")
    return dict(
        name=f"paged_index_logits h{heads} B{batch} {context // 1024}K",
        op="paged_index_logits",
        make=make,
        flops=2 * batch * context * heads * DIM,
        roof=True,
        bytes=batch * context * (DIM + 4 + 4),
        keys=[key],
        path=key.name,
        target=PAGED_ROW_TARGET if batch == 1 else PAGED_BATCH_TARGET,
    )


def _store_case(op: str, rows: int) -> dict:
    def make():
        gen = _gen()
        x = torch.randn(rows, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        if op == "quant_index":
            return (x, False)
        pages = -(-rows // PAGE)
        cache = torch.zeros(pages, PAGE * (DIM + 4), dtype=torch.uint8, device="cuda")
        return (x, cache, torch.randperm(pages * PAGE, device="cuda", generator=gen)[:rows].int(), False)

    key = builders.QuantIndexKey(DIM, 0 if op == "quant_index" else PAGE)
    moved = rows * (2 * DIM + DIM + 4 + (4 if op == "store_index_k" else 0))
    big = rows >= 1 << 20
    return dict(
        name=f"{op} {rows if rows < 1024 else f'{rows >> 20}M'} rows",
        op=op,
        make=make,
        flops=None,
        bytes=moved,
        keys=[key],
        path=key.name,
        target=STORE_TARGET if big else SMALL_STORE_TARGET,
    )


def bench_cases() -> list[dict]:
    """The indexer cases of ``python -m sparse_dsa_ops bench``, with their targets (bound, value, unit)."""
    cases = [_logits_case(h, 4096, 65536, False) for h in (64, 32, 16, 8)]
    cases += [_logits_case(64, 4096, 65536, True)]
    cases += [_index_topk_case(h, 4096, 65536, c, f) for h in (64, 8) for c in (False, True) for f in (True, False)]
    # a causal prompt of its own keys (token t sees t + 1 of them): half the logits lie past the tokens
    cases += [_index_topk_case(h, 16384, 16384, True, f) for h in (64, 8) for f in (True, False)]
    cases += [_paged_case(h, b, 131072) for h in (64, 8) for b in (64, 1)]
    cases += [_store_case(op, rows) for op in ("quant_index", "store_index_k") for rows in (1 << 20, 16)]
    return cases


def warmup_keys_of(spec) -> list:
    """The indexer's kernels :func:`sparse_dsa_ops.warmup` compiles for ``spec`` (a ``WarmupSpec``): none without
    ``index_heads``."""
    if not spec.index_heads:
        return []
    keys = warmup_keys(spec.index_heads, spec.index_dim, spec.index_page, spec.round_scale, spec.slot_dtypes)
    return keys + (filtered_keys(spec.index_heads, spec.index_dim, spec.topk_k) if spec.topk_k else [])


def filtered_keys(heads, dim: int, k: int, kind: str | None = None) -> list:
    """The kernels ``index_topk``'s filtered scheme adds for ``heads`` (an int or several) at head dim ``dim`` and
    selection size ``k`` where the scheme runs on target ``kind`` (this process's by default): the filter, the
    guesses' top-k (both schemes) at the rank of every sample step whose lists fit LIST_MAX (the step grows with the
    keys), and the top-k of the lists."""
    kind = kind or target()
    plan = plan_index_topk(1, FILTER_MIN_KEYS, 8, dim, "float8_e4m3fn", k, DEFAULT_SMS, kind)
    heads = (heads,) if isinstance(heads, int) else tuple(heads)
    fp8 = "float8_e4m3fn"
    found = [builders.IndexFilterKey(dim, h) for h in heads if builders.index_logits_key(dim, h, fp8, kind).ws]
    if not found or not plan.filtered:
        return []
    step, ranks = SAMPLE_STEP, []
    while _guess_rank(k, step)[1] <= LIST_MAX:
        ranks.append(_guess_rank(k, step)[0])
        step *= 2
    for rank in dict.fromkeys(ranks):
        found += TopkPlan(1, 0).keys(rank, 0, True, False) + TopkPlan(2, 0).keys(rank, 0, True, False)
    return found + TopkPlan(1, 0).keys(k, 1, False, False)
