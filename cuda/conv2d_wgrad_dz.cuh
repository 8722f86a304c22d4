// conv2d_wgrad_dz.cuh: what the weight gradient's kernels (conv2d_wgrad.cu) share:
// dz = the elementwise op's backward of dy and the mask bit, formed from dy
// in registers or from raw dy rows the copy engine brought (DyRuns, DzRaw),
// the tile's shared-memory strides, and one MMA step of the mma.sync kernel
// (wgrad_step).
#pragma once

#include "conv2d_tiles.cuh"
#include "params.cuh"
#include "activations.cuh"
#include "wgmma.cuh"
#include "copy_engine.cuh"

namespace cupy_act {

// dz tile row stride: [kBN][kDS]; the A fragments' 8-byte loads (row g,
// words 2t, 2t + 1) hit banks (8g + 2t) % 32, distinct in each half warp.
constexpr int kDS = kBM + 8;
// The bulk-copy path's raw dy lines, bytes apart: [kBN][kBM + 8] elements,
// room for a line's 16-byte aligned run (its first element up to 16 bytes
// in). Float32 pairs load as the dz tile's; a 16-bit pair is one word,
// (68g + t) % 32 = (4g + t) % 32: distinct banks in the warp.
template <typename T>
constexpr int kRawStride = (kBM + 8) * (int)sizeof(T);
constexpr int kWgradDepth = 72;     // depth per chunk (9 column tiles of 8; padding reads zeros)
constexpr int kWgradCols = kWgradDepth / 8;

// dy[e .. e + valid - 1] (valid <= 4, dy_e = dy + e) and their mask bits (bit
// j: element e + j); zero bits past `valid`, no access there. vec4 (e % 4 ==
// 0, dy 4-element aligned, valid 0 or 4): one vector load and one mask word;
// otherwise scalar loads and two mask words (the second only where the run
// crosses into it).
template <typename T>
__device__ __forceinline__ void load_dz4(const T* dy_e, const u32* mask, long long e, int valid,
                                         bool vec4, T (&d)[4], u32& bits) {
  const u32* m = mask + (e >> 5);
  const int sh = (int)(e & 31);
  if (vec4) {
    ldg4_if(dy_e, valid > 0, d);
    bits = ldg_if(m, valid > 0) >> sh;
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) d[j] = ldg_if(dy_e + j, j < valid);
  const u32 lo = ldg_if(m, valid > 0), hi = ldg_if(m + 1, sh + valid > 32);
  bits = __funnelshift_r(lo, hi, sh);
}

// The bulk path's dy (_conv.wgrad_bulk: a tile's positions in each channel
// are one run of dy, starting at an even element), for one block: its copies
// into raw rows [kBN][kRawStride<T> bytes], and the mask words of its bits,
// realigned (bit p of a line's 4 words: position p of the run).
template <typename T, bool kTmap>
struct DyRuns {
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16 bytes
  static constexpr int kRawBytes = kBN * kRawStride<T>;
  const ConvParams* p;
  const T* dy;
  const TensorMap* map;  // kTmap: dy's tensor map
  int tile_n, rows_per_tile, cols;
  long long out_plane;

  // The first element of tile `tile`'s line 0, and the run's length.
  __device__ __forceinline__ void run(int tile, long long& e0, int& len) const {
    const int th = tile % p->tiles_h, tw = (tile / p->tiles_h) % p->tiles_w;
    const int n = tile / (p->tiles_w * p->tiles_h);
    const int oh0 = th * rows_per_tile, ow0 = tw * cols;
    e0 = ((long long)n * p->cout + tile_n) * out_plane + (long long)oh0 * p->ow + ow0;
    len = (min(rows_per_tile, p->oh - oh0) - 1) * p->ow + min(cols, p->ow - ow0);
  }

  // Warp 0 has the copy engine bring each line's run of dy, widened to whole
  // 16-byte units (the run's first element lands e % kVec elements into its
  // row), into the rows at shared address dst; each lane counts its own bytes
  // on `bar`. Lines past cout are not copied (their rows' sums are never
  // written).
  __device__ __forceinline__ void issue(int tile, u32 dst, u32 bar, int lane) const {
    if (kTmap) {  // one box: every line's run, from the 16-byte unit it starts in
      const int th = tile % p->tiles_h, tw = (tile / p->tiles_h) % p->tiles_w;
      const int n = tile / (p->tiles_w * p->tiles_h);
      const int pos = th * rows_per_tile * p->ow + tw * cols;  // in the plane (< 2^31)
      bar_expect(bar, lane == 0 ? kRawBytes : 0);
      if (lane == 0) tensor_copy_3d(dst, *map, pos & -kVec, tile_n, n, bar);
      return;
    }
    long long e0;
    int len;
    run(tile, e0, len);
    const int lines = min(kBN, p->cout - tile_n);
    u32 bytes = 0;
    for (int line = lane; line < lines; line += 32) {
      const int shift = (int)((e0 + line * out_plane) & (kVec - 1));
      bytes += ((shift + len + kVec - 1) / kVec) * 16;
    }
    bar_expect(bar, bytes);
    for (int line = lane; line < lines; line += 32) {
      const long long e = e0 + line * out_plane;
      const int shift = (int)(e & (kVec - 1));
      bulk_copy(dst + line * kRawStride<T>, dy + (e - shift),
                ((shift + len + kVec - 1) / kVec) * 16, bar);
    }
  }

