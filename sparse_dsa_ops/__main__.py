"""``python -m sparse_dsa_ops [check | source | bench]``.

* ``check`` (the default): the environment, then every op at the DeepSeek V3.2 and GLM-5.3-Flash
  geometries on the best device available (a CUDA GPU if there is one, else the CPU, where the ops
  *are* the reference), checked against the reference, as a table.
* ``source``: the generated TileLang kernel source of an op for one geometry, for CUDA (sm_90a) or
  HIP (gfx950); needs no GPU.
* ``bench``: GPU timings with CUDA-graph replay beside a bf16 matmul and a device copy measured in
  the same run, and each target of DESIGN.md met or missed by how much (``--rounds N``: the median and the
  range of N timings).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference
from .layout import KCacheLayout

GEOMETRIES = {"deepseek": (512, 64, 128), "glm": (256, 0, 64)}  # d_nope, d_rope, heads


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def environment() -> list[tuple[str, str]]:
    try:
        import tilelang

        tl = tilelang.__version__
    except Exception as err:  # a broken install should not stop the report
        tl = f"not importable ({type(err).__name__}: {err})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        device = "no CUDA device; ops run the pure-Torch reference on the CPU"
    return [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("tilelang", tl),
        ("device", device),
    ]


@dataclass
class Case:
    op: str
    geometry: str
    make: Callable[[torch.Generator], tuple]  # CPU inputs
    run: Callable[..., object]  # the op
    ref: Callable[..., object]  # the reference on CPU inputs
    exact: bool  # bytes must match; otherwise relative L2 error of the first output


def _cases(n_rows: int, tokens: int, topk: int, slots: int) -> list[Case]:
    ops = torch.ops.dsa
    cases = []
    for geo, (d_nope, d_rope, heads) in GEOMETRIES.items():
        lay = KCacheLayout(d_nope, d_rope)

        def k_rows(gen, n, d_nope=d_nope, d_rope=d_rope):
            rope = torch.randn(n, d_rope, generator=gen).bfloat16() if d_rope else None
            return torch.randn(n, d_nope, generator=gen).bfloat16(), rope

        def pool(gen, lay=lay, k_rows=k_rows):
            return reference.quant_k_cache(*k_rows(gen, slots)).reshape(-1, 64, lay.row_bytes)

        def slot_ids(gen, m):
            ids = torch.randint(0, slots, (m,), generator=gen, dtype=torch.int32)
            ids[::7] = -1
            return ids

        def attn_inputs(gen, kind, t_count=tokens, heads=heads, lay=lay, pool=pool):
            q = torch.randn(t_count, heads, lay.d_qk, generator=gen).bfloat16()
            kv = pool(gen)
            if kind == "bf16":
                kv = reference.dequant_k_cache(kv)
            elif kind == "fp8":  # native FP8: float8 q over float8 rows
                q, kv = q.to(torch.float8_e4m3fn), reference.dequant_k_cache(kv).to(torch.float8_e4m3fn)
            idx = torch.randint(-1, slots, (t_count, topk), generator=gen, dtype=torch.int32)
            return q, kv, idx, lay.d_qk**-0.5, lay.d_nope, None

        def store_ref(k, r, cache, loc, rs):
            cache = cache.clone()
            reference.store_k_cache(k, r, cache, loc, rs)
            return cache

        def store_run(k, r, cache, loc, rs):
            ops.store_k_cache(k, r, cache, loc, rs)
            return cache

        cases += [
            Case("quant_k_cache", geo, lambda g, k=k_rows: (*k(g, n_rows), False), ops.quant_k_cache,
                 reference.quant_k_cache, True),
            Case("store_k_cache", geo, lambda g, k=k_rows, p=pool: (*k(g, n_rows), p(g),
                 torch.randperm(slots, generator=g)[:n_rows].int(), True), store_run, store_ref, True),
            Case("dequant_k_cache", geo, lambda g, p=pool: (p(g),), ops.dequant_k_cache, reference.dequant_k_cache,
                 True),
            Case("gather_k_cache", geo, lambda g, p=pool: (p(g), slot_ids(g, n_rows)), ops.gather_k_cache,
                 reference.gather_k_cache, True),
            Case("gather_dequant_k_cache", geo, lambda g, p=pool: (p(g), slot_ids(g, n_rows)),
                 ops.gather_dequant_k_cache, reference.gather_dequant_k_cache, True),
            Case("sparse_attn bf16", geo, lambda g, a=attn_inputs: a(g, "bf16"), ops.sparse_attn,
                 reference.sparse_attn, False),
            Case("sparse_attn packed", geo, lambda g, a=attn_inputs: a(g, "packed"), ops.sparse_attn,
                 reference.sparse_attn, False),
            Case("sparse_attn fp8", geo, lambda g, a=attn_inputs: a(g, "fp8"), ops.sparse_attn,
                 reference.sparse_attn, False),
            Case("sparse_attn T2 packed", geo, lambda g, a=attn_inputs: a(g, "packed", 2), ops.sparse_attn,
                 reference.sparse_attn, False),
        ]
    return cases


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _to(args: tuple, device: torch.device) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def check(device: torch.device) -> int:
    """Run every op on ``device`` against the reference on the CPU; print a table; return failures."""
    for key, value in environment():
        print(f"{key:<10}{value}")
    print()
    on_cpu = device.type == "cpu"
    # on a GPU, 256 tokens take the prefill path at both geometries and 2 tokens the split decode path
    sizes = dict(n_rows=4096, tokens=4, topk=2048, slots=16384) if on_cpu else dict(
        n_rows=65536, tokens=256, topk=2048, slots=65536)
    rows, failures = [], 0
    for case in _cases(**sizes):
        gen = torch.Generator().manual_seed(0)
        inputs = case.make(gen)
        try:
            got = _first(case.run(*_to(inputs, device)))
            want = _first(case.ref(*inputs))
            got = got.cpu()
            if case.exact:
                ok = got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                detail = "bytes equal" if ok else "bytes differ"
            else:
                err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
                ok = err <= 1e-2
                detail = f"rel L2 {err:.1e}"
            dev_inputs = _to(inputs, device)
            ms = _time_ms(lambda c=case, a=dev_inputs: c.run(*a), device, 3 if on_cpu else 20)
            status = ("ok" if ok else "FAIL") + (" (reference backend)" if on_cpu else f" ({detail})")
        except Exception as err:  # report every op, even after one fails
            ok, ms, status = False, float("nan"), f"ERROR {type(err).__name__}: {err}"
        failures += not ok
        rows.append([case.op, case.geometry, str(device), status, f"{ms:.3f}"])
    print(format_table(["op", "geometry", "device", "status", "ms"], rows))
    print(f"\n{len(rows) - failures} of {len(rows)} ok")
    return failures


CACHE_OPS = ("quant_k_cache", "store_k_cache", "dequant_k_cache", "gather_k_cache", "gather_dequant_k_cache")


def source(args: argparse.Namespace) -> int:
    """Print the generated source of every kernel the op runs for the geometry."""
    from . import _cuda

    if args.op == "sparse_attn":
        sm_scale = args.sm_scale if args.sm_scale is not None else (args.d_nope + args.d_rope) ** -0.5
        keys = _cuda.attn_keys(args.kv, args.d_nope, args.d_rope, args.heads, sm_scale, args.topk_length,
                               target=args.target, q_fp8=args.q == "fp8")
    else:
        keys = _cuda.cache_keys(args.op, KCacheLayout(args.d_nope, args.d_rope), args.round_scale, args.slot_dtype)
    for key in keys:
        print(f"// ===== {key.name}, target {args.target} ({_cuda.TARGETS[args.target]}) =====")
        print(_cuda.lower_source(key, args.target))
    return 0


# ----------------------------------------------------------------------------------------------
# bench


def _graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Microseconds per call of ``fn``: a CUDA graph that holds ``reps`` calls is replayed five times, and
    the fastest replay's mean per call is returned (BENCHMARKS.md: "the best of 5 replays")."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) * 1e3 / reps)
    return best


def _ceilings() -> dict[str, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = _graph_time_us(lambda: torch.mm(a, b, out=c), reps=5)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # the best of a byte copy and a word copy of the same 1 GiB (torch picks different kernels)
    copy_us = min(_graph_time_us(lambda: dst.copy_(src), reps=5),
                  _graph_time_us(lambda: dst.view(torch.int64).copy_(src.view(torch.int64)), reps=5))
    return {"matmul_tflops": 2 * 8192**3 / mm_us / 1e6, "copy_gbps": 2 * (1 << 30) / copy_us / 1e3}


def _attn_case(name, kind, d_nope, d_rope, heads, tokens, slots, topk):
    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        d_qk = d_nope + d_rope
        q = torch.randn(tokens, heads, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(slots, d_qk, device="cuda", dtype=torch.bfloat16, generator=gen)
        if kind == "packed":
            kv = torch.ops.dsa.quant_k_cache(kv[:, :d_nope].contiguous(),
                                             kv[:, d_nope:].contiguous() if d_rope else None)
        elif kind == "fp8":
            q, kv = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
        idx = torch.randint(0, slots, (tokens, topk), device="cuda", dtype=torch.int32, generator=gen)
        return (q, kv, idx, d_qk**-0.5, d_nope)

    from . import _cuda

    flops = 2 * tokens * heads * topk * (2 * d_nope + d_rope)
    plan = _cuda.plan_attn(kind, d_nope, d_rope, heads, (d_nope + d_rope) ** -0.5, False, kind == "fp8", tokens, topk,
                           torch.cuda.get_device_properties(0).multi_processor_count)
    return dict(name=name, op="sparse_attn", make=make, flops=flops, bytes=None, keys=list(plan.keys), path=str(plan))


def _cache_case(name, op, d_nope, d_rope, rows):
    lay = KCacheLayout(d_nope, d_rope)

    def make():
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(rows, d_nope, device="cuda", dtype=torch.bfloat16, generator=gen)
        r = torch.randn(rows, d_rope, device="cuda", dtype=torch.bfloat16, generator=gen) if d_rope else None
        if op == "quant_k_cache":
            return (k, r, False)
        pool = torch.ops.dsa.quant_k_cache(k, r)
        ids = torch.randperm(rows, device="cuda", generator=gen).int()
        if op == "store_k_cache":
            return (k, r, pool, ids, False)
        if op == "dequant_k_cache":
            return (pool,)
        return (pool, ids)

    in_bytes = {"quant_k_cache": 2 * lay.d_qk, "store_k_cache": 2 * lay.d_qk + 4, "dequant_k_cache": lay.row_bytes,
                "gather_k_cache": lay.row_bytes + 4, "gather_dequant_k_cache": lay.row_bytes + 4}[op]
    out_bytes = 2 * lay.d_qk if "dequant" in op else lay.row_bytes
    from . import _cuda

    keys = _cuda.cache_keys(op, lay, slot_dtype="int32")
    return dict(name=name, op=op, make=make, flops=None, bytes=rows * (in_bytes + out_bytes), keys=keys,
                path=keys[0].family)


# The targets of DESIGN.md, by bench case: (bound, value, unit), a rate in TFLOPS, a latency in microseconds, or
# for the cache ops on 1M rows a fraction of the device copy measured in the same run.
TARGETS = {
    "prefill deepseek bf16 T4096 S8192 H128 k2048": (">=", 600.0, "TFLOPS"),
    "prefill glm bf16 T4096 S8192 H64 k2048": (">=", 450.0, "TFLOPS"),
    "decode glm bf16 T1 S65536 H64 k2048": ("<=", 15.0, "us"),
    "decode glm bf16 T17 S65536 H64 k2112": ("<=", 20.0, "us"),
    "decode deepseek bf16 T1 S65536 H128 k2048": ("<=", 20.0, "us"),
    "decode deepseek packed T256 S65536 H128 k2048": (">=", 400.0, "TFLOPS"),
    "decode glm packed T1 S65536 H64 k2048": ("<=", 10.0, "us"),
    "decode glm packed T17 S65536 H64 k2112": ("<=", 15.0, "us"),
    "prefill glm packed T4096 S8192 H64 k2048": (">=", 400.0, "TFLOPS"),
    **{f"{op} {geo} 1M rows": (">=", 0.8, "of copy") for geo in GEOMETRIES for op in CACHE_OPS},
}


def target_status(name: str, us: float, rate: float, ratio: float) -> str:
    """The bench's target cell for case ``name`` timed at ``us`` microseconds (``rate`` in TFLOPS or GB/s,
    ``ratio`` to its ceiling): the target of :data:`TARGETS` and whether it is met, by how much, or by how much
    it is missed; "" for a case without a target."""
    if name not in TARGETS:
        return ""
    bound, value, unit = TARGETS[name]
    got = {"TFLOPS": rate, "us": us, "of copy": ratio}[unit]
    margin = value / got - 1 if bound == "<=" else got / value - 1
    text = f"{bound} {value:.0%} {unit}" if unit == "of copy" else f"{bound} {value:g} {unit}"
    # (a margin under 0.1% in two decimals: "missed by 0.0%" beside a rate that rounds to the target says nothing)
    by = f"{abs(margin):.2%}" if abs(margin) < 0.001 else f"{abs(margin):.1%}"
    return f"{text}: met by {by}" if margin >= 0 else f"{text}: missed by {by}"


def bench_row(case: dict, times_us: list[float], ceil: dict[str, float]) -> tuple[list[str], dict]:
    """The table row and the JSON record of ``case`` timed ``times_us`` (one time per round): the median time, its
    rate against the ceilings ``ceil`` of the same run, the range over the rounds, and the target's status."""
    times = sorted(times_us)
    us = statistics.median(times)
    if case["flops"]:
        rate, unit, ceiling = case["flops"] / us / 1e6, "TFLOPS", ceil["matmul_tflops"]
    else:
        rate, unit, ceiling = case["bytes"] / us / 1e3, "GB/s", ceil["copy_gbps"]
    ratio = rate / ceiling
    spread = f"{times[0]:.1f}-{times[-1]:.1f}" if len(times) > 1 else ""
    status = target_status(case["name"], us, rate, ratio)
    row = [case["name"], case["path"], f"{us:.1f}", spread, f"{rate:.0f} {unit}", f"{ratio:.0%}", status]
    record = dict(case=case["name"], path=case["path"], us=us, us_rounds=list(times_us), rate=rate, unit=unit,
                  ratio_to_ceiling=ratio, target=status)
    return row, record


