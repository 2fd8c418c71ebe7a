"""Pieces every GPU op module shares: input alignment, pool addressing and slot ids."""

from __future__ import annotations

import math

import torch

from ..ops import PoolView

__all__ = ["ALIGN", "aligned", "check_pool", "slot_dtype", "pool_rows", "pool_slots"]

# The kernels address their inputs from the tensors' data pointers and load up to 16 bytes at once (8
# bf16 values of q, four int32 indices); a pool's rows are read from its start, each with vectors of up to
# 16 bytes that its row width keeps aligned (so 8 for the 264- and 392-byte packed rows).
ALIGN = 16


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte-aligned data pointer: ``x`` itself where it is both, else a copy (the
    caching allocator's blocks are aligned). Only for inputs the kernels read whole, never for pools."""
    x = x.contiguous()
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


def check_pool(op: str, name: str, pool: torch.Tensor, row_bytes: int) -> None:
    """Raise a ValueError where the kernels cannot address pool ``pool`` (rows of ``row_bytes`` bytes): it
    must start where a row of a 16-byte-aligned pool could (a whole pool, or a slice of one by rows). A
    misaligned load would be a sticky CUDA error that ends the process's use of the device; copying a
    pool per call would cost its whole size, and ``store_k_cache`` must write into the caller's."""
    need = math.gcd(row_bytes, ALIGN)
    if pool.data_ptr() % need:
        raise ValueError(
            f"dsa.{op} on {pool.device.type}: {name} (rows of {row_bytes} bytes) must start at an address that "
            f"is a multiple of {need} bytes, as every row of a {ALIGN}-byte-aligned pool does; its data pointer "
            f"is {pool.data_ptr() % need} bytes past one (a view at a byte offset?). Pass a pool allocated by "
            "torch, or a slice of one by whole rows or pages."
        )


def slot_dtype(ids: torch.Tensor) -> str:
    return "int64" if ids.dtype == torch.int64 else "int32"


def pool_rows(pool: torch.Tensor, view: PoolView, packed: bool = True) -> torch.Tensor:
    """The pool as one ``[rows, width]`` tensor of rows the kernels address by row id: a uint8 view of packed rows
    of any 1-byte dtype. Without a copy where every slot starts a whole number of rows after the first
    (``view.whole_rows``): for pages or rows further apart, the rows from the first slot's to the last slot's (the
    gaps included, never addressed: see :func:`pool_slots`). Any other stride (rows a multiple of 16 bytes apart
    but not a whole number of rows, as in a slice of wider rows) gets a compact copy of the pool, made per call:
    the kernels take the pool as a contiguous ``[rows, width]`` tensor with no row stride of its own.
    ``packed``: the pool holds packed rows (not raw bf16 or float8 values)."""
    if packed and pool.dtype in (torch.int8, torch.float8_e4m3fn):
        pool = pool.view(torch.uint8)
    if view.contiguous:
        return pool.reshape(-1, view.width)
    if not view.whole_rows:
        return pool.reshape(-1, view.width).contiguous()
    rows = (view.pages - 1) * (view.page_stride // view.width) + (view.page - 1) * (view.row_step // view.width) + 1
    return pool.as_strided((rows, view.width), (view.width, 1))


def pool_slots(ids: torch.Tensor, view: PoolView) -> torch.Tensor:
    """Slot ids as row ids of :func:`pool_rows`: ``ids`` itself for a contiguous pool or its compact copy; else slot
    ``s`` becomes ``(s // page) * (page_stride / width) + (s % page) * (row_stride / width)``, and an id outside
    ``[0, S)`` becomes -1."""
    if view.contiguous or not view.whole_rows:
        return ids
    valid = (ids >= 0) & (ids < view.slots)
    page = torch.div(ids, view.page, rounding_mode="floor")
    rows = page * (view.page_stride // view.width) + (ids - page * view.page) * (view.row_step // view.width)
    return torch.where(valid, rows, -1).to(ids.dtype)
