"""The DSA layer of ``examples/dsa_layer.py`` tensor-parallel over N processes (one per GPU, or CPU processes).

Run it with ``torchrun --nproc-per-node N -m examples.tp_layer [--config NAME] [--check] [--bench]``: NCCL on GPUs
(rank r on ``cuda:r``), gloo and the reference ops at small sizes on CPUs. :func:`launch` starts the same ranks from
Python (the tests use it).

How the layer is split, as SGLang's (``python/sglang/srt/models/deepseek_v2.py`` with its NSA ``Indexer``) and vLLM's
(``vllm/model_executor/models/deepseek_v2.py``) DeepSeek-V3.2 model code split it:

- **Replicated on every rank**: the query and KV down-projections (``Wq_a``, ``Wkv_a``, their norms and the RoPE
  tail) and the whole indexer (its query up-projection, key projection, key norm, head weights, k-pool gate). Both
  engines build these as replicated linears and keep one index-K cache per rank that holds every token; this file
  does the same. Every rank then writes the same latent row and index key of every token into its own caches (the
  caches are bit-identical across ranks) and selects the same top-k rows, so no collective is needed before the
  attention, and the indexer's FP8 queries and logits are never split across ranks.
- **Column-parallel** (split by attention head): the query up-projection ``Wq_b`` and the KV up-projection, that is
  ``W_UK`` (absorbed into q) and ``W_UV`` (applied to the latent output). Rank r owns heads
  ``r * H / N .. (r + 1) * H / N - 1`` and runs ``sparse_attn`` at ``H / N`` heads (DeepSeek-V3.2 at N 8: 16 heads;
  GLM-5 and GLM-5.3-Flash: 8).
- **Row-parallel**: the output projection ``Wo``; each rank multiplies its heads' values by its columns of ``Wo``
  and an all-reduce (sum, in bfloat16, as both engines do) gives every rank the layer's output.

Sharding the indexer by its heads instead would need an all-reduce of the ``[T, W]`` float32 logits before the top-k
(its logit is a sum over heads) — larger than the layer's output and on the critical path — for projections that are
small next to MLA's.

Decode steps run through :class:`~examples.dsa_layer.DecodeStep`: ``torch.compile(fullgraph=True)`` traces the
all-reduce with the DSA ops (dynamo maps ``torch.distributed.all_reduce`` to its functional collective), and on a GPU
the step — projections, cache writes, indexer, top-k, ``sparse_attn`` and the NCCL all-reduce — is captured in one
CUDA graph per rank and replayed with new tokens. The CPU run checks the same compiled graph with gloo; the GPU
capture needs a machine of two or more GPUs.

Letters as in ``examples/dsa_layer.py``; N is the number of ranks.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from examples.dsa_layer import (
    DEEPSEEK_V32,
    GLM_5,
    GLM_53_FLASH,
    DecodeStep,
    DSAConfig,
    DSALayer,
    PagedCache,
    prefill_batch,
    warm_up,
)

__all__ = [
    "TP_CONFIGS",
    "shard_config",
    "small_config",
    "DSALayerShard",
    "run_layer",
    "launch",
    "save_runs",
    "bench_decode",
    "main",
]

# The whole-model configs (the "-tp8" ones of dsa_layer.py are already one rank's share).
TP_CONFIGS = {c.name: c for c in (DEEPSEEK_V32, GLM_5, GLM_53_FLASH)}
SEQ_LENS_GPU = (2600, 300, 3300)
SEQ_LENS_CPU = (120, 29, 77)
BENCH_ITERS = 50


def shard_config(config: DSAConfig, world: int) -> DSAConfig:
    """One rank's share of ``config`` at tensor parallelism ``world``: ``heads / world`` attention heads, everything
    else (the latent rows, the indexer, the page size) unchanged."""
    if world < 1 or config.heads % world:
        raise ValueError(f"{config.name}: {config.heads} heads do not split evenly over {world} ranks")
    return replace(config, name=f"{config.name}-tp{world}", heads=config.heads // world)


def small_config(config: DSAConfig, world: int) -> DSAConfig:
    """``config`` at CPU size with two heads per rank: the real latent rows and indexer head dim, narrow dense
    projections, four indexer heads and a top-k of 48."""
    return replace(
        config,
        name=f"{config.name}-small",
        hidden=256,
        heads=2 * world,
        q_lora=128,
        qk_nope=32,
        v_head=32,
        index_heads=4,
        index_topk=48,
    )


class DSALayerShard(DSALayer):
    """Rank ``rank``'s shard of :class:`~examples.dsa_layer.DSALayer` at tensor parallelism ``world``.

    The weights are those of ``DSALayer(config, seed=seed)`` (drawn on the CPU, so every rank and the single-process
    layer agree), the head-indexed ones cut to this rank's heads: ``Wq_b``'s rows, ``W_UK`` and ``W_UV``, ``Wo``'s
    columns. Its ``config`` is :func:`shard_config`'s, so :meth:`prefill`, :meth:`decode` and
    :class:`~examples.dsa_layer.DecodeStep` run unchanged at ``H / N`` heads; :meth:`output` ends in the all-reduce
    over ``group`` that sums the ranks' shares of the output projection.

    Parameters
    ----------
    config : DSAConfig
        The whole layer's geometry (all heads).
    rank, world : int
        This rank and the number of ranks of ``group``.
    device : where the weights live
    seed : int
    group : torch.distributed.ProcessGroup or None
        The tensor-parallel group (default: the whole world).
    """

    def __init__(
        self,
        config: DSAConfig,
        rank: int,
        world: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        shard = shard_config(config, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of {world} ranks")
        full = DSALayer(config, "cpu", seed)  # checks the geometry and draws every weight in the one order there is
        # nn.Module's own init, not DSALayer's: the buffers are the full layer's, cut, never drawn again
        torch.nn.Module.__init__(self)
        self.config, self.rank, self.world, self.group = shard, rank, world, group
        heads = slice(rank * shard.heads, (rank + 1) * shard.heads)
        cut = {
            "wq_b": full.wq_b.view(config.heads, -1, config.q_lora)[heads].flatten(0, 1),  # [H/N (nope + R), q_lora]
            "w_uk": full.w_uk[heads],  # [H/N, nope, C]
            "w_uv": full.w_uv[heads],  # [H/N, v, C]
            "wo": full.wo.view(config.hidden, config.heads, -1)[:, heads].flatten(1),  # [hidden, H/N v]
        }
        for name, value in full.named_buffers():
            self.register_buffer(name, cut.get(name, value).contiguous().to(device), persistent=False)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """This rank's heads ``o_latent [T, H/N, C]`` through its W_UV and its columns of Wo, summed over the ranks
        -> ``[T, hidden]`` bfloat16, the same on every rank."""
        y = super().output(o_latent)  # [T, hidden]: this rank's share
        dist.all_reduce(y, group=self.group)
        return y


# ----------------------------------------------------------------------------------------------
# One rank's run.


def run_layer(
    layer: DSALayer,
    seq_lens: Sequence[int],
    decode_steps: int,
    device: torch.device | str,
    backend: str,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], DecodeStep]:
    """Prefill requests of ``seq_lens`` tokens into fresh caches, then ``decode_steps`` decode steps of one new token
    per request through :class:`~examples.dsa_layer.DecodeStep`.

    The tokens and the caches' page table come from ``seed`` alone, so every rank and the single-process layer see
    the same inputs. Returns CPU copies of ``prefill_y [T, hidden]``, ``prefill_indices [T, K]``,
    ``decode_y [steps, B, hidden]``, ``decode_indices [steps, B, K]`` and the caches ``kv``, ``index_k`` (and
    ``index_stage`` with a k-pool indexer), and the decode step (its CUDA graph, on a GPU).
    """
    c = layer.config
    cache = PagedCache.allocate(c, len(seq_lens), max(seq_lens) + decode_steps, device, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)

    def tokens(n: int) -> torch.Tensor:
        return torch.randn(n, c.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)

    y, indices = layer.prefill(tokens(sum(seq_lens)), prefill_batch(seq_lens, device), cache)
    out = {"prefill_y": y, "prefill_indices": indices}
    step = DecodeStep(layer, cache, backend=backend)
    positions = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
    ys, picks = [], []
    for _ in range(decode_steps):
        y, indices = step(tokens(len(seq_lens)), positions)
        ys.append(y.clone())  # the step's outputs are overwritten by the next replay
        picks.append(indices.clone())
        positions += 1
    out.update(decode_y=torch.stack(ys), decode_indices=torch.stack(picks), kv=cache.kv, index_k=cache.index_k)
    if cache.index_stage is not None:
        out["index_stage"] = cache.index_stage
    return {name: t.cpu() for name, t in out.items()}, step


# ----------------------------------------------------------------------------------------------
# Process groups.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # the ranks share the host's cores: more threads than cores only thrash (torchrun's default too)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *args, backend: str | None = None, join: bool = True) -> mp.ProcessContext | None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes that form the default process group (NCCL with one
    GPU per rank when ``backend`` is "nccl", gloo on CPUs; default: NCCL where ``world`` GPUs are visible). ``fn``
    must be importable by name (a module-level function): the processes are spawned, not forked. With ``join`` it
    returns when every rank is done and raises when any failed; without, it returns the processes' context at once
    (call its ``join()`` until it returns True)."""
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    return mp.spawn(_rank_main, args=(world, _free_port(), backend, fn, args), nprocs=world, join=join)


