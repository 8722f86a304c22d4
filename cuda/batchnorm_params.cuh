// batchnorm_params.cuh: the BatchNorm kernels' parameter block and the
// per-element and per-channel helpers that the reductions
// (batchnorm_reduce.cuh) and the elementwise passes (batchnorm.cu) share.
// batchnorm.cu's header says what the kernels compute.
#pragma once

#include "numerics.cuh"
#include "vectors.cuh"

namespace cupy_act {

constexpr int kBnThreads = 256;
enum BnAct { kIdentity = 0, kRelu = 1, kLeaky = 2 };
enum BnPass { kStats = 0, kGrad = 1, kGradFromOutput = 2 };
enum BnFlags { kEval = 1, kFromOutput = 2, kSums = 4 };

struct BnParams {
  const void* x;          // forward: input; backward: the forward's input, or its output (kFromOutput)
  const void* dy;         // backward: upstream gradient
  void* y;                // forward: y (x itself in the in-place mode); backward: dx
  u32* mask;              // 1 bit per element; null: none written (identity, in-place, no gradient)
  const float* weight;    // [C] or null (1)
  const float* bias;      // [C] or null (0)
  float* mean;            // [C] batch (or running) mean: written forward, read backward
  float* invstd;          // [C] 1 / sqrt(var + eps)
  double* partial;        // [C][splits][2]; bn_finish_sums: [C][2] totals (+ the count: kStats)
  float* running_mean;    // [C] or null: updated by a training forward
  float* running_var;     // [C] or null
  float* grad_weight;     // [C] or null
  float* grad_bias;       // [C] or null
  float* coef;            // [4][C] the elementwise pass's per-channel constants: four
                          // planes of C floats (bn_put_coef, bn_coefs)
  long long* num_batches; // or null: num_batches_tracked, incremented once by a training
                          // forward (here rather than a separate launch on the host)
  u32* arrivals;          // [C] (NCHW reductions): zero at launch, and again at exit
  const void* residual;   // or null: added before the activation, y = act(bn(x) + residual)
  void* grad_residual;    // or null: the backward writes dz (the residual's gradient) here
  double* moments;        // [C][2] or null: the forward's mean and biased variance (the
                          // compiled op's statistics), then [2C] the count, [2C + 1] a pad;
                          // kSums: where the local sums go
  const void* post;       // or null: added after the activation, out = act(bn(x)) + post
                          // (only where residual is null)
  long long n;            // elements
  long long inner;        // H x W
  long long channels;
  long long splits;       // partial sums per channel
  long long dy_skip;      // dy's elements between one row (channels-last: C values) or one
                          // sample (NCHW: C x H x W) and the next, beyond the row or sample:
                          // 0 where dy is dense; a channel slice of a concatenation's
                          // gradient is read where it lies instead of copied
  double momentum;        // the running statistics' factor (PyTorch's exponential_average_factor)
  double eps;
  double inv_inner;       // 1 / inner and 1 / channels, for quot()
  double inv_channels;
  float slope;            // LeakyReLU's negative slope
  int flags;              // BnFlags
};

// Element i's channel, and (outer) its row (channels-last) or sample (NCHW):
// dy's element i lies at i + outer * p.dy_skip.
template <bool CL>
__device__ __forceinline__ long long bn_channel(long long i, const BnParams& p,
                                                long long& outer) {
  const long long q = CL ? i : quot(i, p.inner, p.inv_inner);
  outer = quot(q, p.channels, p.inv_channels);
  return q - outer * p.channels;
}

template <typename T, int V>
__device__ __forceinline__ void bn_load(const void* p, long long i, float (&f)[V]) {
  if constexpr (V == 1) {
    f[0] = Num<T>::to_op(static_cast<const T*>(p)[i]);
  } else {
    Pack<T> v;
    v.raw = load16(static_cast<const T*>(p) + i);
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = Num<T>::to_op(v.e[j]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void bn_store(void* p, long long i, const float (&f)[V]) {
  if constexpr (V == 1) {
    static_cast<T*>(p)[i] = Num<T>::from_op(f[0]);
  } else {
    Pack<T> v;
#pragma unroll
    for (int j = 0; j < V; ++j) v.e[j] = Num<T>::from_op(f[j]);
    store16(static_cast<T*>(p) + i, v.raw);
  }
}

// The activation's bit: set where its forward is the identity (relu: also NaN).
template <int A>
__device__ __forceinline__ bool bn_bit(float t) {
  return A == kRelu ? !(t <= 0.f) : t > 0.f;
}

template <int A>
__device__ __forceinline__ float bn_act(float t, float slope) {
  if (A == kIdentity) return t;
  if (A == kRelu) return bn_bit<A>(t) ? t : 0.f;
  return t > 0.f ? t : t * slope;
}

template <int A>
__device__ __forceinline__ float bn_act_grad(float dy, bool bit, float slope) {
  if (A == kIdentity) return dy;
  if (A == kRelu) return bit ? dy : 0.f;
  return bit ? dy : dy * slope;
}

// From the output (identity, or LeakyReLU with slope > 0): y > 0 exactly where
// t > 0, and t = y / slope elsewhere, taken as y * inv_slope (inv_slope = 1 /
// slope rounded: one rounding more than the division, within the in-place
// gradients' bound, where IEEE division's ten-odd instructions per element
// made the in-place reduction the slowest pass).
template <int A>
__device__ __forceinline__ float bn_unact(float y, float inv_slope) {
  return (A == kLeaky && !(y > 0.f)) ? y * inv_slope : y;
}

// The V mask bits of the vector at element i (i % V == 0, so one word holds them).
template <int A>
__device__ __forceinline__ u32 bn_bits(const BnParams& p, long long i) {
  return A == kIdentity ? ~0u : p.mask[i >> 5] >> (i & 31);
}

__device__ __forceinline__ float bn_weight(const BnParams& p, long long c) {
  return p.weight != nullptr ? p.weight[c] : 1.f;
}
__device__ __forceinline__ float bn_bias(const BnParams& p, long long c) {
  return p.bias != nullptr ? p.bias[c] : 0.f;
}

// Channel c's four coefficients, one per plane of p.coef (structure of
// arrays: a channels-last thread loads its V channels' values of a plane as
// V / 4 vectors, where one float4 per channel put its lanes' loads 16 x V
// bytes apart, V wavefronts of L1 per vector of data).
__device__ __forceinline__ void bn_put_coef(const BnParams& p, long long c, float4 v) {
  p.coef[c] = v.x;
  p.coef[p.channels + c] = v.y;
  p.coef[2 * p.channels + c] = v.z;
  p.coef[3 * p.channels + c] = v.w;
}

__device__ __forceinline__ float4 bn_coef(const BnParams& p, long long c) {
  return make_float4(p.coef[c], p.coef[p.channels + c], p.coef[2 * p.channels + c],
                     p.coef[3 * p.channels + c]);
}

}  // namespace cupy_act
