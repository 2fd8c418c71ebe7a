// Compile-only stand-in for rocWMMA: TileLang's common.h includes it, but neither its templates nor our kernels use
// any of it (their matrix products call the MFMA builtins directly).
#pragma once
