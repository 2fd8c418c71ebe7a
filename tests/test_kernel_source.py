"""Generated kernel sources on the CPU: CUDA (sm_90a) and HIP (gfx950) lowering of every kernel
family, zero-width tails compiled out, and nvcc compiling the CUDA sources for sm_90a.

The default run lowers a representative kernel of each family and target; the whole sweep carries the
``lowering`` marker (``pytest -m lowering``), which CI runs as its own step."""

import functools
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from csrc_tl.attention import head_block
from csrc_tl.attention.plan import ws_plan
from sparse_dsa_ops import KCacheLayout, _cuda, reference
from sparse_dsa_ops.ops import FAMILIES
from tests.nvcc import assert_no_serialized_wgmma, assert_no_spills, compile_sm90a, needs_nvcc
from tests.test_cuda import at_offset, attn_suite_keys

LAYOUTS = {"656": KCacheLayout(512, 64), "264": KCacheLayout(256, 0)}
CACHE_OPS = ["quant_k_cache", "store_k_cache", "dequant_k_cache", "gather_k_cache", "gather_dequant_k_cache"]
ATTN = {
    "glm-256+0-h64": (256, 0, 64),
    "deepseek-512+64-h128": (512, 64, 128),
    "512+0-h16": (512, 0, 16),
    "512+0-h8": (512, 0, 8),
}
LOWERING = pytest.mark.lowering
PATHS = {"prefill": 0, "split": 1}  # the index of each kernel in a geometry's attn_keys


def sweep(values, keep=lambda v: False, ids=None):
    """``values`` as parameters, each but those ``keep`` accepts marked as part of the lowering sweep."""

    def param(v):
        return (
            pytest.param(*v, marks=LOWERING)
            if isinstance(v, tuple)
            else pytest.param(v, marks=LOWERING, id=ids(v) if ids else None)
        )

    return [v if keep(v) else param(v) for v in values]


@functools.cache
def _gpu(name: str, *args):
    """The GPU backend's implementation of op ``name`` called as the dispatcher would (after the op's checker)."""
    from sparse_dsa_ops.ops import OPS

    impl = getattr(getattr(_cuda, OPS[name].family), name)  # (the op's family module holds it)
    return impl(OPS[name].check(*args), *args) if getattr(impl, "takes_checked", False) else impl(*args)


@functools.cache
def source(key, target: str) -> str:
    return _cuda.lower_source(key, target)


def cache_key(op, width, slot="int32"):
    return _cuda.cache_keys(op, LAYOUTS[width], round_scale=True, slot_dtype=slot)[0]


def attn_keys(name, kind, has_len=False, target="cuda"):
    """Keys of a geometry; kind "fp8" is native float8 kv with float8 q."""
    d_v, d_rope, heads = ATTN[name]
    return _cuda.attn_keys(
        kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, has_len, target=target, q_fp8=kind == "fp8"
    )


def kernel_body(src: str) -> str:
    return src[src.index('extern "C"') :]


@pytest.mark.parametrize(
    "op, width, target",
    sweep(
        [(op, w, t) for op in CACHE_OPS for w in LAYOUTS for t in ("cuda", "hip")],
        keep=lambda c: c[1:] == ("656", "cuda") or c == ("store_k_cache", "264", "hip"),
    ),
)
def test_cache_sources(op, width, target):
    src = source(cache_key(op, width), target)
    assert "__global__" in src and f"{op}_kernel" in src
    if op in ("quant_k_cache", "store_k_cache"):
        # the tail input exists exactly when the layout has a tail
        assert ("k_rope" in src) == (LAYOUTS[width].d_rope > 0)
    if op != "gather_k_cache":
        # the bfloat16 view of the tail is created only when there is a tail to move
        assert ("tails" in kernel_body(src)) == (LAYOUTS[width].d_rope > 0)


