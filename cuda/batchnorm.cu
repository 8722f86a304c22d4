// batchnorm.cu: BatchNorm (2-D, per-channel statistics over N x H x W) fused
// with an activation and its 1-bit mask.
//
//   training forward:  bn_reduce<T, CL, V, kStats>  partial sums of x and x^2 per (channel, split),
//                                                   then (NCHW: the channel's last block;
//                      bn_finalize<kStats>           channels-last: a warp per channel) mean,
//                                                   invstd, running statistics, coef
//                      bn_forward<T, CL, V, A>      y = act((x - mean) * invstd * w + b), mask
//   eval forward:      bn_finalize_eval (from the running statistics), bn_forward
//   backward:          bn_reduce<T, CL, V, kGrad, A>  partial sums of dz and dz * xhat, where
//                                                    dz = act'(mask) * dy, xhat = (x - mean) * invstd,
//                      (or bn_finalize<kGrad>)       then grad_bias = sum dz, grad_weight =
//                                                    sum dz * xhat, coef
//                      bn_backward<T, CL, V, A, Out> dx = (dz - mean(dz) - xhat * mean(dz xhat)) * invstd * w
//   synchronized (SyncBatchNorm, kSums): bn_reduce (and bn_finalize) write each channel's
//                      sums (and the count) instead of finishing; the host all-reduces them
//                      across processes; bn_finish_sums<P> then finishes every channel from
//                      the totals, and bn_forward / bn_backward run as above
//
// With a residual r (apex's bn_add_relu): y = act(bn(x) + r), the mask taken on
// bn(x) + r, and the backward also writes dr = dz.
//
// With a shortcut s (p.post; compiled graphs fold a block's `act(bn(x)) + s`
// into the op; never with a residual): out = act(bn(x)) + s, act's value
// rounded to T first and the sum taken as PyTorch's add takes it (float,
// rounded once, no flush), so the bits equal those of the op followed by the
// add. The mask is act's own: the backward is the op's, s's gradient being
// the output's.
//
// NCHW finishes each channel in the reduction's last block to arrive (a
// counter per channel in p.arrivals, zero before the launch and set back to
// zero by that block): two launches per pass instead of three. A
// channels-last tile holds up to 256 channels whose partial sums one block
// would read alone, so it keeps the separate finishing launch.
//
// From the output (kFromOutput, the in-place mode: the forward wrote y over x
// and the backward has only y): z = act^-1(y) (identity, or LeakyReLU with a
// positive slope: z = y / slope where y <= 0), the activation's bit is y > 0,
// and xhat = (z - b) / w inverts the affine transform. w = 0 loses xhat: that
// channel's grad_weight comes out NaN (its dx is 0, as it should be).
//
// Layout: CL = false is NCHW (channel of element i: (i / HW) % C), CL = true
// channels-last (i % C). V elements per thread and trip: 16 / sizeof(T) (one
// 16-byte vector; the host picks it where HW (NCHW) or C (channels-last) is a
// multiple of V and the pointers are 16-byte aligned, so a vector never
// straddles a channel boundary (NCHW) or holds V consecutive channels
// (channels-last)), else 1. Channels come from quot() (vectors.cuh), never a
// 64-bit division. The mask has bit i % 32 of word i / 32 for element i in
// memory order (elementwise.cu's format).
//
// Statistics accumulate in double and are reduced in a fixed order: the same
// inputs give the same bits on every run. Accuracy, not bit equality, with
// PyTorch's kernels (whose reduction order is theirs).
//
// Files: batchnorm_params.cuh (the parameter block, loads and stores, the
// activation's math, the per-channel constants), batchnorm_reduce.cuh (the
// reductions and the kernels that finish them per channel), and here the
// elementwise passes.
#include "batchnorm_reduce.cuh"

namespace cupy_act {

// Channels-last: the host sizes the elementwise grids so that each thread's
// vectors share one column of V channels (the grid's vectors per trip a
// multiple of C / V, or a single trip): a thread loads its V coefficients
// once, a plane at a time, 16 bytes per load (C is a multiple of V >= 4
// there, and the planes 16-byte aligned). Loaded per vector, they were V
// float4 loads whose lanes lie 16 x V bytes apart, and the L1 wavefronts, not
// DRAM, set the pass's speed; loaded once per thread as float4 per channel,
// they still did where a thread has one trip (a small layer: (32, 128, 32,
// 32) bfloat16 took 23 us against PyTorch's 7).
template <bool CL, int V>
__device__ __forceinline__ void bn_coefs(const BnParams& p, long long first, float4 (&q)[V]) {
  if constexpr (CL) {
    long long row;
    const long long c = bn_channel<true>(first, p, row);
    float f[4][V];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float* src = p.coef + k * p.channels + c;
      if constexpr (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
          const float4 t = *reinterpret_cast<const float4*>(src + j);
          f[k][j] = t.x;
          f[k][j + 1] = t.y;
          f[k][j + 2] = t.z;
          f[k][j + 3] = t.w;
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) f[k][j] = src[j];
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) q[j] = make_float4(f[0][j], f[1][j], f[2][j], f[3][j]);
  }
}

