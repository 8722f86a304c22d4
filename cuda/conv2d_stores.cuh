// conv2d_stores.cuh: the fused forward's output stores and mask words, shared by
// its two epilogues (conv2d.cu through shared memory with mma.sync,
// conv2d_epilogue.cuh from the warpgroup MMAs' accumulators): a stretch of
// mask bits written as whole output words by atomic ORs, stores as wide as
// the output's alignment allows, the bias + divide + LeakyReLU of one value
// (the elementwise op's own functor), and where a tile starts.
#pragma once

#include "conv2d_tiles.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

// One lane's part in writing the mask words of a stretch of consecutive
// output elements [e, e + len) (in general not word-aligned), whose bits a
// group of lanes holds: after tile_word4x4 or tile_word2x8, tile word m (32
// bits) is in lane lane0 + stride m. The stretch is tile words first .. first
// + count - 1 and takes up to count + 1 output words; this lane writes output
// word k of it (from tile words first + k and the one before). See
// put_mask_word.
struct MaskLane {
  int k;               // output word (e >> 5) + k
  int src_hi, src_lo;  // the lanes holding tile words first + k, first + k - 1
  bool use_hi, use_lo;
};

__device__ __forceinline__ MaskLane mask_lane(int lane0, int stride, int first, int count, int k,
                                              bool ok) {
  MaskLane m;
  m.k = k;
  const int last = first + count - 1;
  m.src_hi = lane0 + stride * min(first + k, last);
  m.src_lo = lane0 + stride * max(min(first + k - 1, last), first);
  m.use_hi = ok && k < count;
  m.use_lo = ok && k >= 1 && k <= count;
  return m;
}

// Every lane of the warp calls it (shuffles), with the tile word its group
// left in it (tile_word4x4, tile_word2x8) and its MaskLane. Every word goes
// in by an atomic OR (a reduction: nothing waits for it): the words at
// either end because a neighbouring warp or block owns their other bits, the
// ones the stretch covers entirely because the buffer starts zeroed and, on
// an H200, reductions measured faster than stores there (the seed shape's
// "fused_tf32" forward 360.6 -> 354.8 us; plain stores at both ends, with
// the end word carried over to the next row, made it 10% slower). Zero
// words are skipped.
//
// Output word k of the stretch [e, e + len) is (tile word k << sh) | (tile
// word k - 1 >> (32 - sh)), sh = e % 32: store_mask_word takes those two
// (hi, lo; zero where the stretch has none). Bits outside the stretch are
// dropped (the wgmma epilogue leaves them unset only inside it).
__device__ __forceinline__ void store_mask_word(u32* mask, u32 hi, u32 lo, int k, long long e,
                                                int len) {
  const int sh = (int)(e & 31), end = sh + len - 32 * k;  // the stretch's end, in word k's bits
  if (len <= 0 || end <= 0) return;
  u32* dst = mask + (e >> 5) + k;
  const u32 out = __funnelshift_l(lo, hi, sh);
  const int from = k == 0 ? sh : 0;
  const u32 part = out & (0xffffffffu >> (32 - min(end, 32))) & (0xffffffffu << from);
  if (part != 0u) atomicOr(dst, part);
}

__device__ __forceinline__ void put_mask_word(u32* mask, u32 word, const MaskLane& m, long long e,
                                              int len) {
  const u32 hi = __shfl_sync(0xffffffffu, word, m.src_hi);
  const u32 lo = __shfl_sync(0xffffffffu, word, m.src_lo);
  store_mask_word(mask, m.use_hi ? hi : 0u, m.use_lo ? lo : 0u, m.k, e, len);
}

// The first `valid` of N consecutive elements (N a multiple of 4) to dst:
// 4-element vector stores where all N exist and dst is aligned to 4
// elements, 2-element ones where it is aligned to 2, else one by one.
template <int N, typename T>
__device__ __forceinline__ void store_n(T* dst, const T (&e)[N], int valid) {
  static_assert(N % 4 == 0, "whole vectors");
  union {
    T e[N];
    u32 w[N * sizeof(T) / 4];
  } out;
#pragma unroll
  for (int j = 0; j < N; ++j) out.e[j] = e[j];
  const u64 at = (u64)dst;
  if (valid == N && (at & (4 * sizeof(T) - 1)) == 0) {
#pragma unroll
    for (int v = 0; v < N / 4; ++v) {
      const u32* w = out.w + v * sizeof(T);
      if (sizeof(T) == 4)
        reinterpret_cast<uint4*>(dst)[v] = make_uint4(w[0], w[1], w[2], w[3]);
      else
        reinterpret_cast<uint2*>(dst)[v] = make_uint2(w[0], w[1]);
    }
  } else if (valid == N && (at & (2 * sizeof(T) - 1)) == 0) {
#pragma unroll
    for (int v = 0; v < N / 2; ++v) {
      const u32* w = out.w + v * sizeof(T) / 2;
      if (sizeof(T) == 4)
        reinterpret_cast<uint2*>(dst)[v] = make_uint2(w[0], w[1]);
      else
        reinterpret_cast<u32*>(dst)[v] = w[0];
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < valid) dst[j] = out.e[j];
  }
}