@pytest.mark.parametrize("target", ["cuda", pytest.param("hip", marks=LOWERING)])
@pytest.mark.parametrize(
    "lay, vec",
    [
        (KCacheLayout(256, 0), 8),
        (KCacheLayout(512, 64), 8),
        pytest.param(KCacheLayout(384, 2), 8, marks=LOWERING),
        (KCacheLayout(256, 2), 4),
        pytest.param(KCacheLayout(384, 0), 4, marks=LOWERING),
    ],
    ids=str,
)
@pytest.mark.parametrize("op", ["quant_k_cache", pytest.param("store_k_cache", marks=LOWERING)])
def test_quant_kernels_write_whole_rows(op, lay, vec, target):
    # a group of 32 lanes quantizes whole rows, `vec` values a lane: one store of `vec` FP8 bytes (8 where
    # the rows keep 8-byte alignment), the tile's amax by a butterfly among its 128 / vec lanes (shuffle
    # distances 8 to 1, or 16 to 1), after the k rows of ROWS_PER_GROUP rows have been loaded
    from csrc_tl.k_cache import ROWS_PER_GROUP, quant_vector

    assert quant_vector(lay) == vec
    body = kernel_body(source(_cuda.cache_keys(op, lay)[0], target))
    if target == "cuda":
        assert f"*(fp8_e4_{vec}_t*)" in body and ("fp8_e4_8_t" in body) == (vec == 8)
        shuffles = [int(d) for d in re.findall(r"__shfl_xor_sync\(\(uint\)4294967295, scale\[0\], (\d+), 32\)", body)]
        assert shuffles == [128 // vec >> k for k in range(1, (128 // vec).bit_length())]
        assert f"int64_t slots[{ROWS_PER_GROUP}];" in body
        # every load of k precedes the first shuffle
        assert body.rindex("k_nope + ") < body.index("__shfl_xor_sync")
    assert ("k_rope" in body) == (lay.d_rope > 0)


@pytest.mark.parametrize("op", ["quant_k_cache", "store_k_cache"])
def test_quant_kernels_refuse_odd_tails(launches, op):
    k_nope, k_rope = torch.randn(2, 256).bfloat16(), torch.randn(2, 3).bfloat16()
    call = {
        "quant_k_cache": lambda: _gpu("quant_k_cache", k_nope, k_rope),
        "store_k_cache": lambda: _gpu(
            "store_k_cache",
            k_nope,
            k_rope,
            torch.zeros(4, 270, dtype=torch.uint8),
            torch.tensor([0, 1], dtype=torch.int32),
        ),
    }[op]
    with pytest.raises(ValueError, match=f"dsa.{op} on a GPU: k_rope must have an even width, got d_rope = 3"):
        call()
    assert not launches


@pytest.mark.parametrize(
    "target", sweep(["cuda", "hip"], keep=lambda t: t == "cuda", ids=lambda t: f"for-{t}"), ids=lambda t: f"for-{t}"
)
def test_union_sources(target):
    # the union of a group's selections: one shared byte a pool row set by atomicOr, every index guarded (nothing read
    # of the table for an invalid one), a block-wide prefix sum of the emitted entries, each written with its tokens'
    # bits above its row (the HIP sweep's source is compiled by CI's HIP step)
    from csrc_tl.attention.union import UnionKey

    body = kernel_body(source(UnionKey(8, 1 << 14, True), target))
    assert "atomicOr" in body and "shfl_up" in body and "<< 24)" in body
    assert "(x[0] < slots) && (x[0] < 16384)" in body, "a row past the pool or the table is never valid"
    assert "lengths[" in body and "topk_length[" in body


def test_grouped_blocks_mask_by_token():
    # a grouped head block's producer decodes each entry (row below bit 24, tokens above) and its consumers keep the
    # score of row h where the entry has the bit of row h's token (h // 8 at 8 heads a token)
    body = kernel_body(source(_cuda.group_keys("bf16", 512, 64, 8, 576**-0.5, False, target="cuda")[-1], "cuda"))
    assert "16777215)" in body and ">> 24) & 255)" in body
    assert re.search(r"ok0\)\[[^;]*\] >> [^;]*& 1\)", body) and re.search(r"ok1\)\[[^;]*\] >> [^;]*& 1\)", body)


@pytest.mark.parametrize(
    "kind, target",
    # the default run: CUDA; the sweep lowers them for HIP too (and CI's HIP step compiles them)
    sweep([(k, t) for k in ("mark", "remap") for t in ("cuda", "hip")], keep=lambda c: c[1] == "cuda"),
)
def test_row_map_sources(kind, target):
    # the row maps of a serving pool's selected rows: one guarded pass over the ids, no read of the pool rows' table
    # for an invalid id (mark: a store of 1 where selected; remap: the row's place, or -1)
    from csrc_tl.attention.rows import RowsKey

    body = kernel_body(source(RowsKey(kind), target))
    assert re.search(r"0 <= ids\[", body) and re.search(r"ids\[[^;]*\] < s\b", body)
    if kind == "mark":
        assert re.search(r"flags\[[^;]*\] = 1;", body) and "pos" not in body
    else:
        assert "pos[ids[" in body and "- 1)" in body and "= -1;" in body


@pytest.mark.parametrize(
    "name, kind, target",
    sweep(
        [(n, k, t) for n in ATTN for k in ("bf16", "packed", "fp8") for t in ("cuda", "hip")],
        # the default run: DeepSeek's packed kernels for sm_90a (warp-specialized prefill and split decode, combine with
        # a tail) and GLM's bf16 kernels for gfx950 (the portable ones, without a tail)
        keep=lambda c: c in {("deepseek-512+64-h128", "packed", "cuda"), ("glm-256+0-h64", "bf16", "hip")},
    ),
)
def test_attention_sources(name, kind, target):
    keys = attn_keys(name, kind, target=target)
    # the warp-specialized kernels are CUDA-only; under 64 heads they pad the head block (512+0-h16)
    ws = target == "cuda"
    # FP8 rows of 256 are staged raw and widened by two producer warpgroups
    staged = kind != "bf16" and ATTN[name][0] == 256
    families = ["attn_prefill_ws", "attn_decode_ws", "combine"]
    assert [k.family for k in keys] == (families if ws else ["attn_prefill", "attn_decode", "combine"])
    for key in keys[:-1]:
        body = kernel_body(source(key, target))
        has_tail = ATTN[name][1] > 0
        # no tail buffers, copies or GEMMs when d_rope == 0
        assert ("qt_s" in body) == has_tail and ("kt_s" in body) == has_tail
        if target == "cuda":
            gemms = len(re.findall(r"wgmma_ss<|gemm_ss<|mma_sync", body))
            assert gemms >= 2
        if kind == "fp8":
            # q and kv arrive as float8 and are widened on the way into shared memory
            # (kernels that widen rows in place name kv after their view of it as 2-byte words)
            # (a kernel launched as a programmatic dependent has no __restrict__ parameters: nvcc)
            assert re.search(r"fp8_e4_t\* (__restrict__ )?q\b", body)
            assert re.search(r"fp8_e4_t\* (__restrict__ )?(kv|words)\b", body)
    if ws:
        for key in keys[:2]:
            # the prefill over staged packed rows without a tail copies each row by one TMA bulk copy
            bulk = staged and kind == "packed" and not ATTN[name][1] and key.family == "attn_prefill_ws"
            # packed rows of the transposed prefill at 8 heads or fewer go through registers: no copies at all
            direct = ws_plan(key.geo, split=key.split, transposed=key.transposed).direct
            # Each warpgroup role syncs its own warps only through named barriers no other role uses:
            # a shared id lets warps of two roles complete each other's barrier, a timing-dependent
            # deadlock (TileLang 0.1.15 gave the producer the first consumer's id after a cp.async wait).
            body = kernel_body(source(key, target))
            roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", body)[1:]
            assert len(roles) == 3
            # one producer warpgroup, or two (256 threads) where staged FP8 rows are widened
            assert f"__launch_bounds__({512 if staged else 384}, 1)" in body
            ids = [set(re.findall(r"__sync_thread_partial\((\d+), \d+\)", role)) for role in roles]
            assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2]), ids
            assert all("__syncthreads" not in role for role in roles)
            # bf16 rows go to shared memory by cp.async and signal the stage barrier when they land;
            # 256-wide FP8 rows are staged raw by cp.async (packed rows in the prefill: by bulk copies
            # that land on the raw stage's barrier) and widened shared-to-shared, wider ones copied raw
            # into their own stage and widened there (each thread waits for its own copies; in place,
            # each row's lanes after a warp sync: dsa_widen<kScaled, kSync = true>)
            assert ("cp_async" in roles[2]) == (not bulk and not direct)
            assert ("cp_async_wait" in roles[2]) == (kind != "bf16" and not bulk and not direct)
            assert ("dsa_ld_row<" in roles[2]) == direct
            assert ("dsa_bulk_row<256, 264>(" in roles[2]) == bulk
            if bulk:
                # no barrier among the producer threads (TileLang's planner put two in every pass around
                # reads at a data-dependent column); a warp sync and a proxy fence before each refill
                assert "__sync_thread_partial" not in roles[2] and "dsa_widen_bulk(" in roles[2]
                # before the first producer block and before each of the four of a pair loop step (64 rows each)
                assert roles[2].count("dsa_bulk_reuse();") == 5
                assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in source(key, target)
            assert bool(re.search(r"dsa_widen<false, false>\(", roles[2])) == (kind == "fp8" and staged)
            widened_in_place = kind != "bf16" and not staged and not direct
            assert bool(re.search(r"dsa_widen<(true|false), true>\(", roles[2])) == widened_in_place
            # no barrier among the producer threads inside the loop of widening calls (TileLang puts one
            # there when it sees the stage's reads and writes through T.access_ptr; it cost ~10% at
            # DeepSeek geometry)
            assert not re.search(
                r"\{\s*tl::__sync_thread_partial\([^;]*;\s*(#pragma unroll\s*)?"
                r"(for \([^)]*\) \{\s*)?dsa_widen<",
                roles[2],
            )
            assert ("mbarrier_cp_async_arrive_noinc" in roles[2]) == (kind == "bf16")
            if kind != "bf16" and not staged:
                # rows widened in place or through registers: no barrier among the producer threads at all
                # (TileLang put three per pass and block around copies and valid flags it saw; ~5% at DeepSeek geometry)
                assert "__sync_thread_partial" not in roles[2]
            if widened_in_place:
                assert "dsa_cp_async<16>" in roles[2] and "cp_async_gs_conditional" not in roles[2]
                # one copy group per pass, each widened as soon as it lands (not after the whole block)
                assert "dsa_cp_async_wait(" in roles[2] and "tl::cp_async_wait<0>" not in roles[2]
            # q reaches shared memory in 16-byte vectors: a scalar copy (what TileLang makes of a
            # [64, d] tile over 384 threads) once took ~23% of the kernel's time
            assert re.search(r"\*\((uint4|fp8_e4_8_t)\*\)\(q \+ ", roles[0] + roles[1])  # by the consumers
            for buf in ("q_l", "q_r"):
                assert not re.search(rf"\(\(bfloat16_t\*\){buf}\)\[[^;]*\] = q\[", body)
        # Programmatic dependent launch: the split kernel waits for the kernel before it ahead of any
        # global access (every role starts after the wait) and lets the combine launch once consumer
        # warpgroup 0 has stored its partial (its role's last act); the combine waits before it reads
        # the partials and then lets the next kernel launch. The prefill kernel is launched plainly.
        prefill, split = (kernel_body(source(key, target)) for key in keys[:2])
        assert "cudaGridDependencySynchronize" not in prefill and "cudaTrigger" not in prefill
        wait = split.index("cudaGridDependencySynchronize();")
        assert wait < split.index("warpgroup_reg_")
        assert not re.search(r"\b(q|indices|kv|out|lse|words|values|tails)\[", split[:wait])
        role0 = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", split)[1]
        assert split.count("cudaTriggerProgrammaticLaunchCompletion();") == 1
        assert role0.index("cudaTriggerProgrammaticLaunchCompletion();") > role0.rindex("dsa_copy16((&(out[")
        # a split kernel walks exactly its top-k blocks: its producer skips the second block of a last
        # odd pair (no padding block); a prefill kernel walks whole pairs
        assert "if (((pair * 2) + 1) <" in split and "if (((pair * 2) + 1) <" not in prefill
    combine = kernel_body(source(keys[-1], target))
    assert "combine_kernel" in combine
    # the combine loads the partials of a chunk of splits before it uses any (one memory round trip for
    # up to COMBINE_CHUNK splits; one load after another took ~1 us more of a GLM decode on an H200);
    # the split kernel stores them as bf16 through shared memory, and the combine reads 16-byte vectors
    chunk = combine[combine.index("for (int ck") :]
    assert chunk.index("expf(") > max(chunk.rindex("part_out +"), chunk.rindex("part_lse["))
    split_body = kernel_body(source(keys[1], target))
    if target == "cuda":
        assert "*(uint4*)(vals + " in chunk and re.search(r"const bfloat16_t\* (__restrict__ )?part_out", combine)
        # (a warp-specialized split kernel copies the partial out of its shared tile by dsa_copy16, a
        # portable one by TMA)
        assert ("dsa_copy16((&(out[" if ws else "tma_store(out_desc") in split_body
        if ws:
            # the consumer warpgroups order their partial stores by named barriers 14 and 15, which none
            # of TileLang's own syncs takes
            assert "dsa_bar_sync(14, 128);" in split_body and "dsa_bar_sync(15, 128);" in split_body
            assert not re.search(r"__sync_thread_partial\((14|15),", split_body)
    if ws:
        assert keys[-1].pdl
        trigger = combine.index("cudaTriggerProgrammaticLaunchCompletion();")
        assert combine.index("cudaGridDependencySynchronize();") < trigger < combine.index("part_lse[")
    else:  # HIP, or a portable split kernel: plain launches
        assert not keys[-1].pdl and "GridDependency" not in combine


