"""CPU tests of the plan records of sparse attention: the plan of the warp-specialized kernel
(csrc_tl.attention.plan: which producer and consumer scheme, block sizes, stages and persistence each geometry
gets, and the device helpers its prelude carries) and the launch plan of a call (csrc_tl.attention.launch: which
kernels run over which tokens, in how many splits). Nothing here lowers a kernel."""

import dataclasses
import itertools
import math
import subprocess
import sys
from typing import NamedTuple

import pytest

from csrc_tl.attention import (
    DEFAULT_TILES,
    TRANSPOSED_MAX_HEADS,
    TRANSPOSED_PLAN_HEADS,
    AttnGeometry,
    device,
    head_block,
    transposed_head_block,
    ws_plan,
    ws_supported,
)
from csrc_tl.attention.geometry import GROUP_HEADS
from csrc_tl.attention.keys import AttnKey, CombineKey
from csrc_tl.attention.launch import (
    GROUP_MAX_UNION,
    GROUP_MIN_TOKENS,
    TAIL_MIN_BLOCKS,
    TAIL_MIN_SPLITS,
    TAIL_SPLIT_BLOCKS,
    TOPK_BLOCK,
    WIDEN_BYTES,
    WIDEN_COUNT_TOKENS,
    WIDEN_MIN_TOKENS,
    WIDEN_REUSE,
    AttnKernels,
    AttnLaunch,
    attn_kernels,
    grouped_geometry,
    plan_group,
    plan_launch,
    plan_widen_pool,
    union_share,
    widened_geometry,
)
from csrc_tl.attention.plan import CONSUMER_SCHEMES, DEFAULT_CTAS, ROW_SCHEMES, WS_NREG, WS_NREG_DIRECT
from csrc_tl.attention.union import UNION_TABLES, UnionKey


def geometry(
    kind: str, d_v: int, d_rope: int, heads: int = 64, q_fp8: bool = False, has_len: bool = False
) -> AttnGeometry:
    return AttnGeometry(d_v, d_rope, heads, kind, has_len, (d_v + d_rope) ** -0.5, q_fp8)


class Case(NamedTuple):
    geo: AttnGeometry
    split: bool
    scheme: tuple[str, int]  # (consumer / producer scheme, producer warpgroups): the key of WS_NREG
    block_i: int
    flags: frozenset  # the plan's flags that are true, among FLAGS

    def __str__(self) -> str:
        return f"{'decode' if self.split else 'prefill'}-{self.geo}"


FLAGS = (
    "copies_async",
    "staged",
    "inplace",
    "paired",
    "p0_in_tail",
    "halves",
    "wg1_widens",
    "persist",
    "quarters",
    "bulk",
    "calls_widen",
)


def case(geo, split, scheme, block_i, *flags):
    assert set(flags) <= set(FLAGS), flags
    return Case(geo, split, scheme, block_i, frozenset(flags))


CASES = [
    # DeepSeek bf16 rows (576 wide): paired consumers over stage halves, 64-row blocks (FlashMLA's pipeline)
    case(geometry("bf16", 512, 64), False, ("paired", 1), 64, "copies_async", "paired", "p0_in_tail", "halves"),
    case(
        geometry("bf16", 512, 64, heads=1), False, ("paired", 1), 64, "copies_async", "paired", "p0_in_tail", "halves"
    ),
    # its decode: one consumer scores every block
    case(geometry("bf16", 512, 64), True, ("single", 1), 64, "copies_async"),
    # GLM bf16 rows: paired over whole 128-row stages
    case(geometry("bf16", 256, 0), False, ("paired", 1), 128, "copies_async", "paired"),
    # GLM packed rows: staged, bulk-copied by the TMA unit, persistent, two producers
    case(geometry("packed", 256, 0), False, ("single", 2), 128, "staged", "persist", "quarters", "bulk"),
    case(
        geometry("packed", 256, 0, heads=8, has_len=True),
        False,
        ("single", 2),
        128,
        "staged",
        "persist",
        "quarters",
        "bulk",
    ),
    # ... whose decode keeps cp.async copies and one CTA per item
    case(geometry("packed", 256, 0, heads=8), True, ("single", 2), 64, "staged", "quarters"),
    # GLM native FP8 rows: staged and widened through dsa_widen
    case(geometry("fp8", 256, 0, q_fp8=True), False, ("single", 2), 128, "staged", "quarters", "calls_widen"),
    # DeepSeek packed rows: in place, consumer warpgroup 1 widens the last pass of each block
    case(
        geometry("packed", 512, 64), False, ("inplace_wg1", 1), 64, "inplace", "wg1_widens", "quarters", "calls_widen"
    ),
    case(
        geometry("packed", 512, 64, heads=128),
        True,
        ("inplace_wg1", 1),
        64,
        "inplace",
        "wg1_widens",
        "quarters",
        "calls_widen",
    ),
    # packed 512+0 decode: in place without warpgroup 1's pass
    case(geometry("packed", 512, 0), True, ("inplace", 1), 64, "inplace", "quarters", "calls_widen"),
    # DeepSeek native FP8 rows: in place (unpacked rows: no wg1 pass)
    case(geometry("fp8", 512, 64, q_fp8=True), False, ("inplace", 1), 64, "inplace", "quarters", "calls_widen"),
]


