"""``python -m sparse_dsa_ops [check]``: the environment, then every op checked against the reference.

Runs each op at the DeepSeek V3.2 and GLM-5.3-Flash geometries on the best device available
(a CUDA GPU if there is one, else the CPU, where the ops *are* the reference) and prints a table.
"""

from __future__ import annotations

import argparse
import platform
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

        def attn_inputs(gen, kind, heads=heads, lay=lay, pool=pool):
            q = torch.randn(tokens, heads, lay.d_qk, generator=gen).bfloat16()
            kv = pool(gen)
            if kind == "bf16":
                kv = reference.dequant_k_cache(kv)
            idx = torch.randint(-1, slots, (tokens, topk), generator=gen, dtype=torch.int32)
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
    sizes = dict(n_rows=4096, tokens=4, topk=2048, slots=16384) if on_cpu else dict(
        n_rows=65536, tokens=64, topk=2048, slots=65536)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparse_dsa_ops", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    p_check = sub.add_parser("check", help="environment and a self-check of every op (the default)")
    p_check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args(argv)
    if args.command in (None, "check"):
        name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        return 1 if check(torch.device(name)) else 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
