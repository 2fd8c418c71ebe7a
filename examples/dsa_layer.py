"""A whole DeepSeek Sparse Attention (DSA) layer in plain model code on the ``sparse_dsa_ops`` ops.

The layer is the attention of DeepSeek-V3.2, GLM-5 or GLM-5.3-Flash at their public configs, with random weights.
GLM-5.3-Flash has no RoPE (its latent rows have no tail, its indexer rotates nothing) and a k-pool indexer: it scores
pools of 16 tokens. Per token:

1. **Projections** (plain torch): the query latent ``rms_norm(x Wq_a)``; MLA's query heads from it, their NoPE part
   absorbed through ``W_UK`` into the C-wide latent and their RoPE part rotated (pairs of adjacent dims); the
   compressed KV row ``rms_norm`` latent + rotated RoPE tail; the indexer's query heads (from the query latent) and its
   single key (``LayerNorm(x W_k)``), both rotated on their first ``index_rope`` dims (as two halves) and then through
   a Hadamard transform, and the indexer's per-head weights ``x W_w``.
2. **Caches**: ``store_k_cache`` writes the latent row into the packed FP8 pool, ``store_index_k`` the indexer key
   into the paged index-K cache; both pools share the slot numbering of one page table.
3. **Indexer**: ``quant_index`` turns the indexer queries into FP8 with one scale per (token, head); that scale and
   the softmax-style factors are folded into the head weights,
   ``weights[t, h] = w[t, h] * q_scale[t, h] * Hi**-0.5 * D**-0.5``, so that the logit of key j is
   ``k_scale[j] * sum_h weights[t, h] * relu(q8[t, h] . k8[j])`` (DeepSeek-V3.2's ``Indexer``). Prefill scores
   the batch's own keys with ``index_logits`` (token i of a request sees that request's first i + 1 keys); decode
   scores each request's pages with ``paged_index_logits``.
4. **Selection**: ``topk`` keeps the ``min(2048, index_topk)`` best positions of each token and maps them through
   the page table to pool slots, padded with -1 to a multiple of 64. With a k-pool indexer (GLM-5.3-Flash),
   ``kpool_store_index_k`` writes one index-K row per complete pool (a per-channel softmax-gated average of its
   tokens' keys, staged in bfloat16 until the pool's last token arrives), every token scores its request's pools with
   ``paged_index_logits``, and ``kpool_topk`` keeps the best 128 pools, expanded to their tokens, plus the tokens of
   the incomplete pool: 2063 entries, padded to 2112.
5. **Attention**: ``sparse_attn`` over those slots of the packed pool gives the C-wide latent output, which ``W_UV``
   and the output projection turn back into the hidden width. Its ``sm_scale`` is the model's
   (:attr:`DSAConfig.sm_scale`): ``qk_head_dim ** -0.5`` of the un-absorbed heads, times YaRN's ``mscale ** 2`` where
   the config has YaRN (DeepSeek-V3.2: 0.1352); the RoPE frequencies here are YaRN's unscaled ones, which the ops
   never see.

:class:`DSALayer` holds the weights and runs :meth:`~DSALayer.prefill` and :meth:`~DSALayer.decode`;
:class:`DecodeStep` compiles ``decode`` with ``torch.compile(fullgraph=True)`` and, on a GPU, replays it from a CUDA
graph over static input buffers; :func:`dense_reference` is the layer computed densely in plain torch (the tests'
oracle); :func:`bench_layer` times one decode step and one prefill stage by stage.

``python -m examples.dsa_layer`` times each public config on a GPU; without one it runs each config at CPU size
(:func:`cpu_size`, :func:`run_on_cpu`) and checks it against :func:`dense_reference`.

Letters: T query tokens, B requests, H attention heads, C the latent width (kv_lora, 512), R the RoPE width of the
latent rows (64, or 0), Hi indexer heads, D the indexer head dim (128), P pages of ``page`` slots, W a row of
index logits, K the top-k width padded to a multiple of 64.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

import sparse_dsa_ops as dsa
from sparse_dsa_ops import KCacheLayout

__all__ = [
    "DSAConfig",
    "DEEPSEEK_V32",
    "DEEPSEEK_V32_TP8",
    "GLM_5",
    "GLM_5_TP8",
    "GLM_53_FLASH",
    "GLM_53_FLASH_TP8",
    "CONFIGS",
    "Projection",
    "cat_projections",
    "PrefillBatch",
    "prefill_batch",
    "slot_of",
    "PagedCache",
    "DSALayer",
    "DecodeStep",
    "dense_reference",
    "quantize_index_rows",
    "dequantized_latent_rows",
    "decode_stages",
    "prefill_stages",
    "run_stages",
    "bench_layer",
    "warm_up",
    "cpu_size",
    "run_on_cpu",
]

FP8_MAX = 448.0  # the largest float8_e4m3fn value
KV_TILE = 128  # one FP8 scale per 128 latent values of a packed row
INDEX_SCALE_MIN = 1e-4  # floor of an indexer row's amax (quant_index's contract)
MAX_TOPK = 2048  # every model selects at most 2048 rows per query
TOPK_MULTIPLE = 64  # sparse_attn reads index rows whose width is a multiple of 64
NORM_EPS = 1e-6
DENSE_CHUNK_BYTES = 256 << 20  # float32 scratch of one query chunk of dense_reference
FILL_CHUNK_ROWS = 1 << 18  # rows written per call when bench_layer fills a cache
BENCH_QUEUE_CYCLES = 200_000_000  # ~0.1 s of GPU sleep so that every timed replay is queued before the first runs


# ----------------------------------------------------------------------------------------------
# Geometry.


@dataclass(frozen=True)
class DSAConfig:
    """One DSA attention layer's geometry.

    ``hidden``, ``q_lora``, ``qk_nope`` and ``v_head`` only size the dense projections; the sparse ops see the
    latent row (``kv_lora`` + ``d_rope``), the head counts, the indexer geometry and the page size.
    """

    name: str
    hidden: int
    heads: int  # MLA query heads (of this tensor-parallel shard)
    q_lora: int  # width of the query latent
    qk_nope: int  # per-head NoPE query/key width before absorption
    v_head: int  # per-head value width after W_UV
    d_rope: int  # RoPE width of the query heads and of the latent rows' tail; 0: no tail
    kv_lora: int = 512  # C, the latent width (d_nope = d_v of the packed rows)
    index_heads: int = 64  # Hi
    index_dim: int = 128  # D
    index_rope: int = 64  # the indexer rotates the first index_rope dims of its q and k (as two halves); 0: no RoPE
    index_topk: int = 2048
    kpool: int = 1  # the indexer scores pools of kpool consecutive tokens (GLM-5.3-Flash: 16); 1: single tokens
    index_hadamard: bool = True  # rotate the indexer's q and k through a Hadamard transform before FP8 quantization
    page: int = 64
    rope_theta: float = 10000.0
    rope_factor: float = 1.0  # YaRN's factor (1: no YaRN)
    mscale_all_dim: float = 0.0  # YaRN's mscale_all_dim: the attention scale grows by mscale ** 2
    index_round_scale: bool = True  # power-of-two indexer scales (DeepSeek-V3.2's ue8m0 scale format)
    kv_round_scale: bool = False

    @property
    def topk(self) -> int:
        """The tokens selected from complete pools (or single tokens): ``min(2048, index_topk)``."""
        return min(MAX_TOPK, self.index_topk)

    @property
    def pool_topk(self) -> int:
        """k of the selection: pools (of ``kpool`` tokens, or single tokens), ``topk / kpool``."""
        return self.topk // self.kpool

    @property
    def topk_width(self) -> int:
        """K: the selection's width as sparse_attn reads it: the selected pools' tokens plus the incomplete pool's
        ``kpool - 1`` at most (2063 for GLM-5.3-Flash), rounded up to a multiple of 64 (padded with -1)."""
        return -(-(self.pool_topk * self.kpool + self.kpool - 1) // TOPK_MULTIPLE) * TOPK_MULTIPLE

    @property
    def sm_scale(self) -> float:
        """The model's softmax scale: ``qk_head_dim ** -0.5`` of the un-absorbed heads (``qk_nope + d_rope``), times
        YaRN's ``mscale ** 2`` with ``mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`` where the config has
        YaRN (DeepSeek-V3.2: 0.1352). Absorption does not change it."""
        mscale = 0.1 * self.mscale_all_dim * math.log(self.rope_factor) + 1.0 if self.rope_factor > 1 else 1.0
        return float((self.qk_nope + self.d_rope) ** -0.5 * mscale**2)

    @property
    def index_weight_scale(self) -> float:
        """``Hi**-0.5 * D**-0.5``, folded into the indexer's head weights."""
        return float(self.index_heads**-0.5 * self.index_dim**-0.5)

    @property
    def layout(self) -> KCacheLayout:
        return KCacheLayout(self.kv_lora, self.d_rope)


