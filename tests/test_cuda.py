"""GPU kernels against the reference on the same data (``cuda`` marker; skipped without a GPU).

Kernels are compiled once, in parallel, by the module fixture. Inputs are hostile: sentinel
indices of every kind, rows with nothing valid, NaN in every KV row no valid entry selects, and
outputs whose memory was filled with NaN before the call.
"""

import math

import pytest
import torch

import sparse_dsa_ops as dsa
from csrc_tl.attention import partial_heads
from csrc_tl.attention.keys import CombineKey
from sparse_dsa_ops import KCacheLayout, reference
from tests.oracle import INT_MAX, INT_MIN, hostile_indices, unselected_slots

pytestmark = pytest.mark.cuda

LAYOUTS = [KCacheLayout(512, 64), KCacheLayout(256, 0), KCacheLayout(512, 0), KCacheLayout(256, 64)]
# (d_v, d_rope, heads) of the attention cases; sm_scale is d_qk ** -0.5 for each
GLM, DEEPSEEK = (256, 0, 64), (512, 64, 128)
# 256+64 at 64 heads: the 392-byte packed row, whose tails are only 8-byte aligned, through the
# warp-specialized kernels that stage FP8 rows raw. Under 64 heads the warp-specialized kernels pad
# their head block on sm_90; the portable kernels run there for FP8 rows of 384 (not whole 16-value
# chunks per producer thread) and bf16 rows of 192 + 64. 512+0 packed: the 528-byte row, widened in place
# without a tail
ATTN_GEOS = [
    GLM,
    DEEPSEEK,
    (512, 64, 16),
    (256, 64, 64),
    (256, 0, 1),
    (256, 0, 8),
    (256, 0, 16),
    (256, 0, 128),
    (384, 0, 16),
    (192, 64, 8),
    (512, 0, 16),
]
# kv kinds: "fp8" is native float8_e4m3fn kv with float8 q, "fp8-kv" the same kv with bf16 q, "packed-q8"
# a packed pool with float8 q
ALL_KINDS = ("bf16", "packed", "fp8", "fp8-kv", "packed-q8")
# (packed rows at 8 heads: GLM's tensor-parallel shard of 8; a packed row needs d_v a multiple of 128)
THREE = ("bf16", "packed", "fp8")
ATTN_KINDS = {
    GLM: ALL_KINDS,
    DEEPSEEK: ALL_KINDS,
    (512, 64, 16): THREE,
    (256, 64, 64): THREE,
    (256, 0, 1): ("bf16", "fp8"),
    (256, 0, 8): THREE,
    (256, 0, 16): ("bf16", "fp8"),
    (256, 0, 128): ("bf16", "fp8"),
    (384, 0, 16): THREE,
    (192, 64, 8): ("bf16",),
    (512, 0, 16): ("packed",),
}
assert list(ATTN_KINDS) == ATTN_GEOS
ATTN_CASES = [(geo, kind) for geo in ATTN_GEOS for kind in ATTN_KINDS[geo]]


def kernel_kind(kind):
    """(kv kind, q is float8) of a test kind."""
    return {
        "bf16": ("bf16", False),
        "packed": ("packed", False),
        "fp8": ("fp8", True),
        "fp8-kv": ("fp8", False),
        "packed-q8": ("packed", True),
    }[kind]


def attn_suite_keys(target=None):
    """The attention kernels this suite runs on ``target`` (default: this machine's); the CPU tests
    lower the warp-specialized ones for sm_90a."""
    keys = []
    for d_v, d_rope, heads in ATTN_GEOS:
        for kind in ATTN_KINDS[d_v, d_rope, heads]:
            kv_kind, q_fp8 = kernel_kind(kind)
            keys += dsa._cuda.attn_keys(
                kv_kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, False, target=target, q_fp8=q_fp8
            )
    for (d_v, d_rope, heads), kind in [
        (DEEPSEEK, "bf16"),
        (DEEPSEEK, "packed"),
        (DEEPSEEK, "fp8"),
        (GLM, "packed"),
        (GLM, "fp8"),
    ]:
        kv_kind, q_fp8 = kernel_kind(kind)
        keys += dsa._cuda.attn_keys(
            kv_kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, True, target=target, q_fp8=q_fp8
        )
    for (d_v, d_rope, heads), kind, with_lengths in SINK_MAX_CASES:
        kv_kind, q_fp8 = kernel_kind(kind)
        keys += dsa._cuda.attn_keys(
            kv_kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, with_lengths, target=target, q_fp8=q_fp8, sink=True
        )
    return list(dict.fromkeys(keys))


