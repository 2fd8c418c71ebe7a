"""``python -m sparse_dsa_ops [check | source | bench]``.

* ``check`` (the default): the environment, then every op at the DeepSeek V3.2 and GLM-5.3-Flash
  geometries, as a table. On a CUDA GPU each op's kernels are checked against the reference run on the CPU.
  On the CPU the ops *are* the reference, so there it checks only each op's contract: that it is registered,
  accepts valid inputs, and that its fake kernel (what ``torch.compile`` traces) gives the shapes and dtypes it
  returns.
* ``source``: the generated TileLang kernel source of an op for one geometry, for CUDA (sm_90a) or
  HIP (gfx950); needs no GPU.
* ``bench``: GPU timings with CUDA-graph replay beside a bf16 matmul and a device copy measured in
  the same run, and each target of docs/design.md met or missed by how much (``--rounds N``: the median and the
  range of N timings).

A mistake in the arguments ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from . import ops
from .layout import QUANT_TILE
from .ops.samples import Case

# DeepSeek-V3.2 and GLM-5.3-Flash (its public config): d_nope, d_rope, heads
GEOMETRIES = {"deepseek": (512, 64, 128), "glm": (512, 0, 64)}


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


def _check_cases(on_cpu: bool) -> list[Case]:
    """Every family's self-check cases (each family's contract module makes its own)."""
    return [case for family in ops.FAMILIES for case in family.check_cases(on_cpu)]


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


def _warm_up_check(cases: list[Case], device: torch.device) -> None:
    """Compile the kernels ``cases`` run on ``device`` (each case names its own), in parallel, before the first case
    (one after another they take minutes); the progress line says what it is doing."""
    print("compiling the check's kernels in parallel (TileLang's disk cache makes the next run fast)", flush=True)
    from csrc_tl.attention.keys import AttnKey

    from . import _cuda

    # the attention kernels first: their nvcc compiles are the longest, and they run beside the lowering of the rest
    keys = sorted((key for case in cases for key in case.keys(device)), key=lambda k: not isinstance(k, AttnKey))
    _cuda.warmup(keys, workers=16)


def _compare(got: torch.Tensor, want: torch.Tensor, exact: bool) -> tuple[bool, str]:
    """Whether ``got`` matches the reference's ``want``: the same bytes, or infinities at the same places and a
    relative L2 error of at most 1e-2 over the finite entries."""
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)}, reference {list(want.shape)}"
    if exact:
        ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return ok, "bytes equal" if ok else "bytes differ"
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        return False, "inf or NaN at other places"
    err = ((got[finite] - want[finite]).norm() / want[finite].norm().clamp_min(1e-30)).item()
    return err <= 1e-2, f"rel L2 {err:.1e}"


def _fake_matches(case: Case, inputs: tuple, got: torch.Tensor) -> tuple[bool, str]:
    """Whether the op's fake kernel, run on fake copies of ``inputs``, gives ``got``'s shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = _first(case.run(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs)))
    if (fake.shape, fake.dtype) != (got.shape, got.dtype):
        return False, f"fake kernel gives {fake.dtype} {list(fake.shape)}, the op {got.dtype} {list(got.shape)}"
    return True, "fake kernel agrees"


def check(device: torch.device) -> int:
    """Run every op on ``device`` against the reference on the CPU (on the CPU, where the ops are the reference,
    against their fake kernels); print a table; return failures."""
    for key, value in environment():
        print(f"{key:<10}{value}")
    print()
    on_cpu = device.type == "cpu"
    if on_cpu:
        print(
            "No GPU: the ops run the reference itself, so this checks each op's contract on the CPU (it is\n"
            "registered, accepts these inputs, and its fake kernel, what torch.compile traces, gives the shapes and\n"
            "dtypes it returns), not the GPU kernels. Run it on a GPU to check those against the reference.\n"
        )
    cases = _check_cases(on_cpu)
    if not on_cpu:
        _warm_up_check(cases, device)
    rows, failures = [], 0
    for case in cases:
        gen = torch.Generator().manual_seed(0)
        inputs = case.make(gen)
        try:
            got = _first(case.run(*_to(inputs, device))).cpu()
            ok, detail = (
                _fake_matches(case, inputs, got) if on_cpu else _compare(got, _first(case.ref(*inputs)), case.exact)
            )
            dev_inputs = _to(inputs, device)
            ms = _time_ms(lambda c=case, a=dev_inputs: c.run(*a), device, 3 if on_cpu else 20)
            status = f"{'ok' if ok else 'FAIL'} ({detail})"
        except Exception as err:  # report every op, even after one fails
            ok, ms, status = False, float("nan"), f"ERROR {type(err).__name__}: {err}"
        failures += not ok
        rows.append([case.op, case.geometry, str(device), status, f"{ms:.3f}"])
    print(format_table(["op", "geometry", "device", "status", "ms"], rows))
    print(f"\n{len(rows) - failures} of {len(rows)} ok")
    return failures


