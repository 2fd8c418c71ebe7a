"""What ``patch_model`` buys on one DSA attention layer of DeepSeek-V3.2: time and memory against the original.

The layer is transformers' ``DeepseekV32Attention`` (``model.model.layers[0].self_attn``: projections, indexer,
attention, output projection; not the norms or MLP of its decoder layer), called directly at DeepSeek-V3.2's public
attention dimensions (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, indexer
64 heads x 128, top-k 2048, YaRN), random bfloat16 weights, one request. For each T of ``--tokens``: a prefill of T
tokens into an empty cache, then one decode step after them (S = T + 1 keys), eager: patch_model supports neither
CUDA graphs nor ``torch.compile`` of it. Time: CUDA events, the median of ``--runs`` calls after a warm-up call.
Peak: the most ``torch.cuda.max_memory_allocated()`` reaches in a call minus the weights, so the call's inputs (the
boolean causal mask ``[1, 1, T, S]`` that the model builds for either is T * S bytes) and cache count. Where the
original runs out of GPU memory (its prefill at 32768 tokens) the table says "does not fit", and its decode step runs
on a cache of T random rows. ``sparse_dsa_ops.warmup`` compiles the kernels first (a minute or two on a fresh
machine; TileLang's disk cache makes the next run's fast)::

    python -m examples.transformers_layer --tokens 32768   # default: 4096 32768; --kv-cache bf16; --json PATH

Without a GPU (or with ``--device cpu``) it is a smoke run: :data:`CPU_SIZE` at 64 tokens, on the host clock.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM, DynamicCache

import sparse_dsa_ops as dsa
from sparse_dsa_ops.integrations.transformers import PAGE, patch_model

__all__ = ["PUBLIC", "CPU_SIZE", "build_model", "layer_inputs", "measure", "measure_model", "table", "main"]

# DeepSeek-V3.2's config.json; YaRN's mscale sets the attention's scale (0.1352), which the kernels compile in
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096)
YARN.update(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
PUBLIC = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512)
PUBLIC.update(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_parameters=YARN)
PUBLIC.update(index_n_heads=64, index_head_dim=128, index_topk=2048)
# a second on a CPU: 4 heads and narrow projections; the latent rows (512 + 64) and the indexer's 64 x 128 stay
CPU_SIZE = {**PUBLIC, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64}
CPU_SIZE.update(qk_nope_head_dim=32, v_head_dim=32, index_topk=24)
# the original's indexer holds its [T, 64, S] float32 scores twice at once: 8 GiB at 4096 tokens, 512 GiB at 32768
DEFAULT_TOKENS = {"cuda": [4096, 32768], "cpu": [64]}
CPU_MAX_TOKENS = 1024  # the original's T * 64 * S indexer scores take minutes beyond this on a CPU
GIB = 2**30


def build_model(dims: dict, device: torch.device) -> DeepseekV32ForCausalLM:
    """One layer of ``dims`` with random bfloat16 weights on ``device``; a vocabulary of 256 and an MLP of width 1
    (the config's least), which nothing here runs."""
    config = DeepseekV32Config(num_hidden_layers=1, vocab_size=256, intermediate_size=1, **dims)
    torch.manual_seed(0)
    with device:  # initialized where it runs, in bfloat16; the RoPE frequencies stay float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def layer_inputs(model, tokens: int, start: int) -> dict:
    """The attention module's arguments for ``tokens`` new tokens after ``start`` cached ones: hidden states
    ``[1, T, hidden]`` bfloat16, the model's causal mask ``[1, 1, T, start + T]`` bool, positions and RoPE."""
    dev = model.device
    hidden = torch.randn(1, tokens, model.config.hidden_size, device=dev, dtype=torch.bfloat16)
    positions = torch.arange(start, start + tokens, device=dev)[None]  # [1, T]
    mask = torch.ones(tokens, start + tokens, dtype=torch.bool, device=dev).tril(start)[None, None]
    rope = model.model.rotary_emb(hidden, positions)
    return dict(hidden_states=hidden, attention_mask=mask, position_ids=positions, position_embeddings=rope)


def cache_argument(attn) -> str:
    """The name under which the original ``attn.forward`` takes the cache: ``cache``, or ``past_key_values`` in
    transformers before 5.24 (whose forward would take ``cache`` into its ``**kwargs`` and run without one)."""
    return "cache" if "cache" in inspect.signature(type(attn).forward).parameters else "past_key_values"


def timed_call(attn, kwargs: dict, weights: int) -> tuple[float, float | None]:
    """Microseconds of ``attn(**kwargs)`` and, on a GPU, its peak GiB above ``weights`` bytes."""
    if kwargs["hidden_states"].device.type != "cuda":
        start = time.perf_counter()
        attn(**kwargs)
        return 1e6 * (time.perf_counter() - start), None
    torch.cuda.synchronize()  # an empty queue: the events time this call's launches and kernels alone
    torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    attn(**kwargs)
    end.record()
    end.synchronize()
    return 1e3 * begin.elapsed_time(end), (torch.cuda.max_memory_allocated() - weights) / GIB


@torch.no_grad()
def measure(model, tokens: int, new_cache: Callable, runs: int) -> tuple[float, float | None, DynamicCache]:
    """Median microseconds and largest peak GiB (None on a CPU) of ``runs`` calls of the attention module on
    ``tokens`` new tokens after a warm-up call (kernels load, the patched pools grow), each on ``new_cache()`` and
    inputs that follow its cached tokens; and the last call's cache."""
    attn = model.model.layers[0].self_attn
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    samples = []
    for _ in range(runs + 1):
        cache = new_cache()
        start = cache.get_seq_length()
        kwargs = {**layer_inputs(model, tokens, start), cache_argument(attn): cache}
        samples.append(timed_call(attn, kwargs, weights))
        if cache.get_seq_length() != start + tokens:  # a decode step timed without its cached keys would mislead
            raise RuntimeError(f"the layer left {cache.get_seq_length()} tokens in its cache, not {start + tokens}")
    peaks = [s[1] for s in samples[1:] if s[1] is not None]
    return statistics.median(s[0] for s in samples[1:]), max(peaks, default=None), cache


def fits(fn: Callable, *args):
    """``fn(*args)``, or None where the GPU runs out of memory (freed again before returning)."""
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        pass
    gc.collect()  # the failed call's tensors, now that its traceback is gone
    torch.cuda.empty_cache()
    return None


@torch.no_grad()
def random_cache(model, tokens: int) -> DynamicCache:
    """The original's cache after ``tokens`` random bfloat16 rows shaped as the layer caches its own, which one
    token through the layer shows: the latent ``[1, 1, T, 512]`` and RoPE tail ``[1, 1, T, 64]`` (the per-head keys
    ``[1, 128, T, 192]`` and values ``[1, 128, T, 128]`` in transformers 5.17), and index keys ``[1, T, 128]``."""
    attn = model.model.layers[0].self_attn
    probe = DynamicCache(config=model.config)
    attn(**layer_inputs(model, 1, 0), **{cache_argument(attn): probe})
    layer = probe.layers[attn.layer_idx]

    def rows(like: torch.Tensor) -> torch.Tensor:  # [B, ..., 1, W] -> [B, ..., T, W]
        shape = (*like.shape[:-2], tokens, like.shape[-1])
        return torch.randn(shape, device=model.device, dtype=torch.bfloat16)

    cache = DynamicCache(config=model.config)
    cache.update(rows(layer.keys), rows(layer.values), attn.layer_idx)
    cache.update_indexer(rows(layer.indexer_keys), attn.layer_idx)
    return cache


def measure_model(model, label: str, tokens: Sequence[int], runs: int) -> list[dict]:
    """A prefill and a decode row per T for ``model`` as it is now (``label``: "original" or "patched")."""

    def row(case: str, t: int, got: tuple | None, note: str | None = None) -> dict:
        us, gib = got[:2] if got else (None, None)
        return dict(case=case, tokens=t, model=label, fits=got is not None, us=us, peak_gib=gib, note=note)

    rows = []
    for t in tokens:
        print(f"{label}: a prefill of {t} tokens, then a decode step", file=sys.stderr, flush=True)
        prefill = fits(measure, model, t, lambda: DynamicCache(config=model.config), runs)
        rows.append(row("prefill", t, prefill))
        cache, note = (prefill[2], None) if prefill else (None, None)
        del prefill
        if cache is None and label == "original":  # its decode step fits where its prefill does not
            cache, note = random_cache(model, t), "on a cache of random rows"
        decode = None if cache is None else fits(measure, model, 1, lambda c=cache: c, runs)
        rows.append(row("decode", t, decode, note))
        del cache, decode  # the next T starts from the weights alone
    return rows


def warm_up(model, kv_cache: str) -> None:
    """Compile the kernels the patched layer runs, in parallel, before anything is timed."""
    attn, idx = model.model.layers[0].self_attn, model.model.layers[0].self_attn.indexer
    print(f"compiling the patched layer's kernels for a {kv_cache} pool (progress on stderr)", flush=True)
    geometry = dict(heads=attn.num_heads, d_nope=attn.kv_lora_rank, d_rope=attn.qk_rope_head_dim)
    indexer = dict(index_heads=idx.n_heads, index_dim=idx.head_dim, index_page=PAGE, topk_k=idx.index_topk)
    # only what the patched forward calls: no lengths, unrounded scales, int64 slots, store_k_cache for packed rows
    calls = dict(kv_kinds=(kv_cache,), topk_length=(False,), round_scale=(False,), slot_dtypes=("int64",))
    dsa.warmup(**geometry, **indexer, **calls, sm_scale=float(attn.scaling), cache_ops=kv_cache == "packed", workers=16)


def table(rows: Sequence[dict]) -> str:
    """One line per case and T: the patched and the original call side by side, and the speed-up."""

    def cells(r: dict) -> str:
        if not r["fits"]:
            return f"{'does not fit':>13}{'':>10}"
        mark = "*" if r["note"] else ""
        us = f"{r['us'] / 1e3:.2f} ms{mark}" if r["us"] >= 1e3 else f"{r['us']:.0f} µs{mark}"
        return f"{us:>13}{'-' if r['peak_gib'] is None else format(r['peak_gib'], '.2f'):>10}"

    by = {(r["case"], r["tokens"], r["model"]): r for r in rows}
    lines = [f"{'case':8}{'T':>7}  {'patched':>13}{'peak GiB':>10}  {'original':>13}{'peak GiB':>10}{'speed-up':>10}"]
    for case, t in dict.fromkeys((r["case"], r["tokens"]) for r in rows):
        p, o = by[case, t, "patched"], by[case, t, "original"]
        speed = f"{o['us'] / p['us']:.1f}x" if p["fits"] and o["fits"] else "-"
        lines.append(f"{case:8}{t:>7}  {cells(p)}  {cells(o)}{speed:>10}")
    if any(r["note"] for r in rows):
        lines.append("* the original's decode step on a cache of T random rows: its prefill does not fit")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m examples.transformers_layer [--tokens T ...] [--kv-cache packed|bf16] [--device D] [--runs N]
    [--json PATH]``: print the table, and write its rows as JSON."""
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="prefill lengths T (default 4096 32768; CPU: 64)")
    parser.add_argument("--kv-cache", choices=("packed", "bf16"), default="packed", help="the patched latent pool")
    parser.add_argument("--device", choices=["cpu", *(["cuda", *gpus] if gpus else [])], help="default: the GPU")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per case, after one warm-up call")
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if gpus else "cpu"))
    tokens = args.tokens or DEFAULT_TOKENS[device.type]
    if min(tokens) < 1 or args.runs < 1:
        parser.error("--tokens and --runs take positive integers")
    if device.type == "cpu" and max(tokens) > CPU_MAX_TOKENS:
        parser.error(f"--tokens {max(tokens)}: a CPU run takes at most {CPU_MAX_TOKENS} tokens")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: no directory {args.json.parent}")
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # the events and the peak statistics are the current GPU's
    model = build_model(PUBLIC if cuda else CPU_SIZE, device)
    if cuda:
        warm_up(model, args.kv_cache)
    rows = measure_model(model, "original", tokens, args.runs)
    patch_model(model, args.kv_cache)
    rows += measure_model(model, "patched", tokens, args.runs)
    where = torch.cuda.get_device_name() if cuda else "CPU smoke size: 4 heads, top-k 24, host clock, no memory figures"
    print(f"DeepseekV32Attention of DeepSeek-V3.2, one request, kv_cache={args.kv_cache!r}, decode eager; {where}")
    print(table(rows))
    if args.json:
        record = dict(device=where, kv_cache=args.kv_cache, runs=args.runs, rows=rows)
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
