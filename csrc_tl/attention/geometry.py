"""The geometry record every sparse-attention kernel is specialized on, and the head blocking shared by the kernels.

Letters: T tokens, H heads, K top-k entries, S pool rows, NS splits (see :mod:`csrc_tl.attention`).
"""

from dataclasses import dataclass

from ..layout import KCacheLayout

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_START = -(2.0**30)  # running max before any valid score: exp2 of (-inf - NEG_START) is 0, never NaN
MAX_HEAD_BLOCK = 64  # heads one block (one GEMM M tile) handles
MIN_HEAD_BLOCK = 16  # smallest M tile of the tensor-core GEMMs
# Most heads the transposed (few-heads) consumers of the warp-specialized kernels are built for: the heads are the N
# dimension of their GEMMs (scores transposed, keys as M), where wgmma takes any multiple of 8. Where the launch plan
# uses them is narrower (TRANSPOSED_PLAN_HEADS in .plan: the measured crossover)
TRANSPOSED_MAX_HEADS = 32
# Head counts whose tokens a grouped head block can hold (AttnGeometry.group): 64 rows of 8, 4 or 2 tokens (at most 8
# tokens: one bit each in the high byte of an entry of their union)
GROUP_HEADS = (8, 16, 32)
GROUP_ROW_BITS = 24  # bits of the row in an entry of a union (pools of at most 2^24 rows)


@dataclass(frozen=True)
class AttnGeometry:
    """Everything a sparse-attention kernel is specialized on (besides tile parameters)."""

    d_v: int  # value / NoPE width: a multiple of 64 (of 128 for packed kv)
    d_rope: int  # RoPE tail width, 0 for none
    heads: int  # 1..128
    kv_kind: str  # "bf16", "fp8" (raw float8_e4m3fn values) or "packed" (uint8 FP8 rows)
    has_topk_length: bool
    sm_scale: float
    q_fp8: bool = False  # q is float8_e4m3fn (allowed with fp8 or packed kv) instead of bf16
    # Heads of one token where a 64-row head block holds the heads of several tokens (0: a block holds one token's):
    # the kernel of GROUP_HEADS heads a token walks the union of MAX_HEAD_BLOCK // group tokens' selections, each entry
    # the row in its low 24 bits and in its high 8 the tokens that select it (see csrc_tl.attention.union)
    group: int = 0

    @property
    def d_qk(self) -> int:
        return self.d_v + self.d_rope

    @property
    def layout(self) -> KCacheLayout | None:
        """The packed row of a ``packed`` pool (d_nope = d_v); None for bf16 rows."""
        return KCacheLayout(self.d_v, self.d_rope) if self.kv_kind == "packed" else None

    @property
    def kv_row_width(self) -> int:
        """Elements (bf16, fp8) or bytes (packed) in one pool row."""
        return self.layout.row_bytes if self.kv_kind == "packed" else self.d_qk

    @property
    def kv_dtype(self):
        import tilelang.language as T  # here, so that planning a launch imports neither TileLang nor torch

        return {"bf16": T.bfloat16, "fp8": T.float8_e4m3fn, "packed": T.uint8}[self.kv_kind]

    def __str__(self) -> str:
        tail = ("_len" if self.has_topk_length else "") + ("_qfp8" if self.q_fp8 else "")
        tail += f"_g{self.group}" if self.group else ""
        return f"{self.kv_kind}_{self.d_v}p{self.d_rope}_h{self.heads}{tail}"

    def check(self):
        assert self.kv_kind in ("bf16", "fp8", "packed"), f"unknown kv kind {self.kv_kind}"
        assert not (self.q_fp8 and self.kv_kind == "bf16"), "float8 q needs fp8 or packed kv"
        assert 1 <= self.heads <= 128, "heads must be in 1..128"
        assert self.d_v % 64 == 0, "d_v must be a multiple of 64 (GEMM N/K tiles)"
        assert self.d_rope % 16 == 0, "d_rope must be a multiple of 16 (GEMM K tile)"
        if self.group:
            assert self.group in GROUP_HEADS and self.heads == MAX_HEAD_BLOCK, "a grouped block: 64 rows of 8-32 heads"
            assert self.kv_kind == "bf16" and self.has_topk_length, (
                "a grouped block walks bf16 rows to its union's length"
            )

    @property
    def group_tokens(self) -> int:
        """Tokens of a grouped head block (1 where a block holds one token's heads)."""
        return MAX_HEAD_BLOCK // self.group if self.group else 1


# Default tile parameters, by path; (block_i, threads, num_stages).
DEFAULT_TILES = {
    "prefill": dict(block_i=64, threads=256, num_stages=2),
    "decode": dict(block_i=64, threads=256, num_stages=2),
}


def head_block(heads: int) -> int:
    """Heads per block: the next power of two, at least 16 (a tensor-core M tile), at most 64."""
    block = MIN_HEAD_BLOCK
    while block < min(heads, MAX_HEAD_BLOCK):
        block *= 2
    return block


def transposed_head_block(heads: int) -> int:
    """Heads of the transposed scheme's GEMM N tile: ``heads`` rounded up to a multiple of 8 (wgmma's N step)."""
    assert 1 <= heads <= TRANSPOSED_MAX_HEADS, f"the transposed scheme takes 1..{TRANSPOSED_MAX_HEADS} heads"
    return -(-heads // 8) * 8


def partial_heads(heads: int, ws: bool) -> int:
    """Head rows of a split kernel's partial output: whole head blocks (the heads rounded up to a
    multiple of :func:`head_block`, or of 64 for the warp-specialized kernel ``ws``), so that every
    block stores its whole tile unguarded; the combine reads the first ``heads`` rows."""
    block = MAX_HEAD_BLOCK if ws else head_block(heads)
    return -(-heads // block) * block