def bench_cases() -> list[dict]:
    cases = [
        _attn_case("prefill deepseek bf16 T4096 S8192 H128 k2048", "bf16", 512, 64, 128, 4096, 8192, 2048),
        _attn_case("prefill glm bf16 T4096 S8192 H64 k2048", "bf16", 256, 0, 64, 4096, 8192, 2048),
        _attn_case("decode glm bf16 T1 S65536 H64 k2048", "bf16", 256, 0, 64, 1, 65536, 2048),
        _attn_case("decode glm bf16 T17 S65536 H64 k2112", "bf16", 256, 0, 64, 17, 65536, 2112),
        _attn_case("decode deepseek bf16 T1 S65536 H128 k2048", "bf16", 512, 64, 128, 1, 65536, 2048),
        _attn_case("decode deepseek packed T256 S65536 H128 k2048", "packed", 512, 64, 128, 256, 65536, 2048),
        _attn_case("decode glm packed T1 S65536 H64 k2048", "packed", 256, 0, 64, 1, 65536, 2048),
        _attn_case("decode glm packed T17 S65536 H64 k2112", "packed", 256, 0, 64, 17, 65536, 2112),
        _attn_case("prefill glm packed T4096 S8192 H64 k2048", "packed", 256, 0, 64, 4096, 8192, 2048),
        _attn_case("prefill deepseek fp8 T4096 S8192 H128 k2048", "fp8", 512, 64, 128, 4096, 8192, 2048),
        _attn_case("prefill glm fp8 T4096 S8192 H64 k2048", "fp8", 256, 0, 64, 4096, 8192, 2048),
        _attn_case("decode glm fp8 T1 S65536 H64 k2048", "fp8", 256, 0, 64, 1, 65536, 2048),
        _attn_case("decode glm fp8 T17 S65536 H64 k2112", "fp8", 256, 0, 64, 17, 65536, 2112),
        # tensor-parallel shards: DeepSeek over 8 GPUs has 16 heads per GPU, GLM 8
        _attn_case("prefill deepseek bf16 T4096 S8192 H16 k2048", "bf16", 512, 64, 16, 4096, 8192, 2048),
        _attn_case("decode deepseek packed T1 S65536 H16 k2048", "packed", 512, 64, 16, 1, 65536, 2048),
        _attn_case("decode deepseek packed T256 S65536 H16 k2048", "packed", 512, 64, 16, 256, 65536, 2048),
        _attn_case("prefill glm packed T4096 S8192 H8 k2048", "packed", 256, 0, 8, 4096, 8192, 2048),
        _attn_case("decode glm packed T1 S65536 H8 k2048", "packed", 256, 0, 8, 1, 65536, 2048),
        _attn_case("decode glm packed T17 S65536 H8 k2112", "packed", 256, 0, 8, 17, 65536, 2112),
    ]
    for geo, (d_nope, d_rope, _) in GEOMETRIES.items():
        for op in CACHE_OPS:
            cases.append(_cache_case(f"{op} {geo} 1M rows", op, d_nope, d_rope, 1 << 20))
    cases.append(_cache_case("store_k_cache glm 16 rows", "store_k_cache", 256, 0, 16))
    return cases


def bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    for key, value in environment():
        print(f"{key:<10}{value}")
    ceil = _ceilings()
    print(f"ceilings  bf16 matmul 8192^3: {ceil['matmul_tflops']:.0f} TFLOPS; device copy 1 GiB: "
          f"{ceil['copy_gbps']:.0f} GB/s (read + write)\n")
    from . import _cuda

    wanted = [f for f in (args.filter or "").split(",") if f]
    cases = [c for c in bench_cases() if not wanted or any(f in c["name"] for f in wanted)]
    _cuda.warmup([k for c in cases for k in c["keys"]], workers=16)
    rows, records = [], []
    for case in cases:
        inputs = case["make"]()
        op = getattr(torch.ops.dsa, case["op"])
        try:
            op(*inputs)  # compiles outside the capture
            # each round captures and times a graph of its own
            times = [_graph_time_us(lambda op=op, inputs=inputs: op(*inputs)) for _ in range(args.rounds)]
        except Exception as err:  # keep measuring the other cases
            rows.append([case["name"], case["path"], "ERROR", "", f"{type(err).__name__}: {err}"[:80], "", ""])
            continue
        row, record = bench_row(case, times, ceil)
        rows.append(row)
        records.append(record)
        del inputs
    headers = ["case", "kernels", "us", f"range ({args.rounds} rounds)", "rate", "of ceiling", "target"]
    if args.rounds == 1:  # (no range column)
        headers.pop(3)
        rows = [r[:3] + r[4:] for r in rows]
    print(format_table(headers, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=dict(environment()), ceilings=ceil, rows=records), f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparse_dsa_ops", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    p_check = sub.add_parser("check", help="environment and a self-check of every op (the default)")
    p_check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p_src = sub.add_parser("source", help="print the generated kernel source of an op (no GPU needed)")
    p_src.add_argument("--op", required=True, choices=("sparse_attn", *CACHE_OPS))
    p_src.add_argument("--kv", default="bf16", choices=("bf16", "fp8", "packed"),
                       help="kv of sparse_attn: bf16, fp8 (float8_e4m3fn values) or packed (uint8 FP8 rows)")
    p_src.add_argument("--q", default="bf16", choices=("bf16", "fp8"), help="q dtype of sparse_attn (fp8 needs "
                       "fp8 or packed kv)")
    p_src.add_argument("--d-nope", type=int, default=512, help="latent (= value) width")
    p_src.add_argument("--d-rope", type=int, default=64, help="RoPE tail width (0 for none)")
    p_src.add_argument("--heads", type=int, default=128)
    p_src.add_argument("--sm-scale", type=float, default=None, help="default: d_qk ** -0.5")
    p_src.add_argument("--topk-length", action="store_true", help="the variant that takes topk_length")
    p_src.add_argument("--round-scale", action="store_true")
    p_src.add_argument("--slot-dtype", default="int32", choices=("int32", "int64"))
    p_src.add_argument("--target", default="cuda", choices=("cuda", "hip"), help="cuda = sm_90a, hip = gfx950")
    p_bench = sub.add_parser("bench", help="GPU timings with CUDA-graph replay")
    p_bench.add_argument("--json", default=None, help="also write the rows to this file")
    p_bench.add_argument("--filter", default=None, help="only cases whose name contains one of these "
                         "comma-separated strings")
    p_bench.add_argument("--rounds", type=int, default=1, help="time each case this many times (a graph "
                         "captured for each) and report the median and the range")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.rounds < 1:
        p_bench.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.command in (None, "check"):
        name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        return 1 if check(torch.device(name)) else 0
    if args.command == "source":
        if args.op == "sparse_attn" and args.q == "fp8" and args.kv == "bf16":
            p_src.error("--q fp8 needs --kv fp8 or --kv packed")
        return source(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