  // Without the copy engine (dy not 16-byte aligned): each line's run by
  // plain loads into its row from the row's start (a warp per line), zeros
  // past the run and for lines past cout.
  __device__ __forceinline__ void load(int tile, T* rows, int tid) const {
    long long e0;
    int len;
    run(tile, e0, len);
    const int lines = min(kBN, p->cout - tile_n);
#pragma unroll 2
    for (int line = tid >> 5; line < kBN; line += kConvThreads / 32) {
      T v[kBM / 32];
#pragma unroll
      for (int i = 0; i < kBM / 32; ++i) {
        const int at = (tid & 31) + 32 * i;
        v[i] = ldg_if(dy + e0 + line * out_plane + at, line < lines && at < len);
      }
#pragma unroll
      for (int i = 0; i < kBM / 32; ++i) rows[line * (kBM + 8) + (tid & 31) + 32 * i] = v[i];
    }
  }

  // The mask words of tile `tile`, by plain loads: item k = tid + 128 i of
  // line k / 4 takes bits 32 (k % 4) on of its run from two words (clamped to
  // the run's last word; bits past the run are never used).
  __device__ __forceinline__ void mask_words(int tile, int tid, u32 (&mw)[2][2]) const {
    static_assert(kBN * 4 == 2 * kConvThreads, "two mask items per thread");
    long long e0;
    int len;
    run(tile, e0, len);
    const int lines = min(kBN, p->cout - tile_n);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = tid + i * kConvThreads, line = k >> 2;
      const long long e = e0 + line * out_plane, last = (e + len - 1) >> 5;
      const long long w0 = (e >> 5) + (k & 3);
      mw[i][0] = line < lines ? __ldg(p->mask + min(w0, last)) : 0u;
      mw[i][1] = line < lines ? __ldg(p->mask + min(w0 + 1, last)) : 0u;
    }
  }

  // Those words realigned into `maligned` ([kBN][4]: bit p of a line's words
  // is position p of its run).
  __device__ __forceinline__ void realign(int tile, int tid, const u32 (&mw)[2][2],
                                          u32* maligned) const {
    long long e0;
    int len;
    run(tile, e0, len);
    const u32 e_lo = (u32)e0, plane_lo = (u32)out_plane;  // low bits suffice
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = tid + i * kConvThreads;
      maligned[k] = __funnelshift_r(mw[i][0], mw[i][1], (e_lo + (u32)(k >> 2) * plane_lo) & 31u);
    }
  }

  // Where line `line`'s run starts in its row (bytes); rows by plain loads
  // (`load`) start at 0.
  __device__ __forceinline__ u32 shift_bytes(int tile, int line) const {
    long long e0;
    int len;
    run(tile, e0, len);
    return (((u32)e0 + (u32)line * (u32)out_plane) & (kVec - 1)) * sizeof(T);
  }
};

// The block's elementwise functor (its slope and 1 / divisor from p).
template <typename T>
__device__ __forceinline__ DivLeakyRelu<T> block_op(const ConvParams& p) {
  Params ap;
  ap.slope = p.slope;
  ap.scale = p.scale;
  return DivLeakyRelu<T>(ap);
}

// Where wgrad_step's A operand (dz, channel rows g + 8h + 16i of this warp's
// 32, positions p0 + 2t and p0 + 2t + 1) comes from. DzFloats: the dz tile
// the register path formed; DzRaw: formed here from raw dy and the mask words
// the bulk copies brought (each value is loaded by one thread once, so dz is
// computed once either way).
struct DzFloats {
  u32 row;  // the shared address of this thread's dz row at position p0 + 2t
  __device__ __forceinline__ void operator()(int i, int h, float& v0, float& v1) const {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                 : "=f"(v0), "=f"(v1)
                 : "r"(row + (i * 16 + h * 8) * kDS * 4));
  }
};

template <typename T>
struct DzRaw {
  u32 row;   // the shared address of this thread's dy row at position p0 + 2t
  u32 mrow;  // its mask row's word p0 / 32 (realigned: 4 words, bit p = position p)
  int sh;    // the bit of position p0 + 2t in that word
  const DivLeakyRelu<T>& op;
  __device__ __forceinline__ void operator()(int i, int h, float& v0, float& v1) const {
    const int line = i * 16 + h * 8;
    union {
      T e[2];
      u32 w[sizeof(T) / 2];
    } d;
    if (sizeof(T) == 4)
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];"
                   : "=r"(d.w[0]), "=r"(d.w[sizeof(T) / 2 - 1])
                   : "r"(row + line * kRawStride<T>));
    else
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(d.w[0]) : "r"(row + line * kRawStride<T>));
    u32 bits;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(bits) : "r"(mrow + line * 16));
    bits >>= sh;
    v0 = Num<T>::to_op(op.backward(d.e[0], bits & 1u));
    v1 = Num<T>::to_op(op.backward(d.e[1], (bits >> 1) & 1u));
  }
};

