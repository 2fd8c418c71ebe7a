// Device helpers of the warp-specialized sparse-attention kernels (csrc_tl/attention/ws_kernel.py).
// The kernel builder reads this file by sections: the text after a `// section: NAME` line up to the next one is
// injected verbatim into a kernel's prelude when its plan needs that helper (see csrc_tl/attention/device.py), so
// the generated source depends on every byte of a section, blank lines included.
// section: row_sums

__device__ __forceinline__ float* dsa_row_sums() { __shared__ float sums[2 * 64]; return sums; }
__device__ __forceinline__ void dsa_put_row_sum(int i, float v) { dsa_row_sums()[i] = v; }
__device__ __forceinline__ float dsa_row_sum(int i) { return dsa_row_sums()[i]; }
// section: convert

__device__ __forceinline__ unsigned dsa_bf16x2(unsigned short fp8x2, float scale, bool scaled) {
  unsigned h, r;
  float lo, hi;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(fp8x2));
  asm("{.reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b;}" : "=f"(lo), "=f"(hi) : "r"(h));
  if (scaled) { lo *= scale; hi *= scale; }
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 8 FP8 values (two 32-bit words) to 8 bf16 values (16 bytes)
__device__ __forceinline__ uint4 dsa_widen8(unsigned w0, unsigned w1, float scale, bool scaled) {
  return make_uint4(dsa_bf16x2(w0 & 0xffff, scale, scaled), dsa_bf16x2(w0 >> 16, scale, scaled),
                    dsa_bf16x2(w1 & 0xffff, scale, scaled), dsa_bf16x2(w1 >> 16, scale, scaled));
}
// section: widen

// Chunks of 16 FP8 values, each given as (raw, d0, d1, scale): raw points to its 16 raw values, d0 and
// d1 to the two 8-value bf16 halves it takes widened in a stage.
// Every chunk's raw values are loaded before any chunk is stored, so the shared-memory loads are in
// flight together. kSync: in place, where other lanes of the warp widen over a chunk's raw values
// (ws_inplace_raw_col), the warp synchronizes between its lanes' loads and their stores.
template <bool kScaled, bool kSync>
__device__ __forceinline__ void dsa_widen() {
  if constexpr (kSync) __syncwarp();
}
template <bool kScaled, bool kSync, typename... Rest>
__device__ __forceinline__ void dsa_widen(const void* raw, void* d0, void* d1, float scale, Rest... rest) {
  uint4 v = *reinterpret_cast<const uint4*>(raw);
  dsa_widen<kScaled, kSync>(rest...);
  *reinterpret_cast<uint4*>(d0) = dsa_widen8(v.x, v.y, scale, kScaled);
  *reinterpret_cast<uint4*>(d1) = dsa_widen8(v.z, v.w, scale, kScaled);
}
// wait until at most n of this thread's cp.async groups are pending (n a constant after unrolling)
__device__ __forceinline__ void dsa_cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
  }
}
// the 8 raw FP8 tail values at the start of a 16-byte tail chunk, widened over it
__device__ __forceinline__ void dsa_widen_tail_inplace(void* t) {
  uint2 raw = *reinterpret_cast<const uint2*>(t);
  *reinterpret_cast<uint4*>(t) = dsa_widen8(raw.x, raw.y, 1.0f, false);
}
// section: copy

// Stores and copies of the in-place and halves producers addressed with T.address_of, out of sight
// of TileLang's barrier planner (see produce_inplace): a flag, and a cp.async of N bytes (zeros where
// pred is false).
__device__ __forceinline__ void dsa_put_flag(int* p, int v) { *p = v; }
template <int N>
__device__ __forceinline__ void dsa_cp_async(void* smem, const void* gmem, bool pred) {
  unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(gmem), "r"(pred ? 16 : 0) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                 :: "r"(a), "l"(gmem), "n"(N), "r"(pred ? N : 0) : "memory");
  }
}
// section: bulk

