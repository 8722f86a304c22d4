// conv2d_wgrad.cu: the fused convolution block's weight and bias gradients,
// read once from the upstream gradient, the forward's 1-bit mask and x.
//
//   conv2d_wgrad_kernel<T, kPasses, kChannelsLast>      (grid: splits x column tiles x chunks)
//     part[s][co][k] = sum over the positions m of split s of dz[m][co] * patch[m][k]
//     part[splits][cout] + [s][co] = sum over the same positions of dz[m][co]
//   conv2d_wgrad_finish<T>
//     gw[co][k] = sum over s of part[s][co][k]; gb[co] likewise, in order of s
//
// dz = d loss / d (conv + bias) is the elementwise op's backward of dy and the
// mask bit (DivLeakyRelu<T>::backward, so it rounds as the mask backward
// kernel and eager PyTorch do), formed while dy is copied into shared memory:
// it never goes to memory.
//
// An implicit GEMM on tensor cores, the forward's transposed: rows co (the
// block's 64 output channels), columns k = (ci, kh, kw) of one chunk of cc
// input channels (at most 72 of depth), reduced over output positions m. Each
// block walks a fixed, contiguous run of 128-position tiles (the forward's
// rectangles) and per tile copies dz (A: [co][m], split as x is) and the input
// patch (B: [m][k] at moff(m) + koff(k), as in the forward) into shared
// memory. Warp w takes channels 32 (w & 1) .. + 31 and half the tile's
// positions, 64 (w >> 1) .. + 63; the two halves' sums are added in shared
// memory at the end, in a fixed order. Precision as the forward's: 3xTF32
// for float32 ("fp32"), one TF32 pass otherwise; float32 accumulation.
//
// Deterministic: a split's tiles, the warps' order of positions and the final
// sum over splits (in double, in order of s) are fixed by the shape and the
// device's SM count (the number of splits), so the same inputs give the same
// bits on every run.
//
// Non-finite values: an inf or NaN in dy or x propagates as in the FP32 sum
// (see split()). Positions past the output's edge in a tile have dz = 0 and
// read patch values that no real position may read; 0 * inf there would be a
// NaN the reference does not have, so the MMAs of an 8-position step that
// holds such positions zero their patch operands (guarded steps), and steps
// with none of the output's positions are skipped.
#include "conv2d_tiles.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

constexpr int kDS = kBM + 4;       // dz tile row stride: [kBN][kDS], (4g + t) % 32 distinct
constexpr int kDzPart = kBN * kDS;  // words from a dz word to its small part
constexpr int kWgradDepth = 72;     // the most depth per chunk (9 column tiles of 8)

// The mask bits of elements e .. e + valid - 1 (valid <= 4), bit j = element e + j.
__device__ __forceinline__ u32 mask_bits4(const u32* mask, long long e, int valid) {
  if (valid <= 0) return 0u;
  const long long wi = e >> 5;
  const int sh = (int)(e & 31);
  u32 bits = __ldg(mask + wi) >> sh;
  if (sh + valid > 32) bits |= __ldg(mask + wi + 1) << (32 - sh);
  return bits & ((1u << valid) - 1u);
}

// acc += dz * patch over 8 positions (p0 .. p0 + 7 of the tile) of this
// warp: a_row the shared address of its A row at position p0, kb its B
// columns' patch offsets, mo0 / mo1 the patch offsets of positions p0 + t
// and p0 + t + 4 (bytes). kGuard: positions of the step outside the output
// (`live` bit j: position p0 + t + 4j exists) take zero patch operands.
template <int kPasses, bool kGuard>
__device__ __forceinline__ void wgrad_step(float (&acc)[2][9][4], u32 a_row, const int (&kb)[9],
                                           u32 patch_addr, int mo0, int mo1, int nj, u32 live) {
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  u32 a[2][2][4], b[2][9][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q)  // q: (channel g or g + 8) x (position t or t + 4)
      lds<kParts, kDzPart * 4>(a_row + (i * 16 * kDS + (q & 1) * 8 * kDS + (q >> 1) * 4) * 4,
                               a[0][i][q], a[1][i][q]);
#pragma unroll
  for (int j = 0; j < 9; ++j) {
    if (j < nj) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        lds<kParts, kPatchPart * 4>(patch_addr + (q ? mo1 : mo0) + kb[j], b[0][j][q], b[1][j][q]);
        if (kGuard && !((live >> q) & 1u)) b[0][j][q] = b[1][j][q] = 0u;
      }
    }
  }
  if (kPasses == 3) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 9; ++j)
        if (j < nj) mma_tf32(acc[i][j], a[1][i], b[0][j]);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 9; ++j)
        if (j < nj) mma_tf32(acc[i][j], a[0][i], b[1][j]);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 9; ++j)
      if (j < nj) mma_tf32(acc[i][j], a[0][i], b[0][j]);
}

