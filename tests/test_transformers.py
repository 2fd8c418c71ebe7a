"""sparse_dsa_ops.integrations.transformers: transformers' DSA models patched onto the ops against the originals.

Tiny random models at the real attention geometry (kv_lora_rank 512, RoPE 64, indexer 64 or 32 heads x 128), two
layers, a batch of two rows, one left-padded. The original runs in float32 with its indexer scoring FP8-rounded
queries and keys (the selection the ops make; transformers' own indexer skips FP8), so both select the same keys;
the patched model (same weights) must then match each attention layer within the attention contract's error and
``generate()`` the same greedy tokens.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import sparse_dsa_ops as dsa
from sparse_dsa_ops.integrations import transformers as integration

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, n) for n in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")):
    pytest.skip("this transformers has no DeepseekV32 / GlmMoeDsa models", allow_module_level=True)

SEQ, PAD, NEW_TOKENS = 48, 9, 16
# attention outputs relative to their largest magnitude: bf16 operands of the ops (q, the latent) against the
# float32 original; packed FP8 rows add their quantization
ATTN_TOL = {"bf16": 2e-2, "packed": 6e-2}


def tiny_config(name: str, index_topk: int):
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=index_topk,
        index_head_dim=128,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        pad_token_id=0,
        initializer_range=0.05,
    )
    if name == "DeepseekV32":
        return transformers.DeepseekV32Config(index_n_heads=64, **common)
    return transformers.GlmMoeDsaConfig(index_n_heads=32, indexer_types=["full", "shared"], **common)


MODELS = {"DeepseekV32": "DeepseekV32ForCausalLM", "GlmMoeDsa": "GlmMoeDsaForCausalLM"}
INDEX_ROPE = {"DeepseekV32": "apply_rotary_pos_emb", "GlmMoeDsa": "apply_rotary_pos_emb_interleave"}


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the indexer's FP8 quantization and back (float32)."""
    values, scale = dsa.quant_index(x.to(torch.bfloat16))
    return values.float() * scale.unsqueeze(-1)


def fp8_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
    """transformers' indexer forward with FP8-rounded queries and keys: the selection the ops make."""
    rope = getattr(sys.modules[type(self).__module__], self._rope_name)
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)  # [B, S, Hi, D]
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)  # [B, S, 1, D]
    split = [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim]
    (q_rot, q_pass), (k_rot, k_pass) = q.split(split, dim=-1), k.split(split, dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = fp8_rounded(torch.cat([q_rot, q_pass], dim=-1))  # [B, S, Hi, D]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    k = fp8_rounded(k)  # [B, T, D]
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.double(), k.double()))  # [B, S, Hi, T]
    weights = self.weights_proj(hidden_states.float()).double() * self.n_heads**-0.5 * self.softmax_scale
    logits = torch.einsum("bsh,bsht->bst", weights, scores)  # [B, S, T]
    logits = logits.masked_fill(
        ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0, -math.inf
    )
    return logits.topk(min(self.index_topk, logits.shape[-1]), dim=-1).indices.to(torch.int32)


def model_pair(name: str, kv_cache: str, index_topk: int = 24):
    """``(original, patched)``: the float32 original with the FP8-emulating indexer, and a patched copy."""
    torch.manual_seed(0)
    config = tiny_config(name, index_topk)
    original = getattr(transformers, MODELS[name])(config).eval()
    for module in original.modules():
        if type(module).__name__.endswith("Indexer"):
            module._rope_name = INDEX_ROPE[name]
            module.forward = types.MethodType(fp8_indexer_forward, module)
    patched = getattr(transformers, MODELS[name])(config).eval()
    patched.load_state_dict(original.state_dict())
    return original, integration.patch_model(patched, kv_cache)


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0  # the second row left-padded
    ids[1, :PAD] = 0
    return ids, mask


def dsa_attentions(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "kv_b_proj")]


def layer_io(model, ids, mask) -> list[tuple[tuple, dict, torch.Tensor]]:
    """Each DSA attention module's inputs and output ``[B, S, hidden]`` in one forward."""
    seen = []

    def keep(_module, args, kwargs, out):
        seen.append((args, kwargs, out[0].detach().float()))

    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in dsa_attentions(model)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("kv_cache", ["bf16", "packed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_attention_layers_match_the_original(name, kv_cache):
    # each patched layer on the original's inputs to that layer (no error carried over from the layer before); a
    # shared layer gets the patched full layer's selection, as in the model
    original, patched = model_pair(name, kv_cache)
    ids, mask = batch()
    real = mask.bool()  # padding tokens' outputs are not used by the model
    selection = None
    io = layer_io(original, ids, mask)
    assert len(io) == 2
    for layer, ((args, kwargs, want), attn) in enumerate(zip(io, dsa_attentions(patched))):
        kwargs = {**kwargs, "cache": None, "prev_topk_indices": selection}
        with torch.no_grad():
            out = attn(*args, **kwargs)
        got = out[0].float()
        selection = out[2] if len(out) == 3 else None
        assert got.isfinite().all(), f"layer {layer}: inf or NaN"
        err = (got - want)[real].abs().max() / want[real].abs().max()
        assert err < ATTN_TOL[kv_cache], f"layer {layer}: relative error {err:.3g}"


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_gives_the_originals_greedy_tokens(name):
    original, patched = model_pair(name, "bf16")
    ids, mask = batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    want = original.generate(**kwargs)
    got = patched.generate(**kwargs)
    assert got.shape == want.shape == (2, SEQ + NEW_TOKENS)
    assert torch.equal(got, want)


def test_the_cache_reports_its_length_and_grows():
    _, patched = model_pair("GlmMoeDsa", "packed")
    ids, mask = batch()
    with torch.no_grad():
        out = patched(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        layer = integration.paged_dsa_layer_class()
        assert all(isinstance(x, layer) for x in cache.layers)
        assert cache.get_seq_length() == SEQ
        state = cache.layers[0].state
        assert state.kv.dtype == torch.uint8 and state.kv.shape == (2 * state.cap, 656)
        assert cache.layers[1].state.index is None  # the shared layer keeps no index keys
        assert not state.valid[1, :PAD].any() and state.valid[1, PAD:SEQ].all()


def test_unsupported_models_and_settings_say_so():
    with pytest.raises(NotImplementedError, match="Linear is not supported"):
        integration.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="k-pool indexer"):
        integration.patch_model(type("Glm5NextForConditionalGeneration", (torch.nn.Module,), {})())
    _, patched = model_pair("DeepseekV32", "bf16")
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        integration.patch_model(patched, "fp16")
