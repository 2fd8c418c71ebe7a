"""The packed FP8 K-cache row.

One row of the latent KV cache, as the serving stack stores it::

    [ d_nope x float8_e4m3fn | (d_nope / 128) x float32 scale | d_rope x bfloat16 ]
    row_bytes = d_nope + 4 * d_nope / 128 + 2 * d_rope

Each 128-wide tile of the NoPE latent has its own float32 scale; the RoPE tail is stored
unquantized. DeepSeek V3.2 rows are 656 bytes (512 + 64), GLM-5.3-Flash rows 528 bytes (512 + 0),
the 256 + 0 geometry 264 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FP8_MAX", "QUANT_TILE", "KCacheLayout"]

QUANT_TILE = 128  # NoPE values that share one scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # float32
ROPE_ELEM_BYTES = 2  # bfloat16
INFERABLE_ROPE_DIMS = (0, 64)  # tails that from_row_bytes recognises


@dataclass(frozen=True)
class KCacheLayout:
    """Byte layout of one packed FP8 row.

    Parameters
    ----------
    d_nope : int
        Width of the quantized latent (also the value width d_v); a positive multiple of 128.
    d_rope : int
        Width of the bfloat16 RoPE tail; 0 means the row has no tail at all.
    """

    d_nope: int
    d_rope: int

    def __post_init__(self) -> None:
        if not isinstance(self.d_nope, int) or self.d_nope <= 0 or self.d_nope % QUANT_TILE:
            raise ValueError(f"KCacheLayout: d_nope must be a positive multiple of {QUANT_TILE}, got {self.d_nope!r}")
        if not isinstance(self.d_rope, int) or self.d_rope < 0:
            raise ValueError(f"KCacheLayout: d_rope must be a non-negative int, got {self.d_rope!r}")

    @property
    def num_scales(self) -> int:
        """Number of float32 scales, one per 128-wide NoPE tile."""
        return self.d_nope // QUANT_TILE

    @property
    def d_qk(self) -> int:
        """Width of a dequantized row: d_nope + d_rope."""
        return self.d_nope + self.d_rope

    @property
    def nope_offset(self) -> int:
        """Byte offset of the FP8 values (always 0)."""
        return 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the float32 scales."""
        return self.d_nope

    @property
    def rope_offset(self) -> int:
        """Byte offset of the bfloat16 RoPE tail (equal to row_bytes when there is no tail)."""
        return self.d_nope + SCALE_BYTES * self.num_scales

    @property
    def row_bytes(self) -> int:
        """Bytes in one packed row."""
        return self.rope_offset + ROPE_ELEM_BYTES * self.d_rope

    @classmethod
    def from_row_bytes(cls, row_bytes: int) -> KCacheLayout:
        """Infer the layout from a row width, for a RoPE tail of 0 or 64.

        656 -> 512 + 64, 264 -> 256 + 0, 528 -> 512 + 0, 392 -> 256 + 64. The answer is unique:
        a row without tail is a multiple of 132 bytes, a row with a 64-wide tail is 128 more.

        Raises
        ------
        ValueError
            For any other width; the message lists the valid widths nearest to it.
        """
        per_tile = QUANT_TILE + SCALE_BYTES
        for d_rope in INFERABLE_ROPE_DIMS:
            body = row_bytes - ROPE_ELEM_BYTES * d_rope
            if body > 0 and body % per_tile == 0:
                return cls(d_nope=body // per_tile * QUANT_TILE, d_rope=d_rope)
        raise ValueError(
            f"KCacheLayout: {row_bytes} is not a packed FP8 row width; the nearest valid widths are "
            + ", ".join(f"{lay.row_bytes} ({lay.d_nope}+{lay.d_rope})" for lay in cls.nearest(row_bytes))
        )

    @classmethod
    def nearest(cls, row_bytes: int, count: int = 4) -> list[KCacheLayout]:
        """The ``count`` inferable layouts whose row width is closest to ``row_bytes``."""
        tiles = max(1, round(row_bytes / (QUANT_TILE + SCALE_BYTES)))
        candidates = [
            cls(d_nope=n * QUANT_TILE, d_rope=r)
            for n in range(max(1, tiles - 3), tiles + 4)
            for r in INFERABLE_ROPE_DIMS
        ]
        candidates.sort(key=lambda lay: (abs(lay.row_bytes - row_bytes), lay.row_bytes))
        return sorted(candidates[:count], key=lambda lay: lay.row_bytes)

    def __str__(self) -> str:
        return f"{self.d_nope}+{self.d_rope} ({self.row_bytes} B)"
