"""Sparse attention at the head counts of tensor-parallel shards (1-32 heads per GPU) on the GPU: the transposed
consumers of the warp-specialized kernels (heads as the GEMMs' N, padded to a multiple of 8 inside the kernel)
against the reference, with the hostile inputs of the attention suite."""

import pytest
import torch

import sparse_dsa_ops as dsa
from sparse_dsa_ops import reference
from tests.test_cuda import attn_inputs, check_attn, check_sink_and_max, cuda, gen, kernel_kind, run_both

pytestmark = pytest.mark.cuda

# (geometry (d_v, d_rope, heads), kind) of the shard cases: 512-wide rows with and without the tail at head counts
# that are and are not multiples of 8, every kv kind; 256-wide rows take the transposed consumers in the split kernel
# only
SHARD_CASES = [
    ((512, 64, 1), "bf16"),
    ((512, 0, 3), "fp8-kv"),
    ((512, 64, 5), "packed"),
    ((512, 64, 8), "bf16"),
    ((512, 64, 8), "packed"),
    ((512, 64, 8), "fp8"),
    ((512, 64, 13), "packed-q8"),
    ((512, 64, 24), "bf16"),
    ((512, 64, 32), "packed"),
    ((512, 0, 8), "packed"),
    ((512, 0, 31), "bf16"),
    ((256, 0, 13), "packed"),
]
# (geometry, kind, topk_length) of sparse_attn_with_max_logits with a sink
SHARD_SINK_CASES = [((512, 64, 16), "packed", True), ((512, 0, 8), "bf16", False), ((512, 64, 24), "fp8", True)]
REPLAY = ((512, 64, 16), "packed")


def _keys(geo, kind, with_lengths, sink=False):
    (d_v, d_rope, heads), (kv_kind, q_fp8) = geo, kernel_kind(kind)
    scale = (d_v + d_rope) ** -0.5
    return dsa._cuda.attn_keys(kv_kind, d_v, d_rope, heads, scale, with_lengths, q_fp8=q_fp8, sink=sink)


def shard_keys() -> list:
    """The kernels this module runs."""
    keys = [k for geo, kind in SHARD_CASES for k in _keys(geo, kind, True)]
    keys += [k for geo, kind, with_lengths in SHARD_SINK_CASES for k in _keys(geo, kind, with_lengths, sink=True)]
    keys += _keys(*REPLAY, False)
    return list(dict.fromkeys(keys))


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dsa._cuda.warmup(shard_keys(), workers=16, progress=False)


def test_shard_kernels_are_transposed():
    # every warp-specialized kernel of a 512-wide shard runs the transposed consumers on sm_90
    if not dsa._cuda.compile.is_hopper():
        pytest.skip("the warp-specialized kernels are sm_90's")
    for key in _keys((512, 64, 16), "packed", False):
        assert getattr(key, "transposed", True), key.name


@pytest.mark.parametrize("geo, kind", SHARD_CASES, ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}" for g, k in SHARD_CASES])
@pytest.mark.parametrize("t_count", [1, 3, 300], ids=["decode-T1", "decode", "prefill"])
def test_shards_against_the_reference(geo, kind, t_count):
    # hostile indices (sentinels, duplicates), an empty row, NaN in unselected rows, outputs poisoned; lengths cut
    # rows short (one to nothing, some past the top-k width)
    lengths = torch.randint(-3, 700, (t_count,), generator=gen(5), dtype=torch.int32)
    lengths[0] = 0 if t_count > 1 else lengths[0]
    got, want = run_both(attn_inputs(geo, kind, t_count, 640, seed=t_count + geo[2]), lengths)
    check_attn(got, want)


@pytest.mark.parametrize(
    "geo, kind, with_lengths",
    SHARD_SINK_CASES,
    ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}-len{int(n)}" for g, k, n in SHARD_SINK_CASES],
)
@pytest.mark.parametrize("t_count", [3, 300], ids=["decode", "prefill"])
def test_shards_sink_and_max_logits(geo, kind, with_lengths, t_count):
    lengths = None
    if with_lengths:
        lengths = torch.randint(-3, 600, (t_count,), generator=gen(29), dtype=torch.int32)
        lengths[0] = 0
    check_sink_and_max(geo, kind, t_count, 512, lengths)


@pytest.mark.parametrize("t_count", [2, 300], ids=["decode", "prefill"])
def test_shard_repeatable_and_replayed_on_new_data(t_count):
    # bit-identical repeats, and a captured graph replayed on new inputs
    inputs = attn_inputs(*REPLAY, t_count, 1024, seed=3)
    q, kv, idx = cuda(*inputs[:3])
    first = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    again = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dsa.sparse_attn(q, kv, idx, *inputs[3:])
    fresh = attn_inputs(*REPLAY, t_count, 1024, seed=4)
    for dst, src in zip((q, kv, idx), cuda(*fresh[:3])):
        dst.copy_(src)
    graph.replay()
    check_attn((out.clone(), lse.clone()), reference.sparse_attn(*fresh))
