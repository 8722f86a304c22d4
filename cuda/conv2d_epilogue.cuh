// conv2d_epilogue.cuh: the fused forward's epilogue on compute capability 9.0,
// straight from the warpgroup MMAs' accumulators (conv2d.cu's forward_tiles
// calls it; the layout and the reasons are below): NCHW and NHWC, the tile's
// mask words, the row seams.
#pragma once

#include "conv2d_stores.cuh"
#include "wgmma.cuh"

namespace cupy_act {

// ---- The wgmma path's epilogue, straight from the accumulators ----
// The MMA's accumulator rows are mapped to output positions so that each
// thread holds 4 consecutive ones: thread (warp, g, t) holds positions
// P(h, r) = 32 warp + 4 g + 2 h + r (h, r = 0, 1: M-half h's row 16 warp +
// g + 8 r, wgmma.cuh's D layout; the A fragments load those positions'
// patch, a_wg) and channels tile_n + 8 j + 2 t + s (j = 0 .. 7, s = 0, 1):
// acc[h][4 j + 2 r + s]. The 4 positions lie in one tile row (C >= 32), so
// NCHW stores each channel's 4 values at once (16 bytes for float32; a
// warp's store covers 32 consecutive positions of 4 channels), and NHWC
// stores pairs of channels. No barrier: the patch stays in shared memory
// for the next tile (the ring of rows).

// The block's bias values in shared memory, after the tile's mask words tw.
template <typename T>
__device__ __forceinline__ T* bias_s(u32* tw) {
  return reinterpret_cast<T*>(tw + kTileMaskWords);
}

// Two consecutive elements to a (2 * sizeof(T))-byte aligned address.
template <typename T>
__device__ __forceinline__ void store2(T* dst, T a, T b) {
  union {
    T e[2];
    u32 w[sizeof(T) / 2];
  } out;
  out.e[0] = a;
  out.e[1] = b;
  if (sizeof(T) == 4)
    *reinterpret_cast<uint2*>(dst) = make_uint2(out.w[0], out.w[1]);
  else
    *reinterpret_cast<u32*>(dst) = out.w[0];
}

// An 8 x 8 transpose of 4-bit elements over the 8 lanes of equal t (g =
// lane / 4): nibble c of x in lane g comes back as nibble g in lane c.
// Three exchanges, each swapping one bit of the row (lane) and column
// (nibble) index: with lane ^ 4b, lanes whose g has bit b keep the columns
// with bit b set and take their partner's others, moved by b columns.
__device__ __forceinline__ u32 transpose_nibbles(u32 x, int g) {
#pragma unroll
  for (int b = 4; b >= 1; b >>= 1) {
    const u32 lo = b == 4 ? 0x0000ffffu : b == 2 ? 0x00ff00ffu : 0x0f0f0f0fu;  // column bit b clear
    const u32 y = __shfl_xor_sync(0xffffffffu, x, 4 * b);
    x = g & b ? (x & ~lo) | ((y >> (4 * b)) & lo) : (x & lo) | ((y << (4 * b)) & ~lo);
  }
  return x;
}

// The warpgroup epilogue's warps wait for each other after every kStoreStep
// of their 16 store instructions (4 channels each; a named barrier: the block
// is the warpgroup). A channel's 128-byte line is shared by neighbouring
// warps' runs wherever the row does not start on a line (126-wide rows:
// nearly everywhere). Written by both within a short time it costs the
// memory system about what one whole line does; written far apart (one warp
// some channels ahead) it costs about as much again. In a copy of this kernel
// (2026-11-27, 53390f4), the seed shape's no-grad forward on an H100: "fused_tf32" 355 us with no
// barrier, 332 with one every 2 stores, 331 every 4, 338 every 8 (with odd
// warps' channels in reverse order and no barrier: 461); after every store
// 1-3% faster again than every 2, for "fused" too.
constexpr int kStoreStep = 1;

__device__ __forceinline__ void warps_in_step() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConvThreads) : "memory");
}

// Whether every float32 row of y starts on a 128-byte line (widths a
// multiple of 32, y on a line): then no line is shared, neither between a
// row's warps nor between rows. The same for the whole block.
template <typename T>
__device__ __forceinline__ bool rows_on_lines(const ConvParams& p, const T* y) {
  return sizeof(T) == 4 && (p.ow & 31) == 0 && ((u64)y & 127) == 0;
}

