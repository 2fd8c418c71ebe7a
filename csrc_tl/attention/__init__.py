"""TileLang kernels of DeepSeek-style sparse attention over one latent KV head.

Two paths share one builder:

* prefill (``split=False``): one block per (token, head block); it walks the token's top-k list in
  blocks of ``block_i`` rows, gathers those rows into shared memory (zeros for invalid entries,
  which are never dereferenced), and runs an online softmax with exp2.
* decode (``split=True``): for few tokens one block per token leaves the GPU idle, so the top-k
  blocks are also split ``NS`` ways over the grid's second axis; each split writes a normalized
  partial output and its natural-log LSE, and :func:`build_combine` merges them.

Shapes (T tokens, H heads, K top-k entries, S pool rows, NS splits; all dynamic but H):
``q [T, H, d_qk]`` bf16 or float8_e4m3fn, ``kv [S, d_qk]`` bf16 or float8_e4m3fn (raw values) or packed
``[S, B] uint8``, ``indices [T, K] int32``
(K a multiple of ``block_i``), optional ``topk_length [T] int32``; prefill writes
``out [T, H, d_v] bf16`` and ``lse [T, H] float32``, decode writes ``part_out [T, NS, P, d_v] bf16`` (P =
:func:`partial_heads`: H rounded up to whole head blocks)
(normalized partials: their rounding adds at most one bf16 rounding, 2^-9 relative, to the merged
output, which the combine rounds once more) and ``part_lse [T, NS, H] float32``.

With ``d_rope == 0`` the tail is compiled out: no tail buffers, copies or GEMMs exist.

On Hopper, :func:`build_attn_ws` builds the same two paths warp-specialized, over blocks of 64 heads
(fewer heads are padded with zero rows of q, whose results are never stored): a
producer warpgroup gathers the next top-k block into one of two shared stages while warpgroup 0
runs the score GEMMs, the softmax and the left half of PV and warpgroup 1 the right half of PV;
for the prefill of bf16 rows the two consumer warpgroups instead score the two blocks of a pair side
by side (over 64-row blocks in FlashMLA's pipeline: stages in halves with barriers of their own, the
next pair's scores issued under the last PV GEMM). Where FP8 rows are staged raw (:func:`ws_staged`),
two producer warpgroups widen them; wider FP8 rows are copied raw into their own bf16 stage and
widened there. The prefill over bulk-copied packed rows (GLM's) is persistent: one CTA per SM walks tokens one
after another (:func:`ws_persistent`).

FP8 inputs (native float8_e4m3fn q or kv, and the values of a packed row) are widened to bf16 on
their way into shared memory and the GEMMs run in bf16: every e4m3 value is exactly a bf16 value,
so this adds no error. The FP8 tensor-core path is not used: it would need the probabilities in
FP8 for the PV product (3 mantissa bits, about 6% per entry), and with FP8 rows the kernels are
bound by the producer's gather and widening, not by the tensor cores (BENCHMARKS.md).

Modules: :mod:`.geometry` (the geometry record), :mod:`.keys` (the kernels' typed keys and their builder),
:mod:`.launch` (the launch plan of a call: which of these kernels run, over
which tokens, in how many splits: :func:`plan_launch`), :mod:`.common` (softmax steps and stores shared by the
kernels), :mod:`.portable` (:func:`build_attn`), :mod:`.combine` (:func:`build_combine`), :mod:`.plan` (the plan record
of the warp-specialized kernel, :func:`ws_plan`), :mod:`.ws_producer` and :mod:`.ws_consumer` (its warpgroups'
macros), :mod:`.ws_kernel` (:func:`build_attn_ws`) and :mod:`.device` (the CUDA helpers of ``device_helpers.cuh``).

The names below are loaded from their modules on first use, so that importing one module of the package (the launch
plan, say) does not import the kernel builders and TileLang with it.
"""

import importlib

# module -> the names the package exports from it
_EXPORTS = {
    "geometry": (
        "AttnGeometry",
        "DEFAULT_TILES",
        "head_block",
        "partial_heads",
        "LOG2E",
        "LN2",
        "NEG_START",
        "MAX_HEAD_BLOCK",
        "MIN_HEAD_BLOCK",
        "TRANSPOSED_MAX_HEADS",
        "transposed_head_block",
    ),
    "launch": (
        "AttnKernels",
        "AttnLaunch",
        "attn_kernels",
        "plan_launch",
        "plan_splits",
        "plan_tail",
        "TOPK_BLOCK",
        "TAIL_SPLIT_BLOCKS",
        "TAIL_MIN_BLOCKS",
        "TAIL_MIN_SPLITS",
    ),
    "plan": (
        "DEFAULT_CTAS",
        "ws_supported",
        "ws_block",
        "ws_persistent",
        "ws_inplace_raw_col",
        "ws_quarters",
        "ws_bulk",
        "ws_staged",
        "ws_paired_fits",
        "ws_transposed",
        "TRANSPOSED_PLAN_HEADS",
        "ws_row_lane",
        "ws_plan",
        "WsPlan",
        "check_ws_nreg",
        "WS_NREG",
        "WS_PASS_CONFIGS",
        "WS_THREADS_PER_ROW",
        "WS_INPLACE_AHEAD",
        "WS_RAW_ROWS",
        "RAW_PAD",
        "SMEM_LIMIT",
        "WS_CONSUMER_BARRIER",
        "WS_STORE_BARRIERS",
    ),
    "keys": ("AttnKey", "CombineKey", "SCHEMES"),
    "portable": ("build_attn",),
    "ws_kernel": ("build_attn_ws",),
    "combine": ("build_combine", "COMBINE_THREADS", "COMBINE_VEC", "COMBINE_CHUNK"),
    "device": ("WS_PRELUDE", "WS_CONVERT", "WS_WIDEN", "WS_COPY", "WS_BULK", "WS_BAR_SYNC", "WS_STORE", "WS_PERSIST"),
    "common": (
        "valid_entries",
        "rescale",
        "exponentiate",
        "online_softmax",
        "reciprocal",
        "normalize",
        "store_rows",
        "load_q",
    ),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
