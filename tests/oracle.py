"""Float64 brute-force definitions the tests hold every backend to, and hostile input makers.

These are written independently of ``sparse_dsa_ops.reference`` (loops, float64, a table of all
FP8 values) so that a mistake there does not hide itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class Geometry:
    name: str
    d_nope: int
    d_rope: int

    @property
    def d_qk(self) -> int:
        return self.d_nope + self.d_rope

    def __str__(self) -> str:
        return self.name


DEEPSEEK = Geometry("deepseek-512+64", 512, 64)
GLM = Geometry("glm-256+0", 256, 0)
GEOMETRIES = [DEEPSEEK, GLM, Geometry("512+0", 512, 0), Geometry("256+64", 256, 64)]

# Every finite float8_e4m3fn value, ascending, in float64.
_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
FP8_VALUES = torch.unique(_codes[torch.isfinite(_codes)])


def fp8_rank(x: torch.Tensor) -> torch.Tensor:
    """Position of each (representable) value in FP8_VALUES; -0 and +0 share a rank."""
    return torch.searchsorted(FP8_VALUES, x.double().contiguous())


def brute_scales(k_nope: torch.Tensor, round_scale: bool) -> torch.Tensor:
    """Per-128 scales in float64 math, rounded once to float32: ``[N, d_nope / 128]``."""
    x = k_nope.double().reshape(k_nope.shape[0], -1, 128)
    out = torch.empty(x.shape[:2], dtype=torch.float32)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            s = float(torch.tensor(x[i, j].abs().max().item() / 448.0, dtype=torch.float32))
            if s == 0.0:
                s = 1.0
            if round_scale:
                s = 2.0 ** math.ceil(math.log2(s))
            out[i, j] = s
    return out


def brute_fp8(y: torch.Tensor) -> torch.Tensor:
    """Nearest FP8 value of each float64 ``y``, saturating at +-448 (ties resolved either way)."""
    y = y.double().clamp(-448.0, 448.0).reshape(-1, 1)
    nearest = (FP8_VALUES.reshape(1, -1) - y).abs().argmin(dim=1)
    return FP8_VALUES[nearest].reshape(-1)


def split_packed(packed: torch.Tensor, d_nope: int, d_rope: int):
    """Packed rows ``[N, B]`` -> (fp8 values as float64 [N, d_nope], scales [N, n], tail bf16 [N, d_rope])."""
    n_tiles = d_nope // 128
    values = packed[:, :d_nope].contiguous().view(torch.float8_e4m3fn).double()
    scales = packed[:, d_nope : d_nope + 4 * n_tiles].contiguous().view(torch.float32)
    tail = packed[:, d_nope + 4 * n_tiles :].contiguous().view(torch.bfloat16)
    return values, scales, tail


def brute_attn(q, rows_of, indices, sm_scale, d_v, topk_length=None):
    """Float64 loop: ``rows_of(slot) -> float64 [d_qk]`` or None for an invalid slot.

    Returns (out [T, H, d_v] float64, lse [T, H] float64).
    """
    t_count, heads, _ = q.shape
    idx = indices.reshape(t_count, -1)
    out = torch.zeros(t_count, heads, d_v, dtype=torch.float64)
    lse = torch.full((t_count, heads), -math.inf, dtype=torch.float64)
    for t in range(t_count):
        limit = idx.shape[1] if topk_length is None else int(topk_length[t])
        rows = [rows_of(int(s)) for s in idx[t, : max(0, limit)]]
        rows = [r for r in rows if r is not None]
        if not rows:
            continue
        kmat = torch.stack(rows)  # [n, d_qk]
        scores = q[t].double() @ kmat.T * sm_scale  # [H, n]
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ kmat[:, :d_v]
    return out, lse


def hostile_indices(gen, t_count, topk, num_slots, *, empty_rows=(), invalid_frac=0.25):
    """``[T, K]`` int32 slot ids: valid ids mixed with -1, other negatives, >= S, INT_MIN and INT_MAX.

    Rows listed in ``empty_rows`` hold no valid id at all.
    """
    idx = torch.randint(0, num_slots, (t_count, topk), generator=gen, dtype=torch.int64)
    junk = torch.tensor([-1, -2, -(2**20), num_slots, num_slots + 7, INT_MIN, INT_MAX], dtype=torch.int64)
    bad = torch.rand(t_count, topk, generator=gen) < invalid_frac
    pick = torch.randint(0, len(junk), (t_count, topk), generator=gen)
    idx = torch.where(bad, junk[pick], idx)
    for t in empty_rows:
        idx[t] = junk[torch.randint(0, len(junk), (topk,), generator=gen)]
    return idx.to(torch.int32)


def unselected_slots(indices: torch.Tensor, num_slots: int, topk_length=None) -> torch.Tensor:
    """Bool ``[S]``: slots that no valid entry selects (the tests fill these with NaN)."""
    idx = indices.reshape(indices.shape[0], -1).long()
    valid = (idx >= 0) & (idx < num_slots)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1]) < topk_length.long()[:, None]
    used = torch.zeros(num_slots, dtype=torch.bool)
    used[idx[valid]] = True
    return ~used
