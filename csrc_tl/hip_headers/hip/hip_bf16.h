// Compile-only stand-in for ROCm's bfloat16 header: the `hip_bfloat16` struct TileLang's templates name
// (`bfloat16_t`), with ROCm's interface (an explicit constructor from float, an implicit conversion to float,
// arithmetic that stays bfloat16). Conversions go through clang's __bf16, which gfx950 converts in hardware
// (v_cvt_pk_bf16_f32); ROCm's own struct may round in software, so its register counts can differ slightly.
#pragma once

#include <hip/hip_runtime.h>

struct hip_bfloat16 {
  unsigned short data;

  hip_bfloat16() = default;
  __device__ explicit hip_bfloat16(float f) : data(__builtin_bit_cast(unsigned short, static_cast<__bf16>(f))) {}
  __device__ operator float() const { return static_cast<float>(__builtin_bit_cast(__bf16, data)); }
};

#define DSA_HIP_BF16_OP(OP)                                                                                            \
  static __device__ __forceinline__ hip_bfloat16 operator OP(hip_bfloat16 a, hip_bfloat16 b) {                         \
    return hip_bfloat16(static_cast<float>(a) OP static_cast<float>(b));                                               \
  }                                                                                                                    \
  static __device__ __forceinline__ hip_bfloat16 &operator OP##=(hip_bfloat16 & a, hip_bfloat16 b) {                   \
    return a = a OP b;                                                                                                 \
  }
DSA_HIP_BF16_OP(+)
DSA_HIP_BF16_OP(-)
DSA_HIP_BF16_OP(*)
DSA_HIP_BF16_OP(/)
#undef DSA_HIP_BF16_OP

static __device__ __forceinline__ hip_bfloat16 operator-(hip_bfloat16 a) {
  a.data ^= 0x8000;
  return a;
}
