"""Hugging Face transformers' DSA models on the ``dsa`` ops, with one call.

::

    from sparse_dsa_ops.integrations.transformers import patch_model

    model = AutoModelForCausalLM.from_pretrained("deepseek-ai/DeepSeek-V3.2-Exp", dtype=torch.bfloat16)
    patch_model(model)  # kv_cache="packed": FP8 latent rows; "bf16": bfloat16 latent rows
    model.generate(**inputs)  # unchanged

transformers' DSA attention is dense underneath: its indexer scores every cached token per head, top-k becomes a
boolean mask over the full ``[T, S]`` score matrix, and the latent is expanded into per-head K and V for every token
on every step. :func:`patch_model` replaces the forward of each DSA attention module with the absorbed form on the
ops, and nothing else of the model:

- the query's NoPE part is absorbed into the latent (``q . W_UK``), so attention runs on one latent KV head of
  ``kv_lora_rank + qk_rope_head_dim`` columns: :func:`sparse_dsa_ops.sparse_attn` over the selected rows, then the
  value up-projection ``W_UV`` and ``o_proj``; the scale is the module's own ``scaling`` (with YaRN's mscale);
- the latent rows live in a paged pool of this module's own, packed FP8 (:func:`store_k_cache`) or bfloat16, and
  the indexer's keys in a paged index-K cache (:func:`store_index_k`); the indexer scores with
  :func:`quant_index` / :func:`paged_index_logits` and selects with :func:`topk` (FP8 keys and queries, as the
  models' reference kernels do; transformers' own indexer stays in bfloat16);
- GLM-5.3-Flash's k-pool indexer scores pools of ``index_kpool`` consecutive tokens of a request (counted from its
  first real token) instead of tokens: its index-K cache holds one row per complete pool, compressed and stored by
  :func:`kpool_store_index_k` when the pool's last token arrives (the tokens of the incomplete pool wait in a small
  buffer per row), and :func:`kpool_topk` selects the best ``index_topk / index_kpool`` pools and appends the tokens
  of the incomplete pool;
- GLM-5's and GLM-5.3-Flash's "shared" indexer layers reuse the previous full layer's selection, as the models do;
- each DSA layer's entry in the transformers cache becomes a :class:`PagedDsaLayer` (created on the layer's first
  call, growing as ``generate()`` appends) that reports the cached length, so positions and masks stay right.

Padding comes from the attention mask (left padding, as ``generate()`` pads); positions and RoPE from the model's
own ``position_ids`` and rotary embedding (GLM-5.3-Flash's DSA layers have none). Attention memory is O(T * top-k)
per layer; the indexer's logits are O(T * S) float32 (O(T * S / index_kpool) with pools; transformers' were
O(T * S * heads)), and the model's own causal mask stays as it was.

Supported: ``DeepseekV32ForCausalLM`` / ``DeepseekV32Model`` (DeepSeek-V3.2), ``GlmMoeDsaForCausalLM`` /
``GlmMoeDsaModel`` (GLM-5) and ``Glm5NextForConditionalGeneration`` / ``Glm5NextModel`` / ``Glm5NextTextModel``
(GLM-5.3-Flash; its linear-attention layers stay transformers'), in transformers 5.17 and later (the models pass
the cache as ``past_key_values`` before 5.24 and as ``cache`` from then on; the patched forward takes either). Any
other model raises ``NotImplementedError``.
Beam search works (the cache's rows are reordered). Not supported: static caches, ``torch.compile`` of the decode
step and CUDA graphs (the pools grow by reallocation, a host-side decision, and the indexer's width follows the
cached length).

Letters: B batch rows, T new tokens per row, L tokens already cached per row, H heads, Hi indexer heads, D the
indexer head dim, C = kv_lora_rank, R = qk_rope_head_dim, kp = index_kpool.
"""

from __future__ import annotations

import functools
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import (
    KCacheLayout,
    kpool_store_index_k,
    kpool_topk,
    paged_index_logits,
    quant_index,
    sparse_attn,
    store_index_k,
    store_k_cache,
    topk,
)

