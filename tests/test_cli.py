import subprocess
import sys

import pytest

from sparse_dsa_ops.__main__ import format_table, main


def test_check_prints_every_op_on_the_cpu():
    run = subprocess.run([sys.executable, "-m", "sparse_dsa_ops"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "torch" in out and "tilelang" in out and "device" in out
    for op in ("quant_k_cache", "store_k_cache", "dequant_k_cache", "gather_k_cache", "gather_dequant_k_cache",
               "sparse_attn bf16", "sparse_attn packed", "sparse_attn fp8", "sparse_attn T2 packed"):
        rows = [line for line in out.splitlines() if line.startswith(op + " ")]
        assert len(rows) == 2 and " deepseek " in rows[0] and " glm " in rows[1], rows
    assert "18 of 18 ok" in out and "FAIL" not in out and "ERROR" not in out


def test_unknown_command_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        main(["frobnicate"])
    assert "invalid choice" in capsys.readouterr().err


def test_format_table_aligns_columns():
    assert format_table(["a", "bb"], [["ccc", "d"]]).splitlines() == ["a    bb", "---  --", "ccc  d"]


def test_bench_cases_name_their_kernels(monkeypatch):
    # the case table is built without a GPU here (an H200's 132 SMs), so the kernel column can be checked
    from types import SimpleNamespace

    import torch

    from sparse_dsa_ops import _cuda
    from sparse_dsa_ops.__main__ import bench_cases

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(_cuda, "_is_hopper", lambda: True)
    _cuda.plan_attn.cache_clear()  # plans are cached per process; this one pretends to be an H200
    try:
        cases = {c["name"]: c for c in bench_cases()}
    finally:
        _cuda.plan_attn.cache_clear()
    assert cases["decode glm bf16 T1 S65536 H64 k2048"]["path"] == "attn_decode_ws x16 + combine"
    assert cases["decode glm packed T1 S65536 H64 k2048"]["path"] == "attn_decode_ws x16 + combine"
    assert cases["prefill deepseek bf16 T4096 S8192 H128 k2048"]["path"] == "attn_prefill_ws"
    assert cases["decode glm packed T17 S65536 H8 k2112"]["path"] == "attn_decode_ws x7 + combine"
    assert cases["prefill deepseek bf16 T4096 S8192 H16 k2048"]["path"] == "attn_prefill_ws"
    assert cases["dequant_k_cache glm 1M rows"]["path"] == "dequant"
    for case in cases.values():
        assert [k.family for k in case["keys"]][0] in case["path"]
