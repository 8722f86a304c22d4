// batchnorm_reduce.cuh: the BatchNorm reductions (the statistics' sums of x
// and x^2, the gradients' sums of dz and dz * xhat) and the kernels that
// finish them per channel (statistics, running statistics, gradients and
// the elementwise passes' coefficients). batchnorm.cu's header says how.
#pragma once

#include "batchnorm_params.cuh"

namespace cupy_act {

// The reduction's value pair for one element: x and x^2 (kStats), or dz and
// dz * xhat, with xhat = (v - ctr) * scl (kGrad: v = x, ctr = mean, scl =
// invstd; kGradFromOutput: v = act^-1(y) - r, r the residual or 0, ctr = b,
// scl = 1 / w).
template <int P, int A, typename Acc>
__device__ __forceinline__ void bn_term(float v, float dy, bool bit, float r, float ctr,
                                        float scl, float slope, float inv_slope, Acc& a,
                                        Acc& b) {
  if (P == kStats) {
    a += v;
    b += (Acc)v * v;
    return;
  }
  if (P == kGradFromOutput) {
    bit = A == kIdentity || v > 0.f;
    v = bn_unact<A>(v, inv_slope) - r;
  }
  const float dz = bn_act_grad<A>(dy, bit, slope);
  a += dz;
  b += (Acc)(dz * ((v - ctr) * scl));
}

template <int P>
__device__ __forceinline__ void bn_center(const BnParams& p, long long c, float& ctr, float& scl) {
  ctr = scl = 0.f;
  if (P == kGrad) {
    ctr = p.mean[c];
    scl = p.invstd[c];
  } else if (P == kGradFromOutput) {
    ctr = p.bias != nullptr ? p.bias[c] : 0.f;
    scl = 1.f / (p.weight != nullptr ? p.weight[c] : 1.f);
  }
}

// One vector of each input as loaded (16 bytes, or one element): the
// reductions load several before summing any, so that their loads are in
// flight together.
template <typename T, int V>
union BnRaw {
  Raw16 raw;
  T e[V];
};

template <typename T, int V>
struct BnIn {
  BnRaw<T, V> x, dy, r;
  u32 bits;
};

template <typename T, int V>
__device__ __forceinline__ void bn_load_raw(const void* p, long long i, BnRaw<T, V>& out) {
  if constexpr (V == 1)
    out.e[0] = static_cast<const T*>(p)[i];
  else
    out.raw = load16(static_cast<const T*>(p) + i);
}

// What pass P reads of the vector at element i of x (dyi of dy).
template <typename T, int V, int P, int A>
__device__ __forceinline__ void bn_fetch(const BnParams& p, long long i, long long dyi,
                                         BnIn<T, V>& in) {
  bn_load_raw<T, V>(p.x, i, in.x);
  in.bits = ~0u;
  if (P != kStats) bn_load_raw<T, V>(p.dy, dyi, in.dy);
  if (P == kGrad) in.bits = bn_bits<A>(p, i);
  if (P == kGradFromOutput && p.residual != nullptr) bn_load_raw<T, V>(p.residual, i, in.r);
}

// A fetched vector's V elements into the accumulators (a, b: one pair per
// element's channel, or all into [0] when the vector is one channel's).
template <typename T, int V, int P, int A, int K, typename Acc>
__device__ __forceinline__ void bn_add(const BnParams& p, const BnIn<T, V>& in,
                                       const float (&ctr)[K], const float (&scl)[K],
                                       Acc (&a)[K], Acc (&b)[K]) {
  const bool residual = P == kGradFromOutput && p.residual != nullptr;
  const float inv_slope = __frcp_rn(p.slope);  // (loop-invariant: a kernel parameter's)
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int k = K == 1 ? 0 : j;
    const float v = Num<T>::to_op(in.x.e[j]);
    const float d = P == kStats ? 0.f : Num<T>::to_op(in.dy.e[j]);
    const float r = residual ? Num<T>::to_op(in.r.e[j]) : 0.f;
    bn_term<P, A, Acc>(v, d, (in.bits >> j) & 1u, r, ctr[k], scl[k], p.slope, inv_slope, a[k],
                       b[k]);
  }
}