# (geometry, kind, topk_length) of sparse_attn_with_max_logits with a sink: every consumer scheme of the prefill
# kernels (paired over 64-row blocks with its lazy running max, paired over 128-row blocks, single over in-place and
# staged FP8 rows, persistent over bulk-copied rows, portable) and the split path with its sink combine
SINK_MAX_CASES = [
    (DEEPSEEK, "bf16", False),
    (DEEPSEEK, "bf16", True),
    (GLM, "bf16", False),
    (DEEPSEEK, "packed", True),
    (DEEPSEEK, "fp8", False),
    (GLM, "packed", True),
    ((256, 0, 8), "packed", False),
    ((192, 64, 8), "bf16", False),
]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    keys = attn_suite_keys()
    for lay in LAYOUTS:
        for rs in (False, True):
            keys += dsa._cuda.cache_keys("quant_k_cache", lay, rs)
            keys += dsa._cuda.cache_keys("store_k_cache", lay, rs, "int32" if not rs else "int64")
        keys += dsa._cuda.cache_keys("dequant_k_cache", lay)
        for slot in ("int32", "int64"):
            keys += dsa._cuda.cache_keys("gather_k_cache", lay, slot_dtype=slot)
            keys += dsa._cuda.cache_keys("gather_dequant_k_cache", lay, slot_dtype=slot)
    dsa._cuda.warmup(keys, workers=16, progress=False)


def poison_allocator(nbytes=1 << 28):
    """Fill a block of the caching allocator with NaN and free it: the next outputs reuse it."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def at_offset(x: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``x`` (on its device) whose data pointer lies ``offset`` bytes past a 16-byte boundary."""
    n = x.numel() * x.element_size()
    raw = torch.empty(n + 64, dtype=torch.uint8, device=x.device)
    start = (-raw.data_ptr()) % 16 + offset
    view = raw[start : start + n].view(x.dtype).view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16 == offset
    return view


def gen(seed=0):
    return torch.Generator(device="cpu").manual_seed(seed)


def make_k(g, n, lay, magnitude=1.0):
    k = torch.randn(n, lay.d_nope, generator=g) * magnitude
    k *= (
        torch.exp2(torch.randint(-6, 6, (n, lay.num_scales, 1), generator=g).float())
        .repeat_interleave(128, dim=1)
        .reshape(n, -1)
    )
    k[0, :128] = 0
    k[-1] = 0
    r = torch.randn(n, lay.d_rope, generator=g).bfloat16() if lay.d_rope else None
    return k.bfloat16(), r


def cuda(*xs):
    return [None if x is None else x.cuda() for x in xs]