# The public configs. DeepSeek-V3.2: YaRN (factor 40, mscale_all_dim 1), 64 indexer heads with RoPE on 64 dims.
DEEPSEEK_V32 = DSAConfig(
    "deepseek-v3.2",
    hidden=7168,
    heads=128,
    q_lora=1536,
    qk_nope=128,
    v_head=128,
    d_rope=64,
    rope_factor=40.0,
    mscale_all_dim=1.0,
)
# GLM-5: 64 heads of 192 + 64, values of 256, 32 indexer heads with RoPE on 64 dims; no YaRN.
GLM_5 = DSAConfig("glm-5", hidden=6144, heads=64, q_lora=2048, qk_nope=192, v_head=256, d_rope=64, index_heads=32)
# GLM-5.3-Flash: no RoPE anywhere (512 + 0 latent rows, heads of 256), and a k-pool indexer: 32 heads score pools of
# 16 tokens (their keys a gated average, quantized as pooled: a Hadamard rotation would not commute with the
# per-channel gate), 128 pools selected, plus the incomplete pool's tokens.
GLM_53_FLASH = DSAConfig(
    "glm-5.3-flash",
    hidden=4096,
    heads=64,
    q_lora=1536,
    qk_nope=256,
    v_head=256,
    d_rope=0,
    index_heads=32,
    index_rope=0,
    kpool=16,
    index_hadamard=False,
)
# One rank of tensor parallelism 8: the attention heads are split; the indexer is replicated, as in DeepSeek-V3.2's
# reference model, because every rank must select the same rows.
DEEPSEEK_V32_TP8 = replace(DEEPSEEK_V32, name="deepseek-v3.2-tp8", heads=16)
GLM_5_TP8 = replace(GLM_5, name="glm-5-tp8", heads=8)
GLM_53_FLASH_TP8 = replace(GLM_53_FLASH, name="glm-5.3-flash-tp8", heads=8)
CONFIGS = {c.name: c for c in (DEEPSEEK_V32, DEEPSEEK_V32_TP8, GLM_5, GLM_5_TP8, GLM_53_FLASH, GLM_53_FLASH_TP8)}


# ----------------------------------------------------------------------------------------------
# Plain-torch pieces of the projections.


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in float32, rounded once to bfloat16: ``[..., n]`` -> ``[..., n]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + NORM_EPS)
    return (xf * weight.float()).to(torch.bfloat16)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LayerNorm in float32, rounded once to bfloat16."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), NORM_EPS).to(torch.bfloat16)


def _rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, r/2]`` float32 of positions ``[T]`` and inverse frequencies ``[r/2]``."""
    angle = positions.float().unsqueeze(-1) * inv_freq  # [T, r/2]
    return angle.cos(), angle.sin()


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x [..., r]`` (MLA's interleaved layout)."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [..., r/2] each
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(torch.bfloat16)


def _rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[i], x[i + r/2])`` of ``x [..., r]`` (the indexer's non-interleaved layout)."""
    a, b = x.float().chunk(2, dim=-1)  # [..., r/2] each
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(torch.bfloat16)


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``[n, n]`` float32 (n a power of two)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h * n**-0.5


