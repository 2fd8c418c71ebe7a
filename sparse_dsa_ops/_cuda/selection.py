"""GPU implementation of the exact top-k selection (arguments already checked by the family's contract,
``sparse_dsa_ops.ops.selection``): the TileLang kernels of ``csrc_tl.selection``, one CTA per row when the rows fill
the GPU (:func:`plan_topk`), and for few long rows (decode) each row split over several CTAs in one launch, whose
scratch is allocated per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from csrc_tl import selection as builders

from ..ops import takes_checked
from .common import aligned
from .compile import kernel, register_builder, sm_count

__all__ = ["bench_cases", "warmup_keys", "plan_topk", "scratch_bytes", "select", "TopkPlan", "topk"]

register_builder(builders.TopkKey, builders.build_topk_rows, builders.pass_configs)
register_builder(builders.TopkSplitKey, builders.build_topk_split, builders.pass_configs)

# rows of at most this many columns are one CTA's work however few they are: one read into the CTA's list beats the
# split's handoff (BENCHMARKS.md, design decisions)
SPLIT_MAX_ROW = 8192
SPLIT_MIN_CHUNK = 4096  # columns of a split CTA at least (its list is gathered from them)
SPLIT_WAVES = 1  # split CTAs per SM the rows of a call aim at (one wave: measured faster than two at 4 and 64 rows)
SPLIT_THREADS = 1024  # threads of a split CTA (measured 10-15% faster than 512 at 1, 4 and 64 rows)
MAX_CHUNKS = 256  # CTAs a row at most (the split kernel takes up to its thread count)
# list entries of a split row's last CTA: k 4096's guess aims at 8192 keys with room on both sides (144 KiB of
# shared memory in all, one CTA an SM as the split plans anyway)
SPLIT_CAP = 16384
DEFAULT_SMS = 132  # an H200's, for plans made without a GPU


@dataclass(frozen=True)
class TopkPlan:
    """What one ``topk`` call launches: ``chunks`` CTAs a row (1: the one-CTA-per-row kernel)."""

    chunks: int
    chunk: int  # columns of a chunk (the whole width when not split)

    def keys(self, k: int, page_size: int, has_starts: bool, has_row_request: bool) -> list:
        fields = dict(k=k, page_size=page_size, has_starts=has_starts, has_row_request=has_row_request)
        if self.chunks == 1:
            return [builders.TopkKey(**fields)]
        return [builders.TopkSplitKey(threads=SPLIT_THREADS, cap=SPLIT_CAP, **fields)]


def plan_topk(rows: int, width: int, sms: int) -> TopkPlan:
    """Split a row over CTAs when ``rows`` alone leave most of the ``sms`` SMs idle and the rows are long."""
    if width <= SPLIT_MAX_ROW or rows * SPLIT_WAVES >= sms:
        return TopkPlan(1, width)
    chunks = max(1, min(SPLIT_WAVES * sms // max(rows, 1), -(-width // SPLIT_MIN_CHUNK), MAX_CHUNKS))
    return TopkPlan(chunks, builders.split_chunk(width, chunks)) if chunks > 1 else TopkPlan(1, width)


@takes_checked
def topk(args, logits, lengths, k, starts=None, page_table=None, row_request=None, page_size=64, out_width=None):
    out = torch.empty(logits.shape[0], args.width, dtype=torch.int32, device=logits.device)
    select(out, logits, lengths, k, starts, page_table, row_request, page_size if args.paged else 0)
    return out


def select(out, logits, lengths, k, starts=None, page_table=None, row_request=None, page=0) -> None:
    """``topk`` into ``out [R, W']`` int32, contiguous (a slice of rows of a bigger output too): every element
    written. ``page``: the page size of ``page_table``, 0 without one."""
    rows, width = logits.shape
    if not rows:
        return
    if not width:
        out.fill_(-1)
        return
    plan = plan_topk(rows, width, sm_count(logits.device))
    keys = plan.keys(k, page, starts is not None, row_request is not None)
    lengths = aligned(lengths)
    optional = [aligned(t) for t in (starts, page_table, row_request) if t is not None]
    if plan.chunks == 1:
        kernel(keys[0])(logits, lengths, *optional, out)
        return
    dev = logits.device
    tickets = torch.zeros(rows, dtype=torch.int32, device=dev)
    cand = torch.empty(rows, plan.chunks, 2, plan.chunk, dtype=torch.int32, device=dev)
    cand_count = torch.empty(rows, plan.chunks, dtype=torch.int32, device=dev)
    kernel(keys[0])(logits, lengths, *optional, tickets, cand, cand_count, out)


def scratch_bytes(rows: int, width: int, sms: int) -> int:
    """The device scratch one ``topk`` call on ``rows`` rows of ``width`` allocates (on ``sms`` SMs), in bytes."""
    plan = plan_topk(rows, width, sms)
    if plan.chunks == 1:
        return 0
    return 4 * rows * (1 + plan.chunks * (2 * plan.chunk + 1))


def warmup_keys(k=None, page_size=64, starts=(False, True), paged=(False, True), row_request=(False, True)) -> list:
    """The top-k kernels of selection size ``k`` (both schemes) for the argument combinations given: with or
    without ``starts``, positions or slots of a page table of ``page_size`` tokens, with or without
    ``row_request``."""
    if not k:
        return []
    keys = []
    for has_starts in starts:
        for is_paged in paged:
            for has_request in row_request if is_paged else (False,):
                for chunks in (1, 2):
                    keys += TopkPlan(chunks, 0).keys(k, page_size if is_paged else 0, has_starts, has_request)
    return list(dict.fromkeys(keys))


SOURCE_OPS = ("topk",)  # the ops ``python -m sparse_dsa_ops source`` prints this family's kernels of


def source_keys(op: str, args) -> list:
    """Both schemes of ``topk`` for the command line's ``args``: ``k``, and ``page`` (pool slots through a page
    table of that many tokens a page; 0: positions)."""
    return TopkPlan(1, 0).keys(args.k, args.page, False, False) + TopkPlan(2, 0).keys(args.k, args.page, False, False)


# ----------------------------------------------------------------------------------------------
# Bench cases: the logits are read once (the byte count), against the device copy of the same run.

ROW_TARGETS = {1: ("<=", 12.0, "us"), 4: ("<=", 20.0, "us")}
COPY_TARGET = (">=", 0.70, "of copy")


def _case(rows: int, width: int, k: int, causal: bool = False, targeted: bool = True) -> dict:
    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(rows, width, device="cuda", generator=gen)
        if causal:  # prefill: row r sees 1 + r * (width - 1) / (rows - 1) columns
            lengths = (1 + torch.arange(rows, device="cuda") * (width - 1) // max(rows - 1, 1)).int()
        else:
            lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        return logits, lengths, k

    sms = sm_count(torch.device("cuda")) if torch.cuda.is_available() else DEFAULT_SMS
    plan = plan_topk(rows, width, sms)
    keys = plan.keys(k, 0, False, False)
    read = (rows * (width + 1) // 2 if causal else rows * width) * 4
    target = ROW_TARGETS.get(rows, COPY_TARGET) if targeted else None
    name = f"topk k{k} of {width // 1024}K, {rows} rows{' causal' if causal else ''}"
    path = f"{plan.chunks} CTAs a row" if plan.chunks > 1 else "a CTA a row"
    return dict(name=name, op="topk", make=make, flops=None, bytes=read, keys=keys, path=path, target=target)


def bench_cases() -> list[dict]:
    """The top-k cases of ``python -m sparse_dsa_ops bench``, with their targets (bound, value, unit)."""
    return [
        _case(1, 131072, 2048),
        _case(4, 131072, 2048),
        _case(64, 131072, 2048),
        _case(4096, 65536, 2048, causal=True),
        # (the other selection sizes of the models, beside k 2048's target)
        *(_case(4096, 65536, k, causal=True, targeted=False) for k in (512, 1024, 2112, 4096)),
    ]


def warmup_keys_of(spec) -> list:
    """The top-k kernels :func:`sparse_dsa_ops.warmup` compiles for ``spec`` (a ``WarmupSpec``): those of k
    ``topk_k``, none without it."""
    return warmup_keys(spec.topk_k, spec.index_page) if spec.topk_k else []