# ------------------------------------------------------------------------------------------
# cache ops


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_quant_dequant_bytes(lay, round_scale, magnitude):
    k, r = make_k(gen(), 333, lay, magnitude)
    want = reference.quant_k_cache(k, r, round_scale)
    poison_allocator()
    got = dsa.quant_k_cache(*cuda(k, r), round_scale)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(dsa.dequant_k_cache(got).cpu(), reference.dequant_k_cache(want))


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_store_sentinels(lay, round_scale):
    g = gen(1)
    n, page, pages = 40, 16, 8
    k, r = make_k(g, n, lay)
    pool = torch.randint(0, 256, (pages, page, lay.row_bytes), generator=g, dtype=torch.int32).to(torch.uint8)
    loc = torch.randperm(pages * page, generator=g)[:n]
    loc[::5] = -1
    loc[3] = pages * page
    loc[7] = INT_MIN if not round_scale else -(2**40)
    loc = loc.to(torch.int64 if round_scale else torch.int32)
    want = pool.clone()
    reference.store_k_cache(k, r, want, loc, round_scale)
    got = pool.cuda()
    dsa.store_k_cache(*cuda(k, r), got, loc.cuda(), round_scale)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "lay",
    [KCacheLayout(384, 2), KCacheLayout(256, 2), KCacheLayout(384, 0), KCacheLayout(128, 0), KCacheLayout(1024, 130)],
    ids=str,
)
def test_quant_and_store_other_widths(lay):
    # rows the inferable layouts do not cover: 8-byte stores with an odd number of tiles (384+2: the last
    # pass has one tile for two), 4-byte stores (rows of 268, 396 and 132 bytes), a tail of more than one step
    g = gen(3)
    n, slots = 77, 128  # 77: the last group's second row lies past the end
    k, r = make_k(g, n, lay)
    poison_allocator()
    assert torch.equal(dsa.quant_k_cache(*cuda(k, r)).cpu(), reference.quant_k_cache(k, r))
    pool = torch.randint(0, 256, (slots, lay.row_bytes), generator=g, dtype=torch.int32).to(torch.uint8)
    loc = torch.randperm(slots, generator=g)[:n].int()
    loc[::6] = -1
    loc[5] = slots
    want = pool.clone()
    reference.store_k_cache(k, r, want, loc)
    got = pool.cuda()
    dsa.store_k_cache(*cuda(k, r), got, loc.cuda())
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_gathers(lay, slot_dtype):
    g = gen(2)
    k, r = make_k(g, 256, lay)
    pool = reference.quant_k_cache(k, r).reshape(16, 16, 1, lay.row_bytes)
    ids = torch.randint(0, 256, (500,), generator=g)
    ids[::3] = ids[0]  # repeated pages
    ids[1::7] = torch.tensor([-1, 256, INT_MIN, INT_MAX, -5, 10**6] * 20)[: len(ids[1::7])]
    ids = ids.to(slot_dtype)
    poison_allocator()
    assert torch.equal(dsa.gather_k_cache(pool.cuda(), ids.cuda()).cpu(), reference.gather_k_cache(pool, ids))
    assert torch.equal(
        dsa.gather_dequant_k_cache(pool.cuda(), ids.cuda()).cpu(), reference.gather_dequant_k_cache(pool, ids)
    )


@pytest.mark.parametrize("n", [1, 1 << 20], ids=["1-row", "1M-rows"])
def test_cache_ops_one_row_and_a_million(n):
    lay = KCacheLayout(512, 64)
    k = torch.randn(n, 512, dtype=torch.bfloat16)
    r = torch.randn(n, 64, dtype=torch.bfloat16)
    want = reference.quant_k_cache(k, r)  # the CPU oracle
    k, r = k.cuda(), r.cuda()
    got = dsa.quant_k_cache(k, r)
    bad = (got.cpu() != want).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, (bad[:4], got.cpu()[bad[:1]], want[bad[:1]])
    pool = torch.zeros(n + 3, lay.row_bytes, dtype=torch.uint8, device="cuda")
    loc = torch.randperm(n + 3, device="cuda")[:n].int()
    dsa.store_k_cache(k, r, pool, loc)
    assert torch.equal(pool[loc.long()], got)
    assert torch.equal(dsa.gather_dequant_k_cache(pool, loc).cpu(), reference.dequant_k_cache(want))


def test_store_graph_capture_replays_new_rows_and_slots():
    lay = KCacheLayout(256, 0)
    pool = torch.zeros(64, lay.row_bytes, dtype=torch.uint8, device="cuda")
    k = torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")
    loc = torch.empty(8, dtype=torch.int32, device="cuda")
    k.normal_()
    loc.copy_(torch.arange(8))
    dsa.store_k_cache(k, None, pool, loc)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsa.store_k_cache(k, None, pool, loc)
    want = pool.cpu()
    for step in range(3):
        new_k = torch.randn(8, 256, dtype=torch.bfloat16)
        new_loc = torch.randperm(64)[:8].int()
        new_loc[step] = -1
        k.copy_(new_k)
        loc.copy_(new_loc)
        graph.replay()
        reference.store_k_cache(new_k, None, want, new_loc)
        assert torch.equal(pool.cpu(), want)


def test_compiling_inside_a_capture_says_to_warm_up():
    k = torch.randn(4, 896, dtype=torch.bfloat16, device="cuda")  # a layout nothing else compiles
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warmup"):
        with torch.cuda.graph(graph):
            dsa.quant_k_cache(k, None)