// U fetched vectors into the double accumulators. The statistics add term by
// term in double (x^2 is exact there, and E[x^2] - mean^2 cancels). A
// gradient pass's terms are rounded float values already (dz, and dz * xhat):
// they are summed in float over the U vectors (over the vector's V elements,
// NCHW), then added once in double, one float-to-double conversion and one
// double addition per U (V) terms where each term took one of each. The
// float sum adds at most U - 1 (V - 1) roundings of the size the terms
// carry. The bfloat16 gradient sums fell from 61.8 to 50.2 us at (32, 64,
// 128, 128) channels-last, in place (H200, 2026-11-29; docs/batchnorm.md).
template <typename T, int V, int P, int A, int K, int U>
__device__ __forceinline__ void bn_add_all(const BnParams& p, const BnIn<T, V> (&in)[U],
                                           const float (&ctr)[K], const float (&scl)[K],
                                           double (&a)[K], double (&b)[K]) {
  if constexpr (P == kStats) {
#pragma unroll
    for (int u = 0; u < U; ++u) bn_add<T, V, P, A, K, double>(p, in[u], ctr, scl, a, b);
  } else {
    float fa[K], fb[K];
#pragma unroll
    for (int k = 0; k < K; ++k) fa[k] = fb[k] = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) bn_add<T, V, P, A, K, float>(p, in[u], ctr, scl, fa, fb);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      a[k] += fa[k];
      b[k] += fb[k];
    }
  }
}

// The block's (a, b) pairs summed into s1[0], s2[0]: a fixed-order tree.
__device__ __forceinline__ void bn_block_sum(double* s1, double* s2, double a, double b) {
  s1[threadIdx.x] = a;
  s2[threadIdx.x] = b;
  __syncthreads();
  for (int h = kBnThreads / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) {
      s1[threadIdx.x] += s1[threadIdx.x + h];
      s2[threadIdx.x] += s2[threadIdx.x + h];
    }
    __syncthreads();
  }
}

// Channel c's partial sums: thread t takes splits t, t + 256, ... in order,
// then a fixed-order tree; the totals land in thread 0 (with thousands of
// splits, one thread's dependent loads would take longer than the reduction
// itself). Loads from L2 (__ldcg): other blocks of the same launch may have
// written them.
__device__ __forceinline__ void bn_sum_partials(const BnParams& p, long long c, double* s1,
                                                double* s2, double& a, double& b) {
  a = 0.0;
  b = 0.0;
  for (long long s = threadIdx.x; s < p.splits; s += kBnThreads) {
    a += __ldcg(p.partial + (c * p.splits + s) * 2);
    b += __ldcg(p.partial + (c * p.splits + s) * 2 + 1);
  }
  bn_block_sum(s1, s2, a, b);
  a = s1[0];
  b = s2[0];
}
// mean and invstd of channel c, and coef = (mean, invstd * w, b) for bn_forward.
__device__ __forceinline__ void bn_set_stats(const BnParams& p, long long c, double mean,
                                             double var) {
  const float invstd = (float)(1.0 / sqrt(var + p.eps));
  p.mean[c] = (float)mean;
  p.invstd[c] = invstd;
  // (an odd channel count leaves 8 bytes before the moments: zeroed, so that
  // every byte of the statistics is the call's)
  if (c == 0 && (p.channels & 1) && p.moments != nullptr) {
    p.invstd[p.channels] = 0.f;
    p.invstd[p.channels + 1] = 0.f;
  }
  bn_put_coef(p, c, make_float4((float)mean, invstd * bn_weight(p, c), bn_bias(p, c), 0.f));
}

// Channel c's running statistics from the batch's mean and biased variance
// (PyTorch's rules: momentum average, unbiased variance; callers refuse a
// single value per channel). The compiled op passes the module's buffers
// here too (batchnorm_act's update_mean and update_var).
__device__ __forceinline__ void bn_running(const BnParams& p, long long c, double mean,
                                           double var, double count) {
  const double m = p.momentum;
  p.running_mean[c] = (float)((1.0 - m) * p.running_mean[c] + m * mean);
  p.running_var[c] = (float)((1.0 - m) * p.running_var[c] + m * var * count / (count - 1.0));
}

