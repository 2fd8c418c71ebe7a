"""The torch.library contract: schemas, opcheck, torch.compile and the argument checker."""

import math
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
from sparse_dsa_ops.ops import SCHEMAS


def test_import_does_not_load_tilelang():
    # the GPU backend (and TileLang under it) loads on the first op on a GPU, not when the package is imported
    code = (
        "import sys, torch, sparse_dsa_ops as dsa; "
        "dsa.quant_k_cache(torch.zeros(2, 512, dtype=torch.bfloat16)); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tilelang' or m.endswith('._cuda')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_schemas_are_exact():
    expect = {
        "quant_k_cache": "dsa::quant_k_cache(Tensor k_nope, Tensor? k_rope, bool round_scale=False) -> Tensor",
        "store_k_cache": "dsa::store_k_cache(Tensor k_nope, Tensor? k_rope, Tensor(a!) cache, Tensor loc, "
        "bool round_scale=False) -> ()",
        "dequant_k_cache": "dsa::dequant_k_cache(Tensor packed) -> Tensor",
        "gather_k_cache": "dsa::gather_k_cache(Tensor cache, Tensor indices) -> Tensor",
        "gather_dequant_k_cache": "dsa::gather_dequant_k_cache(Tensor cache, Tensor indices) -> Tensor",
        "sparse_attn": "dsa::sparse_attn(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
        "Tensor? topk_length=None, Tensor? attn_sink=None, float? empty_lse=None) -> (Tensor, Tensor)",
        "sparse_attn_with_max_logits": "dsa::sparse_attn_with_max_logits(Tensor q, Tensor kv, Tensor indices, "
        "float sm_scale, int d_v, Tensor? topk_length=None, Tensor? attn_sink=None, float? empty_lse=None) "
        "-> (Tensor, Tensor, Tensor)",
        "attn_max_logits": "dsa::attn_max_logits(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, "
        "Tensor? topk_length=None) -> Tensor",
        "quant_index": "dsa::quant_index(Tensor x, bool round_scale=False) -> (Tensor, Tensor)",
        "store_index_k": "dsa::store_index_k(Tensor k, Tensor(a!) cache, Tensor loc, bool round_scale=False) -> ()",
        "gather_index_k": "dsa::gather_index_k(Tensor cache, Tensor indices, int? head_dim=None) -> (Tensor, Tensor)",
        "index_logits": "dsa::index_logits(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, "
        "Tensor ke) -> Tensor",
        "paged_index_logits": "dsa::paged_index_logits(Tensor q, Tensor cache, Tensor weights, Tensor lengths, "
        "Tensor page_table) -> Tensor",
        "topk": "dsa::topk(Tensor logits, Tensor lengths, int k, Tensor? starts=None, Tensor? page_table=None, "
        "Tensor? row_request=None, int page_size=64, int? out_width=None) -> Tensor",
        "index_topk": "dsa::index_topk(Tensor q, Tensor k, Tensor k_scale, Tensor weights, Tensor ks, Tensor ke, "
        "int topk, int? out_width=None) -> Tensor",
        "kpool_store_index_k": "dsa::kpool_store_index_k(Tensor k, Tensor gate, Tensor ape, Tensor(a!) cache, "
        "Tensor loc, bool round_scale=False) -> ()",
        "kpool_topk": "dsa::kpool_topk(Tensor logits, Tensor lengths, int k, int kpool, Tensor? starts=None, "
        "Tensor? page_table=None, Tensor? row_request=None, int page_size=64, int? out_width=None, bool tail=True) "
        "-> Tensor",
    }
    assert set(SCHEMAS) == set(expect)
    for name, schema in expect.items():
        assert str(getattr(torch.ops.dsa, name).default._schema) == schema


def _op_samples(gen):
    k = torch.randn(6, 512, generator=gen).bfloat16()
    r = torch.randn(6, 64, generator=gen).bfloat16()
    k_glm = torch.randn(5, 256, generator=gen).bfloat16()
    packed = dsa.quant_k_cache(k, r)
    pool = packed.repeat(4, 1).reshape(3, 8, 1, 656).clone()
    strided = packed.repeat(8, 1).reshape(3, 16, 1, 656)[:, :8]  # pages two pages apart, as a per-layer view
    sink = torch.randn(16, generator=gen)
    ids = torch.tensor([3, -1, 23, 99, 0], dtype=torch.int32)
    q = torch.randn(3, 16, 576, generator=gen).bfloat16()
    idx = torch.randint(-1, 24, (3, 64), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([64, 0, 17], dtype=torch.int32)
    kv_bf16 = torch.randn(24, 256, generator=gen).bfloat16()
    return {
        "quant-deepseek": ("quant_k_cache", (k, r, False)),
        "quant-256-round": ("quant_k_cache", (k_glm, None, True)),
        "store-paged": ("store_k_cache", (k, r, pool, torch.tensor([1, -1, 5, 30, 7, 2]), False)),
        "store-256-round": ("store_k_cache", (k_glm, None, torch.zeros(2, 4, 264, dtype=torch.uint8), ids, True)),
        "store-page-strided": ("store_k_cache", (k, r, strided, torch.tensor([1, -1, 5, 30, 7, 2]), False)),
        "dequant-rows": ("dequant_k_cache", (packed,)),
        "dequant-pool": ("dequant_k_cache", (pool,)),
        "gather": ("gather_k_cache", (pool, ids)),
        "gather-dequant-int64": ("gather_dequant_k_cache", (pool, ids.long())),
        "gather-page-strided": ("gather_k_cache", (strided, ids)),
        "attn-packed": ("sparse_attn", (q, pool, idx, 0.05, 512, lengths)),
        "attn-bf16": ("sparse_attn", (q[..., :256], kv_bf16, idx, 0.05, 256, None)),
        "attn-sink-int8-pool": ("sparse_attn", (q, pool.view(torch.int8), idx, 0.05, 512, None, sink)),
        "attn-page-strided": ("sparse_attn", (q, strided, idx, 0.05, 512, lengths)),
        "attn-fp8": (
            "sparse_attn",
            (
                q.to(torch.float8_e4m3fn),
                torch.randn(24, 576, generator=gen).to(torch.float8_e4m3fn),
                idx,
                0.05,
                512,
                lengths,
            ),
        ),
        "max-logits": ("attn_max_logits", (q, pool, idx, 0.05, 512, lengths)),
        "attn-with-max-logits": ("sparse_attn_with_max_logits", (q, pool, idx, 0.05, 512, lengths, sink)),
        "attn-empty-lse": ("sparse_attn_with_max_logits", (q, pool, idx, 0.05, 512, lengths, None, math.inf)),
    }


SAMPLES = sorted(_op_samples(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("case", SAMPLES)
def test_opcheck(gen, case):
    name, args = _op_samples(gen)[case]
    fp8_input = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    # torch's schema check compares inputs with allclose, which has no float8 kernel on the CPU; the
    # mutation contract of sparse_attn is checked on bf16 and packed inputs above
    tests = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8_input else None
    torch.library.opcheck(getattr(torch.ops.dsa, name).default, args, **({"test_utils": tests} if tests else {}))


@pytest.mark.parametrize("case", SAMPLES)
def test_fake_matches_real(gen, case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, args = _op_samples(gen)[case]
    op = getattr(torch.ops.dsa, name).default
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
        if r is None:  # an op that writes in place returns nothing
            assert f is None
            continue
        assert (r.shape, r.dtype, r.stride(), r.device) == (f.shape, f.dtype, f.stride(), f.device)


def _decode_step(k_nope, k_rope, cache, loc, q, indices, lengths):
    torch.ops.dsa.store_k_cache(k_nope, k_rope, cache, loc)
    return torch.ops.dsa.sparse_attn(q, cache, indices, 0.0625, 512, lengths)


def _decode_inputs(gen, t_count, slots=64):
    return dict(
        k_nope=torch.randn(t_count, 512, generator=gen).bfloat16(),
        k_rope=torch.randn(t_count, 64, generator=gen).bfloat16(),
        cache=dsa.quant_k_cache(
            torch.randn(slots, 512, generator=gen).bfloat16(), torch.randn(slots, 64, generator=gen).bfloat16()
        ).reshape(slots // 16, 16, 656),
        loc=torch.randperm(slots, generator=gen)[:t_count].to(torch.int32),
        q=torch.randn(t_count, 16, 576, generator=gen).bfloat16(),
        indices=torch.randint(-1, slots, (t_count, 128), generator=gen, dtype=torch.int32),
        lengths=torch.randint(0, 129, (t_count,), generator=gen, dtype=torch.int32),
    )


def _run_step(step, inputs):
    inputs = {k: v.clone() for k, v in inputs.items()}
    out, lse = step(**inputs)
    return out, lse, inputs["cache"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_decode_step(gen, backend):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(_decode_step, backend=counter, fullgraph=True, dynamic=True)
    for t_count in (2, 3, 5, 9):
        inputs = _decode_inputs(gen, t_count)
        # the rows stored this step are attended to: every token selects the first new slot
        inputs["indices"][:, 0] = inputs["loc"][0]
        got = _run_step(step, inputs)
        want = _run_step(_decode_step, inputs)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert got[0].isfinite().all() and got[0].abs().sum() > 0
    assert counter.frame_count == 1  # one graph for every token count, no graph break


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compile_reports_bad_input_at_trace_time(gen, backend):
    torch._dynamo.reset()
    step = torch.compile(_decode_step, backend=backend, fullgraph=True, dynamic=True)
    inputs = _decode_inputs(gen, 3)
    inputs["indices"] = inputs["indices"].long()
    with pytest.raises(Exception, match="indices must be int32"):
        step(**inputs)


# ------------------------------------------------------------------------------------------
# Bad input: each case names the argument and what it needs.

BF = torch.bfloat16
U8 = torch.uint8
I32 = torch.int32


def _z(*shape, dtype=BF):
    return torch.zeros(*shape, dtype=dtype)


BAD_CALLS = {
    "quant-float32": (dsa.quant_k_cache, (_z(4, 512, dtype=torch.float32), None), TypeError, "k_nope must be bfloat16"),
    "quant-rank": (dsa.quant_k_cache, (_z(4, 1, 512), None), ValueError, "k_nope must be 2-d"),
    "quant-width": (dsa.quant_k_cache, (_z(4, 500), None), ValueError, "multiple of 128"),
    "quant-rope-rows": (dsa.quant_k_cache, (_z(4, 512), _z(3, 64)), ValueError, "k_rope must be"),
    "quant-rope-dtype": (dsa.quant_k_cache, (_z(4, 512), _z(4, 64, dtype=torch.float16)), TypeError, "k_rope"),
    "quant-strided": (dsa.quant_k_cache, (_z(512, 4).T, None), ValueError, "contiguous in its last dim"),
    "store-width": (
        dsa.store_k_cache,
        (_z(2, 512), _z(2, 64), _z(8, 264, dtype=U8), _z(2, dtype=I32)),
        ValueError,
        "656-byte rows",
    ),
    "store-loc-len": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(8, 264, dtype=U8), _z(3, dtype=I32)),
        ValueError,
        "loc must be of length 2",
    ),
    "store-loc-dtype": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(8, 264, dtype=U8), _z(2)),
        TypeError,
        "loc must be int32 or int64",
    ),
    "store-cache-dtype": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(8, 264), _z(2, dtype=I32)),
        TypeError,
        "cache must be uint8",
    ),
    "store-cache-heads": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(2, 4, 2, 264, dtype=U8), _z(2, dtype=I32)),
        ValueError,
        "single KV head",
    ),
    "store-cache-strided": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(8, 300, dtype=U8)[:, :264], _z(2, dtype=I32)),
        ValueError,
        "cache must be contiguous when 2-d",
    ),
    "store-cache-page-gap": (
        dsa.store_k_cache,
        (_z(2, 256), None, _z(4, 2, 300, dtype=U8)[:, :, :264], _z(2, dtype=I32)),
        ValueError,
        "contiguous within a page",
    ),
    "attn-sink-shape": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256, None, _z(4, dtype=torch.float32)),
        ValueError,
        r"attn_sink must be \[8\] \(one per head of q\)",
    ),
    "dequant-width": (dsa.dequant_k_cache, (_z(4, 600, dtype=U8),), ValueError, "nearest valid widths"),
    "dequant-dtype": (
        dsa.dequant_k_cache,
        (_z(4, 656, dtype=torch.int16),),
        TypeError,
        "packed must be uint8 or int8 or float8_e4m3fn",
    ),
    "gather-ids-dtype": (
        dsa.gather_k_cache,
        (_z(8, 656, dtype=U8), _z(3, dtype=torch.int16)),
        TypeError,
        "indices must be int32 or int64",
    ),
    "gather-ids-rank": (
        dsa.gather_k_cache,
        (_z(8, 656, dtype=U8), _z(3, 1, dtype=I32)),
        ValueError,
        "indices must be 1-d",
    ),
    "gather-width": (
        dsa.gather_dequant_k_cache,
        (_z(8, 576, dtype=U8), _z(3, dtype=I32)),
        ValueError,
        "cache has rows of 576 bytes",
    ),
    "gather-rank": (dsa.gather_k_cache, (_z(656, dtype=U8), _z(3, dtype=I32)), ValueError, "cache must be 2-d"),
    "attn-q-dtype": (
        dsa.sparse_attn,
        (_z(2, 8, 256, dtype=torch.float16), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256),
        TypeError,
        "q must be bfloat16",
    ),
    "attn-q-fp8-with-bf16-kv": (
        dsa.sparse_attn,
        (_z(2, 8, 256, dtype=torch.float8_e4m3fn), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256),
        TypeError,
        "a float8_e4m3fn q needs an FP8 or packed kv",
    ),
    "attn-q-rank": (
        dsa.sparse_attn,
        (_z(8, 256), _z(8, 256), _z(8, 64, dtype=I32), 0.1, 256),
        ValueError,
        "q must be 3-d",
    ),
    "attn-kv-width": (
        dsa.sparse_attn,
        (_z(2, 8, 576), _z(8, 512), _z(2, 64, dtype=I32), 0.1, 512),
        ValueError,
        "kv must be rows of width d_qk = 576",
    ),
    "attn-kv-dtype": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256, dtype=torch.float32), _z(2, 64, dtype=I32), 0.1, 256),
        TypeError,
        "kv must be bfloat16",
    ),
    "attn-packed-width": (
        dsa.sparse_attn,
        (_z(2, 8, 576), _z(8, 264, dtype=U8), _z(2, 64, dtype=I32), 0.1, 512),
        ValueError,
        "packed rows of 656 bytes",
    ),
    "attn-packed-dv": (
        dsa.sparse_attn,
        (_z(2, 8, 576), _z(8, 656, dtype=U8), _z(2, 64, dtype=I32), 0.1, 500),
        ValueError,
        "d_v must be a multiple of 128",
    ),
    "attn-dv-range": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 300),
        ValueError,
        r"d_v must be an int in \[1, d_qk = 256\]",
    ),
    "attn-heads": (
        dsa.sparse_attn,
        (_z(2, 129, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256),
        ValueError,
        "at most 128 heads",
    ),
    "attn-dv-multiple": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 96),
        ValueError,
        "d_v must be a multiple of 64, got 96",
    ),
    "attn-rope-tail": (
        dsa.sparse_attn,
        (_z(2, 8, 264), _z(8, 264), _z(2, 64, dtype=I32), 0.1, 256),
        ValueError,
        "RoPE tail d_qk - d_v = 8 a multiple of 16",
    ),
    "attn-idx-dtype": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=torch.int64), 0.1, 256),
        TypeError,
        "indices must be int32",
    ),
    "attn-idx-tokens": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(3, 64, dtype=I32), 0.1, 256),
        ValueError,
        "T = 2 like q",
    ),
    "attn-idx-topk": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 100, dtype=I32), 0.1, 256),
        ValueError,
        "multiple of 64",
    ),
    "attn-idx-heads": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 2, 64, dtype=I32), 0.1, 256),
        ValueError,
        r"\[T, 1, K\]",
    ),
    "attn-lengths": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256, _z(3, dtype=I32)),
        ValueError,
        "topk_length must be",
    ),
    "attn-lengths-dtype": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256, _z(2, dtype=torch.int64)),
        TypeError,
        "topk_length must be int32",
    ),
    "attn-scale-nan": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), float("nan"), 256),
        ValueError,
        "sm_scale must be a finite float",
    ),
    "attn-empty-lse-nan": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(8, 256), _z(2, 64, dtype=I32), 0.1, 256, None, None, float("nan")),
        TypeError,
        "empty_lse must be a float",
    ),
    "attn-kv-heads": (
        dsa.sparse_attn,
        (_z(2, 8, 256), _z(2, 4, 2, 256), _z(2, 64, dtype=I32), 0.1, 256),
        ValueError,
        "single KV head",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input(case):
    fn, args, exc, message = BAD_CALLS[case]
    with pytest.raises(exc, match=message):
        fn(*args)


def test_bad_input_names_what_it_got():
    with pytest.raises(ValueError) as info:
        dsa.sparse_attn(_z(2, 8, 576), _z(8, 512), _z(2, 64, dtype=I32), 0.1, 512)
    expect = "dsa.sparse_attn: kv must be rows of width d_qk = 576 like q, got bfloat16 [8, 512] on cpu"
    assert str(info.value) == expect


def test_device_mix_is_rejected():
    meta = torch.zeros(8, 256, dtype=BF, device="meta")
    with pytest.raises(ValueError, match="q must be on meta like the other tensors"):
        dsa.sparse_attn(_z(2, 8, 256), meta, _z(2, 64, dtype=I32).to("meta"), 0.1, 256)
    with pytest.raises(ValueError, match="k_rope must be on cpu"):
        dsa.quant_k_cache(_z(2, 512), _z(2, 64).to("meta"))
    with pytest.raises(ValueError, match="loc must be on cpu"):
        dsa.store_k_cache(_z(2, 256), None, _z(8, 264, dtype=U8), _z(2, dtype=I32).to("meta"))
