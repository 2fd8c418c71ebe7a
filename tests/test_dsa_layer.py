"""The whole DSA layer of ``examples/dsa_layer.py`` against its dense twin (``dense_reference``).

A batch of three requests of different lengths is prefilled into paged caches whose page table is a random
permutation of the pages (and whose bytes start as NaN, so a read of an unwritten slot shows), then eight decode
steps run through ``DecodeStep``: ``torch.compile(fullgraph=True)``, and on a GPU a CUDA graph replayed on new tokens.
After every forward pass each request is recomputed densely in plain torch from the same projections: full float32
index logits from the same FP8 values, the same order rule (logit descending, position ascending), softmax over the
selected rows of the dequantized latent cache. The selected sets must be equal (on a GPU, up to entries whose logit
lies within a small band of the row's k-th best, where sums in another order may swap two neighbours) and
the outputs must agree to bfloat16 accuracy. CPU cases run small head counts and short contexts with the real row
geometry (512 + 64 and 512 + 0 latent rows, index dim 128); ``cuda`` cases run the models' head counts.
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch


def _import_example():
    """``examples.dsa_layer`` from the repository root (pytest puts only ``tests/`` on the path)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("examples.dsa_layer")


L = _import_example()

SEQ_LENS_CPU = (120, 29, 77)  # three requests; the top-k (48) is smaller than two of them
SEQ_LENS_GPU = (2600, 300, 3300)  # two requests longer than the 2048 rows selected
DECODE_STEPS = 8
# A selection may differ from the twin's only in entries whose logits lie this close (relative to the row's largest
# |logit|) to the row's k-th best, and in at most MAX_SWAPS entries per row. On the CPU the sets must be equal; on a
# GPU the compiled projections (another float32 rounding of a norm or a rotation can flip one FP8 input) and the
# kernels' accumulation order may move a logit a little, and two neighbours at the k-th place may swap.
BAND = {"cpu": 0.0, "cuda": 1e-2}
MAX_SWAPS = {"cpu": 0, "cuda": 8}
# Outputs: both sides round the latent output to bfloat16 and share the output projection; the GPU attention rounds
# its probabilities to bfloat16 as well, and the compiled decode step projects q with other bfloat16 roundings than
# the twin's eager projections (measured on an H200: 0.5% rms in prefill, up to 1.0% in decode at 8 and 16 heads,
# where fewer heads average the output projection's error). Bounds relative to the twin's largest |y| (max) and its
# norm (rms).
OUT_TOL = {"cpu": dict(max=2**-7, rms=2**-9), "cuda": dict(max=2**-5, rms=2**-6)}


def tiny(config, **changes):
    """``config`` at the example's CPU size (few heads and a small top-k, the real latent rows and indexer head dim),
    with ``changes``."""
    return replace(L.cpu_size(config), **changes)


CONFIGS_PUBLIC = [L.DEEPSEEK_V32, L.GLM_5, L.GLM_53_FLASH]
CPU_CONFIGS = [
    tiny(L.DEEPSEEK_V32),
    # the other rounding of each cache's scales
    tiny(L.GLM_53_FLASH, index_round_scale=False, kv_round_scale=True),
]
GPU_CONFIGS = [L.DEEPSEEK_V32, L.DEEPSEEK_V32_TP8, L.GLM_5_TP8, L.GLM_53_FLASH, L.GLM_53_FLASH_TP8]


def rows_of(proj, rows):
    """The projections of the tokens ``rows`` of a batch."""
    return L.Projection(*(None if field is None else field[rows] for field in proj))


def positions_of(slots, table_row, page, pool_slots):
    """Positions ``[q, K]`` int64 of the request whose pages are ``table_row`` for its selected ``slots [q, K]``:
    -1 for -1, and -2 for a slot outside the request's pages."""
    pages = table_row.long().unsqueeze(-1) * page + torch.arange(page, device=slots.device)  # [max_pages, page]
    lookup = torch.full((pool_slots,), -2, dtype=torch.int64, device=slots.device)
    lookup[pages.flatten()] = torch.arange(pages.numel(), device=slots.device)
    ids = slots.long()
    inside = (ids >= 0) & (ids < pool_slots)
    return torch.where(inside, lookup[ids.clamp(0, pool_slots - 1)], torch.where(ids == -1, -1, -2))


