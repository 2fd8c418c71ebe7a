"""sparse_dsa_ops.flash_mla against FlashMLA's definitions, written here in float64.

The reference below restates FlashMLA's own (its ``tests/ref.py``): scores ``sm_scale * q . k`` over the valid
entries; ``lse`` their natural-log log-sum-exp, ``+inf`` for a row with nothing valid; ``max_logits`` their max,
``-inf`` there; ``out`` the softmax-weighted V rows times ``exp(lse) / (exp(lse) + exp(sink))``, 0 there. The cases
mirror FlashMLA's prefill and decode tests: its token counts, head counts, widths, page sizes and index sentinels,
rows with nothing valid, lengths and sinks (with +-inf), NaN in every KV row no valid entry selects, and strided
inputs. CPU cases are small (the CPU backend is the plain-Torch reference); the ``cuda`` cases run FlashMLA's sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
import sparse_dsa_ops.flash_mla as fm
from sparse_dsa_ops import KCacheLayout

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
PREFILL_SCALE = 0.5  # FlashMLA's prefill tests' scale
REF_CHUNK_BYTES = 1 << 28  # float64 scratch of one reference chunk
# tolerances: out is one bf16 rounding of a float32 result on the CPU; the GPU kernels round P to bf16 as well
# (FlashMLA's own bounds); lse and max_logits are float32 sums and maxima of a few thousand terms
# The GPU kernels round the probabilities to bfloat16 before their product with V (as FlashMLA's do): an output that
# cancels to near zero keeps the rounding of the terms it sums, so its absolute bound scales with the largest |out|
# of the case (the float64 reference's), not with the element itself.
OUT_TOL = {"cpu": dict(atol=1e-5, rtol=2**-8), "cuda": dict(atol=2**-8, rtol=3.01 / 128, atol_of_max=True)}
LOGIT_TOL = dict(atol=1e-5, rtol=3e-5)
POOL_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
PAGES = (2, 53, 61, 64, 69, 576)  # FlashMLA's decode page sizes (and 53/61 its corner cases')
DTYPE_NAMES = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "uint8"}


def sentinels(size: int) -> torch.Tensor:
    """Invalid ids of every kind for a pool of ``size`` rows."""
    return torch.tensor([INT_MIN, -123456, -1, size, INT_MAX], dtype=torch.int64)


# ------------------------------------------------------------------------------------------
# FlashMLA's definitions in float64.


def ref_sparse_attn(q, rows, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
    """FlashMLA's sparse attention of ``q [T, H, d_qk]`` over ``rows [S, d_qk]`` float64 (the pool as values).

    ``indices [T, K]``: entries outside ``[0, S)`` or at positions ``>= topk_length[t]`` are invalid.
    Returns ``out [T, H, d_v]``, ``max_logits [T, H]``, ``lse [T, H]`` in float64.
    """
    t_count, heads, d_qk = q.shape
    topk = indices.shape[-1]
    out = torch.zeros(t_count, heads, d_v, dtype=torch.float64, device=q.device)
    max_logits = torch.full((t_count, heads), -math.inf, dtype=torch.float64, device=q.device)
    lse = torch.full((t_count, heads), math.inf, dtype=torch.float64, device=q.device)
    chunk = max(1, REF_CHUNK_BYTES // (8 * topk * (d_qk + 2 * heads)))
    for start in range(0, t_count, chunk):
        stop = min(start + chunk, t_count)
        idx = indices[start:stop].long()  # [t, K]
        invalid = (idx < 0) | (idx >= rows.shape[0])
        if topk_length is not None:
            invalid |= torch.arange(topk, device=q.device) >= topk_length[start:stop, None].long()
        picked = rows[torch.where(invalid, 0, idx)]  # [t, K, d_qk]
        picked = torch.where(invalid[..., None], 0.0, picked)  # NaN rows nobody selects stay out of the sums
        scores = torch.einsum("thd,tkd->thk", q[start:stop].double(), picked) * sm_scale  # [t, H, K]
        scores = scores.masked_fill(invalid[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, H]
        lse_for_out = row_lse if attn_sink is None else torch.logaddexp(row_lse, attn_sink.double())
        lse_for_out = torch.where(lse_for_out == -math.inf, math.inf, lse_for_out)  # lonely rows: out 0
        probs = torch.exp(scores - lse_for_out[..., None])  # [t, H, K]
        out[start:stop] = torch.einsum("thk,tkd->thd", probs, picked[..., :d_v])
        max_logits[start:stop] = scores.amax(dim=-1)
        lse[start:stop] = torch.where(row_lse == -math.inf, math.inf, row_lse)
    return out, max_logits, lse


def dequant_rows(packed: torch.Tensor, lay: KCacheLayout) -> torch.Tensor:
    """Packed rows ``[S, row_bytes]`` uint8 -> their values ``[S, d_qk]`` float64, read from the byte layout.

    As FlashMLA's tests do, the dequantized K is kept in bfloat16: ``bf16(float32(fp8) * scale)``.
    """
    n = packed.shape[0]
    tiles = lay.d_nope // 128
    values = packed[:, : lay.d_nope].contiguous().view(torch.float8_e4m3fn).float().reshape(n, tiles, 128)
    scales = packed[:, lay.d_nope : lay.d_nope + 4 * tiles].contiguous().view(torch.float32)  # [S, tiles]
    nope = (values * scales[..., None]).reshape(n, lay.d_nope).bfloat16()
    rope = packed[:, lay.d_nope + 4 * tiles :].contiguous().view(torch.bfloat16)  # [S, d_rope]
    return torch.cat([nope, rope], dim=1).double()


def assert_close(name, got, want, atol, rtol, atol_of_max=False):
    """No NaN; +inf and -inf exactly where the reference has them; then tolerances on the finite rest (``atol``
    times the largest finite |want| with ``atol_of_max``)."""
    want = want.to(got.device)
    assert not got.isnan().any(), f"{name}: NaN"
    assert torch.equal(got.isposinf(), want.isposinf()), f"{name}: +inf positions differ"
    assert torch.equal(got.isneginf(), want.isneginf()), f"{name}: -inf positions differ"
    finite = want.isfinite()
    if atol_of_max and finite.any():
        atol = atol * want[finite].abs().max().item()
    torch.testing.assert_close(got[finite].double(), want[finite], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------
# Hostile inputs.


def hostile_indices(gen, rows, topk, size, lonely_every=0, invalid_frac=0.2):
    """``[rows, topk]`` int32: distinct valid ids per row (as many as ``size`` allows) mixed with every sentinel;
    every ``lonely_every``-th row (from row 1) holds no valid id at all."""
    span = max(size, topk)
    ids = torch.rand(rows, span, generator=gen).argsort(dim=1)[:, :topk]  # distinct per row, in [0, span)
    junk = sentinels(size)
    fill = junk[torch.randint(0, len(junk), (rows, topk), generator=gen)]
    bad = (ids >= size) | (torch.rand(rows, topk, generator=gen) < invalid_frac)
    if lonely_every:
        bad[1::lonely_every] = True
    return torch.where(bad, fill, ids).to(torch.int32)


def lengths_for(gen, rows, topk):
    """``[rows]`` int32 in ``[0, topk]``, with a 0 and a full row."""
    lengths = torch.randint(0, topk + 1, (rows,), generator=gen, dtype=torch.int32)
    lengths[0] = 0
    if rows > 1:
        lengths[-1] = topk
    return lengths


def sinks_for(gen, heads):
    """``[h_q]`` float32 with -inf and +inf among finite values (as FlashMLA's tests draw them)."""
    sink = torch.randn(heads, generator=gen)
    pick = torch.randn(heads, generator=gen)
    sink[pick < -0.5] = -math.inf
    sink[pick > 0.5] = math.inf
    return sink


def unselected(indices, size, topk_length=None):
    """Bool ``[size]``: rows that no valid entry selects (filled with NaN by the tests)."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < size)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1]) < topk_length.long()[:, None]
    used = torch.zeros(size, dtype=torch.bool)
    used[idx[valid]] = True
    return ~used


def strided(x: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """``x`` as a slice of a tensor ``extra`` wider along ``dim`` (same values, larger strides). The gaps hold NaN,
    or for integers the valid id 7, so that a read of a gap shows in the results."""
    shape = list(x.shape)
    shape[dim] += extra
    wide = torch.full(shape, 7, dtype=x.dtype) if not x.is_floating_point() else torch.full(shape, math.nan).to(x.dtype)
    view = wide.narrow(dim, 0, x.shape[dim])
    view.copy_(x)
    return view


def widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` laid out as FlashMLA's tests lay out their inputs: a slice of a tensor one longer in every dim and 128
    wider in the last, so that no stride is a whole number of rows (a kv ``[s_kv, 1, 576]`` has rows 1408 elements
    apart). Gaps hold NaN, or for integers the valid id 7."""
    shape = [n + 1 for n in x.shape[:-1]] + [x.shape[-1] + 128]
    fill = 7 if not x.is_floating_point() else math.nan
    view = torch.full(shape, fill, dtype=torch.float32 if x.is_floating_point() else x.dtype).to(x.dtype)
    view = view[tuple(slice(0, n) for n in x.shape)]
    view.copy_(x)
    return view


def to_cuda(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` on the GPU with the same strides (a strided view stays strided; gaps are left unset)."""
    if x is None:
        return None
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda").copy_(x)


# ------------------------------------------------------------------------------------------
# Prefill: flash_mla_sparse_fwd.


@dataclass(frozen=True)
class Prefill:
    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    topk: int
    d_v: int = 512
    sink: bool = False
    lengths: bool = False
    lonely_every: int = 5
    strided: bool = False
    widened: bool = False  # q, kv and indices laid out as FlashMLA's own prefill test lays them out

    def __str__(self) -> str:
        flags = [
            name
            for name, on in (
                ("sink", self.sink),
                ("len", self.lengths),
                ("strided", self.strided),
                ("widened", self.widened),
            )
            if on
        ]
        return "-".join(
            [f"sq{self.s_q}", f"h{self.h_q}", f"{self.d_qk}v{self.d_v}", f"kv{self.s_kv}", f"k{self.topk}", *flags]
        )


def prefill_inputs(gen, case: Prefill):
    q = torch.randn(case.s_q, case.h_q, case.d_qk, generator=gen).bfloat16()
    kv = (torch.randn(case.s_kv, 1, case.d_qk, generator=gen) / 10).bfloat16()
    idx = hostile_indices(gen, case.s_q, case.topk, case.s_kv, case.lonely_every)
    sink = sinks_for(gen, case.h_q) if case.sink else None
    lengths = lengths_for(gen, case.s_q, case.topk) if case.lengths else None
    kv[unselected(idx, case.s_kv, lengths)] = math.nan
    idx = idx.reshape(case.s_q, 1, case.topk)
    if case.strided:  # FlashMLA's tests pass slices of larger tensors; kv's rows stay whole rows apart
        q, kv, idx = strided(q, 1, 3), strided(kv, 1, 1), strided(idx, 2, 5)
    if case.widened:  # kv's rows 128 + d_qk * 2 elements apart: not whole rows, a multiple of 16 bytes
        q, kv, idx = widened(q), widened(kv), widened(idx)
    return q, kv, idx, sink, lengths


def run_prefill(case: Prefill, q, kv, idx, sink, lengths):
    # called as FlashMLA's test library calls it
    got = fm.flash_mla_sparse_fwd(q, kv, idx, sm_scale=PREFILL_SCALE, d_v=case.d_v, attn_sink=sink, topk_length=lengths)
    want = ref_sparse_attn(q, kv[:, 0].double(), idx[:, 0], PREFILL_SCALE, case.d_v, sink, lengths)
    return got, want


def check_prefill(case: Prefill, got, want, device: str):
    out, max_logits, lse = got
    s_q, h_q = case.s_q, case.h_q
    assert out.shape == (s_q, h_q, case.d_v) and out.dtype == torch.bfloat16
    assert max_logits.shape == (s_q, h_q) and max_logits.dtype == torch.float32
    assert lse.shape == (s_q, h_q) and lse.dtype == torch.float32
    assert_close("out", out, want[0], **OUT_TOL[device])
    assert_close("max_logits", max_logits, want[1], **LOGIT_TOL)
    assert_close("lse", lse, want[2], **LOGIT_TOL)
    lonely = want[2].isposinf().to(out.device)
    assert out[lonely].eq(0).all()


PREFILL_CPU = [
    Prefill(1, 128, 576, 128, 128),
    Prefill(62, 16, 512, 95, 128),  # top-k wider than the KV: out-of-range entries
    Prefill(213, 8, 576, 592, 128, strided=True),
    Prefill(62, 16, 576, 592, 128, sink=True, lengths=True, widened=True),
    Prefill(62, 64, 512, 153, 256, widened=True),
    Prefill(62, 64, 576, 153, 64, sink=True, lengths=True),
    Prefill(62, 8, 512, 300, 100, sink=True, lengths=True),  # a top-k the shim pads to 128
    Prefill(213, 16, 576, 40, 192, sink=True, lengths=True, lonely_every=3),  # few valid rows: many lonely
    Prefill(5, 1, 256, 50, 64, d_v=256, sink=True),  # one head, 256 + 0: beyond FlashMLA
]


@pytest.mark.parametrize("case", PREFILL_CPU, ids=str)
def test_sparse_fwd(gen, case):
    inputs = prefill_inputs(gen, case)
    got, want = run_prefill(case, *inputs)
    check_prefill(case, got, want, "cpu")


PREFILL_CUDA = (
    [
        Prefill(s_q, h_q, d_qk, s_kv, topk)
        for d_qk in (512, 576)
        for h_q in (64, 128, 8, 16)
        for s_kv, topk in ((128, 128), (1840, 256), (95, 128))
        for s_q in (1, 62, 213)
    ]
    + [
        Prefill(s_q, h_q, d_qk, s_kv, topk, sink=True, lengths=True)
        for d_qk in (512, 576)
        for h_q in (64, 128, 8, 16)
        for s_kv, topk in ((592, 128), (153, 256))
        for s_q in (62, 213)
    ]
    + [
        Prefill(s_q, h_q, 576, s_kv, topk, sink=True, lengths=True, lonely_every=2)
        for h_q in (64, 128)
        for s_q, s_kv, topk in ((1, 128, 128), (1234, 4321, 4096), (1024, 32, 2048))
    ]
    + [Prefill(213, 16, 576, 592, 100, sink=True, lengths=True, strided=True)]
    + [
        Prefill(s_q, h_q, d_qk, s_kv, topk, sink=True, lengths=True, widened=True)
        for d_qk in (512, 576)
        for h_q in (64, 128)
        for s_q, s_kv, topk in ((62, 1840, 256), (213, 95, 128))
    ]
)


@pytest.fixture(scope="module")
def compiled():
    """Compile every kernel the ``cuda`` cases run, in parallel, before the first of them."""
    keys = []
    for case in PREFILL_CUDA:
        keys += dsa._cuda.attn_keys(
            "bf16", case.d_v, case.d_qk - case.d_v, case.h_q, PREFILL_SCALE, case.lengths, sink=case.sink
        )
    for case in DECODE_CUDA:
        lay = case.layout
        keys += dsa._cuda.attn_keys(
            "packed", lay.d_nope, lay.d_rope, case.h_q, lay.d_qk**-0.5, case.lengths, sink=case.sink
        )
    dsa._cuda.warmup(keys, workers=16, progress=False)


@pytest.mark.cuda
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("case", PREFILL_CUDA, ids=str)
def test_sparse_fwd_cuda(gen, case):
    got, want = run_prefill(case, *[to_cuda(x) for x in prefill_inputs(gen, case)])
    check_prefill(case, got, want, "cuda")


def test_sparse_fwd_pads_any_topk_with_invalid_entries(gen):
    case = Prefill(9, 8, 576, 200, 70, sink=True, lengths=True)
    q, kv, idx, sink, lengths = prefill_inputs(gen, case)
    padded = torch.cat([idx, torch.full((9, 1, 58), -1, dtype=torch.int32)], dim=2)
    got = fm.flash_mla_sparse_fwd(q, kv, idx, PREFILL_SCALE, 512, sink, lengths)
    want = fm.flash_mla_sparse_fwd(q, kv, padded, PREFILL_SCALE, 512, sink, lengths)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_sparse_fwd_lonely_rows_and_infinite_sinks(gen, device):
    # every convention at once: a lonely row, a row cut to nothing by topk_length, sinks -inf / +inf / finite
    q = torch.randn(3, 3, 576, generator=gen).bfloat16().to(device)
    kv = torch.randn(10, 1, 576, generator=gen).bfloat16().to(device)
    idx = torch.tensor(
        [[[INT_MIN, -1, 10, INT_MAX] + [-1] * 60], [[1, 2, 3, 4] + [-1] * 60], [[5, 6, -123456, 7] + [-1] * 60]],
        dtype=torch.int32,
        device=device,
    )
    lengths = torch.tensor([64, 0, 64], dtype=torch.int32, device=device)
    sink = torch.tensor([-math.inf, math.inf, 0.25], device=device)
    out, max_logits, lse = fm.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, sink, lengths)
    assert out[:2].eq(0).all() and (lse[:2] == math.inf).all() and (max_logits[:2] == -math.inf).all()
    assert out[2, 1].eq(0).all() and out[2, 0].ne(0).any() and lse[2].isfinite().all()
    plain = fm.flash_mla_sparse_fwd(q, kv, idx, 0.1, 512, None, lengths)
    assert torch.equal(plain[1], max_logits) and torch.equal(plain[2], lse)  # the sink changes out only
    assert torch.equal(plain[0][2, 0], out[2, 0])  # a -inf sink changes nothing


def test_sparse_fwd_compiles_to_one_graph(gen):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fm.flash_mla_sparse_fwd, backend=counter, fullgraph=True, dynamic=True)
    first = None
    for s_q in (3, 5, 9):
        q, kv, idx, sink, lengths = prefill_inputs(gen, Prefill(s_q, 8, 576, 150, 100, sink=True, lengths=True))
        got = compiled(q, kv, idx, PREFILL_SCALE, 512, sink, lengths)
        want = fm.flash_mla_sparse_fwd(q, kv, idx, PREFILL_SCALE, 512, sink, lengths)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        # the first call may compile twice (dynamo restarts once to specialize the Python float sm_scale)
        first = counter.frame_count if first is None else first
    assert counter.frame_count == first  # other token counts reuse the graph


@pytest.mark.cuda
@pytest.mark.usefixtures("compiled")
def test_sparse_fwd_graph_capture_replays_new_inputs(gen):
    case = Prefill(62, 64, 576, 592, 256, sink=True, lengths=True)
    q, kv, idx, sink, lengths = [x.cuda() for x in prefill_inputs(gen, case)]

    def step():
        return fm.flash_mla_sparse_fwd(q, kv, idx, PREFILL_SCALE, 512, sink, lengths)

    step()  # compiles the kernels: compiling inside a capture is an error
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        for static, new in zip((q, kv, idx, sink, lengths), prefill_inputs(gen, case)):
            static.copy_(new)
        graph.replay()
        eager = step()
        for c, e in zip(captured, eager):
            assert torch.equal(c, e)
        check_prefill(case, captured, run_prefill(case, q, kv, idx, sink, lengths)[1], "cuda")


# ------------------------------------------------------------------------------------------
# Decode: get_mla_metadata and flash_mla_with_kvcache.


@dataclass(frozen=True)
class Decode:
    b: int
    s_q: int
    h_q: int
    page: int
    topk: int
    pool_dtype: torch.dtype = torch.float8_e4m3fn
    d_nope: int = 512
    d_rope: int = 64
    sink: bool = False
    lengths: bool = False
    lonely_every: int = 4
    layers: int = 1  # > 1: the pool is one layer's view of a buffer of several, pages that far apart
    row_gap: int = 0  # bytes between one row's end and the next row's start within a page (a slice of wider rows)

    @property
    def layout(self) -> KCacheLayout:
        return KCacheLayout(self.d_nope, self.d_rope)

    @property
    def blocks(self) -> int:
        return max(2, -(-2 * self.topk // self.page)) + 1

    def __str__(self) -> str:
        flags = [
            name
            for name, on in (
                ("sink", self.sink),
                ("len", self.lengths),
                (f"layers{self.layers}", self.layers > 1),
                (f"gap{self.row_gap}", self.row_gap > 0),
            )
            if on
        ]
        return "-".join(
            [
                f"b{self.b}",
                f"sq{self.s_q}",
                f"h{self.h_q}",
                f"{self.d_nope}+{self.d_rope}",
                f"page{self.page}",
                f"k{self.topk}",
                DTYPE_NAMES[self.pool_dtype],
                *flags,
            ]
        )


def decode_inputs(gen, case: Decode):
    lay = case.layout
    slots = case.blocks * case.page
    k_nope = torch.randn(slots, lay.d_nope, generator=gen).bfloat16()
    k_rope = torch.randn(slots, lay.d_rope, generator=gen).bfloat16() if lay.d_rope else None
    rows = dsa.quant_k_cache(k_nope, k_rope)  # [slots, row_bytes] uint8
    q = torch.randn(case.b, case.s_q, case.h_q, lay.d_qk, generator=gen).bfloat16()
    idx = hostile_indices(gen, case.b * case.s_q, case.topk, slots, case.lonely_every)
    lengths = lengths_for(gen, case.b, case.topk) if case.lengths else None
    token_lengths = None if lengths is None else lengths.repeat_interleave(case.s_q)
    rows[unselected(idx, slots, token_lengths)] = 0xFF  # NaN values, scales and tails in rows nobody selects
    buffer = torch.full((case.blocks, case.layers, case.page, lay.row_bytes + case.row_gap), 0xFF, dtype=torch.uint8)
    layer = buffer[:, case.layers // 2, :, : lay.row_bytes]  # [blocks, page, row_bytes], the gaps NaN bytes
    layer.copy_(rows.reshape(case.blocks, case.page, lay.row_bytes))
    k_cache = layer.unsqueeze(2).view(case.pool_dtype)  # [blocks, page, 1, row_bytes]
    sink = sinks_for(gen, case.h_q) if case.sink else None
    return q, k_cache, idx.reshape(case.b, case.s_q, case.topk), sink, lengths


def ref_decode(case: Decode, q, k_cache, idx, sink, lengths):
    """FlashMLA's decode definition: ``out [b, s_q, h_q, d_v]`` and ``lse [b, h_q, s_q]`` in float64."""
    lay = case.layout
    rows = dequant_rows(k_cache.view(torch.uint8).reshape(-1, lay.row_bytes), lay)
    token_lengths = None if lengths is None else lengths.repeat_interleave(case.s_q)
    flat_q = q.reshape(case.b * case.s_q, case.h_q, lay.d_qk)
    scale = lay.d_qk**-0.5  # FlashMLA's default softmax_scale
    out, _, lse = ref_sparse_attn(
        flat_q, rows, idx.reshape(case.b * case.s_q, case.topk), scale, lay.d_nope, sink, token_lengths
    )
    return (
        out.reshape(case.b, case.s_q, case.h_q, lay.d_nope),
        lse.reshape(case.b, case.s_q, case.h_q).transpose(1, 2),
    )


def run_decode(case: Decode, q, k_cache, idx, sink, lengths, meta=None):
    if meta is None:
        cache_seqlens = torch.full((case.b,), case.topk, dtype=torch.int32, device=q.device)
        meta = fm.get_mla_metadata(cache_seqlens, case.s_q * case.h_q, 1, case.h_q, True, case.topk)
    # positionally, as FlashMLA's test library calls it (softmax_scale None: d_qk ** -0.5)
    return fm.flash_mla_with_kvcache(
        q, k_cache, None, None, case.d_nope, meta[0], meta[1], None, False, True, idx, sink, None, None, lengths, None
    )


def check_decode(case: Decode, got, want, device: str):
    out, lse = got
    assert out.shape == (case.b, case.s_q, case.h_q, case.d_nope) and out.dtype == torch.bfloat16
    assert lse.shape == (case.b, case.h_q, case.s_q) and lse.dtype == torch.float32
    assert_close("out", out, want[0], **OUT_TOL[device])
    assert_close("lse", lse, want[1], **LOGIT_TOL)
    lonely = want[1].isposinf().transpose(1, 2).to(out.device)  # [b, s_q, h_q]
    assert out[lonely].eq(0).all()


DECODE_CPU = [
    Decode(2, 1, 16, page, topk, dtype)
    for (page, topk), dtype in zip(((2, 64), (53, 100), (61, 576), (64, 64), (69, 128), (576, 64)), POOL_DTYPES * 2)
] + [
    Decode(2, 3, 64, 64, 128, torch.uint8, sink=True, lengths=True),
    Decode(3, 3, 8, 53, 100, torch.int8, sink=True, lengths=True, lonely_every=2),
    Decode(2, 1, 128, 61, 64, torch.float8_e4m3fn, sink=True),
    Decode(2, 3, 16, 69, 64, torch.int8, d_nope=512, d_rope=0, lengths=True),  # the 528-byte row
    Decode(2, 1, 1, 2, 64, torch.uint8, d_nope=256, d_rope=0, sink=True),  # one head, 264-byte rows
    Decode(2, 3, 16, 64, 128, torch.float8_e4m3fn, sink=True, lengths=True, layers=3),
    Decode(2, 3, 16, 53, 128, torch.uint8, sink=True, lengths=True, layers=2, row_gap=16),  # rows 672 bytes apart
    Decode(2, 1, 8, 61, 64, torch.int8, layers=3, row_gap=656),  # rows two rows apart: read in place
    Decode(2, 1, 8, 2, 64, torch.uint8, d_nope=256, d_rope=0, row_gap=8),  # 264-byte rows 272 bytes apart
]


@pytest.mark.parametrize("case", DECODE_CPU, ids=str)
def test_with_kvcache(gen, case):
    inputs = decode_inputs(gen, case)
    check_decode(case, run_decode(case, *inputs), ref_decode(case, *inputs), "cpu")


DECODE_CUDA = (
    [
        Decode(b, s_q, h_q, page, topk, dtype)
        for (page, dtype) in zip(PAGES, POOL_DTYPES * 2)
        for h_q in (64, 128, 16)
        for topk in (64, 576, 2048)
        for b, s_q in ((4, 1), (74, 3))
    ]
    + [
        Decode(74, 3, h_q, page, topk, dtype, d_nope=512, d_rope=0, sink=True, lengths=True)
        for h_q in (64, 8)
        for page, topk, dtype in ((2, 64, torch.uint8), (64, 576, torch.float8_e4m3fn))
    ]
    + [
        Decode(b, 3, h_q, page, topk, dtype, sink=True, lengths=True, lonely_every=2)
        for h_q in (64, 128)
        for b in (4, 321)
        for page, topk, dtype in ((61, 64, torch.int8), (53, 576, torch.float8_e4m3fn), (69, 100, torch.uint8))
    ]
    + [Decode(74, 1, 128, 64, 2048, torch.float8_e4m3fn, sink=True, lengths=True, layers=3)]
    + [
        Decode(74, 3, h_q, 64, 576, dtype, sink=True, lengths=True, layers=2, row_gap=gap)
        for h_q in (64, 16)
        for dtype, gap in ((torch.float8_e4m3fn, 16), (torch.uint8, 656))
    ]
)


@pytest.mark.cuda
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("case", DECODE_CUDA, ids=str)
def test_with_kvcache_cuda(gen, case):
    inputs = [to_cuda(x) for x in decode_inputs(gen, case)]  # a per-layer pool view keeps its page stride
    check_decode(case, run_decode(case, *inputs), ref_decode(case, *inputs), "cuda")


def test_with_kvcache_reads_the_pool_in_place(gen, monkeypatch):
    # the op receives a uint8 view of the caller's memory with the caller's strides, for every pool dtype
    seen = []
    real = dsa.ops.sparse_attn

    def spy(q, kv, *args):
        seen.append(kv)
        return real(q, kv, *args)

    monkeypatch.setattr(dsa.ops, "sparse_attn", spy)
    for dtype in POOL_DTYPES:
        case = Decode(2, 1, 8, 16, 64, dtype, layers=3)
        q, k_cache, idx, sink, lengths = decode_inputs(gen, case)
        run_decode(case, q, k_cache, idx, sink, lengths)
        kv = seen.pop()
        assert kv.dtype == torch.uint8 and kv.data_ptr() == k_cache.data_ptr()
        assert kv.shape == k_cache.shape and kv.stride() == k_cache.stride()
        assert k_cache.stride(0) == 3 * case.page * case.layout.row_bytes  # pages three layers apart


def test_with_kvcache_pool_dtypes_agree(gen):
    case = Decode(2, 3, 16, 61, 128, sink=True, lengths=True)
    q, k_cache, idx, sink, lengths = decode_inputs(gen, case)
    results = [run_decode(case, q, k_cache.view(dtype), idx, sink, lengths) for dtype in POOL_DTYPES]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_with_kvcache_lse_layout_is_flashmlas(gen):
    # FlashMLA returns lse as the [b, h_q, s_q] transpose of a contiguous [b, s_q, h_q] tensor
    case = Decode(2, 3, 8, 64, 64)
    _, lse = run_decode(case, *decode_inputs(gen, case))
    assert lse.shape == (2, 8, 3) and lse.stride() == (24, 1, 8)


def test_with_kvcache_strided_q_and_indices(gen):
    case = Decode(2, 3, 16, 53, 100, torch.int8, sink=True, lengths=True)
    q, k_cache, idx, sink, lengths = decode_inputs(gen, case)
    want = run_decode(case, q, k_cache, idx, sink, lengths)
    for got in (
        run_decode(case, strided(q, 2, 3), k_cache, strided(idx, 2, 7), sink, lengths),
        run_decode(case, widened(q), k_cache, widened(idx), sink, lengths),  # as FlashMLA's decode test passes them
    ):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_with_kvcache_explicit_scale_and_keywords(gen):
    case = Decode(2, 1, 8, 64, 64, sink=True)
    q, k_cache, idx, sink, lengths = decode_inputs(gen, case)
    meta, splits = fm.get_mla_metadata()
    by_keyword = fm.flash_mla_with_kvcache(
        q=q,
        k_cache=k_cache,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=512,
        tile_scheduler_metadata=meta,
        num_splits=splits,
        softmax_scale=576**-0.5,
        is_fp8_kvcache=True,
        indices=idx,
        attn_sink=sink,
    )
    default = run_decode(case, q, k_cache, idx, sink, lengths)
    assert torch.equal(by_keyword[0], default[0]) and torch.equal(by_keyword[1], default[1])
    other = fm.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, splits, 0.01, is_fp8_kvcache=True, indices=idx)
    rows = dequant_rows(k_cache.view(torch.uint8).reshape(-1, case.layout.row_bytes), case.layout)
    want = ref_sparse_attn(q.reshape(2, 8, 576), rows, idx.reshape(2, 64), 0.01, 512)
    assert_close("out", other[0], want[0].reshape(2, 1, 8, 512), **OUT_TOL["cpu"])
    assert_close("lse", other[1], want[2].reshape(2, 1, 8).transpose(1, 2), **LOGIT_TOL)


def test_metadata_is_a_placeholder():
    # the old call form (FlashMLA's first sparse release), the new one and keywords all give the same placeholder;
    # nothing is read: a tensor with no data (the meta device) is fine
    seqlens = torch.empty(4, dtype=torch.int32, device="meta")
    for meta, splits in (
        fm.get_mla_metadata(seqlens, 128, 1, 128, True, 2048),
        fm.get_mla_metadata(),
        fm.get_mla_metadata(cache_seqlens=seqlens, num_q_tokens_per_head_k=64, num_heads_k=1),
    ):
        assert isinstance(meta, fm.FlashMLASchedMeta) and splits is None
        assert not meta.have_initialized and meta.tile_scheduler_metadata is None and meta.num_splits is None


def test_with_kvcache_ignores_schedules_of_any_kind(gen):
    # one placeholder reused across shapes, and the old API's metadata tensors, give the same results
    meta = fm.get_mla_metadata()
    old = (torch.zeros(132, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    for case in (Decode(2, 1, 8, 64, 64), Decode(3, 2, 16, 69, 128, torch.uint8)):
        inputs = decode_inputs(gen, case)
        a, b = run_decode(case, *inputs, meta=meta), run_decode(case, *inputs, meta=old)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert meta[0] == fm.FlashMLASchedMeta()  # never written


def test_with_kvcache_compiles_to_one_graph(gen):
    torch._dynamo.reset()
    meta = fm.get_mla_metadata()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fm.flash_mla_with_kvcache, backend=counter, fullgraph=True, dynamic=True)
    first = None
    for b in (2, 3, 5):
        case = Decode(b, 3, 8, 64, 100, sink=True, lengths=True)
        q, k_cache, idx, sink, lengths = decode_inputs(gen, case)
        args = (q, k_cache, None, None, 512, meta[0], None, None, False, True, idx, sink, None, None, lengths)
        got, want = compiled(*args), fm.flash_mla_with_kvcache(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        first = counter.frame_count if first is None else first
    assert counter.frame_count == first  # other batch sizes reuse the graph


@pytest.mark.cuda
@pytest.mark.usefixtures("compiled")
def test_with_kvcache_graph_capture_replays_new_inputs(gen):
    case = Decode(74, 1, 128, 64, 2048, sink=True, lengths=True)
    q, k_cache, idx, sink, lengths = [x.cuda() for x in decode_inputs(gen, case)]
    meta = fm.get_mla_metadata(torch.full((74,), 4096, dtype=torch.int32, device="cuda"), 128, 1, 128, True, 2048)

    def step():
        return run_decode(case, q, k_cache, idx, sink, lengths, meta)

    step()  # compiles the kernels: compiling inside a capture is an error
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        new = decode_inputs(gen, case)
        k_cache.view(torch.uint8).copy_(new[1].view(torch.uint8))
        for static, fresh in zip((q, idx, sink, lengths), new[:1] + new[2:]):
            static.copy_(fresh)
        graph.replay()
        eager = step()
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
        check_decode(case, captured, ref_decode(case, q, k_cache, idx, sink, lengths), "cuda")


# ------------------------------------------------------------------------------------------
# What is not supported, and bad input.


def _decode_kwargs(gen):
    case = Decode(1, 1, 8, 64, 64)
    q, k_cache, idx, _, _ = decode_inputs(gen, case)
    return dict(
        q=q,
        k_cache=k_cache,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=512,
        tile_scheduler_metadata=fm.get_mla_metadata()[0],
        is_fp8_kvcache=True,
        indices=idx,
    )


UNSUPPORTED = {  # the argument the message names -> how the call sets it
    "indices=None": lambda kw: dict(indices=None),
    "extra_k_cache": lambda kw: dict(extra_k_cache=kw["k_cache"]),
    "extra_indices_in_kvcache": lambda kw: dict(extra_indices_in_kvcache=kw["indices"]),
    "extra_topk_length": lambda kw: dict(extra_topk_length=torch.zeros(1, dtype=torch.int32)),
    "causal=True": lambda kw: dict(causal=True),
    "is_fp8_kvcache=False": lambda kw: dict(is_fp8_kvcache=False),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_with_kvcache_unsupported_modes_say_so(gen, name):
    kwargs = _decode_kwargs(gen)
    with pytest.raises(NotImplementedError, match=re.escape(name) + " is not supported"):
        fm.flash_mla_with_kvcache(**{**kwargs, **UNSUPPORTED[name](kwargs)})


def test_with_kvcache_flashmlas_own_512_row_is_refused(gen):
    kwargs = _decode_kwargs(gen)
    kwargs["q"] = kwargs["q"][..., :512].contiguous()
    kwargs["k_cache"] = torch.zeros(2, 64, 1, fm.FLASHMLA_MODEL1_ROW_BYTES, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="k_cache.*KCacheLayout"):
        fm.flash_mla_with_kvcache(**kwargs)


BAD_DECODE = {
    "bf16-pool": (dict(k_cache=torch.zeros(2, 64, 1, 576, dtype=torch.bfloat16)), TypeError, "k_cache"),
    "3d-q": (dict(q=torch.zeros(8, 8, 576, dtype=torch.bfloat16)), ValueError, "q must be"),
    "indices-batch": (dict(indices=torch.zeros(2, 1, 64, dtype=torch.int32)), ValueError, "indices must be"),
    "lengths-per-token": (dict(topk_length=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "topk_length must"),
    "lengths-int64": (dict(topk_length=torch.zeros(1, dtype=torch.int64)), TypeError, "topk_length"),
    "row-width": (dict(k_cache=torch.zeros(2, 64, 1, 528, dtype=torch.uint8)), ValueError, "kv"),
}


@pytest.mark.parametrize("name", BAD_DECODE)
def test_with_kvcache_bad_input_names_the_argument(gen, name):
    change, exc, message = BAD_DECODE[name]
    with pytest.raises(exc, match=message):
        fm.flash_mla_with_kvcache(**{**_decode_kwargs(gen), **change})


def test_sparse_fwd_bad_input_names_the_argument(gen):
    q, kv, idx, _, _ = prefill_inputs(gen, Prefill(4, 8, 576, 64, 64))
    with pytest.raises(NotImplementedError, match="kv.*h_kv = 1"):
        fm.flash_mla_sparse_fwd(q, kv.expand(64, 2, 576), idx, PREFILL_SCALE)
    with pytest.raises(TypeError, match="indices must be int32"):
        fm.flash_mla_sparse_fwd(q, kv, idx.long(), PREFILL_SCALE)
    with pytest.raises(ValueError, match="kv"):
        fm.flash_mla_sparse_fwd(q, kv[..., :512], idx, PREFILL_SCALE)
    with pytest.raises(TypeError, match="attn_sink"):
        fm.flash_mla_sparse_fwd(q, kv, idx, PREFILL_SCALE, attn_sink=torch.zeros(8, dtype=torch.float64))


def test_core_ops_take_flashmlas_strides(gen):
    # the contract under the face: checker, reference and fake take pools whose rows are not whole rows apart
    q = torch.randn(5, 8, 576, generator=gen).bfloat16()
    kv = (torch.randn(40, 1, 576, generator=gen) / 10).bfloat16()
    idx = torch.randint(-2, 44, (5, 64), generator=gen, dtype=torch.int32)
    want = dsa.sparse_attn(q, kv, idx, 0.5, 512)
    for pool in (widened(kv), widened(kv[:, 0]), widened(kv.reshape(8, 5, 576)).unsqueeze(2)):
        got = dsa.sparse_attn(q, pool, idx, 0.5, 512)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        torch.library.opcheck(torch.ops.dsa.sparse_attn.default, (q, pool, idx, 0.5, 512))
    packed = dsa.quant_k_cache(kv[:, 0, :512].contiguous(), kv[:, 0, 512:].contiguous())  # [40, 656]
    ids = torch.tensor([3, -1, 39, 40, 0], dtype=torch.int32)
    rows = strided(packed.view(8, 5, 656), 2, 16)  # rows 672 bytes apart
    assert torch.equal(dsa.gather_k_cache(rows, ids), dsa.gather_k_cache(packed, ids))
    torch.library.opcheck(torch.ops.dsa.gather_k_cache.default, (rows, ids))


def test_strides_the_kernels_cannot_reach_are_refused(gen):
    q = torch.randn(5, 8, 576, generator=gen).bfloat16()
    idx = torch.zeros(5, 64, dtype=torch.int32)
    kv = torch.zeros(40, 580, dtype=torch.bfloat16)[:, :576]  # rows 1160 bytes apart
    with pytest.raises(ValueError, match="kv must be rows a whole number of 576-element rows or a multiple of 16"):
        fm.flash_mla_sparse_fwd(q, kv.unsqueeze(1), idx.unsqueeze(1), PREFILL_SCALE)
    pool = torch.zeros(40, 672, dtype=torch.uint8)[:, :656]  # a pool that is written keeps its rows packed
    with pytest.raises(ValueError, match="cache must be contiguous when 2-d"):
        dsa.store_k_cache(torch.zeros(1, 512).bfloat16(), torch.zeros(1, 64).bfloat16(), pool, idx[0, :1])


def test_module_exports():
    assert sorted(fm.__all__) == sorted(
        ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]
    )
    assert all(callable(getattr(fm, name)) for name in fm.__all__)