// A packed row's kBytes FP8 values (rows 8-byte aligned, at least 8 bytes of scales after the values) by
// one bulk copy into its raw slot (16-byte aligned). A row whose start lies 8 bytes past a 16-byte
// boundary is copied from that boundary, kBytes + 16 bytes (the previous row's scales first, its own
// last), so its values land 8 bytes into the slot; the pool's first row has no row before it (a pool that
// starts 8 bytes past a boundary): its first 8 values are stored by the issuing lane itself and the copy
// starts 8 bytes into the row. The issuing lane arrives on `bar` expecting the copy's bytes (an invalid
// row: a plain arrival). Every lane returns its row's flag: 0 invalid, 1 + (values 8 bytes in).
template <int kBytes, int kRowBytes>
__device__ __forceinline__ int dsa_bulk_row(void* slot, const void* pool, int index, void* bar, bool issuer, bool ok) {
  const char* row = reinterpret_cast<const char*>(pool) + (long long)index * kRowBytes;
  unsigned shift = (unsigned)(reinterpret_cast<unsigned long long>(row) & 15);
  if (issuer) {
    unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    if (ok) {
      unsigned s = (unsigned)__cvta_generic_to_shared(slot), n = kBytes + 2 * shift;
      // (selects, not a branch: a branch here made the packed prefill about 1% slower on an H200)
      bool head = shift != 0 && index == 0;
      const char* src = head ? row + 8 : row - shift;
      s += head ? 16 : 0;
      n = head ? kBytes : n;
      if (head) *reinterpret_cast<uint2*>(reinterpret_cast<char*>(slot) + 8) = *reinterpret_cast<const uint2*>(row);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(n) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(s), "l"(src), "r"(n), "r"(b) : "memory");
    } else {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
    }
  }
  return ok ? 1 + int(shift >> 3) : 0;
}
// 16 zero bytes where a lane widens a chunk of an invalid row (its slot holds stale bytes, maybe NaN codes)
__device__ __forceinline__ void dsa_zero16(void* p, bool ok) {
  if (!ok) *reinterpret_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
}
// 16 FP8 values at raw (8-byte aligned: the row may lie 8 bytes into its slot) times scale, widened into 8
// bf16 values at d0 and 8 at d1 (WS_CONVERT)
__device__ __forceinline__ void dsa_widen_bulk(const void* raw, void* d0, void* d1, float scale) {
  const uint2* r = reinterpret_cast<const uint2*>(raw);
  uint2 a = r[0], b = r[1];
  *reinterpret_cast<uint4*>(d0) = dsa_widen8(a.x, a.y, scale, true);
  *reinterpret_cast<uint4*>(d1) = dsa_widen8(b.x, b.y, scale, true);
}
// The lanes of a warp (which hold whole rows) are done reading their raw slots through the generic proxy
// before the bulk copies (async proxy) refill them.
__device__ __forceinline__ void dsa_bulk_reuse() {
  __syncwarp();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// section: put_bf16

__device__ __forceinline__ void dsa_put_bf16(void* p, float v) {
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  *reinterpret_cast<unsigned short*>(p) = b;
}
// section: bar_sync
__device__ __forceinline__ void dsa_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
// section: copy16
__device__ __forceinline__ void dsa_copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
// section: ld_index
__device__ __forceinline__ int dsa_ld_index(const int* indices, long long offset) { return indices[offset]; }
// section: col_stats

// The transposed consumers' softmax statistics over the rows of a score tile S^T [64, HB] that consumer warpgroup 0
// holds in wgmma's accumulator layout: a thread's value 4 * b + 2 * r + c is row 16 * warp + lane / 4 + 8 * r,
// column 8 * b + 2 * (lane % 4) + c. A column's 16 rows in a warp are reduced by shuffles over the eight lanes that
// share lane % 4 (a fixed order: the result does not vary from run to run), its four warps through red [4 * HB] in
// shared memory and a named barrier of the warpgroup: one barrier per block for all columns.
template <int HB, bool kMax>
__device__ __forceinline__ void dsa_col_reduce(const float* s, float* red, int bar) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int b = 0; b < HB / 8; ++b) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float x = kMax ? fmaxf(s[4 * b + c], s[4 * b + 2 + c]) : s[4 * b + c] + s[4 * b + 2 + c];
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, x, m);
        x = kMax ? fmaxf(x, y) : x + y;
      }
      if (lane < 4) red[warp * HB + 8 * b + 2 * lane + c] = x;
    }
  }
  dsa_bar_sync(bar, 128);
}
// Thread h < HB folds column h's block max into the running max m[h] and writes alpha[h], the factor the earlier
// blocks are rescaled by; the warpgroup reads both after the second barrier.
template <int HB>
__device__ __forceinline__ void dsa_col_max_update(const float* s, float* red, float* m, float* alpha, float scale2,
                                                   int bar) {
  dsa_col_reduce<HB, true>(s, red, bar);
  const int h = threadIdx.x & 127;
  if (h < HB) {
    const float x = fmaxf(fmaxf(red[h], red[HB + h]), fmaxf(red[2 * HB + h], red[3 * HB + h]));
    const float old = m[h], now = fmaxf(old, x);
    alpha[h] = exp2f((old - now) * scale2);
    m[h] = now;
  }
  dsa_bar_sync(bar, 128);
}
// Thread h < HB folds column h's block sum of probabilities into the running sum sum[h] (rescaled by alpha[h]).
// red must not be the buffer of dsa_col_max_update: the barriers of each then order the other's reuse.
template <int HB>
__device__ __forceinline__ void dsa_col_sum_update(const float* s, float* red, float* sum, const float* alpha,
                                                   int bar) {
  dsa_col_reduce<HB, false>(s, red, bar);
  const int h = threadIdx.x & 127;
  if (h < HB) sum[h] = sum[h] * alpha[h] + ((red[h] + red[HB + h]) + (red[2 * HB + h] + red[3 * HB + h]));
}
// section: direct