// load_patch's NCHW case with more loads in flight: the block's threads walk
// (patch row, 4-column group) items kBatch at a time, all loads of a batch
// issued before any conversion (one memory latency per batch, not per row).
template <typename T, int kPasses, int kBatch>
__device__ __forceinline__ void load_patch_nchw(u32* patch, const ConvParams& p, const T* xn,
                                                int c0, int ih_base, int iw_base, int tid) {
  const int groups = (p.patch_w + 3) >> 2;
  const int items = p.cc * p.patch_h * groups;
  for (int i0 = tid; i0 < items; i0 += kBatch * kConvThreads) {
    float v[kBatch][4];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int item = i0 + b * kConvThreads;
      const int row = item / groups, pc = (item - row * groups) * 4;
      const int c = row / p.patch_h, ih = ih_base + row - c * p.patch_h;
      const bool row_ok = item < items && (unsigned)ih < (unsigned)p.h && c0 + c < p.cin;
      const T* src = xn + ((long long)(c0 + c) * p.h + ih) * p.w_in + iw_base + pc;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        v[b][j] = row_ok && (unsigned)(iw_base + pc + j) < (unsigned)p.w_in
                      ? Num<T>::to_op(src[j])
                      : 0.f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int item = i0 + b * kConvThreads;
      if (item >= items) break;
      const int row = item / groups, pc = (item - row * groups) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (pc + j < p.patch_w) put_split<kPasses>(patch + row * p.patch_w, pc + j, kPatchPart, v[b][j]);
    }
  }
}

template <typename T, int kPasses, bool kChannelsLast>
__global__ void __launch_bounds__(kConvThreads, 2) conv2d_wgrad_kernel(const ConvParams p) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  extern __shared__ __align__(16) float smem[];
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.y);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cols = 1 << p.c_log2;
  const int col_tiles = (p.cout + kBN - 1) / kBN;
  const int tile_n = (blockIdx.y % col_tiles) * kBN;
  const int c0 = (blockIdx.y / col_tiles) * p.cc;  // this block's chunk of input channels
  const int khw = p.kh * p.kw;
  const int k_total = p.cin * khw;
  const int kc = min(p.cc, p.cin - c0) * khw;  // this chunk's real depth
  const int plane = p.patch_h * p.patch_w;

  // Shared memory (see _conv.wgrad_tiling): koff [kc_pad] | the patch ([cc + 1]
  // planes, the last one zero; small parts at + kPatchPart), reused at the
  // end for the two halves' sums | dz [kBN][kDS] (small parts at + kDzPart) |
  // bias sums [kBN].
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  int* koff = reinterpret_cast<int*>(smem);
  u32* patch = reinterpret_cast<u32*>(smem) + p.kc_pad;
  const int patch_words = kParts == 2 ? 2 * kPatchPart : (p.cc + 1) * plane;
  const int region = patch_words > kBN * kWgradDepth ? patch_words : kBN * kWgradDepth;
  u32* dzs = patch + ((region + 3) & ~3);  // 16-byte aligned (kc_pad is a multiple of 8)
  float* bsum = reinterpret_cast<float*>(dzs + kParts * kDzPart);

  build_koff(koff, p, tid);
  for (int i = tid; i < plane; i += kConvThreads)
    put_split<kPasses>(patch, p.cc * plane + i, kPatchPart, 0.f);
  for (int i = tid; i < kBN; i += kConvThreads) bsum[i] = 0.f;
  __syncthreads();

  // This thread's A row (channel 32 wm + g, position t) and B columns (depth
  // 8j + g of each column tile j < nj: the byte offsets koff, kept in registers).
  const int wm = warp & 1, wk = warp >> 1;
  const int nj = p.kc_pad >> 3;
  const u32 patch_addr = (u32)__cvta_generic_to_shared(patch);
  const u32 a_row = (u32)__cvta_generic_to_shared(dzs) + ((wm * 32 + g) * kDS + t) * 4;
  int kb[9];
