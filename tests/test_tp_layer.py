"""The tensor-parallel DSA layer of ``examples/tp_layer.py`` against the single-process layer of
``examples/dsa_layer.py``.

Two ranks (gloo on the CPU, NCCL on GPUs) each run their shard of the layer: a prefill of three requests, then
decode steps through ``DecodeStep`` (the compiled graph holding the DSA ops and the all-reduce; on GPUs replayed from
a CUDA graph). The ranks' caches and outputs must be bit-identical to each other; the caches and the selected rows
must equal the single-process layer's (the indexer and the down-projections are replicated, so every rank computes
exactly what one process does); the output may differ from it only by the all-reduce's roundings: each rank's share
of the output projection is rounded to bfloat16 before the sum, which is rounded again.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch


def _import_examples():
    """``examples.dsa_layer`` and ``examples.tp_layer`` from the repository root (pytest puts only ``tests/`` on the
    path; the spawned ranks inherit this path)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("examples.dsa_layer"), importlib.import_module("examples.tp_layer")


L, TP = _import_examples()

WORLD = 2
SEED = 5
SEQ_LENS_CPU = (120, 29, 77)  # the top-k (48) is smaller than two of them
DECODE_STEPS = 3
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff
# Output bounds relative to the single layer's largest |y| (max) and its norm (rms). On the CPU: one rounding of each
# rank's share, one of their sum and the single layer's own, on values no larger than max |y| (plus the rare
# bfloat16 flip of a q or latent-output element that a sliced matmul rounds the other way). On GPUs the compiled
# steps fuse the projections of H and H / N heads differently as well: the bounds of test_dsa_layer's GPU twin.
OUT_TOL = {"cpu": dict(max=(WORLD + 2) * BF16_EPS, rms=BF16_EPS), "cuda": dict(max=2**-5, rms=2**-6)}
CACHES = ("kv", "index_k", "index_stage")

CPU_CONFIGS = [
    TP.small_config(L.DEEPSEEK_V32, WORLD),
    # no RoPE, the k-pool indexer (staged keys), the other rounding of each cache's scales
    replace(TP.small_config(L.GLM_53_FLASH, WORLD), index_round_scale=False, kv_round_scale=True),
]


def as_bytes(t):
    """``t`` as raw bytes: bit-exact comparison, NaN (a poisoned, never written slot) equal to itself."""
    return t.contiguous().flatten().view(torch.uint8)


def check_runs(config, ranks, want, device_type):
    """``ranks``: each rank's :func:`run_layer` results of ``config``; ``want``: the single-process layer's."""
    for name, value in ranks[0].items():
        for r, other in enumerate(ranks[1:], 1):
            assert torch.equal(as_bytes(other[name]), as_bytes(value)), f"{config.name}: {name} of rank {r} != rank 0"
    got = ranks[0]
    assert set(got) == set(want)
    for name in CACHES:
        if name not in want:
            continue
        if device_type == "cpu":
            assert torch.equal(as_bytes(got[name]), as_bytes(want[name])), f"{config.name}: {name}"
        else:  # decode rows come from compiled graphs of H / N and H heads: a rare byte may round the other way
            assert (as_bytes(got[name]) != as_bytes(want[name])).float().mean() <= 1e-3, f"{config.name}: {name}"
    for phase in ("prefill", "decode"):
        indices, want_indices = got[f"{phase}_indices"], want[f"{phase}_indices"]
        if device_type == "cpu":
            assert torch.equal(indices, want_indices), f"{config.name}: {phase} selected other rows"
        else:
            assert (indices != want_indices).float().mean() <= 1e-3, f"{config.name}: {phase} selected other rows"
        y, want_y = got[f"{phase}_y"].float(), want[f"{phase}_y"].float()
        assert y.isfinite().all(), f"{config.name}: NaN or inf in the {phase} output"
        tol, err = OUT_TOL[device_type], y - want_y
        assert err.abs().max() <= tol["max"] * want_y.abs().max(), f"{config.name}: {phase} max error"
        assert err.norm() <= tol["rms"] * want_y.norm(), f"{config.name}: {phase} rms error"


def test_shards_cover_the_layer():
    # the head-indexed weights of the ranks, put back together, are the single layer's; the rest is replicated
    config = CPU_CONFIGS[0]
    full = L.DSALayer(config, seed=SEED)
    shards = [TP.DSALayerShard(config, r, WORLD, seed=SEED) for r in range(WORLD)]
    assert [s.config.heads for s in shards] == [config.heads // WORLD] * WORLD
    assert torch.equal(torch.cat([s.wq_b for s in shards]), full.wq_b)
    assert torch.equal(torch.cat([s.w_uk for s in shards]), full.w_uk)
    assert torch.equal(torch.cat([s.w_uv for s in shards]), full.w_uv)
    assert torch.equal(torch.cat([s.wo for s in shards], dim=1), full.wo)
    for name in ("wq_a", "wkv_a", "kv_norm", "wi_q", "wi_k", "wi_w", "hadamard"):
        assert all(torch.equal(getattr(s, name), getattr(full, name)) for s in shards), name
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        TP.shard_config(config, 3)
    assert (TP.shard_config(L.DEEPSEEK_V32, 8).heads, TP.shard_config(L.GLM_53_FLASH, 8).heads) == (16, 8)


def test_two_ranks_match_the_single_layer(tmp_path):
    ranks = TP.launch(
        TP.save_runs, WORLD, str(tmp_path), CPU_CONFIGS, SEQ_LENS_CPU, DECODE_STEPS, SEED, backend="gloo", join=False
    )
    # the single-process layer runs here while the ranks start
    want = {
        c.name: TP.run_layer(L.DSALayer(c, seed=SEED), SEQ_LENS_CPU, DECODE_STEPS, "cpu", "aot_eager", SEED)[0]
        for c in CPU_CONFIGS
    }
    while not ranks.join():
        pass
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for config in CPU_CONFIGS:
        check_runs(config, [r[config.name] for r in results], want[config.name], "cpu")


@pytest.mark.cuda
def test_ranks_match_the_single_layer_on_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two or more GPUs")
    world = max(n for n in (2, 4, 8) if n <= torch.cuda.device_count())
    configs = [L.DEEPSEEK_V32, L.GLM_53_FLASH]
    seq_lens, steps = TP.SEQ_LENS_GPU, 4
    TP.launch(TP.save_runs, world, str(tmp_path), configs, seq_lens, steps, SEED, backend="nccl")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for config in configs:
        L.warm_up(config)
        want, step = TP.run_layer(L.DSALayer(config, "cuda", SEED), seq_lens, steps, "cuda", "inductor", SEED)
        assert step.graph is not None, "the single layer's decode steps must have replayed a CUDA graph"
        check_runs(config, [r[config.name] for r in results], want, "cuda")
