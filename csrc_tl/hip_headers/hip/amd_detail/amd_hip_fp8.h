// Compile-only stand-in for ROCm's FP8 header, gfx950 only: the OCP formats (float8 e4m3 with max 448, e5m2) that
// gfx950's conversion instructions implement, as ROCm names them. Every conversion is one hardware instruction
// through clang's builtins (v_cvt_f32_fp8 / v_cvt_pk_fp8_f32 and their bf8 twins): the compile step checks that
// each kernel that converts FP8 contains them, so a header whose conversion fell back to software or a trap would
// fail it. The FNUZ formats of gfx942 are left out: gfx950 does not convert them in hardware.
#pragma once

#include <hip/hip_runtime.h>

typedef unsigned char __hip_fp8_storage_t;
typedef unsigned short __hip_fp8x2_storage_t;
typedef unsigned int __hip_fp8x4_storage_t;

enum __hip_saturation_t { __HIP_NOSAT = 0, __HIP_SATFINITE = 1 };
enum __hip_fp8_interpretation_t { __HIP_E4M3 = 2, __HIP_E5M2 = 3 };

namespace __dsa_fp8 {
constexpr float kMaxE4M3 = 448.0f;
constexpr float kMaxE5M2 = 57344.0f;

// Saturation clamps to the largest finite value first (fmed3 keeps NaN a NaN); the instruction rounds to nearest even.
static __device__ __forceinline__ __hip_fp8_storage_t from_float(float v, __hip_saturation_t sat,
                                                                 __hip_fp8_interpretation_t interp) {
  if (interp == __HIP_E5M2) {
    if (sat == __HIP_SATFINITE) v = __builtin_amdgcn_fmed3f(v, kMaxE5M2, -kMaxE5M2);
    return static_cast<__hip_fp8_storage_t>(__builtin_amdgcn_cvt_pk_bf8_f32(v, v, 0, false));
  }
  if (sat == __HIP_SATFINITE) v = __builtin_amdgcn_fmed3f(v, kMaxE4M3, -kMaxE4M3);
  return static_cast<__hip_fp8_storage_t>(__builtin_amdgcn_cvt_pk_fp8_f32(v, v, 0, false));
}
}  // namespace __dsa_fp8

static __device__ __forceinline__ __hip_fp8_storage_t __hip_cvt_float_to_fp8(float v, __hip_saturation_t sat,
                                                                            __hip_fp8_interpretation_t interp) {
  return __dsa_fp8::from_float(v, sat, interp);
}

struct __hip_fp8_e4m3 {
  __hip_fp8_storage_t __x;
  __hip_fp8_e4m3() = default;
  __device__ __hip_fp8_e4m3(float v) : __x(__dsa_fp8::from_float(v, __HIP_SATFINITE, __HIP_E4M3)) {}
  __device__ operator float() const { return __builtin_amdgcn_cvt_f32_fp8(__x, 0); }
};

struct __hip_fp8_e5m2 {
  __hip_fp8_storage_t __x;
  __hip_fp8_e5m2() = default;
  __device__ __hip_fp8_e5m2(float v) : __x(__dsa_fp8::from_float(v, __HIP_SATFINITE, __HIP_E5M2)) {}
  __device__ operator float() const { return __builtin_amdgcn_cvt_f32_bf8(__x, 0); }
};

// Packed pairs and quads: storage only (TileLang's templates read and write their bytes).
struct __hip_fp8x2_e4m3 {
  __hip_fp8x2_storage_t __x;
};
struct __hip_fp8x2_e5m2 {
  __hip_fp8x2_storage_t __x;
};
struct __hip_fp8x4_e4m3 {
  __hip_fp8x4_storage_t __x;
};
struct __hip_fp8x4_e5m2 {
  __hip_fp8x4_storage_t __x;
};
