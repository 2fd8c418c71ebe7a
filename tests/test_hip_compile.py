"""The HIP compile step (``tests/hip_compile.py``) fails what it must: a kernel whose FP8 conversions are not gfx950's
instructions, and a kernel whose LDS does not fit a gfx950 workgroup. Marked ``hip``; needs clang-22 (CI's HIP step
installs it and runs these), skipped without it."""

import shutil

import pytest

from csrc_tl import indexer as ix
from csrc_tl import selection
from tests import hip_compile

pytestmark = [
    pytest.mark.hip,
    pytest.mark.skipif(shutil.which(hip_compile.CLANG) is None, reason=f"{hip_compile.CLANG} is not installed"),
]

FP8_HEADER = "hip/amd_detail/amd_hip_fp8.h"
# gfx950's conversion builtins in our FP8 header, and what a header without them might do instead
CONVERSIONS = [
    "__builtin_amdgcn_cvt_pk_fp8_f32(v, v, 0, false)",
    "__builtin_amdgcn_cvt_pk_bf8_f32(v, v, 0, false)",
    "__builtin_amdgcn_cvt_f32_fp8(__x, 0)",
    "__builtin_amdgcn_cvt_f32_bf8(__x, 0)",
]
FALLBACKS = {
    # bit manipulation in place of the instruction (the shape of a generic software conversion)
    "software": [
        "(__float_as_uint(v) >> 20)",
        "(__float_as_uint(v) >> 21)",
        "__uint_as_float(__x << 20u)",
        "__uint_as_float(__x << 21u)",
    ],
    # what a header does for a format it cannot convert on this target
    "trap": ["(__builtin_trap(), 0)"] * 2 + ["(__builtin_trap(), 0.0f)"] * 2,
}


@pytest.fixture(scope="module")
def quant_index(tmp_path_factory):
    """quant_index's kernel for gfx950 (it converts bf16 rows to FP8), written for the step."""
    key = ix.QuantIndexKey(128)
    return hip_compile.write_source(tmp_path_factory.mktemp("sources"), key.name, *hip_compile.hip_source(key))


def test_fp8_converts_with_gfx950_instructions(quant_index):
    usage = hip_compile.compile_source(quant_index)
    assert usage.problems() == [] and usage.converts_fp8 and usage.fp8_instructions > 0
    assert usage.vgprs > 0 and usage.occupancy > 0


@pytest.mark.parametrize("fallback", FALLBACKS)
def test_a_conversion_without_the_instructions_fails(fallback, quant_index, tmp_path):
    # the same kernel against an FP8 header whose conversions fall back: searched first, it shadows ours
    header = (hip_compile.HEADERS / FP8_HEADER).read_text()
    for builtin, replacement in zip(CONVERSIONS, FALLBACKS[fallback]):
        assert builtin in header
        header = header.replace(builtin, replacement)
    (tmp_path / FP8_HEADER).parent.mkdir(parents=True)
    (tmp_path / FP8_HEADER).write_text(header)
    usage = hip_compile.compile_source(quant_index, include=(tmp_path,))
    assert not usage.errors and usage.fp8_instructions == 0
    assert "converts FP8 without gfx950's conversion instructions (a software fallback)" in usage.problems()
    assert any("trap" in problem for problem in usage.problems()) == (fallback == "trap")


def test_a_tile_over_the_lds_fails_the_step(tmp_path, capsys):
    # a top-k list of 18432 entries (8 bytes each) takes 164448 bytes of LDS with the rest of the kernel's shared
    # memory, 608 more than a gfx950 workgroup has; it compiles (the launch asks for it), the step refuses it
    key = selection.TopkKey(64, cap=18432)
    hip_compile.write_source(tmp_path, key.name, *hip_compile.hip_source(key))
    assert hip_compile.main(["--sources", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "asks for 164448 bytes of LDS, more than the 163840 of a gfx950 workgroup" in out
    assert "1 HIP kernels compiled for gfx950 by clang++-22: 0 ok, 1 failed" in out


def test_a_kernel_that_does_not_compile_fails_the_step(quant_index, tmp_path, capsys):
    source = quant_index.read_text().replace("fp8_e4_t* __restrict__", "undeclared_t*", 1)
    (tmp_path / quant_index.name).write_text(source)
    assert hip_compile.main(["--sources", str(tmp_path)]) == 1
    assert "does not compile: " in capsys.readouterr().out


def test_no_source_fails_the_step(tmp_path):
    assert hip_compile.main(["--sources", str(tmp_path)]) == 1
