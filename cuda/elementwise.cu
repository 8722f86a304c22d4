// elementwise.cu: the one generic kernel behind every op and kind.
//
//   act_kernel<Op, FORWARD, bias, U>       y = op(x)
//   act_kernel<Op, FORWARD_MASK, bias, U>  y = op(x) and the mask, in one pass
//   act_kernel<Op, BACKWARD, false, U>     dx = op'(dy, mask); x is never read
// With bias, x + bias[channel] (rounded to T) is what the op sees.
//
// Mask format: bit (i % 32) of 32-bit word (i / 32) holds element i's bit, so
// byte k, bit b (least significant first) is element 8k + b: the order of
// numpy.packbits(bits, bitorder="little"). The buffer holds ceil(n / 8) bytes
// rounded up to a multiple of 16; every bit past n is written as 0.
//
// Work split: each warp walks a grid-stride loop over tiles of kUnroll
// warp-wide 16-byte vectors; lane l of the warp holds elements [l*V, l*V + V) of
// each vector (V = 16 / sizeof(T)), so loads and stores are coalesced 16-byte
// accesses and a warp's vector covers exactly V whole mask words. With a mask,
// the G = 32 / V lanes that share a word OR their pieces together with
// shuffles, and the tile's kUnroll * V words leave in one store instruction
// (32 contiguous bytes for float32 with kUnroll = 2). What the tiles leave
// (the tail, or everything when x or y is not 16-byte aligned) is done a
// warp-sized group of 32 elements at a time, one element per lane, where a
// ballot forms each mask word. Indices are 64-bit throughout.
#include "numerics.cuh"
#include "params.cuh"
#include "vectors.cuh"
#include "activations.cuh"

namespace cupy_act {

enum Kind { FORWARD = 0, FORWARD_MASK = 1, BACKWARD = 2 };

// Block size and the streaming switch, set by cupy_act/_loader.py through -D
// options (the defaults here are the same values). The vectors per thread
// (kUnroll) differ per op, kind and dtype and are a template argument, taken
// from cupy_act/_registry.py; scripts/tune.py measured them on an H200.
#ifndef CUPY_ACT_THREADS
#define CUPY_ACT_THREADS 128
#endif
// (CUPY_ACT_STREAMING: vectors.cuh.)
constexpr int kThreads = CUPY_ACT_THREADS;  // threads per block

// The channel of element i: (i / inner) % channels.
__device__ __forceinline__ long long channel_of(long long i, const Params& p) {
  const long long q = quot(i, p.inner, p.inv_inner);
  return q - quot(q, p.channels, p.inv_channels) * p.channels;
}

// How the V biases of one aligned vector (first index i, i % V == 0) are found:
//   kSharedChannel  inner % V == 0: all V elements are in channel c (NCHW)
//   kChannelRun     inner == 1, channels % V == 0: channels c .. c + V - 1, one
//                   16-byte load (channels-last)
//   kPerElement     otherwise: element by element from i's channel and offset
// Everything is recomputed per vector from the kernel parameters (which live
// in constant memory), so no per-thread cursor holds registers: with one
// 16-byte vector per thread, staying at 32 registers keeps full occupancy.
enum BiasMode { kSharedChannel, kChannelRun, kPerElement };

template <typename T>
__device__ __forceinline__ Pack<T> vector_bias(const T* bias, long long i, int mode,
                                               const Params& p) {
  constexpr int V = 16 / sizeof(T);
  Pack<T> b;
  if (mode == kChannelRun) {
    b.raw = load16(bias + (i - quot(i, p.channels, p.inv_channels) * p.channels));
  } else if (mode == kSharedChannel) {
    const T v = bias[channel_of(i, p)];
#pragma unroll
    for (int j = 0; j < V; ++j) b.e[j] = v;
  } else {
    const long long q = quot(i, p.inner, p.inv_inner);
    long long r = i - q * p.inner;
    long long c = q - quot(q, p.channels, p.inv_channels) * p.channels;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      b.e[j] = bias[c];
      if (++r == p.inner) {
        r = 0;
        if (++c == p.channels) c = 0;
      }
    }
  }
  return b;
}