// The bias values come from shared memory (bias_s(tw): the block's 64 channels,
// zero past cout; a global load per tile left every warp waiting on it).
// Mask bits are gathered for every value; those outside the output (past
// its edge, past cout) are dropped where the words are stored
// (store_mask_word), so no test is spent per bit.
//
// NCHW. A channel's 4 values go out by store_n (as wide as alignment
// allows). Mask: the tile's words go to tw[line * 4 + u] (line: channel
// tile_n + line; u: positions 32 u .. 32 u + 31, warp u's), written out by
// put_tile_mask_nchw after a barrier. A lane gathers a nibble per channel
// (bit 2 h + r), 8 channels (2 j + s = 8 i + c) per word i;
// transpose_nibbles leaves lane g the word of channel 8 i + g: positions 32
// warp + 4 g' + q at bit 4 g' + q.
template <typename T, bool kAllChannels, typename Op>
__device__ __forceinline__ void epilogue_wgmma_nchw(const float (&acc)[2][32], const ConvParams& p,
                                                    T* y, bool has_bias, const Op& op,
                                                    typename Num<T>::op_t alpha, TileAt at,
                                                    int tile_n, u32* tw, float* seam_head,
                                                    float* seam_tail, int warp, int g, int t) {
  const int cols = 1 << p.c_log2;
  const long long out_plane = (long long)p.oh * p.ow;
  // channel 2 t + 8 j + s exists where 8 j + s < c_left
  const int c_left = p.cout - tile_n - 2 * t;
  const int pos = 32 * warp + 4 * g, row = pos >> p.c_log2, col = pos & (cols - 1);
  const int valid = at.oh0 + row < p.oh ? max(0, min(4, p.ow - at.ow0 - col)) : 0;
  // channels 2 t + 8 j + s, stepped along (j, s) (a 64-bit add, cheaper
  // than a product per store)
  T* yc = y + ((long long)at.n * p.cout + tile_n + 2 * t) * out_plane +
          (long long)(at.oh0 + row) * p.ow + at.ow0 + col;
  const Run4 how = run4(yc, valid, out_plane);
  // float32, one row per warp (C = 128) starting two elements into a vector
  // unit: store_shifted's aligned vectors (a warp-wide choice). For 16-bit
  // types neither the vote nor the shuffle is emitted (a constant condition
  // does not remove a warp-wide intrinsic).
  constexpr bool kShifts = sizeof(T) == 4;
  const int next_valid = kShifts ? __shfl_down_sync(0xffffffffu, valid, 4) : 0;  // lane g + 1's
  const bool shifted = kShifts && __all_sync(0xffffffffu, p.c_log2 == 7 && (out_plane & 3) == 0 &&
                                                              ((u64)yc & 15) == 8);
  // Rows on lines share no line between warps: no barrier (it cost 4% at
  // 128 columns).
  const bool in_step = !rows_on_lines(p, y);
  // Row seams (forward_tiles; null where this tile stores the line itself):
  // warp 0's units in the line the previous row ends in go to seam_head, the
  // other warps' units in the line the next row starts in to seam_tail, a
  // line per channel kSeamStride floats apart. The key element: the previous
  // row's last, or the next row's first (bytes from the lane's first).
  float* seam_line = warp == 0 ? seam_head : seam_tail;
  const bool seam_on = seam_line != nullptr && (warp == 0 || col + 4 > p.ow - 32);
  // Where a unit goes depends on its address modulo 128 alone, and seams
  // come with planes of whole 4-element vectors, so channels 8 apart (8
  // planes: a multiple of 128 bytes) route alike: worked out once per tile
  // for the lane's two channels (s), at its first address (r0) and 8 bytes
  // on (r8). Each of the four then has a pointer of its own, to y or into
  // the seam buffer, stepped 8 channels on per j: the store loop tests no
  // route. (Tested at every store, as first written, the seed's TF32
  // forward took 316 us against 326 without the seams on an H100; with the
  // pointers 287 against 326; docs/conv-forward.md.)
  T* unit[2][2] = {};  // [s][0: the first unit, 1: the one 8 bytes on]
  int unit_step[2][2] = {};
  if (sizeof(T) == 4 && seam_line != nullptr) {
    const u32 to_key = warp == 0 ? 0u - 4u * (u32)(col + 1) : 4u * (u32)(p.ow - col);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      T* ys = yc + s * out_plane;
      const u32 a = (u32)(u64)ys, key = a + to_key;
      float* line = seam_line + (2 * t + s) * kSeamStride;
      bool r[2];
      r[0] = seam_on && (a ^ key) < 128u;
      r[1] = seam_on && ((a + 8u) ^ key) < 128u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        T* into = reinterpret_cast<T*>(line + (((a + 8u * h) & 127u) >> 2));
        unit[s][h] = r[h] ? into : ys + 2 * h;
        unit_step[s][h] = r[h] ? 8 * kSeamStride : 8 * (int)out_plane;  // (plane < 2^28)
      }
    }
  }
  u32 word[2] = {0u, 0u};
  // Each store's 4 values are formed just before it; the mask bits only
  // where the mask is written (kMask: the no-grad forward skips them, 2 of
  // the 6 instructions per value). Forming a tile's values before its first
  // store (the arithmetic's chains side by side) was no faster for the
  // seed's no-grad float32 forward on an H100 (all first 272.6-280.5 us, per
  // store 271.4-272.2, 2026-11-27, a602205), and at 168 registers ptxas spilled with it
  // in the three-pass kernels.
  auto channels = [&](auto vectors, auto seam, auto with_mask) {
    constexpr bool kSeam = decltype(seam)::value, kMask = decltype(with_mask)::value;
    T v[8][2][4];
    auto form = [&](int j, int s) {
      const T b = bias_s<T>(tw)[2 * t + 8 * j + s];
      u32 bits = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        bool bit;
        v[j][s][q] =
            epilogue_value(acc[q >> 1][4 * j + 2 * (q & 1) + s], op, has_bias, b, alpha, bit);
        if (kMask) bits |= (u32)bit << q;
      }
      if (kMask) word[j >> 2] |= bits << (4 * (2 * (j & 3) + s));
    };
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        form(j, s);
        const bool c_ok = kAllChannels || 8 * j + s < c_left;
        T* u0 = kSeam ? unit[s][0] : yc;
        T* u8 = kSeam ? unit[s][1] : yc + 2;
        if (decltype(vectors)::value && shifted)
          store_shifted(u0, u8, v[j][s], g, valid, next_valid, c_ok);
        else if (decltype(vectors)::value)
          store_vectors(u0, u8, v[j][s], how, c_ok);
        else
          store_n(yc, v[j][s], c_ok ? valid : 0);
        if constexpr (kSeam) {
          unit[s][0] += unit_step[s][0];
          unit[s][1] += unit_step[s][1];
        } else {
          yc += s == 0 ? out_plane : 7 * out_plane;
        }
        if (in_step && (2 * j + s) % kStoreStep == kStoreStep - 1) warps_in_step();
      }
    }
  };
  auto stores = [&](auto vectors, auto seam) {
    if (p.mask)
      channels(vectors, seam, Flag<true>());
    else
      channels(vectors, seam, Flag<false>());
  };
  // Where every lane's runs go out as vectors (the seed shape: 16-byte ones,
  // or 8-byte ones on rows that start 8 bytes into a 16-byte unit, and at the
  // right edge), predicated vector stores with no branch; else (odd widths,
  // unaligned outputs) store_n's branches. A warp-wide choice, once per tile;
  // warps with seam units store through their units' pointers (seams are
  // only where no lane needs store_n).
  if (__any_sync(0xffffffffu, how.rest))
    stores(Flag<false>(), Flag<false>());
  else if (sizeof(T) == 4 && __any_sync(0xffffffffu, seam_on))
    stores(Flag<true>(), Flag<sizeof(T) == 4>());
  else
    stores(Flag<true>(), Flag<false>());
  if (p.mask) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = 8 * i + g, line = 8 * (c >> 1) + 2 * t + (c & 1);
      tw[line * 4 + warp] = transpose_nibbles(word[i], g);
    }
  }
}

