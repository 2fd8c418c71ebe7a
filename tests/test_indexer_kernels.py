"""The lightning indexer's TileLang kernels (``csrc_tl/indexer.py``) on their own, without the ops around them.

CPU: representative keys of every builder lowered for CUDA (sm_90a) and HIP (gfx950), and checks of what only the
generated code shows (the FP8 GEMM instruction, TMA loads, cache reads behind their slot checks, no register spills
under nvcc). The sweep over many keys carries the ``lowering`` marker.

GPU (``cuda``): each builder compiled directly with TileLang and called as its docstring says, against small
pure-Torch computations written here: bytes exactly for quantize / store / gather, logits in float64 with the
tolerance derived below. Inputs are hostile (sentinel slot ids and page-table entries, ranges past both ends, empty
rows, lengths 0, 1, page, page + 1 and past W), outputs are NaN before the call and unread cache bytes are NaN.
"""

import functools
import re

import pytest
import torch

from csrc_tl import indexer as ix
from csrc_tl import kpool as kp
from tests.nvcc import assert_no_serialized_wgmma, assert_no_spills, compile_sm90a, needs_nvcc

FP8 = torch.float8_e4m3fn
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
D = 128
# Values of the exact logits data: every product of two of them is a multiple of 1/4 of magnitude at most 4, so a
# dot of 128 products is a multiple of 1/4 below 2^9 in magnitude and exact in any adder of 11 or more bits, the FP8
# tensor cores' included. What remains is float32 rounding: Hi products w * relu(s), their sum (each partial sum
# within 2^-24 of the sum of magnitudes, so (Hi - 1) * 2^-24 in all, 7.6e-6 at 128 heads) and one product by the
# key's scale: 1e-5 of k_scale * sum_h |w_h| * relu(s_h) bounds every order of summation.
EXACT_VALUES = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0])
EXACT_REL = 1e-5
# With arbitrary FP8 values the dot itself rounds: the FP8 tensor cores' adders keep about 14 mantissa bits. Hold
# those to 2^-9 of k_scale * sum_h |w_h| * sum_d |q_hd * k_d| (a wrong row, head, weight or scale is off by the
# order of that magnitude itself).
FP8_DOT_REL = 2.0**-9


# ---------------------------------------------------------------------------------------------------------------
# Lowering (CPU).


@functools.cache
def lowered(key, target: str) -> str:
    """The device source of ``key``'s kernel for ``target``, lowered as the build lowers it (once per process)."""
    from sparse_dsa_ops import _cuda

    return _cuda.lower_source(key, target)


def build(key):
    return {
        ix.QuantIndexKey: ix.build_quant_index,
        ix.GatherIndexKey: ix.build_gather_index_k,
        ix.IndexLogitsKey: ix.build_index_logits,
        ix.PagedLogitsKey: ix.build_paged_index_logits,
        ix.IndexFilterKey: ix.build_index_filter,
    }[type(key)](key)


def body(src: str) -> str:
    return src[src.index('extern "C"') :]


def enclosing_conditions(src: str, pattern: str) -> list[str]:
    """For each line of ``src`` matching ``pattern``: the conditions of the ``if`` blocks that enclose it, joined."""
    lines = src.splitlines()
    found = []
    for n, line in enumerate(lines):
        if not re.search(pattern, line):
            continue
        depth = len(line) - len(line.lstrip())
        conds = []
        for above in reversed(lines[:n]):
            indent = len(above) - len(above.lstrip())
            if indent < depth and above.strip():
                depth = indent
                if above.lstrip().startswith("if ("):
                    conds.append(above.strip().rstrip("{").strip())
        found.append(" && ".join(conds))
    return found


CACHE_KEYS = [ix.QuantIndexKey(D), ix.QuantIndexKey(D, 64, True, "int64"), ix.GatherIndexKey(D, 64)]