# ------------------------------------------------------------------------------------------
# sparse attention


def attn_inputs(geo, kind, t_count, topk, num_slots=4096, seed=0, empty_rows=(1,), pad_from=None):
    d_v, d_rope, heads = geo
    g = gen(seed)
    d_qk = d_v + d_rope
    idx = hostile_indices(g, t_count, topk, num_slots, empty_rows=[e for e in empty_rows if e < t_count])
    if pad_from is not None:
        idx[:, pad_from:] = -1
    kv_kind, q_fp8 = kernel_kind(kind)
    q = torch.randn(t_count, heads, d_qk, generator=g)
    q = q.to(torch.float8_e4m3fn) if q_fp8 else q.bfloat16()
    nan_rows = unselected_slots(idx, num_slots)
    if kv_kind in ("bf16", "fp8"):
        # native FP8 values spread over the e4m3 range, as a quantized model's would be
        kv = torch.randn(num_slots, d_qk, generator=g) * (16.0 if kv_kind == "fp8" else 1.0)
        kv = kv.to(torch.float8_e4m3fn if kv_kind == "fp8" else torch.bfloat16)
        nan = (torch.uint8, 0x7F) if kv_kind == "fp8" else (torch.int16, 0x7FC0)  # bits of a NaN
        kv.view(nan[0])[nan_rows] = nan[1]
    else:
        k = torch.randn(num_slots, d_v, generator=g).bfloat16()
        r = torch.randn(num_slots, d_rope, generator=g).bfloat16() if d_rope else None
        kv = reference.quant_k_cache(k, r)
        kv[nan_rows] = 0xFF
    return q, kv, idx, d_qk**-0.5, d_v


def check_attn(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any(), (
        f"NaN in out at {out.isnan().sum().item()} values, in lse at {lse.isnan().sum().item()}"
    )
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse is -inf on other rows than the reference's"
    assert (out[torch.isinf(ref_lse)] == 0).all(), "out is not 0 on rows with nothing valid"
    fin = ~torch.isinf(ref_lse)
    if not fin.any():  # every row empty: nothing more to compare
        return
    diff = (out.float() - ref_out.float())[fin]
    # The kernel rounds the probabilities to bf16 before the PV GEMM (2^-9 relative each), the
    # reference keeps them in float32; both round the output once to bf16.
    err, norm = diff.norm().item(), ref_out.float()[fin].norm().item()
    assert err <= 1e-2 * norm, f"L2 error of out {err:.3g} against the reference's norm {norm:.3g}"
    worst = diff.abs().max().item()
    assert worst <= 2**-6 * ref_out.float().abs().max() + 1e-6, f"largest error of out {worst:.3g}"
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
    assert lse_err <= 1e-3 * max(1.0, ref_lse[fin].abs().max().item()), f"largest error of lse {lse_err:.3g}"


def run_both(inputs, topk_length=None):
    q, kv, idx, sm_scale, d_v = inputs
    want = reference.sparse_attn(q, kv, idx, sm_scale, d_v, topk_length)
    poison_allocator()
    got = dsa.sparse_attn(*cuda(q, kv, idx), sm_scale, d_v, None if topk_length is None else topk_length.cuda())
    return got, want


# (d_v, heads, splits, ws) of the combine: several heads per block (256, 64 wide), one head in a block
# with a partial second column vector (1088), splits in one chunk, over a chunk and in several chunks;
# ws: partials with the 64-row head blocks of the warp-specialized split kernel (8 heads: padded)
COMBINE_CASES = [
    (256, 64, 7, True),
    (256, 64, 16, True),
    (512, 128, 17, True),
    (1088, 3, 40, False),
    (64, 5, 1, False),
    (256, 8, 7, True),
]


@pytest.mark.parametrize(
    "d_v, heads, splits, ws",
    COMBINE_CASES,
    ids=[f"dv{d}-h{h}-ns{n}{'-ws' if w else ''}" for d, h, n, w in COMBINE_CASES],
)
@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf], ids=["neginf", "posinf"])
def test_combine_against_float64(d_v, heads, splits, ws, empty_lse):
    # the split partials of 5 tokens: the first split of every token empty, token 1 empty in every split,
    # token 2 non-empty only in the last split (so the running max starts at -inf chunk after chunk);
    # NaN in the padding rows of the partial output
    g = gen(splits)
    t_count = 5
    part_lse = torch.randn(t_count, splits, heads, generator=g) * 8
    padded = partial_heads(heads, ws)
    part_out = torch.randn(t_count, splits, padded, d_v, generator=g).bfloat16()
    part_out[:, :, heads:] = math.nan  # the rows of heads past the last one, which the combine never reads
    empty = torch.zeros(t_count, splits, dtype=torch.bool)
    empty[:, 0] = True
    empty[1] = True
    empty[2, :-1] = True
    part_lse[empty] = -math.inf
    part_out[empty] = 0  # what a split kernel writes for a split without a valid entry
    top = part_lse.double().amax(dim=1, keepdim=True)  # [T, 1, H]
    weight = torch.exp(part_lse.double() - top.nan_to_num(neginf=0)).nan_to_num()  # [T, NS, H]
    total = weight.sum(dim=1)  # [T, H]
    want_out = (weight[..., None] * part_out[:, :, :heads].double()).sum(dim=1) / total.clamp_min(1e-300)[..., None]
    want_lse = torch.where(total > 0, top[:, 0] + total.log(), empty_lse)
    key = CombineKey(d_v, heads, padded)
    dsa._cuda.warmup([key], progress=False)
    poison_allocator()
    out = torch.empty(t_count, heads, d_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(t_count, heads, device="cuda")
    dsa._cuda.kernel(key)(part_out.cuda(), part_lse.cuda(), out, lse, empty_lse)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(lse.isinf(), want_lse.isinf()) and not lse.isnan().any()
    assert (out[1] == 0).all() and (lse[1] == empty_lse).all()
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.double(), want_out, rtol=2**-7, atol=1e-6)  # one rounding to bf16