// kUnroll: 16-byte vectors per thread and trip; with a mask, at most G = 32 / V,
// so that a tile's mask words fit one warp-wide store.
template <class Op, int K, bool HasBias, int kUnroll>
__global__ void __launch_bounds__(kThreads) act_kernel(const Params p) {
  typedef typename Op::T T;
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int G = 32 / V;          // lanes whose bits share a mask word
  static_assert(K != FORWARD_MASK || kUnroll <= G, "a tile's mask words must fit one store");
  constexpr long long kStep = 32LL * V;         // elements per warp-wide vector
  constexpr long long kTile = kStep * kUnroll;  // elements per warp per trip
  const Op op(p);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);  // may alias x: every element is read before written
  const T* bias = static_cast<const T*>(p.bias);
  const typename Num<T>::op_t alpha = scalar_from_bits<typename Num<T>::op_t>(p.alpha);
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * kThreads + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * kThreads) >> 5;

  const bool aligned = (((u64)x | (u64)y) & 15) == 0;
  const long long tiles = aligned ? p.n / kTile : 0;

  int bias_mode = kPerElement;
  if (HasBias) {
    if (p.inner % V == 0)
      bias_mode = kSharedChannel;
    else if (p.inner == 1 && p.channels % V == 0 && ((u64)bias & 15) == 0)
      bias_mode = kChannelRun;
  }

  for (long long t = warp; t < tiles; t += nwarps) {
    const long long base = t * kTile;
    Pack<T> v[kUnroll];
    u32 word[kUnroll];
    u32 mine = 0;  // FORWARD_MASK: the word this lane stores (vector lane % G, word lane / G)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll in flight
      v[u].raw = load16(x + base + u * kStep + lane * V);
      if (K == BACKWARD) word[u] = p.mask[(base + u * kStep) / 32 + lane / G];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int shift = V * (lane % G);  // this lane's bits within its word
      u32 bits = K == BACKWARD ? word[u] >> shift : 0u;
      Pack<T> out, bv;
      if (HasBias) bv = vector_bias(bias, base + u * kStep + lane * V, bias_mode, p);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (K == BACKWARD) {
          out.e[j] = op.backward(v[u].e[j], (bits >> j) & 1u);
        } else {
          T xj = v[u].e[j];
          if (HasBias) xj = add_bias(xj, bv.e[j], alpha);
          bool b;
          out.e[j] = op.forward(xj, b);
          bits |= (u32)b << j;
        }
      }
      store16(y + base + u * kStep + lane * V, out.raw);
      if (K == FORWARD_MASK) {  // OR the G lanes' V-bit pieces into one word
        u32 w = bits << shift;
#pragma unroll
        for (int off = 1; off < G; off <<= 1) w |= __shfl_xor_sync(0xffffffffu, w, off);
        if (lane % G == u) mine = w;
      }
    }
    // Word (vector u, piece k) sits at base / 32 + u * V + k: the tile's words are
    // contiguous, so this is one coalesced store of kUnroll * V words.
    if (K == FORWARD_MASK && lane % G < kUnroll)
      p.mask[base / 32 + (lane % G) * V + lane / G] = mine;
  }

  // Groups of 32 elements after the tiles; with a mask, on to the end of the
  // buffer so that the padding words are written (as 0) too.
  const long long first = tiles * kTile / 32;
  const long long groups = K == FORWARD_MASK ? p.mask_words : (p.n + 31) / 32;
  for (long long g = first + warp; g < groups; g += nwarps) {
    const long long i = g * 32 + lane;
    const bool active = i < p.n;
    if (K == BACKWARD) {
      const u32 w = p.mask[g];
      if (active) y[i] = op.backward(x[i], (w >> lane) & 1u);
    } else {
      bool b = false;
      if (active) {
        T xi = x[i];
        if (HasBias) xi = add_bias(xi, bias[channel_of(i, p)], alpha);
        y[i] = op.forward(xi, b);
      }
      if (K == FORWARD_MASK) {
        const u32 w = __ballot_sync(0xffffffffu, b);
        if (lane == 0) p.mask[g] = w;
      }
    }
  }
}

}  // namespace cupy_act