@LOWERING
def test_tail_gemm_is_compiled_out():
    # the same kernel with and without a tail differs by exactly the tail's GEMM and copies
    with_tail = kernel_body(source(attn_keys("deepseek-512+64-h128", "bf16")[0], "cuda"))
    no_tail = kernel_body(source(_cuda.attn_keys("bf16", 512, 0, 128, 576**-0.5, False, target="cuda")[0], "cuda"))
    assert with_tail.count("initialize_wgmma_descriptor") > no_tail.count("initialize_wgmma_descriptor")
    assert "kt_s" not in no_tail


@pytest.mark.parametrize(
    "name, path", [("deepseek-512+64-h128", "prefill"), pytest.param("glm-256+0-h64", "split", marks=LOWERING)]
)
def test_topk_length_variant_takes_the_lengths(name, path):
    plain = source(attn_keys(name, "packed")[PATHS[path]], "cuda")
    with_len = source(attn_keys(name, "packed", has_len=True)[PATHS[path]], "cuda")
    assert "topk_length" not in plain and "topk_length" in with_len


# the warp-specialized kernels of the GPU suite the default run lowers: those test_attention_sources lowers
SUITE_WS_SAMPLE = set(attn_keys("deepseek-512+64-h128", "packed")[:2])


@needs_nvcc
@pytest.mark.parametrize(
    "key",
    [
        cache_key("store_k_cache", "656", "int64"),
        attn_keys("deepseek-512+64-h128", "packed", has_len=True)[0],
        *sweep(
            [
                cache_key("quant_k_cache", "264"),
                cache_key("gather_dequant_k_cache", "264"),
                *attn_keys("glm-256+0-h64", "bf16"),
                attn_keys("deepseek-512+64-h128", "packed", has_len=True)[1],
                *attn_keys("deepseek-512+64-h128", "fp8")[:2],
                attn_keys("deepseek-512+64-h128", "bf16")[0],
                attn_keys("deepseek-512+64-h128", "bf16", has_len=True)[0],
                attn_keys("glm-256+0-h64", "fp8", has_len=True)[0],
                attn_keys("glm-256+0-h64", "packed")[0],
                attn_keys("512+0-h16", "packed")[0],
                attn_keys("512+0-h16", "packed", has_len=True)[1],
                attn_keys("512+0-h8", "packed", has_len=True)[0],
                *_cuda.group_keys("bf16", 512, 64, 8, 576**-0.5, True, target="cuda", sink=True)[1:],
                _cuda.group_keys("bf16", 512, 0, 16, 512**-0.5, False, target="cuda")[-1],
                _cuda.group_keys("bf16", 256, 0, 32, 256**-0.5, False, target="cuda")[-1],
            ],
            ids=lambda k: k.name,
        ),
    ],
    ids=lambda k: k.name,
)
def test_cuda_sources_compile_for_sm90a(key, tmp_path):
    # the flags TileLang passes nvcc for this kernel (its pass configs)
    fast = _cuda.pass_configs(key).get("tl.enable_fast_math", False)
    log = compile_sm90a(source(key, "cuda"), tmp_path, fast_math=fast, keep=True)
    assert (tmp_path / "k.cubin").stat().st_size > 1000
    assert_no_spills(log)
    assert_no_serialized_wgmma(log)
    if key.family.startswith("attn_"):
        # a block's output is scaled by one reciprocal per row, not divided element by element: the
        # IEEE divisions (div.rn.f32, 128 to 256 per kernel) took ~2.5 us at the end of every block on
        # an H200
        ptx = (tmp_path / "k.ptx").read_text()
        assert "div.rn.f32" not in ptx
    if key.family.endswith("_ws"):
        # the warp-specialized kernels are built with fast math: each exp2 one ex2.approx.ftz, not the
        # IEEE form with its handling of subnormal results
        assert fast and "ex2.approx.ftz.f32" in ptx and not re.search(r"ex2\.approx\.f32", ptx)


@pytest.mark.parametrize(
    "key",
    sweep(
        [k for k in attn_suite_keys("cuda") if k.family.endswith("_ws")],
        keep=lambda k: k in SUITE_WS_SAMPLE,
        ids=lambda k: k.name,
    ),
    ids=lambda k: k.name,
)
def test_gpu_suite_ws_kernels_lower(key):
    # every warp-specialized kernel the GPU suite runs lowers for sm_90a on the CPU: TileLang's barrier
    # planner refuses some loop forms in some geometries only ("Cannot lower a required shared-memory
    # sync inside a divergent region", met at 256+0 native FP8, 128 heads)
    body = kernel_body(source(key, "cuda"))
    assert body.count("warpgroup_reg_") == 3 and "wgmma_ss<" in body


