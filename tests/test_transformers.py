"""sparse_dsa_ops.integrations.transformers: transformers' DSA models patched onto the ops against the originals.

Tiny random models at the real attention geometry (kv_lora_rank 512, RoPE 64, indexer 64 or 32 heads x 128; for
GLM-5.3-Flash no RoPE and pools of 16 tokens behind a linear-attention layer), two DSA layers, a batch of two rows,
one left-padded. The original runs in float32 with its indexer scoring FP8-rounded queries and keys (pool keys with
pools; the selection the ops make; transformers' own indexer skips FP8), so both select the same keys; the patched
model (same weights) must then match each attention layer within the attention contract's error and ``generate()``
the same greedy tokens.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import sparse_dsa_ops as dsa
from sparse_dsa_ops.integrations import transformers as integration

transformers = pytest.importorskip("transformers")
if not all(
    hasattr(transformers, n)
    for n in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration")
):
    pytest.skip("this transformers has no DeepseekV32 / GlmMoeDsa / Glm5Next models", allow_module_level=True)

SEQ, PAD, NEW_TOKENS = 48, 9, 16
# attention outputs relative to their largest magnitude: bf16 operands of the ops (q, the latent) against the
# float32 original; packed FP8 rows add their quantization
ATTN_TOL = {"bf16": 2e-2, "packed": 6e-2}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # the GPU runs the ops' kernels


def tiny_config(name: str, index_topk: int):
    if name == "Glm5Next":
        return tiny_kpool_config(index_topk)
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


def tiny_kpool_config(index_topk: int):
    """GLM-5.3-Flash: a linear-attention (KDA) layer, then a full and a shared DSA layer (NoPE, pools of 16)."""
    text = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=3,
        # every transformers version maps "full_attention" to its own name of a DSA layer
        layer_types=["linear_attention", "full_attention", "full_attention"],
        indexer_types=["full", "full", "shared"],
        mlp_layer_types=["dense"] * 3,
        linear_num_heads=2,
        linear_head_dim=32,
        hc_sinkhorn_iters=3,  # of 20: the residual streams' routing is not what these tests check, and costs ops
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_rope_head_dim=0,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=index_topk,
        index_head_dim=128,
        index_n_heads=32,
        index_kpool=KPOOL,
        max_position_embeddings=256,
        pad_token_id=0,
        initializer_range=0.05,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32)
    return transformers.Glm5NextConfig(text_config=text, vision_config={**vision, "projection_intermediate_size": 32})


MODELS = {
    "DeepseekV32": "DeepseekV32ForCausalLM",
    "GlmMoeDsa": "GlmMoeDsaForCausalLM",
    "Glm5Next": "Glm5NextForConditionalGeneration",
}
INDEX_ROPE = {"DeepseekV32": "apply_rotary_pos_emb", "GlmMoeDsa": "apply_rotary_pos_emb_interleave"}
KPOOL = 16
# top-k tokens: 2 pools of 16 for GLM-5.3-Flash, so that the 3 complete pools of the full row's prompt lose one
INDEX_TOPK = {"DeepseekV32": 24, "GlmMoeDsa": 24, "Glm5Next": 2 * KPOOL}


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the indexer's FP8 quantization and back (float32)."""
    values, scale = dsa.quant_index(x.to(torch.bfloat16))
    return values.float() * scale.unsqueeze(-1)


def fp8_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, cache=None, **kwargs):
    """transformers' indexer forward with FP8-rounded queries and keys: the selection the ops make."""
    cache = kwargs.get("past_key_values", cache)  # the cache's name before transformers 5.24
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


def fp8_kpool_indexer(indexer) -> None:
    """transformers' k-pool indexer with FP8-rounded queries and pool keys, the keys compressed with bfloat16 weights,
    products and sum as the ops compress them (and as transformers does in a bfloat16 model); a gate and ``ape`` that
    differ per channel and position (transformers initializes them constant)."""
    torch.nn.init.normal_(indexer.index_kpool_compress_gate, std=0.05)
    torch.nn.init.normal_(indexer.index_kpool_compress_ape, std=0.5)
    dim = indexer.head_dim
    indexer.wq_b.register_forward_hook(lambda _m, _a, q: fp8_rounded(q.unflatten(-1, (-1, dim))).flatten(-2))
    pooled_states = indexer.get_pooled_states

    def fp8_pooled_states(packed_states):
        _, tokens, complete = pooled_states(packed_states)  # [B, P, kpool] (-1 past the keys), [B, P]
        keys, gates, _ = packed_states.split([dim, dim, 1], dim=-1)  # [B, S, D] each
        rows, at = torch.arange(len(tokens), device=tokens.device)[:, None, None], tokens.clamp(min=0)
        weights = (gates[rows, at] + indexer.index_kpool_compress_ape).softmax(dim=2).bfloat16()  # [B, P, kpool, D]
        pooled = (weights * keys[rows, at].bfloat16()).float().sum(dim=2)  # [B, P, D]
        return fp8_rounded(pooled), tokens, complete

    indexer.get_pooled_states = fp8_pooled_states


