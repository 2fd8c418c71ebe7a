"""The HIP compile step: kernels lowered for gfx950 and compiled to gfx950 code objects by upstream clang, on a machine
without ROCm or an AMD GPU, with each kernel's resources checked.

Each HIP source is compiled by ``clang++-22 -x hip --offload-arch=gfx950 --cuda-device-only -O3`` against TileLang's
HIP templates and the compile-only headers of ``csrc_tl/hip_headers`` (``-nogpuinc -nogpulib``: no ROCm at all).
clang's kernel-resource-usage remarks give each kernel's registers, scratch, spills and occupancy; TileLang's lowering
gives the dynamic LDS its launch asks for (every kernel here takes its shared memory that way). A kernel fails the step
when it does not compile, spills vector registers or uses scratch, asks for more LDS than a gfx950 workgroup has
(160 KiB), or converts FP8 without gfx950's conversion instructions (a software fallback or a trap where the hardware
converts). Scalar registers spilled into lanes of vector registers are reported, not failed: they never reach memory
(a spill that does shows as scratch).

Three ways in:

* ``python -m tests.hip_compile``: lower a few kernels of every family and compile them (a developer's check);
* ``python -m pytest -p tests.hip_compile --hip-sources DIR ...``: a pytest run (the lowering sweep in CI) writes the
  HIP source of every kernel it lowers into DIR, and ``python -m tests.hip_compile --sources DIR --until DIR/.done``
  compiles them as they come, until the file DIR/.done exists;
* the functions below, which tests/test_hip_compile.py calls.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CLANG = os.environ.get("HIP_CLANG", "clang++-22")  # Debian's clang-22 and lld-22 (.ci/run installs them)
ARCH = "gfx950"
LDS_BYTES = 160 * 1024  # a gfx950 workgroup's LDS
WAVE = 64
SIMDS = 4  # SIMDs of a gfx950 compute unit
HEADERS = Path(__file__).resolve().parent.parent / "csrc_tl" / "hip_headers"
SUFFIX = ".hip"
DYNAMIC_LDS = "// dynamic LDS bytes: "  # the first line of a written source
REMARK_TAG = "[-Rpass-analysis=kernel-resource-usage]"
# gfx950's FP8 and BF8 conversions: v_cvt_f32_fp8, v_cvt_pk_fp8_f32, v_cvt_scalef32_pk_bf16_fp8, ...
FP8_CONVERSION = re.compile(r"^\s*v_cvt_\w*(?:fp8|bf8)\w*", re.MULTILINE)
TRAP = re.compile(r"^\s*s_trap\b", re.MULTILINE)
FP8_TYPE = r"fp8_e[45](?:_\d+)?_t"


class CompileError(RuntimeError):
    pass


@dataclass
class Usage:
    """What clang reports of one kernel, and what the step checks."""

    name: str
    vgprs: int = 0
    agprs: int = 0
    sgprs: int = 0
    lds: int = 0  # bytes: static plus the launch's dynamic LDS
    scratch: int = 0  # bytes a lane
    vgpr_spills: int = 0
    sgpr_spills: int = 0  # into lanes of VGPRs (v_writelane), not memory
    occupancy: int = 0  # waves a SIMD, with the LDS taken into account
    threads: int = 0
    converts_fp8: bool = False  # the source converts to or from FP8
    fp8_instructions: int = 0  # gfx950 FP8 conversion instructions in the code object
    traps: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = list(self.errors)
        if self.vgpr_spills or self.scratch:
            found.append(f"spills {self.vgpr_spills} VGPRs, {self.scratch} bytes of scratch a lane")
        if self.lds > LDS_BYTES:
            found.append(f"asks for {self.lds} bytes of LDS, more than the {LDS_BYTES} of a gfx950 workgroup")
        if self.traps:
            found.append(f"{self.traps} trap instruction(s): an operation gfx950 cannot do as compiled")
        if self.converts_fp8 and not self.fp8_instructions:
            found.append("converts FP8 without gfx950's conversion instructions (a software fallback)")
        return found


def hip_source(key) -> tuple[str, int]:
    """The HIP source of ``key``'s kernel for gfx950, lowered as the build lowers it, and the dynamic LDS (bytes) its
    launch asks for."""
    from sparse_dsa_ops._cuda import compile as tl_compile

    artifact = tl_compile.lower(key, "hip")
    return artifact.kernel_source, dynamic_lds(artifact)


def dynamic_lds(artifact) -> int:
    """The dynamic shared memory the launch of a lowered kernel asks for (TileLang's wrapper reads the same)."""
    sizes = [
        int(func.attrs["dyn_shared_memory_buf"])
        for func in artifact.device_mod.functions.values()
        if func.attrs and "dyn_shared_memory_buf" in func.attrs
    ]
    return max(sizes, default=0)


def write_source(directory: Path, name: str, source: str, lds: int) -> Path:
    """Write a kernel's source for the step (whole or not at all: a compile running beside sees complete files)."""
    path = Path(directory) / f"{name}{SUFFIX}"
    part = path.with_suffix(".part")
    part.write_text(f"{DYNAMIC_LDS}{lds}\n{source}")
    part.replace(path)
    return path


def converts_fp8(source: str) -> bool:
    """Whether a kernel's source converts to FP8 (a cast to an FP8 type) or from FP8 (a cast of an FP8 value)."""
    body = source[source.find('extern "C"') :]
    if re.search(rf"\b{FP8_TYPE}\s*\)\s*\(|\b{FP8_TYPE}\(", body):
        return True
    names = set(re.findall(rf"\b{FP8_TYPE}\s*\*?\s*(?:__restrict__\s+)?(\w+)", body))
    casts = re.findall(r"\((?:float|bfloat16_t|half_t)\)\s*\(\s*(\w+)", body)
    return any(name in names for name in casts)


def compile_source(path: Path, include: tuple[Path, ...] = ()) -> Usage:
    """Compile one written source to a gfx950 code object; ``include``: header directories searched before ours."""
    from tilelang.env import TILELANG_TEMPLATE_PATH

    path = Path(path)
    text = path.read_text()
    lds = int(text.split("\n", 1)[0].removeprefix(DYNAMIC_LDS)) if text.startswith(DYNAMIC_LDS) else 0
    usage = Usage(path.name.removesuffix(SUFFIX), converts_fp8=converts_fp8(text))
    bounds = re.search(r"__launch_bounds__\((\d+)", text)
    usage.threads = int(bounds.group(1)) if bounds else 0
    with tempfile.TemporaryDirectory(prefix="hip-") as work:
        command = [
            CLANG,
            "-x",
            "hip",
            f"--offload-arch={ARCH}",
            "--cuda-device-only",
            "--no-gpu-bundle-output",
            "-nogpuinc",
            "-nogpulib",
            "-O3",
            "-std=c++17",  # as TileLang's own HIP build compiles
            *(f"-I{d}" for d in include),
            f"-I{HEADERS}",
            f"-I{TILELANG_TEMPLATE_PATH}",
            "-Rpass-analysis=kernel-resource-usage",
            "-save-temps=obj",  # the assembly beside the code object, for its instructions
            "-c",
            str(path),
            "-o",
            str(Path(work) / "kernel.co"),
        ]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=work)
        usage.seconds = time.perf_counter() - start
        log = done.stdout + done.stderr
        if done.returncode != 0:
            errors = [line for line in log.splitlines() if "error" in line] or log.splitlines()[-5:]
            usage.errors.append("does not compile: " + " | ".join(errors[:5]))
            return usage
        assembly = "\n".join(p.read_text() for p in Path(work).glob("*.s"))
    remarks = {}
    for line in log.splitlines():
        if REMARK_TAG in line:  # "<where>: remark: <where>:     <key>: <value> [...]", the location before or after
            where_key, value = line.split(REMARK_TAG)[0].rsplit(":", 1)
            remarks.setdefault(where_key.rsplit(":", 1)[1].strip(), value.strip())
    if "VGPRs" not in remarks:
        usage.errors.append("clang reported no resource usage")
        return usage
    usage.vgprs, usage.agprs = int(remarks.get("VGPRs", 0)), int(remarks.get("AGPRs", 0))
    usage.sgprs = int(remarks.get("TotalSGPRs", 0))
    usage.scratch = int(remarks.get("ScratchSize [bytes/lane]", 0))
    usage.vgpr_spills, usage.sgpr_spills = int(remarks.get("VGPRs Spill", 0)), int(remarks.get("SGPRs Spill", 0))
    usage.lds = int(remarks.get("LDS Size [bytes/block]", 0)) + lds
    usage.occupancy = occupancy(int(remarks.get("Occupancy [waves/SIMD]", 0)), usage.lds, usage.threads)
    usage.fp8_instructions = len(FP8_CONVERSION.findall(assembly))
    usage.traps = len(TRAP.findall(assembly))
    return usage


