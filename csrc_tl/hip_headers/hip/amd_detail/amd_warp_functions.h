// Compile-only stand-in for ROCm's warp functions: HIP's shuffles over ds_bpermute, with ROCm's lane arithmetic
// (a shuffle within groups of `width` lanes; a source lane outside the group reads the calling lane's own value).
#pragma once

static __device__ __forceinline__ int __lane_id() {
  return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
}

static __device__ __forceinline__ int __dsa_bpermute(int lane, int var) {
  return __builtin_amdgcn_ds_bpermute(lane << 2, var);
}

static __device__ __forceinline__ int __shfl(int var, int src_lane, int width = warpSize) {
  int self = __lane_id();
  return __dsa_bpermute((src_lane & (width - 1)) + (self & ~(width - 1)), var);
}
static __device__ __forceinline__ int __shfl_up(int var, unsigned int delta, int width = warpSize) {
  int self = __lane_id();
  int index = self - static_cast<int>(delta);
  return __dsa_bpermute(index < (self & ~(width - 1)) ? self : index, var);
}
static __device__ __forceinline__ int __shfl_down(int var, unsigned int delta, int width = warpSize) {
  int self = __lane_id();
  int index = self + static_cast<int>(delta);
  return __dsa_bpermute(static_cast<int>((self & (width - 1)) + delta) >= width ? self : index, var);
}
static __device__ __forceinline__ int __shfl_xor(int var, int lane_mask, int width = warpSize) {
  int self = __lane_id();
  int index = self ^ lane_mask;
  return __dsa_bpermute(index >= ((self + width) & ~(width - 1)) ? self : index, var);
}

// Every other 32-bit type moves as an int; 64-bit types as two.
#define DSA_HIP_SHFL_32(T)                                                                                             \
  static __device__ __forceinline__ T __shfl(T var, int src_lane, int width = warpSize) {                              \
    return __builtin_bit_cast(T, __shfl(__builtin_bit_cast(int, var), src_lane, width));                               \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_up(T var, unsigned int delta, int width = warpSize) {                     \
    return __builtin_bit_cast(T, __shfl_up(__builtin_bit_cast(int, var), delta, width));                               \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_down(T var, unsigned int delta, int width = warpSize) {                   \
    return __builtin_bit_cast(T, __shfl_down(__builtin_bit_cast(int, var), delta, width));                             \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_xor(T var, int lane_mask, int width = warpSize) {                         \
    return __builtin_bit_cast(T, __shfl_xor(__builtin_bit_cast(int, var), lane_mask, width));                          \
  }
DSA_HIP_SHFL_32(unsigned int)
DSA_HIP_SHFL_32(float)
#undef DSA_HIP_SHFL_32

#define DSA_HIP_SHFL_64(T)                                                                                             \
  static __device__ __forceinline__ T __shfl(T var, int src_lane, int width = warpSize) {                              \
    int2 v = __builtin_bit_cast(int2, var);                                                                            \
    return __builtin_bit_cast(T, int2(__shfl(v.x, src_lane, width), __shfl(v.y, src_lane, width)));                    \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_up(T var, unsigned int delta, int width = warpSize) {                     \
    int2 v = __builtin_bit_cast(int2, var);                                                                            \
    return __builtin_bit_cast(T, int2(__shfl_up(v.x, delta, width), __shfl_up(v.y, delta, width)));                    \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_down(T var, unsigned int delta, int width = warpSize) {                   \
    int2 v = __builtin_bit_cast(int2, var);                                                                            \
    return __builtin_bit_cast(T, int2(__shfl_down(v.x, delta, width), __shfl_down(v.y, delta, width)));                \
  }                                                                                                                    \
  static __device__ __forceinline__ T __shfl_xor(T var, int lane_mask, int width = warpSize) {                         \
    int2 v = __builtin_bit_cast(int2, var);                                                                            \
    return __builtin_bit_cast(T, int2(__shfl_xor(v.x, lane_mask, width), __shfl_xor(v.y, lane_mask, width)));          \
  }
DSA_HIP_SHFL_64(long)
DSA_HIP_SHFL_64(unsigned long)
DSA_HIP_SHFL_64(long long)
DSA_HIP_SHFL_64(unsigned long long)
DSA_HIP_SHFL_64(double)
#undef DSA_HIP_SHFL_64
