"""The packed FP8 K-cache row (``KCacheLayout``), re-exported for users.

The layout is pure Python and lives beside the kernel builders (``csrc_tl.layout``), which must not
import this package; see that module for the row format.
"""

from csrc_tl.layout import FP8_MAX, QUANT_TILE, KCacheLayout

__all__ = ["FP8_MAX", "QUANT_TILE", "KCacheLayout"]