// Values per channel in this launch's x (a synchronized finish, bn_finish_sums,
// takes the group's count from the totals instead).
__device__ __forceinline__ double bn_count(const BnParams& p) {
  return (double)(p.n / p.channels);
}

// After the moments: the count they were taken over (a synchronized backward
// reads the group's there) and a pad, zeroed: every byte of the statistics is the call's.
__device__ __forceinline__ void bn_set_count(const BnParams& p, long long c, double count) {
  if (c == 0) {
    p.moments[2 * p.channels] = count;
    p.moments[2 * p.channels + 1] = 0.0;
  }
}

// One thread: channel c's statistics from its sums over count values, and the
// running statistics' update.
__device__ __forceinline__ void bn_finish_stats(const BnParams& p, long long c, double sum,
                                                double sumsq, double count) {
  if (p.num_batches != nullptr && c == 0) *p.num_batches += 1;
  const double mean = sum / count;
  double var = sumsq / count - mean * mean;  // biased: what normalizes
  if (var < 0.0) var = 0.0;
  if (p.running_mean != nullptr) bn_running(p, c, mean, var, count);
  if (p.moments != nullptr) {
    p.moments[2 * c] = mean;
    p.moments[2 * c + 1] = var;
    bn_set_count(p, c, count);
  }
  bn_set_stats(p, c, mean, var);
}

// One thread: grad_bias = sum dz, grad_weight = sum dz * xhat, and coef = (ctr,
// k, g, h) for bn_backward's dx = k * dz - (v - ctr) * g - h, with k = invstd * w and
//   from x:      ctr = mean, g = invstd * mean(dz xhat) * k, h = mean(dz) * k
//   from output: ctr = b,    g = invstd * mean(dz xhat),     h = mean(dz) * k
// (xhat = (v - ctr) * invstd, or (v - ctr) / w); kEval: g = h = 0, the running
// statistics being constants.
__device__ __forceinline__ void bn_finish_grad(const BnParams& p, long long c, double sum_dz,
                                               double sum_dzx, double count) {
  if (p.grad_bias != nullptr) p.grad_bias[c] = (float)sum_dz;
  if (p.grad_weight != nullptr) p.grad_weight[c] = (float)sum_dzx;
  const bool out = p.flags & kFromOutput;
  const double invstd = p.invstd[c], k = invstd * bn_weight(p, c);
  const float ctr = out ? bn_bias(p, c) : p.mean[c];
  double g = 0.0, h = 0.0;
  // (w = 0 from the output: xhat is lost and sum dz * xhat NaN, but dx = k * (...)
  // is 0; g = 0 keeps it so)
  if (!(p.flags & kEval) && !(out && k == 0.0)) {
    g = invstd * (sum_dzx / count) * (out ? 1.0 : k);
    h = (sum_dz / count) * k;
  }
  bn_put_coef(p, c, make_float4(ctr, (float)k, (float)g, (float)h));
}

// kSums (one process of a synchronized BatchNorm): channel c's local sums into
// p.moments, for the host to all-reduce; the forward adds the count (values
// per channel here), the backward writes grad_bias and grad_weight from the
// local sums, as PyTorch's SyncBatchNorm does (data parallelism averages them).
template <int P>
__device__ __forceinline__ void bn_local_sums(const BnParams& p, long long c, double a, double b) {
  p.moments[2 * c] = a;
  p.moments[2 * c + 1] = b;
  if (P == kStats) {
    if (c == 0) p.moments[2 * p.channels] = bn_count(p);
  } else {
    if (p.grad_bias != nullptr) p.grad_bias[c] = (float)a;
    if (p.grad_weight != nullptr) p.grad_weight[c] = (float)b;
  }
}

// Channel c's statistics (kStats) or gradients from its sums a, b, or
// (kSums) its local sums: one thread.
template <int P>
__device__ __forceinline__ void bn_finish_sums_of(const BnParams& p, long long c, double a,
                                                  double b) {
  if (p.flags & kSums)
    bn_local_sums<P>(p, c, a, b);
  else if (P == kStats)
    bn_finish_stats(p, c, a, b, bn_count(p));
  else
    bn_finish_grad(p, c, a, b, bn_count(p));
}

