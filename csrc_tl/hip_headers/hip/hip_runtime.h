// A compile-only stand-in for ROCm's <hip/hip_runtime.h>, for gfx950 device code only.
//
// It declares what TileLang's HIP templates and our generated kernels use, written with clang's own AMDGPU builtins,
// so that upstream clang can compile the kernels to a gfx950 code object on a machine without ROCm (CI), and report
// their registers, LDS and spills. Nothing here is ever run: on AMD hardware the real ROCm headers replace this
// directory. See ../README.md.
#pragma once

#if !defined(__HIP__) || !defined(__HIP_DEVICE_COMPILE__)
#error "compile-only HIP headers: device compilation only (clang -x hip --cuda-device-only)"
#endif
#if !defined(__gfx950__)
#error "compile-only HIP headers: written for gfx950 (64-lane wavefronts, OCP FP8 conversions)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(threads) __attribute__((amdgpu_flat_work_group_size(1, threads)))

// ---------------------------------------------------------------------------------------------------------------
// Work-item coordinates. The properties read clang's builtins, so `threadIdx.x` is a plain unsigned int.

#define DSA_HIP_COORD(NAME, X, Y, Z)                                                                                   \
  struct NAME##_t {                                                                                                    \
    __declspec(property(get = __get_x)) unsigned int x;                                                                \
    __declspec(property(get = __get_y)) unsigned int y;                                                                \
    __declspec(property(get = __get_z)) unsigned int z;                                                                \
    static __device__ __forceinline__ unsigned int __get_x() { return X; }                                             \
    static __device__ __forceinline__ unsigned int __get_y() { return Y; }                                             \
    static __device__ __forceinline__ unsigned int __get_z() { return Z; }                                             \
  };                                                                                                                   \
  extern const __device__ NAME##_t NAME;

DSA_HIP_COORD(threadIdx, __builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),
              __builtin_amdgcn_workitem_id_z())
DSA_HIP_COORD(blockIdx, __builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),
              __builtin_amdgcn_workgroup_id_z())
DSA_HIP_COORD(blockDim, __builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(),
              __builtin_amdgcn_workgroup_size_z())
DSA_HIP_COORD(gridDim, __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),
              __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),
              __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z())
#undef DSA_HIP_COORD

static constexpr int warpSize = 64;  // gfx950 runs 64-lane wavefronts only

// ---------------------------------------------------------------------------------------------------------------
// Vector types: the members and make_* functions the templates and kernels use.

// (HIP's vector types have element-wise constructors: TileLang writes `float4(a, b, c, d)` and `uint1{v}`.)
#define DSA_HIP_VEC(T, NAME, ALIGN)                                                                                    \
  struct __align__(ALIGN) NAME##1 {                                                                                    \
    T x;                                                                                                               \
    NAME##1() = default;                                                                                               \
    __device__ constexpr NAME##1(T x_) : x(x_) {}                                                                      \
  };                                                                                                                   \
  struct __align__(2 * ALIGN) NAME##2 {                                                                                \
    T x, y;                                                                                                            \
    NAME##2() = default;                                                                                               \
    __device__ constexpr NAME##2(T x_, T y_) : x(x_), y(y_) {}                                                         \
  };                                                                                                                   \
  struct __align__(4 * ALIGN) NAME##4 {                                                                                \
    T x, y, z, w;                                                                                                      \
    NAME##4() = default;                                                                                               \
    __device__ constexpr NAME##4(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}                               \
  };                                                                                                                   \
  static __device__ __forceinline__ NAME##1 make_##NAME##1(T x) { return NAME##1(x); }                                 \
  static __device__ __forceinline__ NAME##2 make_##NAME##2(T x, T y) { return NAME##2(x, y); }                         \
  static __device__ __forceinline__ NAME##4 make_##NAME##4(T x, T y, T z, T w) { return NAME##4(x, y, z, w); }

DSA_HIP_VEC(signed char, char, 1)
DSA_HIP_VEC(unsigned char, uchar, 1)
DSA_HIP_VEC(short, short, 2)
DSA_HIP_VEC(unsigned short, ushort, 2)
DSA_HIP_VEC(int, int, 4)
DSA_HIP_VEC(unsigned int, uint, 4)
DSA_HIP_VEC(long long, longlong, 8)
DSA_HIP_VEC(unsigned long long, ulonglong, 8)
DSA_HIP_VEC(float, float, 4)
DSA_HIP_VEC(double, double, 8)
#undef DSA_HIP_VEC

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  __device__ constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// ---------------------------------------------------------------------------------------------------------------
// Barriers and fences (ROCm's definitions: a barrier orders the workgroup's memory on both sides).

static __device__ __forceinline__ void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
static __device__ __forceinline__ void __threadfence_block() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup"); }
static __device__ __forceinline__ void __threadfence() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
static __device__ __forceinline__ void __threadfence_system() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }

#include "amd_detail/amd_warp_functions.h"

// ---------------------------------------------------------------------------------------------------------------
// Atomics on global and shared memory, relaxed and device-wide, as HIP's atomicX functions are.

