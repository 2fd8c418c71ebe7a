"""The row maps of a call whose selected rows are widened (``AttnLaunch.widen_pool`` over the rows the call selects
rather than the whole pool; see :func:`csrc_tl.attention.launch.plan_count_rows`): ``mark`` flags every pool row some
token selects, and, once the flags' inclusive prefix sum ``pos`` numbers the flagged rows, ``remap`` rewrites each
selection as the row's place among them.

Shapes (N selections, S pool rows; both dynamic): ``ids [N] int32`` slot ids (any value: those outside ``[0, S)`` are
invalid), ``flags [S] int32`` (zeroed by the caller; ``mark`` writes 1 where a row is selected), ``pos [S] int32``
(the inclusive prefix sum of ``flags``), ``out [N] int32`` (``pos[id] - 1``, or -1 for an invalid id).
"""

from dataclasses import dataclass

ROWS_THREADS = 256
ROWS_PER_THREAD = 8  # ids a thread takes, each load of a warp coalesced


@dataclass(frozen=True)
class RowsKey:
    """A row-map kernel of a call whose selected rows are widened: ``kind`` "mark" or "remap"."""

    kind: str

    family = "rows"

    def __post_init__(self):
        assert self.kind in ("mark", "remap"), f"kind is mark or remap, got {self.kind!r}"

    @property
    def name(self) -> str:
        return f"attn_{self.kind}_rows"

    def __str__(self) -> str:
        return self.name


def build_rows(key: RowsKey):
    """The TileLang program of ``key``: ``mark(ids, flags)`` or ``remap(ids, pos, out)`` (see the module)."""
    import tilelang.language as T  # here, so that planning a launch imports neither TileLang nor torch

    n, s = T.dynamic("n"), T.dynamic("s")
    block = ROWS_THREADS * ROWS_PER_THREAD

    if key.kind == "mark":

        @T.prim_func
        def mark(ids: T.Tensor((n,), T.int32), flags: T.Tensor((s,), T.int32)):
            with T.Kernel(T.ceildiv(n, block), threads=ROWS_THREADS) as bx:
                tx = T.get_thread_binding()
                for v in T.unroll(ROWS_PER_THREAD):
                    i = bx * block + v * ROWS_THREADS + tx
                    if i < n:
                        slot = ids[i]
                        if slot >= 0 and slot < s:
                            flags[slot] = 1

        return mark

    @T.prim_func
    def remap(ids: T.Tensor((n,), T.int32), pos: T.Tensor((s,), T.int32), out: T.Tensor((n,), T.int32)):
        with T.Kernel(T.ceildiv(n, block), threads=ROWS_THREADS) as bx:
            tx = T.get_thread_binding()
            for v in T.unroll(ROWS_PER_THREAD):
                i = bx * block + v * ROWS_THREADS + tx
                if i < n:
                    slot = ids[i]
                    if slot >= 0 and slot < s:
                        out[i] = pos[slot] - 1
                    else:
                        out[i] = -1

    return remap