#pragma unroll
  for (int j = 0; j < 9; ++j) kb[j] = j < nj ? koff[8 * j + g] : 0;

  Params ap;  // the elementwise functor's scalars
  ap.slope = p.slope;
  ap.scale = p.scale;
  const DivLeakyRelu<T> op(ap);
  const long long out_plane = (long long)p.oh * p.ow;
  const int tiles = p.n * p.tiles_h * p.tiles_w;
  const int rows_per_tile = kBM >> p.c_log2;
  const int image = p.cin * p.h * p.w_in;  // < 2^31 (_conv.fits)
  const int tile_first = blockIdx.x * p.tiles_per_split;
  const int tile_end = min(tiles, tile_first + p.tiles_per_split);
  float bacc[2] = {0.f, 0.f};  // NHWC: dz sums of this lane's channels lane, 32 + lane

  float acc[2][9][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 9; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  for (int tile = tile_first; tile < tile_end; ++tile) {
    const int tw = tile % p.tiles_w;
    const int th = (tile / p.tiles_w) % p.tiles_h;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th * rows_per_tile, ow0 = tw * cols;
    const int rows = min(rows_per_tile, p.oh - oh0), row_len = min(cols, p.ow - ow0);
    __syncthreads();  // the previous tile's MMAs are done with the patch and dz
    if (kChannelsLast)
      load_patch<T, kPasses, true>(patch, p, x + (long long)n * image, c0, oh0 * p.sh - p.ph,
                                   ow0 * p.sw - p.pw, tid);
    else
      load_patch_nchw<T, kPasses, 4>(patch, p, x + (long long)n * image, c0, oh0 * p.sh - p.ph,
                                     ow0 * p.sw - p.pw, tid);
    // dz into shared memory, [channel][position], zero past the output's edge;
    // each lane stores 4 consecutive positions of one channel (16 bytes: a
    // quarter warp's stores cover the 32 banks once).
    if (!kChannelsLast) {  // a warp per channel, a lane per 4 positions of its row
      const int lane4 = lane * 4;
      const int row = lane4 >> p.c_log2, col = lane4 & (cols - 1);
      const int valid = row < rows ? max(0, min(4, row_len - col)) : 0;
      const long long e_lane =
          ((long long)n * p.cout + tile_n) * out_plane + (long long)(oh0 + row) * p.ow + ow0 + col;
      constexpr int kLines = 8;  // lines per batch: their loads in flight together
      for (int line0 = warp; line0 < kBN; line0 += kLines * kConvThreads / 32) {
        T d[kLines][4];
        u32 bits[kLines];
#pragma unroll
        for (int b = 0; b < kLines; ++b) {
          const int line = line0 + b * (kConvThreads / 32);
          const int ok = tile_n + line < p.cout ? valid : 0;
          const long long e = e_lane + line * out_plane;
          load4_raw(dy + e, ok, ((u64)(dy + e) & (4 * sizeof(T) - 1)) == 0, d[b]);
          bits[b] = mask_bits4(p.mask, e, ok);
        }
#pragma unroll
        for (int b = 0; b < kLines; ++b) {
          const int line = line0 + b * (kConvThreads / 32);
          const int ok = tile_n + line < p.cout ? valid : 0;
          float v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j)
            v[j] = j < ok ? Num<T>::to_op(op.backward(d[b][j], (bits[b] >> j) & 1u)) : 0.f;
          put_split4<kPasses>(dzs, line * kDS + lane4, kDzPart, v);
          if (blockIdx.y < col_tiles) {  // the first chunk's blocks sum the bias gradient
            float s = add_rn(add_rn(add_rn(v[0], v[1]), v[2]), v[3]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s = add_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
            if (lane == 0) bsum[line] = add_rn(bsum[line], s);
          }
        }
      }
    } else {  // a warp per 4 positions, a lane per channel (two halves of 32)
      for (int ml = warp * 4; ml < kBM; ml += kConvThreads / 8) {
        T d[2][4];
        u32 bit[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // the loads first: 8 in flight
            const int co = tile_n + h * 32 + lane;
            const int r = (ml + j) >> p.c_log2, c = (ml + j) & (cols - 1);
            d[h][j] = Num<T>::zero();
            bit[h][j] = 0u;
            if (r < rows && c < row_len && co < p.cout) {
              const long long e = (((long long)n * p.oh + oh0 + r) * p.ow + ow0 + c) * p.cout + co;
              d[h][j] = dy[e];
              bit[h][j] = __ldg(p.mask + (e >> 5)) >> (e & 31);
            }
          }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int r = (ml + j) >> p.c_log2, c = (ml + j) & (cols - 1);
            const bool ok = r < rows && c < row_len && tile_n + h * 32 + lane < p.cout;
            v[j] = ok ? Num<T>::to_op(op.backward(d[h][j], bit[h][j] & 1u)) : 0.f;
            bacc[h] = add_rn(bacc[h], v[j]);
          }
          put_split4<kPasses>(dzs, (h * 32 + lane) * kDS + ml, kDzPart, v);
        }
      }
    }
    __syncthreads();

    // The MMAs over this warp's half of the tile, 8 positions a step (a step
    // lies in one output row of the rectangle: C >= 32).
    for (int p0 = wk * 64; p0 < wk * 64 + 64; p0 += 8) {
      const int r = p0 >> p.c_log2, c = p0 & (cols - 1);
      if (r >= rows || c >= row_len) continue;  // no output position in the step
      const int mo = r * p.sh * p.patch_w + c * p.sw;
      const int mo0 = (mo + t * p.sw) * 4, mo1 = (mo + (t + 4) * p.sw) * 4;
      const u32 a_step = a_row + p0 * 4;
      if (c + 8 <= row_len) {
        wgrad_step<kPasses, false>(acc, a_step, kb, patch_addr, mo0, mo1, nj, 3u);
      } else {
        const u32 live = (u32)(c + t < row_len) | (u32)(c + t + 4 < row_len) << 1;
        wgrad_step<kPasses, true>(acc, a_step, kb, patch_addr, mo0, mo1, nj, live);
      }
    }
  }
  __syncthreads();  // done with the patch: the halves' sums take its place

  // The second half's sums into shared memory, added to the first half's in
  // order, then this split's partial weight gradient out.
  float* red = reinterpret_cast<float*>(patch);  // [kBN][kWgradDepth]
  if (wk == 1) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (j < nj)
            red[(wm * 32 + i * 16 + g + (q >> 1) * 8) * kWgradDepth + 8 * j + 2 * t + (q & 1)] =
                acc[i][j][q];
  }
  __syncthreads();
  const int k_first = c0 * khw;
  float* part = p.part + (long long)blockIdx.x * p.cout * k_total;
  if (wk == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int col = wm * 32 + i * 16 + g + (q >> 1) * 8;
          const int k = 8 * j + 2 * t + (q & 1);
          if (j < nj && k < kc && tile_n + col < p.cout)
            part[(long long)(tile_n + col) * k_total + k_first + k] =
                add_rn(acc[i][j][q], red[col * kWgradDepth + k]);
        }
  }
  if (blockIdx.y >= col_tiles) return;  // the bias gradient: the first chunk's blocks
  float* bpart = p.part + (long long)p.splits * p.cout * k_total + (long long)blockIdx.x * p.cout;
  if (kChannelsLast) {
    __syncthreads();  // the halves' sums are read: the warps' bias sums take their place
#pragma unroll
    for (int h = 0; h < 2; ++h) red[warp * kBN + h * 32 + lane] = bacc[h];
    __syncthreads();
    for (int i = tid; i < kBN; i += kConvThreads)
      if (tile_n + i < p.cout)
        bpart[tile_n + i] =
            add_rn(add_rn(add_rn(red[i], red[kBN + i]), red[2 * kBN + i]), red[3 * kBN + i]);
  } else {
    for (int i = tid; i < kBN; i += kConvThreads)
      if (tile_n + i < p.cout) bpart[tile_n + i] = bsum[i];
  }
}