@pytest.mark.parametrize("c", CASES, ids=str)
def test_plan_schemes(c: Case):
    plan = ws_plan(c.geo, split=c.split)
    assert plan.scheme == c.scheme
    assert plan.nreg == WS_NREG[c.scheme]
    assert plan.n_prod == c.scheme[1]
    assert plan.block_i == c.block_i
    assert {f for f in FLAGS if getattr(plan, f)} == c.flags


@pytest.mark.parametrize("c", CASES, ids=str)
def test_plan_sizes(c: Case):
    """The derived sizes fit together: producer passes fill a producer block, producer blocks a stage, and the
    ready barriers count every arrival."""
    plan = ws_plan(c.geo, split=c.split)
    assert plan.half * 2 == c.geo.d_v
    assert plan.hb == 64 and plan.groups == -(-c.geo.heads // 64)
    assert plan.passes * plan.rows_per_pass == plan.block_p
    assert plan.subs * plan.block_p == plan.block_i
    assert plan.rows_per_pass == 16 * plan.n_prod
    assert plan.ready_count == 128 * plan.n_prod * (2 if plan.copies_async else 1) + 128 * plan.wg1_widens
    if plan.wg1_widens:
        assert plan.prod_passes + plan.wg1_passes == tuple(range(plan.passes))
    else:
        assert plan.prod_passes is None and plan.wg1_passes is None
    assert (plan.scale_word is None) == (c.geo.kv_kind != "packed")
    if c.split:
        assert plan.block_i == 64, "a split kernel's splits are whole 64-row blocks"
    assert plan.ctas == DEFAULT_CTAS


def test_plan_is_frozen_and_pure():
    geo = geometry("packed", 256, 0)
    plan = ws_plan(geo)
    assert plan == ws_plan(geo) and hash(plan) == hash(ws_plan(geo))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.persist = False
    # the CTA count of a persistent kernel is recorded, and changes no other choice
    other = ws_plan(geo, ctas=78)
    assert other.ctas == 78 and dataclasses.replace(other, ctas=plan.ctas) == plan


def test_plan_overrides():
    geo = geometry("fp8", 256, 0, q_fp8=True)
    one = ws_plan(geo, producers=1, nreg=WS_NREG[("single", 1)])
    assert one.n_prod == 1 and one.rows_per_pass == 16 and one.passes == 4
    assert ws_plan(geo, block_i=64).block_i == 64
    with pytest.raises(AssertionError, match="register budgets"):
        ws_plan(geometry("bf16", 256, 0), producers=2)  # no default budgets for paired consumers and two producers
    with pytest.raises(AssertionError, match="64-row blocks"):
        ws_plan(geometry("bf16", 256, 0), split=True, block_i=128)


@pytest.mark.parametrize(
    "geo, ok",
    [
        (geometry("bf16", 384, 0), True),
        (geometry("fp8", 384, 0), False),
        (geometry("bf16", 192, 64), False),
        (geometry("packed", 512, 32), False),
        (geometry("fp8", 512, 0), True),
    ],
    ids=lambda v: str(v),
)
def test_ws_supported(geo, ok):
    assert ws_supported(geo) is ok
    if not ok:
        with pytest.raises(AssertionError, match="needs d_v"):
            ws_plan(geo)


def test_device_helper_sections():
    names = (
        "row_sums",
        "convert",
        "widen",
        "copy",
        "bulk",
        "put_bf16",
        "bar_sync",
        "copy16",
        "ld_index",
        "col_stats",
        "direct",
    )
    sections = device.sections()
    assert tuple(sections) == names
    assert all(text.endswith("\n") and "// section:" not in text for text in sections.values())
    assert device.WS_STORE.count("dsa_bar_sync(int id") == 1 and device.WS_PERSIST.count("dsa_bar_sync(int id") == 1
    # the transposed consumers' column statistics call the named barrier: exactly one definition in every prelude
    for split in (False, True):
        plan = ws_plan(AttnGeometry(512, 64, 16, "packed", False, 0.1), split=split, transposed=True)
        assert plan.prelude.count("dsa_bar_sync(int id") == 1 and "dsa_col_max_update" in plan.prelude


@pytest.mark.parametrize("c", CASES, ids=str)
def test_prelude(c: Case):
    """The prelude carries the helpers the plan's producer and consumers call, and only those."""
    plan = ws_plan(c.geo, split=c.split)
    text = plan.prelude or ""
    assert ("dsa_row_sum(" in text) == plan.paired
    assert ("dsa_bulk_row" in text) == plan.bulk
    assert ("dsa_widen<" in text or "void dsa_widen(" in text) == plan.calls_widen
    assert ("dsa_copy16" in text) == plan.split
    assert ("dsa_ld_index" in text) == plan.persist
    assert ("dsa_cp_async(" in text) == (plan.inplace or plan.halves or plan.bulk)
    assert "dsa_ld_row" not in text and not plan.direct  # (the plain consumers keep the in-place copies)


@pytest.mark.parametrize("heads", [1, 5, 8])
def test_few_heads_of_tailless_packed_rows_go_through_registers(heads):
    """The transposed prefill over GLM-5.3-Flash's 528-byte rows at 8 heads or fewer gathers them through registers:
    loaded by ``dsa_ld_row``, never copied raw into the stage nor widened there (the one case where that measured
    faster: see ws_direct)."""
    plan = ws_plan(AttnGeometry(512, 0, heads, "packed", True, 0.1), transposed=True)
    assert plan.inplace and plan.direct and plan.wg1_widens and not plan.calls_widen
    assert plan.row_words == 4 * (4 + 1) + 1  # four value chunks, the scales, the flag
    assert plan.nreg == WS_NREG_DIRECT[plan.scheme]
    text = plan.prelude
    assert "dsa_ld_row" in text and "dsa_widen8" in text and "dsa_widen<" not in text


@pytest.mark.parametrize(
    "geo, split, transposed",
    [
        (AttnGeometry(512, 0, 16, "packed", False, 0.1), False, True),  # 16 heads: slower so
        (AttnGeometry(512, 0, 8, "packed", False, 0.1), True, True),  # the split kernel: not measured so
        (AttnGeometry(512, 0, 8, "packed", False, 0.1), False, False),  # the plain consumers
        (AttnGeometry(512, 64, 8, "packed", False, 0.1), False, True),  # DeepSeek's rows: slower so
        (AttnGeometry(256, 0, 8, "packed", False, 0.1), True, True),  # staged: widened shared-to-shared
        (AttnGeometry(512, 64, 8, "fp8", False, 0.1), False, True),  # no scales: the in-place widening
        (AttnGeometry(512, 64, 8, "bf16", False, 0.1), False, True),
    ],
    ids=lambda v: str(v),
)
def test_direct_only_where_it_is_faster(geo, split, transposed):
    assert not ws_plan(geo, split=split, transposed=transposed).direct


# ----------------------------------------------------------------------------------------------
# The launch plan of a call.


def launch_id(v) -> str:
    if isinstance(v, bool):
        return "sm90" if v else "other"
    if isinstance(v, AttnLaunch):
        return f"prefill{v.prefill_tokens}-split{v.split_tokens}x{v.splits}"
    return str(v)


GLM_PACKED = geometry("packed", 256, 0)
GLM_BF16 = geometry("bf16", 256, 0)
SHARD_16 = geometry("packed", 512, 0, heads=16)
DS_PACKED_128 = geometry("packed", 512, 64, heads=128)
DS_BF16_128 = geometry("bf16", 512, 64, heads=128)


def kernels(geo, ws=True, ctas=0, partial_heads=64, transposed=False) -> AttnKernels:
    """The kernel keys of ``geo``: warp-specialized (``ctas``: a persistent prefill's grid) or portable."""
    return AttnKernels(
        AttnKey("prefill_ws" if ws else "prefill", geo, ctas, transposed=transposed),
        AttnKey("decode_ws" if ws else "decode", geo, transposed=transposed),
        CombineKey(geo.d_v, geo.heads, partial_heads, ws),
    )


@pytest.mark.parametrize(
    "geo, tokens, topk, sm_count, sm90, want",
    [
        # the persistent GLM packed prefill: 31 whole rounds of 132 items, the last 4 tokens in 16 splits of 2 blocks
        (GLM_PACKED, 4096, 2048, 132, True, AttnLaunch(kernels(GLM_PACKED, ctas=132), 4096, 4092, 16)),
        # ... its whole rounds alone, and items too short to split off
        (GLM_PACKED, 4092, 2048, 132, True, AttnLaunch(kernels(GLM_PACKED, ctas=132), 4092, 4092)),
        (GLM_PACKED, 4096, 512, 132, True, AttnLaunch(kernels(GLM_PACKED, ctas=132), 4096, 4096)),
        # on 78 SMs the persistent grid is 78 CTAs: 52 rounds take 4056 tokens, and the last 40 fill over half the SMs,
        # so the split path would not split them: the prefill takes them all
        (GLM_PACKED, 4096, 2048, 78, True, AttnLaunch(kernels(GLM_PACKED, ctas=78), 4096, 4096)),
        # decode T 1: every split kernel takes one block a split
        (GLM_BF16, 1, 2048, 132, True, AttnLaunch(kernels(GLM_BF16), 1, 0, 32)),
        (GLM_BF16, 1, 2048, 132, False, AttnLaunch(kernels(GLM_BF16, ws=False), 1, 0, 32)),
        # a 16-head shard: the warp-specialized kernels run the transposed consumers; their partials still have a
        # whole 64-head block, the portable one's 16
        (
            SHARD_16,
            1,
            2048,
            132,
            True,
            AttnLaunch(kernels(SHARD_16, transposed=True), 1, 0, 32),
        ),
        (
            SHARD_16,
            1,
            2048,
            132,
            False,
            AttnLaunch(kernels(SHARD_16, ws=False, partial_heads=16), 1, 0, 32),
        ),
        # DeepSeek: T 17 at 128 heads is 34 items (3 splits), T 256 fills the GPU; one CTA per item, no tail
        (
            DS_PACKED_128,
            17,
            2048,
            132,
            True,
            AttnLaunch(kernels(DS_PACKED_128, partial_heads=128), 17, 0, 3),
        ),
        (
            DS_PACKED_128,
            256,
            2048,
            132,
            True,
            AttnLaunch(kernels(DS_PACKED_128, partial_heads=128), 256, 256),
        ),
        (
            DS_BF16_128,
            4100,
            2048,
            132,
            True,
            AttnLaunch(kernels(DS_BF16_128, partial_heads=128), 4100, 4100),
        ),
    ],
    ids=lambda v: launch_id(v),
)
def test_launch_plan(geo, tokens, topk, sm_count, sm90, want):
    assert plan_launch(geo, tokens, topk, sm_count, sm90) == want


GRID = list(
    itertools.product(
        [("bf16", False), ("fp8", True), ("packed", False)],
        [(512, 64), (512, 0), (256, 0), (384, 0)],
        [1, 8, 16, 64, 128],
        [1, 2, 17, 64, 256, 4092, 4096, 4100, 8192],
        [512, 2048, 2112],
        [132, 78],
    )
)


@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "other"])
def test_launch_plan_invariants(sm90):
    """Over a grid of calls: the split path keeps one wave of whole top-k blocks, the prefill of a persistent kernel
    whole rounds of its CTAs; off sm_90 CUDA nothing is warp-specialized."""
    for (kind, q_fp8), (d_v, d_rope), heads, tokens, topk, sm_count in GRID:
        geo = geometry(kind, d_v, d_rope, heads, q_fp8)
        launch = plan_launch(geo, tokens, topk, sm_count, sm90)
        k = launch.kernels
        assert k == attn_kernels(geo, sm90, sm_count)
        ws = sm90 and ws_supported(geo)
        assert k.split.warp_specialized == ws and k.prefill.warp_specialized == ws and k.combine.pdl == ws
        block = 64 if ws else head_block(heads)  # heads of a split kernel's block
        assert k.partial_heads == -(-heads // block) * block
        assert launch.prefill_tokens + launch.split_tokens == tokens
        items = math.ceil(heads / head_block(heads))  # (token, head block) items of one token
        if launch.split_tokens:
            assert launch.split_tokens * items * launch.splits <= sm_count, "one wave of splits"
            # one top-k block a split or more, a persistent prefill's tail TAIL_SPLIT_BLOCKS or more
            least = TAIL_SPLIT_BLOCKS if launch.prefill_tokens else 1
            assert topk // TOPK_BLOCK // launch.splits >= least
        if launch.prefill_tokens and launch.split_tokens:  # a persistent prefill's last round split off
            assert k.ctas and launch.prefill_tokens * items % k.ctas == 0
            assert launch.splits >= TAIL_MIN_SPLITS and topk // TOPK_BLOCK >= TAIL_MIN_BLOCKS


def test_launch_plan_persistent_ctas():
    # the persistent prefill's grid: one CTA per SM of the GPU the plan is for, an H200's where none is given
    assert attn_kernels(GLM_PACKED, True).ctas == DEFAULT_CTAS
    assert attn_kernels(GLM_PACKED, True, 78) == kernels(GLM_PACKED, ctas=78)
    assert attn_kernels(GLM_PACKED, False, 78) == kernels(GLM_PACKED, ws=False)
    # no other prefill is persistent (DeepSeek packed rows, native FP8 rows, bf16 rows)
    for geo in (geometry("packed", 512, 64), geometry("fp8", 256, 0, q_fp8=True), geometry("bf16", 256, 0)):
        assert attn_kernels(geo, True, 78).prefill == AttnKey("prefill_ws", geo)


def test_launch_plan_is_frozen_and_checked():
    launch = plan_launch(GLM_PACKED, 4096, 2048, 132, True)
    assert launch == plan_launch(GLM_PACKED, 4096, 2048, 132, True) and launch.split_tokens == 4
    assert hash(launch) == hash(plan_launch(GLM_PACKED, 4096, 2048, 132, True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.splits = 1
    with pytest.raises(AssertionError, match="split path runs"):
        AttnLaunch(launch.kernels, 4096, 4096, 16)
    with pytest.raises(AssertionError, match="a prefill kernel and a split kernel"):
        AttnKernels(launch.kernels.split, launch.kernels.prefill, launch.kernels.combine)
    with pytest.raises(AssertionError, match="no tokens"):
        plan_launch(GLM_PACKED, 0, 2048, 132, True)


def test_widen_pool_plan():
    # a prefill that gathers each FP8 pool row many times widens the pool once and runs the bf16 rows' kernels
    ds8 = geometry("packed", 512, 64, 8)
    launch = plan_launch(ds8, 4096, 2048, 132, True, slots=8192, group=False)
    assert launch.widen_pool and launch.kernels == attn_kernels(widened_geometry(ds8), True, 132)
    assert launch.kernels.prefill.geo == geometry("bf16", 512, 64, 8) and launch.kernels.prefill.transposed
    assert str(launch) == "pool to bf16 + attn_prefill_ws"
    # native FP8 rows and a float8 q: the bf16 kernels take q widened, where its bf16 copy fits beside the pool's
    fp8 = plan_launch(geometry("fp8", 512, 64, 8, q_fp8=True), 4096, 2048, 132, True, slots=8192, group=False)
    assert fp8.widen_pool and fp8.kernels.prefill.geo == geometry("bf16", 512, 64, 8)
    assert not plan_launch(geometry("fp8", 512, 64, 128, q_fp8=True), 4096, 2048, 132, True, slots=8192).widen_pool
    assert plan_launch(geometry("fp8", 512, 64, 128), 4096, 2048, 132, True, slots=8192).widen_pool  # a bf16 q
    # GLM's persistent packed prefill over its pool widened: the bf16 prefill, no tail split off
    assert plan_launch(GLM_PACKED, 4096, 2048, 132, True, slots=8192) == dataclasses.replace(
        plan_launch(widened_geometry(GLM_PACKED), 4096, 2048, 132, True), widen_pool=True
    )
    # the pool not widened: no pool size given, fewer tokens than WIDEN_MIN_TOKENS, a pool gathered fewer than
    # WIDEN_REUSE times per row (T 1024 over 65536 slots is 32 times: widened), a bf16 pool past WIDEN_BYTES, bf16
    # rows, off sm_90
    assert not plan_launch(ds8, 4096, 2048, 132, True).widen_pool
    assert not plan_launch(ds8, WIDEN_MIN_TOKENS - 1, 2048, 132, True, slots=64).widen_pool
    assert not plan_launch(ds8, 1024, 2048, 132, True, slots=1024 * 2048 // WIDEN_REUSE + 1).widen_pool
    assert plan_launch(ds8, 1024, 2048, 132, True, slots=65536).widen_pool
    largest = WIDEN_BYTES // (2 * 576)
    assert plan_widen_pool(ds8, 1 << 20, 2048, largest, True) and not plan_widen_pool(
        ds8, 1 << 20, 2048, largest + 1, True
    )
    assert not plan_launch(geometry("bf16", 512, 64, 8), 4096, 2048, 132, True, slots=8192).widen_pool
    assert not plan_launch(ds8, 4096, 2048, 132, False, slots=8192).widen_pool
    # a pool too large to widen whole counts the rows the call selects (eagerly), to widen those alone
    serving = plan_launch(ds8, 4096, 2048, 132, True, slots=1 << 20)
    assert serving.count_rows and not serving.widen_pool and serving.kernels == attn_kernels(ds8, True, 132)
    assert not plan_launch(ds8, 4096, 2048, 132, True, slots=8192).count_rows  # (the whole pool is widened)
    assert not plan_launch(ds8, WIDEN_COUNT_TOKENS - 1, 2048, 132, True, slots=1 << 20).count_rows
    assert not plan_launch(ds8, 4096, 2048, 132, False, slots=1 << 20).count_rows
    assert not plan_launch(geometry("bf16", 512, 64, 8), 4096, 2048, 132, True, slots=1 << 20).count_rows
    assert not plan_launch(ds8, 4096, 2048, 132, True, slots=1 << 20, widen_pool=False).count_rows
    # forced either way (the bench's and the tests' comparisons)
    assert not plan_launch(ds8, 4096, 2048, 132, True, slots=8192, widen_pool=False).widen_pool
    assert plan_launch(ds8, 256, 2048, 132, True, widen_pool=True).widen_pool
    with pytest.raises(AssertionError, match="widening the pool takes FP8 rows"):
        plan_launch(geometry("bf16", 512, 64, 8), 4096, 2048, 132, True, widen_pool=True)


def test_widen_pool_keys_cover_the_plan(monkeypatch):
    # warmup compiles what a call over its pool widened launches: the widening of a packed pool, the bf16 rows' kernels
    from sparse_dsa_ops import _cuda
    from sparse_dsa_ops._cuda import k_cache

    monkeypatch.setattr(_cuda.attention, "is_hopper", lambda: True)  # warmup's keys are this machine's: an H200

    for kind, q_fp8 in (("packed", False), ("fp8", True)):
        for heads in (8, 64) if kind == "packed" else (8, 16):  # (a float8 q's bf16 copy fits at 16 heads)
            scale = 576**-0.5
            plan = _cuda.plan_attn(
                kind, 512, 64, heads, scale, True, q_fp8, 4100, 2048, DEFAULT_CTAS, "cuda", slots=8192
            )
            keys = _cuda.widen_pool_keys(kind, 512, 64, heads, scale, True, target="cuda", sm_count=DEFAULT_CTAS)
            keys += _cuda.group_keys(kind, 512, 64, heads, scale, True, target="cuda", sm_count=DEFAULT_CTAS)
            assert plan.widen_pool and set(plan.keys) <= set(keys)
            widen = k_cache.cache_keys("dequant_k_cache", geometry("packed", 512, 64).layout)
            assert (set(widen) <= set(keys)) == (kind == "packed")
            assert set(keys) <= set(_cuda.attention.warmup_keys(heads, 512, 64, scale, (kind,), (q_fp8,)))
    assert _cuda.widen_pool_keys("bf16", 512, 64, 8, 576**-0.5, False, target="cuda") == []
    assert _cuda.widen_pool_keys("packed", 512, 64, 8, 576**-0.5, False, target="hip") == []


def test_group_plan():
    # at 8-16 heads a prefill over a small pool of bf16 rows (or its pool widened) runs head blocks of 64 / H tokens
    # over the union of their selections; the last tokens, fewer than a group, take the per-token plan
    bf8 = geometry("bf16", 512, 64, 8)
    launch = plan_launch(bf8, 4096, 2048, 132, True, slots=8192)
    assert launch.group == 8 and launch.prefill_tokens == 4096 and launch.rest is None and not launch.split
    assert launch.union == UnionKey(8, UNION_TABLES[0], False)
    assert (
        launch.prefill.geo
        == grouped_geometry(bf8)
        == dataclasses.replace(geometry("bf16", 512, 64, 64, has_len=True), group=8)
    )
    assert not launch.prefill.transposed and launch.keys == (launch.union, launch.prefill)
    assert str(launch) == "union of 8 tokens + attn_prefill_ws (grouped)"
    assert plan_launch(geometry("bf16", 512, 0, 16), 4096, 2048, 132, True, slots=8192).group == 4
    packed = plan_launch(geometry("packed", 512, 64, 8), 4096, 2048, 132, True, slots=8192)
    assert packed.widen_pool and packed.group == 8 and packed.prefill.geo.kv_kind == "bf16"
    # a rest of 5 tokens: the per-token kernels (here the split path: 5 tokens do not fill the GPU)
    rest = plan_launch(bf8, 4093, 2048, 132, True, slots=8192)
    assert rest.prefill_tokens == 4088 and rest.rest == plan_launch(bf8, 5, 2048, 132, True, group=False)
    assert rest.keys == (rest.union, rest.prefill) + rest.rest.keys and rest.rest.split
    assert "(last 5 tokens)" in str(rest)
    # the expected union of distinct uniform selections decides, against a bound a head count: 45% of the selections
    # at 8 tokens over 8192 rows, 68% at 4, 88% at 2 (32 heads); 66% at 8 tokens over 16384 rows (grouped: the
    # bench's crossover), 71% over 20480 rows, 90% over 65536 (not grouped)
    assert math.isclose(union_share(8, 2048, 8192), 8192 * (1 - 0.75**8) / (8 * 2048))
    assert tuple(GROUP_MAX_UNION) == GROUP_HEADS
    for heads in GROUP_HEADS:
        assert union_share(64 // heads, 2048, 8192) <= GROUP_MAX_UNION[heads] < union_share(64 // heads, 2048, 65536)
    assert plan_launch(geometry("bf16", 512, 64, 32), 4096, 2048, 132, True, slots=8192).group == 2
    assert plan_launch(bf8, 4096, 2048, 132, True, slots=16384).group == 8
    assert plan_launch(bf8, 4096, 2048, 132, True, slots=20480).group == 1
    assert plan_launch(bf8, 4096, 2048, 132, True, slots=65536).group == 1
    # never: under GROUP_MIN_TOKENS, 64 heads or more, off sm_90, no pool size, a pool past the largest table, the
    # consumers forced
    assert plan_launch(bf8, GROUP_MIN_TOKENS - 1, 2048, 132, True, slots=1024).group == 1
    assert plan_group(geometry("bf16", 512, 64, 64), 4096, 2048, 8192, True) == 1
    assert plan_launch(bf8, 4096, 2048, 132, False, slots=8192).group == 1
    assert plan_launch(bf8, 4096, 2048, 132, True).group == 1
    assert plan_launch(bf8, 4096, 2048, 132, True, slots=UNION_TABLES[-1] + 1, group=True).group == 1
    assert plan_launch(bf8, 4096, 2048, 132, True, slots=8192, transposed=True).group == 1
    assert plan_group(bf8, 4096, 2048, 8192, True) == 8


def test_group_keys_cover_the_plan(monkeypatch):
    # warmup compiles what a grouped call launches: the union kernels and the grouped prefill kernel
    from sparse_dsa_ops import _cuda

    monkeypatch.setattr(_cuda.attention, "is_hopper", lambda: True)
    for kind, heads, with_len, sink in (
        ("bf16", 8, False, False),
        ("packed", 16, True, True),
        ("bf16", 16, True, False),
    ):
        scale = 576**-0.5
        plan = _cuda.plan_attn(
            kind, 512, 64, heads, scale, with_len, False, 4096, 2048, DEFAULT_CTAS, "cuda", sink=sink, slots=8192
        )
        assert plan.union is not None
        keys = _cuda.group_keys(kind, 512, 64, heads, scale, with_len, target="cuda", sink=sink)
        assert set(plan.keys) <= set(keys)
        assert set(keys) <= set(_cuda.attention.warmup_keys(heads, 512, 64, scale, (kind,), attn_sink=(sink,)))
    assert _cuda.group_keys("bf16", 512, 64, 64, 576**-0.5, False, target="cuda") == []
    assert _cuda.group_keys("bf16", 512, 64, 8, 576**-0.5, False, target="hip") == []


def test_topk_block_is_the_split_kernels_block():
    # a split is whole blocks of both split kernels, and the top-k width sparse_attn takes is whole blocks
    from sparse_dsa_ops.ops import TOPK_MULTIPLE

    assert TOPK_BLOCK == DEFAULT_TILES["decode"]["block_i"] == TOPK_MULTIPLE
    assert all(ws_plan(geometry(kind, 512, 64), split=True).block_i == TOPK_BLOCK for kind in ("bf16", "packed"))


def test_backend_plan_is_the_launch_plan():
    """The GPU backend's plan of a call is the launch plan itself: its kernel keys, nothing translated or decided
    again."""
    from sparse_dsa_ops import _cuda

    for tokens, topk, target in ((4096, 2048, "cuda"), (1, 2048, "cuda"), (4096, 2048, "hip"), (17, 2112, "hip")):
        launch = plan_launch(GLM_PACKED, tokens, topk, 132, target == "cuda")
        plan = _cuda.plan_attn("packed", 256, 0, 64, GLM_PACKED.sm_scale, False, False, tokens, topk, 132, target)
        assert plan == launch
        assert plan.keys == ((plan.kernels.prefill,) if launch.prefill_tokens else ()) + (
            (plan.kernels.split, plan.kernels.combine) if launch.split_tokens else ()
        )


def test_a_sink_or_max_logits_changes_the_prefill_kernel_and_a_sink_the_combine():
    """With an attention sink (or a call that wants the row maxima) the prefill kernel is its sink_max variant; with a
    sink the split path's combine folds it in; the split kernel and the split count stay those of the plain call."""
    from dataclasses import replace

    from sparse_dsa_ops import _cuda

    for tokens in (1, 17, 4096):
        args = ("packed", 256, 0, 64, GLM_PACKED.sm_scale, False, False, tokens, 2048, 132, "cuda")
        plain = _cuda.plan_attn(*args)
        for sink, max_logits in ((True, False), (False, True), (True, True)):
            plan = _cuda.plan_attn(*args, sink=sink, max_logits=max_logits)
            assert plan.splits == plain.splits and plan.prefill_tokens == plain.prefill_tokens
            if plain.prefill:
                assert plan.prefill == replace(plain.prefill, sink_max=True)
                assert plan.prefill.name == plain.prefill.name + "_sinkmax"
            if plain.split:
                assert plan.split == (plain.split[0], replace(plain.split[1], sink=sink))
                assert plan.split[1].name == plain.split[1].name + ("_sink" if sink else "")


IMPORTS = (
    "import sys, csrc_tl.attention.launch; print(' '.join(sorted(m for m in ('torch', 'sparse_dsa_ops', "
    "'tilelang') if m in sys.modules)))"
)


def test_launch_plan_imports_no_backend():
    loaded = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout.split()
    assert "sparse_dsa_ops" not in loaded


def test_launch_plan_imports_no_torch():
    loaded = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


@pytest.mark.parametrize("heads", [1, 3, 8, 13, 16, 24, 31, 32, 33, 64, 128])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "packed"])
@pytest.mark.parametrize("d_v, d_rope", [(512, 64), (512, 0), (256, 0)])
def test_transposed_consumers_at_tensor_parallel_shards(heads, kind, d_v, d_rope):
    # the warp-specialized kernels of 64-row blocks run the transposed consumers (heads as the GEMMs' N, rounded up
    # to a multiple of 8) up to 32 heads, where the bench measured them faster than the plain ones; the prefills of
    # 256-wide rows (128-row blocks) keep the plain ones, and so do the portable kernels and a call that asks for
    # the plain consumers
    geo = geometry(kind, d_v, d_rope, heads=heads)
    kernels = attn_kernels(geo, True, 132)
    assert TRANSPOSED_PLAN_HEADS == (TRANSPOSED_MAX_HEADS, TRANSPOSED_MAX_HEADS) == (32, 32)
    assert kernels.split.transposed == (heads <= 32)
    assert kernels.prefill.transposed == (heads <= 32 and d_v == 512)
    if heads <= TRANSPOSED_MAX_HEADS:
        plan = ws_plan(geo, split=True, transposed=True)
        assert plan.hb == transposed_head_block(heads) == -(-heads // 8) * 8 and not plan.paired
    assert not attn_kernels(geo, False, 132).split.transposed
    plain = attn_kernels(geo, True, 132, transposed=False)
    assert not plain.prefill.transposed and not plain.split.transposed


@pytest.mark.parametrize("heads", [1, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_decode_splits_by_consumers(heads, tokens):
    """A decode of a 2048-wide top-k: every split kernel, transposed (up to 32 heads) or plain (64-head blocks), takes
    one top-k block a split, as many splits as one wave of 132 SMs holds (the bench's crossover: BENCHMARKS.md)."""
    geo = geometry("packed", 512, 64, heads=heads)
    launch = plan_launch(geo, tokens, 2048, 132, True)
    items = tokens * -(-heads // 64)
    want = {1: 32, 2: 32, 4: 32, 8: 16, 64: 2, 128: 1}[items]  # (T 64 at 128 heads: the prefill takes 128 items)
    assert launch.splits == want
    assert items * launch.splits <= 132


@pytest.mark.parametrize(
    "kind, d_v, d_rope, heads, options, rows, consumers",
    [
        ("bf16", 512, 64, 128, {}, "async", "halves"),  # FlashMLA's pipeline
        ("bf16", 256, 0, 64, {}, "async", "paired"),
        ("packed", 512, 64, 128, {}, "inplace", "single"),  # no room for raw stages beside the bf16 ones
        ("packed", 512, 64, 128, {"split": True}, "inplace", "single"),
        ("packed", 256, 0, 64, {}, "bulk", "single"),  # 264-byte rows, 8-byte aligned: a TMA bulk copy each
        ("fp8", 256, 0, 64, {}, "staged", "single"),
        ("bf16", 512, 64, 16, {"transposed": True}, "async", "transposed"),
        ("packed", 512, 64, 8, {"transposed": True}, "inplace", "transposed"),
        ("packed", 512, 0, 8, {"transposed": True}, "direct", "transposed"),  # GLM-5.3-Flash's rows at 8 heads
        ("packed", 512, 0, 16, {"transposed": True}, "inplace", "transposed"),
    ],
)
def test_plan_row_and_consumer_schemes(kind, d_v, d_rope, heads, options, rows, consumers):
    """Each kernel's two scheme values, and the flags the kernel builders read follow from them."""
    plan = ws_plan(geometry(kind, d_v, d_rope, heads=heads), **options)
    assert (plan.rows, plan.consumers) == (rows, consumers)
    assert rows in ROW_SCHEMES and consumers in CONSUMER_SCHEMES
    assert plan.staged == (rows in ("staged", "bulk")) and plan.inplace == (rows in ("inplace", "direct"))
    assert plan.paired == (consumers in ("paired", "halves")) and plan.transposed == (consumers == "transposed")


def test_widened_rows_host_side_on_the_cpu(monkeypatch):
    # the host side of widening a serving pool's selected rows (mark, count, widen, remap), its kernels replaced by
    # torch ones that keep their contracts: each valid selection, remapped, reads its own row widened; invalid ones
    # (sentinels, past the pool) stay invalid; the rows are the distinct valid ids, ascending
    import torch

    from csrc_tl.attention.rows import RowsKey
    from sparse_dsa_ops import reference
    from sparse_dsa_ops._cuda import attention
    from sparse_dsa_ops.ops import OPS

    def kernel(key):
        if isinstance(key, RowsKey) and key.kind == "mark":
            return lambda ids, flags: flags.index_fill_(0, ids[(ids >= 0) & (ids < flags.numel())].long(), 1)

        def remap(ids, pos, out):
            valid = (ids >= 0) & (ids < pos.numel())
            out.copy_(torch.where(valid, pos[ids.clamp(0, pos.numel() - 1).long()] - 1, -1))

        def widen(pool, rows, out):
            out.copy_(reference.gather_dequant_k_cache(pool, rows))

        return remap if isinstance(key, RowsKey) else widen

    monkeypatch.setattr(attention, "kernel", kernel)
    g = torch.Generator().manual_seed(3)
    slots, t_count, topk = 300, 5, 64
    pool = reference.quant_k_cache(torch.randn(slots, 512, generator=g).bfloat16(), torch.randn(slots, 64).bfloat16())
    idx = torch.randint(-4, slots + 4, (t_count, topk), generator=g, dtype=torch.int32)
    idx[0, :3] = torch.tensor([-(2**31), 2**31 - 1, slots], dtype=torch.int32)
    idx[1] = 7  # one row, selected again and again
    args = OPS["sparse_attn"].check(torch.zeros(t_count, 8, 576).bfloat16(), pool, idx, 0.1, 512)
    flags, rows = attention._selected_rows(pool, idx)
    valid = (idx >= 0) & (idx < slots)
    assert torch.equal(rows, idx[valid].unique().to(torch.int32))
    widened, remapped = attention._widen_rows(args, pool, rows), attention._remap(idx, flags)
    assert torch.equal(remapped < 0, ~valid) and torch.equal(remapped[~valid], torch.full_like(remapped[~valid], -1))
    assert torch.equal(widened[remapped[valid].long()], reference.dequant_k_cache(pool[idx[valid].long()]))