@pytest.mark.parametrize("kind", ["bf16", "packed", "fp8"])
@pytest.mark.parametrize(
    "topk, pad_from", [(2048, None), (2112, None), (2112, 2051)], ids=["k2048", "k2112", "2051-valid"]
)
@pytest.mark.parametrize("t_count", [1, 8, 17])
def test_glm_decode_coverage(kind, t_count, topk, pad_from):
    got, want = run_both(attn_inputs(GLM, kind, t_count, topk, pad_from=pad_from))
    check_attn(got, want)


@pytest.mark.parametrize("kind", ["bf16", "packed", "fp8"])
def test_glm_prefill_partial_last_block(kind):
    # 2112 entries are 16.5 blocks of the 128-row prefill kernels (bf16, native FP8); 2051 valid, the rest -1
    got, want = run_both(attn_inputs(GLM, kind, 200, 2112, pad_from=2051))
    check_attn(got, want)


@pytest.mark.parametrize("geo, kind", ATTN_CASES, ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}" for g, k in ATTN_CASES])
@pytest.mark.parametrize(
    "t_count, topk", [(3, 256), (24, 1024), (300, 256)], ids=["decode", "decode-long-splits", "prefill"]
)
def test_geometries(geo, kind, t_count, topk):
    # 3 tokens of 256: splits of two top-k blocks (one where the portable split kernel runs);
    # 24 tokens of 1024: splits of 4 or more blocks
    got, want = run_both(attn_inputs(geo, kind, t_count, topk, seed=t_count))
    check_attn(got, want)


@pytest.mark.parametrize("kind", ["bf16", "packed", "fp8"])
@pytest.mark.parametrize("t_count", [5, 24, 300], ids=["decode", "decode-long-splits", "prefill"])
def test_topk_length(kind, t_count):
    inputs = attn_inputs(DEEPSEEK, kind, t_count, 512, seed=7)
    lengths = torch.randint(-3, 600, (t_count,), generator=gen(3), dtype=torch.int32)
    lengths[0], lengths[-1] = 0, 512
    got, want = run_both(inputs, lengths)
    check_attn(got, want)


