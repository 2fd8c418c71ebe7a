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
- GLM-5's "shared" indexer layers reuse the previous full layer's selection, as the model does;
- each DSA layer's entry in the transformers cache becomes a :class:`PagedDsaLayer` (created on the layer's first
  call, growing as ``generate()`` appends) that reports the cached length, so positions and masks stay right.

Padding comes from the attention mask (left padding, as ``generate()`` pads); positions and RoPE from the model's
own ``position_ids`` and rotary embedding. Attention memory is O(T * top-k) per layer; the indexer's logits are
O(T * S) float32 (transformers' were O(T * S * heads)), and the model's own 4-d causal mask stays as it was.

Supported: ``DeepseekV32ForCausalLM`` / ``DeepseekV32Model`` (DeepSeek-V3.2) and ``GlmMoeDsaForCausalLM`` /
``GlmMoeDsaModel`` (GLM-5). ``Glm5NextForConditionalGeneration`` (GLM-5.3-Flash, a k-pool indexer) raises
``NotImplementedError``, as does any other model. Beam search works (the cache's rows are reordered). Not
supported: static caches, ``torch.compile`` of the decode step and CUDA graphs (the pools grow by reallocation,
a host-side decision, and the indexer's width follows the cached length).

Letters: B batch rows, T new tokens per row, L tokens already cached per row, H heads, Hi indexer heads, D the
indexer head dim, C = kv_lora_rank, R = qk_rope_head_dim.
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

from .. import ops

__all__ = ["patch_model", "PAGE", "SUPPORTED_MODELS", "paged_dsa_layer_class"]

PAGE = 64  # tokens per page of the latent pool and the index-K cache
KV_CACHE_KINDS = ("packed", "bf16")
SUPPORTED_MODELS = ("DeepseekV32ForCausalLM", "DeepseekV32Model", "GlmMoeDsaForCausalLM", "GlmMoeDsaModel")
_KPOOL_MODELS = ("Glm5NextForConditionalGeneration", "Glm5NextModel", "Glm5NextForCausalLM")


@dataclass(frozen=True)
class _Spec:
    """How one model family's DSA attention differs: the RoPE of its main attention and of its indexer, and whether
    its forward returns the selection (GLM passes it on to its "shared" layers)."""

    packed: bool
    rope: Callable  # apply_rotary_pos_emb_interleave of the model's module
    index_rope: Callable
    returns_topk: bool


# attention class -> (the indexer's RoPE function name in the model's module, whether forward returns the top-k)
_ATTENTION = {
    "DeepseekV32Attention": ("apply_rotary_pos_emb", False),  # half-split RoPE in the indexer
    "GlmMoeDsaAttention": ("apply_rotary_pos_emb_interleave", True),
}


class _PagedState:
    """One layer's cache for B rows: the latent pool ``kv [B * cap, W]`` (packed rows or bfloat16), the index-K cache
    ``index [B * cap / PAGE, PAGE * (D + 4)]`` (none on a "shared" layer) and which cached keys are real tokens
    (``valid [B, cap]``, False for padding). Row b, position p is slot ``b * cap + p`` of both."""

    def __init__(self, batch: int, device: torch.device, kv_width: int, kv_dtype: torch.dtype, index_dim: int | None):
        self.batch, self.device = batch, device
        self.kv_width, self.kv_dtype, self.index_dim = kv_width, kv_dtype, index_dim
        self.cap = 0
        self.length = 0
        self.kv = torch.empty(0, kv_width, dtype=kv_dtype, device=device)
        self.index = None
        self.valid = torch.empty(batch, 0, dtype=torch.bool, device=device)
        self.page_table = torch.empty(batch, 0, dtype=torch.int32, device=device)

    def reserve(self, length: int) -> None:
        """Room for ``length`` tokens per row; a larger pool keeps every row's tokens at the same positions."""
        if length <= self.cap:
            return
        cap = max(2 * self.cap, -(-length // PAGE) * PAGE)
        b = self.batch
        self.kv = self._grow(self.kv.view(b, self.cap, self.kv_width), cap).view(b * cap, self.kv_width)
        if self.index_dim is not None:
            page_bytes = PAGE * (self.index_dim + ops.INDEX_SCALE_BYTES)
            old = torch.empty(b, 0, page_bytes, dtype=torch.uint8, device=self.device) if self.index is None else None
            pages = self.index.view(b, self.cap // PAGE, page_bytes) if old is None else old
            self.index = self._grow(pages, cap // PAGE).view(b * cap // PAGE, page_bytes)
        self.valid = self._grow(self.valid, cap)
        self.page_table = torch.arange(b * cap // PAGE, dtype=torch.int32, device=self.device).view(b, cap // PAGE)
        self.cap = cap

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
        self.valid = self.valid.index_select(0, rows)


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
        kv_width, kv_dtype = ops.KCacheLayout(attn.kv_lora_rank, attn.qk_rope_head_dim).row_bytes, torch.uint8
    else:
        kv_dtype = torch.bfloat16
    index_dim = None if attn.indexer is None else attn.indexer.head_dim
    if cache is None:
        return _PagedState(batch, device, kv_width, kv_dtype, index_dim)
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
        layer.state = _PagedState(batch, device, kv_width, kv_dtype, index_dim)
    elif layer.state.batch != batch:
        raise ValueError(f"sparse_dsa_ops: the cache holds {layer.state.batch} rows, this call has {batch}")
    return layer.state


def _key_validity(mask: torch.Tensor | None, start: int, count: int, batch: int, device) -> torch.Tensor:
    """``[B, count]`` bool: whether the keys at positions ``start ..`` are real tokens, read from the model's 4-d
    mask ``[B, 1, T, kv_len]``: its last query may see every key (left padding masks the same keys in every row)."""
    if mask is None:
        return torch.ones(batch, count, dtype=torch.bool, device=device)
    row = mask[:, 0, -1, start : start + count]  # [B, count]
    if row.dtype == torch.bool:
        return row.expand(batch, count)
    return (row > torch.finfo(row.dtype).min / 2).expand(batch, count)  # additive masks: 0 or the dtype's min


def _select(attn, hidden_states, q_resid, position_embeddings, state: _PagedState, start: int, slots) -> torch.Tensor:
    """The indexer's top-k of each new token as positions ``[B * T, K']`` int32 (ascending, -1 padded): FP8 queries
    and keys as the models' reference kernels score them, over the real keys up to the token's own position."""
    idx, spec = attn.indexer, attn._sparse_dsa
    b, t, _ = hidden_states.shape
    heads, dim, rope = idx.n_heads, idx.head_dim, idx.qk_rope_head_dim
    cos, sin = position_embeddings
    q = idx.wq_b(q_resid).view(b, t, heads, dim)  # [B, T, Hi, D]
    k = idx.k_norm(idx.wk(hidden_states)).unsqueeze(2)  # [B, T, 1, D]
    q_rot, q_pass = q.split([rope, dim - rope], dim=-1)
    k_rot, k_pass = k.split([rope, dim - rope], dim=-1)
    q_rot, k_rot = spec.index_rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)  # [B, T, Hi, D]
    k = torch.cat([k_rot, k_pass], dim=-1).reshape(b * t, dim)  # [B * T, D]
    weights = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float()  # [B, T, Hi]
    weights = weights * (heads**-0.5 * idx.softmax_scale)  # relu(c * s) = c * relu(s) for the scale c > 0
    q_fp8, q_scale = ops.quant_index(q.to(torch.bfloat16))  # [B, T, Hi, D], [B, T, Hi]
    ops.store_index_k(k.to(torch.bfloat16), state.index, slots)
    end = start + t
    pages = -(-end // PAGE)
    lengths = torch.arange(start + 1, end + 1, dtype=torch.int32, device=q.device).repeat(b)  # [B * T], causal
    logits = ops.paged_index_logits(
        q_fp8, state.index, (weights * q_scale).reshape(b * t, heads), lengths, state.page_table[:, :pages]
    )  # [B * T, pages * PAGE]
    logits.view(b, t, -1).masked_fill_(~state.valid[:, None, : pages * PAGE], -math.inf)
    k_count = min(idx.index_topk, end)
    width = -(-k_count // ops.TOPK_MULTIPLE) * ops.TOPK_MULTIPLE
    pos = ops.topk(logits, lengths, k_count, out_width=width)  # [B * T, K'] ascending positions, -1 padded
    # a row with fewer real keys than k takes padding keys (-inf) too: they attend to nothing
    row_base = torch.arange(b, device=q.device).repeat_interleave(t)[:, None] * state.cap  # [B * T, 1]
    real = state.valid.view(-1)[(row_base + pos.clamp(min=0)).view(-1)].view(pos.shape)
    return torch.where((pos >= 0) & real, pos, -1)


def _dsa_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache=None,
    position_ids: torch.Tensor | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs: Any,
):
    """The DSA attention module's forward on the ops (bound to the module by :func:`patch_model`)."""
    spec: _Spec = self._sparse_dsa
    cache = kwargs.pop("past_key_values", cache)
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
        ops.store_k_cache(k_nope, k_rope if rope else None, state.kv, slots)
    else:
        state.kv[slots] = torch.cat([k_nope, k_rope], dim=-1)

    if self.indexer is not None:
        positions = _select(self, hidden_states, q_resid, position_embeddings, state, start, slots)
    elif prev_topk_indices is None:
        raise ValueError("sparse_dsa_ops: a shared DSA layer needs the selection of a previous full indexer layer")
    else:
        positions = prev_topk_indices
    state.length = start + t

    w = self.kv_b_proj.weight.view(heads, nope + v_dim, lora).float()  # [H, nope + v, C]: W_UK then W_UV
    q_latent = torch.einsum("bhtd,hdc->bthc", q_pass.float(), w[:, :nope])  # [B, T, H, C]
    q_full = torch.cat([q_latent, q_rot.transpose(1, 2).float()], dim=-1).reshape(b * t, heads, lora + rope)
    rows = torch.where(positions >= 0, positions + row_base.repeat_interleave(t)[:, None], -1).to(torch.int32)
    out_latent, _ = ops.sparse_attn(q_full.to(torch.bfloat16), state.kv, rows, float(self.scaling), lora)
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
    if attn.indexer is not None and attn.indexer.head_dim % ops.INDEX_DIM_MULTIPLE:
        problems.append(f"index_head_dim {attn.indexer.head_dim} is not a multiple of {ops.INDEX_DIM_MULTIPLE}")
    if problems:
        raise ValueError(f"sparse_dsa_ops.patch_model: layer {attn.layer_idx}: " + "; ".join(problems))


def patch_model(model: torch.nn.Module, kv_cache: str = "packed") -> torch.nn.Module:
    """Run a transformers DSA model's attention on the ``dsa`` ops, in place; returns ``model``.

    Parameters
    ----------
    model : DeepseekV32ForCausalLM, DeepseekV32Model, GlmMoeDsaForCausalLM or GlmMoeDsaModel
        Loaded in any dtype (bfloat16 is what the ops compute in).
    kv_cache : "packed" or "bf16"
        The latent pool's rows: packed FP8 (``KCacheLayout(kv_lora_rank, qk_rope_head_dim)``, 656 bytes per token
        for both models) or bfloat16.

    Every DSA attention module gets the ops-based forward of this module's docstring; call ``generate()`` or the
    model as before, starting from an empty cache (``generate()`` makes one). Raises ``NotImplementedError`` for an
    unsupported model (GLM-5.3-Flash's k-pool indexer among them) and ``ValueError`` for a configuration the ops do
    not cover, before changing anything.
    """
    name = type(model).__name__
    if kv_cache not in KV_CACHE_KINDS:
        raise ValueError(f"sparse_dsa_ops.patch_model: kv_cache must be one of {KV_CACHE_KINDS}, got {kv_cache!r}")
    if name in _KPOOL_MODELS:
        raise NotImplementedError(
            f"sparse_dsa_ops.patch_model: {name} (GLM-5.3-Flash) is not supported yet: its k-pool indexer "
            "(gated pools of index keys, dsa.kpool_* ops) is not wired into patch_model"
        )
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
        index_rope, returns_topk = _ATTENTION[type(attn).__name__]
        attn._sparse_dsa = _Spec(
            packed=kv_cache == "packed",
            rope=module.apply_rotary_pos_emb_interleave,
            index_rope=getattr(module, index_rope),
            returns_topk=returns_topk,
        )
        if not hasattr(attn, "indexer"):
            attn.indexer = None
        attn.forward = types.MethodType(_dsa_attention_forward, attn)
    return model
