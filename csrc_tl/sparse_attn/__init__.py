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

Modules: :mod:`.geometry` (the key), :mod:`.common` (softmax steps and stores shared by the kernels),
:mod:`.portable` (:func:`build_attn`), :mod:`.combine` (:func:`build_combine`), :mod:`.plan` (the plan record of the
warp-specialized kernel, :func:`ws_plan`), :mod:`.ws_producer` and :mod:`.ws_consumer` (its warpgroups' macros),
:mod:`.ws_kernel` (:func:`build_attn_ws`) and :mod:`.device` (the CUDA helpers of ``device_helpers.cuh``).
"""

from .combine import COMBINE_CHUNK, COMBINE_THREADS, COMBINE_VEC, build_combine
from .common import exponentiate, load_q, normalize, online_softmax, reciprocal, rescale, store_rows, valid_entries
from .device import WS_BAR_SYNC, WS_BULK, WS_CONVERT, WS_COPY, WS_PERSIST, WS_PRELUDE, WS_STORE, WS_WIDEN
from .geometry import (
                       DEFAULT_TILES,
                       LN2,
                       LOG2E,
                       MAX_HEAD_BLOCK,
                       MIN_HEAD_BLOCK,
                       NEG_START,
                       AttnGeometry,
                       head_block,
                       partial_heads,
)
from .plan import (
                       DEFAULT_CTAS,
                       RAW_PAD,
                       SMEM_LIMIT,
                       WS_CONSUMER_BARRIER,
                       WS_INPLACE_AHEAD,
                       WS_NREG,
                       WS_PASS_CONFIGS,
                       WS_RAW_ROWS,
                       WS_STORE_BARRIERS,
                       WS_THREADS_PER_ROW,
                       WsPlan,
                       check_ws_nreg,
                       ws_block,
                       ws_bulk,
                       ws_inplace_raw_col,
                       ws_paired_fits,
                       ws_persistent,
                       ws_plan,
                       ws_quarters,
                       ws_row_lane,
                       ws_staged,
                       ws_supported,
)
from .portable import build_attn
from .ws_kernel import build_attn_ws

__all__ = ["AttnGeometry", "DEFAULT_TILES", "DEFAULT_CTAS", "head_block", "partial_heads", "ws_supported", "ws_block",
           "ws_persistent", "ws_inplace_raw_col", "ws_quarters", "ws_bulk", "ws_staged", "ws_paired_fits",
           "ws_row_lane", "ws_plan", "WsPlan", "check_ws_nreg", "build_attn", "build_attn_ws", "build_combine",
           "WS_NREG", "WS_PASS_CONFIGS", "WS_THREADS_PER_ROW", "WS_INPLACE_AHEAD", "WS_RAW_ROWS", "RAW_PAD",
           "SMEM_LIMIT", "WS_CONSUMER_BARRIER", "WS_STORE_BARRIERS", "WS_PRELUDE", "WS_CONVERT", "WS_WIDEN",
           "WS_COPY", "WS_BULK", "WS_BAR_SYNC", "WS_STORE", "WS_PERSIST", "COMBINE_THREADS", "COMBINE_VEC",
           "COMBINE_CHUNK", "LOG2E", "LN2", "NEG_START", "MAX_HEAD_BLOCK", "MIN_HEAD_BLOCK", "valid_entries",
           "rescale", "exponentiate", "online_softmax", "reciprocal", "normalize", "store_rows", "load_q"]