// How a lane stores the first `valid` of 4 consecutive elements, the same
// for all the channels it holds where their planes lie a multiple of the
// vector apart: one 4-element vector (`all`), or 2-element vectors for the
// first pair (`lo`) and the second (`hi`); `rest` where some element would be
// left for a single store. Decided once per tile; the vectors are predicated
// stores rather than branches: with store_n's, the lane at the output's right
// edge (fewer than 4 values) split its warp at every channel and held the
// block's next barrier back (clock64 stamps, 2026-11-26, ddeb8df: the last warp's
// epilogue 1200-1650 cycles per tile longer than the others', at the seed
// shape's 126 columns).
struct Run4 {
  bool all, lo, hi, rest;  // rest: elements that need single stores
};

template <typename T>
__device__ __forceinline__ Run4 run4(const T* dst, int valid, long long plane) {
  const u64 at = (u64)dst;
  Run4 r;
  r.all = valid == 4 && (plane & 3) == 0 && (at & (4 * sizeof(T) - 1)) == 0;
  const bool pairs = !r.all && (plane & 1) == 0 && (at & (2 * sizeof(T) - 1)) == 0;
  r.lo = pairs && valid >= 2;
  r.hi = pairs && valid == 4;
  r.rest = (r.all || r.hi ? 4 : r.lo ? 2 : 0) < valid;
  return r;
}

// 4 elements of T as their sizeof(T) 32-bit words, in memory order.
template <typename T>
struct Words4 {
  u32 w[sizeof(T)];
};

template <typename T>
__device__ __forceinline__ Words4<T> words4(const T (&e)[4]) {
  union {
    T e[4];
    u32 w[sizeof(T)];
  } u;
#pragma unroll
  for (int j = 0; j < 4; ++j) u.e[j] = e[j];
  Words4<T> out;
#pragma unroll
  for (int i = 0; i < (int)sizeof(T); ++i) out.w[i] = u.w[i];
  return out;
}

// A vector (uint4 or uint2) of the output to its place where ok: y, or for
// the units of a seam line (forward_tiles) the seam buffer, the pointer then
// generic (one store instruction for either place).
template <typename V, typename T>
__device__ __forceinline__ void put_unit(T* dst, const V& v, bool ok) {
  if (ok) *reinterpret_cast<V*>(dst) = v;
}

// The vectors of r (not its rest), where ok. float32: the unit at the run's
// first element goes to u0, the one two elements on to u8 (dst and dst + 2,
// or their places in the seam buffer).
template <typename T>
__device__ __forceinline__ void store_vectors(T* u0, T* u8, const T (&e)[4], const Run4& r,
                                              bool ok) {
  const Words4<T> out = words4(e);
  if (sizeof(T) == 4) {
    put_unit(u0, make_uint4(out.w[0], out.w[1], out.w[2], out.w[3]), ok && r.all);
    put_unit(u0, make_uint2(out.w[0], out.w[1]), ok && r.lo);
    put_unit(u8, make_uint2(out.w[2], out.w[3]), ok && r.hi);
  } else {
    if (ok && r.all) *reinterpret_cast<uint2*>(u0) = make_uint2(out.w[0], out.w[1]);
    if (ok && r.lo) *reinterpret_cast<u32*>(u0) = out.w[0];
    if (ok && r.hi) *reinterpret_cast<u32*>(u0 + 2) = out.w[1];
  }
}

template <bool V>
struct Flag {
  static constexpr bool value = V;
};

// A warp's run of one row whose start lies two elements into a vector unit
// (every other row of the seed's 126-wide output): each lane's 4 values
// straddle two units, and as two half-vector stores each store instruction
// spread its pieces over all of the run's sectors. Instead lane g (of the 8 with equal t,
// holding positions 4 g .. 4 g + 3) stores the whole unit its last two
// values open, completed by lane g + 1's first two (a shuffle); lane 0 also
// its first two, and a lane with 4 whose unit no next lane completes (lane
// 7, or the last one of a row 0 mod 4 wide) its last two: aligned vectors.
// `valid`: the lane's valid elements (0, 2 or 4 here: every store a
// vector), `next_valid` lane g + 1's; every lane must call it (the
// shuffles). Rows 0 mod 4 wide take it where y starts 8 bytes into a unit
// (the first version, written for rows 2 mod 4 wide, left such a row's last
// two elements out: tests/test_conv.py's alignment cases found it). Taken
// for float32 only (epilogue_wgmma_nchw): 16-bit outputs were slower with it
// in a first version.
template <typename T>
__device__ __forceinline__ void store_shifted(T* u0, T* u8, const T (&e)[4], int g, int valid,
                                              int next_valid, bool ok) {
  const Words4<T> out = words4(e);
  const bool whole = ok && g < 7 && valid == 4 && next_valid >= 2;
  const bool lead = ok && g == 0 && valid >= 2, trail = ok && valid == 4 && !whole;
  if (sizeof(T) == 4) {
    const u32 n0 = __shfl_down_sync(0xffffffffu, out.w[0], 4);
    const u32 n1 = __shfl_down_sync(0xffffffffu, out.w[1], 4);
    put_unit(u8, make_uint4(out.w[2], out.w[3], n0, n1), whole);
    put_unit(u0, make_uint2(out.w[0], out.w[1]), lead);
    put_unit(u8, make_uint2(out.w[2], out.w[3]), trail);
  } else {
    const u32 n = __shfl_down_sync(0xffffffffu, out.w[0], 4);
    if (whole) *reinterpret_cast<uint2*>(u0 + 2) = make_uint2(out.w[1], n);
    if (lead) *reinterpret_cast<u32*>(u0) = out.w[0];
    if (trail) *reinterpret_cast<u32*>(u0 + 2) = out.w[1];
  }
}