def test_key_names_spell_the_specialization():
    assert ix.QuantIndexKey(128).name == "quant_index_d128"
    assert ix.QuantIndexKey(128, 64, True, "int64").name == "store_index_k_d128_p64_pow2_i64"
    assert str(ix.GatherIndexKey(128, 64)) == "gather_index_k_d128_p64_i32"
    assert ix.index_logits_key(128, 64, "float8_e4m3fn", "cuda").name == "index_logits_d128_h64_qfp8_ws"
    assert ix.index_logits_key(128, 64, "float8_e4m3fn", "hip").name == "index_logits_d128_h64_qfp8"
    assert ix.index_logits_key(128, 8, "bfloat16", "cuda").name == "index_logits_d128_h8_qbf16"
    paged = ix.paged_logits_key(128, 64, 64, "float8_e4m3fn", "cuda")
    assert paged.name == "paged_index_logits_d128_h64_p64_qfp8_ws_s16"
    # pages the TMA path does not take run the portable kernel; a CTA always takes whole 64-row tiles
    assert ix.paged_logits_key(128, 64, 3, "float8_e4m3fn", "cuda").name == "paged_index_logits_d128_h64_p3_qfp8_s384"
    assert ix.paged_logits_key(128, 8, 1, "float8_e4m3fn", "cuda").pages_per_cta == 1024


@pytest.mark.parametrize(
    "tokens, heads, keys, cols",
    [
        (4096, 64, 65536, ix.LOGITS_CHUNK),  # a whole prompt: its token blocks fill the GPU
        (4096, 8, 65536, ix.LOGITS_CHUNK),
        (220, 64, 65536, 13696),  # an index_topk chunk at 64 heads: 55 CTAs of 4 tokens, 5 chunks each
        (220, 8, 65536, ix.LOGITS_MIN_COLS),  # at 8 heads, 7 CTAs of 32 tokens: the smallest chunks, 32 each
        (1, 8, 65536, ix.LOGITS_MIN_COLS),  # one token: the smallest chunks
        (300, 1, 100, ix.LOGITS_MIN_COLS),  # fewer keys than the smallest chunk
        (4096, 1, 65536, ix.LOGITS_CHUNK),  # one head: the warp-specialized kernel's CTAs of 32 tokens fill the GPU
    ],
)
def test_prefill_columns_a_cta_fill_the_gpu(tokens, heads, keys, cols):
    got = ix.logits_cols(tokens, heads, keys, 132, ws=True)
    assert got == cols and got % ix.BN == 0


def test_prefill_columns_follow_the_portable_kernels_blocks():
    # one head: the portable kernel's 32 blocks of 128 tokens take 8000 columns a CTA for about 2 CTAs an SM; the
    # warp-specialized kernel's CTA takes two query blocks of 16 tokens
    assert ix.head_padding(1) == (1, 128) and ix.head_padding(1, ws=True) == (ix.WS_MIN_HP, 16)
    assert ix.cta_tokens(1, ws=False) == 128 and ix.cta_tokens(1, ws=True) == 32
    assert ix.logits_cols(4096, 1, 65536, 132, ws=False) == 8000


