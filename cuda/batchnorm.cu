// batchnorm.cu: training BatchNorm (2-D, per-channel statistics over N x H x W)
// fused with an activation and its 1-bit mask.
//
//   forward:  bn_reduce<T, CL, kStats>   partial sums of x and x^2 per (channel, split)
//             bn_finalize_stats          mean, invstd, running statistics per channel
//             bn_forward<T, CL, A>       y = act((x - mean) * invstd * w + b), mask
//   backward: bn_reduce<T, CL, kGrad, A> partial sums of dz and dz * xhat, where
//                                        dz = act'(mask) * dy, xhat = (x - mean) * invstd
//             bn_finalize_grad           grad_bias = sum dz, grad_weight = sum dz * xhat
//             bn_backward<T, CL, A>      dx = (dz - mean(dz) - xhat * mean(dz xhat)) * invstd * w
//
// Layout: CL = false is NCHW (channel of element i: (i / HW) % C), CL = true
// channels-last (i % C). The mask has bit i % 32 of word i / 32 for element i
// in memory order. Statistics accumulate in double (one pass, no cancellation
// worth the name at float32 inputs) and are reduced in a fixed order: the
// same inputs give the same bits on every run. Accuracy, not bit equality,
// with PyTorch's kernels (whose reduction order is theirs).
#include "numerics.cuh"