def _source_families() -> dict:
    """Each op with kernels -> its family's GPU module (each family declares its ``SOURCE_OPS``)."""
    return {op: module for module in (family.gpu() for family in ops.FAMILIES) for op in module.SOURCE_OPS}


def _kernel_spec(args: argparse.Namespace) -> ops.KernelSpec:
    """``source``'s geometry arguments as the typed spec every family reads."""
    return ops.KernelSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ops.KernelSpec)})


def _source_errors(args: argparse.Namespace) -> str | None:
    """What is wrong with ``source``'s geometry arguments (the ops' limits), or None."""
    if args.d_nope <= 0 or args.d_nope % QUANT_TILE:
        return f"--d-nope must be a positive multiple of {QUANT_TILE}, got {args.d_nope}"
    if args.d_rope < 0 or args.d_rope % ops.D_ROPE_MULTIPLE:
        return f"--d-rope must be 0 or a positive multiple of {ops.D_ROPE_MULTIPLE}, got {args.d_rope}"
    if not 1 <= args.heads <= ops.MAX_HEADS:
        return f"--heads must be in 1..{ops.MAX_HEADS}, got {args.heads}"
    if args.index_dim <= 0 or args.index_dim % ops.INDEX_DIM_MULTIPLE:
        return f"--index-dim must be a positive multiple of {ops.INDEX_DIM_MULTIPLE}, got {args.index_dim}"
    if args.page < 0:
        return f"--page must be 0 or more, got {args.page}"
    if not 1 <= args.k <= ops.MAX_TOPK:
        return f"--k must be in 1..{ops.MAX_TOPK}, got {args.k}"
    if args.op == "sparse_attn" and args.q == "fp8" and args.kv == "bf16":
        return "--q fp8 needs --kv fp8 or --kv packed"
    return None


def source(args: argparse.Namespace) -> int:
    """Print the generated source of every kernel the op runs for the geometry."""
    from . import _cuda

    for key in _source_families()[args.op].source_keys(args.op, _kernel_spec(args)):
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
    copy_us = min(
        _graph_time_us(lambda: dst.copy_(src), reps=5),
        _graph_time_us(lambda: dst.view(torch.int64).copy_(src.view(torch.int64)), reps=5),
    )
    fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # (column-major b, as cuBLASLt needs)
    one = torch.ones((), device="cuda")
    fp8_us = _graph_time_us(lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16), reps=5)
    return {
        "matmul_tflops": 2 * 8192**3 / mm_us / 1e6,
        "fp8_matmul_tflops": 2 * 8192**3 / fp8_us / 1e6,
        "copy_gbps": 2 * (1 << 30) / copy_us / 1e3,
    }


def bench_cases() -> list[dict]:
    """Every family's bench cases (each family's GPU module declares its own, with their targets), then FlashMLA's
    face's."""
    from . import flash_mla

    return [case for family in ops.FAMILIES for case in family.gpu().bench_cases()] + flash_mla.bench_cases()


def targets() -> dict[str, tuple]:
    """The target of each bench case that has one: (bound, value, unit)."""
    return {c["name"]: c["target"] for c in bench_cases() if c.get("target")}


def target_status(target: tuple | None, us: float, rate: float, ratio: float) -> str:
    """The bench's target cell for a case with ``target`` (bound, value, unit) timed at ``us`` microseconds (``rate``
    in TFLOPS or GB/s, ``ratio`` to its ceiling, or its time over its roof for the unit "x roof"): the target and
    whether it is met, by how much, or by how much it is missed; "" for a case without a target."""
    if not target:
        return ""
    bound, value, unit = target
    got = {"TFLOPS": rate, "us": us, "of copy": ratio, "x roof": ratio}[unit]
    margin = value / got - 1 if bound == "<=" else got / value - 1
    text = f"{bound} {value:.0%} {unit}" if unit == "of copy" else f"{bound} {value:g} {unit}"
    # (a margin under 0.1% in two decimals: "missed by 0.0%" beside a rate that rounds to the target says nothing)
    by = f"{abs(margin):.2%}" if abs(margin) < 0.001 else f"{abs(margin):.1%}"
    return f"{text}: met by {by}" if margin >= 0 else f"{text}: missed by {by}"