@pytest.mark.parametrize(
    "key, message",
    [
        (ix.QuantIndexKey(96), "multiple of 64"),
        (ix.QuantIndexKey(128, -1), "page must be 0"),
        (ix.QuantIndexKey(128, 64, slot_dtype="int16"), "int32 or int64"),
        (ix.GatherIndexKey(128, 0), "positive number of tokens"),
        (ix.IndexLogitsKey(128, 0), "heads must be in 1..128"),
        (ix.IndexLogitsKey(128, 129), "heads must be in 1..128"),
        (ix.IndexLogitsKey(128, 8, "bfloat16", ws=True), "no warp-specialized kernel"),
        # 3 pages of 16 tokens are not whole 64-row tiles (the portable kernel: the warp-specialized one refuses
        # pages of 16 tokens before it looks at the split)
        (ix.PagedLogitsKey(128, 8, 16, ws=False, split_pages=3), "whole 64-row tiles"),
        # the warp-specialized decode takes pages of a multiple of 64 tokens only
        (ix.PagedLogitsKey(128, 8, 16, ws=True), "no warp-specialized kernel"),
        (ix.PagedLogitsKey(128, 8, 3, ws=True), "no warp-specialized kernel"),
        (ix.PagedLogitsKey(128, 8, 64, "bfloat16", ws=True), "no warp-specialized kernel"),
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_builders_refuse_bad_keys(key, message):
    with pytest.raises(AssertionError, match=message):
        build(key)


@pytest.mark.parametrize("target", ["cuda", "hip"])
@pytest.mark.parametrize("key", CACHE_KEYS, ids=str)
def test_cache_kernels_read_and_write_only_valid_slots(key, target):
    src = body(lowered(key, target))
    limit = f"slot < (((int64_t)p) * (int64_t){key.page})"
    if isinstance(key, ix.QuantIndexKey) and key.page == 0:
        # one 16-byte load of 8 bf16 values a lane, one 8-byte store of their FP8 values, a 16-lane butterfly
        assert "*(uint4*)(x + " in src and "*(fp8_e4_8_t*)(values + " in src
        shuffle = {"cuda": r"__shfl_xor_sync\([^,]+, sc\[0\], (\d+), 32\)", "hip": r"__shfl_xor\(sc\[0\], (\d+), 32\)"}
        assert re.findall(shuffle[target], src) == ["8", "4", "2", "1"]
    elif isinstance(key, ix.QuantIndexKey):
        # every write into the cache sits behind the slot check (ids are int64 here: no truncation)
        writes = enclosing_conditions(src, r"\) = \*\(fp8_e4_8_t\*\)\(qv|\(\(float\*\)scales\)\[.*\] = sc\[0\]")
        assert len(writes) == 2 and all("(int64_t)0 <= slot" in c and limit in c for c in writes), writes
    else:
        # 16-byte reads of a page's rows, each behind the slot check; invalid ids give zeros and scale 0
        reads = enclosing_conditions(src, r"= \*\(fp8_e4_16_t\*\)\(\(\(fp8_e4_t\*\)scales\)|= \(\(float\*\)scales\)\[")
        assert len(reads) == 2 and all("(int64_t)0 <= slot" in c and limit in c for c in reads), reads


def test_index_logits_ws_kernel_structure():
    key = ix.index_logits_key(D, 64, "float8_e4m3fn", "cuda")
    src = body(lowered(key, "cuda"))
    # FP8 wgmma of a 64-row key block by a 128-row query block; keys and their scales arrive by TMA only, each key
    # block once into stages that both consumer warpgroups release (the second reads the second query block)
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128, 32" in src
    assert "CUtensorMap k_desc" in src and "CUtensorMap k_scale_desc" in src and src.count("tl::tma_load(") == 2
    assert "empty[0].init(256)" in src and src.count("q_s)[0])) + 16384))") == 1
    # three roles (two consumer warpgroups, the producer), each syncing through named barriers of its own only
    assert "__launch_bounds__(384, 1)" in src
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", src)[1:]
    assert len(roles) == 3 and all("__syncthreads" not in role for role in roles)
    ids = [set(re.findall(r"__sync_thread_partial\((\d+), \d+\)", role)) for role in roles]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2]), ids
    # the epilogue (the sum over heads, the stores): the prelude's reduce-scatter over the 4 lanes of a key row, no
    # shared-memory reduction; each warpgroup loads its weights once
    assert "AllReduce" not in src
    assert re.findall(r"dsa_index_block<(\d+)>\(acc[01], w[01], scale[01]\[0\], logits, n,", src) == ["64", "64"]
    assert re.findall(r"dsa_index_weights<(\d+)>\(weights, 64,", src) == ["64", "64"]
    # the ping-pong: each consumer warpgroup waits for its turn and passes it on after issuing its GEMM
    assert src.count("turn[0].wait(") == 1 and src.count("turn[1].wait(") == 1
    assert src.count("turn[0].arrive()") == 1 and src.count("turn[1].arrive()") == 1


@pytest.mark.parametrize(
    "key",
    [
        ix.index_logits_key(D, 64, "float8_e4m3fn", "hip"),
        pytest.param(ix.paged_logits_key(D, 64, 64, "float8_e4m3fn", "hip"), marks=pytest.mark.lowering),
    ],
    ids=str,
)
def test_portable_kernels_use_the_fp8_mfma_on_gfx950(key):
    assert not key.ws and "__builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8" in lowered(key, "hip")


