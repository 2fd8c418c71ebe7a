// Compile-only stand-in for ROCm's half-precision header. TileLang's templates use clang's _Float16 directly (as
// `half_t`); nothing of ROCm's __half API is needed, so nothing is declared.
#pragma once

#include <hip/hip_runtime.h>
