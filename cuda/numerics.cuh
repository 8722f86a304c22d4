// numerics.cuh: storage types, bit views and IEEE arithmetic that never flushes
// subnormals.
//
// CuPy compiles every module with -ftz=true. Under that flag NVVM emits the .ftz
// forms of f32 add, mul, setp and cvt, which flush subnormal inputs and results to
// zero, while PyTorch's kernels are built without it. So in this library:
//   * every f32 operation on data is inline PTX that names its rounding mode and
//     has no .ftz (inline asm is passed through untouched by the flag);
//   * every comparison is made on the integer bit pattern, never with setp.f32;
//   * f16/bf16 conversions are the same PTX instructions that cuda_fp16.h and
//     cuda_bf16.h emit for PyTorch (no headers are included: the compiled unit is
//     self-contained, so CuPy's cache key, the source text, covers everything).
// f64 arithmetic is never flushed; it uses the same explicit forms for symmetry.
#pragma once

namespace cupy_act {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Half-precision storage types: 16 raw bits, converted explicitly.
struct half_t {
  u16 bits;
};
struct bfloat16_t {
  u16 bits;
};

// Round-to-nearest-even arithmetic on the op type, no flush to zero.
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// a * b + c rounded once.
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
__device__ __forceinline__ double fma_rn(double a, double b, double c) {
  double r;
  asm("fma.rn.f64 %0, %1, %2, %3;" : "=d"(r) : "d"(a), "d"(b), "d"(c));
  return r;
}
__device__ __forceinline__ double mul_rn(double a, double b) {
  double r;
  asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
  return r;
}

// Num<T>: the op type (PyTorch's at::opmath_type: float for 16-bit types), the
// signed integer view of the bits, and the conversions T <-> op type.
template <typename T>
struct Num;

template <>
struct Num<float> {
  typedef float op_t;
  typedef int sbits_t;
  static constexpr sbits_t kInf = 0x7f800000;  // bits of +inf
  static constexpr sbits_t kAbs = 0x7fffffff;  // everything but the sign
  static __device__ __forceinline__ sbits_t bits(float x) { return __float_as_int(x); }
  static __device__ __forceinline__ float zero() { return __int_as_float(0); }
  static __device__ __forceinline__ op_t to_op(float x) { return x; }
  static __device__ __forceinline__ float from_op(op_t x) { return x; }
};

template <>
struct Num<double> {
  typedef double op_t;
  typedef long long sbits_t;
  static constexpr sbits_t kInf = 0x7ff0000000000000LL;
  static constexpr sbits_t kAbs = 0x7fffffffffffffffLL;
  static __device__ __forceinline__ sbits_t bits(double x) { return __double_as_longlong(x); }
  static __device__ __forceinline__ double zero() { return __longlong_as_double(0LL); }
  static __device__ __forceinline__ op_t to_op(double x) { return x; }
  static __device__ __forceinline__ double from_op(op_t x) { return x; }
};

template <>
struct Num<half_t> {
  typedef float op_t;
  typedef short sbits_t;
  static constexpr sbits_t kInf = 0x7c00;
  static constexpr sbits_t kAbs = 0x7fff;
  static __device__ __forceinline__ sbits_t bits(half_t x) { return (short)x.bits; }
  static __device__ __forceinline__ half_t zero() {
    half_t h;
    h.bits = 0;
    return h;
  }
  // What __half2float / __float2half emit (c10::Half's conversions on CUDA).
  static __device__ __forceinline__ op_t to_op(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
  }
  static __device__ __forceinline__ half_t from_op(op_t f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
  }
};

template <>
struct Num<bfloat16_t> {
  typedef float op_t;
  typedef short sbits_t;
  static constexpr sbits_t kInf = 0x7f80;
  static constexpr sbits_t kAbs = 0x7fff;
  static __device__ __forceinline__ sbits_t bits(bfloat16_t x) { return (short)x.bits; }
  static __device__ __forceinline__ bfloat16_t zero() {
    bfloat16_t h;
    h.bits = 0;
    return h;
  }
  // What __bfloat162float / __float2bfloat16 emit (c10::BFloat16 on CUDA): the
  // cvt instructions where the architecture has them, else the exact software
  // equivalents (a shift up; round-to-nearest-even down, NaN -> 0x7fff).
  static __device__ __forceinline__ op_t to_op(bfloat16_t x) {
#if __CUDA_ARCH__ >= 900
    float f;
    asm("cvt.f32.bf16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#else
    return __int_as_float((int)((u32)x.bits << 16));
#endif
  }
  static __device__ __forceinline__ bfloat16_t from_op(op_t f) {
    bfloat16_t h;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
    const u32 u = (u32)__float_as_int(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      h.bits = 0x7fff;
    } else {
      h.bits = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
#endif
    return h;
  }
};

// x > 0, decided on the bits: NaN is not > 0, subnormals are (no flush).
// As a signed integer a positive number lies in (0, +inf]; a set sign bit makes
// it negative and NaN lies above +inf.
template <typename T>
__device__ __forceinline__ bool greater_than_zero(T x) {
  const typename Num<T>::sbits_t s = Num<T>::bits(x);
  return s > 0 && s <= Num<T>::kInf;
}
// float: the IEEE compare itself, without .ftz (which -ftz=true would give
// `x > 0.f`, flushing positive subnormals to false): one instruction where
// the bits take two.
template <>
__device__ __forceinline__ bool greater_than_zero(float x) {
  u32 r;
  asm("{\n .reg .pred p;\n setp.gt.f32 p, %1, 0f00000000;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(r)
      : "f"(x));
  return r != 0;
}

// !(x <= 0): true for x > 0 and for every NaN (either sign).
template <typename T>
__device__ __forceinline__ bool not_at_most_zero(T x) {
  const typename Num<T>::sbits_t s = Num<T>::bits(x);
  return s > 0 || (s & Num<T>::kAbs) > Num<T>::kInf;
}

// An op-type scalar from the 64 bits the host packed (float in the low half).
template <typename OpT>
__device__ __forceinline__ OpT scalar_from_bits(u64 b);
template <>
__device__ __forceinline__ float scalar_from_bits<float>(u64 b) {
  return __int_as_float((int)(u32)b);
}
template <>
__device__ __forceinline__ double scalar_from_bits<double>(u64 b) {
  return __longlong_as_double((long long)b);
}

// PyTorch's `out + bias`: ATen's add computes `a + alpha * b` in the op type with
// alpha a run-time 1, which nvcc contracts into fma(alpha, b, a). The value is
// x + b rounded once either way, but float64 keeps NaN payloads and which one
// survives when both x and b are NaN depends on the instruction: the addend's
// for that FMA, not what an add would give. So this is that FMA, with alpha
// passed in at run time so that nothing folds it into an add.
template <typename T>
__device__ __forceinline__ T add_bias(T x, T b, typename Num<T>::op_t alpha) {
  return Num<T>::from_op(fma_rn(alpha, Num<T>::to_op(b), Num<T>::to_op(x)));
}

}  // namespace cupy_act