__all__ = ["patch_model", "PAGE", "SUPPORTED_MODELS", "paged_dsa_layer_class"]

PAGE = 64  # tokens per page of the latent pool, and index rows (tokens or pools) per page of the index-K cache
KV_CACHE_KINDS = ("packed", "bf16")
SUPPORTED_MODELS = (
    "DeepseekV32ForCausalLM",
    "DeepseekV32Model",
    "GlmMoeDsaForCausalLM",
    "GlmMoeDsaModel",
    "Glm5NextForConditionalGeneration",
    "Glm5NextModel",
    "Glm5NextTextModel",
)
# the ops' contract values that size this module's buffers (stated in the ops' docstrings)
INDEX_SCALE_BYTES = 4  # an index-K row: D FP8 values, then one float32 scale
INDEX_DIM_MULTIPLE = 64  # the indexer's head dim
TOPK_MULTIPLE = 64  # sparse_attn reads index rows whose width is a multiple of 64


@dataclass(frozen=True)
class _Spec:
    """How one model family's DSA attention differs: the RoPE of its main attention and of its indexer (None: NoPE),
    whether its forward returns the selection (GLM passes it on to its "shared" layers) and the indexer's pool size
    (None: the indexer scores tokens; an int: a k-pool indexer)."""

    packed: bool
    rope: Callable | None  # apply_rotary_pos_emb_interleave of the model's module
    index_rope: Callable | None
    returns_topk: bool
    kpool: int | None


# attention class -> (the RoPE function names of its main attention and of its indexer in the model's module, None
# for NoPE; whether forward returns the top-k)
_ATTENTION = {
    # half-split RoPE in the indexer
    "DeepseekV32Attention": ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb", False),
    "GlmMoeDsaAttention": ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb_interleave", True),
    "Glm5NextTextAttention": (None, None, True),
}


