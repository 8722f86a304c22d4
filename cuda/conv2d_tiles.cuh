// conv2d_tiles.cuh: what the fused convolution's kernels share (conv2d.cu,
// the forward; conv2d_wgrad.cu, the weight gradient): the parameter block,
// the 3xTF32 split, the TF32 MMA, and the input patch of a 128-position
// output tile copied into shared memory.
#pragma once
#include "numerics.cuh"

namespace cupy_act {

struct ConvParams {
  const void* x;               // input, NCHW or NHWC (per kChannelsLast), dense
  const void* w;               // weight, OIHW, dense
  const void* bias;            // (Cout,) or null
  void* y;                     // output, the input's layout (wgrad: the upstream gradient dy)
  u32* mask;                   // forward: zeroed mask buffer, or null; wgrad: the forward's
  int n, cin, h, w_in;         // input
  int cout, oh, ow;            // output
  int kh, kw;                  // filter size
  int sh, sw, ph, pw, dh, dw;  // stride, zero padding, dilation
  int c_log2;                  // tile columns C = 1 << c_log2, rows 128 >> c_log2
  int tiles_h, tiles_w;        // tiles per image
  int cc;                      // input channels per chunk
  int kc_pad;                  // cc * kh * kw rounded up to a multiple of 8
  int patch_h, patch_w;        // patch plane: PH x PW, row stride PW
  int pad_;
  u64 slope, scale, alpha;  // float bits, as in Params
  // The weight gradient (conv2d_wgrad.cu): per-split partial sums, then gw, gb.
  // The input gradient (conv2d_dgrad.cu): dx in gw, input rows per block in
  // tiles_per_split, column tiles in tiles_w. The forward: tiles per block in
  // tiles_per_split.
  void* gw;                 // (Cout, Cin, kH, kW) dense, the weight's dtype (dgrad: dx)
  void* gb;                 // (Cout,) or null
  float* part;              // [splits][cout][K] partial gw, then [splits][cout] partial gb
  int tiles_per_split, splits;
};

constexpr int kConvThreads = 128;
constexpr int kBM = 128;       // output positions per block
constexpr int kBN = 64;        // output channels per block
constexpr int kCS = kBM + 4;   // epilogue tile, NCHW: [kBN][kCS]
constexpr int kCSL = kBN + 4;  // epilogue tile, NHWC: [kBM][kCSL]
// Dynamic shared memory: max(epilogue tile, table + patch + weights); the host
// (cupy_act/_conv.py) computes the same sizes.
constexpr int kEpilogueFloats = kBM * kCSL > kBN* kCS ? kBM * kCSL : kBN * kCS;
// After the forward's patch (wgmma): a tile's mask words (NCHW), the bias values.
constexpr int kTileMaskWords = kBN * 4;
constexpr int kAfterPatchWords = kTileMaskWords + kBN;
// The row seams' buffer (float32, one pass, NCHW on wgmma: conv2d.cu's
// forward_tiles): two sets of a 128-byte line per channel, kSeamStride floats
// apart (4 past the line: the 4 channels of one store land in distinct banks).
constexpr int kSeamStride = 36;
constexpr int kSeamFloats = 2 * kBN * kSeamStride;

// cvt.rna.tf32.f32 in integer operations: add half a TF32 unit to the
// magnitude's bits, then drop the low 13 (a carry into the exponent is the
// correct rounding; a finite value past the largest TF32 one becomes inf, as
// cvt gives). sm_80/sm_90 emulate the cvt with a longer sequence. NaN stays
// NaN (the canonical one: a payload in the low bits alone would otherwise
// turn into inf).
__device__ __forceinline__ u32 to_tf32(float x) {
  const u32 b = __float_as_uint(x);
  return (b & 0x7fffffffu) > 0x7f800000u ? 0x7fffffffu : (b + 0x1000u) & 0xffffe000u;
}

__device__ __forceinline__ bool finite_bits(u32 b) { return (b & 0x7f800000u) != 0x7f800000u; }

// The operands of x in kPasses passes. One pass: tf32(x). Three: big = x's
// bits rounded to TF32 (half a unit added to the magnitude, the low 13 bits
// dropped: round half away from zero, as cvt.rna), small = x - big, exact in
// FP32 and kept with its low bits: the tensor cores read a TF32 operand's top
// 19 bits, so small counts to within 2^-10 |small| <= 2^-21 |x| (one TF32
// rounding of it would give 2^-22 |x|, for four more operations per value).
// A non-finite big (x inf or NaN, or a finite x past the largest TF32 value)
// is stored as big = 0 and small = inf, or the canonical NaN, so that of the
// three products only small_a * big_b or big_a * small_b carries it, against
// the other operand's finite part, and no padding or correction term turns
// it into NaN (inf * 0) where the FP32 sum would not. (Both operands
// non-finite in one product gives NaN where the sum may give inf.)
template <int kPasses>
__device__ __forceinline__ void split(float x, u32& big, u32& small) {
  if (kPasses == 1) {
    big = to_tf32(x);
    return;
  }
  const u32 b = __float_as_uint(x);
  const u32 r = (b + 0x1000u) & 0xffffe000u;
  float d;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(x), "f"(__uint_as_float(r)));
  const bool finite = finite_bits(r);
  big = finite ? r : 0u;
  small = finite ? __float_as_uint(d) : (b & 0x7fffffffu) > 0x7f800000u ? 0x7fffffffu : r;
}

