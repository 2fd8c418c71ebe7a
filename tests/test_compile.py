"""The compile path on the CPU: ``source`` (and with it the lowering sweep) lowers exactly the source that the build
hands to the device compiler, and the build's target is the current GPU's.

The build runs for real up to the device compiler (nvcc or hipcc), which is intercepted: what it would have compiled
is compared with what ``python -m sparse_dsa_ops source`` prints, for one kernel of every family and both targets.
"""

import re

import pytest
import torch
import tvm_ffi

from sparse_dsa_ops import _cuda
from sparse_dsa_ops._cuda import compile as tl_compile
from sparse_dsa_ops.ops import FAMILIES
from tests.hip_compile import cli_keys

CALLBACKS = {"cuda": "tilelang_callback_cuda_compile", "hip": "tilelang_callback_hip_compile"}


class _Intercepted(Exception):
    pass


def built_source(key, target: str, monkeypatch) -> str:
    """The device source the build of ``key`` hands to its device compiler, on a GPU of ``target``'s arch."""
    import tilelang

    seen = []

    def device_compiler(code, *args):
        seen.append(code)
        raise _Intercepted

    name = CALLBACKS[target]
    compiler = tvm_ffi.get_global_func(name)
    monkeypatch.setattr(tl_compile, "device_target", lambda: dict(tl_compile.TARGETS[target]))
    tvm_ffi.register_global_func(name, f=device_compiler, override=True)
    tilelang.disable_cache()  # a kernel from the disk cache would never reach the compiler
    try:
        tl_compile._compile(key)
    except Exception:  # the interception, however TVM's FFI wraps it
        pass
    finally:
        tilelang.enable_cache()
        tvm_ffi.register_global_func(name, f=compiler, override=True)
    assert len(seen) == 1, f"the build of {key.name} did not reach the device compiler"
    return seen[0]


def _family(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]


SLOW = {"attention", "selection"}  # families whose first kernel takes 15 to 30 s to lower (twice here): the sweep's


def _cases():
    for family in (f.gpu() for f in FAMILIES):
        for target in ("cuda", "hip"):
            marks = [pytest.mark.lowering] if _family(family) in SLOW else []
            yield pytest.param(family, target, marks=marks, id=f"{_family(family)}-{target}")


@pytest.mark.parametrize("family, target", list(_cases()))
def test_source_prints_what_the_build_compiles(family, target, monkeypatch):
    # the first kernel `source` prints for the family's first op; the kernels with pass configs of their own (top-k,
    # the warp-specialized attention) are where a lowering without them differed
    key = cli_keys(["--op", family.SOURCE_OPS[0], "--target", target])[0]
    assert numbered_alike(built_source(key, target, monkeypatch)) == numbered_alike(_cuda.lower_source(key, target))


def numbered_alike(source: str) -> str:
    """``source`` with the numbers TileLang appends to repeated names dropped: in a process that has lowered other
    kernels before, one lowering of a kernel can name a buffer ``workspace_1`` where the next names it ``workspace``
    (seen in CI's sweep). Pass configs and targets change what the code does, not only such names."""
    return re.sub(r"\b([A-Za-z_]\w*?)_\d+\b", r"\1", source)


@pytest.mark.parametrize(
    "kind, props, want",
    [
        ("cuda", dict(major=9, minor=0), tl_compile.TARGETS["cuda"]),
        ("cuda", dict(major=8, minor=0), {"kind": "cuda", "arch": "sm_80"}),
        ("hip", dict(gcnArchName="gfx950:sramecc+:xnack-"), tl_compile.TARGETS["hip"]),
        ("hip", dict(gcnArchName="gfx942:sramecc+:xnack-"), {"kind": "hip", "mcpu": "gfx942"}),
    ],
    ids=["h100", "a100", "mi355", "mi300"],
)
def test_the_build_targets_the_current_gpu(kind, props, want, monkeypatch):
    # the arch TileLang itself would detect: on an H100 or an MI355 the very TARGETS entries source lowers for
    class Props:
        pass

    device = Props()
    device.__dict__.update(props)
    monkeypatch.setattr(torch.version, "hip", "7.0" if kind == "hip" else None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    assert tl_compile.device_target() == want