namespace cupy_act {

constexpr int kBnThreads = 256;
enum BnAct { kIdentity = 0, kRelu = 1, kLeaky = 2 };
enum BnPass { kStats = 0, kGrad = 1 };

struct BnParams {
  const void* x;          // input of the forward
  const void* dy;         // backward: upstream gradient
  void* y;                // forward: y; backward: dx
  u32* mask;              // 1 bit per element (null for the identity)
  const float* weight;    // [C] or null (1)
  const float* bias;      // [C] or null (0)
  float* mean;            // [C] batch mean (written forward, read backward)
  float* invstd;          // [C] 1 / sqrt(biased var + eps)
  double* partial;        // [C][splits][2]
  float* running_mean;    // [C] or null
  float* running_var;     // [C] or null
  float* grad_weight;     // [C] or null
  float* grad_bias;       // [C] or null
  float* coef;            // [C][2]: mean(dz), mean(dz * xhat)
  long long n;            // elements
  long long inner;        // H x W
  long long channels;
  long long splits;       // partial sums per channel
  double momentum;        // the running statistics' factor (PyTorch's exponential_average_factor)
  double eps;
  float slope;            // LeakyReLU's negative slope
  int pad;
};

template <typename T>
__device__ __forceinline__ float bn_load(const void* p, long long i) {
  return Num<T>::to_op(static_cast<const T*>(p)[i]);
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

__device__ __forceinline__ bool bn_mask_bit(const u32* mask, long long i) {
  return (mask[i >> 5] >> (i & 31)) & 1u;
}

// Element offset of the j-th element of channel c (j over N x HW).
template <bool CL>
__device__ __forceinline__ long long bn_offset(long long j, long long c, const BnParams& p) {
  if (CL) return j * p.channels + c;
  const long long img = j / p.inner;
  return (img * p.channels + c) * p.inner + (j - img * p.inner);
}

// One (channel block, split) per block. NCHW: blockIdx.y is the channel, the
// block's threads walk its elements. Channels-last: 32 channels per block
// (threadIdx.x % 32), 8 rows at a time (threadIdx.x / 32), so a warp reads 32
// neighbouring channels of one row. Partial sums are reduced in shared memory
// in a fixed order.
template <typename T, bool CL, int P, int A>
__global__ void __launch_bounds__(kBnThreads) bn_reduce(const BnParams p) {
  __shared__ double s1[kBnThreads], s2[kBnThreads];
  const long long per_channel = p.n / p.channels;
  const int lanes = CL ? 32 : kBnThreads;  // threads across channels' elements
  const int rows = kBnThreads / lanes;
  const long long c = CL ? (long long)blockIdx.y * 32 + (threadIdx.x % 32) : blockIdx.y;
  const int r = CL ? threadIdx.x / 32 : threadIdx.x;
  const int step_threads = CL ? rows : kBnThreads;
  double a = 0.0, b = 0.0;
  if (c < p.channels) {
    float mean = 0.f, invstd = 0.f;
    if (P == kGrad) mean = p.mean[c], invstd = p.invstd[c];
    const long long stride = (long long)step_threads * gridDim.x;
    for (long long j = (long long)blockIdx.x * step_threads + r; j < per_channel; j += stride) {
      const long long i = bn_offset<CL>(j, c, p);
      const float x = bn_load<T>(p.x, i);
      if (P == kStats) {
        a += x;
        b += (double)x * x;
      } else {
        const bool bit = A == kIdentity ? true : bn_mask_bit(p.mask, i);
        const float dz = bn_act_grad<A>(bn_load<T>(p.dy, i), bit, p.slope);
        const float xhat = (x - mean) * invstd;
        a += dz;
        b += (double)dz * xhat;
      }
    }
  }
  s1[threadIdx.x] = a;
  s2[threadIdx.x] = b;
  __syncthreads();
  // tree over the row index (CL) or over all threads (NCHW), fixed order
  const int span = CL ? rows : kBnThreads;
  for (int h = span / 2; h > 0; h /= 2) {
    const int rr = CL ? threadIdx.x / 32 : threadIdx.x;
    if (rr < h) {
      const int other = threadIdx.x + (CL ? h * 32 : h);
      s1[threadIdx.x] += s1[other];
      s2[threadIdx.x] += s2[other];
    }
    __syncthreads();
  }
  if ((CL ? threadIdx.x < 32 : threadIdx.x == 0) && c < p.channels) {
    double* out = p.partial + (c * p.splits + blockIdx.x) * 2;
    out[0] = s1[threadIdx.x];
    out[1] = s2[threadIdx.x];
  }
}

// Per channel, one thread: the splits' partial sums in order.
__device__ __forceinline__ void bn_sum_partials(const BnParams& p, long long c, double& a,
                                                double& b) {
  a = 0.0;
  b = 0.0;
  for (long long s = 0; s < p.splits; ++s) {
    a += p.partial[(c * p.splits + s) * 2];
    b += p.partial[(c * p.splits + s) * 2 + 1];
  }
}

__global__ void bn_finalize_stats(const BnParams p) {
  const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  double sum, sumsq;
  bn_sum_partials(p, c, sum, sumsq);
  const double count = (double)(p.n / p.channels);
  const double mean = sum / count;
  double var = sumsq / count - mean * mean;  // biased: what normalizes
  if (var < 0.0) var = 0.0;
  p.mean[c] = (float)mean;
  p.invstd[c] = (float)(1.0 / sqrt(var + p.eps));
  if (p.running_mean != nullptr) {
    const double m = p.momentum;
    p.running_mean[c] = (float)((1.0 - m) * p.running_mean[c] + m * mean);
    // unbiased, as PyTorch keeps it (callers refuse a single value per channel)
    p.running_var[c] = (float)((1.0 - m) * p.running_var[c] + m * var * count / (count - 1.0));
  }
}

__global__ void bn_finalize_grad(const BnParams p) {
  const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  double sum_dz, sum_dzx;
  bn_sum_partials(p, c, sum_dz, sum_dzx);
  const double count = (double)(p.n / p.channels);
  if (p.grad_bias != nullptr) p.grad_bias[c] = (float)sum_dz;
  if (p.grad_weight != nullptr) p.grad_weight[c] = (float)sum_dzx;
  p.coef[2 * c] = (float)(sum_dz / count);
  p.coef[2 * c + 1] = (float)(sum_dzx / count);
}

template <bool CL>
__device__ __forceinline__ long long bn_channel(long long i, const BnParams& p) {
  return CL ? i % p.channels : (i / p.inner) % p.channels;
}

// Each warp takes 32 consecutive elements per trip: one ballot is one mask word.
template <typename T, bool CL, int A>
__global__ void __launch_bounds__(kBnThreads) bn_forward(const BnParams p) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * kBnThreads + threadIdx.x) >> 5;
  const long long warps = ((long long)gridDim.x * kBnThreads) >> 5;
  for (long long base = warp * 32; base < p.n; base += warps * 32) {
    const long long i = base + lane;
    bool bit = false;
    if (i < p.n) {
      const long long c = bn_channel<CL>(i, p);
      const float w = p.weight != nullptr ? p.weight[c] : 1.f;
      const float b = p.bias != nullptr ? p.bias[c] : 0.f;
      const float t = (bn_load<T>(p.x, i) - p.mean[c]) * p.invstd[c] * w + b;
      bit = bn_bit<A>(t);
      static_cast<T*>(p.y)[i] = Num<T>::from_op(bn_act<A>(t, p.slope));
    }
    if (A != kIdentity) {
      const u32 word = __ballot_sync(0xffffffffu, bit);
      if (lane == 0) p.mask[base >> 5] = word;
    }
  }
}

template <typename T, bool CL, int A>
__global__ void __launch_bounds__(kBnThreads) bn_backward(const BnParams p) {
  const long long start = (long long)blockIdx.x * kBnThreads + threadIdx.x;
  const long long stride = (long long)gridDim.x * kBnThreads;
  for (long long i = start; i < p.n; i += stride) {
    const long long c = bn_channel<CL>(i, p);
    const bool bit = A == kIdentity ? true : bn_mask_bit(p.mask, i);
    const float dz = bn_act_grad<A>(bn_load<T>(p.dy, i), bit, p.slope);
    const float invstd = p.invstd[c];
    const float xhat = (bn_load<T>(p.x, i) - p.mean[c]) * invstd;
    const float w = p.weight != nullptr ? p.weight[c] : 1.f;
    const float dx = (dz - p.coef[2 * c] - xhat * p.coef[2 * c + 1]) * invstd * w;
    static_cast<T*>(p.y)[i] = Num<T>::from_op(dx);
  }
}

}  // namespace cupy_act