// d += a * b, one 16x8x8 TF32 tile. Fragments (g = lane / 4, t = lane % 4):
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1].
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Predicated loads (read-only data): the value where `pred`, else zero bits;
// no branch, and no memory access where false.
template <typename T>
__device__ __forceinline__ T ldg_if(const T* src, bool pred) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "32- or 16-bit elements");
  union {
    T v;
    u32 w;
    u16 h;
  } r;
  if (sizeof(T) == 4)
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b32 %0, 0;\n"
        " @q ld.global.nc.b32 %0, [%1];\n}"
        : "=r"(r.w) : "l"(src), "r"((int)pred));
  else
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b16 %0, 0;\n"
        " @q ld.global.nc.b16 %0, [%1];\n}"
        : "=h"(r.h) : "l"(src), "r"((int)pred));
  return r.v;
}

// src[0 .. 3] from a (4 * sizeof(T))-byte aligned address where `pred`, else zeros.
template <typename T>
__device__ __forceinline__ void ldg4_if(const T* src, bool pred, T (&d)[4]) {
  union {
    T e[4];
    u32 w[4];
  } r;
  if (sizeof(T) == 4)
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " mov.b32 %2, 0;\n mov.b32 %3, 0;\n @q ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n}"
        : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
        : "l"(src), "r"((int)pred));
  else
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @q ld.global.nc.v2.b32 {%0, %1}, [%2];\n}"
        : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(src), "r"((int)pred));
#pragma unroll
  for (int j = 0; j < 4; ++j) d[j] = r.e[j];
}

// 4 consecutive elements of T from src (aligned to 4 * sizeof(T) where
// `vector`), the first `valid` of them; the rest zero.
template <typename T>
__device__ __forceinline__ void load4_raw(const T* src, int valid, bool vector, T (&v)[4]) {
  union {
    T e[4];
    u32 w[sizeof(T)];
  } in;
  if (vector && valid == 4) {
    if (sizeof(T) == 4) {
      const uint4 r = *reinterpret_cast<const uint4*>(src);
      in.w[0] = r.x, in.w[1] = r.y, in.w[2] = r.z, in.w[3] = r.w;
    } else {
      const uint2 r = *reinterpret_cast<const uint2*>(src);
      in.w[0] = r.x, in.w[1] = r.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) in.e[j] = j < valid ? src[j] : Num<T>::zero();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = in.e[j];
}

// 4 consecutive elements from a (4 * sizeof(T))-byte aligned address, as floats.
template <typename T>
__device__ __forceinline__ void load4(const T* src, float (&v)[4]) {
  T e[4];
  load4_raw(src, 4, true, e);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = Num<T>::to_op(e[j]);
}

// Three passes keep the small parts at fixed distances from the big ones, so
// that one address serves both loads (an immediate offset): the patch's part
// holds at most kPatchPart words, the weights' kWeightPart (depth <= 72).
constexpr int kPatchPart = 4096;
constexpr int kWeightStride = 72;  // words per depth row of the weights: (8t + g) % 32 distinct
constexpr int kWeightPart = 72 * kWeightStride;
// The sm_90a forward's weights are [kBN][kc_pad] per part (K-major core
// matrices), the small part kBN x 72 words on; the allocation (kWeightPart
// per part) leaves the rest free (the ring's staging area may use it).
constexpr int kWgmmaWeightPart = kBN * 72;

// v[0] = the word at shared address addr (the big part), v[1] = the small one.
template <int kParts, int kSmallBytes>
__device__ __forceinline__ void lds(u32 addr, u32& big, u32& small) {
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(big) : "r"(addr));
  if (kParts == 2)
    asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(small) : "r"(addr), "n"(kSmallBytes));
}