// The NCHW mask of the tile at `at` from its words tw (epilogue_wgmma_nchw):
// a group of 8 lanes per line, lane j writing output word ml.k of tile row
// mr (nchw_mask_lane), as in the shared-memory epilogue.
__device__ __forceinline__ MaskLane nchw_mask_lane(const ConvParams& p, int tid, int& mr) {
  const int j = tid & 7, wpr = 1 << (p.c_log2 - 5);
  // j / (wpr + 1) for j < 8: a multiply by ceil(64 / (wpr + 1)), shifted
  mr = (j * (wpr == 1 ? 32 : wpr == 2 ? 22 : 13)) >> 6;
  return mask_lane(0, 1, mr * wpr, wpr, j - mr * (wpr + 1), mr < (kBM >> p.c_log2));
}

__device__ __forceinline__ void put_tile_mask_nchw(const ConvParams& p, const u32* tw, TileAt at,
                                                   int tile_n, int tid) {
  int mr;
  const MaskLane ml = nchw_mask_lane(p, tid, mr);
  const bool row = (ml.use_hi || ml.use_lo) && at.oh0 + mr < p.oh;
  const int len = row ? min(1 << p.c_log2, p.ow - at.ow0) : 0;
  const long long out_plane = (long long)p.oh * p.ow;
  const int lines = min(kBN, p.cout - tile_n);
  long long e = ((long long)at.n * p.cout + tile_n + (tid >> 3)) * out_plane +
                (long long)(at.oh0 + mr) * p.ow + at.ow0;  // line tid / 8's row mr
  for (int line = tid >> 3; line < lines; line += kConvThreads / 8) {
    const u32* w = tw + line * 4;
    store_mask_word(p.mask, ml.use_hi ? w[ml.src_hi] : 0u, ml.use_lo ? w[ml.src_lo] : 0u, ml.k, e,
                    len);
    e += kConvThreads / 8 * out_plane;
  }
}