// One output element from its convolution sum a: rounded to T (the
// convolution's output), plus the bias b (if `has_bias`), through op.forward.
template <typename T, typename Op>
__device__ __forceinline__ T epilogue_value(float a, const Op& op, bool has_bias, T b,
                                            typename Num<T>::op_t alpha, bool& bit) {
  T v = Num<T>::from_op(a);
  if (has_bias) v = add_bias(v, b, alpha);
  return op.forward(v, bit);
}

// The epilogue of a run of 4 consecutive output elements: the tile's values
// at src (16-byte aligned, shared memory) rounded to T, plus the bias b[j]
// (if `has_bias`), through op.forward; the first `valid` stored to dst.
// Returns their mask bits (element j: bit j, zero from `valid` on). The
// arithmetic is branch-free: it runs on all 4 values.
template <typename T, typename Op>
__device__ __forceinline__ u32 epilogue_run4(const float* src, T* dst, int valid, const Op& op,
                                             bool has_bias, const T (&b)[4],
                                             typename Num<T>::op_t alpha) {
  const float4 v4 = *reinterpret_cast<const float4*>(src);
  const float in[4] = {v4.x, v4.y, v4.z, v4.w};
  T out[4];
  u32 bits = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    bool bit;
    out[j] = epilogue_value(in[j], op, has_bias, b[j], alpha, bit);
    bits |= (u32)bit << j;
  }
  store_n(dst, out, valid);
  return bits & ((1u << valid) - 1u);
}

// v in a register that ptxas cannot refill from the parameter bank: left to
// itself it reloads a scalar parameter before each of its uses in the
// epilogue (one more instruction per element). ANDed with the active mask,
// all ones where the whole warp calls it (every lane must), v is unchanged,
// but ptxas cannot tell.
__device__ __forceinline__ u64 in_register(u64 v) {
  const u32 all = __activemask();
  return (u64)((u32)(v >> 32) & all) << 32 | ((u32)v & all);
}

// The two tile words of a group of 8 lanes, lane j holding bits 4j .. 4j +
// 3 of tile word u in nib[u] (u = 0, 1): lanes 0-3 of the group get word 0,
// lanes 4-7 word 1. An exchange with lane j ^ 4 (each keeps one word), then
// sums over lanes j ^ 2 and j ^ 1.
__device__ __forceinline__ u32 tile_word2x8(const u32 (&nib)[2], int j) {
  const u32 x0 = nib[0] << (4 * j), x1 = nib[1] << (4 * j);
  const bool up = j & 4;
  u32 z = (up ? x1 : x0) | __shfl_xor_sync(0xffffffffu, up ? x0 : x1, 4);
  z |= __shfl_xor_sync(0xffffffffu, z, 2);
  return z | __shfl_xor_sync(0xffffffffu, z, 1);
}

// The tile words of a group of 8 lanes, lane j holding bits 4j .. 4j + 3 of
// tile word u in nib[u] (u = 0 .. 3): lanes 2m and 2m + 1 get word m. Three
// exchanges, each halving the words a lane carries: with lane j ^ 4 (lanes
// j < 4 keep words 0 and 1, the others 2 and 3), with lane j ^ 2 (bit 1 of j
// picks one of the two), with lane j ^ 1 (the last sum).
__device__ __forceinline__ u32 tile_word4x4(const u32 (&nib)[4], int j) {
  u32 x[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) x[u] = nib[u] << (4 * j);
  const bool up = j & 4, odd = j & 2;
  const u32 y0 = (up ? x[2] : x[0]) | __shfl_xor_sync(0xffffffffu, up ? x[0] : x[2], 4);
  const u32 y1 = (up ? x[3] : x[1]) | __shfl_xor_sync(0xffffffffu, up ? x[1] : x[3], 4);
  const u32 z = (odd ? y1 : y0) | __shfl_xor_sync(0xffffffffu, odd ? y0 : y1, 2);
  return z | __shfl_xor_sync(0xffffffffu, z, 1);
}

// Where the tile starts: image n, output row oh0, column ow0.
struct TileAt {
  int n, oh0, ow0;
};

__device__ __forceinline__ TileAt tile_at(const ConvParams& p, int tile) {
  const int th = tile % p.tiles_h, tc = (tile / p.tiles_h) % p.tiles_w;
  return {tile / (p.tiles_w * p.tiles_h), th * (kBM >> p.c_log2), tc << p.c_log2};
}

}  // namespace cupy_act