def test_paged_ws_kernel_loads_only_valid_pages():
    key = ix.paged_logits_key(D, 64, 64, "float8_e4m3fn", "cuda")
    src = body(lowered(key, "cuda"))
    assert "wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 64, 32" in src
    # a page and its scales are loaded by TMA only where the entry is in [0, P) and the page holds a position
    # before the row's length (ok); the page table itself is read in bounds
    loads = enclosing_conditions(src, r"tl::tma_load\(")
    assert len(loads) == 2 and all(c.startswith("if (tl::tl_shuffle_elect<32>()) && if (ok) && ") for c in loads), loads
    # (the CTA's entries were read beforehand, -1 past max_pages, and the length is clamped to W)
    assert re.search(r"bool ok = \(\(\(pos < row\[1\]\) & \(0 <= ent\[0\]\)\) & \(ent\[0\] < p\)\)", src)


@pytest.mark.lowering
def test_paged_portable_kernel_reads_only_valid_rows():
    key = ix.paged_logits_key(D, 32, 16, "bfloat16", "cuda")
    src = body(lowered(key, "cuda"))
    reads = enclosing_conditions(src, r"= \*\(fp8_e4_\d+_t\*\)\(\(\(fp8_e4_t\*\)scales\)|= \(\(float\*\)scales\)\[")
    assert reads and all("(int64_t)0 <= ((int64_t*)slot_s)" in c for c in reads), reads


@needs_nvcc
def test_index_logits_ws_compiles_without_spills(tmp_path):
    log = compile_sm90a(lowered(ix.index_logits_key(D, 64, "float8_e4m3fn", "cuda"), "cuda"), tmp_path)
    assert_no_spills(log)
    assert_no_serialized_wgmma(log)


SWEEP_HEADS = [1, 2, 3, 5, 8, 16, 24, 32, 64, 100, 128]
PAGED_HEADS = [1, 5, 8, 32, 64, 128]
KPOOL_VARIANTS = [  # (gate, ape, round_scale, slot dtype) of the k-pool store's sweep keys
    ("bfloat16", "bfloat16", False, "int32"),
    ("float32", "float32", True, "int64"),
    ("float32", "bfloat16", True, "int32"),
]
KPOOL_EXPANSIONS = [  # (kpool, tail, page size, row_request) of the k-pool expansion's sweep keys
    (16, True, 0, False),
    (16, True, 64, False),
    (16, True, 64, True),
    (16, False, 24, False),
    (5, True, 24, True),
    (1, False, 0, False),
    (1, False, 16, True),
]
SWEEP_KEYS = (
    [
        ix.QuantIndexKey(d, p, rs, s)
        for d in (64, 128, 192, 256)
        for p in (0, 1, 2, 64)
        for rs in (False, True)
        for s in ix.SLOT_DTYPES
        if p or s == "int32"
    ]
    + [ix.GatherIndexKey(d, p, s) for d in (64, 128, 256) for p in (1, 2, 16, 64) for s in ix.SLOT_DTYPES]
    + [
        ix.IndexLogitsKey(d, h, q, ws)
        for d in (64, 128, 256)
        for h in SWEEP_HEADS
        for q, ws in (("float8_e4m3fn", True), ("float8_e4m3fn", False), ("bfloat16", False))
        if d == D or h in (8, 64)
    ]
    + [ix.IndexLogitsKey(D, h, "float8_e4m3fn", ws, fill_all=False) for h, ws in ((8, True), (64, False))]
    + [ix.IndexFilterKey(D, h) for h in (1, 8, 64, 128)]  # index_topk's filter
    + [
        ix.PagedLogitsKey(D, h, p, q, ws)
        for h in PAGED_HEADS
        for p in (1, 4, 16, 64, 128)
        for q, ws in (("float8_e4m3fn", True), ("float8_e4m3fn", False), ("bfloat16", False))
        if not ws or ix.paged_ws_supported(D, h, p, q)
    ]
    + [  # the k-pool store (csrc_tl/kpool.py) writes the same cache; keys whose pools stay in registers
        kp.KpoolStoreKey(pool, d, p, *variant)
        for pool, d, p in ((16, 128, 64), (16, 64, 16), (3, 192, 1), (1, 256, 2), (32, 128, 64))
        for variant in KPOOL_VARIANTS
    ]
    + [  # the k-pool expansion (csrc_tl/kpool.py): to positions, to slots, to slots of row requests
        kp.KpoolExpandKey(pool, tail, page, request) for pool, tail, page, request in KPOOL_EXPANSIONS
    ]
)