def model_pair(name: str, kv_cache: str, device: str = "cpu"):
    """``(original, patched)``: the float32 original with the FP8-emulating indexer, and a patched copy."""
    torch.manual_seed(0)
    config = tiny_config(name, INDEX_TOPK[name])
    original = getattr(transformers, MODELS[name])(config).eval()
    for module in original.modules():
        if hasattr(module, "index_kpool"):
            fp8_kpool_indexer(module)
        elif type(module).__name__.endswith("Indexer"):
            module._rope_name = INDEX_ROPE[name]
            module.forward = types.MethodType(fp8_indexer_forward, module)
    patched = getattr(transformers, MODELS[name])(config).eval()
    patched.load_state_dict(original.state_dict())
    return original.to(device), integration.patch_model(patched.to(device), kv_cache)


def batch(device: str = "cpu"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0  # the second row left-padded
    ids[1, :PAD] = 0
    return ids.to(device), mask.to(device)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache", ["bf16", "packed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_attention_layers_match_the_original(name, kv_cache, device):
    # each patched layer on the original's inputs to that layer (no error carried over from the layer before); a
    # shared layer gets the patched full layer's selection, as in the model
    original, patched = model_pair(name, kv_cache, device)
    ids, mask = batch(device)
    real = mask.bool()  # padding tokens' outputs are not used by the model
    selection = None
    io = layer_io(original, ids, mask)
    assert len(io) == 2
    for layer, ((args, kwargs, want), attn) in enumerate(zip(io, dsa_attentions(patched))):
        # without the original's cache (named past_key_values before transformers 5.24)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
        kwargs["prev_topk_indices"] = selection
        with torch.no_grad():
            out = attn(*args, **kwargs)
        got = out[0].float()
        selection = out[2] if len(out) == 3 else None
        assert got.isfinite().all(), f"layer {layer}: inf or NaN"
        err = (got - want)[real].abs().max() / want[real].abs().max()
        assert err < ATTN_TOL[kv_cache], f"layer {layer}: relative error {err:.3g}"


# Greedy tokens may part where the original's two best logits are within this fraction of its largest: the attention's
# bf16 error (ATTN_TOL) carried through the layers to a random tiny model's near ties, which the GPU's summation orders
# may resolve either way (an H100 parted DeepSeek-V3.2's row at a gap of 1.5% of the largest logit)
NEAR_TIE = 3e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_gives_the_originals_greedy_tokens(name, device):
    original, patched = model_pair(name, "bf16", device)
    ids, mask = batch(device)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    want = original.generate(**kwargs, output_scores=True, return_dict_in_generate=True)
    got = patched.generate(**kwargs)
    assert got.shape == want.sequences.shape == (2, SEQ + NEW_TOKENS)
    for row in range(2):  # the same tokens, or the same until a step where the original's best two logits tie
        differ = (got[row, SEQ:] != want.sequences[row, SEQ:]).nonzero()
        if len(differ):
            step = differ[0].item()
            logits = want.scores[step][row].float()  # [vocab], the original's at the first differing step
            gap = logits[want.sequences[row, SEQ + step]] - logits[got[row, SEQ + step]]
            assert gap <= NEAR_TIE * logits.abs().max(), f"row {row}, step {step}: a logit gap of {gap:.3g}"


@pytest.mark.parametrize("name", ["GlmMoeDsa", "Glm5Next"])
def test_the_cache_reports_its_length_and_grows(name):
    _, patched = model_pair(name, "packed")
    ids, mask = batch()
    with torch.no_grad():
        out = patched(input_ids=ids, attention_mask=mask, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    layer = integration.paged_dsa_layer_class()
    full, shared = [x.state for x in cache.layers if isinstance(x, layer)]
    assert len(cache.layers) == patched.config.get_text_config().num_hidden_layers  # a linear layer keeps its cache
    assert cache.get_seq_length() == SEQ
    row_bytes = dsa.KCacheLayout(512, patched.config.get_text_config().qk_rope_head_dim).row_bytes  # 656, 528
    assert full.kv.dtype == torch.uint8 and full.kv.shape == (2 * full.cap, row_bytes)
    assert shared.index is None  # the shared layer keeps no index keys
    assert not full.valid[1, :PAD].any() and full.valid[1, PAD:SEQ].all()
    if name == "Glm5Next":  # one index row per complete pool: 3 of the first row's 48 tokens, 2 of the second's 39
        stored = [dsa.gather_index_k(full.index, b * full.icap + torch.arange(full.icap))[1] > 0 for b in range(2)]
        assert [x.sum().item() for x in stored] == [3, 2] and all(x[: x.sum()].all() for x in stored)


def test_kpool_cache_holds_each_complete_pool_however_the_tokens_arrive():
    # GLM-5.3-Flash's full DSA layer on 64 tokens (the second row's first 9 padding), in one call and in chunks
    # whose single tokens 56 and 63 complete a pool of the second and the first row: index row j of row b must be
    # the gated average of the row's tokens first_b + 16 j .. first_b + 16 j + 15, stored once its last token came,
    # and the outputs must not depend on how the tokens arrived
    _, patched = model_pair("Glm5Next", "packed")
    attn = dsa_attentions(patched)[0]
    idx = attn.indexer
    total = SEQ + NEW_TOKENS
    hidden = torch.randn(2, total, 128, generator=torch.Generator().manual_seed(2))
    valid = torch.cat([batch()[1].bool(), torch.ones(2, NEW_TOKENS, dtype=torch.bool)], dim=1)  # [2, total]
    with torch.no_grad():
        keys = idx.k_norm(idx.wk(hidden)).to(torch.bfloat16).float()  # [2, total, D]
        gates = hidden @ idx.index_kpool_compress_gate.T  # [2, total, D]
    outputs = []
    for bounds in ([0, total], [0, 37, 40, 55, 56, 57, 63, total]):
        cache = transformers.DynamicCache()
        with torch.no_grad():
            out = [
                attn(hidden[:, s:e], attention_mask=valid[:, s:e] if e - s > 1 else None, cache=cache)[0]
                for s, e in zip(bounds, bounds[1:])
            ]
        outputs.append(torch.cat(out, dim=1))
        state = cache.layers[attn.layer_idx].state
        for b, first in enumerate([0, PAD]):
            pools = (total - first) // KPOOL  # 4 and 3
            tokens = first + torch.arange(pools * KPOOL).view(pools, KPOOL)  # [pools, kpool]
            weights = (gates[b, tokens] + idx.index_kpool_compress_ape).softmax(dim=1)  # [pools, kpool, D]
            want = (weights * keys[b, tokens]).sum(dim=1)  # [pools, D]
            values, scale = dsa.gather_index_k(state.index, b * state.icap + torch.arange(pools + 1))
            got = values.float() * scale[:, None]  # [pools + 1, D]
            assert scale[pools] == 0, f"row {b}: an incomplete pool was stored"
            # FP8 e4m3: half a unit in the last place is 1/16 of the value; bfloat16 roundings below that
            err = (got[:pools] - want).abs() - want.abs() / 16
            assert (err <= want.abs().max() * 2**-8).all(), f"row {b}: pool keys"
    real = valid
    err = (outputs[1] - outputs[0])[real].abs().max() / outputs[0][real].abs().max()
    assert err < 1e-3


def test_unsupported_models_and_settings_say_so():
    with pytest.raises(NotImplementedError, match="Linear is not supported"):
        integration.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="has no DSA attention module"):
        integration.patch_model(type("Glm5NextForConditionalGeneration", (torch.nn.Module,), {})())
    _, patched = model_pair("DeepseekV32", "bf16")
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        integration.patch_model(patched, "fp16")


def layer_example():
    """``examples.transformers_layer`` from the repository root (pytest puts only ``tests/`` on the path)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("examples.transformers_layer")


def test_the_layer_example_times_both_models_at_smoke_size(tmp_path, capsys):
    # the script's CPU path end to end: a prefill row and a decode row, each with the patched and the original
    # layer's time, and the same four measurements in its JSON
    path = tmp_path / "layer.json"
    layer_example().main(["--device", "cpu", "--tokens", "64", "--runs", "1", "--json", str(path)])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines if line.startswith(("prefill ", "decode "))}
    assert set(rows) == {"prefill", "decode"}
    for line in rows.values():
        words = line.split()
        assert words[1] == "64" and "does not fit" not in line
        assert sum(unit in ("ms", "µs") for unit in words) == 2, line  # the patched and the original time
    record = json.loads(path.read_text())
    got = {(r["case"], r["model"]) for r in record["rows"] if r["fits"] and r["us"] > 0}
    assert got == {(case, model) for case in ("prefill", "decode") for model in ("patched", "original")}


def test_the_layer_examples_random_cache_feeds_the_originals_decode_step():
    # where the original's prefill does not fit, its decode step runs on random rows shaped as the layer's own cache
    # (latents, or per-head keys and values in transformers 5.17): the step must read them all and append its token
    example = layer_example()
    model = example.build_model(example.CPU_SIZE, torch.device("cpu"))
    cache = example.random_cache(model, 64)
    assert cache.get_seq_length() == 64
    us, _, cache = example.measure(model, 1, lambda: cache, 1)
    assert us > 0 and cache.get_seq_length() == 66  # the warm-up step and the timed one


@pytest.mark.parametrize(
    "argv", [["--tokens", "0"], ["--kv-cache", "fp8"], ["--device", "tpu"], ["--device", "cpu", "--tokens", "8192"]]
)
def test_the_layer_example_refuses_bad_arguments_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        layer_example().main(argv)
    assert stop.value.code == 2
    assert "error: " in capsys.readouterr().err.splitlines()[-1]