def occupancy(by_registers: int, lds: int, threads: int) -> int:
    """Waves a SIMD: clang's figure (registers, static LDS) bounded by the workgroups whose LDS fits a compute unit
    (clang cannot see the dynamic LDS of a launch)."""
    if not lds or not threads:
        return by_registers
    groups = LDS_BYTES // lds
    return min(by_registers, groups * math.ceil(math.ceil(threads / WAVE) / SIMDS))


def table(usages: list[Usage]) -> str:
    from sparse_dsa_ops.__main__ import format_table

    rows = [
        [
            u.name,
            str(u.threads),
            str(u.vgprs),
            str(u.agprs),
            str(u.sgprs),
            str(u.lds),
            str(u.scratch),
            str(u.vgpr_spills),
            str(u.sgpr_spills),
            str(u.occupancy),
            str(u.fp8_instructions),
            f"{u.seconds:.1f}",
            "; ".join(u.problems()) or "ok",
        ]
        for u in sorted(usages, key=lambda u: u.name)
    ]
    headers = [
        "kernel",
        "threads",
        "VGPRs",
        "AGPRs",
        "SGPRs",
        "LDS B",
        "scratch",
        "VGPR spill",
        "SGPR spill",
        "waves/SIMD",
        "fp8 cvt",
        "s",
        "status",
    ]
    return format_table(headers, rows)