@pytest.mark.parametrize("kind", ["packed", "fp8", "fp8-kv"])
def test_topk_length_glm_prefill(kind):
    # GLM's prefill kernels over FP8 rows (native FP8: 128-row blocks filled from two 64-row raw copies)
    # with lengths that end inside a raw copy, on a 64-row boundary, past the last block and at 0
    inputs = attn_inputs(GLM, kind, 300, 2112, seed=5)
    lengths = torch.randint(-3, 2200, (300,), generator=gen(4), dtype=torch.int32)
    lengths[:4] = torch.tensor([0, 64, 100, 2112], dtype=torch.int32)
    got, want = run_both(inputs, lengths)
    check_attn(got, want)


@pytest.mark.parametrize("heads, with_lengths", [(64, True), (8, False)])
def test_persistent_prefill_last_round_split_off(heads, with_lengths):
    # a whole round of the persistent GLM packed prefill and 5 tokens more: the prefill kernel takes the round, the
    # split kernel and the combine the last 5 tokens (rows of out and lse after the prefill's), with an empty row and
    # (at 64 heads) topk_length, with a row of length 0, among them
    geo, topk = (256, 0, heads), 1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t_count = sms + 5
    plan = dsa._cuda.plan_attn("packed", 256, 0, heads, 256**-0.5, with_lengths, False, t_count, topk, sms)
    assert str(plan).endswith("(last 5 tokens)"), plan
    inputs = attn_inputs(geo, "packed", t_count, topk, seed=13, empty_rows=(0, t_count - 2))
    lengths = None
    if with_lengths:
        lengths = torch.randint(-3, topk + 100, (t_count,), generator=gen(14), dtype=torch.int32)
        lengths[-5:-2] = torch.tensor([0, 64, 700], dtype=torch.int32)
    got, want = run_both(inputs, lengths)
    check_attn(got, want)


@pytest.mark.parametrize("t_count", [1, 17, 300], ids=["decode", "decode-T17", "prefill"])
def test_packed_pool_sliced_off_a_16_byte_boundary(t_count):
    # GLM's 264-byte rows are 8-byte aligned only; a pool sliced from a larger one starts 8 bytes past a
    # 16-byte boundary, and every row's offset from one flips: the prefill's bulk copies take each row's
    # offset from its address (the pool's first row has a case of its own), the split kernels copy 8-byte
    # pieces. Slot 0, the pool's first row, is selected by every token
    q, kv, idx, sm_scale, d_v = attn_inputs(GLM, "packed", t_count, 2112, seed=11, pad_from=2051)
    idx[:, 0] = 0
    kv[0] = reference.quant_k_cache(torch.randn(1, d_v, generator=gen(12)).bfloat16(), None)[0]
    want = reference.sparse_attn(q, kv, idx, sm_scale, d_v)
    parent = torch.full((kv.shape[0] + 1, kv.shape[1]), 0xFF, dtype=torch.uint8, device="cuda")  # NaN codes
    parent[1:] = kv.cuda()
    pool = parent[1:]
    assert pool.data_ptr() % 16 == 8
    poison_allocator()
    check_attn(dsa.sparse_attn(q.cuda(), pool, idx.cuda(), sm_scale, d_v), want)


def test_misaligned_views():
    # q and indices whose data pointers lie 2 and 4 bytes past 16-byte boundaries reach the kernels as
    # aligned copies (CPU test: test_misaligned_inputs_reach_the_kernels_as_aligned_copies); a pool view at
    # a byte offset no row of an aligned pool has is refused before any launch, and the device stays usable
    q, kv, idx, sm_scale, d_v = attn_inputs(GLM, "packed", 5, 128, seed=13)
    want = reference.sparse_attn(q, kv, idx, sm_scale, d_v)
    q_at, i_at = at_offset(q.cuda(), 2), at_offset(idx.cuda(), 4)
    check_attn(dsa.sparse_attn(q_at, kv.cuda(), i_at, sm_scale, d_v), want)
    pool = at_offset(kv.cuda(), 4)
    with pytest.raises(ValueError, match="a multiple of 8 bytes"):
        dsa.sparse_attn(q.cuda(), pool, idx.cuda(), sm_scale, d_v)
    check_attn(dsa.sparse_attn(q.cuda(), kv.cuda(), idx.cuda(), sm_scale, d_v), want)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_repeatable_bit_for_bit(kind):
    q, kv, idx, s, d_v = [x.cuda() if isinstance(x, torch.Tensor) else x for x in attn_inputs(DEEPSEEK, kind, 9, 2048)]
    first = dsa.sparse_attn(q, kv, idx, s, d_v)
    for _ in range(3):
        again = dsa.sparse_attn(q, kv, idx, s, d_v)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("t_count", [2, 300], ids=["decode", "prefill"])
