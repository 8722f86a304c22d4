// vectors.cuh: 16-byte global accesses and the division-free index helpers
// shared by the elementwise and BatchNorm kernels.
#pragma once
#include "numerics.cuh"

#ifndef CUPY_ACT_STREAMING
#define CUPY_ACT_STREAMING 0
#endif

namespace cupy_act {

struct __align__(16) Raw16 {
  u32 w[4];
};

// 16-byte global accesses; with CUPY_ACT_STREAMING the .cs (evict-first) forms,
// since every byte is touched exactly once.
__device__ __forceinline__ Raw16 load16(const void* p) {
#if CUPY_ACT_STREAMING
  Raw16 r;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
               : "l"(p));
  return r;
#else
  return *static_cast<const Raw16*>(p);
#endif
}
__device__ __forceinline__ void store16(void* p, const Raw16& v) {
#if CUPY_ACT_STREAMING
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]),
               "r"(v.w[2]), "r"(v.w[3])
               : "memory");
#else
  *static_cast<Raw16*>(p) = v;
#endif
}

template <typename T>
union Pack {
  Raw16 raw;
  T e[16 / sizeof(T)];
};

// a / d for a run-time constant d >= 1, through its double reciprocal inv
// (computed on the host): for 0 <= a < 2^45, a * inv in double is within 2^-7
// of a / d, so the truncated quotient is off by at most one and one
// correction makes it exact. About ten instructions, against some forty for a
// 32-bit and a hundred for a 64-bit integer division.
__device__ __forceinline__ long long quot(long long a, long long d, double inv) {
  if (a >> 45) return a / d;  // beyond the bound (never for real tensors)
  long long q = (long long)((double)a * inv);
  const long long r = a - q * d;
  if (r < 0)
    --q;
  else if (r >= d)
    ++q;
  return q;
}

}  // namespace cupy_act