def as_mask(positions, n):
    """``[q, n]`` bool of the positions ``[q, K]`` (-1 entries ignored)."""
    mask = torch.zeros(positions.shape[0], n + 1, dtype=torch.bool, device=positions.device)
    return mask.scatter_(1, torch.where(positions >= 0, positions, n), True)[:, :n]


def check_selection(got, want, logits, device_type, kpool=1):
    """``got`` / ``want``: selected positions ``[q, K]`` (ascending, then -1) of the layer and of the twin; ``logits``
    the twin's per position (a pooled indexer's: the logit of the position's pool, a swap moving ``kpool``
    positions)."""
    n = logits.shape[1]
    assert (got >= -1).all() and (got < n).all(), "a selected slot outside the request's pages or past its end"
    valid = got >= 0
    assert torch.equal(valid, valid.cummin(dim=1).values), "-1 padding must follow the selected entries"
    assert (got[:, 1:] > got[:, :-1])[valid[:, 1:]].all(), "selected positions must ascend (no repeats)"
    got_mask, want_mask = as_mask(got, n), as_mask(want, n)
    assert torch.equal(got_mask.sum(1), want_mask.sum(1)), "a row selected a different number of entries"
    swapped = got_mask ^ want_mask  # [q, n]
    if not swapped.any():
        return
    kth = torch.where(want_mask, logits, math.inf).amin(dim=1, keepdim=True)  # [q, 1]: the lowest selected logit
    scale = torch.where(logits.isfinite(), logits.abs(), 0.0).amax(dim=1, keepdim=True)  # [q, 1]
    near = (logits - kth).abs() <= BAND[device_type] * scale  # [q, n]
    assert near[swapped].all(), "an entry far from the k-th best logit was swapped"
    assert swapped.sum(1).max() <= 2 * MAX_SWAPS[device_type] * kpool


def check_output(got, want, device_type):
    assert got.isfinite().all(), "NaN or inf: a read of a poisoned (never written) slot?"
    tol = OUT_TOL[device_type]
    err = got.float() - want.float()
    assert err.abs().max() <= tol["max"] * want.float().abs().max()
    assert err.norm() <= tol["rms"] * want.float().norm()


def check_request(layer, cache, request, proj, queries, y, slots):
    """One request's outputs ``y [q, hidden]`` and selected ``slots [q, K]`` against the dense twin."""
    device_type = y.device.type
    got = positions_of(slots, cache.page_table[request], cache.page, cache.kv.shape[0] * cache.page)
    # the twin attends to the rows the layer selected: a swap the selection check allows would otherwise move y by
    # the weight of the swapped rows
    want_positions, logits, want_y = L.dense_reference(layer, proj, queries.long(), attend_to=got)
    check_selection(got, want_positions, logits, device_type, layer.config.kpool)
    check_output(y, want_y, device_type)


