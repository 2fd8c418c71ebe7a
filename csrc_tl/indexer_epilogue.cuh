// The epilogues of the warp-specialized prefill logits and of index_topk's filter (csrc_tl/indexer.py), injected
// verbatim into their kernels' prelude. A consumer warpgroup holds the score tile acc [64 keys, 128 columns] of one key block in wgmma's accumulator
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

// The four lanes of a key row reduce their partial sums by a reduce-scatter: after the exchange over lane bit 0 a lane
// keeps key row r = bit 0, after the one over bit 1 half of that row's tokens, so each lane holds a quarter of the
// row's values (a sum over the same lanes in the same order on every run): p[i] is token tb + i of key row
// dsa_index_row(), i < HALF, tb = dsa_index_tb<HP>(). With one token a block (HP 128) both lanes of bit 1 hold the sum;
// the return value says whether this lane is the one that owns it.
template <int HP>
__device__ __forceinline__ bool dsa_index_reduce(const float* acc, const float* w, float* p) {
  constexpr int BT = 128 / HP, G = HP / 8, HALF = BT > 1 ? BT / 2 : 1;
  const int lane = threadIdx.x & 31, q0 = lane & 1, q1 = (lane >> 1) & 1;
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
    return true;
  } else {
    p[0] += __shfl_xor_sync(0xffffffffu, p[0], 2);
    return !q1;
  }
}

// The first of the HALF tokens whose values this lane holds after dsa_index_reduce.
template <int HP>
__device__ __forceinline__ int dsa_index_tb() {
  constexpr int BT = 128 / HP, HALF = BT > 1 ? BT / 2 : 1;
  return BT > 1 ? ((threadIdx.x >> 1) & 1) * HALF : 0;
}

// One key block's logits: for each token, the sum over its heads of w * relu(acc), times the key's `scale` (that of row
// dsa_index_row()), stored at logits[t0 + token, j0 + key row] ([t_count, n] float32) for tokens below t_count. Where
// `full` (the block lies in every token's range and below n) every value is stored; else a key outside the token's
// [tok_lo, tok_hi) gets -inf and nothing is stored at or past n.
template <int HP>
__device__ __forceinline__ void dsa_index_block(const float* acc, const float* w, float scale, float* logits,
                                                long long n, int t0, int t_count, int j0, const int* tok_lo,
                                                const int* tok_hi, bool full) {
  constexpr int BT = 128 / HP, HALF = BT > 1 ? BT / 2 : 1;
  float p[2 * BT];  // p[r * BT + t]: this thread's heads of token t at key row r, then the reduced values
  if (!dsa_index_reduce<HP>(acc, w, p)) return;
  const int j = j0 + dsa_index_row();
  const int tb = dsa_index_tb<HP>();
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

// index_topk's filter: this thread's tokens' guesses g[i] and position bases base[i] (ks of token t0 + tb + i), their
// running candidate counts cnt[i] zeroed.
template <int HP>
__device__ __forceinline__ void dsa_filter_init(const float* guess, const int* pos_base, int t0, int t_count, float* g,
                                                int* base, int* cnt) {
  constexpr int BT = 128 / HP, HALF = BT > 1 ? BT / 2 : 1;
  const int tb = dsa_index_tb<HP>();
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const int t = min(t0 + tb + i, t_count - 1);
    g[i] = guess[t];
    base[i] = pos_base[t];
    cnt[i] = 0;
  }
}

// The lanes of this lane's token group (lane bit 1) whose key rows come before its own in the block: a key row is
// lane / 4 + 8 * (lane % 2) within the warp.
__device__ __forceinline__ unsigned dsa_filter_before() {
  const int lane = threadIdx.x & 31, a = lane >> 2, b = lane & 1, q1 = (lane >> 1) & 1;
  const unsigned below = (1u << (4 * a)) - 1u, even = 0x11111111u << (2 * q1), odd = 0x22222222u << (2 * q1);
  return b ? (even | (below & odd)) : (below & even);
}

