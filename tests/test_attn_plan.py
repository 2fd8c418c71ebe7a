"""CPU tests of the plan record of the warp-specialized attention kernel (csrc_tl.sparse_attn.plan): which producer
and consumer scheme, block sizes, stages and persistence each geometry gets, and the device helpers its prelude
carries. Nothing here lowers a kernel."""

import dataclasses
from typing import NamedTuple

import pytest

from csrc_tl.sparse_attn import AttnGeometry, device, ws_plan, ws_supported
from csrc_tl.sparse_attn.plan import DEFAULT_CTAS, WS_NREG


def geometry(kind: str, d_v: int, d_rope: int, heads: int = 64, q_fp8: bool = False,
             has_len: bool = False) -> AttnGeometry:
    return AttnGeometry(d_v, d_rope, heads, kind, has_len, (d_v + d_rope) ** -0.5, q_fp8)


class Case(NamedTuple):
    geo: AttnGeometry
    split: bool
    scheme: tuple[str, int]  # (consumer / producer scheme, producer warpgroups): the key of WS_NREG
    block_i: int
    flags: frozenset  # the plan's flags that are true, among FLAGS

    def __str__(self) -> str:
        return f"{'decode' if self.split else 'prefill'}-{self.geo}"


FLAGS = ("copies_async", "staged", "inplace", "paired", "p0_in_tail", "halves", "wg1_widens", "persist", "quarters",
         "bulk", "calls_widen")


def case(geo, split, scheme, block_i, *flags):
    assert set(flags) <= set(FLAGS), flags
    return Case(geo, split, scheme, block_i, frozenset(flags))


CASES = [
    # DeepSeek bf16 rows (576 wide): paired consumers over stage halves, 64-row blocks (FlashMLA's pipeline)
    case(geometry("bf16", 512, 64), False, ("paired", 1), 64, "copies_async", "paired", "p0_in_tail", "halves"),
    case(geometry("bf16", 512, 64, heads=1), False, ("paired", 1), 64, "copies_async", "paired", "p0_in_tail",
         "halves"),
    # its decode: one consumer scores every block
    case(geometry("bf16", 512, 64), True, ("single", 1), 64, "copies_async"),
    # GLM bf16 rows: paired over whole 128-row stages
    case(geometry("bf16", 256, 0), False, ("paired", 1), 128, "copies_async", "paired"),
    # GLM packed rows: staged, bulk-copied by the TMA unit, persistent, two producers
    case(geometry("packed", 256, 0), False, ("single", 2), 128, "staged", "persist", "quarters", "bulk"),
    case(geometry("packed", 256, 0, heads=8, has_len=True), False, ("single", 2), 128, "staged", "persist",
         "quarters", "bulk"),
    # ... whose decode keeps cp.async copies and one CTA per item
    case(geometry("packed", 256, 0, heads=8), True, ("single", 2), 64, "staged", "quarters"),
    # GLM native FP8 rows: staged and widened through dsa_widen
    case(geometry("fp8", 256, 0, q_fp8=True), False, ("single", 2), 128, "staged", "quarters", "calls_widen"),
    # DeepSeek packed rows: in place, consumer warpgroup 1 widens the last pass of each block
    case(geometry("packed", 512, 64), False, ("inplace_wg1", 1), 64, "inplace", "wg1_widens", "quarters",
         "calls_widen"),
    case(geometry("packed", 512, 64, heads=128), True, ("inplace_wg1", 1), 64, "inplace", "wg1_widens", "quarters",
         "calls_widen"),
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


@pytest.mark.parametrize("geo, ok", [
    (geometry("bf16", 384, 0), True), (geometry("fp8", 384, 0), False), (geometry("bf16", 192, 64), False),
    (geometry("packed", 512, 32), False), (geometry("fp8", 512, 0), True)], ids=lambda v: str(v))
def test_ws_supported(geo, ok):
    assert ws_supported(geo) is ok
    if not ok:
        with pytest.raises(AssertionError, match="needs d_v"):
            ws_plan(geo)


def test_device_helper_sections():
    names = ("row_sums", "convert", "widen", "copy", "bulk", "put_bf16", "bar_sync", "copy16", "ld_index")
    sections = device.sections()
    assert tuple(sections) == names
    assert all(text.endswith("\n") and "// section:" not in text for text in sections.values())
    assert device.WS_STORE.count("dsa_bar_sync(int id") == 1 and device.WS_PERSIST.count("dsa_bar_sync(int id") == 1


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

