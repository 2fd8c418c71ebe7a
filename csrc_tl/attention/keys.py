"""The typed keys of the sparse-attention kernels and the one builder function they go through.

A key is a frozen record of everything its kernel is specialized on; its ``name`` spells all of it out (``sm_scale``
included, which the kernels compile in), and :func:`build` makes the kernel's program from the key alone.
"""

from dataclasses import dataclass

from .geometry import DEFAULT_TILES, AttnGeometry
from .rows import RowsKey, build_rows
from .union import UnionKey, build_union

SCHEMES = ("prefill", "decode", "prefill_ws", "decode_ws")  # portable and warp-specialized, prefill and split


@dataclass(frozen=True)
class AttnKey:
    """A sparse-attention kernel: ``scheme`` (one of :data:`SCHEMES`: the portable or warp-specialized prefill, or
    split decode kernel) over ``geo``; ``ctas`` the grid of a persistent warp-specialized prefill (0: one CTA per
    token and head block); ``sink_max`` the prefill variant that also takes an ``attn_sink [H]`` float32 (joining
    each row's denominator of ``out``) and writes ``max_logits [T, H]`` float32 (each row's largest scaled score);
    ``transposed`` a warp-specialized kernel's few-heads consumers (:func:`~csrc_tl.attention.plan.ws_transposed`)."""

    scheme: str
    geo: AttnGeometry
    ctas: int = 0
    sink_max: bool = False
    transposed: bool = False

    def __post_init__(self):
        assert self.scheme in SCHEMES, f"scheme is one of {SCHEMES}, got {self.scheme!r}"
        assert self.ctas >= 0 and (not self.ctas or self.scheme == "prefill_ws"), "ctas: a persistent prefill's"
        assert not (self.sink_max and self.split), "sink_max: a prefill kernel's (the combine folds a split's sink)"
        assert not self.transposed or self.warp_specialized, "transposed: a warp-specialized kernel's consumers"

    @property
    def family(self) -> str:
        """The kernel family the bench and the plans print: ``attn_<scheme>``."""
        return f"attn_{self.scheme}"

    @property
    def warp_specialized(self) -> bool:
        return self.scheme.endswith("_ws")

    @property
    def split(self) -> bool:
        return self.scheme.startswith("decode")

    @property
    def name(self) -> str:
        persistent = f"_c{self.ctas}" if self.ctas else ""
        sink_max = "_sinkmax" if self.sink_max else ""
        transposed = "_tr" if self.transposed else ""
        return f"{self.family}_{self.geo}_s{self.geo.sm_scale!r}{persistent}{sink_max}{transposed}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class CombineKey:
    """The merge of a split kernel's partials: ``d_v`` wide rows of ``heads`` heads, the partials laid out for
    ``partial_heads`` heads (whole head blocks), launched as a programmatic dependent of the split kernel (sm_90)
    with ``pdl``."""

    d_v: int
    heads: int
    partial_heads: int
    pdl: bool = False
    sink: bool = False  # takes an attn_sink [H] float32 that joins the denominator of out

    family = "combine"

    @property
    def name(self) -> str:
        flags = ("_pdl" if self.pdl else "") + ("_sink" if self.sink else "")
        return f"combine_dv{self.d_v}_h{self.heads}_ph{self.partial_heads}{flags}"

    def __str__(self) -> str:
        return self.name


def build(key: "AttnKey | CombineKey | RowsKey | UnionKey"):
    """The TileLang program of ``key``."""
    if isinstance(key, RowsKey):
        return build_rows(key)
    if isinstance(key, UnionKey):
        return build_union(key)
    if isinstance(key, CombineKey):
        from .combine import build_combine

        return build_combine(key.d_v, key.heads, key.partial_heads, pdl=key.pdl, sink=key.sink)
    if key.warp_specialized:
        from .ws_kernel import build_attn_ws

        return build_attn_ws(
            key.geo,
            split=key.split,
            sink_max=key.sink_max,
            transposed=key.transposed,
            **({"ctas": key.ctas} if key.ctas else {}),
        )
    from .portable import build_attn

    tiles = DEFAULT_TILES["decode" if key.split else "prefill"]
    return build_attn(key.geo, split=key.split, sink_max=key.sink_max, **tiles)


def pass_configs(key: "AttnKey | CombineKey | RowsKey | UnionKey") -> dict:
    """TileLang pass configs of ``key``'s kernel."""
    if isinstance(key, AttnKey) and key.warp_specialized:
        from .plan import WS_PASS_CONFIGS

        return dict(WS_PASS_CONFIGS)
    return {}