// float -> double, exactly (inline PTX: under -ftz a C cast flushes subnormals).
__device__ __forceinline__ double to_double(float v) {
  double d;
  asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v));
  return d;
}

// A double rounded to T: to float first (no flush: inline PTX), then to T.
template <typename T>
__device__ __forceinline__ T from_double(double v) {
  float f;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(v));
  return Num<T>::from_op(f);
}

// gw[i] = sum over s of part[s][i] (i over cout * K), gb[co] likewise from the
// bias partials; summed in double in order of s, rounded once to T.
template <typename T>
__global__ void conv2d_wgrad_finish(const ConvParams p) {
  const long long k_total = (long long)p.cin * p.kh * p.kw;
  const long long nw = p.cout * k_total;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nw + (p.gb ? p.cout : 0)) return;
  const bool is_w = i < nw;
  const float* src = is_w ? p.part + i : p.part + p.splits * nw + (i - nw);
  const long long stride = is_w ? nw : p.cout;
  double s = 0.0;
  for (int k = 0; k < p.splits; ++k) s += to_double(__ldg(src + (long long)k * stride));
  const T v = from_double<T>(s);
  if (is_w)
    static_cast<T*>(p.gw)[i] = v;
  else
    static_cast<T*>(p.gb)[i - nw] = v;
}

}  // namespace cupy_act