def _inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / dim)`` for i < dim / 2, float32 ``[dim / 2]``."""
    return (theta ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


class Projection(NamedTuple):
    """The dense projections of T tokens (everything the sparse part of the layer consumes)."""

    q: torch.Tensor  # [T, H, C + R] bfloat16: the absorbed latent query and its rotated RoPE part
    kv_c: torch.Tensor  # [T, C] bfloat16: the normalized latent row
    k_pe: torch.Tensor | None  # [T, R] bfloat16: the rotated RoPE tail (None when R = 0)
    index_q: torch.Tensor  # [T, Hi, D] bfloat16: the indexer's rotated query heads
    index_k: torch.Tensor  # [T, D] bfloat16: the indexer's rotated key
    index_w: torch.Tensor  # [T, Hi] float32: the indexer's raw head weights x W_w
    index_gate: torch.Tensor | None = None  # [T, D] bfloat16: the k-pool gate logits x W_gate (None: kpool 1)


def cat_projections(parts: Sequence[Projection]) -> Projection:
    """The projections of several token runs, concatenated in order."""
    return Projection(*(None if field[0] is None else torch.cat(field) for field in zip(*parts)))


# ----------------------------------------------------------------------------------------------
# Batches and caches.


class PrefillBatch(NamedTuple):
    """Per-token metadata of a prefill of several requests concatenated (all ``[T]`` int32)."""

    positions: torch.Tensor  # position of the token in its request
    request: torch.Tensor  # the token's request
    starts: torch.Tensor  # the token's first key column: its request's offset in the batch
    ends: torch.Tensor  # one past its last key column: starts + positions + 1 (causal)
    lengths: torch.Tensor  # the number of keys it sees: positions + 1


def prefill_batch(seq_lens: Sequence[int], device: torch.device | str = "cpu") -> PrefillBatch:
    """The metadata of a prefill of requests of ``seq_lens`` tokens, concatenated in order."""
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    request = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [T]
    offset = (torch.cumsum(lens, 0) - lens)[request]  # [T]
    positions = torch.arange(int(lens.sum())) - offset  # [T]
    fields = (positions, request, offset, offset + positions + 1, positions + 1)
    return PrefillBatch(*(f.to(device=device, dtype=torch.int32) for f in fields))


def slot_of(page_table: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """Pool slot ``[T]`` int64 of position ``positions[t]`` of request ``request[t]``: its page-table entry times the
    page size plus the offset in the page."""
    entry = page_table[request.long(), positions.long() // page]  # [T] int32
    return entry.long() * page + positions.long() % page


@dataclass
class PagedCache:
    """The two paged caches of a batch of requests, addressed through one page table.

    ``kv``: ``[P, page, row_bytes]`` uint8, the packed FP8 latent rows; ``index_k``: ``[P, page * (D + 4)]`` uint8,
    the FP8 indexer keys and their scales; ``page_table``: ``[B, max_pages]`` int32, request b's pages in order.
    With a k-pool indexer ``index_k`` holds one row per complete pool, pool p of a request at the slot of its position
    p (the first ``1 / kpool`` of its pages), and ``index_stage``: ``[P, page, 2, D]`` bfloat16 holds each token's
    index key and gate logits at the token's slot, from which a pool is compressed when its last token arrives.
    """

    kv: torch.Tensor
    index_k: torch.Tensor
    page_table: torch.Tensor
    page: int
    index_stage: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        config: DSAConfig,
        requests: int,
        max_len: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        poison: bool = True,
        spare_pages: int = 1,
    ) -> PagedCache:
        """Caches for ``requests`` requests of up to ``max_len`` tokens.

        The page table hands out a random permutation of the pages (``spare_pages`` of them belong to no request),
        so that nothing can lean on request b's pages being contiguous. With ``poison`` every byte starts as 0xFF:
        NaN FP8 values and NaN scales, so a read of any slot that was never written shows up as NaN.
        """
        max_pages = -(-max_len // config.page)
        pages = requests * max_pages + spare_pages
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))  # [P]
        table = order[: requests * max_pages].view(requests, max_pages).to(device=device, dtype=torch.int32)
        fill = 0xFF if poison else 0
        kv = torch.full((pages, config.page, config.layout.row_bytes), fill, dtype=torch.uint8, device=device)
        index_k = torch.full((pages, config.page * (config.index_dim + 4)), fill, dtype=torch.uint8, device=device)
        stage = None
        if config.kpool > 1:
            shape = (pages, config.page, 2, config.index_dim)
            stage = torch.full(shape, math.nan if poison else 0.0, dtype=torch.bfloat16, device=device)
        return cls(kv, index_k, table, config.page, stage)

    def slots(self, request: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[T]`` int64 of the tokens at ``positions`` of ``request`` (both ``[T]``)."""
        return slot_of(self.page_table, request, positions, self.page)


# ----------------------------------------------------------------------------------------------
# The layer.