// x split (split<kPasses>) into shared memory: word e, the small part at e + small.
template <int kPasses>
__device__ __forceinline__ void put_split(u32* dst, int e, int small, float x) {
  u32 big, lo;
  split<kPasses>(x, big, lo);
  dst[e] = big;
  if (kPasses == 3) dst[e + small] = lo;
}

// put_split where `pred` (predicated stores: no branch).
template <int kPasses>
__device__ __forceinline__ void put_split_if(u32* dst, int e, float x, bool pred) {
  u32 big, small;
  split<kPasses>(x, big, small);
  const u32 addr = (u32)__cvta_generic_to_shared(dst + e);
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.shared.u32 [%0], %1;\n}"
               :: "r"(addr), "r"(big), "r"((int)pred));
  if (kPasses == 3)
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q st.shared.u32 [%0+%3], %1;\n}"
                 :: "r"(addr), "r"(small), "r"((int)pred), "n"(kPatchPart * 4));
}

// The patch row slot of logical row l (0 <= l < PH) of a tile whose first
// row sits in slot `base` (a ring of PH rows per channel; base 0: row l in slot l).
__device__ __forceinline__ int ring_slot(int base, int l, int ph) {
  const int s = base + l;
  return s >= ph ? s - ph : s;
}

// Depth k = (ci, r, s) of a chunk in the patch: word fix + the row slot's
// (row r * dh, -1 for depth past the chunk's, the padding up to kc_pad,
// which reads the zero plane at fix).
struct KDepth {
  int fix, row;
};

__device__ __forceinline__ KDepth k_depth(const ConvParams& p, int k) {
  const int khw = p.kh * p.kw, plane = p.patch_h * p.patch_w;
  if (k >= p.cc * khw) return {p.cc * plane, -1};
  const int ci = k / khw, rs = k - ci * khw, r = rs / p.kw, s = rs - r * p.kw;
  return {ci * plane + s * p.dw, r * p.dh};
}

// Its byte offset for a tile whose first row sits in ring slot `base`.
__device__ __forceinline__ int k_offset(const ConvParams& p, KDepth d, int base) {
  return 4 * (d.row < 0 ? d.fix : d.fix + ring_slot(base, d.row, p.patch_h) * p.patch_w);
}

// koff[k]: the byte offset in the patch of depth k = (ci, r, s) of a chunk,
// its row r * dh in slot ring_slot(base, r * dh) (base 0: row r * dh); depth
// past the chunk's points at the zero plane.
__device__ __forceinline__ void build_koff(int* koff, const ConvParams& p, int tid, int base) {
  for (int k = tid; k < p.kc_pad; k += kConvThreads) koff[k] = k_offset(p, k_depth(p, k), base);
}

// x / d for 0 <= x, x d < 2^32, with m = div_magic(d): one multiply-high
// (m = ceil(2^32 / d); d = 1 passes x through).
__device__ __forceinline__ u32 div_magic(u32 d) { return 0xffffffffu / d + 1u; }
__device__ __forceinline__ int div_by(int x, int d, u32 m) {
  return d == 1 ? x : (int)__umulhi((u32)x, m);
}

