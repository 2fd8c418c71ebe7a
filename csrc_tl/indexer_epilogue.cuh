// The epilogue of the warp-specialized prefill logits (csrc_tl/indexer.py), injected verbatim into its kernel's
// prelude. A consumer warpgroup holds the score tile acc [64 keys, 128 columns] of one key block in wgmma's accumulator
// layout: a thread's value 4 * b + 2 * r + c is key row 16 * warp + lane / 4 + 8 * r and column 8 * b + 2 * (lane % 4)
// + c, a column being token * HP + head (HP >= 8: a column group b lies in one token, and the four lanes of a key row
// hold all heads of its tokens). A thread's weights w[2 * b + c] are those of the same columns.

// The key row of the block whose values this thread stores after dsa_index_block's reduce-scatter (its scale is read
// by the kernel before the stage is released).
__device__ __forceinline__ int dsa_index_row() {
  const int lane = threadIdx.x & 31;
  return 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2) + 8 * (lane & 1);
}

// The weights of a thread's columns: weights[t0 + token, head] ([T, heads] float32), 0 for padded heads and for
// tokens at or past t_count.
template <int HP>
__device__ __forceinline__ void dsa_index_weights(const float* weights, int heads, int t0, int t_count, float* w) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int b = 0; b < 16; ++b) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 8 * b + 2 * q + c, t = t0 + col / HP, h = col % HP;
      w[2 * b + c] = (h < heads && t < t_count) ? weights[(long long)t * heads + h] : 0.0f;
    }
  }
}

// One key block's logits: for each token, the sum over its heads of w * relu(acc), times the key's `scale` (that of row
// dsa_index_row()), stored at logits[t0 + token, j0 + key row] ([t_count, n] float32) for tokens below t_count. Where
// `full` (the block lies in every token's range and below n) every value is stored; else a key outside the token's
// [tok_lo, tok_hi) gets -inf and nothing is stored at or past n. The four lanes of a key row reduce their partial sums
// by a reduce-scatter: after the exchange over lane bit 0 a lane keeps key row r = bit 0, after the one over bit 1 half
// of that row's tokens, so each lane stores a quarter of the row's values (a sum over the same lanes in the same order
// on every run).
template <int HP>
__device__ __forceinline__ void dsa_index_block(const float* acc, const float* w, float scale, float* logits,
                                                long long n, int t0, int t_count, int j0, const int* tok_lo,
                                                const int* tok_hi, bool full) {
  constexpr int BT = 128 / HP, G = HP / 8, HALF = BT > 1 ? BT / 2 : 1;
  const int lane = threadIdx.x & 31, q0 = lane & 1, q1 = (lane >> 1) & 1;
  float p[2 * BT];  // p[r * BT + t]: this thread's heads of token t at key row r
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int t = 0; t < BT; ++t) {
      float s = 0.0f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int b = t * G + g;
          s = fmaf(fmaxf(acc[4 * b + 2 * r + c], 0.0f), w[2 * b + c], s);
        }
      }
      p[r * BT + t] = s;
    }
  }
#pragma unroll
  for (int t = 0; t < BT; ++t) {
    const float keep = q0 ? p[BT + t] : p[t], give = q0 ? p[t] : p[BT + t];
    p[t] = keep + __shfl_xor_sync(0xffffffffu, give, 1);
  }
  if constexpr (BT > 1) {
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
      const float keep = q1 ? p[HALF + i] : p[i], give = q1 ? p[i] : p[HALF + i];
      p[i] = keep + __shfl_xor_sync(0xffffffffu, give, 2);
    }
  } else {
    p[0] += __shfl_xor_sync(0xffffffffu, p[0], 2);  // both lanes hold the sum; the one with bit 1 clear stores it
    if (q1) return;
  }
  const int j = j0 + dsa_index_row();
  const int tb = BT > 1 ? q1 * HALF : 0;
  if (!full && j >= n) return;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const int t = tb + i;
    if (t0 + t < t_count) {
      float v = p[i] * scale;
      if (!full && (j < tok_lo[t] || j >= tok_hi[t])) v = __int_as_float(0xff800000);  // -inf
      logits[(long long)(t0 + t) * n + j] = v;
    }
  }
}