def save_runs(
    rank: int,
    world: int,
    out_dir: str,
    configs: Sequence[DSAConfig],
    seq_lens: Sequence[int],
    decode_steps: int,
    seed: int = 0,
) -> None:
    """A rank's body for :func:`launch`: :func:`run_layer` of this rank's :class:`DSALayerShard` of each config
    (whole-layer geometry), saved to ``out_dir/rank{rank}.pt`` as ``{config name: results}``. On its GPU (NCCL) the
    decode steps replay CUDA graphs (inductor); on the CPU they run the same compiled graph (aot_eager)."""
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    results = {}
    for config in configs:
        layer = DSALayerShard(config, rank, world, device, seed)
        if on_gpu:
            warm_up(layer.config)
        results[config.name], _ = run_layer(
            layer, seq_lens, decode_steps, device, "inductor" if on_gpu else "aot_eager", seed
        )
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# ----------------------------------------------------------------------------------------------
# The command line.


def _same_on_every_rank(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``t`` is bit-identical to rank 0's copy, agreed by every rank."""
    mine = t.contiguous().flatten().view(torch.uint8)  # bytes: NaN equals itself, and gloo has no bfloat16
    theirs = mine.clone()
    dist.broadcast(theirs, src=0, group=group)
    ok = torch.tensor([int(torch.equal(theirs, mine))], device=t.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())


def bench_decode(step: DecodeStep, layer: DSALayerShard, iters: int = BENCH_ITERS) -> dict[str, float]:
    """Median microseconds of one replay of ``step``'s CUDA graph (the whole decode step on this rank) and of an
    all-reduce of its ``[B, hidden]`` bfloat16 output captured alone in a graph, timed with CUDA events. The ranks
    start each replay together (a barrier first), so the step's time includes the wait for the slowest rank."""
    y = torch.zeros_like(step.x)
    reduce_graph = torch.cuda.CUDAGraph()
    dist.all_reduce(y, group=layer.group)  # NCCL sets up its communicator outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(reduce_graph):
        dist.all_reduce(y, group=layer.group)
    times = {}
    for name, replay in (("step", step.graph.replay), ("all_reduce", reduce_graph.replay)):
        samples = []
        for _ in range(iters):
            dist.barrier(group=layer.group)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            replay()
            end.record()
            end.synchronize()
            samples.append(1e3 * begin.elapsed_time(end))
        times[name] = statistics.median(samples)
    return times


def _rank_cli(rank: int, world: int, args: argparse.Namespace) -> None:
    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    config = TP_CONFIGS[args.config]
    config = config if on_gpu else small_config(config, world)
    seq_lens = tuple(args.seq_lens or (SEQ_LENS_GPU if on_gpu else SEQ_LENS_CPU))
    backend = "inductor" if on_gpu else "aot_eager"
    layer = DSALayerShard(config, rank, world, device, seed=args.seed)
    if on_gpu:
        warm_up(layer.config)
    got, step = run_layer(layer, seq_lens, args.decode_steps, device, backend, args.seed)
    same = all(_same_on_every_rank(value.to(device)) for value in got.values())
    lines = [
        f"{layer.config.name} rank {rank}/{world}: {layer.config.heads} heads, caches and outputs "
        f"{'identical' if same else 'DIFFERENT'} on every rank"
    ]
    if args.check and rank == 0:  # the single-process layer, all heads, on this rank's device
        want, _ = run_layer(
            DSALayer(config, device, args.seed), seq_lens, args.decode_steps, device, backend, args.seed
        )
        for name in ("prefill_y", "decode_y"):
            err = (got[name].float() - want[name].float()).abs().max() / want[name].float().abs().max()
            lines.append(f"  {name}: max |TP - single| / max |single| = {err:.2e}")
        for name in ("prefill_indices", "decode_indices", "kv", "index_k"):
            lines.append(f"  {name}: {'equal' if torch.equal(got[name], want[name]) else 'differ'}")
    if args.bench and on_gpu and step.graph is not None:
        us = bench_decode(step, layer)
        lines.append(
            f"  decode step of {len(seq_lens)} tokens: {us['step']:.1f} us per rank, all-reduce alone "
            f"{us['all_reduce']:.1f} us ({100 * us['all_reduce'] / us['step']:.0f}%)"
        )
    if rank == 0 or not same:
        print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m examples.tp_layer [--config NAME] [--check] [--bench]``, or without torchrun
    ``python -m examples.tp_layer --nproc N ...`` (spawns the ranks itself)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(TP_CONFIGS), default=DEEPSEEK_V32.name)
    parser.add_argument("--seq-lens", type=int, nargs="+", help="prefill lengths (default: three requests)")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with the single-process layer on rank 0")
    parser.add_argument("--bench", action="store_true", help="time the decode step's replay and the all-reduce (GPU)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if TP_CONFIGS[args.config].heads % world:
        parser.error(f"{args.config}: {TP_CONFIGS[args.config].heads} heads do not split over {world} ranks")
    if "RANK" not in os.environ:  # started as a plain script: spawn the ranks
        launch(_rank_cli, world, args)
        return
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    gpus = torch.cuda.device_count() > local
    if gpus:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if gpus else "gloo")
    try:
        _rank_cli(rank, world, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