// The direct producer over packed rows without a tail (WsPlan.direct): a thread's bytes of a row go from global memory
// to its registers and, widened, to the bf16 stage. dsa_ld_row loads a thread's lane of one row into r: its
// kHalfChunks 16-byte chunks of each value half (chunk c of a half at byte (c * 8 + lane) * 16 of the half), the
// row's four tile scales, and the row's flag `ok` last. The loads are issued here and first read when the row is
// widened, a block later.
__device__ __forceinline__ void dsa_ldg16(unsigned* r, const void* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
template <int kHalfChunks, int kHalf, int kScale>
__device__ __forceinline__ void dsa_ld_row(unsigned* r, const void* row, int lane, int ok) {
  const char* b = reinterpret_cast<const char*>(row);
#pragma unroll
  for (int c = 0; c < kHalfChunks; ++c) {
    dsa_ldg16(r + 4 * c, b + (c * 8 + lane) * 16);
    dsa_ldg16(r + 4 * (kHalfChunks + c), b + kHalf + (c * 8 + lane) * 16);
  }
  dsa_ldg16(r + 8 * kHalfChunks, b + kScale);
  r[8 * kHalfChunks + 4] = ok;
}
// One 16-value chunk r[0..4) of a loaded row (its scales and flag at `row`, see dsa_ld_row) times its tile's scale,
// widened into 8 bf16 values at d0 and 8 at d1; zeros for an invalid row (whose bytes are row 0's, maybe NaN codes).
template <int kFlag>
__device__ __forceinline__ void dsa_widen_regs(const unsigned* r, const unsigned* row, int tile, void* d0, void* d1) {
  const bool ok = row[kFlag] != 0;
  const unsigned m = ok ? 0xffffffffu : 0u;
  const float s = ok ? __uint_as_float(row[kFlag - 4 + tile]) : 0.0f;
  *reinterpret_cast<uint4*>(d0) = dsa_widen8(r[0] & m, r[1] & m, s, true);
  *reinterpret_cast<uint4*>(d1) = dsa_widen8(r[2] & m, r[3] & m, s, true);
}
template <int kFlag>
__device__ __forceinline__ void dsa_put_row_flag(int* p, const unsigned* row) { *p = row[kFlag] != 0 ? 1 : 0; }