def run_flow(config, device, seq_lens, backend):
    """Prefill ``seq_lens``, then DECODE_STEPS decode steps, each pass checked against the twin; returns the step."""
    layer = L.DSALayer(config, device, seed=1)
    cache = L.PagedCache.allocate(config, len(seq_lens), max(seq_lens) + DECODE_STEPS, device, seed=2)
    table = cache.page_table.flatten()
    assert not torch.equal(table, table.sort().values), "the page table must not hand out pages in order"
    gen = torch.Generator().manual_seed(3)

    x = torch.randn(sum(seq_lens), config.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    batch = L.prefill_batch(seq_lens, device)
    y, indices = layer.prefill(x, batch, cache)
    proj = layer.project(x, batch.positions)
    history = []
    for b, rows in enumerate(torch.arange(x.shape[0], device=device).split(list(seq_lens))):
        history.append([rows_of(proj, rows)])
        check_request(layer, cache, b, history[b][0], batch.positions[rows], y[rows], indices[rows])

    step = L.DecodeStep(layer, cache, backend=backend)
    positions = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    for _ in range(DECODE_STEPS):
        x = torch.randn(len(seq_lens), config.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
        y, indices = (t.clone() for t in step(x, positions))
        proj = layer.project(x, positions)
        for b in range(len(seq_lens)):
            history[b].append(rows_of(proj, slice(b, b + 1)))
            check_request(
                layer, cache, b, L.cat_projections(history[b]), positions[b : b + 1], y[b : b + 1], indices[b : b + 1]
            )
        positions += 1
    return step


def test_model_geometry():
    # the public configs: DeepSeek-V3.2, GLM-5 and GLM-5.3-Flash
    assert L.DEEPSEEK_V32.layout.row_bytes == L.GLM_5.layout.row_bytes == 656 and L.GLM_53_FLASH.layout.row_bytes == 528
    dims = [(c.hidden, c.heads, c.q_lora, c.qk_nope, c.d_rope, c.v_head, c.index_heads) for c in CONFIGS_PUBLIC]
    assert dims == [
        (7168, 128, 1536, 128, 64, 128, 64),
        (6144, 64, 2048, 192, 64, 256, 32),
        (4096, 64, 1536, 256, 0, 256, 32),
    ]
    assert [(c.index_rope, c.kpool, c.pool_topk) for c in CONFIGS_PUBLIC] == [
        (64, 1, 2048),
        (64, 1, 2048),
        (0, 16, 128),
    ]
    for config in GPU_CONFIGS:
        assert (config.topk, config.kv_lora, config.index_dim) == (2048, 512, 128)
        assert config.topk_width == (2112 if config.kpool == 16 else 2048)  # 2048 + 15 = 2063, padded to 2112
    # the model's softmax scale: qk_head_dim ** -0.5, times YaRN's mscale ** 2 for DeepSeek-V3.2 (factor 40)
    assert math.isclose(L.DEEPSEEK_V32.sm_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel_tol=1e-12)
    assert round(L.DEEPSEEK_V32.sm_scale, 4) == 0.1352
    assert L.GLM_5.sm_scale == L.GLM_53_FLASH.sm_scale == 0.0625  # 192 + 64 and 256 + 0, no YaRN
    assert (L.DEEPSEEK_V32_TP8.heads, L.GLM_5_TP8.heads, L.GLM_53_FLASH_TP8.heads) == (16, 8, 8)
    assert (CPU_CONFIGS[0].topk, CPU_CONFIGS[0].topk_width) == (48, 64)
    assert (CPU_CONFIGS[1].pool_topk, CPU_CONFIGS[1].topk_width) == (3, 64)  # 3 pools of 16 and a tail of 15


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda c: c.name)
def test_layer_against_dense_twin(config):
    run_flow(config, "cpu", SEQ_LENS_CPU, backend="aot_eager")


@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda c: c.name)
def test_bench_stages_are_the_layer(config):
    # bench_layer times decode_stages / prefill_stages: they must compute exactly what the layer does
    layer = L.DSALayer(config, seed=1)
    caches = [L.PagedCache.allocate(config, 2, 80, seed=2) for _ in range(2)]
    gen = torch.Generator().manual_seed(4)
    batch = L.prefill_batch((70, 9))
    x = torch.randn(79, config.hidden, generator=gen).bfloat16()
    want = layer.prefill(x, batch, caches[0])
    got = L.run_stages(L.prefill_stages(layer, caches[1], batch), {"x": x})
    assert torch.equal(got["y"], want[0]) and torch.equal(got["indices"], want[1])
    x, positions = torch.randn(2, config.hidden, generator=gen).bfloat16(), torch.tensor([70, 9], dtype=torch.int32)
    want = layer.decode(x, positions, caches[0].kv, caches[0].index_k, caches[0].page_table, caches[0].index_stage)
    got = L.run_stages(L.decode_stages(layer, caches[1]), {"x": x, "positions": positions})
    assert torch.equal(got["y"], want[0]) and torch.equal(got["indices"], want[1])
    assert torch.equal(caches[0].kv, caches[1].kv) and torch.equal(caches[0].index_k, caches[1].index_k)


@pytest.mark.cuda
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.name)
def test_layer_against_dense_twin_on_gpu(config):
    # the twin projects eagerly; inductor keeps fused intermediates in float32 unless told to round them to
    # bfloat16 as eager does, and one flipped rounding before the FP8 quantization of q moves its index logits
    from torch._inductor import config as inductor_config

    L.warm_up(config)
    with inductor_config.patch(emulate_precision_casts=True):
        step = run_flow(config, "cuda", SEQ_LENS_GPU, backend="inductor")
    assert step.graph is not None, "the decode steps must have replayed a CUDA graph"


@pytest.mark.cuda
def test_bench_layer_runs():
    figures = L.bench_layer(
        L.GLM_53_FLASH_TP8, decode_batch=4, decode_context=4096, prefill_tokens=1024, iters=2, warmup=1
    )
    assert set(figures) == {"decode", "prefill"}
    for phase, us in figures.items():
        assert {"project", "topk", "sparse_attn", "output", "total", "layer"} <= set(us), phase
        assert all(math.isfinite(t) and t > 0 for t in us.values()), (phase, us)