def bench_row(case: dict, times_us: list[float], ceil: dict[str, float]) -> tuple[list[str], dict]:
    """The table row and the JSON record of ``case`` timed ``times_us`` (one time per round): the median time, its
    rate against the ceilings ``ceil`` of the same run (for a case with a ``roof``, its time over the roof:
    max(FLOPs / FP8 matmul ceiling, bytes / copy ceiling)), the range over the rounds, and the target's status."""
    times = sorted(times_us)
    us = statistics.median(times)
    if case.get("roof"):
        roof_us = max(case["flops"] / (ceil["fp8_matmul_tflops"] * 1e6), case["bytes"] / (ceil["copy_gbps"] * 1e3))
        rate, unit = case["flops"] / us / 1e6, "TFLOPS"
        ratio, share = us / roof_us, f"{us / roof_us:.2f}x roof ({roof_us:.1f} us)"
    else:
        if case["flops"]:
            rate, unit, ceiling = case["flops"] / us / 1e6, "TFLOPS", ceil["matmul_tflops"]
        else:
            rate, unit, ceiling = case["bytes"] / us / 1e3, "GB/s", ceil["copy_gbps"]
        ratio = rate / ceiling
        share = f"{ratio:.0%}"
    spread = f"{times[0]:.1f}-{times[-1]:.1f}" if len(times) > 1 else ""
    status = target_status(case.get("target"), us, rate, ratio)
    row = [case["name"], case["path"], f"{us:.1f}", spread, f"{rate:.0f} {unit}", share, status]
    record = dict(
        case=case["name"],
        path=case["path"],
        us=us,
        us_rounds=list(times_us),
        rate=rate,
        unit=unit,
        ratio_to_ceiling=ratio,
        target=status,
    )
    return row, record


def bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU", file=sys.stderr)
        return 2
    for key, value in environment():
        print(f"{key:<10}{value}")
    ceil = _ceilings()
    print(
        f"ceilings  bf16 matmul 8192^3: {ceil['matmul_tflops']:.0f} TFLOPS; FP8 matmul 8192^3: "
        f"{ceil['fp8_matmul_tflops']:.0f} TFLOPS; device copy 1 GiB: {ceil['copy_gbps']:.0f} GB/s (read + write)\n"
    )
    from . import _cuda

    wanted = [f for f in (args.filter or "").split(",") if f]
    cases = [c for c in bench_cases() if not wanted or any(f in c["name"] for f in wanted)]
    _cuda.warmup([k for c in cases for k in c["keys"]], workers=16)
    rows, records = [], []
    for case in cases:
        inputs = case["make"]()
        op = case.get("run") or getattr(torch.ops.dsa, case["op"])
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
    parser = argparse.ArgumentParser(
        prog="python -m sparse_dsa_ops",
        description="DeepSeek sparse attention ops: a self-check, the generated kernel sources and GPU timings.",
    )
    sub = parser.add_subparsers(dest="command")
    p_check = sub.add_parser("check", help="environment and a self-check of every op (the default)")
    p_check.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p_src = sub.add_parser("source", help="print the generated kernel source of an op (no GPU needed)")
    p_src.add_argument("--op", required=True, choices=tuple(_source_families()))
    p_src.add_argument(
        "--kv",
        default="bf16",
        choices=("bf16", "fp8", "packed"),
        help="kv of sparse_attn: bf16, fp8 (float8_e4m3fn values) or packed (uint8 FP8 rows)",
    )
    p_src.add_argument(
        "--q", default="bf16", choices=("bf16", "fp8"), help="q dtype of sparse_attn (fp8 needs fp8 or packed kv)"
    )
    p_src.add_argument("--d-nope", type=int, default=512, help="latent (= value) width")
    p_src.add_argument("--d-rope", type=int, default=64, help="RoPE tail width (0 for none)")
    p_src.add_argument("--heads", type=int, default=128, help="query heads, or the indexer's heads")
    p_src.add_argument("--sm-scale", type=float, default=None, help="default: d_qk ** -0.5")
    p_src.add_argument("--topk-length", action="store_true", help="the variant that takes topk_length")
    p_src.add_argument("--attn-sink", action="store_true", help="the variant that takes an attention sink")
    p_src.add_argument("--index-dim", type=int, default=128, help="the indexer's head dim")
    p_src.add_argument(
        "--page", type=int, default=64, help="tokens a page of the index-K cache, or of top-k's page table (0: none)"
    )
    p_src.add_argument("--k", type=int, default=2048, help="k of topk")
    p_src.add_argument(
        "--round-scale", action="store_true", help="the cache ops' variant that rounds scales up to powers of two"
    )
    p_src.add_argument(
        "--slot-dtype", default="int32", choices=("int32", "int64"), help="dtype of the slot ids the cache ops take"
    )
    p_src.add_argument("--target", default="cuda", choices=("cuda", "hip"), help="cuda = sm_90a, hip = gfx950")
    p_bench = sub.add_parser("bench", help="GPU timings with CUDA-graph replay")
    p_bench.add_argument("--json", default=None, help="also write the rows to this file")
    p_bench.add_argument(
        "--filter", default=None, help="only cases whose name contains one of these comma-separated strings"
    )
    p_bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each case this many times (a graph captured for each) and report the median and the range",
    )
    args = parser.parse_args(argv)
    if args.command == "bench" and args.rounds < 1:
        p_bench.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.command in (None, "check"):
        name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            p_check.error("--device cuda: torch sees no CUDA GPU here (use --device cpu)")
        return 1 if check(torch.device(name)) else 0
    if args.command == "source":
        if problem := _source_errors(args):
            p_src.error(problem)
        try:
            return source(args)
        except (AssertionError, ValueError) as err:  # a kernel's own precondition, with its reason
            p_src.error(f"no {args.op} kernel for these arguments: {err}")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