# a buffer TileLang allocates without a name of its own ("v", then "v_1", ... and their barriers' "v_2_mem")
UNNAMED_BUFFER = re.compile(r"(?:void\*|auto|uint64_t)\s+v(?:_\d+)?(?:_mem)?\b")


@pytest.mark.parametrize(
    "key",
    sweep(
        [k for k in attn_suite_keys("cuda") if k.family.endswith("_ws")],
        keep=lambda k: k in SUITE_WS_SAMPLE,
        ids=lambda k: k.name,
    ),
    ids=lambda k: k.name,
)
def test_every_shared_buffer_has_a_name(key):
    # TileLang numbers buffers of the same (default) name in an order that changes from one process to
    # the next, and the generated kernel changes with it: which raw stage sits where in shared memory,
    # and in some kernels where the producer's barriers go (7 of the GPU suite's 62
    # warp-specialized kernels differed between three processes, none after the raw stages got names)
    assert not UNNAMED_BUFFER.search(source(key, "cuda"))


@LOWERING
def test_lowering_is_the_same_in_every_process():
    # kernels that came out differently from process to process before their buffers were named
    code = (
        "from sparse_dsa_ops import _cuda; import hashlib; "
        "keys = _cuda.attn_keys('fp8', 256, 0, 64, 256 ** -0.5, False, target='cuda', q_fp8=True)[:2] "
        "+ _cuda.attn_keys('packed', 256, 64, 64, 320 ** -0.5, False, target='cuda')[:1]; "
        "print(*(hashlib.sha256(_cuda.lower_source(k, 'cuda').encode()).hexdigest() for k in keys))"
    )
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = {run.communicate()[0] for run in runs}
    assert all(run.returncode == 0 for run in runs) and len(outs) == 1, outs


# (tokens, heads, top-k, blocks a split at least, the plan's split count)
SPLIT_PLANS = [
    (1, 64, 2048, 1, 32),  # GLM T1: one block per split, 32 blocks in flight
    (1, 64, 2048, 2, 16),  # a persistent prefill's tail: two blocks per split
    (17, 64, 2112, 1, 7),  # GLM T17: 119 blocks, one wave on 132 SMs (8 splits would be 136: two waves)
    (17, 64, 2112, 2, 7),  # ... 7 splits of 5 blocks, the last one 3
    (1, 64, 2112, 2, 11),  # 33 blocks: 16 splits would walk 3 blocks each, as 11 do
    (1, 128, 2048, 1, 32),  # DeepSeek T1: two head blocks
    (17, 128, 2048, 2, 3),  # DeepSeek T17: 34 (token, head block) pairs
    (66, 128, 2048, 1, 1),  # 132 pairs fill the GPU: the prefill path
    (3, 16, 64, 1, 1),  # one top-k block cannot be split
    (3, 64, 64, 2, 1),
    (3, 64, 0, 2, 1),
]