@pytest.mark.lowering
@pytest.mark.parametrize("target", ["cuda", "hip"])
@pytest.mark.parametrize("key", SWEEP_KEYS, ids=str)
def test_every_key_lowers(key, target):
    if getattr(key, "ws", False) and target == "hip":
        pytest.skip("the warp-specialized kernels are sm_90 only")
    src = body(lowered(key, target))
    assert "__global__" in src
    if isinstance(key, (ix.IndexLogitsKey, ix.PagedLogitsKey)) and target == "cuda":
        assert ("kFloat8_e4m3, tl::DataType::kFloat8_e4m3" in src) == (key.q_dtype == "float8_e4m3fn")


@pytest.mark.parametrize("heads, hp", [(8, 8), (64, 64)])
def test_filter_lists_instead_of_storing(heads, hp):
    # index_topk's filter: the logits kernel's CTA over every key (a grid of token blocks), its consumers' filter
    # epilogue behind their own named barriers (12, 13), no logits stored and no -inf filled
    src = body(lowered(ix.IndexFilterKey(D, heads), "cuda"))
    assert src.count(f"dsa_filter_block<{hp}>(") == 2 and src.count(f"dsa_filter_counts<{hp}>(") == 2
    assert ", 12);" in src and ", 13);" in src
    assert "dsa_index_block<" not in src and "CUDART_INF_F" not in src
    assert "blockIdx.y" not in src


@pytest.mark.lowering
@needs_nvcc
@pytest.mark.parametrize("key", [k for k in SWEEP_KEYS if getattr(k, "ws", False) and k.dim == D], ids=str)
def test_ws_kernels_compile_without_spills(key, tmp_path):
    log = compile_sm90a(lowered(key, "cuda"), tmp_path)
    assert_no_spills(log)
    assert_no_serialized_wgmma(log)


# ---------------------------------------------------------------------------------------------------------------
# GPU: each builder compiled directly, against pure Torch.


