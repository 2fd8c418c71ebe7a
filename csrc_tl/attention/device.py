"""The CUDA device helpers of the warp-specialized kernels, read by sections from ``device_helpers.cuh`` beside this
module, and the prelude a kernel of a given plan injects (:func:`prelude`)."""

import re
from functools import cache
from pathlib import Path

HELPERS_FILE = Path(__file__).with_name("device_helpers.cuh")
# a section runs from its marker line to the next marker (or the end of the file); the text before the first is
# the file's own header
_MARKER = re.compile(r"^// section: (\w+)\n", re.MULTILINE)


@cache
def sections() -> dict[str, str]:
    """The helper sections of ``device_helpers.cuh`` by name, each exactly as it is injected into a prelude."""
    parts = _MARKER.split(HELPERS_FILE.read_text())
    return dict(zip(parts[1::2], parts[2::2]))


def helper(*names: str) -> str:
    """The sections ``names`` of ``device_helpers.cuh``, concatenated in that order."""
    return "".join(sections()[n] for n in names)


# Paired consumer warpgroups hand each other their final row sums through a static shared array that
# TileLang does not see: its barrier planner would try to separate the two warpgroups' accesses with
# a barrier inside one of them, which it fails to lower for some kernels; the done mbarriers order
# them instead.
WS_PRELUDE = helper("row_sums")
# The conversion of FP8 values to bf16 in the producers of build_attn_ws (WS_WIDEN, WS_BULK): e4m3 -> f16 is
# exact, f16 -> f32 too; the scale multiply and the rounding to bf16 are those of the reference's
# dequantization.
WS_CONVERT = helper("convert")
# The widening of FP8 rows in the producer of build_attn_ws (staged rows: from their raw stage; other
# rows in place, where the raw values of a row's 128-value group lie in the second of the two lines the
# group takes widened: see ws_inplace_raw_col), through WS_CONVERT.
WS_WIDEN = helper("widen")
# The direct producer's loads of packed rows into registers and their widening from there (WsPlan.direct), through
# WS_CONVERT.
WS_DIRECT = helper("direct")
# Stores and cp.async copies addressed with T.address_of (the in-place, halves and bulk producers).
WS_COPY = helper("copy")
# The staged producer's copies of packed rows by the TMA unit (ws_bulk): one bulk copy per row, issued by the
# row's first lane, completing on the raw stage's mbarrier; other lanes only zero their chunks of an invalid
# row (no copy lands there).
WS_BULK = helper("bulk")
# A named barrier of ``n`` threads (the split kernels' stores, the persistent kernels' consumers between items).
WS_BAR_SYNC = helper("bar_sync")
# The split kernels' partial stores (store_rows with a warpgroup): bf16 values into a shared tile, a named
# barrier of one warpgroup, 16-byte copies to global memory.
WS_STORE = helper("put_bf16", "bar_sync", "copy16")
# Helpers of the persistent kernels: the consumers' barrier between work items, and an index load at a computed offset
# (load_index).
WS_PERSIST = "\n" + helper("bar_sync", "ld_index")


# The transposed consumers' column statistics (the softmax's max and sum over the rows of S^T), after the named
# barrier they use where no other helper brings it.
WS_COL_STATS = helper("col_stats")


def prelude(
    paired: bool,
    inplace: bool,
    halves: bool,
    bulk: bool,
    calls_widen: bool,
    split: bool,
    persist: bool,
    transposed: bool = False,
    direct: bool = False,
) -> str | None:
    """The device helpers a warp-specialized kernel of these plan choices calls (see :class:`WsPlan`), or None."""
    has_bar_sync = split or persist
    return (
        (WS_PRELUDE if paired else "")
        + (WS_COPY if inplace or halves or bulk else "")
        + (WS_CONVERT if calls_widen or bulk or direct else "")
        + (WS_WIDEN if calls_widen else "")
        + (WS_DIRECT if direct else "")
        + (WS_BULK if bulk else "")
        + (WS_STORE if split else "")
        + (WS_PERSIST if persist else "")
        + ((WS_COL_STATS if has_bar_sync else WS_BAR_SYNC + WS_COL_STATS) if transposed else "")
    ) or None
