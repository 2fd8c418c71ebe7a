"""Sparse attention in grouped head blocks on the GPU: at 8-32 heads a prefill over bf16 rows (or its pool widened)
runs head blocks of several tokens over the union of their selections (``plan_group``), against the reference with
the hostile inputs of the attention suite, and over overlapping selections without duplicates (the union merges
rows; a token's duplicate makes its group list every entry alone); and the union kernel alone against an oracle of
the lists it writes."""

import math

import pytest
import torch

import sparse_dsa_ops as dsa
from csrc_tl.attention.union import UNION_TABLES, UnionKey
from sparse_dsa_ops import reference
from sparse_dsa_ops._cuda.attention import _attend
from sparse_dsa_ops._cuda.compile import kernel, sm_count
from sparse_dsa_ops.ops import OPS
from tests.test_cuda import attn_inputs, check_attn, cuda, gen, kernel_kind, poison_allocator

pytestmark = pytest.mark.cuda

T_COUNT, TOPK, SLOTS = 61, 128, 1024  # 61 tokens: whole groups and a rest of fewer than a group
# (geometry (d_v, d_rope, heads), kind, topk_length): both 512-wide rows and the 256-wide ones, 8, 16 and 32 heads,
# bf16 rows and pools widened (packed rows, native FP8 rows with a float8 q)
CASES = [
    ((512, 64, 8), "bf16", True),
    ((512, 64, 16), "packed", False),
    ((512, 0, 8), "packed", True),
    ((512, 64, 32), "bf16", False),
    ((256, 0, 16), "bf16", True),
    ((512, 64, 8), "fp8", False),
]
# the public op's own plan groups these tokens (a rest of 5) over a pool of 512 rows (a union of 45% of the selections)
PLANNED = ((512, 64, 8), "bf16", 517, 512)


def _keys(geo, kind, with_lengths, sink=False):
    (d_v, d_rope, heads), (kv_kind, _) = geo, kernel_kind(kind)
    scale = (d_v + d_rope) ** -0.5
    keys = dsa._cuda.group_keys(kv_kind, d_v, d_rope, heads, scale, with_lengths, sink=sink, max_logits=sink)
    keys += dsa._cuda.attn_keys("bf16", d_v, d_rope, heads, scale, with_lengths, sink=sink)
    if kv_kind != "bf16":
        keys += dsa._cuda.widen_pool_keys(kv_kind, d_v, d_rope, heads, scale, with_lengths, sink=sink)
    return keys


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not dsa._cuda.compile.is_hopper():
        pytest.skip("grouped head blocks run on sm_90 only")
    keys = [k for geo, kind, with_lengths in CASES for k in _keys(geo, kind, with_lengths)]
    keys += _keys((512, 64, 16), "bf16", True, sink=True) + _keys(PLANNED[0], PLANNED[1], False)
    keys += [UnionKey(per, UNION_TABLES[0], lengths) for per in (2, 4, 8) for lengths in (False, True)]
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def _overlapping(inputs, seed):
    """``inputs`` with each token selecting TOPK distinct rows of a window of 2 TOPK rows the hostile indices left
    readable (no duplicates: every group's union merges), a few sentinels among them, and one token empty."""
    q, kv, idx, scale, d_v = inputs
    rows = idx[(idx >= 0) & (idx < SLOTS)].unique()[: 2 * TOPK]
    g = gen(seed)
    picks = torch.stack([rows[torch.randperm(rows.numel(), generator=g)[:TOPK]] for _ in range(T_COUNT)]).int()
    picks[:, 5] = -1
    picks[::3, 7] = SLOTS
    picks[1::4, 9] = 2**31 - 1
    picks[2] = -1
    return q, kv, picks, scale, d_v


def _run_grouped(inputs, lengths=None, sink=None, max_logits=False):
    """The op's outputs on the GPU with its tokens grouped (the pool widened first for FP8 rows); the plan is asked
    whether it groups them."""
    q, kv, idx = cuda(*inputs[:3])
    scale, d_v = inputs[3:]
    lengths, sink = cuda(lengths, sink)
    args = OPS["sparse_attn"].check(q, kv, idx, scale, d_v, lengths, sink)
    best = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda") if max_logits else None
    widen = None if args.kv_kind == "bf16" else True
    poison_allocator()
    out, lse = _attend(args, q, kv, idx, scale, d_v, lengths, sink, best, widen_pool=widen, group=True)
    return (out, lse) + ((best,) if max_logits else ())


def _plan(geo, kind, t_count, with_lengths, slots=SLOTS):
    (d_v, d_rope, heads), (kv_kind, q_fp8) = geo, kernel_kind(kind)
    args = (kv_kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, with_lengths, q_fp8, t_count, TOPK)
    return dsa._cuda.plan_attn(*args, sm_count(torch.device("cuda")), slots=slots)


@pytest.mark.parametrize("selections", ["hostile", "overlapping"])
@pytest.mark.parametrize("geo, kind, with_lengths", CASES, ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}" for g, k, _ in CASES])
def test_grouped_against_the_reference(geo, kind, with_lengths, selections):
    # hostile indices (sentinels, duplicates), an empty row, NaN in unselected rows, outputs poisoned; lengths cut
    # rows short (one to nothing, some past the top-k width)
    inputs = attn_inputs(geo, kind, T_COUNT, TOPK, SLOTS, seed=geo[2] + geo[1])
    if selections == "overlapping":
        inputs = _overlapping(inputs, seed=geo[2])
    lengths = None
    if with_lengths:
        lengths = torch.randint(-3, TOPK + 40, (T_COUNT,), generator=gen(7), dtype=torch.int32)
        lengths[0] = 0
    want = reference.sparse_attn(*inputs, lengths)
    check_attn(_run_grouped(inputs, lengths), want)