// The row seams of tile `at` (forward_tiles): for each channel whose row
// does not start on a line, the line it shares with the row before, whole
// from `lines` (the previous tile's part and this tile's), 8 lanes per line:
// a warp's store writes 4 whole lines. A thread's channels are 16 apart (16
// planes of whole 4-element vectors: a multiple of 128 bytes), so they start
// alike within their lines; unrolled, the loads go out together.
__device__ __forceinline__ void put_seams(const float* lines, float* y, const ConvParams& p,
                                          TileAt at, int tile_n, int tid) {
  constexpr int kApart = kConvThreads / 8;
  const long long out_plane = (long long)p.oh * p.ow;
  const int chans = min(kBN, p.cout - tile_n), q = tid & 7, c0 = tid >> 3;
  float* row = y + ((long long)at.n * p.cout + tile_n + c0) * out_plane + (long long)at.oh0 * p.ow;
  const int into = (int)((u64)row & 127) >> 2;  // (pointer arithmetic keeps y's global space)
  uint4 v[kBN / kApart];
#pragma unroll
  for (int i = 0; i < kBN / kApart; ++i)
    if (c0 + kApart * i < chans)
      v[i] = *reinterpret_cast<const uint4*>(lines + (c0 + kApart * i) * kSeamStride + 4 * q);
#pragma unroll
  for (int i = 0; i < kBN / kApart; ++i)
    if (into != 0 && c0 + kApart * i < chans)
      *reinterpret_cast<uint4*>(row + kApart * i * out_plane - into + 4 * q) = v[i];
}

// NHWC: a position's channels are consecutive, two per lane (one store of
// both where `pair`: cout even, y aligned). Mask: the position's 64 bits
// (channels tile_n ..) are two words, gathered per lane (bit 8 (j % 4) + 2 t
// + s of word j / 4) and ORed over the 4 lanes of equal g; lane t then
// writes output word t of the position's stretch (up to 3).
template <typename T, bool kAllChannels, typename Op>
__device__ __forceinline__ void epilogue_wgmma_nhwc(const float (&acc)[2][32], const ConvParams& p,
                                                    T* y, bool has_bias, const Op& op,
                                                    typename Num<T>::op_t alpha, TileAt at,
                                                    int tile_n, u32* tw, bool pair, int warp, int g,
                                                    int t) {
  const int cols = 1 << p.c_log2;
  const int c_left = p.cout - tile_n - 2 * t;
  const int len = min(kBN, p.cout - tile_n);
  T b[8][2];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int s = 0; s < 2; ++s) b[j][s] = bias_s<T>(tw)[2 * t + 8 * j + s];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = 32 * warp + 4 * g + 2 * h + r, row = pos >> p.c_log2, col = pos & (cols - 1);
      const bool ok = at.oh0 + row < p.oh && at.ow0 + col < p.ow;
      const long long e =  // the element of (this position, channel tile_n)
          (((long long)at.n * p.oh + at.oh0 + row) * p.ow + at.ow0 + col) * p.cout + tile_n;
      T* yp = y + e + 2 * t;
      u32 mw[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        bool bit[2], st[2];
        T v[2];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          v[s] = epilogue_value(acc[h][4 * j + 2 * r + s], op, has_bias, b[j][s], alpha, bit[s]);
          st[s] = ok && (kAllChannels || 8 * j + s < c_left);
        }
        if (pair) {
          if (st[0]) store2(yp + 8 * j, v[0], v[1]);
        } else {
          if (st[0]) yp[8 * j] = v[0];
          if (st[1]) yp[8 * j + 1] = v[1];
        }
        mw[j >> 2] |= ((u32)bit[0] | (u32)bit[1] << 1) << (8 * (j & 3));
      }
      if (p.mask) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          mw[u] <<= 2 * t;
          mw[u] |= __shfl_xor_sync(0xffffffffu, mw[u], 1);
          mw[u] |= __shfl_xor_sync(0xffffffffu, mw[u], 2);
        }
        const u32 hi = t == 0 ? mw[0] : t == 1 ? mw[1] : 0u;
        const u32 lo = t == 1 ? mw[0] : t == 2 ? mw[1] : 0u;
        store_mask_word(p.mask, hi, lo, t, e, ok ? len : 0);
      }
    }
}

}  // namespace cupy_act