// The block: channel c's partial sums, then its statistics (kStats) or
// gradients, or (kSums) its local sums.
template <int P>
__device__ __forceinline__ void bn_finish(const BnParams& p, long long c, double* s1, double* s2) {
  double a, b;
  bn_sum_partials(p, c, s1, s2, a, b);
  if (threadIdx.x == 0) bn_finish_sums_of<P>(p, c, a, b);
}

// NCHW: block (split, channel); the block's threads walk the channel's N planes
// a vector at a time, then one fixed-order tree.
template <typename T, int V, int P, int A>
__device__ __forceinline__ void bn_reduce_planes(const BnParams& p) {
  __shared__ double s1[kBnThreads], s2[kBnThreads];
  const long long c = blockIdx.y;
  float ctr[1], scl[1];
  bn_center<P>(p, c, ctr[0], scl[0]);
  double a[1] = {0.0}, b[1] = {0.0};
  const long long vectors = p.n / p.channels / V;
  const long long stride = (long long)gridDim.x * kBnThreads;
  for (long long k = (long long)blockIdx.x * kBnThreads + threadIdx.x; k < vectors; k += stride) {
    const long long j = k * V;
    const long long img = quot(j, p.inner, p.inv_inner);
    const long long i = (img * p.channels + c) * p.inner + (j - img * p.inner);
    BnIn<T, V> in[1];
    bn_fetch<T, V, P, A>(p, i, i + img * p.dy_skip, in[0]);
    bn_add_all<T, V, P, A, 1, 1>(p, in, ctr, scl, a, b);
  }
  bn_block_sum(s1, s2, a[0], b[0]);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    double* out = p.partial + (c * p.splits + blockIdx.x) * 2;
    out[0] = s1[0];
    out[1] = s2[0];
    __threadfence();  // (the sums visible before the arrival)
    last = atomicAdd(p.arrivals + c, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) p.arrivals[c] = 0u;  // (for the next reduction on the stream)
  bn_finish<P == kStats ? kStats : kGrad>(p, c, s1, s2);
}

// Channels-last: a block holds a tile of W = min(C / V, 32) vector columns
// (V consecutive channels each, blockIdx.y the tile) by R = 256 / W rows, so
// a warp reads whole stretches of rows; its threads walk rows split by split,
// U rows at a time (4 in the statistics, 2 in the gradients, which read two
// arrays), their loads issued before any is summed: the host launches one
// wave of blocks at the kernel's occupancy, each a long walk, where short
// blocks with one load in flight per thread left the memory system idle
// (half of the copy bandwidth in bfloat16). Then a fixed-order tree over the
// R rows, one channel of the vector at a time (4 KB of shared memory; it
// was 32 KB, which held the occupancy down).
template <typename T, int V, int P, int A>
__device__ __forceinline__ void bn_reduce_rows(const BnParams& p) {
  __shared__ double s1[kBnThreads], s2[kBnThreads];
  const long long cols = p.channels / V;
  const int w = (int)(cols < 32 ? cols : 32);
  const int rows_per_block = kBnThreads / w;
  const int tc = threadIdx.x % w, tr = threadIdx.x / w;
  const long long col = (long long)blockIdx.y * w + tc;
  const bool active = tr < rows_per_block && col < cols;
  double a[V], b[V];
  float ctr[V], scl[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    a[j] = b[j] = 0.0;
    if (active) bn_center<P>(p, col * V + j, ctr[j], scl[j]);
  }
  constexpr int kBnUnroll = P == kStats ? 4 : 2;  // (the gradients load two arrays)
  if (active) {
    const long long rows = p.n / p.channels;
    const long long stride = (long long)gridDim.x * rows_per_block;
    long long r = (long long)blockIdx.x * rows_per_block + tr;
    for (; r + (kBnUnroll - 1) * stride < rows; r += kBnUnroll * stride) {
      BnIn<T, V> in[kBnUnroll];
#pragma unroll
      for (int u = 0; u < kBnUnroll; ++u) {
        const long long ru = r + u * stride, i = ru * p.channels + col * V;
        bn_fetch<T, V, P, A>(p, i, i + ru * p.dy_skip, in[u]);
      }
      bn_add_all<T, V, P, A, V, kBnUnroll>(p, in, ctr, scl, a, b);
    }
    for (; r < rows; r += stride) {
      const long long i = r * p.channels + col * V;
      BnIn<T, V> in[1];
      bn_fetch<T, V, P, A>(p, i, i + r * p.dy_skip, in[0]);
      bn_add_all<T, V, P, A, V, 1>(p, in, ctr, scl, a, b);
    }
  }
  int top = 1;
  while (top < rows_per_block) top *= 2;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s1[threadIdx.x] = a[j];
    s2[threadIdx.x] = b[j];
    __syncthreads();
    for (int h = top / 2; h > 0; h /= 2) {
      if (tr < h && tr + h < rows_per_block && col < cols) {
        s1[threadIdx.x] += s1[threadIdx.x + h * w];
        s2[threadIdx.x] += s2[threadIdx.x + h * w];
      }
      __syncthreads();
    }
    if (tr == 0 && col < cols) {
      double* out = p.partial + ((col * V + j) * p.splits + blockIdx.x) * 2;
      out[0] = s1[threadIdx.x];
      out[1] = s2[threadIdx.x];
    }
    __syncthreads();  // (s1, s2 read before the next channel's values overwrite them)
  }
}

