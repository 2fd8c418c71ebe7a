"""The work items of a warp-specialized kernel (:mod:`csrc_tl.attention.ws_kernel`): one (token, head block) per
CTA, or for a persistent kernel (``plan.persist``) the items ``bx, bx + ctas, ...`` of CTA ``bx`` one after another."""

from types import SimpleNamespace

import tilelang.language as T

from .common import valid_entries
from .plan import WsPlan


def work_helpers(plan: WsPlan, dims) -> SimpleNamespace:
    """The work-item arithmetic of ``plan`` over the kernel's dynamic sizes ``dims = (t_count, s_count, k_count,
    n_split)``: ``work``, ``next_token``, ``next_stop``, ``work_items``, ``pair_phase`` and ``global_block``."""
    geo, persist, ctas, groups, hb, block_i = plan.geo, plan.persist, plan.ctas, plan.groups, plan.hb, plan.block_i
    t_count, _, k_count, _ = dims

    def work(bx, by, i, topk_length, *item0):
        """``(t, h0, first, stop, n_blk, pairs, walk)`` of work item ``i`` of the CTA ``(bx, by)``: its token, first
        head and first top-k block, the end of its valid entries, its blocks, the pairs of them and the blocks it walks.
        A kernel that is not persistent has one item, ``item0``. A persistent kernel walks at least one pair for an
        empty row too, so that every item fills both stages and the stages' phases alternate with the pairs."""
        if not persist:
            return item0
        w = bx + i * ctas
        t = w // groups
        n_valid = valid_entries(geo, topk_length, t, k_count)
        n_blk = T.ceildiv(n_valid, block_i)
        pairs = T.max(T.ceildiv(n_blk, 2), 1)
        return t, w % groups * hb, 0, n_valid, n_blk, pairs, 2 * pairs

    def next_token(bx, i, t):
        """The token of a persistent CTA's work item after ``i`` (the last token if there is none), else ``t``."""
        return T.min((bx + (i + 1) * ctas) // groups, t_count - 1) if persist else t

    def next_stop(bx, i, t_n, topk_length):
        """The end of the valid entries of a persistent CTA's work item after ``i`` (token ``t_n``), 0 if there is
        none."""
        if not persist:
            return 0
        return T.if_then_else(bx + (i + 1) * ctas < t_count * groups, valid_entries(geo, topk_length, t_n, k_count), 0)

    def work_items(n_items):
        """The loop over a CTA's work items: one (item 0, a Python loop) unless persistent."""
        return T.serial(n_items) if persist else (0,)

    def pair_phase(base, pair):
        """The stages' phase in pair ``pair`` of the current work item (``base[0]`` blocks before it)."""
        return (base[0] // 2 + pair) & 1 if persist else pair & 1

    def global_block(base, it):
        """Block ``it`` of the current work item counted over the CTA's items (``base[0]`` blocks before it)."""
        return base[0] + it if persist else it

    return SimpleNamespace(
        work=work,
        next_token=next_token,
        next_stop=next_stop,
        work_items=work_items,
        pair_phase=pair_phase,
        global_block=global_block,
    )