class _PagedState:
    """One layer's cache for B rows: the latent pool ``kv [B * cap, W]`` (packed rows or bfloat16), the index-K cache
    ``index [B * icap / PAGE, PAGE * (D + 4)]`` with its page table ``page_table [B, icap / PAGE]`` (none on a
    "shared" layer) and which cached keys are real tokens (``valid [B, cap]``, False for padding). Row b, position p
    is slot ``b * cap + p`` of the latent pool.

    A token indexer (``kpool`` None) keeps one index row per token, slot ``b * cap + p`` (``icap = cap``). A k-pool
    indexer keeps one per complete pool: row b's pool j holds its real tokens ``j * kp .. j * kp + kp - 1`` (counted
    from its first real token) and is slot ``b * icap + j``; the index keys and gate logits of the row's tokens past
    its last complete pool wait in ``tail_k [B, kp, D]`` bfloat16 and ``tail_gate [B, kp, D]`` float32."""

    def __init__(
        self,
        batch: int,
        device: torch.device,
        kv_width: int,
        kv_dtype: torch.dtype,
        index_dim: int | None,
        kpool: int | None = None,
    ):
        self.batch, self.device = batch, device
        self.kv_width, self.kv_dtype, self.index_dim, self.kpool = kv_width, kv_dtype, index_dim, kpool
        self.cap = self.icap = 0
        self.length = 0
        self.kv = torch.empty(0, kv_width, dtype=kv_dtype, device=device)
        self.index = None
        self.valid = torch.empty(batch, 0, dtype=torch.bool, device=device)
        self.page_table = torch.empty(batch, 0, dtype=torch.int32, device=device)
        self.tail_k = self.tail_gate = None
        if kpool is not None and index_dim is not None:
            self.tail_k = torch.zeros(batch, kpool, index_dim, dtype=torch.bfloat16, device=device)
            self.tail_gate = torch.zeros(batch, kpool, index_dim, dtype=torch.float32, device=device)

    def reserve(self, length: int) -> None:
        """Room for ``length`` tokens per row; a larger pool keeps every row's tokens at the same positions."""
        if length <= self.cap:
            return
        cap = max(2 * self.cap, -(-length // PAGE) * PAGE)
        # a row's pools are at most cap // kp
        icap = cap if self.kpool is None else max(1, -(-(cap // self.kpool) // PAGE)) * PAGE
        b = self.batch
        self.kv = self._grow(self.kv.view(b, self.cap, self.kv_width), cap).view(b * cap, self.kv_width)
        if self.index_dim is not None:
            page_bytes = PAGE * (self.index_dim + INDEX_SCALE_BYTES)
            if self.index is None:
                self.index = torch.empty(0, page_bytes, dtype=torch.uint8, device=self.device)
            pages = self.index.view(b, self.icap // PAGE, page_bytes)
            self.index = self._grow(pages, icap // PAGE).view(b * icap // PAGE, page_bytes)
        self.valid = self._grow(self.valid, cap)
        self.page_table = torch.arange(b * icap // PAGE, dtype=torch.int32, device=self.device).view(b, icap // PAGE)
        self.cap, self.icap = cap, icap

    @staticmethod
    def _grow(x: torch.Tensor, size: int) -> torch.Tensor:
        """``x [B, n, ...]`` in a zeroed ``[B, size, ...]``."""
        out = x.new_zeros(x.shape[0], size, *x.shape[2:])
        out[:, : x.shape[1]] = x
        return out

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (beam search), in that order."""
        b, rows = self.batch, rows.to(self.device)
        self.kv = self.kv.view(b, -1, self.kv_width).index_select(0, rows).reshape(-1, self.kv_width)
        if self.index is not None:
            self.index = self.index.view(b, -1, self.index.shape[-1]).index_select(0, rows).reshape(self.index.shape)
        if self.tail_k is not None:
            self.tail_k = self.tail_k.index_select(0, rows)
            self.tail_gate = self.tail_gate.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)

    def first_real(self, end: int) -> torch.Tensor:
        """``[B]`` int32: each row's first real position (``end`` for a row without a real token before ``end``)."""
        valid = self.valid[:, :end]  # [B, end]
        first = valid.to(torch.int32).argmax(dim=1)  # the first of the maxima
        return torch.where(valid.any(dim=1), first, end).to(torch.int32)


@functools.cache
def paged_dsa_layer_class() -> type:
    """``PagedDsaLayer``: the transformers cache layer a patched DSA layer keeps its :class:`_PagedState` in (built
    on first use, so that importing this module needs no transformers)."""
    from transformers.cache_utils import CacheLayerMixin

    class PagedDsaLayer(CacheLayerMixin):
        """A DSA layer's paged cache inside a transformers ``Cache``: it reports the cached length to ``generate()``
        and the masks; the patched attention reads and writes its pools."""

        is_compileable = False

        def __init__(self) -> None:
            super().__init__()
            self.state: _PagedState | None = None
            self.is_initialized = True

        def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
            return None

        def update(self, *args: Any, **kwargs: Any):
            raise RuntimeError(
                "sparse_dsa_ops: a patched DSA layer's cache is written by its attention, not by Cache.update"
            )

        def get_seq_length(self) -> int:
            return 0 if self.state is None else self.state.length

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.state = None

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.state is not None:
                self.state.reorder(beam_idx)

        def offload(self) -> None:
            return None

        def prefetch(self) -> None:
            return None

    return PagedDsaLayer


def _layer_state(attn, cache, batch: int, device: torch.device) -> _PagedState:
    """The paged state of ``attn``'s layer in ``cache`` (a fresh one per call without a cache)."""
    kv_width = attn.kv_lora_rank + attn.qk_rope_head_dim
    spec: _Spec = attn._sparse_dsa
    if spec.packed:
        kv_width, kv_dtype = KCacheLayout(attn.kv_lora_rank, attn.qk_rope_head_dim).row_bytes, torch.uint8
    else:
        kv_dtype = torch.bfloat16
    index_dim = None if attn.indexer is None else attn.indexer.head_dim

    def fresh() -> _PagedState:
        return _PagedState(batch, device, kv_width, kv_dtype, index_dim, spec.kpool)

    if cache is None:
        return fresh()
    layer_class = paged_dsa_layer_class()
    layers, idx = cache.layers, attn.layer_idx
    while len(layers) <= idx:
        layers.append(layer_class())
    layer = layers[idx]
    if not isinstance(layer, layer_class):
        if layer.get_seq_length() > 0:
            raise RuntimeError(
                f"sparse_dsa_ops: layer {idx}'s cache already holds tokens that the unpatched model wrote; start "
                "from an empty cache after patch_model"
            )
        layer = layers[idx] = layer_class()
    if layer.state is None:
        layer.state = fresh()
    elif layer.state.batch != batch:
        raise ValueError(f"sparse_dsa_ops: the cache holds {layer.state.batch} rows, this call has {batch}")
    return layer.state


def _key_validity(mask: torch.Tensor | None, start: int, count: int, batch: int, device) -> torch.Tensor:
    """``[B, count]`` bool: whether the keys at positions ``start ..`` are real tokens. A 4-d mask
    ``[B, 1, T, kv_len]`` (DeepSeek-V3.2, GLM-5) gives its last query's row: that query may see every key, and left
    padding masks the same keys in every row. A 2-d padding mask (GLM-5.3-Flash's ``[B, T]``, or ``[B, kv_len]``)
    gives its last ``count`` columns."""
    if mask is None:
        return torch.ones(batch, count, dtype=torch.bool, device=device)
    if mask.dim() == 2:
        return mask[:, -count:].bool().expand(batch, count)  # [B, count]; 0 or False: padding
    row = mask[:, 0, -1, start : start + count]  # [B, count]
    if row.dtype == torch.bool:
        return row.expand(batch, count)
    return (row > torch.finfo(row.dtype).min / 2).expand(batch, count)  # additive masks: 0 or the dtype's min


def _index_queries(attn, hidden_states, q_resid, position_embeddings) -> tuple[torch.Tensor, ...]:
    """The indexer's FP8 queries ``[B, T, Hi, D]``, their weights ``[B * T, Hi]`` float32 (each head's weight times
    the query's scale and the logit scale) and the new tokens' index keys ``[B, T, D]`` bfloat16."""
    idx, spec = attn.indexer, attn._sparse_dsa
    b, t, _ = hidden_states.shape
    heads, dim = idx.n_heads, idx.head_dim
    q = idx.wq_b(q_resid).view(b, t, heads, dim)  # [B, T, Hi, D]
    k = idx.k_norm(idx.wk(hidden_states)).unsqueeze(2)  # [B, T, 1, D]
    if spec.index_rope is not None:
        rope = idx.qk_rope_head_dim
        cos, sin = position_embeddings
        q_rot, q_pass = q.split([rope, dim - rope], dim=-1)
        k_rot, k_pass = k.split([rope, dim - rope], dim=-1)
        q_rot, k_rot = spec.index_rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)  # [B, T, Hi, D]
        k = torch.cat([k_rot, k_pass], dim=-1)  # [B, T, 1, D]
    weights = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float()  # [B, T, Hi]
    weights = weights * (heads**-0.5 * idx.softmax_scale)  # relu(c * s) = c * relu(s) for the scale c > 0
    q_fp8, q_scale = quant_index(q.to(torch.bfloat16))  # [B, T, Hi, D], [B, T, Hi]
    return q_fp8, (weights * q_scale).reshape(b * t, heads), k.view(b, t, dim).to(torch.bfloat16)


def _select(attn, hidden_states, q_resid, position_embeddings, state: _PagedState, start: int, slots) -> torch.Tensor:
    """The indexer's top-k of each new token as positions ``[B * T, K']`` int32 (ascending, -1 padded): FP8 queries
    and keys as the models' reference kernels score them, over the real keys up to the token's own position."""
    idx = attn.indexer
    b, t, _ = hidden_states.shape
    q_fp8, weights, k = _index_queries(attn, hidden_states, q_resid, position_embeddings)
    store_index_k(k.view(b * t, -1), state.index, slots)
    end = start + t
    pages = -(-end // PAGE)
    lengths = torch.arange(start + 1, end + 1, dtype=torch.int32, device=k.device).repeat(b)  # [B * T], causal
    logits = paged_index_logits(q_fp8, state.index, weights, lengths, state.page_table[:, :pages])
    logits.view(b, t, -1).masked_fill_(~state.valid[:, None, : pages * PAGE], -math.inf)  # [B * T, pages * PAGE]
    k_count = min(idx.index_topk, end)
    width = -(-k_count // TOPK_MULTIPLE) * TOPK_MULTIPLE
    pos = topk(logits, lengths, k_count, out_width=width)  # [B * T, K'] ascending positions, -1 padded
    # a row with fewer real keys than k takes padding keys (-inf) too: they attend to nothing
    row_base = torch.arange(b, device=k.device).repeat_interleave(t)[:, None] * state.cap  # [B * T, 1]
    real = state.valid.view(-1)[(row_base + pos.clamp(min=0)).view(-1)].view(pos.shape)
    return torch.where((pos >= 0) & real, pos, -1)


def _store_pools(state: _PagedState, k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, start: int) -> None:
    """Compress and store the pools that the new tokens (``k [B, T, D]`` bfloat16, ``gate [B, T, D]`` float32 at
    positions ``start ..``) complete; the tokens past each row's last complete pool go to its tail buffers. Padding
    tokens belong to no pool."""
    b, t, dim = k.shape
    kp, dev = state.kpool, k.device
    valid = state.valid[:, start : start + t]  # [B, T]
    done = state.valid[:, :start].sum(dim=1)  # [B] real tokens before these
    held = done % kp  # [B] of them in the tail buffers
    total = held + valid.sum(dim=1)  # [B] held and new real tokens
    # each row's run of tokens without a complete pool in one buffer: the held ones, then the new real ones; the
    # padding tokens all land in the last column, which no pool and no tail reads
    dest = torch.where(valid, held[:, None] + valid.cumsum(dim=1) - 1, kp + t)[..., None].expand(b, t, dim)
    run_k = torch.cat([state.tail_k, k.new_zeros(b, t + 1, dim)], dim=1).scatter_(1, dest, k)  # [B, kp + T + 1, D]
    run_gate = torch.cat([state.tail_gate, gate.new_zeros(b, t + 1, dim)], dim=1).scatter_(1, dest, gate)
    most = (kp - 1 + t) // kp  # the pools one row can complete here
    if most:
        j = torch.arange(most, device=dev)  # [most]
        first_pool = torch.arange(b, device=dev)[:, None] * state.icap + (done // kp)[:, None]  # [B, 1] its slot
        loc = torch.where(j < (total // kp)[:, None], first_pool + j, -1)  # [B, most], -1: no pool completed
        pools = run_k[:, : most * kp].reshape(b * most, kp, dim)  # [B * most, kp, D]
        gates = run_gate[:, : most * kp].reshape(b * most, kp, dim)
        kpool_store_index_k(pools, gates, ape, state.index, loc.view(-1))
    # positions past the run (clamped) only fill unused tail entries
    tail = ((total - total % kp)[:, None] + torch.arange(kp, device=dev)).clamp(max=kp + t)  # [B, kp]
    tail = tail[..., None].expand(b, kp, dim)
    state.tail_k, state.tail_gate = run_k.gather(1, tail), run_gate.gather(1, tail)


def _select_pools(attn, hidden_states, q_resid, state: _PagedState, start: int) -> torch.Tensor:
    """A k-pool indexer's selection of each new token as positions ``[B * T, K']`` int32 (ascending, -1 padded): the
    best ``index_topk / kp`` complete pools among those it sees, each as its kp tokens, then the tokens of its
    incomplete pool (``index_kpool_always_select_tail``); FP8 queries and pool keys. Stores the completed pools."""
    idx = attn.indexer
    b, t, _ = hidden_states.shape
    kp, end = state.kpool, start + t
    q_fp8, weights, k = _index_queries(attn, hidden_states, q_resid, None)
    gate = torch.nn.functional.linear(hidden_states, idx.index_kpool_compress_gate)  # [B, T, D]
    _store_pools(state, k, gate.float(), idx.index_kpool_compress_ape.float(), start)
    first = state.first_real(end)  # [B]
    new = torch.arange(start, end, dtype=torch.int32, device=k.device)  # [T]
    seen = (new - first[:, None] + 1).clamp(min=0).view(-1)  # [B * T] real tokens each sees, itself included
    most = end // kp  # no row has more complete pools
    pages = max(1, -(-most // PAGE))
    logits = paged_index_logits(q_fp8, state.index, weights, seen // kp, state.page_table[:, :pages])
    k_pools = max(1, min(idx.index_topk // kp, most))
    tail = bool(idx.index_kpool_always_select_tail)
    width = -(-(k_pools * kp + (kp - 1 if tail else 0)) // TOPK_MULTIPLE) * TOPK_MULTIPLE
    pos = kpool_topk(logits, seen, k_pools, kp, out_width=width, tail=tail)  # [B * T, K'] numbers of real tokens
    return torch.where(pos >= 0, pos + first.repeat_interleave(t)[:, None], -1)  # their positions


def _dsa_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The DSA attention module's forward on the ops (bound to the module by :func:`patch_model`)."""
    spec: _Spec = self._sparse_dsa
    cache = kwargs.pop("past_key_values", cache)  # the cache's name in transformers before 5.24
    b, t, _ = hidden_states.shape
    heads, nope, rope, v_dim, lora = (
        self.num_heads,
        self.qk_nope_head_dim,
        self.qk_rope_head_dim,
        self.v_head_dim,
        self.kv_lora_rank,
    )
    dev = hidden_states.device
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [B, T, q_lora]
    q = self.q_b_proj(q_resid).view(b, t, heads, nope + rope).transpose(1, 2)  # [B, H, T, nope + R]
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    kv_pass, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([lora, rope], dim=-1)
    latent = self.kv_a_layernorm(kv_pass)  # [B, T, C]
    if spec.rope is not None:
        cos, sin = position_embeddings
        q_rot, k_rot = spec.rope(q_rot, k_rot.view(b, 1, t, rope), cos, sin)  # [B, H, T, R], [B, 1, T, R]

    state = _layer_state(self, cache, b, dev)
    start = state.length
    state.reserve(start + t)
    state.valid[:, start : start + t] = _key_validity(attention_mask, start, t, b, dev)
    row_base = torch.arange(b, device=dev) * state.cap  # [B]
    slots = (row_base[:, None] + torch.arange(start, start + t, device=dev)).reshape(-1)  # [B * T]
    k_nope = latent.reshape(b * t, lora).to(torch.bfloat16)
    k_rope = k_rot.reshape(b * t, rope).to(torch.bfloat16)
    if spec.packed:
        store_k_cache(k_nope, k_rope if rope else None, state.kv, slots)
    else:
        state.kv[slots] = torch.cat([k_nope, k_rope], dim=-1)

    if self.indexer is None:
        if prev_topk_indices is None:
            raise ValueError("sparse_dsa_ops: a shared DSA layer needs the selection of a previous full indexer layer")
        positions = prev_topk_indices
    elif spec.kpool is None:
        positions = _select(self, hidden_states, q_resid, position_embeddings, state, start, slots)
    else:
        positions = _select_pools(self, hidden_states, q_resid, state, start)
    state.length = start + t

    w = self.kv_b_proj.weight.view(heads, nope + v_dim, lora).float()  # [H, nope + v, C]: W_UK then W_UV
    q_latent = torch.einsum("bhtd,hdc->bthc", q_pass.float(), w[:, :nope])  # [B, T, H, C]
    q_full = torch.cat([q_latent, q_rot.transpose(1, 2).float()], dim=-1).reshape(b * t, heads, lora + rope)
    rows = torch.where(positions >= 0, positions + row_base.repeat_interleave(t)[:, None], -1).to(torch.int32)
    out_latent, _ = sparse_attn(q_full.to(torch.bfloat16), state.kv, rows, float(self.scaling), lora)
    out = torch.einsum("nhc,hec->nhe", out_latent.float(), w[:, nope:])  # [B * T, H, v]
    out = self.o_proj(out.reshape(b, t, heads * v_dim).to(hidden_states.dtype))
    if spec.returns_topk:
        return out, None, positions
    return out, None


def _check_geometry(attn) -> None:
    """A clear error for a configuration the ops do not cover."""
    lora, rope, heads = attn.kv_lora_rank, attn.qk_rope_head_dim, attn.num_heads
    problems = []
    if lora % 128:
        problems.append(f"kv_lora_rank {lora} is not a multiple of 128")
    if rope % 16:
        problems.append(f"qk_rope_head_dim {rope} is not a multiple of 16")
    if not 1 <= heads <= 128:
        problems.append(f"{heads} attention heads (1 to 128 are supported)")
    if attn.indexer is not None and attn.indexer.head_dim % INDEX_DIM_MULTIPLE:
        problems.append(f"index_head_dim {attn.indexer.head_dim} is not a multiple of {INDEX_DIM_MULTIPLE}")
    if problems:
        raise ValueError(f"sparse_dsa_ops.patch_model: layer {attn.layer_idx}: " + "; ".join(problems))


def patch_model(model: torch.nn.Module, kv_cache: str = "packed") -> torch.nn.Module:
    """Run a transformers DSA model's attention on the ``dsa`` ops, in place; returns ``model``.

    Parameters
    ----------
    model : one of ``SUPPORTED_MODELS``
        DeepSeek-V3.2, GLM-5 or GLM-5.3-Flash (``Glm5NextForConditionalGeneration``, ``Glm5NextModel`` or
        ``Glm5NextTextModel``), loaded in any dtype (bfloat16 is what the ops compute in).
    kv_cache : "packed" or "bf16"
        The latent pool's rows: packed FP8 (``KCacheLayout(kv_lora_rank, qk_rope_head_dim)``, 656 bytes per token
        for DeepSeek-V3.2 and GLM-5, 528 for GLM-5.3-Flash's NoPE latent) or bfloat16.

    Every DSA attention module gets the ops-based forward of this module's docstring; call ``generate()`` or the
    model as before, starting from an empty cache (``generate()`` makes one). Raises ``NotImplementedError`` for an
    unsupported model and ``ValueError`` for a configuration the ops do not cover, before changing anything.
    """
    name = type(model).__name__
    if kv_cache not in KV_CACHE_KINDS:
        raise ValueError(f"sparse_dsa_ops.patch_model: kv_cache must be one of {KV_CACHE_KINDS}, got {kv_cache!r}")
    if name not in SUPPORTED_MODELS:
        raise NotImplementedError(
            f"sparse_dsa_ops.patch_model: {name} is not supported; supported models: {', '.join(SUPPORTED_MODELS)}"
        )
    targets = [m for m in model.modules() if type(m).__name__ in _ATTENTION]
    if not targets:
        raise NotImplementedError(f"sparse_dsa_ops.patch_model: {name} has no DSA attention module to patch")
    for attn in targets:
        _check_geometry(attn)
    for attn in targets:
        module = sys.modules[type(attn).__module__]
        rope, index_rope, returns_topk = _ATTENTION[type(attn).__name__]
        attn._sparse_dsa = _Spec(
            packed=kv_cache == "packed",
            rope=None if rope is None else getattr(module, rope),
            index_rope=None if index_rope is None else getattr(module, index_rope),
            returns_topk=returns_topk,
            kpool=getattr(attn.config, "index_kpool", None),
        )
        if not hasattr(attn, "indexer"):
            attn.indexer = None
        attn.forward = types.MethodType(_dsa_attention_forward, attn)
    return model