// Each warp takes 32 consecutive vectors per trip, kBnFwdUnroll trips at a
// time (their loads issued first: one load in flight per thread left the
// pass short of the copy bandwidth); the G = 32 / V lanes that share a mask
// word OR their V bits together (V = 1: one ballot).
constexpr int kBnFwdUnroll = 2;

template <typename T, bool CL, int V, int A>
__global__ void __launch_bounds__(kBnThreads) bn_forward(const BnParams p) {
  constexpr int G = 32 / V;
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * kBnThreads + threadIdx.x) >> 5;
  const long long warps = ((long long)gridDim.x * kBnThreads) >> 5;
  const long long vectors = p.n / V;
  const bool masked = A != kIdentity && p.mask != nullptr;
  // (a call has a residual or a shortcut, not both: they share the registers,
  // where a third set of loads in flight cost the bfloat16 pass occupancy)
  const void* extra = p.residual != nullptr ? p.residual : p.post;
  float4 q[V];
  bn_coefs<CL, V>(p, (warp * 32 + lane) * V, q);
  for (long long first = warp * 32; first < vectors; first += warps * 32 * kBnFwdUnroll) {
    BnRaw<T, V> x[kBnFwdUnroll], res[kBnFwdUnroll];  // res: the residual or the shortcut
#pragma unroll
    for (int u = 0; u < kBnFwdUnroll; ++u) {
      const long long k = first + u * warps * 32 + lane;
      if (k < vectors) {
        bn_load_raw<T, V>(p.x, k * V, x[u]);
        if (extra != nullptr) bn_load_raw<T, V>(extra, k * V, res[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBnFwdUnroll; ++u) {
      const long long base = first + u * warps * 32;
      if (base >= vectors) break;  // (the same for the whole warp)
      const long long k = base + lane;
      u32 bits = 0;
      if (k < vectors) {
        const long long i = k * V;
        if (!CL) {
          long long img;
          q[0] = bn_coef(p, bn_channel<false>(i, p, img));
        }
        float v[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float4& c = q[CL ? j : 0];
          float t = (Num<T>::to_op(x[u].e[j]) - c.x) * c.y + c.z;
          if (p.residual != nullptr) t += Num<T>::to_op(res[u].e[j]);  // (not + 0: -0 stays -0)
          bits |= (u32)bn_bit<A>(t) << j;
          v[j] = bn_act<A>(t, p.slope);
          if (p.post != nullptr)
            v[j] = add_rn(Num<T>::to_op(Num<T>::from_op(v[j])), Num<T>::to_op(res[u].e[j]));
        }
        bn_store<T, V>(p.y, i, v);
      }
      if (masked) {
        if constexpr (V == 1) {
          const u32 word = __ballot_sync(0xffffffffu, bits);
          if (lane == 0) p.mask[base >> 5] = word;
        } else {
          bits <<= (lane % G) * V;
#pragma unroll
          for (int o = 1; o < G; o *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
          if (lane % G == 0 && k < vectors) p.mask[k / G] = bits;
        }
      }
    }
  }
}

template <typename T, bool CL, int V, int A, bool Out>
__global__ void __launch_bounds__(kBnThreads) bn_backward(const BnParams p) {
  const long long vectors = p.n / V;
  const long long stride = (long long)gridDim.x * kBnThreads;
  const bool eval = p.flags & kEval;
  const long long first = (long long)blockIdx.x * kBnThreads + threadIdx.x;
  const float inv_slope = __frcp_rn(p.slope);
  float4 q[V];
  bn_coefs<CL, V>(p, first * V, q);
  for (long long k = first; k < vectors; k += stride) {
    const long long i = k * V;
    long long outer = 0;
    if (!CL)
      q[0] = bn_coef(p, bn_channel<false>(i, p, outer));
    else if (p.dy_skip != 0)
      outer = quot(i, p.channels, p.inv_channels);
    float v[V], d[V], r[V] = {};
    bn_load<T, V>(p.x, i, v);
    bn_load<T, V>(p.dy, i + outer * p.dy_skip, d);
    if (Out && p.residual != nullptr) bn_load<T, V>(p.residual, i, r);
    const u32 bits = Out ? 0u : bn_bits<A>(p, i);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4& c = q[CL ? j : 0];
      bool bit = (bits >> j) & 1u;
      float z = v[j];
      if (Out) {
        bit = A == kIdentity || z > 0.f;
        z = bn_unact<A>(z, inv_slope) - r[j];
      }
      const float dz = bn_act_grad<A>(d[j], bit, p.slope);
      d[j] = dz;
      // (eval: dz * k alone, so an inf input does not make 0 * inf = NaN)
      v[j] = eval ? dz * c.y : dz * c.y - (z - c.x) * c.z - c.w;
    }
    bn_store<T, V>(p.y, i, v);
    if (p.grad_residual != nullptr) bn_store<T, V>(p.grad_residual, i, d);
  }
}

}  // namespace cupy_act