#define DSA_HIP_ATOMIC(NAME, BUILTIN)                                                                                  \
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>                                          \
  static __device__ __forceinline__ T NAME(T *address, T val) {                                                        \
    return BUILTIN(address, val, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);                                          \
  }
DSA_HIP_ATOMIC(atomicAdd, __hip_atomic_fetch_add)
DSA_HIP_ATOMIC(atomicSub, __hip_atomic_fetch_sub)
DSA_HIP_ATOMIC(atomicMax, __hip_atomic_fetch_max)
DSA_HIP_ATOMIC(atomicMin, __hip_atomic_fetch_min)
DSA_HIP_ATOMIC(atomicAnd, __hip_atomic_fetch_and)
DSA_HIP_ATOMIC(atomicOr, __hip_atomic_fetch_or)
DSA_HIP_ATOMIC(atomicXor, __hip_atomic_fetch_xor)
DSA_HIP_ATOMIC(atomicExch, __hip_atomic_exchange)
#undef DSA_HIP_ATOMIC

template <typename T>
static __device__ __forceinline__ T atomicCAS(T *address, T compare, T val) {
  __hip_atomic_compare_exchange_strong(address, &compare, val, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_AGENT);
  return compare;
}

// ---------------------------------------------------------------------------------------------------------------
// Math: clang's builtins, which the AMDGPU backend lowers to its own instructions (no device library needed).

#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_huge_valf())
#endif
#ifndef INFINITY
#define INFINITY (__builtin_inff())
#endif
#ifndef NAN
#define NAN (__builtin_nanf(""))
#endif

static __device__ __forceinline__ int __popc(unsigned int x) { return __builtin_popcount(x); }
static __device__ __forceinline__ int __ffs(int x) { return __builtin_ffs(x); }

static __device__ __forceinline__ float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
static __device__ __forceinline__ int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
static __device__ __forceinline__ float __uint_as_float(unsigned int x) { return __builtin_bit_cast(float, x); }
static __device__ __forceinline__ unsigned int __float_as_uint(float x) { return __builtin_bit_cast(unsigned int, x); }
static __device__ __forceinline__ double __hiloint2double(int hi, int lo) {
  return __builtin_bit_cast(double, (static_cast<unsigned long long>(static_cast<unsigned int>(hi)) << 32) |
                                        static_cast<unsigned int>(lo));
}

static __device__ __forceinline__ float fabsf(float x) { return __builtin_fabsf(x); }
static __device__ __forceinline__ double fabs(double x) { return __builtin_fabs(x); }
static __device__ __forceinline__ float sqrtf(float x) { return __builtin_sqrtf(x); }
static __device__ __forceinline__ float rsqrtf(float x) { return __builtin_amdgcn_rsqf(x); }
static __device__ __forceinline__ float expf(float x) { return __builtin_expf(x); }
static __device__ __forceinline__ float exp2f(float x) { return __builtin_exp2f(x); }
static __device__ __forceinline__ float logf(float x) { return __builtin_logf(x); }
static __device__ __forceinline__ float log2f(float x) { return __builtin_log2f(x); }
static __device__ __forceinline__ float __expf(float x) { return __builtin_amdgcn_exp2f(x * 1.4426950408889634f); }
static __device__ __forceinline__ float __exp2f(float x) { return __builtin_amdgcn_exp2f(x); }
static __device__ __forceinline__ float __log2f(float x) { return __builtin_amdgcn_logf(x); }
static __device__ __forceinline__ float __logf(float x) { return __builtin_amdgcn_logf(x) * 0.6931471805599453f; }
static __device__ __forceinline__ float roundf(float x) { return __builtin_roundf(x); }
static __device__ __forceinline__ double round(double x) { return __builtin_round(x); }
static __device__ __forceinline__ float floorf(float x) { return __builtin_floorf(x); }
static __device__ __forceinline__ float ceilf(float x) { return __builtin_ceilf(x); }
static __device__ __forceinline__ float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
static __device__ __forceinline__ float fminf(float a, float b) { return __builtin_fminf(a, b); }

// HIP's global min and max of two values of one type
#define DSA_HIP_MINMAX(T)                                                                                              \
  static __device__ __forceinline__ T min(T a, T b) { return a < b ? a : b; }                                          \
  static __device__ __forceinline__ T max(T a, T b) { return a > b ? a : b; }
DSA_HIP_MINMAX(int)
DSA_HIP_MINMAX(unsigned int)
DSA_HIP_MINMAX(long)
DSA_HIP_MINMAX(unsigned long)
DSA_HIP_MINMAX(long long)
DSA_HIP_MINMAX(unsigned long long)
#undef DSA_HIP_MINMAX
static __device__ __forceinline__ float min(float a, float b) { return __builtin_fminf(a, b); }
static __device__ __forceinline__ float max(float a, float b) { return __builtin_fmaxf(a, b); }
static __device__ __forceinline__ double min(double a, double b) { return __builtin_fmin(a, b); }
static __device__ __forceinline__ double max(double a, double b) { return __builtin_fmax(a, b); }

extern "C" __device__ int printf(const char *format, ...);
