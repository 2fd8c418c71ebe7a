import subprocess
import sys

import pytest

from sparse_dsa_ops.__main__ import format_table, main

# the self-check's geometries
DS, GLM = "512+64 DeepSeek-V3.2", "512+0 GLM-5.3-Flash"


def test_check_prints_every_op_on_the_cpu():
    from sparse_dsa_ops.ops import OPS

    run = subprocess.run([sys.executable, "-m", "sparse_dsa_ops"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "torch" in out and "tilelang" in out and "device" in out
    # on the CPU the ops are the reference: the check says it checks their contract, not the kernels
    assert "contract on the CPU" in out and "not the GPU kernels" in out
    table = out.split("-----", 1)[1].splitlines()
    checked = {line.split()[0] for line in table if line.strip() and not line.startswith("-")}
    assert checked >= set(OPS), f"the check leaves out {sorted(set(OPS) - checked)}"
    # the cache ops and packed attention at both geometries, bf16 and native FP8 attention at DeepSeek's
    geometries = {
        "quant_k_cache": (DS, GLM),
        "sparse_attn bf16": (DS,),
        "sparse_attn fp8": (DS,),
        "sparse_attn packed": (GLM,),
        "sparse_attn T2 packed": (DS, GLM),
    }
    for op, geos in geometries.items():
        rows = [line for line in out.splitlines() if line.startswith(op + " ")]
        assert len(rows) == len(geos) and all(f" {geo} " in row for geo, row in zip(geos, rows)), rows
    total = sum(1 for line in table if " cpu " in line)
    assert f"{total} of {total} ok" in out and "FAIL" not in out and "ERROR" not in out


def test_warmup_compiles_each_key_once_with_a_progress_line(monkeypatch, capsys):
    from dataclasses import dataclass

    from sparse_dsa_ops._cuda import compile as tl_compile

    @dataclass(frozen=True)
    class Key:
        n: int

        @property
        def name(self) -> str:
            return f"kernel{self.n}"

    built = []
    monkeypatch.setattr(tl_compile, "program", lambda key: f"program{key.n}")
    monkeypatch.setattr(tl_compile, "_compile", lambda key, func: built.append((key, func)) or (lambda: key))
    keys = [Key(i % 5) for i in range(8)]
    tl_compile.warmup(keys, workers=3)
    assert sorted(k.n for k, _ in built) == list(range(5)) and all(f == f"program{k.n}" for k, f in built)
    assert all(tl_compile.kernel(Key(i))() == Key(i) for i in range(5))
    err = capsys.readouterr().err
    assert "elaborating kernel 5/5" in err and "compiled 5/5 kernels" in err
    tl_compile.warmup(keys, workers=3)  # all compiled: nothing to do
    assert len(built) == 5 and capsys.readouterr().err == ""
    for i in range(5):
        tl_compile._KERNELS.pop(Key(i))


def test_unknown_command_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "invalid choice" in capsys.readouterr().err


MISTAKES = {
    "d-nope": (["source", "--op", "sparse_attn", "--d-nope", "500"], "--d-nope must be a positive multiple of 128"),
    "d-rope": (["source", "--op", "sparse_attn", "--d-rope", "8"], "--d-rope must be 0 or a positive multiple of 16"),
    "heads": (["source", "--op", "index_logits", "--heads", "129"], "--heads must be in 1..128, got 129"),
    "index-dim": (["source", "--op", "quant_index", "--index-dim", "100"], "--index-dim must be a positive multiple"),
    "k": (["source", "--op", "topk", "--k", "5000"], "--k must be in 1..4096, got 5000"),
    "fp8-q": (["source", "--op", "sparse_attn", "--q", "fp8"], "--q fp8 needs --kv fp8 or --kv packed"),
    "op": (["source", "--op", "attention"], "argument --op: invalid choice: 'attention'"),
    "device": (["check", "--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_mistake_ends_in_one_line_and_exit_status_2(capsys, case):
    argv, message = MISTAKES[case]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err.splitlines()[-1] and "Traceback" not in err


def test_check_on_cuda_without_a_gpu_is_a_mistake(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["check", "--device", "cuda"])
    assert info.value.code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err.splitlines()[-1]


def test_a_kernel_precondition_is_a_mistake_too(monkeypatch, capsys):
    from types import SimpleNamespace

    from sparse_dsa_ops import __main__ as cli

    def source_keys(op, args):
        raise AssertionError("d_v must be a multiple of 64 (GEMM N/K tiles)")

    monkeypatch.setattr(cli, "_source_families", lambda: {"sparse_attn": SimpleNamespace(source_keys=source_keys)})
    with pytest.raises(SystemExit) as info:
        main(["source", "--op", "sparse_attn"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert info.value.code == 2 and last.endswith(
        "no sparse_attn kernel for these arguments: d_v must be a multiple of 64 (GEMM N/K tiles)"
    )


def test_help_is_plain_text(capsys):
    for argv in (["--help"], ["source", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    # every option says what it is for
    source_help = " ".join(out.split("usage: python -m sparse_dsa_ops source", 1)[1].split())
    assert "powers of two" in source_help and "slot ids" in source_help


def test_format_table_aligns_columns():
    assert format_table(["a", "bb"], [["ccc", "d"]]).splitlines() == ["a    bb", "---  --", "ccc  d"]


@pytest.fixture
def h200(monkeypatch):
    """The bench's case tables built without a GPU as on an H200 (132 SMs, sm_90), so that the kernels they name
    can be checked; the attention plans made meanwhile are cleared after the test (plans are cached per process)."""
    from types import SimpleNamespace

    import torch

    from sparse_dsa_ops import _cuda

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(_cuda.attention, "is_hopper", lambda: True)
    _cuda.plan_attn.cache_clear()
    yield
    _cuda.plan_attn.cache_clear()


def _cases() -> dict[str, dict]:
    from sparse_dsa_ops.__main__ import bench_cases

    return {c["name"]: c for c in bench_cases()}


def _named_by_path(case: dict) -> bool:
    """Whether ``case``'s path names the kernels of its keys: the families of the K-cache and attention kernels, the
    indexer's and the k-pool store's kernels by their own names, the top-k kernels by how many CTAs take a row."""
    from csrc_tl import indexer, k_cache, kpool, selection
    from csrc_tl.attention.keys import AttnKey, CombineKey
    from csrc_tl.attention.union import UnionKey

    keys, path = case["keys"], case["path"]
    filters = [k for k in keys if isinstance(k, indexer.IndexFilterKey)]
    if filters:  # index_topk's filtered scheme: its filter by name, beside logits and top-k kernels
        others = [k for k in keys if k not in filters]
        plain = all(isinstance(k, (indexer.IndexLogitsKey, selection.TopkKey, selection.TopkSplitKey)) for k in others)
        return len(filters) == 1 and f"{filters[0].name} (lists of " in path and plain
    if len(keys) > 1 and isinstance(keys[0], indexer.IndexLogitsKey):  # index_topk, or its composition: logits + top-k
        return path.startswith(f"{keys[0].name} + top-k (") and all(isinstance(k, selection.TopkKey) for k in keys[1:])
    if len(keys) > 1 and isinstance(keys[-1], kpool.KpoolExpandKey):  # the pool selection: top-k + the expansion
        head, _, expansion = path.rpartition(" + ")
        return expansion == keys[-1].name and _named_by_path(dict(case, keys=keys[:-1], path=head))
    # an attention call over its pool widened: a packed pool's widening kernel last
    if path.startswith("pool to bf16 + "):
        attn = [k for k in keys if isinstance(k, (AttnKey, CombineKey, UnionKey))]
        widen = keys[len(attn) :]
        if not all(isinstance(k, k_cache.CacheKey) and k.kind == "dequant" for k in widen):
            return False
        return len(widen) <= 1 and _named_by_path(dict(case, keys=attn, path=path.removeprefix("pool to bf16 + ")))
    if keys and isinstance(keys[0], UnionKey):  # tokens grouped in head blocks: the union kernel, then the kernels
        head = f"union of {keys[0].tokens} tokens + "
        return path.startswith(head) and _named_by_path(dict(case, keys=keys[1:], path=path.removeprefix(head)))
    if all(isinstance(k, (AttnKey, CombineKey, k_cache.CacheKey)) for k in keys):
        return path.startswith(keys[0].family) and all(k.family in path for k in keys)
    named = (indexer.QuantIndexKey, indexer.IndexLogitsKey, indexer.PagedLogitsKey, kpool.KpoolStoreKey)
    if all(isinstance(k, named) for k in keys):
        return len(keys) == 1 and path == keys[0].name
    if len(keys) == 1 and isinstance(keys[0], selection.TopkKey):
        return path == "a CTA a row"
    chunks = path.removesuffix(" CTAs a row")
    return len(keys) == 1 and isinstance(keys[0], selection.TopkSplitKey) and chunks.isdigit() and int(chunks) > 1


def test_bench_cases_name_their_kernels(h200):
    from sparse_dsa_ops import _cuda

    cases = _cases()
    assert cases["decode 256+0 bf16 T1 S65536 H64 k2048"]["path"] == "attn_decode_ws x32 + combine"
    assert cases["decode 256+0 packed T1 S65536 H64 k2048"]["path"] == "attn_decode_ws x32 + combine"
    assert cases["prefill deepseek bf16 T4096 S8192 H128 k2048"]["path"] == "attn_prefill_ws"
    # FP8 pools that a prefill gathers many times: widened to bf16 first, then the bf16 rows' kernels
    assert cases["prefill 256+0 packed T4096 S8192 H64 k2048"]["path"] == "pool to bf16 + attn_prefill_ws"
    # ... and at 8-16 heads over a small pool, head blocks of several tokens over the union of their selections
    grouped = "union of 8 tokens + attn_prefill_ws (grouped)"
    assert cases["tp prefill deepseek fp8 T4096 S8192 H8 k2048"]["path"] == "pool to bf16 + " + grouped
    # (not where a float8 q's bf16 copy would pass WIDEN_BYTES: 604 MB at 128 heads)
    assert cases["prefill deepseek fp8 T4096 S8192 H128 k2048"]["path"] == "attn_prefill_ws"
    in_kernel = cases["tp prefill deepseek packed T1024 S65536 H16 k2048 in-kernel"]
    assert in_kernel["path"] == "attn_prefill_ws" and all(k.geo.kv_kind == "packed" for k in in_kernel["keys"])
    assert cases["decode 256+0 packed T17 S65536 H8 k2112"]["path"] == "attn_decode_ws x7 + combine"
    assert cases["prefill deepseek bf16 T4096 S8192 H16 k2048"]["path"] == grouped.replace("8 tokens", "4 tokens")
    assert cases["decode deepseek packed T256 S65536 H128 k2048"]["path"] == "attn_prefill_ws"
    assert cases["dequant_k_cache 256+0 1M rows"]["path"] == "dequant"
    # the indexer's warp-specialized kernels for FP8 queries at every head count, the paged one over 64-token pages
    assert cases["index_logits h8 T4096 N64K"]["path"] == "index_logits_d128_h8_qfp8_ws"
    assert cases["paged_index_logits h64 B1 128K"]["path"] == "paged_index_logits_d128_h64_p64_qfp8_ws_s16"
    assert cases["store_index_k 1M rows"]["path"] == "store_index_k_d128_p64_i32"
    # top-k: the few long rows of a decode are split over CTAs, the 4096 rows of a prefill fill the GPU by themselves
    assert cases["topk k2048 of 128K, 1 rows"]["path"].endswith(" CTAs a row")
    assert cases["topk k2048 of 64K, 4096 rows causal"]["path"] == "a CTA a row"
    for name, case in cases.items():
        assert case["keys"] and _named_by_path(case), (name, case["path"], case["keys"])
        for key in case["keys"]:
            _cuda.pass_configs(key)  # a builder is registered for every key (a KeyError otherwise)
        if case["op"] == "topk":
            assert all(f"k{key.k} " in name for key in case["keys"]), name


def test_gpu_check_compiles_the_kernels_its_cases_run(h200, monkeypatch):
    # as on an H200: attention's prefill over bf16, native FP8 and packed rows, its split decode over packed rows at
    # both geometries, both top-k schemes; the warm-up compiles the kernels the cases name, each once
    import torch

    from csrc_tl import selection as topk_builders
    from sparse_dsa_ops import __main__ as cli
    from sparse_dsa_ops import _cuda

    cases, device = cli._check_cases(on_cpu=False), torch.device("cuda")
    assert all(case.keys(device) for case in cases)
    attn = {(c.op, c.geometry): [k.family for k in c.keys(device)] for c in cases if c.op.startswith("sparse_attn")}
    assert attn == {
        ("sparse_attn bf16", DS): ["attn_prefill_ws"],
        ("sparse_attn fp8", DS): ["attn_prefill_ws"],
        ("sparse_attn T2 packed", DS): ["attn_decode_ws", "combine"],
        ("sparse_attn packed", GLM): ["attn_prefill_ws"],
        ("sparse_attn T2 packed", GLM): ["attn_decode_ws", "combine"],
        # (the maxima of the decode's tokens come from attn_max_logits: its gather of packed rows)
        ("sparse_attn_with_max_logits", DS): ["attn_decode_ws", "combine", "gather_dequant"],
        ("sparse_attn_with_max_logits", GLM): ["attn_decode_ws", "combine", "gather_dequant"],
    }
    selection = {c.op: c.keys(device) for c in cases if c.op.startswith("topk")}
    assert [type(k) for k in selection["topk"]] == [topk_builders.TopkSplitKey]
    assert [(type(k), k.page_size) for k in selection["topk to slots"]] == [(topk_builders.TopkKey, 64)]
    compiled = []
    monkeypatch.setattr(_cuda, "warmup", lambda keys, workers: compiled.extend(keys))
    cli._warm_up_check(cases, device)
    # each kernel adds seconds of lowering to the first check on a fresh machine
    assert sorted(map(str, compiled)) == sorted(str(key) for case in cases for key in case.keys(device))
    # (the pool selection reuses the top-k kernels; index_topk's chunks run a logits kernel of their own fill)
    assert len(set(compiled)) == 30
    # the attention kernels (the longest nvcc compiles) are handed to the compile threads first
    attn = [k.__class__.__name__ == "AttnKey" for k in compiled]
    assert attn == sorted(attn, reverse=True)


COPY = (">=", 0.85, "of copy")


def test_every_target_names_a_bench_case(h200):
    # the targets of docs/design.md, each on the bench case that measures it
    from sparse_dsa_ops.__main__ import targets

    want = {
        "prefill deepseek bf16 T4096 S8192 H128 k2048": (">=", 600.0, "TFLOPS"),
        "prefill 256+0 bf16 T4096 S8192 H64 k2048": (">=", 450.0, "TFLOPS"),
        "prefill 256+0 packed T4096 S8192 H64 k2048": (">=", 400.0, "TFLOPS"),
        "decode deepseek packed T256 S65536 H128 k2048": (">=", 400.0, "TFLOPS"),
        "decode deepseek bf16 T1 S65536 H128 k2048": ("<=", 20.0, "us"),
        "decode 256+0 bf16 T1 S65536 H64 k2048": ("<=", 15.0, "us"),
        "decode 256+0 bf16 T17 S65536 H64 k2112": ("<=", 20.0, "us"),
        "decode 256+0 packed T1 S65536 H64 k2048": ("<=", 10.0, "us"),
        "decode 256+0 packed T17 S65536 H64 k2112": ("<=", 15.0, "us"),
    }
    cache_ops = ("quant_k_cache", "store_k_cache", "dequant_k_cache", "gather_k_cache", "gather_dequant_k_cache")
    want |= {f"{op} {geo} 1M rows": COPY for op in cache_ops for geo in ("deepseek", "glm5.3-flash 512+0", "256+0")}
    # the indexer: logits within 1.4x of their roof at 8 to 64 heads, a paged batch at its roof, one paged row of
    # 128K tokens in 12 us; its cache stores as the K cache's, a few rows in 3 us
    want |= {f"index_logits h{h} T4096 N64K": ("<=", 1.4, "x roof") for h in (64, 32, 16, 8)}
    want["index_logits h64 T4096 N64K causal"] = ("<=", 1.4, "x roof")
    want |= {f"paged_index_logits h{h} B64 128K": ("<=", 1.0, "x roof") for h in (64, 8)}
    want |= {f"paged_index_logits h{h} B1 128K": ("<=", 12.0, "us") for h in (64, 8)}
    want |= {f"{op} 1M rows": COPY for op in ("quant_index", "store_index_k")}
    want |= {f"{op} 16 rows": ("<=", 3.0, "us") for op in ("quant_index", "store_index_k")}
    # top-k 2048 of 128K: one row in 12 us, four in 20 us, many rows at 70% of the copy
    want |= {
        "topk k2048 of 128K, 1 rows": ("<=", 12.0, "us"),
        "topk k2048 of 128K, 4 rows": ("<=", 20.0, "us"),
        "topk k2048 of 128K, 64 rows": (">=", 0.70, "of copy"),
        "topk k2048 of 64K, 4096 rows causal": (">=", 0.70, "of copy"),
    }
    # the k-pool ops: a store at 80% of the copy, one pool row of 8192 pools in 10 us, many rows at 60% of the copy
    want["kpool_store_index_k 64K pools of 16"] = (">=", 0.8, "of copy")
    want["kpool_topk k128 of 8192 pools of 16, 1 rows"] = ("<=", 10.0, "us")
    want["kpool_topk k128 of 8192 pools of 16, 64 rows"] = (">=", 0.6, "of copy")
    assert targets() == want


def test_bench_row_reports_the_median_the_range_and_the_target(h200):
    from sparse_dsa_ops.__main__ import bench_row

    cases = _cases()
    ceil = {"matmul_tflops": 800.0, "copy_gbps": 2600.0}
    # GLM packed decode at T 17, target <= 15 us: the median of three rounds decides
    row, record = bench_row(cases["decode 256+0 packed T17 S65536 H64 k2112"], [15.3, 14.6, 14.8], ceil)
    assert row[2] == "14.8" and row[3] == "14.6-15.3"
    assert row[6] == "<= 15 us: met by 1.4%" and record["target"] == row[6]
    assert record["us"] == 14.8 and record["us_rounds"] == [15.3, 14.6, 14.8]
    # DeepSeek packed decode at T 256, target >= 400 TFLOPS (2 * 256 * 128 * 2048 * 1088 flops)
    case = cases["decode deepseek packed T256 S65536 H128 k2048"]
    assert case["flops"] == 2 * 256 * 128 * 2048 * 1088
    row, record = bench_row(case, [366.9, 362.0], ceil)
    assert row[2] == "364.4" and row[4] == "401 TFLOPS" and row[6] == ">= 400 TFLOPS: met by 0.2%"
    row, _ = bench_row(case, [366.9], ceil)
    assert row[3] == "" and row[6] == ">= 400 TFLOPS: missed by 0.5%"
    # within 0.1% of the target the margin has two decimals (FN timed 365.1 us: 399.97 TFLOPS)
    row, _ = bench_row(case, [365.1], ceil)
    assert row[4] == "400 TFLOPS" and row[6] == ">= 400 TFLOPS: missed by 0.01%"
    # a cache op against 85% of the copy ceiling; a case without a target
    row, _ = bench_row(cases["store_k_cache 256+0 1M rows"], [379.2], ceil)
    assert row[5] == "83%" and row[6] == ">= 85% of copy: missed by 2.4%"
    row, record = bench_row(cases["prefill 256+0 fp8 T4096 S8192 H64 k2048"], [1292.8], ceil)
    assert row[6] == "" and record["target"] == ""


def test_bench_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_bench_table_and_json_on_the_cpu(monkeypatch, capsys, tmp_path):
    # the bench loop with the GPU parts stubbed: a CPU gather case timed at 10, 12 and 11 us per round
    import json

    import torch

    from sparse_dsa_ops import __main__ as cli
    from sparse_dsa_ops import _cuda

    pool = torch.zeros(8, 264, dtype=torch.uint8)
    case = dict(
        name="gather_k_cache 256+0 1M rows",
        op="gather_k_cache",
        flops=None,
        bytes=2.6e7,
        keys=[],
        path="gather",
        make=lambda: (pool, torch.arange(4, dtype=torch.int32)),
        target=(">=", 0.8, "of copy"),
    )
    times = iter([10.0, 12.0, 11.0, 13.0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "environment", lambda: [("device", "stub")])
    monkeypatch.setattr(
        cli, "_ceilings", lambda: {"matmul_tflops": 800.0, "fp8_matmul_tflops": 1300.0, "copy_gbps": 2600.0}
    )
    monkeypatch.setattr(cli, "bench_cases", lambda: [case])
    monkeypatch.setattr(cli, "_graph_time_us", lambda fn: (fn(), next(times))[1])
    monkeypatch.setattr(_cuda, "warmup", lambda keys, workers: None)
    assert main(["bench", "--rounds", "3", "--json", str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    assert header.split() == ["case", "kernels", "us", "range", "(3", "rounds)", "rate", "of", "ceiling", "target"]
    row = lines[-1].split()
    assert row[-13:] == [
        "gather",
        "11.0",
        "10.0-12.0",
        "2364",
        "GB/s",
        "91%",
        ">=",
        "80%",
        "of",
        "copy:",
        "met",
        "by",
        "13.6%",
    ]
    record = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert record["us"] == 11.0 and record["us_rounds"] == [10.0, 12.0, 11.0] and record["target"].endswith("13.6%")
    # one round (the default): no range column
    assert main(["bench"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.startswith("case")).split()[3] == "rate"
    assert lines[-1].split()[-11:-7] == ["13.0", "2000", "GB/s", "77%"] and lines[-1].endswith("missed by 3.8%")


def test_source_covers_every_op_with_kernels():
    from sparse_dsa_ops.__main__ import _source_families
    from sparse_dsa_ops.ops import OPS

    assert set(_source_families()) == set(OPS) - {"attn_max_logits"}  # (the one op without a kernel of its own)


def test_source_prints_the_kernels_of_an_op(capsys):
    assert main(["source", "--op", "store_index_k", "--page", "16", "--slot-dtype", "int64", "--target", "hip"]) == 0
    out = capsys.readouterr().out
    assert "// ===== store_index_k_d128_p16_i64, target hip" in out and "__global__" in out