@pytest.mark.parametrize(
    "tokens, heads, topk, min_blocks, splits",
    SPLIT_PLANS,
    ids=[f"T{t}-h{h}-k{k}-min{m}" for t, h, k, m, _ in SPLIT_PLANS],
)
def test_decode_split_plan(tokens, heads, topk, min_blocks, splits):
    plan = _cuda.plan_splits(tokens, heads, topk, 132, min_blocks)
    assert plan == splits
    assert plan == 1 or tokens * -(-heads // 64) * plan <= 132  # never a second wave
    assert plan == 1 or topk // 64 // plan >= min_blocks
    if plan > 1:  # no split count has fewer blocks per split, and no smaller one as few

        def per_split(n):
            return math.ceil(topk // 64 / n)

        cap = min(topk // 64 // min_blocks, 132 // (tokens * math.ceil(heads / 64)))
        assert per_split(plan) == min(per_split(n) for n in range(1, cap + 1))
        assert all(per_split(n) > per_split(plan) for n in range(1, plan))


@pytest.mark.parametrize(
    "kind, geo, tokens, topk, target, plan",
    [
        ("bf16", "glm-256+0-h64", 1, 2048, "cuda", "attn_decode_ws x32 + combine"),
        ("bf16", "glm-256+0-h64", 17, 2112, "cuda", "attn_decode_ws x7 + combine"),  # 5 blocks per split
        ("bf16", "deepseek-512+64-h128", 1, 2048, "cuda", "attn_decode_ws x32 + combine"),
        ("packed", "glm-256+0-h64", 1, 2048, "cuda", "attn_decode_ws x32 + combine"),  # staged FP8 rows
        ("packed", "deepseek-512+64-h128", 1, 2048, "cuda", "attn_decode_ws x32 + combine"),  # widened in place
        ("packed", "glm-256+0-h64", 17, 2112, "cuda", "attn_decode_ws x7 + combine"),
        ("packed", "deepseek-512+64-h128", 256, 2048, "cuda", "attn_prefill_ws"),
        ("bf16", "glm-256+0-h64", 1, 2048, "hip", "attn_decode x32 + combine"),  # no warp specialization
        # 16 heads (a tensor-parallel shard): the warp-specialized kernels over a padded head block
        ("bf16", "512+0-h16", 300, 2048, "cuda", "attn_prefill_ws"),
        # the persistent GLM packed prefill: the tokens of its last, partial round take the split path (4 after 31
        # rounds of 132 64-head tokens, in 16 splits; 36 after 2 rounds, in 3; 4 after 62 rounds of 66 128-head
        # tokens), unless their top-k ranges are short or the split path would split them in fewer than 3 parts
        (
            "packed",
            "glm-256+0-h64",
            4096,
            2048,
            "cuda",
            "attn_prefill_ws + attn_decode_ws x16 + combine (last 4 tokens)",
        ),
        (
            "packed",
            "glm-256+0-h64",
            300,
            2048,
            "cuda",
            "attn_prefill_ws + attn_decode_ws x3 + combine (last 36 tokens)",
        ),
        ("packed", (256, 0, 128), 4096, 2048, "cuda", "attn_prefill_ws + attn_decode_ws x16 + combine (last 4 tokens)"),
        ("packed", "glm-256+0-h64", 4092, 2048, "cuda", "attn_prefill_ws"),  # 31 whole rounds
        ("packed", "glm-256+0-h64", 4096, 512, "cuda", "attn_prefill_ws"),  # items too short to split off
        ("packed", "glm-256+0-h64", 4200, 2048, "cuda", "attn_prefill_ws"),  # 108 tokens left: no split
        ("packed", "glm-256+0-h64", 190, 2048, "cuda", "attn_prefill_ws"),  # 58 tokens left: only 2 splits
        ("bf16", "deepseek-512+64-h128", 4096, 2048, "cuda", "attn_prefill_ws"),  # one CTA per item: every token
        ("packed", "glm-256+0-h64", 4096, 2048, "hip", "attn_prefill"),
        ("packed", "512+0-h16", 1, 2048, "cuda", "attn_decode_ws x32 + combine"),  # transposed: one block a split
        ("bf16", "512+0-h16", 1, 2048, "hip", "attn_decode x32 + combine"),
    ],
    ids=lambda v: "{}+{}-h{}".format(*v) if isinstance(v, tuple) else None,
)
def test_attention_plan(kind, geo, tokens, topk, target, plan):
    d_v, d_rope, heads = ATTN[geo] if isinstance(geo, str) else geo
    got = _cuda.plan_attn(kind, d_v, d_rope, heads, (d_v + d_rope) ** -0.5, False, False, tokens, topk, 132, target)
    assert str(got) == plan
    assert got.keys[-1].family == ("combine" if got.splits > 1 else got.keys[0].family)
    assert 0 <= got.prefill_tokens <= tokens and (got.prefill is None) == (got.prefill_tokens == 0)
    assert (got.prefill_tokens < tokens) == bool(got.split)
    if got.prefill and got.split:  # whole waves in the prefill, one wave of splits after it
        items = -(-heads // 64)
        assert got.prefill_tokens * items % 132 == 0 and (tokens - got.prefill_tokens) * items * got.splits <= 132
    if got.splits > 1:
        # the split kernel's partial output has whole head blocks of its kernel (64 heads when
        # warp-specialized, else 16 at 16 heads), and the combine is built for the same rows
        block = 64 if got.split[0].family == "attn_decode_ws" else head_block(heads)
        assert got.partial_heads == got.split[1].partial_heads == -(-heads // block) * block


@pytest.fixture
def launches(monkeypatch):
    """The CUDA backend's op functions run on CPU tensors, each kernel launch recorded instead of run:
    a list of (kernel key, launch arguments)."""
    calls = []
    for family in (f.gpu() for f in FAMILIES):  # each family module launches through its own imported names
        monkeypatch.setattr(family, "kernel", lambda key: lambda *args: calls.append((key, args)), raising=False)
    monkeypatch.setattr(_cuda.attention, "sm_count", lambda device: 132)
    monkeypatch.setattr(_cuda.attention, "is_hopper", lambda: True)
    return calls


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_misaligned_inputs_reach_the_kernels_as_aligned_copies(launches, offset):
    # q, indices and topk_length at an offset: the kernels load 16-byte vectors from their data pointers
    q = torch.randn(3, 64, 256).bfloat16()
    idx = torch.randint(-1, 8, (3, 64), dtype=torch.int32)
    lengths = torch.tensor([0, 5, 64], dtype=torch.int32)
    kv = torch.zeros(8, 264, dtype=torch.uint8)
    int_offset = offset if offset % 4 == 0 else 4  # (int32 views need 4-byte steps)
    _gpu(
        "sparse_attn",
        at_offset(q, offset),
        kv,
        at_offset(idx, int_offset),
        256**-0.5,
        256,
        at_offset(lengths, int_offset),
    )
    ((_, got),) = launches
    assert all(t.data_ptr() % 16 == 0 for t in got[:4] if isinstance(t, torch.Tensor))
    assert torch.equal(got[0], q) and torch.equal(got[2], idx) and torch.equal(got[3], lengths)
    assert got[1] is kv or got[1].data_ptr() == kv.data_ptr()  # the pool is never copied
    launches.clear()
    aligned = [q, kv, idx]
    _gpu("sparse_attn", *aligned, 256**-0.5, 256)
    assert launches[0][1][0] is q  # aligned inputs are passed as they are, not as views made per call


@pytest.mark.parametrize("heads, t_count, main", [(64, 137, 132), (128, 71, 66)])
def test_last_partial_round_takes_the_split_path(launches, heads, t_count, main):
    # the persistent GLM packed prefill on 132 SMs: the prefill kernel takes the tokens of whole rounds (132 tokens of
    # 64 heads, 66 of 128 heads), the split kernel and the combine the last 5, all on views of the call's tensors: the
    # split path's rows of q, indices and topk_length (copied where they start off a 16-byte boundary, as 66 int32
    # lengths in do), of out and lse
    topk, d_qk, d_v = 1024, 256, 256
    q = torch.randn(t_count, heads, d_qk).bfloat16()
    kv = torch.zeros(8, 264, dtype=torch.uint8)
    idx = torch.randint(-1, 8, (t_count, topk), dtype=torch.int32)
    lengths = torch.randint(0, topk, (t_count,), dtype=torch.int32)
    out, lse = _gpu("sparse_attn", q, kv, idx, d_qk**-0.5, d_v, lengths)
    (prefill, first), (split, rest), (combine, merged) = launches
    assert (prefill.family, split.family, combine.family) == ("attn_prefill_ws", "attn_decode_ws", "combine")
    for got, want in zip(first[:4], (q[:main], kv, idx[:main], lengths[:main])):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    for got, want in zip(first[4:], (out[:main], lse[:main])):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    assert rest[0].data_ptr() == q[main:].data_ptr() and torch.equal(rest[0], q[main:])
    assert rest[2].data_ptr() == idx[main:].data_ptr() and torch.equal(rest[2], idx[main:])
    assert torch.equal(rest[3], lengths[main:]) and rest[3].data_ptr() % 16 == 0
    assert (rest[3].data_ptr() == lengths[main:].data_ptr()) == (main * 4 % 16 == 0)
    part_out, part_lse = rest[4:]
    assert part_out.shape == (5, 8, 128 if heads == 128 else 64, d_v) and part_lse.shape == (5, 8, heads)
    assert merged[0] is part_out and merged[1] is part_lse
    assert merged[2].data_ptr() == out[main:].data_ptr() and merged[2].shape == (5, heads, d_v)
    assert merged[3].data_ptr() == lse[main:].data_ptr() and merged[3].shape == (5, heads)


@pytest.mark.parametrize(
    "row_bytes, offset, ok",
    [
        (264, 8, True),  # a 264-byte pool sliced by one row: rows start 8 bytes past 16-byte boundaries anyway
        (392, 8, True),
        (264, 4, False),
        (656, 8, False),  # 656-byte rows all start on 16-byte boundaries in an aligned pool
        (528, 8, False),
        (656, 0, True),
    ],
)
def test_pools_must_start_where_a_row_can(launches, row_bytes, offset, ok):
    lay = KCacheLayout.from_row_bytes(row_bytes)
    pool = at_offset(torch.zeros(16, row_bytes, dtype=torch.uint8), offset)
    q = torch.randn(2, 16, lay.d_qk).bfloat16()
    idx = torch.zeros(2, 64, dtype=torch.int32)
    k_nope = torch.randn(2, lay.d_nope).bfloat16()
    k_rope = torch.randn(2, lay.d_rope).bfloat16() if lay.d_rope else None
    loc = torch.tensor([1, 3], dtype=torch.int32)
    calls = [
        lambda: _gpu("sparse_attn", q, pool, idx, lay.d_qk**-0.5, lay.d_nope),
        lambda: _gpu("store_k_cache", k_nope, k_rope, pool, loc),
        lambda: _gpu("gather_k_cache", pool, loc),
        lambda: _gpu("gather_dequant_k_cache", pool, loc),
    ]
    for call in calls:
        if ok:
            call()
        else:
            need = math.gcd(row_bytes, 16)
            with pytest.raises(ValueError, match=f"rows of {row_bytes} bytes.*a multiple of {need} bytes"):
                call()
    assert len(launches) == (len(calls) if ok else 0)
    # dequant_k_cache reads the whole input: a misaligned one is copied instead
    launches.clear()
    _gpu("dequant_k_cache", pool)
    ((_, (rows, _)),) = launches
    assert rows.data_ptr() % 16 == 0 and torch.equal(rows, pool)


@pytest.mark.parametrize(
    "kind, path", [("bf16", "attn_prefill_ws"), ("packed", "attn_prefill"), ("fp8", "attn_prefill")]
)
def test_ws_kernels_need_whole_chunks_per_half(kind, path):
    # 384 + 0 (a 396-byte packed row): a half of a bf16 row is three 16-byte chunks of each of the
    # eight threads of a row, but a half of an FP8 row (192 values) is not whole 16-value chunks, and
    # the warp-specialized producer would leave part of it unwritten: those rows take the portable kernels
    plan = _cuda.plan_attn(kind, 384, 0, 64, 384**-0.5, False, kind == "fp8", 4096, 2048, 132, "cuda")
    assert str(plan) == path


@LOWERING
def test_staged_copies_respect_row_alignment():
    # the 392-byte packed row (256 + 64): rows and the bf16 tail at byte 264 are 8-byte aligned only,
    # so every cp.async of the staged producer moves 8 bytes (a 16-byte copy there is a misaligned
    # address); the 320-byte native FP8 row copies its values in 16 bytes and its tail in 8
    import re

    for kind, sizes in (("packed", {"8"}), ("fp8", {"16", "8"})):
        key = _cuda.attn_keys(kind, 256, 64, 64, 320**-0.5, False, target="cuda", q_fp8=kind == "fp8")[0]
        producer = kernel_body(source(key, "cuda")).split("warpgroup_reg_dealloc")[1]
        assert set(re.findall(r"cp_async_gs_conditional<(\d+)>", producer)) == sizes


def test_inplace_raw_columns_fill_whole_lines():
    # the in-place producer's copies: the eight lanes of a row copy each 128-value group's raw bytes
    # side by side into the second of the two 128-byte lines the group takes widened (ncu: strided,
    # each 16-byte copy took a shared-memory wavefront of its own), and only lanes of the same row
    # (one warp) widen over another lane's raw bytes
    from csrc_tl.attention import WS_THREADS_PER_ROW, ws_inplace_raw_col, ws_row_lane

    assert WS_THREADS_PER_ROW == 8
    for group in range(2):
        raw = {lane: range(ws_inplace_raw_col(group, lane), ws_inplace_raw_col(group, lane) + 8) for lane in range(8)}
        widened = {lane: range(128 * group + 16 * lane, 128 * group + 16 * lane + 16) for lane in range(8)}
        cols = sorted(c for r in raw.values() for c in r)
        assert cols == list(range(128 * group + 64, 128 * group + 128))  # one whole line, 8-column aligned
        assert all(ws_inplace_raw_col(group, lane) % 8 == 0 for lane in range(8))  # 16-byte copies
        for lane in range(8):
            assert set(raw[lane]) <= set(range(128 * group, 128 * group + 128))  # inside the group's lines
            # whose raw bytes it overwrites: none where it writes the first line
            over = [other for other in range(8) if set(raw[other]) & set(widened[lane])]
            assert over == ([] if lane < 4 else [2 * lane - 8, 2 * lane - 7])
    # the eight lanes of a row are in one warp (the warp sync orders them), with and without quarters
    for quarters in (False, True):
        for tx in range(128):
            row = ws_row_lane(tx, quarters)[0]
            mates = [u for u in range(128) if ws_row_lane(u, quarters)[0] == row]
            assert len(mates) == 8 and len({u // 32 for u in mates}) == 1


@pytest.mark.parametrize("kind", ["packed", pytest.param("fp8", marks=LOWERING)])
@pytest.mark.parametrize("path", ["prefill", "split"])
def test_inplace_producer_schedule(kind, path):
    # the in-place producer (512+64 FP8 rows) issues the copies of a block's passes WS_INPLACE_AHEAD (2)
    # ahead of their widening: three passes' copies committed before it waits for the first, each wait
    # for its own pass only, both stages alike; a packed row's four scales in one 16-byte load per pass.
    # Over packed rows (prefill and split kernels), consumer warpgroup 1 fills the last of the four passes of
    # each block (the first block before its loop, then the next one in each iteration) and the producer the
    # other three.
    from csrc_tl.attention import WS_INPLACE_AHEAD

    assert WS_INPLACE_AHEAD == 2
    key = attn_keys("deepseek-512+64-h128", kind)[PATHS[path]]
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", kernel_body(source(key, "cuda")))[1:]
    scale_load = r"(\(float4\*\)\(\(\(float\*\)scales\))"

    def schedule(role):
        events = re.findall(r"dsa_cp_async_wait\((\d+)\)|(cp_async_commit)|" + scale_load, role)
        return "".join(wait or ("C" if commit else "S") for wait, commit, _ in events)

    wg1_widens = kind == "packed"
    block = {"packed": "SCSC" + ("SC210" if wg1_widens else "SC2SC210"), "fp8": "CCC2C210"}[kind]
    assert schedule(roles[2]) == 2 * block
    assert schedule(roles[1]) == ("SC0" * 3 if wg1_widens else "")
    assert schedule(roles[0]) == ""
    # the ready barriers count warpgroup 1's arrivals too where it fills a pass
    for stage in "01":
        assert f"ready{stage}[0].init({256 if wg1_widens else 128});" in source(key, "cuda")


def test_direct_producer_schedule():
    # the transposed prefill over 512+0 packed rows at 8 heads gathers them through registers: each warpgroup that
    # fills passes of a block (the producer two, warpgroup 1 two) starts its first block's loads before its loop,
    # and in each block waits for the stage, then stores each row widened and starts the same row's loads for the
    # next block; nothing is copied raw into the stage
    key = attn_keys("512+0-h8", "packed")[PATHS["prefill"]]
    assert key.transposed
    src = kernel_body(source(key, "cuda"))
    assert "dsa_cp_async<" not in src and "dsa_widen<" not in src
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", src)[1:]

    def schedule(role):
        events = re.findall(r"(dsa_ld_row<)|(free[01]\[0\]\.wait)|(dsa_widen_regs<)|(ready[01]\[0\]\.arrive)", role)
        letters = "".join("L" if ld else "W" if wait else "S" if widen else "A" for ld, wait, widen, _ in events)
        return re.sub("S+", "S", letters)

    assert schedule(roles[2]) == "LL" + 2 * "WSLSLA"
    assert schedule(roles[1]).replace("A", "") == "LL" + 3 * "WSLSL"


@pytest.mark.parametrize(
    "name, kind, path, paired, halves",
    [
        # FP8 rows: the producer bounds the kernel
        pytest.param("deepseek-512+64-h128", "packed", "prefill", False, False, id="deepseek-packed-prefill-single"),
        pytest.param(
            "glm-256+0-h64", "packed", "prefill", False, False, id="glm-packed-prefill-single", marks=LOWERING
        ),
        # prefill of narrow bf16 rows: 128-row blocks in pairs; its split kernel
        pytest.param("glm-256+0-h64", "bf16", "prefill", True, False, id="glm-bf16-prefill-paired", marks=LOWERING),
        pytest.param("glm-256+0-h64", "bf16", "split", False, False, id="glm-bf16-split-single", marks=LOWERING),
        # 64-row blocks in pairs, FlashMLA's pipeline
        pytest.param(
            "deepseek-512+64-h128",
            "bf16",
            "prefill",
            True,
            True,
            id="deepseek-bf16-prefill-paired-halves",
            marks=LOWERING,
        ),
        pytest.param(
            "deepseek-512+64-h128", "bf16", "split", False, False, id="deepseek-bf16-split-single", marks=LOWERING
        ),
    ],
)
def test_paired_consumers(name, kind, path, paired, halves):
    # paired consumers: warpgroup 1 scores a block of its own and multiplies its own probabilities
    # from registers; the row sums pass between the consumers outside TileLang's shared buffers
    body = kernel_body(source(attn_keys(name, kind)[PATHS[path]], "cuda"))
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", body)[1:]
    assert ("wgmma_rs" in roles[1]) == paired
    assert ("dsa_row_sum" in body) == paired
    # halves: each half of a stage has its own barriers, and warpgroup 0 issues the next pair's first
    # score GEMM (over stage 0's left half) between its last PV GEMM's issue and its wait for that GEMM
    assert ("ready_r1" in body) == halves
    if halves:
        first = roles[0]
        pv = first.index("(&(((bfloat16_t*)p1_s)[0]))")
        tail = first[pv : first.index("wait_wgmma<1>", pv)]
        assert tail.count("wgmma_ss<") == 2 and "kv_l0" in tail
    if paired:
        # warpgroup 1 hands over its probabilities only after it issued its PV GEMM over warpgroup
        # 0's, so that GEMM runs first and frees the stage (half) warpgroup 0 scores next sooner
        second = roles[1]
        assert second.index("p1_ready[0].arrive()") > second.index("(&(((bfloat16_t*)p0_s)[0]))")


def test_register_budgets_fit_the_launch():
    # setmaxnreg requests beyond the registers the CTA launched with hang the kernel; the consumers
    # raise their budgets from the launch count and the producers' lower them
    from csrc_tl.attention import WS_NREG, check_ws_nreg

    for (_, producers), budgets in WS_NREG.items():
        check_ws_nreg(budgets, producers)


@pytest.mark.parametrize(
    "nreg", [(232, 160, 112), (240, 168, 104), (160, 200, 80)], ids=lambda nreg: "-".join(map(str, nreg))
)
def test_ws_register_budgets_must_fit_the_launch(nreg):
    # a CTA of 384 threads launches with 168 registers a thread: setmaxnreg raises the consumers' budgets
    # from there and lowers the producer's, so a consumer budget under 168 is an illegal instruction and
    # a total over 3 x 168 hangs the kernel (both seen on an H200); the builder refuses them
    from csrc_tl.attention import AttnGeometry, build_attn_ws

    geo = AttnGeometry(512, 64, 128, "packed", False, 576**-0.5)
    with pytest.raises(AssertionError, match="budgets"):
        build_attn_ws(geo, nreg=nreg)
    build_attn_ws(geo, nreg=(208, 168, 128))  # an accepted one builds


@pytest.mark.parametrize("quarters", [False, True])
def test_producer_rows_and_lanes(quarters):
    # every (row, lane) of a pass belongs to exactly one producer thread; with quarters the eight
    # threads of a quarter warp store the same 16-byte half of their 32-byte widened chunks to eight
    # different 16-byte bank groups of the stage's 128-byte swizzle (one wavefront), without to four
    from csrc_tl.attention import ws_row_lane

    threads = 256
    assert sorted(ws_row_lane(tx, quarters) for tx in range(threads)) == [
        (row, lane) for row in range(threads // 8) for lane in range(8)
    ]
    for first in range(0, threads, 8):
        for half in (0, 1):
            groups = set()
            for tx in range(first, first + 8):
                row, lane = ws_row_lane(tx, quarters)
                chunk = 2 * lane + half  # 16-byte chunk of the row's 128 bf16 values
                groups.add(chunk % 8 ^ row % 8)  # its place in a 128-byte swizzle atom
            assert len(groups) == (8 if quarters else 4)


@pytest.mark.parametrize(
    "name, kind, path, quarters",
    [
        ("glm-256+0-h64", "bf16", "prefill", False),  # bf16 rows: cp.async straight into the stage
        ("glm-256+0-h64", "packed", "prefill", True),  # the prefill over bulk-copied packed rows
        ("glm-256+0-h64", "packed", "split", True),  # its split kernel
        ("glm-256+0-h64", "fp8", "prefill", True),
        ("deepseek-512+64-h128", "packed", "prefill", True),  # in place: the DeepSeek packed decode of T 256 runs here
        ("deepseek-512+64-h128", "packed", "split", True),
        ("deepseek-512+64-h128", "fp8", "prefill", True),
    ],
)
def test_quarter_warp_rows(name, kind, path, quarters):
    # which warp-specialized kernels map producer threads to rows by quarter warps (ws_quarters;
    # measured choices, BENCHMARKS.md)
    from csrc_tl.attention import ws_block, ws_quarters

    key = attn_keys(name, kind)[PATHS[path]]
    split = path == "split"
    assert key.family.endswith("_ws")
    assert ws_quarters(key.geo, split, ws_block(key.geo, split)) is quarters


@pytest.mark.parametrize(
    "name, kind, path, rows",
    [
        ("glm-256+0-h64", "bf16", "prefill", 128),
        ("glm-256+0-h64", "fp8", "prefill", 128),  # native FP8 rows: two 64-row raw copies fill a 128-row stage
        ("glm-256+0-h64", "packed", "prefill", 128),  # bulk-copied rows (measured slower at 128 with cp.async copies)
        ("glm-256+0-h64", "packed", "split", 64),
        ("glm-256+0-h64", "fp8", "split", 64),  # split kernels: whole 64-row blocks
        ("deepseek-512+64-h128", "fp8", "prefill", 64),
        ("deepseek-512+64-h128", "bf16", "prefill", 64),
    ],
)
def test_ws_block_rows(name, kind, path, rows):
    from csrc_tl.attention import ws_block

    key = attn_keys(name, kind)[PATHS[path]]
    assert ws_block(key.geo, path == "split") == rows


@pytest.mark.parametrize(
    "d_v, d_rope, kind, split, bulk",
    [
        (256, 0, "packed", False, True),  # GLM's packed prefill
        (256, 0, "packed", True, False),  # its split kernels: cp.async (measured faster there)
        (256, 64, "packed", False, False),  # the 392-byte row: a tail (copied in 8-byte pieces)
        (256, 0, "fp8", False, False),  # native FP8 rows: 16-byte aligned, cp.async of 16 bytes
        (512, 64, "packed", False, False),  # widened in place
        (512, 0, "packed", False, False),
    ],
)
def test_bulk_copied_rows(d_v, d_rope, kind, split, bulk):
    # which staged producers copy each row by one TMA bulk copy (ws_bulk)
    from csrc_tl.attention import AttnGeometry, ws_block, ws_bulk

    geo = AttnGeometry(d_v, d_rope, 64, kind, False, (d_v + d_rope) ** -0.5)
    assert ws_bulk(geo, split, ws_block(geo, split)) is bulk


@LOWERING
@pytest.mark.parametrize("kind, parts", [("fp8", 2), ("packed", 2)])
def test_staged_producer_parts_per_stage(kind, parts):
    # the staged producer (GLM prefill) widens a stage from `parts` raw copies of 64 rows: one wait for
    # its copies per part (its own cp.async copies, or the bulk copies on the raw stage's barrier), one
    # wait for the stage to be free and one fence before its ready arrival per stage (two stages in the
    # pair loop)
    key = attn_keys("glm-256+0-h64", kind)[0]
    producer = kernel_body(source(key, "cuda")).split("warpgroup_reg_dealloc")[1]
    if kind == "fp8":
        assert producer.count("tl::cp_async_wait<1>") == 2 * parts
    else:
        # the raw stages' barriers, arrived on once per row by its issuing lane: producer block k of a
        # CTA (four a pair of 128-row stages) waits on raw stage k % 2 for its use k // 2, so for its parity
        bars = re.findall(r"(\w+)\[0\]\.init\(64\);", kernel_body(source(key, "cuda")))
        assert len(bars) == 2
        landed = [(bar, parity) for bar, parity in re.findall(r"(\w+)\[0\]\.wait\(([^;]*)\);", producer) if bar in bars]
        assert len(landed) == 4 and landed[0][0] != landed[1][0]
        assert [bar for bar, _ in landed] == [landed[0][0], landed[1][0]] * 2
        for pair in range(3):
            assert [eval(parity, {"pair": pair}) for _, parity in landed] == [(4 * pair + i) // 2 % 2 for i in range(4)]
    assert len(re.findall(r"free[01]\[0\]\.wait\(", producer)) == 2
    assert producer.count("fence_proxy_async") == 2


# prefill kernels that are not persistent (their keys carry no CTA count: ctas 0)
NOT_PERSISTENT = [
    ("deepseek-512+64-h128", "packed"),
    ("glm-256+0-h64", "fp8"),
    ("glm-256+0-h64", "bf16"),
    ("512+0-h16", "packed"),
]


def test_persistent_prefill_keys():
    # the GLM packed prefill (bulk-copied staged rows) is persistent: its key carries the CTA count (the current
    # GPU's SM count, or DEFAULT_CTAS without one) and each CTA walks items bx, bx + CTAs, ...; no other kernel is
    from csrc_tl.attention import DEFAULT_CTAS, AttnGeometry, ws_persistent

    key = attn_keys("glm-256+0-h64", "packed")[0]
    assert key.family == "attn_prefill_ws" and key.ctas == DEFAULT_CTAS
    shard = _cuda.attn_keys("packed", 256, 0, 8, 256**-0.5, True, target="cuda", sm_count=78)
    assert shard[0].ctas == 78 and shard[1].ctas == 0 and shard[0].name.endswith("_c78")
    for name, kind in NOT_PERSISTENT:
        assert attn_keys(name, kind)[0].ctas == 0, name
    assert not ws_persistent(AttnGeometry(256, 0, 64, "packed", False, 0.1), split=True)
    # the default run's prefill (the one test_attention_sources lowers) has no loop over items
    assert "dsa_bar_sync(13" not in source(attn_keys(*NOT_PERSISTENT[0])[0], "cuda")


@LOWERING
def test_persistent_prefill_source():
    shard = _cuda.attn_keys("packed", 256, 0, 8, 256**-0.5, True, target="cuda", sm_count=78)
    body = kernel_body(source(shard[0], "cuda"))
    # the item stride is the CTA count; the consumers meet between items; indices load at computed offsets
    assert re.search(r"\* 78\) \+ \(\(int\)blockIdx\.x\)", body)
    assert body.count("dsa_bar_sync(13, 256)") == 2 and "dsa_ld_index(" in body
    for name, kind in NOT_PERSISTENT:
        assert "dsa_bar_sync(13" not in source(attn_keys(name, kind)[0], "cuda"), name


@pytest.mark.parametrize("target", ["cuda", "hip"], ids=["sm90a", "gfx950"])
def test_sink_combine_folds_the_sink_into_the_normalization(target):
    # a split decode with an attention sink normalizes in its combine: exp(sink - lse) joins the denominator of
    # out (and only of out); the combine without a sink neither takes nor reads one
    from csrc_tl.attention.keys import CombineKey

    plain, sink = (kernel_body(source(CombineKey(512, 64, 64, target == "cuda", s), target)) for s in (False, True))
    assert "attn_sink" not in plain
    assert re.search(r"1\.000000e\+00f?(\*/)? / \(total\[0\] \+ (__)?expf?\(\(attn_sink\[", sink), sink
    assert sink.count("attn_sink[") == 1


@pytest.mark.parametrize(
    "name, kind, target",
    sweep(
        [(n, k, t) for n in ATTN for k in ("bf16", "packed") for t in ("cuda", "hip")],
        # the default run: the paired consumers with their lazy running max (DeepSeek bf16, sm_90a) and the portable
        # kernel (GLM bf16, gfx950)
        keep=lambda c: c in {("deepseek-512+64-h128", "bf16", "cuda"), ("glm-256+0-h64", "bf16", "hip")},
    ),
)
def test_sink_max_prefill_takes_the_sink_and_writes_the_max(name, kind, target):
    # the prefill's sink_max variant reads attn_sink once per row at the end (its term joins the denominator of out)
    # and stores max_logits; the plain prefill kernel takes neither
    plain = attn_keys(name, kind, target=target)[0]
    key = replace(plain, sink_max=True)
    body, plain_body = kernel_body(source(key, target)), kernel_body(source(plain, target))
    assert "attn_sink" not in plain_body and "max_logits" not in plain_body
    params = body[: body.index("{")]
    assert re.search(r"float\* __restrict__ attn_sink\b", params) and "float* __restrict__ max_logits" in params
    assert re.search(r"max_logits\[[^\n]*\] = ", body), "no store of max_logits"
    assert body.count("attn_sink[") >= 1 and body.count("attn_sink[") <= 2  # (once per consumer warpgroup)


def test_sink_and_max_logits_reach_the_prefill_kernel_and_the_split_tail(launches):
    # the persistent GLM packed prefill with its last round split off: the prefill kernel's sink_max variant gets the
    # sink (-inf where the call has none) and the rows of max_logits; the split path's tokens get their maxima from
    # the family's attn_max_logits (its packed rows gathered by the K-cache family's kernel, not through the
    # dispatcher), and its combine the sink where the call has one
    heads, t_count, main, topk, d_qk = 64, 137, 132, 1024, 256
    q = torch.randn(t_count, heads, d_qk).bfloat16()
    kv = reference.quant_k_cache(torch.randn(8, d_qk).bfloat16(), None)
    idx = torch.randint(-1, 8, (t_count, topk), dtype=torch.int32)
    sink = torch.randn(heads)
    for call_sink in (None, sink):
        launches.clear()
        out, lse, best = _gpu("sparse_attn_with_max_logits", q, kv, idx, d_qk**-0.5, d_qk, None, call_sink)
        (prefill, first), (split, _), (combine, merged), (gather, gathered) = launches
        assert prefill.sink_max and not split.sink_max and combine.sink == (call_sink is not None)
        assert gather.kind == "gather_dequant" and torch.equal(gathered[1], idx[main:].reshape(-1))
        got_sink, got_max = first[3], first[6]
        if call_sink is None:
            assert torch.equal(got_sink, torch.full((heads,), -math.inf))
        else:
            assert got_sink.data_ptr() == sink.data_ptr() and merged[2].data_ptr() == sink.data_ptr()
        assert got_max.data_ptr() == best.data_ptr() and got_max.shape == (main, heads)
    launches.clear()
    _gpu("sparse_attn", q, kv, idx, d_qk**-0.5, d_qk, None, sink)  # a sink alone: the same kernels, no second pass
    assert [key.sink_max for key, _ in launches[:1]] == [True] and len(launches) == 3