class DSALayer(torch.nn.Module):
    """DeepSeek-V3.2-style sparse attention with random bfloat16 weights (no training, no autograd).

    Parameters
    ----------
    config : DSAConfig
    device : where the weights live
    seed : int
        The weights are drawn on the CPU from this seed, so they are the same on every device.
    """

    def __init__(self, config: DSAConfig, device: torch.device | str = "cpu", seed: int = 0) -> None:
        super().__init__()
        c = self.config = config
        if c.d_rope % 2 or c.index_rope % 2 or not 0 <= c.index_rope <= c.index_dim:
            raise ValueError(f"{c.name}: RoPE widths must be even and index_rope in [0, index_dim], got {c}")
        if c.kpool < 1 or c.topk % c.kpool:
            raise ValueError(f"{c.name}: kpool must be >= 1 and divide the top-k {c.topk}, got {c.kpool}")
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * fan_in**-0.5).to(torch.bfloat16)

        def norm_weight(n: int) -> torch.Tensor:
            return (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

        buffers = {
            "wq_a": weight(c.q_lora, c.hidden, fan_in=c.hidden),  # [q_lora, hidden]
            "q_norm": norm_weight(c.q_lora),
            "wq_b": weight(c.heads * (c.qk_nope + c.d_rope), c.q_lora, fan_in=c.q_lora),  # [H (nope + R), q_lora]
            "wkv_a": weight(c.kv_lora + c.d_rope, c.hidden, fan_in=c.hidden),  # [C + R, hidden]
            "kv_norm": norm_weight(c.kv_lora),
            "w_uk": weight(c.heads, c.qk_nope, c.kv_lora, fan_in=c.qk_nope),  # [H, nope, C]: absorbed into q
            "w_uv": weight(c.heads, c.v_head, c.kv_lora, fan_in=c.kv_lora),  # [H, v, C]: applied to the output
            "wo": weight(c.hidden, c.heads * c.v_head, fan_in=c.heads * c.v_head),  # [hidden, H v]
            "wi_q": weight(c.index_heads * c.index_dim, c.q_lora, fan_in=c.q_lora),  # [Hi D, q_lora]
            "wi_k": weight(c.index_dim, c.hidden, fan_in=c.hidden),  # [D, hidden]
            "ki_norm_w": norm_weight(c.index_dim),
            "ki_norm_b": (0.1 * torch.randn(c.index_dim, generator=gen)).to(torch.bfloat16),
            "wi_w": weight(c.index_heads, c.hidden, fan_in=c.hidden),  # [Hi, hidden]
            "hadamard": _hadamard(c.index_dim),  # [D, D] float32
            "index_freq": _inv_freq(max(c.index_rope, 2), c.rope_theta),  # [index_rope / 2] (unused without RoPE)
        }
        if c.d_rope:
            buffers["mla_freq"] = _inv_freq(c.d_rope, c.rope_theta)  # [R / 2]
        if c.kpool > 1:
            buffers["wi_gate"] = weight(c.index_dim, c.hidden, fan_in=c.hidden)  # [D, hidden]: the pool gate
            buffers["ape"] = (0.5 * torch.randn(c.kpool, c.index_dim, generator=gen)).to(torch.bfloat16)  # [kpool, D]
        for name, value in buffers.items():
            self.register_buffer(name, value.to(device), persistent=False)

    # -- dense parts ------------------------------------------------------------------------

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projection:
        """The dense projections of tokens ``x [T, hidden]`` bfloat16 at ``positions [T]`` int32."""
        c = self.config
        t = x.shape[0]
        q_lat = _rms_norm(F.linear(x, self.wq_a), self.q_norm)  # [T, q_lora]
        q = F.linear(q_lat, self.wq_b).view(t, c.heads, c.qk_nope + c.d_rope)  # [T, H, nope + R]
        kv = F.linear(x, self.wkv_a)  # [T, C + R]
        kv_c = _rms_norm(kv[:, : c.kv_lora], self.kv_norm)  # [T, C]
        q_latent = torch.einsum("thd,hdc->thc", q[..., : c.qk_nope], self.w_uk)  # [T, H, C]: q_nope W_UK
        k_pe = None
        if c.d_rope:
            cos, sin = _rope_angles(positions, self.mla_freq)  # [T, R/2]
            q_pe = _rope_pairs(q[..., c.qk_nope :], cos.unsqueeze(1), sin.unsqueeze(1))  # [T, H, R]
            q_latent = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, C + R]
            k_pe = _rope_pairs(kv[:, c.kv_lora :], cos, sin)  # [T, R]

        r = c.index_rope
        qi = F.linear(q_lat, self.wi_q).view(t, c.index_heads, c.index_dim)  # [T, Hi, D]
        ki = _layer_norm(F.linear(x, self.wi_k), self.ki_norm_w, self.ki_norm_b)  # [T, D]
        if r:
            cos, sin = _rope_angles(positions, self.index_freq)  # [T, r/2]
            qi = torch.cat((_rope_halves(qi[..., :r], cos.unsqueeze(1), sin.unsqueeze(1)), qi[..., r:]), dim=-1)
            ki = torch.cat((_rope_halves(ki[:, :r], cos, sin), ki[:, r:]), dim=-1)
        if c.index_hadamard:
            # the Hadamard rotation spreads outlier dims over the row before the per-row FP8 scale is taken
            qi = (qi.float() @ self.hadamard).to(torch.bfloat16)  # [T, Hi, D]
            ki = (ki.float() @ self.hadamard).to(torch.bfloat16)  # [T, D]
        index_w = F.linear(x, self.wi_w).float()  # [T, Hi]
        gate = F.linear(x, self.wi_gate) if c.kpool > 1 else None  # [T, D] bfloat16
        return Projection(q_latent.contiguous(), kv_c, k_pe, qi, ki, index_w, gate)

    def index_query(self, proj: Projection) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's FP8 queries ``[T, Hi, D]`` and head weights ``[T, Hi]`` float32, q's scale folded in."""
        q8, q_scale = dsa.quant_index(proj.index_q, self.config.index_round_scale)  # [T, Hi, D], [T, Hi]
        return q8, proj.index_w * q_scale * self.config.index_weight_scale

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """``o_latent [T, H, C]`` bfloat16 through W_UV and the output projection -> ``[T, hidden]`` bfloat16."""
        o = torch.einsum("thc,hvc->thv", o_latent, self.w_uv)  # [T, H, v]
        return F.linear(o.flatten(1), self.wo)  # [T, hidden]

    def store(self, proj: Projection, slots: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Write the tokens' latent rows and indexer keys into slots ``[T]`` of both caches (negative: skipped)."""
        c = self.config
        dsa.store_k_cache(proj.kv_c, proj.k_pe, kv, slots, c.kv_round_scale)
        dsa.store_index_k(proj.index_k, index_k, slots, c.index_round_scale)

    def store_pools(
        self,
        proj: Projection,
        request: torch.Tensor,
        positions: torch.Tensor,
        index_k: torch.Tensor,
        index_stage: torch.Tensor,
        page_table: torch.Tensor,
    ) -> None:
        """K-pool indexer: stage the tokens' index keys and gates at their slots, then compress and store the pool
        that each token completes (``kpool_store_index_k``; -1 for a token that completes none). Every token is a
        pool's possible last one, so prefill and decode share this path and no host sync picks the pools."""
        c = self.config
        stage = index_stage.view(-1, 2, c.index_dim)  # [S, 2, D]
        stage[slot_of(page_table, request, positions, c.page)] = torch.stack((proj.index_k, proj.index_gate), dim=1)
        window = positions.long().unsqueeze(-1) - (c.kpool - 1) + torch.arange(c.kpool, device=positions.device)
        members = slot_of(page_table, request.unsqueeze(-1).expand_as(window), window.clamp_min(0), c.page)
        staged = stage[members]  # [T, kpool, 2, D]: the kpool tokens ending at each token
        complete = (positions + 1) % c.kpool == 0  # [T]
        loc = torch.where(complete, slot_of(page_table, request, positions // c.kpool, c.page), -1)  # [T]
        dsa.kpool_store_index_k(staged[:, :, 0], staged[:, :, 1], self.ape, index_k, loc, c.index_round_scale)

    def select(
        self,
        q8: torch.Tensor,
        weights: torch.Tensor,
        lengths: torch.Tensor,
        index_k: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """The selected slots ``[T, K]`` int32 of tokens that see ``lengths [T]`` positions of the requests whose
        page-table rows are ``table [T, max_pages]`` (one row per token): the indexer's logits over the paged
        index-K cache, then ``topk`` (single tokens) or ``kpool_topk`` (pools, expanded, and the tail)."""
        c = self.config
        seen = torch.div(lengths, c.kpool, rounding_mode="floor")  # [T] complete pools (tokens when kpool is 1)
        logits = dsa.paged_index_logits(q8.unsqueeze(1), index_k, weights, seen, table)  # [T, W]
        if c.kpool == 1:
            return dsa.topk(logits, lengths, c.topk, page_table=table, page_size=c.page, out_width=c.topk_width)
        return dsa.kpool_topk(
            logits, lengths, c.pool_topk, c.kpool, page_table=table, page_size=c.page, out_width=c.topk_width
        )

    # -- forward passes ---------------------------------------------------------------------

    def prefill(self, x: torch.Tensor, batch: PrefillBatch, cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill requests from their start: ``x [T, hidden]`` bfloat16, their tokens concatenated.

        Writes every token into ``cache`` and returns ``y [T, hidden]`` bfloat16 and the selected slots
        ``[T, K]`` int32 (the positions of the request chosen by the indexer, as pool slots, -1 padded).
        """
        c = self.config
        proj = self.project(x, batch.positions)
        slots = cache.slots(batch.request, batch.positions)  # [T]
        if c.kpool > 1:  # pools: each token scores its request's pools over the paged cache of pool rows
            dsa.store_k_cache(proj.kv_c, proj.k_pe, cache.kv, slots, c.kv_round_scale)
            self.store_pools(proj, batch.request, batch.positions, cache.index_k, cache.index_stage, cache.page_table)
            q8, weights = self.index_query(proj)  # [T, Hi, D], [T, Hi]
            table = cache.page_table[batch.request.long()]  # [T, max_pages]: each token's request's pages
            indices = self.select(q8, weights, batch.lengths, cache.index_k, table)  # [T, K] slots
            o_latent, _ = dsa.sparse_attn(proj.q, cache.kv, indices, c.sm_scale, c.kv_lora)  # [T, H, C]
            return self.output(o_latent), indices
        self.store(proj, slots, cache.kv, cache.index_k)
        q8, weights = self.index_query(proj)  # [T, Hi, D], [T, Hi]
        k8, k_scale = dsa.gather_index_k(cache.index_k, slots, c.index_dim)  # [T, D], [T]: the batch's keys
        logits = dsa.index_logits(q8, k8, k_scale, weights, batch.starts, batch.ends)  # [T, T]
        indices = dsa.topk(
            logits, batch.lengths, c.topk, batch.starts, cache.page_table, batch.request, c.page, c.topk_width
        )  # [T, K] slots
        o_latent, _ = dsa.sparse_attn(proj.q, cache.kv, indices, c.sm_scale, c.kv_lora)  # [T, H, C]
        return self.output(o_latent), indices

    def decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        index_k: torch.Tensor,
        page_table: torch.Tensor,
        index_stage: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per request: ``x [B, hidden]`` bfloat16 at ``positions [B]`` int32 of its request.

        The caches (``kv``, ``index_k``, ``page_table``, and ``index_stage`` with a k-pool indexer, as in
        :class:`PagedCache`) are arguments, not attributes,
        so that ``torch.compile`` sees their in-place writes. Writes the tokens, then each token attends to its
        request's positions ``0 .. positions[b]``. Returns ``y [B, hidden]`` bfloat16 and the selected slots
        ``[B, K]`` int32. Free of host syncs: it can be captured in a CUDA graph.
        """
        c = self.config
        proj = self.project(x, positions)
        request = torch.arange(x.shape[0], device=x.device)  # [B]
        slots = slot_of(page_table, request, positions, c.page)  # [B]
        if c.kpool > 1:
            dsa.store_k_cache(proj.kv_c, proj.k_pe, kv, slots, c.kv_round_scale)
            self.store_pools(proj, request, positions, index_k, index_stage, page_table)
        else:
            self.store(proj, slots, kv, index_k)
        q8, weights = self.index_query(proj)  # [B, Hi, D], [B, Hi]
        lengths = positions + 1  # [B] int32: the new token sees itself
        indices = self.select(q8, weights, lengths, index_k, page_table)  # [B, K] slots
        o_latent, _ = dsa.sparse_attn(proj.q, kv, indices, c.sm_scale, c.kv_lora)  # [B, H, C]
        return self.output(o_latent), indices


class DecodeStep:
    """:meth:`DSALayer.decode` compiled with ``torch.compile(fullgraph=True)`` over static input buffers, and on a
    GPU captured once in a CUDA graph and replayed.

    Parameters
    ----------
    layer : DSALayer
    cache : PagedCache
        Its page table fixes the batch B (one token per request).
    backend : str
        ``torch.compile``'s backend: "inductor" on a GPU; "aot_eager" checks the same full graph (fake kernels,
        functionalized cache writes) on a CPU without generating code.
    cuda_graph : bool or None
        Capture and replay a CUDA graph (default: when the cache is on a GPU).

    Calling it copies the new tokens into the static buffers ``x [B, hidden]`` and ``positions [B]`` in place and
    runs the step. The first call on a GPU warms up on a side stream and captures; later calls replay. The results
    are the graph's static outputs, overwritten by the next call: clone what must outlive it.
    """

    def __init__(
        self,
        layer: DSALayer,
        cache: PagedCache,
        backend: str = "inductor",
        cuda_graph: bool | None = None,
        warmup_runs: int = 2,
    ) -> None:
        device = cache.kv.device
        batch = cache.page_table.shape[0]
        self.layer, self.cache, self.warmup_runs = layer, cache, warmup_runs
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        self.x = torch.zeros(batch, layer.config.hidden, dtype=torch.bfloat16, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=device)
        self.compiled = torch.compile(layer.decode, fullgraph=True, backend=backend)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        return self.compiled(self.x, self.positions, c.kv, c.index_k, c.page_table, c.index_stage)

    def _capture(self) -> None:
        # Warm-up runs write the current tokens into the caches; the replay that follows writes the same bytes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self._run()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step on new tokens ``x [B, hidden]`` bfloat16 at ``positions [B]`` int32 -> ``(y, indices)``."""
        self.x.copy_(x)
        self.positions.copy_(positions)
        if not self.cuda_graph:
            return self._run()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.outputs


# ----------------------------------------------------------------------------------------------
# The dense twin: the same layer in plain torch, every score computed.


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= scale`` (positive float32): scale = m 2^e with m in [0.5, 1)."""
    mantissa, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))


def quantize_index_rows(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's FP8 rows of ``x [..., D]`` bfloat16 as float32 values ``[..., D]`` and scales ``[...]``."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(INDEX_SCALE_MIN) / FP8_MAX  # [...]
    if round_scale:
        scale = _pow2_ceil(scale)
    values = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # [..., D]
    return values, scale


def dequantized_latent_rows(kv_c: torch.Tensor, k_pe: torch.Tensor | None, round_scale: bool) -> torch.Tensor:
    """The latent rows as the packed FP8 pool holds them, dequantized: ``[n, C]`` (+ ``[n, R]``) -> ``[n, C + R]``
    float32 of bfloat16 values (one FP8 scale per 128 latent values; the RoPE tail as it was)."""
    tiles = kv_c.float().unflatten(-1, (-1, KV_TILE))  # [n, C / 128, 128]
    scale = tiles.abs().amax(dim=-1) / FP8_MAX  # [n, C / 128]
    scale = torch.where(scale == 0, 1.0, scale)
    if round_scale:
        scale = _pow2_ceil(scale)
    values = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    rows = (values * scale.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)  # [n, C]
    if k_pe is not None:
        rows = torch.cat((rows, k_pe), dim=-1)  # [n, C + R]
    return rows.float()


def _twin_pool_keys(layer: DSALayer, proj: Projection) -> torch.Tensor:
    """The keys ``[n // kpool, D]`` bfloat16 of the complete pools of one request's tokens, as the model computes
    them: per channel, the softmax over the pool's tokens of gate + ape (float32, rounded to bfloat16), times the
    tokens' keys (bfloat16 products), summed."""
    c = layer.config
    pools = proj.index_k.shape[0] // c.kpool
    keys = proj.index_k[: pools * c.kpool].view(pools, c.kpool, c.index_dim)  # [n / kpool, kpool, D]
    gate = proj.index_gate[: pools * c.kpool].view(pools, c.kpool, c.index_dim)
    weights = (gate.float() + layer.ape.float()).softmax(dim=1).to(torch.bfloat16)  # [n / kpool, kpool, D]
    return (weights * keys).sum(dim=1)  # [n / kpool, D]


def _twin_token_selection(c: DSAConfig, logits: torch.Tensor, qs: torch.Tensor, n: int) -> tuple:
    """Per-token selection of queries ``qs [q]`` from their logits ``[q, n]``: the k best in the order (logit
    descending, position ascending) that ``topk`` keeps. Returns positions ``[q, K]`` (ascending, then -1), the logits
    with -inf past each query, and the selected mask ``[q, n]``."""
    device = logits.device
    column = torch.arange(n, device=device)  # [n]
    take = min(c.topk, n)
    logits = torch.where(column <= qs.unsqueeze(-1), logits, -math.inf)  # [q, n]
    logits = torch.where(logits == 0, 0.0, logits)  # -0 ranks equal to +0
    best = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :take]  # [q, k]: ties, lower first
    chosen = torch.arange(take, device=device) < (qs + 1).unsqueeze(-1)  # [q, k]
    picked = torch.where(chosen, best, n).sort(dim=1).values  # [q, k] ascending, unchosen last
    padded = torch.full((qs.shape[0], c.topk_width), -1, dtype=torch.int64, device=device)
    padded[:, :take] = torch.where(chosen, picked, -1)
    selected = torch.zeros(qs.shape[0], n + 1, dtype=torch.bool, device=device)  # column n: not chosen
    selected = selected.scatter_(1, torch.where(chosen, best, n), True)[:, :n]  # [q, n]
    return padded, logits, selected


def _twin_pool_selection(c: DSAConfig, pool_logits: torch.Tensor, qs: torch.Tensor, n: int) -> tuple:
    """K-pool selection of queries ``qs [q]`` from their pool logits ``[q, n / kpool]``: query i sees
    ``(qs[i] + 1) // kpool`` complete pools; the best ``pool_topk`` (ties: lower pool) give their tokens, and the
    tokens of its incomplete pool follow. Returns positions ``[q, K]``, the token logits ``[q, n]`` (a token's pool's
    logit, +inf for the tail, which is always selected, -inf elsewhere) and the selected mask ``[q, n]``."""
    device, kp = pool_logits.device, c.kpool
    pools = pool_logits.shape[1]
    complete = ((qs + 1) // kp).unsqueeze(-1)  # [q, 1] pools each query sees
    pool_logits = torch.where(torch.arange(pools, device=device) < complete, pool_logits, -math.inf)
    pool_logits = torch.where(pool_logits == 0, 0.0, pool_logits)  # -0 ranks equal to +0
    take = min(c.pool_topk, pools)
    best = torch.sort(pool_logits, dim=1, descending=True, stable=True).indices[:, :take]  # [q, k]
    chosen = torch.arange(take, device=device) < complete  # [q, k]
    picked = torch.zeros(qs.shape[0], pools + 1, dtype=torch.bool, device=device)  # column pools: not chosen
    picked = picked.scatter_(1, torch.where(chosen, best, pools), True)  # [q, pools + 1]
    picked[:, pools] = False  # where the unchosen entries landed
    column = torch.arange(n, device=device)  # [n]
    pool_of = torch.where(column < pools * kp, column // kp, pools)  # [n]: a token's pool (pools: none)
    tail = (column >= complete * kp) & (column <= qs.unsqueeze(-1))  # [q, n]
    selected = picked[:, pool_of] | tail  # [q, n]
    extended = torch.cat((pool_logits, torch.full_like(pool_logits[:, :1], -math.inf)), dim=1)  # [q, pools + 1]
    logits = torch.where(tail, math.inf, extended[:, pool_of])  # [q, n]
    ordered = torch.where(selected, column, n).sort(dim=1).values  # [q, n] ascending, unselected last
    padded = torch.full((qs.shape[0], c.topk_width), -1, dtype=torch.int64, device=device)
    width = min(n, c.topk_width)
    padded[:, :width] = torch.where(ordered[:, :width] < n, ordered[:, :width], -1)
    return padded, logits, selected


def dense_reference(
    layer: DSALayer, proj: Projection, queries: torch.Tensor, attend_to: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer for queries of one request, computed densely in plain torch.

    Parameters
    ----------
    layer : DSALayer
        Its weights (through :meth:`DSALayer.output`) and geometry.
    proj : Projection
        The projections of the request's tokens 0 .. n-1, in position order.
    queries : [q] int64
        Positions of the query tokens; query i sees positions ``0 .. queries[i]``.
    attend_to : [q, K] int64 or None
        Positions to attend to instead of the twin's own selection (ascending, then -1): the output of a layer whose
        selection swapped two neighbours at the k-th place is then checked on the rows it did select.

    Returns
    -------
    positions : [q, K] int64
        The selected positions in ascending order, then -1: the k best of the full float32 logits in the order
        (logit descending, position ascending) that ``topk`` keeps.
    logits : [q, n] float32
        The indexer's logits from the same FP8 values of q and k, ``-inf`` past each query.
    y : [q, hidden] bfloat16
        Softmax over the selected rows (or ``attend_to``'s) of the dequantized latent cache, then W_UV and the
        output projection.
    """
    c = layer.config
    n = proj.kv_c.shape[0]
    if c.kpool > 1:  # the index keys are those of the complete pools
        k8, k_scale = quantize_index_rows(_twin_pool_keys(layer, proj), c.index_round_scale)  # [n / kpool, D]
    else:
        k8, k_scale = quantize_index_rows(proj.index_k, c.index_round_scale)  # [n, D], [n]
    rows = dequantized_latent_rows(proj.kv_c, proj.k_pe, c.kv_round_scale)  # [n, C + R]
    chunk = max(1, DENSE_CHUNK_BYTES // (8 * n * max(c.heads, c.index_heads)))
    positions, logits_out, y = [], [], []
    for q0 in range(0, queries.shape[0], chunk):
        qs = queries[q0 : q0 + chunk].long()  # [q]
        q8, q_scale = quantize_index_rows(proj.index_q[qs], c.index_round_scale)  # [q, Hi, D], [q, Hi]
        weights = proj.index_w[qs] * q_scale * c.index_weight_scale  # [q, Hi]
        scores = torch.einsum("qhd,nd->qhn", q8, k8).relu()  # [q, Hi, n] (or [q, Hi, n / kpool] pools)
        logits = torch.einsum("qhn,qh->qn", scores, weights) * k_scale  # [q, n] (or [q, n / kpool])
        select = _twin_pool_selection if c.kpool > 1 else _twin_token_selection
        padded, logits, selected = select(c, logits, qs, n)  # [q, K], [q, n], [q, n]
        if attend_to is not None:
            given = attend_to[q0 : q0 + chunk].long()  # [q, K]
            given = torch.where((given >= 0) & (given < n), given, n)
            selected = torch.zeros(qs.shape[0], n + 1, dtype=torch.bool, device=rows.device)
            selected = selected.scatter_(1, given, True)[:, :n]  # [q, n]

        att = torch.einsum("qhc,nc->qhn", proj.q[qs].float(), rows) * c.sm_scale  # [q, H, n]
        att = att.masked_fill(~selected.unsqueeze(1), -math.inf).softmax(dim=-1)  # [q, H, n]
        o_latent = torch.einsum("qhn,nc->qhc", att, rows[:, : c.kv_lora]).to(torch.bfloat16)  # [q, H, C]
        positions.append(padded)
        logits_out.append(logits)
        y.append(layer.output(o_latent))
    return torch.cat(positions), torch.cat(logits_out), torch.cat(y)


# ----------------------------------------------------------------------------------------------
# Timing, stage by stage.

Stage = tuple[str, Callable[[dict], None]]


def decode_stages(layer: DSALayer, cache: PagedCache) -> list[Stage]:
    """:meth:`DSALayer.decode` as named stages over an environment dict holding ``x`` and ``positions``; each stage
    reads what the ones before it left there. The last leaves ``y`` and ``indices``."""
    c = layer.config

    def project(e):
        e["proj"] = layer.project(e["x"], e["positions"])
        request = torch.arange(e["x"].shape[0], device=e["x"].device)
        e["slots"] = slot_of(cache.page_table, request, e["positions"], c.page)
        e["lengths"] = e["positions"] + 1

    def request_tables(e):
        e["request"] = torch.arange(e["x"].shape[0], device=e["x"].device)
        e["tables"] = cache.page_table

    return [
        ("project", project),
        *_store_stages(layer, cache, request_tables),
        ("quant_index", _quant_index_stage(layer)),
        *_select_stages(layer, cache, request_tables),
        *_attend_stages(layer, cache),
    ]


def prefill_stages(layer: DSALayer, cache: PagedCache, batch: PrefillBatch) -> list[Stage]:
    """:meth:`DSALayer.prefill` as named stages over an environment dict holding ``x`` (see :func:`decode_stages`)."""
    c = layer.config

    def project(e):
        e["proj"] = layer.project(e["x"], batch.positions)
        e["slots"] = cache.slots(batch.request, batch.positions)
        e["positions"], e["lengths"] = batch.positions, batch.lengths

    def gather_index_k(e):
        e["k8"], e["k_scale"] = dsa.gather_index_k(cache.index_k, e["slots"], c.index_dim)

    def index_logits(e):
        e["logits"] = dsa.index_logits(e["q8"], e["k8"], e["k_scale"], e["weights"], batch.starts, batch.ends)

    def topk(e):
        e["indices"] = dsa.topk(
            e["logits"], batch.lengths, c.topk, batch.starts, cache.page_table, batch.request, c.page, c.topk_width
        )

    def request_tables(e):
        e["request"] = batch.request
        e["tables"] = cache.page_table[batch.request.long()]  # each token's request's pages

    if c.kpool > 1:  # pools: each token scores its request's pools over the paged cache of pool rows
        selection = _select_stages(layer, cache, request_tables)
    else:
        selection = [("gather_index_k", gather_index_k), ("index_logits", index_logits), ("topk", topk)]
    return [
        ("project", project),
        *_store_stages(layer, cache, request_tables),
        ("quant_index", _quant_index_stage(layer)),
        *selection,
        *_attend_stages(layer, cache),
    ]


def _store_stages(layer: DSALayer, cache: PagedCache, request_tables: Callable) -> list[Stage]:
    """The cache writes; with a k-pool indexer, ``request_tables`` (the stage that names each token's request)
    runs first, and the index keys are staged and compressed into pools (:meth:`DSALayer.store_pools`)."""
    c = layer.config

    def store_k_cache(e):
        dsa.store_k_cache(e["proj"].kv_c, e["proj"].k_pe, cache.kv, e["slots"], c.kv_round_scale)

    def store_index_k(e):
        dsa.store_index_k(e["proj"].index_k, cache.index_k, e["slots"], c.index_round_scale)

    def kpool_store_index_k(e):
        request_tables(e)
        layer.store_pools(e["proj"], e["request"], e["positions"], cache.index_k, cache.index_stage, cache.page_table)

    if c.kpool > 1:
        return [("store_k_cache", store_k_cache), ("kpool_store_index_k", kpool_store_index_k)]
    return [("store_k_cache", store_k_cache), ("store_index_k", store_index_k)]


def _select_stages(layer: DSALayer, cache: PagedCache, request_tables: Callable) -> list[Stage]:
    """:meth:`DSALayer.select` as two stages: the indexer's paged logits, then ``topk`` or ``kpool_topk``."""
    c = layer.config

    def paged_index_logits(e):
        request_tables(e)
        seen = torch.div(e["lengths"], c.kpool, rounding_mode="floor")
        e["logits"] = dsa.paged_index_logits(e["q8"].unsqueeze(1), cache.index_k, e["weights"], seen, e["tables"])

    def topk(e):
        e["indices"] = dsa.topk(
            e["logits"], e["lengths"], c.topk, page_table=e["tables"], page_size=c.page, out_width=c.topk_width
        )

    def kpool_topk(e):
        e["indices"] = dsa.kpool_topk(
            e["logits"],
            e["lengths"],
            c.pool_topk,
            c.kpool,
            page_table=e["tables"],
            page_size=c.page,
            out_width=c.topk_width,
        )

    return [("paged_index_logits", paged_index_logits), ("kpool_topk", kpool_topk) if c.kpool > 1 else ("topk", topk)]


def _quant_index_stage(layer: DSALayer) -> Callable[[dict], None]:
    def quant_index(e):
        e["q8"], e["weights"] = layer.index_query(e["proj"])

    return quant_index


def _attend_stages(layer: DSALayer, cache: PagedCache) -> list[Stage]:
    c = layer.config

    def sparse_attn(e):
        e["o_latent"], _ = dsa.sparse_attn(e["proj"].q, cache.kv, e["indices"], c.sm_scale, c.kv_lora)

    def output(e):
        e["y"] = layer.output(e["o_latent"])

    return [("sparse_attn", sparse_attn), ("output", output)]


def run_stages(stages: Sequence[Stage], env: dict) -> dict:
    """Run ``stages`` in order on ``env`` (in place) and return it."""
    for _, stage in stages:
        stage(env)
    return env


def _time_stages(stages: Sequence[Stage], env: dict, iters: int, warmup: int, graphs: bool) -> dict[str, float]:
    """Median microseconds of each stage, and of the whole sequence as one CUDA graph (``"layer"``)."""
    for _ in range(warmup):  # compiles every kernel the stages use, outside any capture
        run_stages(stages, env)
    torch.cuda.synchronize()
    if graphs:
        runs = []
        for _, stage in stages:  # one graph per stage; each reads the outputs the previous stage's graph owns
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                stage(env)
            runs.append(g.replay)
        whole = torch.cuda.CUDAGraph()
        with torch.cuda.graph(whole):
            run_stages(stages, env)
        layer_run = whole.replay
    else:
        runs = [lambda stage=stage: stage(env) for _, stage in stages]

        def layer_run():
            run_stages(stages, env)

    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(len(runs) + 1)] for _ in range(iters)]
    ends = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(BENCH_QUEUE_CYCLES)  # the host queues the replays while the GPU sleeps: no launch gaps timed
    for ev in marks:
        ev[0].record()
        for run, mark in zip(runs, ev[1:]):
            run()
            mark.record()
    for begin, end in ends:
        begin.record()
        layer_run()
        end.record()
    torch.cuda.synchronize()
    us = {
        name: 1e3 * statistics.median(ev[i].elapsed_time(ev[i + 1]) for ev in marks)
        for i, (name, _) in enumerate(stages)
    }
    us["total"] = sum(us.values())
    us["layer"] = 1e3 * statistics.median(b.elapsed_time(e) for b, e in ends)
    return us


def _fill_cache(layer: DSALayer, cache: PagedCache, length: int, seed: int) -> None:
    """Write random rows into positions ``0 .. length-1`` of every request of ``cache``."""
    c = layer.config
    device = cache.kv.device
    gen = torch.Generator(device=device).manual_seed(seed)
    requests = cache.page_table.shape[0]
    request = torch.arange(requests, device=device).repeat_interleave(length)  # [B * length]
    positions = torch.arange(length, device=device).repeat(requests)  # [B * length]

    def rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen, device=device).to(torch.bfloat16)

    for r0 in range(0, request.shape[0], FILL_CHUNK_ROWS):
        slots = cache.slots(request[r0 : r0 + FILL_CHUNK_ROWS], positions[r0 : r0 + FILL_CHUNK_ROWS])
        n = slots.shape[0]
        k_pe = rows(n, c.d_rope) if c.d_rope else None
        dsa.store_k_cache(rows(n, c.kv_lora), k_pe, cache.kv, slots, c.kv_round_scale)
        dsa.store_index_k(rows(n, c.index_dim), cache.index_k, slots, c.index_round_scale)  # (pool rows: p < length)
        if cache.index_stage is not None:
            cache.index_stage.view(-1, 2, c.index_dim)[slots] = rows(n, 2 * c.index_dim).view(n, 2, c.index_dim)


def bench_layer(
    config: DSAConfig,
    *,
    decode_batch: int = 64,
    decode_context: int = 32768,
    prefill_tokens: int = 8192,
    iters: int = 20,
    warmup: int = 2,
    graphs: bool = True,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Time one decode step and one prefill of the layer on the current GPU, stage by stage.

    The decode step: ``decode_batch`` requests, each with ``decode_context - 1`` cached tokens (random rows) and
    one new token, so each new token's indexer scores ``decode_context`` positions. The prefill: one request of
    ``prefill_tokens`` tokens from an empty cache (causal). Each stage — ``project`` (every dense projection, norm,
    RoPE and the Hadamard rotation), ``store_k_cache``, ``store_index_k``, ``quant_index``, ``paged_index_logits`` or
    ``gather_index_k`` + ``index_logits``, ``topk``, ``sparse_attn``, ``output`` (W_UV and the output projection) — is
    captured in its own CUDA graph (``graphs=True``; eager launches otherwise) and timed with CUDA events around its
    replay; the replays are queued behind a GPU sleep so no host launch gap is timed.

    Returns
    -------
    {"decode": {stage: us, ..., "total": us, "layer": us}, "prefill": {...}}
        Median microseconds over ``iters`` runs. ``total`` is the sum of the stages (a stage's share is
        ``us[stage] / us["total"]``); ``layer`` is the whole step captured as one graph.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    layer = DSALayer(config, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    results = {}

    cache = PagedCache.allocate(config, decode_batch, decode_context, device, seed, poison=False)
    _fill_cache(layer, cache, decode_context - 1, seed + 2)
    env = {
        "x": torch.randn(decode_batch, config.hidden, generator=gen, device=device).to(torch.bfloat16),
        "positions": torch.full((decode_batch,), decode_context - 1, dtype=torch.int32, device=device),
    }
    results["decode"] = _time_stages(decode_stages(layer, cache), env, iters, warmup, graphs)
    del cache, env

    cache = PagedCache.allocate(config, 1, prefill_tokens, device, seed, poison=False)
    batch = prefill_batch([prefill_tokens], device)
    env = {"x": torch.randn(prefill_tokens, config.hidden, generator=gen, device=device).to(torch.bfloat16)}
    results["prefill"] = _time_stages(prefill_stages(layer, cache, batch), env, iters, warmup, graphs)
    return results


def warm_up(config: DSAConfig) -> None:
    """Compile every kernel the layer of ``config`` runs, in parallel (one after another they take minutes)."""
    dsa.warmup(
        heads=config.heads,
        d_nope=config.kv_lora,
        d_rope=config.d_rope,
        sm_scale=config.sm_scale,
        kv_kinds=("packed",),
        topk_length=(False,),
        index_heads=config.index_heads,
        index_dim=config.index_dim,
        index_page=config.page,
        topk_k=config.pool_topk,
        workers=16,
    )


def cpu_size(config: DSAConfig) -> DSAConfig:
    """``config`` at a size a CPU runs in seconds: 4 heads and 4 indexer heads, narrow dense projections and a top-k
    of 48; the latent rows (512 + 64 or 512 + 0), the indexer head dim and the k-pool stay the model's."""
    return replace(
        config,
        name=f"{config.name}-cpu",
        hidden=256,
        heads=4,
        q_lora=128,
        qk_nope=32,
        v_head=32,
        index_heads=4,
        index_topk=48,
    )


def run_on_cpu(config: DSAConfig, seq_lens: Sequence[int] = (120, 29, 77), decode_steps: int = 2) -> float:
    """Prefill requests of ``seq_lens`` tokens through the layer of ``config`` on the CPU, then run ``decode_steps``
    eager decode steps; every request's outputs are recomputed by :func:`dense_reference`. Returns the largest error
    of an output relative to the largest ``|y|`` of its request's dense twin."""
    device = torch.device("cpu")
    layer = DSALayer(config, device, seed=1)
    cache = PagedCache.allocate(config, len(seq_lens), max(seq_lens) + decode_steps, device, seed=2)
    gen = torch.Generator().manual_seed(3)
    worst = 0.0

    def check(history: list[Projection], queries: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal worst
        _, _, want = dense_reference(layer, cat_projections(history), queries.long())
        worst = max(worst, ((y.float() - want.float()).abs().max() / want.float().abs().max()).item())

    x = torch.randn(sum(seq_lens), config.hidden, generator=gen).to(torch.bfloat16)
    batch = prefill_batch(seq_lens, device)
    y, _ = layer.prefill(x, batch, cache)
    proj = layer.project(x, batch.positions)
    history = []
    for rows in torch.arange(x.shape[0]).split(list(seq_lens)):
        history.append([Projection(*(None if f is None else f[rows] for f in proj))])
        check(history[-1], batch.positions[rows], y[rows])
    positions = torch.tensor(seq_lens, dtype=torch.int32)
    for _ in range(decode_steps):
        x = torch.randn(len(seq_lens), config.hidden, generator=gen).to(torch.bfloat16)
        y, _ = layer.decode(x, positions, cache.kv, cache.index_k, cache.page_table, cache.index_stage)
        proj = layer.project(x, positions)
        for b in range(len(seq_lens)):
            history[b].append(Projection(*(None if f is None else f[b : b + 1] for f in proj)))
            check(history[b], positions[b : b + 1], y[b : b + 1])
        positions += 1
    return worst


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m examples.dsa_layer [--config NAME ...]``: print :func:`bench_layer`'s table per config; without a
    GPU, run each config at CPU size against the dense twin instead."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: every config")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=32768)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU: each config runs at CPU size (4 heads, top-k 48, its own latent rows) instead of timed.")
        for name in args.config or sorted(CONFIGS):
            c = cpu_size(CONFIGS[name])
            err = run_on_cpu(c)
            print(
                f"{name}: prefill of 3 requests, 2 decode steps, {c.kv_lora}+{c.d_rope} latent rows: outputs within "
                f"{err:.1e} of max |y| of the dense plain-torch layer"
            )
        return
    for name in args.config or sorted(CONFIGS):
        warm_up(CONFIGS[name])
        figures = bench_layer(
            CONFIGS[name],
            decode_batch=args.decode_batch,
            decode_context=args.decode_context,
            prefill_tokens=args.prefill_tokens,
            iters=args.iters,
        )
        for phase, us in figures.items():
            print(f"{name} {phase}: layer {us['layer']:.1f} us, stages {us['total']:.1f} us")
            for stage, t in us.items():
                if stage not in ("total", "layer"):
                    print(f"  {stage:20s} {t:10.1f} us  {100 * t / us['total']:5.1f}%")


if __name__ == "__main__":
    main()