@functools.cache
def kernel(key):
    import tilelang

    return tilelang.compile(build(key), target="cuda", pass_configs=ix.pass_configs(key))


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_quant(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` bf16 -> FP8 values ``[N, D]`` and float32 scales ``[N]``, by the contract (float32 math)."""
    xf = x.float()  # [N, D]
    scale = xf.abs().amax(dim=-1).clamp(min=1e-4) / 448.0  # [N], the float32 division
    if round_scale:  # up to a power of two, exactly: scale = m * 2^e with m in [0.5, 1)
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    return (xf / scale[:, None]).clamp(-448.0, 448.0).to(FP8), scale  # round to nearest even


def index_rows(g, n: int) -> torch.Tensor:
    """bf16 rows over many binades: a zero row, a row below the 1e-4 floor, rows up to 2^20."""
    x = torch.randn(n, D, generator=g) * torch.exp2(torch.randint(-20, 21, (n, 1), generator=g).float())
    x[0] = 0
    x[1] = x[1].sign() * 1e-6
    return x.bfloat16()


def page_values(cache: torch.Tensor, page: int) -> torch.Tensor:
    """The FP8 bytes of a ``[P, page * (D + 4)]`` cache as ``[P, page, D]`` uint8 (a view)."""
    return cache[:, : page * D].view(cache.shape[0], page, D)


def page_scales(cache: torch.Tensor, page: int) -> torch.Tensor:
    """The scales of a cache as ``[P, page]`` float32 (a copy)."""
    return cache[:, page * D :].contiguous().view(torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("round_scale", [False, True], ids=["fp32-scale", "pow2-scale"])
def test_quant_index_bytes(round_scale):
    key = ix.QuantIndexKey(D, 0, round_scale)
    x = index_rows(rng(1), 301)
    values = torch.full((301, D), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)  # NaN before the call
    scale = torch.full((301,), float("nan"), device="cuda")
    kernel(key)(x.cuda(), values, scale)
    want_v, want_s = ref_quant(x, round_scale)
    assert torch.equal(values.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(scale.cpu().view(torch.int32), want_s.view(torch.int32))


def hostile_slots(g, n: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n]`` slot ids: distinct valid ones, with every 7th replaced by a sentinel (negative, past the end, the
    dtype's extremes)."""
    ids = torch.randperm(slots, generator=g)[:n].to(torch.int64)
    big_min, big_max = (INT64_MIN, INT64_MAX) if dtype == torch.int64 else (INT_MIN, INT_MAX)
    sentinels = torch.tensor([-1, slots, slots + 5, big_min, big_max, -slots])
    ids[::7] = sentinels[torch.arange(len(ids[::7])) % len(sentinels)]
    return ids.to(dtype)


@pytest.mark.cuda
def test_store_index_k_writes_exactly_the_valid_slots():
    page, pages = 64, 5
    key = ix.QuantIndexKey(D, page, True, "int64")
    g = rng(2)
    k = index_rows(g, 200)
    loc = hostile_slots(g, 200, pages * page, torch.int64)
    cache = torch.randint(0, 256, (pages, page * (D + 4)), generator=g, dtype=torch.uint8)  # NaN bytes included
    want = cache.clone()
    valid = (loc >= 0) & (loc < pages * page)
    values, scale = ref_quant(k[valid], True)
    slot = loc[valid]
    page_values(want, page)[slot // page, slot % page] = values.view(torch.uint8)
    scales = page_scales(want, page)
    scales[slot // page, slot % page] = scale
    want[:, page * D :] = scales.view(torch.uint8)
    got = cache.cuda()
    kernel(key)(k.cuda(), loc.cuda(), got)
    assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
def test_gather_index_k_bytes_and_invalid_ids():
    page, pages = 64, 5
    key = ix.GatherIndexKey(D, page, "int32")
    g = rng(3)
    cache = torch.randint(0, 256, (pages, page * (D + 4)), generator=g, dtype=torch.uint8)
    ids = hostile_slots(g, 150, pages * page, torch.int32)
    values = torch.full((150, D), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)
    scale = torch.full((150,), float("nan"), device="cuda")
    kernel(key)(cache.cuda(), ids.cuda(), values, scale)
    valid = (ids >= 0) & (ids < pages * page)
    slot = torch.where(valid, ids, 0).long()
    want_v = torch.where(valid[:, None], page_values(cache, page)[slot // page, slot % page], 0)
    want_s = torch.where(valid, page_scales(cache, page).view(torch.int32)[slot // page, slot % page], 0)
    assert torch.equal(values.cpu().view(torch.uint8), want_v)
    assert torch.equal(scale.cpu().view(torch.int32), want_s)


def exact_fp8(g, *shape) -> torch.Tensor:
    return EXACT_VALUES[torch.randint(len(EXACT_VALUES), shape, generator=g)].to(FP8)


def ref_logits(q, k, k_scale, weights, valid):
    """float64 ``[T, N]`` logits (-inf where not ``valid``) and the magnitudes the tolerances scale: ``(logits,
    k_scale * sum_h |w| relu(s), k_scale * sum_h |w| sum_d |q k|)``."""
    q64, k64 = q.double(), k.double()  # [T, Hi, D], [N, D]
    s = torch.einsum("thd,nd->thn", q64, k64)  # [T, Hi, N]
    w = weights.double()[:, :, None]  # [T, Hi, 1]
    sc = k_scale.double()[None, :]  # [1, N]
    logits = (s.relu() * w).sum(dim=1) * sc  # [T, N]
    mag = (s.relu() * w.abs()).sum(dim=1) * sc
    dot_mag = (torch.einsum("thd,nd->thn", q64.abs(), k64.abs()) * w.abs()).sum(dim=1) * sc
    return logits.masked_fill(~valid, float("-inf")), mag, dot_mag


def check_logits(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rel: float) -> None:
    got = got.cpu().double()
    assert not torch.isnan(got).any()
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and (got[inf] < 0).all()
    err = (got - want).abs()[~inf]
    bound = rel * mag[~inf] + 1e-30
    assert (err <= bound).all(), (err / bound).max()


def ragged_ranges(t_count: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ks, ke [T]`` int32 cycling through: all keys, causal (``[0, t + 1)``), a middle window, ranges past both
    ends, empty and reversed ranges, the int32 extremes, one column, the last column."""
    cases = [
        (0, n),
        (0, None),
        (n // 3, n // 3 + 1000),
        (-5, 40),
        (n - 10, n + 100),
        (7, 7),
        (50, 10),
        (INT_MIN, INT_MAX),
        (INT_MAX, INT_MIN),
        (n, n + 5),
        (9, 10),
        (n - 1, n),
    ]
    ks, ke = [], []
    for t in range(t_count):
        a, b = cases[t % len(cases)]
        ks.append(a)
        ke.append(t + 1 if b is None else b)
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


# (heads, T, N): token counts whose last CTA's second query block is partial (32 heads) or empty, key counts past
# one 16384-column chunk where the reference stays small; 3 and 5 heads are padded to the warp-specialized kernel's
# 8 (zero weights)
PREFILL_CASES = [
    (1, 300, 17084),
    (3, 40, 5000),
    (5, 40, 17084),
    (8, 40, 17084),
    (32, 13, 5000),
    (64, 9, 5000),
    (128, 5, 3001),
]


def prefill_inputs(heads, t_count, n, q_dtype, exact=True, seed=4):
    g = rng(seed)
    q = exact_fp8(g, t_count, heads, D) if exact else torch.randn(t_count, heads, D, generator=g).to(FP8)
    k = exact_fp8(g, n, D) if exact else (torch.randn(n, D, generator=g) * 4).to(FP8)
    k_scale = torch.rand(n, generator=g) * 1.5 + 0.5
    weights = torch.randn(t_count, heads, generator=g)
    ks, ke = ragged_ranges(t_count, n)
    return q.to(q_dtype), k, k_scale, weights, ks, ke


def run_prefill(key, q, k, k_scale, weights, ks, ke, cols=None):
    """The kernel's logits (poisoned with NaN before the call) and the mask of the in-range pairs; ``cols``: the key
    columns of a CTA, the plan's by default."""
    logits = torch.full((q.shape[0], k.shape[0]), float("nan"), device="cuda")
    cols = cols or ix.logits_cols(q.shape[0], q.shape[1], k.shape[0], 132, key.ws)
    kernel(key)(*(x.cuda() for x in (q, k, k_scale, weights, ks, ke)), logits, cols)
    col = torch.arange(k.shape[0])[None, :]
    valid = (col >= ks.long().clamp(min=0)[:, None]) & (col < ke.long().clamp(max=k.shape[0])[:, None])
    return logits, valid


@pytest.mark.cuda
@pytest.mark.parametrize("heads, t_count, n", PREFILL_CASES, ids=[f"h{c[0]}" for c in PREFILL_CASES])
@pytest.mark.parametrize("cols", [None, 576], ids=["planned-cols", "cols576"])
def test_index_logits_ws(heads, t_count, n, cols):
    # (576 columns a CTA: chunk edges that are no power of two, inside the tokens' ranges)
    key = ix.index_logits_key(D, heads, "float8_e4m3fn", "cuda")
    assert key.ws
    inputs = prefill_inputs(heads, t_count, n, FP8)
    got, valid = run_prefill(key, *inputs, cols=cols)
    want, mag, _ = ref_logits(inputs[0].float(), inputs[1].float(), *inputs[2:4], valid)
    check_logits(got, want, mag, EXACT_REL)


@pytest.mark.cuda
def test_index_logits_ws_arbitrary_fp8_values():
    key = ix.index_logits_key(D, 64, "float8_e4m3fn", "cuda")
    inputs = prefill_inputs(64, 9, 5000, FP8, exact=False, seed=5)
    got, valid = run_prefill(key, *inputs)
    want, _, dot_mag = ref_logits(inputs[0].float(), inputs[1].float(), *inputs[2:4], valid)
    check_logits(got, want, dot_mag, FP8_DOT_REL)


@pytest.mark.cuda
def test_index_logits_bf16_queries():
    key = ix.index_logits_key(D, 8, "bfloat16", "cuda")
    assert not key.ws
    inputs = prefill_inputs(8, 40, 17084, torch.bfloat16, seed=6)
    got, valid = run_prefill(key, *inputs, cols=1024)
    want, mag, _ = ref_logits(inputs[0].float(), inputs[1].float(), *inputs[2:4], valid)
    check_logits(got, want, mag, EXACT_REL)


def paged_inputs(heads, page, q_dtype, rows_per_request, lengths, max_pages, pages, seed):
    """Inputs of the decode kernel: a page table with sentinel entries, pages that any row reads filled with exact
    data and every other byte NaN (0xFF: an FP8 and a float32 NaN), rows past their length included."""
    g = rng(seed)
    b_count = len(lengths) // rows_per_request
    r_count = b_count * rows_per_request
    table = torch.randint(0, pages, (b_count, max_pages), generator=g, dtype=torch.int32)
    sentinels = torch.tensor([-1, pages, INT_MIN, INT_MAX, -7], dtype=torch.int32)
    hole = torch.rand(b_count, max_pages, generator=g) < 0.15
    table[hole] = sentinels[torch.randint(len(sentinels), (int(hole.sum()),), generator=g)]
    lens = torch.tensor(lengths, dtype=torch.int32)
    cache = torch.full((pages, page * (D + 4)), 0xFF, dtype=torch.uint8)
    w_len = max_pages * page
    for r in range(r_count):
        for p in range(min(max(int(lens[r]), 0), w_len)):
            e = int(table[r // rows_per_request, p // page])
            if 0 <= e < pages:
                page_values(cache, page)[e, p % page] = exact_fp8(g, D).view(torch.uint8)
                scale = torch.rand(1, generator=g) + 0.5
                cache[e, page * D + 4 * (p % page) : page * D + 4 * (p % page) + 4] = scale.view(torch.uint8)
    q = exact_fp8(g, r_count, heads, D).to(q_dtype)
    weights = torch.randn(r_count, heads, generator=g)
    return q, cache, weights, lens, table


def ref_paged(q, cache, weights, lens, table, page):
    """float64 logits ``[R, W]`` of the decode contract and their magnitudes (as :func:`ref_logits`)."""
    r_count, pages = q.shape[0], cache.shape[0]
    b_count, max_pages = table.shape
    w_len = max_pages * page
    pos = torch.arange(w_len)  # [W]
    req = torch.arange(r_count) // (r_count // b_count)  # [R]
    ent = table.long()[req][:, pos // page]  # [R, W]
    valid = (pos[None, :] < lens.long().clamp(0, w_len)[:, None]) & (ent >= 0) & (ent < pages)
    e = torch.where(valid, ent, 0)
    k = page_values(cache, page)[e, pos % page].view(FP8).double()  # [R, W, D]
    sc = page_scales(cache, page)[e, pos % page].double()  # [R, W]
    k = torch.where(valid[..., None], k, 0.0)  # (rows not read are NaN in the cache)
    s = torch.einsum("rhd,rwd->rhw", q.double(), k)  # [R, Hi, W]
    w = weights.double()[:, :, None]
    logits = (s.relu() * w).sum(dim=1) * sc
    mag = (s.relu() * w.abs()).sum(dim=1) * sc.abs()
    return logits.masked_fill(~valid, float("-inf")), torch.where(valid, mag, 0.0)


# (heads, page, q dtype, rows per request, lengths, max_pages, pages): lengths 0, 1, page, page + 1, W and past it,
# negative; two rows per request in the first case
PAGED_CASES = [
    (64, 64, FP8, 2, [0, 1, 64, 65, 2560, 3000, 1500, -3], 40, 30),
    (8, 16, FP8, 1, [16, 17, 0, 1, 1600, 777], 100, 50),
    (128, 128, FP8, 1, [128, 129, 1, 0, 4096], 32, 20),
    (32, 64, torch.bfloat16, 1, [64, 65, 1, 0, 1280], 20, 12),
]


@pytest.mark.cuda
@pytest.mark.parametrize(
    "heads, page, q_dtype, n, lengths, max_pages, pages",
    PAGED_CASES,
    ids=[f"h{c[0]}-p{c[1]}-{'fp8' if c[2] == FP8 else 'bf16'}" for c in PAGED_CASES],
)
def test_paged_index_logits(heads, page, q_dtype, n, lengths, max_pages, pages):
    key = ix.paged_logits_key(D, heads, page, "float8_e4m3fn" if q_dtype == FP8 else "bfloat16", "cuda")
    assert key.ws == (q_dtype == FP8 and page % 64 == 0)
    q, cache, weights, lens, table = paged_inputs(heads, page, q_dtype, n, lengths, max_pages, pages, seed=7)
    logits = torch.full((q.shape[0], max_pages * page), float("nan"), device="cuda")
    kernel(key)(*(x.cuda() for x in (q, cache, weights, lens, table)), logits)
    want, mag = ref_paged(q.float(), cache, weights, lens, table, page)
    check_logits(logits, want, mag, EXACT_REL)