def cli_keys(argv: list[str]) -> list:
    """The kernel keys ``python -m sparse_dsa_ops source <argv>`` lowers, in its order (recorded, not lowered)."""
    from sparse_dsa_ops.__main__ import main as cli
    from sparse_dsa_ops._cuda import compile as tl_compile

    class Lowered:
        kernel_source = ""

    keys, lower, stdout = [], tl_compile.lower, sys.stdout
    tl_compile.lower = lambda key, target: keys.append(key) or Lowered()
    try:
        with open(os.devnull, "w") as sys.stdout:
            assert cli(["source", *argv]) == 0
    finally:
        tl_compile.lower, sys.stdout = lower, stdout
    return keys


def default_keys() -> list:
    """A few kernels of every family for gfx950: every kernel ``source`` prints for each op at its defaults, and the
    attention kernels of the zero-tail geometry over packed rows."""
    from sparse_dsa_ops.__main__ import _source_families

    glm = ["--kv", "packed", "--d-nope", "256", "--d-rope", "0", "--heads", "64"]
    keys = [k for op in _source_families() for k in cli_keys(["--op", op, "--target", "hip"])]
    keys += cli_keys(["--op", "sparse_attn", *glm, "--target", "hip"])
    return list(dict.fromkeys(keys))


def _compile_all(paths, workers: int, include=()) -> list[Usage]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: compile_source(p, include), paths))


def _follow(directory: Path, until: Path, workers: int) -> list[Usage]:
    """Compile every source that appears in ``directory`` until ``until`` exists and all are compiled (and say how
    long the compiles took past that: the time the step adds after the sweeps)."""
    seen, pending = set(), []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while True:
            finished = until.exists()  # read before the listing: a source written before the mark is listed
            for path in sorted(directory.glob(f"*{SUFFIX}")):
                if path not in seen:
                    seen.add(path)
                    pending.append(pool.submit(compile_source, path))
            if finished:
                marked = time.perf_counter()
                usages = [future.result() for future in pending]
                print(f"compiled the last sources {time.perf_counter() - marked:.0f} s after {until.name} appeared")
                return usages
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hip_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=Path, help="compile the sources written here (default: lower a few)")
    parser.add_argument("--until", type=Path, help="with --sources: keep compiling new ones until this file exists")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once")
    args = parser.parse_args(argv)
    if shutil.which(CLANG) is None:
        print(f"{CLANG} is not installed (apt-get install clang-22 lld-22)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.sources is None:
        directory = Path(tempfile.mkdtemp(prefix="hip-sources-"))
        for key in default_keys():
            write_source(directory, key.name, *hip_source(key))
        usages = _compile_all(sorted(directory.glob(f"*{SUFFIX}")), args.jobs)
        shutil.rmtree(directory)
    elif args.until is not None:
        usages = _follow(args.sources, args.until, args.jobs)
    else:
        usages = _compile_all(sorted(args.sources.glob(f"*{SUFFIX}")), args.jobs)
    failed = [u for u in usages if u.problems()]
    print(table(usages))
    print(
        f"\n{len(usages)} HIP kernels compiled for {ARCH} by {CLANG}: {len(usages) - len(failed)} ok, "
        f"{len(failed)} failed, in {time.perf_counter() - start:.0f} s ({sum(u.seconds for u in usages):.0f} s of "
        "compiles)"
    )
    lanes = [u.name for u in usages if u.sgpr_spills]
    if lanes:
        print(f"{len(lanes)} spill SGPRs into VGPR lanes (no memory, not failed): {', '.join(sorted(lanes))}")
    print(f"{ARCH}: {len(usages) - len(failed)} passed, {len(failed)} failed")
    if not usages:
        print("no HIP source to compile: failing", file=sys.stderr)
        return 1
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# The pytest plugin: a run with --hip-sources DIR writes the HIP source of every kernel it lowers for HIP into DIR.


def pytest_addoption(parser):
    parser.addoption("--hip-sources", metavar="DIR", help="write every HIP kernel source lowered here, for the step")


def pytest_configure(config):
    directory = config.getoption("--hip-sources")
    if not directory:
        return
    from sparse_dsa_ops._cuda import compile as tl_compile

    lower = tl_compile.lower

    def lower_and_write(key, target):
        artifact = lower(key, target)
        if target == "hip":
            write_source(Path(directory), key.name, artifact.kernel_source, dynamic_lds(artifact))
        return artifact

    tl_compile.lower = lower_and_write


if __name__ == "__main__":
    sys.exit(main())