// The bias gradient of one-pass float32 as float sums of dz (each thread its
// positions' values per channel row, reduced over the quad at the end): FP32
// accuracy without a small TF32 part of dz and its MMAs. Three passes (and
// 16-bit inputs, exact in TF32) keep it on the tensor cores as a column of ones.
template <typename T, int kPasses>
constexpr bool kFaddBias = kPasses == 1 && sizeof(T) == 4;

// acc += dz * patch and accb += dz * 1 over 8 positions (p0 .. p0 + 7 of the
// tile) of this warp. The MMA's reduction index k = t, t + 4 stands for
// positions p0 + 2t, p0 + 2t + 1 (any order of the sum's terms serves, if A
// and B agree), so that a thread's two dz values lie side by side. load_a
// gives those two values of its rows (DzFloats or DzRaw); kb_addr the shared
// address of its B columns' patch offsets, mo0 / mo1 the patch offsets of
// positions p0 + 2t and p0 + 2t + 1 (bytes), ones the B operand of a column
// of ones (the bias gradient is dz times it, on the tensor cores; one-pass
// float32 sums the floats, kFaddBias). kGuard: positions of the step outside
// the output (`live` bit j: position p0 + 2t + j exists) take zero patch
// operands.
template <typename T, int kPasses, bool kGuard, class A>
__device__ __forceinline__ void wgrad_step(float (&acc)[2][kWgradCols][4], float (&accb)[2][4],
                                           const A& load_a, u32 kb_addr, u32 patch_addr,
                                           int mo0, int mo1, u32 live, const u32 (&ones)[2]) {
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  static_assert(kWgradCols % 3 == 0, "column tiles in groups of three");
  u32 a[2][2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // channel g or g + 8: positions 2t, 2t + 1 (k = t, t + 4)
      float v0, v1;
      load_a(i, h, v0, v1);
      if (kGuard) {  // positions past the output: zero dz too (the bulk path's raw values are not)
        v0 = live & 1u ? v0 : 0.f;
        v1 = live & 2u ? v1 : 0.f;
      }
      split<kPasses>(v0, a[0][i][h], a[1][i][h]);  // one pass: big alone (kFaddBias)
      split<kPasses>(v1, a[0][i][h + 2], a[1][i][h + 2]);
      if (kFaddBias<T, kPasses>) {  // rows g, g + 8: accb[i][0], accb[i][2]
        accb[i][2 * h] = add_rn(accb[i][2 * h], v0);
        accb[i][2 * h] = add_rn(accb[i][2 * h], v1);
      }
    }
  // Column tiles in groups of three: each pass's MMAs over a group are six
  // independent accumulators back to back (the three passes of one
  // accumulator in a row would wait on each other), with the group's B
  // operands only in registers.
#pragma unroll
  for (int j0 = 0; j0 < kWgradCols; j0 += 3) {
    u32 b[3][2][2];
#pragma unroll
    for (int jj = 0; jj < 3; ++jj) {
      u32 kb;  // the offset of column 8 (j0 + jj) + g (a table: registers are short)
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(kb) : "r"(kb_addr + (j0 + jj) * 32));
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        lds<kParts, kPatchPart * 4>(patch_addr + (q ? mo1 : mo0) + kb, b[jj][0][q], b[jj][1][q]);
        if (kGuard && !((live >> q) & 1u)) b[jj][0][q] = b[jj][1][q] = 0u;
      }
    }
    if (kPasses == 3) {
#pragma unroll
      for (int jj = 0; jj < 3; ++jj)
#pragma unroll
        for (int i = 0; i < 2; ++i) mma_tf32(acc[i][j0 + jj], a[1][i], b[jj][0]);
#pragma unroll
      for (int jj = 0; jj < 3; ++jj)
#pragma unroll
        for (int i = 0; i < 2; ++i) mma_tf32(acc[i][j0 + jj], a[0][i], b[jj][1]);
    }
#pragma unroll
    for (int jj = 0; jj < 3; ++jj)
#pragma unroll
      for (int i = 0; i < 2; ++i) mma_tf32(acc[i][j0 + jj], a[0][i], b[jj][0]);
  }
  if (kFaddBias<T, kPasses>) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (kPasses == 3) mma_tf32(accb[i], a[1][i], ones);
    mma_tf32(accb[i], a[0][i], ones);
  }
}

}  // namespace cupy_act