// One key block of index_topk's filter: the values of dsa_index_block at or above each token's guess g (never NaN),
// inside its range, appended in key order to the token's list vals / pos ([t_count, cap]: the value, and the key's
// position j - base), its count cnt[i] (held alike by every thread of the token) advanced by the block's candidates
// whether or not they fit. The ranks: a ballot within each warp, then the four warps' counts through `totals`
// (shared memory, 8-byte aligned: [2 halves][2 lane groups][4 warps] of 64 bits, a byte a token of the group; the
// half `parity` is this block's) and one named barrier `bar` of the warpgroup's 128 threads.
template <int HP>
__device__ __forceinline__ void dsa_filter_block(const float* acc, const float* w, float scale, const float* g,
                                                 const int* base, int* cnt, float* vals, int* pos, int cap, int t0,
                                                 int t_count, int j0, long long n, const int* tok_lo,
                                                 const int* tok_hi, bool full, int* totals, int parity, int bar) {
  constexpr int BT = 128 / HP, HALF = BT > 1 ? BT / 2 : 1;
  static_assert(HALF <= 8, "a token's count of a warp is a byte of 64 bits");
  float p[2 * BT];
  const bool owner = dsa_index_reduce<HP>(acc, w, p);
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, q1 = (lane >> 1) & 1;
  const int j = j0 + dsa_index_row(), tb = dsa_index_tb<HP>(), grp = BT > 1 ? q1 : 0;
  const unsigned group = 0x33333333u << (2 * q1), before = dsa_filter_before();
  unsigned long long* half = reinterpret_cast<unsigned long long*>(totals) + parity * 8 + grp * 4;
  unsigned long long mine = 0;  // this warp's count of each of the group's tokens
  unsigned takes = 0;           // bit i: this lane appends token tb + i
  int rank[HALF];
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const int t = tb + i;
    const float v = p[i] * scale;
    const bool inside = full || (j < n && j >= tok_lo[t] && j < tok_hi[t]);
    const bool take = owner && t0 + t < t_count && inside && v >= g[i];
    const unsigned ballot = __ballot_sync(0xffffffffu, take);
    rank[i] = __popc(ballot & before);
    mine |= (unsigned long long)__popc(ballot & group) << (8 * i);
    takes |= (unsigned)take << i;
    p[i] = v;
  }
  if (BT > 1 ? (lane & ~2) == 0 : lane == 0) half[warp] = mine;  // a lane a group
  asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
  const unsigned long long c0 = half[0], c1 = half[1], c2 = half[2], c3 = half[3];
  const unsigned long long prefix = (warp > 0 ? c0 : 0) + (warp > 1 ? c1 : 0) + (warp > 2 ? c2 : 0);
  const unsigned long long total = c0 + c1 + c2 + c3;  // (a byte holds a token's 64 keys)
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const int at = cnt[i] + (int)((prefix >> (8 * i)) & 0xff) + rank[i];
    if ((takes >> i & 1) && at < cap) {
      const long long slot = (long long)(t0 + tb + i) * cap + at;
      vals[slot] = p[i];
      pos[slot] = j - base[i];
    }
    cnt[i] += (int)((total >> (8 * i)) & 0xff);
  }
}

// The counts of index_topk's filter into count[t0 + token] ([t_count] int32), by one thread of each token.
template <int HP>
__device__ __forceinline__ void dsa_filter_counts(const int* cnt, int* count, int t0, int t_count) {
  constexpr int BT = 128 / HP, HALF = BT > 1 ? BT / 2 : 1;
  const int lane = threadIdx.x & 31, tb = dsa_index_tb<HP>();
  if (((threadIdx.x >> 5) & 3) != 0 || (lane & ~2) != 0 || (BT == 1 && lane != 0)) return;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    if (t0 + tb + i < t_count) count[t0 + tb + i] = cnt[i];
  }
}
