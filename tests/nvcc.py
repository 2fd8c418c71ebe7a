"""The sm_90a compile step: a generated CUDA kernel source compiled by nvcc to an sm_90a cubin, on a machine without
a GPU, and the checks the tests make of ptxas's report.

The flags are those TileLang compiles a kernel with (``-arch=sm_90a -O3 -std=c++20`` against its templates and
CUTLASS, ``--use_fast_math`` when the kernel's pass configs ask for it); ``-Xptxas -v`` makes ptxas report each
kernel's registers, spills and warnings in the log the checks read.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
SPILL_STORES = re.compile(r"[1-9]\d* bytes spill stores")
SERIALIZED_WGMMA = re.compile(r"C751[0-9]")


def compile_sm90a(src: str, directory: Path, fast_math: bool = False, keep: bool = False) -> str:
    """Compile the CUDA source ``src`` for sm_90a in ``directory`` (as ``k.cu`` to ``k.cubin``), failing the test
    with nvcc's log when it does not compile; ``keep``: leave nvcc's intermediate files (``k.ptx``, ...) there too.

    Returns nvcc's log (stdout and stderr), ptxas's report included.
    """
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    directory = Path(directory)
    (directory / "k.cu").write_text(src)
    done = subprocess.run(
        [
            NVCC,
            "-cubin",
            "-arch=sm_90a",
            "-O3",
            "-std=c++20",
            f"-I{TILELANG_TEMPLATE_PATH}",
            f"-I{CUTLASS_INCLUDE_DIR}",
            "-Xptxas",
            "-v",
            *(["-keep", "-keep-dir", str(directory)] if keep else []),
            "-o",
            str(directory / "k.cubin"),
            str(directory / "k.cu"),
            *(["--use_fast_math"] if fast_math else []),
        ],
        capture_output=True,
        text=True,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    return log


def assert_no_spills(log: str) -> None:
    """Fail with the log when ptxas spilled registers of any kernel to local memory."""
    # ptxas compiles each role of a warp-specialized kernel to its setmaxnreg budget (a prefill producer at 56
    # registers spilled at one head)
    assert not SPILL_STORES.search(log), log


def assert_no_serialized_wgmma(log: str) -> None:
    """Fail with the log when ptxas serialized the wgmma instructions of any kernel."""
    # ptxas serializes every wgmma of a kernel (C7510-C7519: C7511 / C7514 / C7515 seen) when, e.g., a GEMM's
    # accumulator is written by other instructions while an earlier GEMM is in flight; the kernels still run, only
    # much slower (BENCHMARKS.md)
    assert not SERIALIZED_WGMMA.search(log), log