// load_patch's NCHW case, logical rows l0 .. l0 + nr - 1 of each channel
// (with a ring of rows, the weight gradient's and the sm_90a forward's, the
// others are still there from the previous tile), row l into slot
// ring_slot(base, l). The block's threads walk
// (row, 4-column group) items kBatch at a time, all loads of a batch issued
// before any conversion; a thread's items advance by kConvThreads, (row,
// group) carried forward without a division, the row's channel by a
// multiply-high (div_by). vec: the rows' 4-element vectors line up with the
// groups (w_in % 4 == 0, iw_base % 4 == 0, x aligned), so a group inside the
// image is one vector load.
template <typename T, int kPasses, int kBatch>
__device__ __forceinline__ void load_patch_nchw(u32* patch, const ConvParams& p, const T* xn,
                                                int c0, int ih_base, int iw_base, int tid,
                                                bool vec, int l0, int nr, int base) {
  const int groups = (p.patch_w + 3) >> 2;
  const int rows = p.cc * nr;
  const int step_row = kConvThreads / groups, step_group = kConvThreads - step_row * groups;
  const u32 mr = div_magic(nr);
  int row = tid / groups, group = tid - row * groups;
  while (row < rows) {
    float v[kBatch][4];
    int it_dst[kBatch], it_pc[kBatch];  // the item's patch row (-1: none) and column
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int c = div_by(row, nr, mr), l = l0 + row - c * nr, ih = ih_base + l;
      it_dst[b] = row < rows ? c * p.patch_h + ring_slot(base, l, p.patch_h) : -1;
      it_pc[b] = group * 4;
      const int iw = iw_base + group * 4;
      const bool row_ok = row < rows && (unsigned)ih < (unsigned)p.h && c0 + c < p.cin;
      const T* src = xn + ((long long)(c0 + c) * p.h + ih) * p.w_in + iw;
      // Both kinds of load, predicated: one vector inside the image, else
      // the scalars that lie in it (no branch, no access outside the image).
      const bool whole = vec && row_ok && iw >= 0 && iw + 3 < p.w_in;
      T e[4];
      ldg4_if(src, whole, e);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const T s = ldg_if(src + j, !whole && row_ok && (unsigned)(iw + j) < (unsigned)p.w_in);
        v[b][j] = Num<T>::to_op(whole ? e[j] : s);
      }
      group += step_group;
      row += step_row;
      if (group >= groups) {
        group -= groups;
        ++row;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      u32* dst = patch + max(it_dst[b], 0) * p.patch_w;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        put_split_if<kPasses>(dst, it_pc[b] + j, v[b][j], it_dst[b] >= 0 && it_pc[b] + j < p.patch_w);
    }
  }
}

// The input patch of channels [c0, c0 + cc) of image xn under the output
// rectangle whose top-left input position is (ih_base, iw_base), zero outside
// the image, split into shared memory. NCHW: load_patch_nchw, rows l0 .. l0
// + nr - 1 into ring slots from `base` (0, PH, 0: every row in place).
// NHWC: a warp per row, a lane per column reading that column's cc
// channels, which lie together (unrolled so that several loads are in
// flight).
template <typename T, int kPasses, bool kChannelsLast>
__device__ __forceinline__ void load_patch(u32* patch, const ConvParams& p, const T* xn, int c0,
                                           int ih_base, int iw_base, int tid, int l0, int nr,
                                           int base) {
  const int lane = tid & 31, warp = tid >> 5;
  if (kChannelsLast) {
    for (int pr = warp; pr < p.patch_h; pr += kConvThreads / 32) {
      const int ih = ih_base + pr;
      const bool row_ok = (unsigned)ih < (unsigned)p.h;
      for (int pc = lane; pc < p.patch_w; pc += 32) {
        const int iw = iw_base + pc;
        const bool ok = row_ok && (unsigned)iw < (unsigned)p.w_in;
        const T* src = xn + (ih * p.w_in + iw) * p.cin + c0;
#pragma unroll 2
        for (int c = 0; c < p.cc; ++c) {
          const float v = ok && c0 + c < p.cin ? Num<T>::to_op(src[c]) : 0.f;
          put_split<kPasses>(patch, (c * p.patch_h + pr) * p.patch_w + pc, kPatchPart, v);
        }
      }
    }
  } else {
    // Where the rows' 4-element vectors line up with the patch columns (16
    // bytes for float32, 8 for 16-bit types), a lane takes 4 columns per load.
    // (w_in % 4 == 0 makes every image start as aligned as the first.)
    const bool vec =
        (p.w_in & 3) == 0 && (iw_base & 3) == 0 && ((u64)xn & (4 * sizeof(T) - 1)) == 0;
    load_patch_nchw<T, kPasses, 2>(patch, p, xn, c0, ih_base, iw_base, tid, vec, l0, nr, base);
  }
}

}  // namespace cupy_act