template <typename T, bool CL, int V, int P, int A>
__global__ void __launch_bounds__(kBnThreads) bn_reduce(const BnParams p) {
  if constexpr (CL)
    bn_reduce_rows<T, V, P, A>(p);
  else
    bn_reduce_planes<T, V, P, A>(p);
}

// Channels-last reductions: a warp per channel (kBnThreads / 32 channels a
// block). Lane l sums splits l, l + 32, ... in order (one-wave grids leave a
// few hundred splits per channel), then a fixed-order shuffle tree; lane 0
// finishes. A block per channel, with its shared-memory tree and a barrier
// per level, took 3-7 us per launch where the reduction before it took 5-8
// (H200, 2026-11-29): (32, 1024, 8, 8) float32 6.6 us.
constexpr int kBnWarps = kBnThreads / 32;

template <int P>
__global__ void __launch_bounds__(kBnThreads) bn_finalize(const BnParams p) {
  const long long c = (long long)blockIdx.x * kBnWarps + threadIdx.x / 32;
  if (c >= p.channels) return;  // (whole warps)
  const int lane = threadIdx.x & 31;
  const double* part = p.partial + c * p.splits * 2;
  double a = 0.0, b = 0.0;
#pragma unroll 4
  for (long long s = lane; s < p.splits; s += 32) {
    a += __ldcg(part + 2 * s);
    b += __ldcg(part + 2 * s + 1);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  if (lane == 0) bn_finish_sums_of<P>(p, c, a, b);
}

// Eval: a thread per channel, from the running statistics.
__global__ void __launch_bounds__(kBnThreads) bn_finalize_eval(const BnParams p) {
  const long long c = (long long)blockIdx.x * kBnThreads + threadIdx.x;
  if (c >= p.channels) return;
  bn_set_stats(p, c, p.running_mean[c], p.running_var[c]);
  if (p.moments != nullptr) {  // (the statistics used, for the compiled op's output)
    p.moments[2 * c] = p.running_mean[c];
    p.moments[2 * c + 1] = p.running_var[c];
    bn_set_count(p, c, bn_count(p));
  }
}

// Synchronized: every channel finished from the process group's totals in
// p.partial ([C][2], all-reduced kSums output), a thread per channel. kStats:
// the count is the totals' [2C], kept after the moments (bn_set_count) for
// the backward, whose count it is (kGrad); grad_bias and grad_weight came
// from the local sums (p.grad_* null here).
template <int P>
__global__ void __launch_bounds__(kBnThreads) bn_finish_sums(const BnParams p) {
  const long long c = (long long)blockIdx.x * kBnThreads + threadIdx.x;
  if (c >= p.channels) return;
  const double a = p.partial[2 * c], b = p.partial[2 * c + 1];
  if (P == kStats) {
    bn_finish_stats(p, c, a, b, p.partial[2 * p.channels]);
  } else {
    bn_finish_grad(p, c, a, b, p.moments[2 * p.channels]);
  }
}

}  // namespace cupy_act
