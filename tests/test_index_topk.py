"""index_topk, the prefill indexer and top-k as one op, against its definition: the composition
``topk(index_logits(q, k, k_scale, weights, ks, ke), ke - ks, topk, starts=ks, out_width=out_width)`` bit for bit on
the same device, on random and hostile inputs; and the 2-d index-K cache's default head dim.

The composition's two ops are held to brute-force oracles in ``test_indexer.py`` and ``test_selection.py``; here a small
Python oracle on the composition's logits also pins what the positions mean. The ``cuda`` tests hold the GPU op to
the GPU composition, to the reference where the logits are exact on both devices, and measure its memory.
"""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparse_dsa_ops as dsa
from sparse_dsa_ops import reference
from tests.oracle import INT_MAX, INT_MIN

FP8 = torch.float8_e4m3fn
DIM = 128
Q_DTYPES = {"q-fp8": FP8, "q-bf16": torch.bfloat16}


def composed(q, k, k_scale, weights, ks, ke, topk, out_width=None):
    """The definition: index_logits, then topk over each token's range with positions relative to ks."""
    logits = dsa.index_logits(q, k, k_scale, weights, ks, ke)
    return dsa.topk(logits, ke - ks, topk, starts=ks, out_width=out_width)


def brute_selection(logits, ks, ke, topk, width):
    """``[T, width]`` int32 by Python's sorted: the best ``topk`` keys of ``[ks, ke)`` clipped to ``[0, N)`` (NaN
    last, logit descending, key ascending) as ascending positions ``j - ks``, then -1."""
    t_count, n = logits.shape
    out = torch.full((t_count, width), -1, dtype=torch.int32)
    for t in range(t_count):
        start, stop = int(ks[t]), int(ke[t])
        row = logits[t].tolist()
        keys = range(max(start, 0), min(stop, n))
        best = sorted(keys, key=lambda j: (math.isnan(row[j]), 0.0 if math.isnan(row[j]) else -row[j], j))[:topk]
        chosen = sorted(j - start for j in best)
        out[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def make_inputs(gen, t_count, n, heads, q_dtype=FP8):
    q = torch.randn(t_count, heads, DIM, generator=gen).to(q_dtype)
    k = (torch.randn(n, DIM, generator=gen) * 4).to(FP8)
    k_scale = torch.rand(n, generator=gen) * 0.1 + 1e-3
    weights = torch.randn(t_count, heads, generator=gen)
    return q, k, k_scale, weights


def causal(t_count, n):
    """Prefill of the last ``t_count`` of ``n`` tokens: token t sees keys ``[0, n - t_count + t]``."""
    return torch.zeros(t_count, dtype=torch.int32), torch.arange(t_count, dtype=torch.int32) + (n - t_count + 1)


# ------------------------------------------------------------------------------------------
# Cases: each builds (q, k, k_scale, weights, ks, ke, topk, out_width)


def _random(gen):
    q, k, k_scale, w = make_inputs(gen, 37, 300, 8)
    ke = torch.randint(0, 301, (37,), generator=gen, dtype=torch.int32)
    ks = ke - torch.randint(0, 200, (37,), generator=gen, dtype=torch.int32)
    return q, k, k_scale, w, ks, ke, 16, None


def _random_bf16_out_width(gen):
    q, k, k_scale, w = make_inputs(gen, 21, 250, 4, torch.bfloat16)
    ks, ke = causal(21, 250)
    return q, k, k_scale, w, ks, ke, 40, 128


def _causal_chunked_prompt(gen):
    q, k, k_scale, w = make_inputs(gen, 64, 64, 16)  # the whole prompt: token t sees keys 0..t
    ks, ke = causal(64, 64)
    return q, k, k_scale, w, ks, ke, 8, 64


def _ragged_batch(gen):
    # three sequences packed into one key array, each token its own sequence's causal range
    lengths = [30, 1, 45]
    ks = torch.cat([torch.full((m,), sum(lengths[:i]), dtype=torch.int32) for i, m in enumerate(lengths)])
    ke = torch.cat([sum(lengths[:i]) + torch.arange(1, m + 1, dtype=torch.int32) for i, m in enumerate(lengths)])
    q, k, k_scale, w = make_inputs(gen, len(ks), sum(lengths), 8)
    return q, k, k_scale, w, ks, ke, 12, 64


def _hostile_ranges(gen):
    # whole row, empty, reversed, ks < 0, ke > N, the last key, starts past N, the int32 extremes both ways
    n = 200
    pairs = [(0, n), (5, 5), (40, 3), (-7, 40), (n - 50, n + 50), (n - 1, n), (n + 3, n + 90)]
    pairs += [(INT_MIN, INT_MAX), (INT_MAX, INT_MIN), (INT_MIN, 5), (-1, INT_MAX)]
    ks, ke = i32([a for a, _ in pairs]), i32([b for _, b in pairs])
    q, k, k_scale, w = make_inputs(gen, len(pairs), n, 4)
    return q, k, k_scale, w, ks, ke, 32, 64


def _duplicated_keys(gen):
    # every key twice with the same scale: equal logits everywhere, decided by the lower key
    q, k, k_scale, w = make_inputs(gen, 9, 160, 8)
    k = k[:80].repeat_interleave(2, dim=0)
    k_scale = k_scale[:80].repeat_interleave(2)
    ks, ke = i32([0, 1, 3, 0, 17, 0, 100, 2, 0]), i32([160, 160, 100, 5, 90, 2, 160, 3, 1])
    return q, k, k_scale, w, ks, ke, 24, None


def _all_equal(gen):
    # zero queries: every logit is 0 (and relu(0) = 0), so the first topk keys of each range win
    q, k, k_scale, w = make_inputs(gen, 6, 120, 4)
    q = torch.zeros_like(q)
    ks, ke = i32([0, 10, -5, 60, 119, 0]), i32([120, 50, 30, 200, 120, 0])
    return q, k, k_scale, w, ks, ke, 16, 64


def _ties_at_the_cut(gen):
    # small integer keys and weights: many exactly equal logits, some straddling the k-th place
    t_count, n = 12, 256
    q = torch.randint(-2, 3, (t_count, 2, DIM), generator=gen).float().to(FP8)
    k = torch.randint(-1, 2, (n, DIM), generator=gen).float().to(FP8)
    k_scale = torch.ones(n)
    w = torch.randint(0, 3, (t_count, 2), generator=gen).float()
    ks = torch.randint(-3, 40, (t_count,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(0, n, (t_count,), generator=gen, dtype=torch.int32)
    return q, k, k_scale, w, ks, ke, 50, 64


def _nan_and_inf_logits(gen):
    # NaN scales make NaN logits (ranked below -inf); infinite scales make +-inf and NaN logits
    q, k, k_scale, w = make_inputs(gen, 8, 100, 4)
    k_scale[::7] = float("nan")
    k_scale[3::11] = float("inf")
    k_scale[5::13] = -float("inf")
    ks, ke = i32([0, 0, 20, 7, -2, 50, 99, 0]), i32([100, 10, 60, 8, 30, 150, 100, 4])
    return q, k, k_scale, w, ks, ke, 6, 64


def _nothing_valid(gen):
    q, k, k_scale, w = make_inputs(gen, 5, 64, 2)
    ks, ke = i32([0, 10, 64, 100, INT_MAX]), i32([0, 3, 80, 200, INT_MAX])
    return q, k, k_scale, w, ks, ke, 8, None


def _k_past_the_row(gen):
    q, k, k_scale, w = make_inputs(gen, 4, 90, 4)
    ks, ke = i32([0, 10, -4, 89]), i32([90, 80, 4, 90])
    return q, k, k_scale, w, ks, ke, 4096, None


def _k1(gen):
    q, k, k_scale, w = make_inputs(gen, 7, 130, 8)
    ks, ke = causal(7, 130)
    return q, k, k_scale, w, ks, ke, 1, 64


def _many_heads(gen):
    q, k, k_scale, w = make_inputs(gen, 5, 70, 128)
    ks, ke = i32([0, 3, 9, -1, 60]), i32([70, 70, 40, 20, 61])
    return q, k, k_scale, w, ks, ke, 10, None


CASES = {
    "random": _random,
    "random-bf16-out-width": _random_bf16_out_width,
    "causal-prompt": _causal_chunked_prompt,
    "ragged-batch": _ragged_batch,
    "hostile-ranges": _hostile_ranges,
    "duplicated-keys": _duplicated_keys,
    "all-equal": _all_equal,
    "ties-at-the-cut": _ties_at_the_cut,
    "nan-and-inf": _nan_and_inf_logits,
    "nothing-valid": _nothing_valid,
    "k-past-the-row": _k_past_the_row,
    "k1": _k1,
    "Hi128": _many_heads,
}


@pytest.mark.parametrize("case", CASES)
def test_index_topk_is_the_composition(gen, case):
    args = CASES[case](gen)
    got = dsa.index_topk(*args)
    assert got.dtype == torch.int32 and got.shape == (args[0].shape[0], args[7] or args[6])
    assert torch.equal(got, composed(*args))


@pytest.mark.parametrize("case", ["random", "hostile-ranges", "duplicated-keys", "ties-at-the-cut", "nan-and-inf"])
def test_index_topk_positions(gen, case):
    q, k, k_scale, w, ks, ke, topk, out_width = CASES[case](gen)
    logits = dsa.index_logits(q, k, k_scale, w, ks, ke)
    got = dsa.index_topk(q, k, k_scale, w, ks, ke, topk, out_width)
    # the int32 extremes wrap ke - ks; the oracle takes the range the wrapped length gives
    wrapped = ks.long() + (ke - ks).long()
    assert torch.equal(got, brute_selection(logits, ks, wrapped, topk, out_width or topk))


# (index_logits' scratch bound, index_topk's logits bound) -> index_topk's tokens a chunk: index_logits runs 30 keys
# by 3 tokens (the unit), or 300 keys by 11 tokens
CHUNKINGS = {
    "chunks-of-3-tokens-30-keys": (4 * (DIM + 8) * 30, 1, 3),
    "chunks-of-11-tokens": (4 * (DIM + 8) * 300, 1, 11),
    "chunks-of-22-tokens": (4 * (DIM + 8) * 300, 4 * 300 * 22, 22),
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_index_topk_in_chunks(gen, monkeypatch, chunking):
    # T 46 runs in chunks that do not divide it, and every logit still comes from the composition's own computation
    index_bytes, topk_bytes, tokens = CHUNKINGS[chunking]
    monkeypatch.setattr(reference.indexer, "_INDEX_CHUNK_BYTES", index_bytes)
    monkeypatch.setattr(reference.indexer, "_INDEX_TOPK_CHUNK_BYTES", topk_bytes)
    calls = []
    scores = reference.index_logits
    monkeypatch.setattr(
        reference.indexer, "index_logits", lambda q, *args: calls.append(q.shape[0]) or scores(q, *args)
    )
    q, k, k_scale, w = make_inputs(gen, 46, 300, 8)
    ke = torch.randint(0, 320, (46,), generator=gen, dtype=torch.int32)
    ks = ke - torch.randint(-5, 300, (46,), generator=gen, dtype=torch.int32)
    for out_width in (None, 96):
        got = dsa.index_topk(q, k, k_scale, w, ks, ke, 20, out_width)
        assert torch.equal(got, composed(q, k, k_scale, w, ks, ke, 20, out_width))
    assert calls == 2 * ([tokens] * (46 // tokens) + [46 % tokens])


def test_index_topk_empty(gen):
    q, k, k_scale, w = make_inputs(gen, 3, 0, 4)
    ks = ke = torch.zeros(3, dtype=torch.int32)
    assert torch.equal(dsa.index_topk(q, k, k_scale, w, ks, ke, 8, 64), torch.full((3, 64), -1, dtype=torch.int32))
    q, k, k_scale, w = make_inputs(gen, 0, 10, 4)
    ks = ke = torch.zeros(0, dtype=torch.int32)
    assert dsa.index_topk(q, k, k_scale, w, ks, ke, 8).shape == (0, 8)


def _bad_calls(gen):
    q, k, k_scale, w = make_inputs(gen, 4, 50, 4)
    ks, ke = causal(4, 50)
    good = dict(q=q, k=k, k_scale=k_scale, weights=w, ks=ks, ke=ke, topk=8, out_width=None)
    return good, {
        "topk-zero": (dict(topk=0), ValueError, "topk must be an int in \\[1, 4096\\]"),
        "topk-too-big": (dict(topk=4097), ValueError, "topk must be an int in \\[1, 4096\\]"),
        "topk-negative": (dict(topk=-1), ValueError, "topk must be an int in \\[1, 4096\\]"),
        "out-width-below-topk": (dict(out_width=7), ValueError, "out_width must be None or an int >= topk = 8"),
        "ks-int64": (dict(ks=ks.long()), TypeError, "ks must be int32"),
        "ke-short": (dict(ke=ke[:3]), ValueError, "ke must be \\[4\\]"),
        "k-bf16": (dict(k=k.bfloat16()), TypeError, "k must be float8_e4m3fn"),
        "k-width": (dict(k=k[:, :64]), ValueError, "k must be \\[N, D\\] with D = 128"),
        "weights-shape": (dict(weights=w[:, :2]), ValueError, "weights must be \\[4, Hi = 4\\]"),
        "k-scale-length": (dict(k_scale=k_scale[:9]), ValueError, "k_scale must be \\[50\\]"),
    }


@pytest.mark.parametrize("bad", sorted(_bad_calls(torch.Generator().manual_seed(0))[1]))
def test_index_topk_refuses(gen, bad):
    from torch._subclasses.fake_tensor import FakeTensorMode

    good, calls = _bad_calls(gen)
    change, exc, message = calls[bad]
    args = {**good, **change}
    with pytest.raises(exc, match="dsa.index_topk: " + message):
        dsa.index_topk(**args)
    with FakeTensorMode() as mode, pytest.raises(exc, match="dsa.index_topk: " + message):  # the fake's checker
        dsa.index_topk(**{n: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for n, a in args.items()})


@pytest.mark.parametrize("case", ["random", "random-bf16-out-width", "hostile-ranges"])
def test_opcheck(gen, case):
    # torch's schema check compares inputs with allclose, which has no float8 kernel on the CPU
    tests = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.dsa.index_topk.default, CASES[case](gen), test_utils=tests)


def _prefill_step(q, k, k_scale, weights, ks, ke):
    return torch.ops.dsa.index_topk(q, k, k_scale, weights, ks, ke, 16, 64)


def test_compile_without_recompiles(gen):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_prefill_step, backend=counter, fullgraph=True, dynamic=True)
    for t_count in (3, 5, 9, 17):
        q, k, k_scale, w = make_inputs(gen, t_count, 90 + t_count, 4)
        ks, ke = causal(t_count, 90 + t_count)
        assert torch.equal(compiled(q, k, k_scale, w, ks, ke), _prefill_step(q, k, k_scale, w, ks, ke))
    assert counter.frame_count == 1  # one graph for every token and key count, no graph break


# ------------------------------------------------------------------------------------------
# The GPU backend's chunking, on the CPU: its plan, and its loop with the reference standing in for the kernels


@pytest.mark.parametrize("sms", [132, 16])
@pytest.mark.parametrize("tokens", [1, 3, 100, 4096, 131072])
@pytest.mark.parametrize("keys", [1, 1000, 65536, 131072, 262144, 1 << 22])
def test_gpu_chunks_stay_within_the_budget(tokens, keys, sms):
    from sparse_dsa_ops._cuda import indexer, selection

    budget = indexer.INDEX_TOPK_BYTES
    rows = indexer.index_topk_rows(tokens, keys, sms, budget)
    last = tokens - (-(-tokens // rows) - 1) * rows
    scratch = max(selection.scratch_bytes(rows, keys, sms), selection.scratch_bytes(last, keys, sms))
    assert 1 <= rows <= tokens and 1 <= last <= rows
    assert rows == 1 or 4 * rows * keys + scratch <= budget
    assert rows in (1, 2, 3, tokens) or rows % indexer.ROW_ALIGN == 0
    assert budget + (4 << 20) + 4 * tokens <= 64 << 20  # room for the lengths and an alignment copy


def test_gpu_chunks_of_the_prefill_targets():
    # T 4096 of 64K keys and a 128K-token prompt: chunks of at least 100 tokens (a whole wave of top-k's rows on an
    # H200 takes 132), each row one CTA's, no top-k scratch
    from sparse_dsa_ops._cuda import indexer, selection

    for tokens, keys in ((4096, 65536), (131072, 131072)):
        rows = indexer.index_topk_rows(tokens, keys, 132, indexer.INDEX_TOPK_BYTES)
        assert rows >= 100 and selection.scratch_bytes(rows, keys, 132) == 0


def test_gpu_loop_with_reference_kernels(gen, monkeypatch):
    # the GPU backend's loop, its kernels replaced by the reference: chunks of 16 tokens (a last one of 14) that write
    # into slices of one output; exact inputs, so that any chunking gives the composition's logits
    from sparse_dsa_ops._cuda import indexer

    launches = []

    def logits_kernel(key):
        assert not key.fill_all  # -inf only into the columns top-k reads

        def run(q, k, k_scale, weights, ks, ke, logits, cols):
            assert cols > 0 and cols % 64 == 0  # the key columns of a CTA: whole 64-row key blocks
            launches.append((key.heads, q.shape[0], logits.shape[0]))
            logits.copy_(reference.index_logits(q, k, k_scale, weights, ks, ke))

        return run

    def select(out, logits, lengths, k, starts):
        out.copy_(reference.topk(logits, lengths, k, starts, out_width=out.shape[1]))

    monkeypatch.setattr(indexer, "kernel", logits_kernel)
    monkeypatch.setattr(indexer, "select", select)
    monkeypatch.setattr(indexer, "sm_count", lambda device: 132)
    monkeypatch.setattr(indexer, "target", lambda: "hip")  # the composition's chunks (no filter kernel there)
    monkeypatch.setattr(indexer, "INDEX_TOPK_BYTES", 4 * 300 * 17)  # 17 rows fit; 16, a multiple of ROW_ALIGN
    q, k, k_scale, w = exact_inputs(gen, 46, 300, 4)
    ks = torch.randint(-3, 200, (46,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-5, 300, (46,), generator=gen, dtype=torch.int32)
    got = indexer.index_topk(q, k, k_scale, w, ks, ke, 24, 64)
    assert torch.equal(got, composed(q, k, k_scale, w, ks, ke, 24, 64))
    assert launches == [(4, 16, 16), (4, 16, 16), (4, 14, 14)]


def reference_kernels(monkeypatch, launches):
    """The GPU backend's kernels replaced by the reference (the logits kernels fill every column, which both fills
    allow), each launch recorded in ``launches`` as (kernel, tokens)."""
    from sparse_dsa_ops._cuda import indexer

    def run_logits(q, k, k_scale, weights, ks, ke, logits, cols):
        assert cols > 0 and cols % 64 == 0  # the key columns of a CTA: whole 64-row key blocks
        logits.copy_(reference.index_logits(q, k, k_scale, weights, ks, ke))

    def run_filter(q, k, k_scale, weights, lo, hi, pos_base, guess, vals, pos, count):
        # each token's keys of [lo, hi) at or above its guess, in key order; the first cap of them listed
        logits = reference.index_logits(q, k, k_scale, weights, lo, hi)
        n, cap = k.shape[0], vals.shape[1]
        for t in range(q.shape[0]):
            a, b = min(max(int(lo[t]), 0), n), min(max(int(hi[t]), 0), n)
            keep = (logits[t, a:b] >= guess[t]).nonzero().flatten()
            count[t] = keep.numel()
            listed = keep[:cap]
            vals[t, : listed.numel()] = logits[t, a + listed]
            pos[t, : listed.numel()] = (a + listed - int(pos_base[t])).int()

    def kernel(key):
        run = run_filter if isinstance(key, indexer.builders.IndexFilterKey) else run_logits

        def launch(*args):
            launches.append(key)
            run(*args)

        return launch

    def select(out, logits, lengths, k, starts=None, page_table=None, row_request=None, page=0):
        want = reference.topk(logits, lengths, k, starts, page_table, row_request, page or 64, out.shape[1])
        out.copy_(want)

    monkeypatch.setattr(indexer, "kernel", kernel)
    monkeypatch.setattr(indexer, "select", select)
    monkeypatch.setattr(indexer, "target", lambda: "cuda")
    return indexer


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("heads", [8, 64])
def test_filtered_scheme_with_reference_kernels(gen, monkeypatch, heads, capturing):
    # the filtered scheme's loop on the CPU with reference kernels: chunks of a CTA's tokens, guesses from every 16th
    # key, lists of 384 entries (k 24), hostile ranges (empty, past N, a wrapped length), a token whose logits all
    # tie (its list overflows: the composition answers it) and random ones
    launches = []
    indexer = reference_kernels(monkeypatch, launches)
    monkeypatch.setattr(indexer, "sm_count", lambda device: 1)
    monkeypatch.setattr(indexer, "FILTER_MIN_KEYS", 0)
    monkeypatch.setattr(indexer, "FILTER_BYTES", 1)  # chunks of one CTA's tokens
    monkeypatch.setattr(indexer, "INDEX_TOPK_BYTES", 1)  # the composition's: one token
    monkeypatch.setattr(indexer, "_capturing", lambda q: capturing)
    monkeypatch.setattr(indexer, "_sample_rows", lambda flat_bytes, n_sample: 4)  # a chunk's samples in parts
    t_count, n, topk = 70, 3000, 24
    q, k, k_scale, w = make_inputs(gen, t_count, n, heads)
    q[5] = 0  # every logit 0: more equal logits than a list holds
    ks = torch.randint(-3, n // 2, (t_count,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-10, n, (t_count,), generator=gen, dtype=torch.int32)
    ks[:4], ke[:4] = i32([INT_MIN, 0, n + 5, 100]), i32([INT_MAX, 0, n + 50, INT_MIN + 50])
    ks[5], ke[5] = 0, n
    plan = indexer.plan_index_topk(t_count, n, heads, DIM, "float8_e4m3fn", topk, 1, "cuda")
    assert plan.filtered and plan.cap == 384 and plan.rows == (32 if heads == 8 else 4)
    got = indexer.index_topk(q, k, k_scale, w, ks, ke, topk, 40)
    assert torch.equal(got, composed(q, k, k_scale, w, ks, ke, topk, 40))
    filters = sum(isinstance(key, indexer.builders.IndexFilterKey) for key in launches)
    assert filters == -(-t_count // plan.rows)
    fallback = [key for key in launches if getattr(key, "fill_all", True) is False]
    # the wrapped length and the tied token (2 of them) when eager, every token's chunks when captured
    assert len(fallback) == (-(-t_count // indexer.index_topk_rows(t_count, n, 1, 1)) if capturing else 2)


FP8_CUDA = ("float8_e4m3fn", "cuda")


def test_warmup_compiles_the_filtered_scheme(monkeypatch):
    # a warmed-up process captures index_topk's filtered scheme: the filter, the guesses' top-k and the lists' top-k
    from csrc_tl.selection import TopkKey
    from sparse_dsa_ops._cuda import indexer, selection
    from sparse_dsa_ops.ops.core import WarmupSpec

    monkeypatch.setattr(indexer, "target", lambda: "cuda")
    spec = WarmupSpec(heads=128, d_nope=512, d_rope=64, sm_scale=0.1, index_heads=64, topk_k=2048)
    keys = indexer.warmup_keys_of(spec) + selection.warmup_keys_of(spec)  # (the composition's top-k: selection's)
    assert indexer.builders.IndexFilterKey(DIM, 64) in keys
    assert TopkKey(180, has_starts=True) in keys and TopkKey(2048, page_size=1) in keys
    # every call's kernels, past 128K keys too (the sample step, and with it the guess's rank, grows with the keys)
    for n in (65536, 1 << 18, 1 << 20):
        assert set(indexer.index_topk_keys(64, DIM, "float8_e4m3fn", 4096, n, 2048, 132)) <= set(keys), n
    monkeypatch.setattr(indexer, "target", lambda: "hip")
    assert not any(isinstance(key, indexer.builders.IndexFilterKey) for key in indexer.warmup_keys_of(spec))


def test_filtered_scheme_plan():
    from sparse_dsa_ops._cuda import indexer

    plan = indexer.plan_index_topk(4096, 65536, 64, DIM, "float8_e4m3fn", 2048, 132, "cuda")
    # k 2048: the 180th largest of the sampled logits; 2880 keys expected at or above it, lists of 3904
    assert (plan.filtered, plan.step, plan.rank, plan.cap) == (True, 16, 180, 3904)
    assert plan.rows * 8 * plan.cap <= indexer.FILTER_BYTES and plan.rows % indexer.ROW_ALIGN == 0
    # 8 heads: 32 tokens a CTA, one an SM at least
    assert indexer.plan_index_topk(8192, 65536, 8, DIM, "float8_e4m3fn", 2048, 132, "cuda").rows == 32 * 132
    assert indexer.plan_index_topk(4096, 65536, 8, DIM, "float8_e4m3fn", 2048, 132, "cuda").rows == 4096
    assert indexer.plan_index_topk(4096, 65536, 8, DIM, "float8_e4m3fn", 4096, 132, "cuda").cap <= indexer.LIST_MAX
    # past 128K keys the step doubles (a token samples at most 8192 keys); lists of a wave within 128 MB, or chunks
    for keys, step in ((1 << 17, 16), (1 << 18, 32), (1 << 20, 128)):
        for heads in (8, 64):
            plan = indexer.plan_index_topk(131072, keys, heads, DIM, "float8_e4m3fn", 2048, 132, "cuda")
            assert plan.filtered == (heads == 64 or keys == 1 << 17)
            if plan.filtered:
                assert plan.step == step and -(-keys // step) <= indexer.SAMPLE_MAX
                assert plan.cap <= indexer.LIST_MAX and plan.rank * step > 2048
                assert plan.rows * 8 * plan.cap <= indexer.FILTER_WAVE_BYTES and plan.rows % indexer.ROW_ALIGN == 0
    for keys, q_dtype, target in ((65536, "bfloat16", "cuda"), (65536, "float8_e4m3fn", "hip"), (16384,) + FP8_CUDA):
        plan = indexer.plan_index_topk(4096, keys, 8, DIM, q_dtype, 2048, 132, target)
        assert not plan.filtered and plan.rows == indexer.index_topk_rows(4096, keys, 132)


# ------------------------------------------------------------------------------------------
# gather_index_k on the 2-d cache: head dim 128 unless told otherwise


def _stored_cache(gen, pages, page, dim):
    cache = torch.zeros(pages, page * (dim + 4), dtype=torch.uint8)
    k = torch.randn(pages * page, dim, generator=gen).bfloat16()
    dsa.store_index_k(k, cache, torch.randperm(pages * page, generator=gen).int())
    return cache


@pytest.mark.parametrize("page", [1, 64], ids=lambda p: f"page{p}")
def test_gather_index_k_2d_defaults_to_head_dim_128(gen, page):
    cache = _stored_cache(gen, 3, page, 128)
    ids = torch.tensor([0, -1, 3 * page - 1, 3 * page, page // 2, INT_MAX], dtype=torch.int32)
    values, scale = dsa.gather_index_k(cache, ids)
    want_values, want_scale = dsa.gather_index_k(cache, ids, 128)
    assert values.shape == (6, 128) and torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale, want_scale) and scale[0] > 0 and scale[1] == 0


def test_gather_index_k_other_head_dims_still_work(gen):
    cache = _stored_cache(gen, 2, 16, 64)
    ids = torch.tensor([5, 31, -1], dtype=torch.int32)
    values, scale = dsa.gather_index_k(cache, ids, 64)  # given, for the 2-d form
    view_values, view_scale = dsa.gather_index_k(cache.view(2, 16, 68), ids)  # inferred from a view
    assert values.shape == (3, 64) and torch.equal(values.view(torch.uint8), view_values.view(torch.uint8))
    assert torch.equal(scale, view_scale)


def test_gather_index_k_2d_width_not_of_128_tokens():
    cache = torch.zeros(2, 16 * 68, dtype=torch.uint8)  # 1088 bytes: 16 tokens of D 64, no whole 132-byte tokens
    with pytest.raises(ValueError, match="D = 128 \\(the default head_dim; pass head_dim for another D\\)"):
        dsa.gather_index_k(cache, torch.tensor([0], dtype=torch.int32))


# ------------------------------------------------------------------------------------------
# GPU: the composition on the GPU, the reference where logits are exact, memory, graph capture

GPU_HEADS = [8, 64]
GPU_TOPKS = [64, 2048]
FILTER_HEADS = [1, 3, 8, 13, 64, 128]


@pytest.fixture(scope="module")
def warm():
    from sparse_dsa_ops._cuda import indexer, selection
    from sparse_dsa_ops._cuda.compile import target

    keys = [
        indexer.builders.index_logits_key(DIM, h, "float8_e4m3fn", target(), fill)
        for h in GPU_HEADS
        for fill in (True, False)
    ]
    keys += [indexer.builders.IndexFilterKey(DIM, h) for h in FILTER_HEADS]
    for topk in GPU_TOPKS:
        keys += selection.warmup_keys(topk, starts=(True,), paged=(False,))
    dsa._cuda.warmup(list(dict.fromkeys(keys)), workers=16, progress=False)


def exact_inputs(gen, t_count, n, heads):
    """Small integers and power-of-two scales: every logit is exact in float32 in any order of summation, so both
    devices compute the same logits and many of them tie."""

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=gen).float()

    k_scale = torch.exp2(torch.randint(-4, 2, (n,), generator=gen).float())
    return ints(t_count, heads, DIM).to(FP8), ints(n, DIM).to(FP8), k_scale, ints(t_count, heads)


def on_cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", FILTER_HEADS, ids=lambda h: f"Hi{h}")
def test_cuda_filter_lists_the_logits_at_or_above_the_guess(warm, gen, heads):
    # the filter kernel alone against the logits kernel: each token's keys at or above its guess, in key order, as
    # they are in the logits; counts past the list's end; nothing written past a list's entries
    from sparse_dsa_ops._cuda import indexer
    from sparse_dsa_ops._cuda.compile import kernel

    t_count, n, cap = 77, 5000, 320
    q, k, k_scale, w = on_cuda(make_inputs(gen, t_count, n, heads))
    lo = torch.randint(-5, n // 2, (t_count,), generator=gen, dtype=torch.int32)
    hi = lo + torch.randint(-10, n, (t_count,), generator=gen, dtype=torch.int32)
    lo[:3], hi[:3] = i32([INT_MIN, n + 5, 0]), i32([INT_MAX, n + 50, n])
    base = lo - torch.randint(0, 50, (t_count,), generator=gen, dtype=torch.int32)
    lo, hi, base = on_cuda((lo, hi, base))
    logits = dsa.index_logits(q, k, k_scale, w, lo, hi)  # [T, N], -inf outside each range
    guess = logits.masked_fill(logits.isinf(), torch.nan).nanquantile(0.9, dim=1).nan_to_num(-math.inf)
    guess[3] = -math.inf  # every key of its range (a list that overflows)
    vals = torch.full((t_count, cap), torch.nan, device="cuda")
    pos = torch.full((t_count, cap), -7, dtype=torch.int32, device="cuda")
    count = torch.full((t_count,), -7, dtype=torch.int32, device="cuda")
    kernel(indexer.builders.IndexFilterKey(DIM, heads))(q, k, k_scale, w, lo, hi, base, guess, vals, pos, count)
    for t in range(t_count):
        a, b = min(max(int(lo[t]), 0), n), min(max(int(hi[t]), 0), n)
        keep = (logits[t, a:b] >= guess[t]).nonzero().flatten() + a
        m = min(keep.numel(), cap)
        assert int(count[t]) == keep.numel(), t
        assert torch.equal(vals[t, :m], logits[t, keep[:m]]), t
        assert torch.equal(pos[t, :m], (keep[:m] - base[t]).int()), t
        assert vals[t, m:].isnan().all() and (pos[t, m:] == -7).all(), t


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["filtered", "chunks"])
@pytest.mark.parametrize("budget", ["default", "64-rows", "one-row"])
@pytest.mark.parametrize("heads", GPU_HEADS, ids=lambda h: f"Hi{h}")
def test_cuda_index_topk_is_the_cuda_composition(warm, gen, monkeypatch, heads, budget, scheme):
    from sparse_dsa_ops._cuda import indexer

    monkeypatch.setattr(indexer, "FILTER_MIN_KEYS", 0 if scheme == "filtered" else 1 << 40)
    t_count, n = 300, 20000
    if budget != "default":  # 64 tokens' logits (fewer a chunk: top-k splits so few rows), or one token
        monkeypatch.setattr(indexer, "INDEX_TOPK_BYTES", 4 * n * 64 if budget == "64-rows" else 1)
    q, k, k_scale, w = make_inputs(gen, t_count, n, heads)
    ks = torch.randint(-3, n // 2, (t_count,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(-10, n, (t_count,), generator=gen, dtype=torch.int32)
    ks[:4], ke[:4] = i32([INT_MIN, 0, n + 5, 7]), i32([INT_MAX, 0, n + 50, 3])
    # ke - ks below INT_MIN wraps to a long range: top-k reads columns past ke, -inf in the composition's logits
    ks[4:6], ke[4:6] = i32([5, 100]), i32([INT_MIN + 2, INT_MIN + 50])
    for topk, out_width in ((64, None), (2048, 2112)):
        args = on_cuda((q, k, k_scale, w, ks, ke, topk, out_width))
        assert torch.equal(dsa.index_topk(*args), composed(*args))


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["filtered", "chunks"])
@pytest.mark.parametrize("heads", GPU_HEADS, ids=lambda h: f"Hi{h}")
def test_cuda_index_topk_matches_the_reference(warm, gen, monkeypatch, heads, scheme):
    from sparse_dsa_ops._cuda import indexer

    monkeypatch.setattr(indexer, "FILTER_MIN_KEYS", 0 if scheme == "filtered" else 1 << 40)
    t_count, n = 200, 9000
    q, k, k_scale, w = exact_inputs(gen, t_count, n, heads)
    ks, ke = causal(t_count, n)
    ks[::3] = torch.randint(-2, n, (len(ks[::3]),), generator=gen, dtype=torch.int32)
    args = (q, k, k_scale, w, ks, ke, 2048, 2112)
    assert torch.equal(dsa.index_topk(*on_cuda(args)).cpu(), reference.index_topk(*args))


@pytest.mark.cuda
def test_cuda_index_topk_long_causal_prompt_in_bounded_memory(warm, gen):
    # a 128K-token causal prefill in one call: at most 64 MB beyond the inputs and the output
    t_count = n = 131072
    heads, topk = 64, 2048
    dev = torch.device("cuda")
    cpu = torch.Generator().manual_seed(1)
    q = torch.randint(-3, 4, (t_count, heads, DIM), device=dev).bfloat16().to(FP8)
    k = (torch.randn(n, DIM, generator=cpu) * 4).to(FP8).to(dev)
    k_scale = (torch.rand(n, generator=cpu) + 0.5).to(dev)
    w = torch.randn(t_count, heads, generator=cpu).to(dev)
    ks, ke = (x.to(dev) for x in causal(t_count, n))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = dsa.index_topk(q, k, k_scale, w, ks, ke, topk)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
    assert extra <= 64 << 20, f"{extra / 2**20:.1f} MB beyond the inputs and the output"
    # the first tokens have fewer keys than topk; the last tokens against the composition on their own rows
    assert torch.equal(out[0, :2], torch.tensor([0, -1], dtype=torch.int32, device=dev))
    tail = slice(t_count - 300, t_count)
    want = composed(q[tail], k, k_scale, w[tail], ks[tail], ke[tail], topk)
    assert torch.equal(out[tail], want)


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["filtered", "chunks"])
def test_cuda_index_topk_in_a_graph(warm, gen, monkeypatch, scheme):
    from sparse_dsa_ops._cuda import indexer

    monkeypatch.setattr(indexer, "FILTER_MIN_KEYS", 0 if scheme == "filtered" else 1 << 40)
    t_count, n = 96, 12000
    first = on_cuda(make_inputs(gen, t_count, n, 8)) + on_cuda(causal(t_count, n))
    static = [a.clone() for a in first]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the caching allocator's blocks for the capture, as torch's examples warm up
        dsa.index_topk(*static, 64, 128)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dsa.index_topk(*static, 64, 128)
    second = on_cuda(make_inputs(gen, t_count, n, 8))
    second[0][5] = 0  # every logit of token 5 ties: its list overflows, the replayed composition answers it
    for dst, src in zip(static, second):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, composed(*static, 64, 128))
