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