def test_graph_replay_on_new_data(t_count):
    inputs = attn_inputs(GLM, "packed", t_count, 2048, seed=11)
    q, kv, idx = cuda(*inputs[:3])
    s, d_v = inputs[3:]
    lengths = torch.full((t_count,), 2048, dtype=torch.int32, device="cuda")
    dsa.sparse_attn(q, kv, idx, s, d_v, lengths)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = dsa.sparse_attn(q, kv, idx, s, d_v, lengths)
    for seed in (12, 13):
        new = attn_inputs(GLM, "packed", t_count, 2048, seed=seed)
        q.copy_(new[0])
        kv.copy_(new[1])
        idx.copy_(new[2])
        lengths.copy_(torch.randint(0, 2049, (t_count,), generator=gen(seed), dtype=torch.int32))
        graph.replay()
        eager = dsa.sparse_attn(q, kv, idx, s, d_v, lengths)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
        check_attn((out, lse), reference.sparse_attn(new[0], new[1], new[2], s, d_v, lengths.cpu()))


@pytest.mark.parametrize("kind", ["bf16", "packed"])
@pytest.mark.parametrize("t_count", [1, 17])
def test_chained_decodes_in_a_graph(kind, t_count):
    # Two GLM decodes back to back, the second taking the first's output as its q (d_qk = d_v = 256):
    # on sm_90 the second's split kernel is a programmatic dependent of the first's combine, which lets
    # it launch before the combine has finished, so it must wait for that combine before it reads q
    inputs = attn_inputs(GLM, kind, t_count, 2112, seed=21, pad_from=2051)
    q, kv, idx = cuda(*inputs[:3])
    s, d_v = inputs[3:]

    def two_layers():
        first = dsa.sparse_attn(q, kv, idx, s, d_v)
        return first, dsa.sparse_attn(first[0], kv, idx, s, d_v)

    two_layers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out1, _), (out2, lse2) = two_layers()
    for seed in (22, 23):
        q.copy_(attn_inputs(GLM, kind, t_count, 2112, seed=seed)[0])  # a new q; the same pool and indices
        graph.replay()
        (e1, _), (e2, el2) = two_layers()
        assert torch.equal(out1, e1) and torch.equal(out2, e2) and torch.equal(lse2, el2)
        check_attn((out2, lse2), reference.sparse_attn(e1.cpu(), inputs[1], inputs[2], s, d_v))


def test_torch_compile_decode_step():
    lay = KCacheLayout(256, 0)
    pool = reference.quant_k_cache(torch.randn(1024, 256).bfloat16(), None).cuda()
    s = 256**-0.5

    def step(k, cache, loc, q, idx):
        torch.ops.dsa.store_k_cache(k, None, cache, loc)
        return torch.ops.dsa.sparse_attn(q, cache, idx, s, 256)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for t_count in (2, 3, 5):
        k = torch.randn(t_count, 256, dtype=torch.bfloat16, device="cuda")
        loc = torch.randperm(1024, device="cuda")[:t_count].int()
        q = torch.randn(t_count, 64, 256, dtype=torch.bfloat16, device="cuda")
        idx = torch.randint(-1, 1024, (t_count, 2048), dtype=torch.int32, device="cuda")
        idx[:, 0] = loc[0]
        a_pool, b_pool = pool.clone(), pool.clone()
        got = compiled(k, a_pool, loc, q, idx)
        want = step(k, b_pool, loc, q, idx)
        assert torch.equal(a_pool, b_pool) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert lay.row_bytes == pool.shape[1]