def test_grouped_sink_and_max_logits():
    geo, kind = (512, 64, 16), "bf16"
    inputs = _overlapping(attn_inputs(geo, kind, T_COUNT, TOPK, SLOTS, seed=21), seed=22)
    lengths = torch.randint(-3, TOPK + 40, (T_COUNT,), generator=gen(23), dtype=torch.int32)
    sink = torch.randn(geo[2], generator=gen(24)) * 4
    sink[0], sink[1] = -math.inf, 60.0
    want_out, want_lse = reference.sparse_attn(*inputs, lengths, sink)
    want_max = reference.attn_max_logits(*inputs, lengths)
    out, lse, best = _run_grouped(inputs, lengths, sink, max_logits=True)
    check_attn((out, lse), (want_out, want_lse))
    best = best.cpu()
    assert torch.equal(torch.isinf(best), torch.isinf(want_max))
    fin = ~torch.isinf(want_max)
    torch.testing.assert_close(best[fin], want_max[fin], rtol=2e-2, atol=2e-2)


def test_the_plan_groups_and_repeats_and_replays():
    # the public op over a small pool at 8 heads groups its tokens by its own plan; bit-identical repeats; a captured
    # graph replayed on new inputs
    geo, kind, t_count, slots = PLANNED
    assert _plan(geo, kind, t_count, False, slots).union is not None
    inputs = attn_inputs(geo, kind, t_count, TOPK, slots, seed=3)
    q, kv, idx = cuda(*inputs[:3])
    first = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    again = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    check_attn(first, reference.sparse_attn(*inputs))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    fresh = attn_inputs(geo, kind, t_count, TOPK, slots, seed=5)
    for dst, src in zip((q, kv, idx), cuda(*fresh[:3])):
        dst.copy_(src)
    graph.replay()
    check_attn((out.clone(), lse.clone()), reference.sparse_attn(*fresh))


def _union_oracle(idx: torch.Tensor, lengths, slots: int, per: int) -> list[list[int]]:
    """Each group's union as the union kernel lists it (:mod:`csrc_tl.attention.union`), entries as unsigned 32-bit
    ints: the valid rows (before the token's length, in ``[0, slots)``) in the order of their first selection, token
    by token and position by position, each with the bits of every token that selects it above bit 24; in a group
    where a token selects a row twice, every valid entry in that order with its own token's bit."""
    t_count, k = idx.shape
    unions = []
    for g in range(t_count // per):
        valid = []
        for j in range(per):
            cut = k if lengths is None else int(lengths[g * per + j])
            valid.append([x for p, x in enumerate(idx[g * per + j].tolist()) if p < cut and 0 <= x < slots])
        if any(len(set(v)) < len(v) for v in valid):
            unions.append([x | 1 << (24 + j) for j in range(per) for x in valid[j]])
            continue
        bits = {}
        for j, rows in enumerate(valid):
            for x in rows:
                bits[x] = bits.get(x, 0) | 1 << j
        seen, entries = set(), []
        for rows in valid:
            for x in rows:
                if x not in seen:
                    seen.add(x)
                    entries.append(x | bits[x] << 24)
        unions.append(entries)
    return unions


@pytest.mark.parametrize("with_lengths", [False, True], ids=["all", "lengths"])
@pytest.mark.parametrize("per", [2, 4, 8])
def test_union_kernel_against_its_oracle(per, with_lengths):
    # overlapping selections with the hostile sentinels, one group with a token's duplicate, an odd top-k width (a
    # warp's run ends inside a step); the union poisoned before the call: nothing written past a group's length
    t_count, k, slots = 6 * per, 300, 700
    g = gen(per + 10 * with_lengths)
    idx = torch.stack([torch.randperm(slots + 60, generator=g)[:k] - 30 for _ in range(t_count)]).int()
    idx[:, 3], idx[:, 11], idx[:, 17] = -(2**31), 2**31 - 1, slots
    idx[per, 2] = idx[per, 40] = 5  # a duplicate: group 1 lists its entries alone
    lengths = torch.randint(-2, k + 30, (t_count,), generator=g, dtype=torch.int32) if with_lengths else None
    if with_lengths:
        lengths[0], lengths[per] = 0, k
    union = torch.full((t_count // per, per * k), -7, dtype=torch.int32, device="cuda")
    count = torch.full((t_count // per,), -7, dtype=torch.int32, device="cuda")
    cut = () if lengths is None else (lengths.cuda(),)
    kernel(UnionKey(per, UNION_TABLES[0], with_lengths))(idx.cuda(), *cut, slots, union, count)
    want = _union_oracle(idx, lengths, slots, per)
    union, count = union.cpu(), count.cpu()
    for grp, entries in enumerate(want):
        assert count[grp] == len(entries)
        assert [x & 0xFFFFFFFF for x in union[grp, : len(entries)].tolist()] == entries
        assert (union[grp, len(entries) :] == -7).all()
