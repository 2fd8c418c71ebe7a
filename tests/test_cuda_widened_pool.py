"""Sparse attention over a widened pool on the GPU: a prefill over FP8 rows (packed or native) that gathers each pool
row many times widens the pool to bf16 once and runs the bf16 rows' kernels (``plan_widen_pool``), against the
reference with the hostile inputs of the attention suite."""

import pytest
import torch

import sparse_dsa_ops as dsa
from csrc_tl.attention.launch import WIDEN_COUNT_TOKENS
from sparse_dsa_ops import reference
from sparse_dsa_ops._cuda.compile import sm_count
from tests.test_cuda import attn_inputs, check_attn, check_sink_and_max, cuda, gen, kernel_kind, run_both

pytestmark = pytest.mark.cuda

T_COUNT, TOPK = 1024, 128  # over attn_inputs' 4096 slots: 32 gathered rows per pool row: widened
COUNT_TOKENS = WIDEN_COUNT_TOKENS  # where a call over a pool too large to widen counts the rows it selects
# (geometry (d_v, d_rope, heads), kind, topk_length): both 512-wide rows at shard head counts, the 256-wide rows at 64
# heads, native FP8 rows and a float8 q at 32 heads
STAGED_CASES = [
    ((512, 64, 8), "packed", True),
    ((512, 0, 16), "packed-q8", False),
    ((256, 0, 64), "packed", True),
    ((512, 64, 32), "fp8", False),
]
SINK_CASE = ((512, 64, 16), "packed")


def _keys(geo, kind, with_lengths, sink=False):
    (d_v, d_rope, heads), (kv_kind, _) = geo, kernel_kind(kind)
    return dsa._cuda.widen_pool_keys(kv_kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, with_lengths, sink=sink)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not dsa._cuda.compile.is_hopper():
        pytest.skip("pools are widened on sm_90 only")
    keys = [k for geo, kind, with_lengths in STAGED_CASES for k in _keys(geo, kind, with_lengths)]
    keys += _keys(*SINK_CASE, False, sink=True) + _keys(*SINK_CASE, False)
    keys += _keys((512, 64, 8), "packed", False) + _keys((512, 64, 8), "fp8", False)
    keys += dsa._cuda.attn_keys("packed", 512, 64, 8, 576**-0.5, False) + dsa._cuda.attn_keys(
        "fp8", 512, 64, 8, 576**-0.5, False, q_fp8=True
    )
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def _widened(geo, kind, with_lengths) -> bool:
    (d_v, d_rope, heads), (kv_kind, q_fp8) = geo, kernel_kind(kind)
    scale = (d_v + d_rope) ** -0.5
    args = (kv_kind, d_v, d_rope, heads, scale, with_lengths, q_fp8, T_COUNT, TOPK, sm_count(torch.device("cuda")))
    return dsa._cuda.plan_attn(*args, slots=4096).widen_pool


@pytest.mark.parametrize(
    "geo, kind, with_lengths", STAGED_CASES, ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}" for g, k, _ in STAGED_CASES]
)
def test_widened_pool_against_the_reference(geo, kind, with_lengths):
    # hostile indices (sentinels, duplicates), an empty row, NaN in unselected rows (widened with the pool, never
    # read), outputs poisoned; lengths cut rows short (one to nothing, some past the top-k width)
    assert _widened(geo, kind, with_lengths)
    lengths = None
    if with_lengths:
        lengths = torch.randint(-3, TOPK + 40, (T_COUNT,), generator=gen(7), dtype=torch.int32)
        lengths[0] = 0
    got, want = run_both(attn_inputs(geo, kind, T_COUNT, TOPK, seed=geo[2]), lengths)
    check_attn(got, want)


def test_widened_pool_sink_and_max_logits():
    assert _widened(*SINK_CASE, False)
    check_sink_and_max(*SINK_CASE, T_COUNT, TOPK, None)


def test_widened_pool_repeatable_and_replayed_on_new_data():
    # bit-identical repeats, and a captured graph (the widening of the pool in it) replayed on new inputs
    inputs = attn_inputs(*SINK_CASE, T_COUNT, TOPK, seed=3)
    q, kv, idx = cuda(*inputs[:3])
    first = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    again = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    fresh = attn_inputs(*SINK_CASE, T_COUNT, TOPK, seed=4)
    for dst, src in zip((q, kv, idx), cuda(*fresh[:3])):
        dst.copy_(src)
    graph.replay()
    check_attn((out.clone(), lse.clone()), reference.sparse_attn(*fresh))


def _serving_pool(kind, distinct, seed):
    """Inputs of COUNT_TOKENS tokens (top-k 64) whose selections touch ``distinct`` rows spread over a pool of 16 x
    4096 rows (a serving pool; the rows no token selects hold NaN bytes): ids outside the rows stay invalid."""
    geo = (512, 64, 8)
    q, kv, idx, scale, d_v = attn_inputs(geo, kind, COUNT_TOKENS, 64, num_slots=distinct, seed=seed)
    slots = 16 * 4096
    place = torch.randperm(slots, generator=gen(seed + 1))[:distinct]
    raw = kv.view(torch.uint8)
    pool = torch.full((slots, raw.shape[1]), 0xFF, dtype=torch.uint8)
    pool[place] = raw
    valid = (idx >= 0) & (idx < distinct)
    idx = torch.where(valid, place[idx.clamp(0, distinct - 1)].int(), torch.where(idx < 0, idx, 2**31 - 1))
    return q, pool.view(kv.dtype), idx, scale, d_v


@pytest.mark.parametrize("kind", ["packed", "fp8"])
@pytest.mark.parametrize("distinct", [4096, 16 * 4096], ids=["one-request", "whole-pool"])
def test_widened_rows_of_a_serving_pool(kind, distinct, monkeypatch):
    # a pool too large to widen whole: the call counts the rows it selects and widens them alone where they are few
    # (4096 rows, selected 64 times each), else keeps the FP8 kernels; the same results either way
    inputs = _serving_pool(kind, distinct, seed=distinct % 97)
    (kv_kind, q_fp8), sms = kernel_kind(kind), sm_count(torch.device("cuda"))
    plan = dsa._cuda.plan_attn(kv_kind, 512, 64, 8, inputs[3], False, q_fp8, COUNT_TOKENS, 64, sms, slots=16 * 4096)
    assert plan.count_rows and not plan.widen_pool
    widened = []
    widen_rows = dsa._cuda.attention._widen_rows
    monkeypatch.setattr(dsa._cuda.attention, "_widen_rows", lambda *a: widened.append(a[2].numel()) or widen_rows(*a))
    check_attn(*run_both(inputs))
    assert widened == ([distinct] if distinct == 4096 else []), widened  # (every one of the rows is selected)


def test_widened_rows_not_counted_in_a_capture():
    # inside a graph capture the call cannot sync to count its rows: it keeps the FP8 kernels
    inputs = _serving_pool("packed", 4096, seed=5)
    q, kv, idx = cuda(*inputs[:3])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    graph.replay()
    check_attn((out.clone(), lse.clone()), reference.sparse_attn(*inputs))