def test_empty_inputs_launch_nothing():
    q = torch.randn(0, 64, 256, dtype=torch.bfloat16, device="cuda")
    out, lse = dsa.sparse_attn(
        q,
        torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(0, 64, dtype=torch.int32, device="cuda"),
        0.1,
        256,
    )
    assert out.shape == (0, 64, 256) and lse.shape == (0, 64)
    out, lse = dsa.sparse_attn(
        torch.randn(2, 64, 256, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(2, 64, dtype=torch.int32, device="cuda"),
        0.1,
        256,
    )
    assert out.eq(0).all() and (lse == -math.inf).all()


@pytest.mark.parametrize("heads", [8, 64])
def test_persistent_prefill_many_items(heads):
    # the persistent GLM packed prefill: each CTA walks several work items (token, head block), empty rows among them
    # (topk_length 0 or less: each still walks one pair of all-invalid blocks), hostile indices, NaN in unread rows
    t_count = 3 * torch.cuda.get_device_properties(0).multi_processor_count + 5
    inputs = attn_inputs((256, 0, heads), "packed", t_count, 256, seed=11, empty_rows=(0, 7, t_count - 1))
    lengths = torch.randint(-2, 300, (t_count,), generator=gen(12), dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 128, 256], dtype=torch.int32)
    got, want = run_both(inputs, lengths)
    check_attn(got, want)


@pytest.mark.parametrize(
    "geo, kind, with_lengths",
    SINK_MAX_CASES,
    ids=[f"{g[0]}+{g[1]}-h{g[2]}-{k}-len{int(n)}" for g, k, n in SINK_MAX_CASES],
)
@pytest.mark.parametrize("t_count", [3, 300], ids=["decode", "prefill"])
def test_sink_and_max_logits(geo, kind, with_lengths, t_count):
    # the prefill kernels' sink_max variant folds the sink into the denominator of out and writes the exact row max
    # (the paired kernel's running max lags it by design); heads with sinks of -inf, far above every lse and of
    # ordinary size, hostile indices, empty rows, NaN in unselected rows, outputs poisoned
    lengths = None
    if with_lengths:
        lengths = torch.randint(-3, 600, (t_count,), generator=gen(23), dtype=torch.int32)
        lengths[0] = 0
    check_sink_and_max(geo, kind, t_count, 512, lengths)


def test_max_logits_of_a_persistent_prefills_split_tail():
    # the last 5 tokens of a persistent prefill take the split path, whose kernels keep no row max: a second pass
    # fills theirs
    geo, topk = (256, 0, 64), 1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = dsa._cuda.plan_attn("packed", 256, 0, 64, 256**-0.5, False, False, sms + 5, topk, sms, sink=True)
    assert str(plan).endswith("(last 5 tokens)"), plan
    check_sink_and_max(geo, "packed", sms + 5, topk, None)


def check_sink_and_max(geo, kind, t_count, topk, lengths):
    q, kv, idx, sm_scale, d_v = attn_inputs(geo, kind, t_count, topk, seed=21, empty_rows=(1, t_count - 1))
    heads = geo[2]
    sink = torch.randn(heads, generator=gen(22)) * 4
    sink[0] = -math.inf
    if heads > 2:
        sink[1] = 60.0
    want_out, want_lse = reference.sparse_attn(q, kv, idx, sm_scale, d_v, lengths, sink)
    want_max = reference.attn_max_logits(q, kv, idx, sm_scale, d_v, lengths)
    poison_allocator()
    args = [*cuda(q, kv, idx), sm_scale, d_v, None if lengths is None else lengths.cuda(), sink.cuda()]
    out, lse, best = dsa.sparse_attn_with_max_logits(*args)
    check_attn((out, lse), (want_out, want_lse))
    plain_out, plain_lse = dsa.sparse_attn(*args)
    assert torch.equal(plain_out, out) and torch.equal(plain_lse, lse), "the sink's result depends on max_logits"
    best = best.cpu()
    assert not best.isnan().any()
    assert torch.equal(torch.isinf(best), torch.isinf(want_max)), "max_logits is -inf on other rows"
    fin = torch.isfinite(want_max)
    if fin.any():
        err = (best[fin] - want_max[fin]).abs().max().item()
        assert err <= 1e-3 * max(1.0, want_max[fin].abs().max().item()), f"largest error of max_logits {err:.3g}"
