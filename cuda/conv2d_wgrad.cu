// conv2d_wgrad.cu: the fused convolution block's weight and bias gradients,
// read once from the upstream gradient, the forward's 1-bit mask and x.
//
//   conv2d_wgrad_kernel<T, kPasses, kChannelsLast, kStages>  (grid: splits x column tiles x chunks)
//   conv2d_wgrad_kernel_tmap<T, kPasses, kStages>  (the same, dy by tensor copies)
//   conv2d_wgrad_kernel_wg<T, kPasses, kDy>, _wg_tmap<T, kPasses>  (sm_90a, 3 x 3 at
//     stride 1: the same sums on warpgroup MMAs, see "On warpgroup MMAs" below)
//     part[s][co][k] = sum over the positions m of split s of dz[m][co] * patch[m][k]
//     part[splits][cout] + [s][co] = sum over the same positions of dz[m][co]
//   conv2d_wgrad_finish<T>
//     gw[co][k] = sum over s of part[s][co][k]; gb[co] likewise (ranges of s per warp, in order)
//
// dz = d loss / d (conv + bias) is the elementwise op's backward of dy and the
// mask bit (DivLeakyRelu<T>::backward, so it rounds as the mask backward
// kernel and eager PyTorch do), formed while dy is copied into shared memory:
// it never goes to memory.
//
// An implicit GEMM on tensor cores, the forward's transposed: rows co (the
// block's 64 output channels), columns k = (ci, kh, kw) of one chunk of cc
// input channels (at most 72 of depth, always 9 column tiles of 8: padding
// depth reads a zero plane, so no MMA sits behind a branch), reduced over
// output positions m. The bias gradient is a tenth column tile, all ones
// (one-pass float32: float sums of dz instead, kFaddBias).
// Each block walks a fixed, contiguous run of 128-position tiles (the
// forward's rectangles, output rows fastest) and per tile copies dz (A:
// [co][m], floats, split into TF32 parts as its fragments are loaded: each is
// loaded once) and the input patch (B: [m][k] at moff(m) + koff(k), split as
// it is stored: each is read up to kh x kw times) into shared memory. One-row
// tiles (NCHW, C = 128) keep the patch as a ring of rows, so that the next
// output row copies only the sh input rows it does not share. Warp w takes
// channels 32 (w & 1) .. + 31 and half the tile's positions, 64 (w >> 1) ..
// + 63; the two halves' sums are added in shared memory at the end, in a
// fixed order. Precision as the forward's: 3xTF32 for float32 ("fp32"), one
// TF32 pass otherwise (the bias gradient keeps FP32 accuracy either way);
// float32 accumulation. 140-168 registers and at most 75 KB of shared memory
// (67 KB at the seed shape with 3xTF32): three blocks per SM.
//
// The bulk-copy path (kStages > 0; sm_90, NCHW, a tile's positions in each
// channel one run of dy from an even element: _conv.wgrad_bulk): warp 0 has
// the copy engine bring each line's run (widened to whole 16-byte units)
// into shared memory, completing on an mbarrier, while the block copies the
// patch; each thread loads a few mask words (plain loads: a bulk copy of a
// few words per line doubled the copy engine's operations and cost 12-15%)
// and realigns them, and dz is formed as the A fragments load (DzRaw), so dy
// never passes through registers on its way in. The register path forms dz
// while copying it (load_dz4: scalar loads where runs are not 16-byte
// aligned, as at 126-wide outputs). Where dy's planes lie a whole number of
// 16-byte units apart (every line's run then starts at the same offset in its
// unit), conv2d_wgrad_kernel_tmap has the copy engine bring all of a tile's
// lines in one tensor copy (a box of kBM + 8 elements from that unit, 64
// lines: the same rows), instead of one bulk copy per line: Nsight at the
// seed shape on H200, float32 647.8 -> 564.2 us, "fused_tf32" 477.1 ->
// 375.4, float16 (128-wide, padding 1) 508.8 -> 401.3. All paths sum the same
// terms in the same order: the same bits.
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
#include "wgmma.cuh"
#include "copy_engine.cuh"
#include "conv2d_wgrad_dz.cuh"

namespace cupy_act {

// The kernels' body; kTmap (with kStages > 0): dy by tensor copies of dy_map.
template <typename T, int kPasses, bool kChannelsLast, int kStages, bool kTmap>
__device__ __forceinline__ void wgrad_tiles(const ConvParams& p, const TensorMap* dy_map) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  static_assert(kStages == 0 || !kChannelsLast, "the bulk copies take NCHW lines");
  static_assert(!kTmap || kStages > 0, "the tensor copies are a bulk path");
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

  // Shared memory (see _conv.wgrad_tiling): koff [kWgradDepth] | this tile's
  // B column offsets kbt [kWgradDepth] | the patch ([cc + 1] planes of PH
  // rows, the last plane zero; small parts at + kPatchPart), reused at the
  // end for the two halves' sums | dz [kBN][kDS], as floats, or with bulk
  // copies (kStages > 0) per stage raw dy [kBN][kRawStride bytes], the
  // realigned mask [kBN][4] and per stage an mbarrier | the halves' bias
  // sums [kBN]. Tensor copies (kTmap) fill the same raw dy rows from the
  // first 128-byte boundary on.
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  int* koff = reinterpret_cast<int*>(smem);
  int* kbt = koff + kWgradDepth;
  u32* patch = reinterpret_cast<u32*>(smem) + 2 * kWgradDepth;
  const int patch_words = kParts == 2 ? 2 * kPatchPart : (p.cc + 1) * plane;
  const int region = patch_words > kBN * kWgradDepth ? patch_words : kBN * kWgradDepth;
  float* dzs = reinterpret_cast<float*>(patch + ((region + 3) & ~3));  // 16-byte aligned
  constexpr int kRawBytes = kBN * kRawStride<T>;
  constexpr int kDzBytes =
      kStages == 0 ? kBN * kDS * 4 : kStages * (kRawBytes + 8) + kBN * 16 + (kTmap ? 128 : 0);
  float* bsum = dzs + kDzBytes / 4;
  const u32 dzs_addr = (u32)__cvta_generic_to_shared(dzs);
  const u32 raw0 = kTmap ? (dzs_addr + 127) & ~127u : dzs_addr;
  u32* maligned = reinterpret_cast<u32*>(reinterpret_cast<char*>(dzs) + (raw0 - dzs_addr) +
                                         kStages * kRawBytes);
  const u32 bar0 = (u32)__cvta_generic_to_shared(maligned + kBN * 4);
  if (kStages > 0 && tid == 0)
    for (int s = 0; s < kStages; ++s) bar_init(bar0 + 8 * s, 32);

  // koff[k], depth k = (ci, r, s) of the chunk: the patch word of its channel
  // plane and column, ci * plane + s * dw (< 2^16: the patch is at most 75
  // KB), and (bits 16 up) its row r * dh (< PH); depth past the chunk's
  // points at the zero plane.
  for (int k = tid; k < kWgradDepth; k += kConvThreads) {
    int e = p.cc * plane;
    if (k < kc) {
      const int ci = k / khw, rs = k - ci * khw, r = rs / p.kw, s = rs - r * p.kw;
      e = (ci * plane + s * p.dw) | (r * p.dh) << 16;
    }
    koff[k] = e;
  }
  for (int i = tid; i < plane; i += kConvThreads)
    put_split<kPasses>(patch, p.cc * plane + i, kPatchPart, 0.f);
  __syncthreads();

  // This thread's A row (channel 32 wm + g, position 2t) and B columns (depth
  // 8j + g of column tile j: their byte offsets in the patch, kbt, per tile).
  const int wm = warp & 1, wk = warp >> 1;
  const u32 patch_addr = (u32)__cvta_generic_to_shared(patch);
  const u32 a_row = raw0 + ((wm * 32 + g) * kDS + 2 * t) * 4;
  const u32 raw_row = raw0 + (wm * 32 + g) * kRawStride<T> + 2 * t * (int)sizeof(T);
  const u32 mask_row = (u32)__cvta_generic_to_shared(maligned) + (wm * 32 + g) * 16;
  const u32 kb_addr = (u32)__cvta_generic_to_shared(kbt + g);
  const u32 one = g == 0 ? 0x3f800000u : 0u;  // B column 0 all ones, the others zero
  const u32 ones[2] = {one, one};

  const DivLeakyRelu<T> op = block_op<T>(p);
  const long long out_plane = (long long)p.oh * p.ow;
  const int tiles = p.n * p.tiles_h * p.tiles_w;
  const int rows_per_tile = kBM >> p.c_log2;
  const int image = p.cin * p.h * p.w_in;  // < 2^31 (_conv.fits)
  const int tile_first = blockIdx.x * p.tiles_per_split;
  const int tile_end = min(tiles, tile_first + p.tiles_per_split);
  // One-row tiles (NCHW, C = 128) keep the patch as a ring of PH rows per
  // channel: a block's next tile (the next output row: th runs fastest)
  // loads only the sh rows it does not share with the previous one.
  const bool ring = !kChannelsLast && rows_per_tile == 1;
  // NCHW: dy's 4-element runs and the patch's groups line up with vectors.
  const bool dz_vec = (p.ow & 3) == 0 && ((u64)dy & (4 * sizeof(T) - 1)) == 0;
  const bool x_vec = (p.w_in & 3) == 0 && ((u64)x & (4 * sizeof(T) - 1)) == 0;

  const DyRuns<T, kTmap> runs{&p, dy, dy_map, tile_n, rows_per_tile, cols, out_plane};
  auto issue = [&](int tile, int stage) {
    runs.issue(tile, raw0 + stage * kRawBytes, bar0 + 8 * stage, lane);
  };
  if (kStages > 1 && warp == 0)
    for (int s = 0; s < kStages - 1 && tile_first + s < tile_end; ++s) issue(tile_first + s, s);

  float acc[2][kWgradCols][4], accb[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      accb[i][q] = 0.f;
#pragma unroll
      for (int j = 0; j < kWgradCols; ++j) acc[i][j][q] = 0.f;
    }

  for (int tile = tile_first, it = 0; tile < tile_end; ++tile, ++it) {
    const int th = tile % p.tiles_h;
    const int tw = (tile / p.tiles_h) % p.tiles_w;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th * rows_per_tile, ow0 = tw * cols;
    const int rows = min(rows_per_tile, p.oh - oh0), row_len = min(cols, p.ow - ow0);
    // The ring: this tile's first patch row (input row oh0 * sh - ph) sits in
    // slot (oh0 * sh) % PH; after the previous output row only the last
    // min(sh, PH) rows are new.
    const int base = ring ? (oh0 * p.sh) % p.patch_h : 0;
    const int fresh = ring && th > 0 && tile > tile_first ? min(p.sh, p.patch_h) : p.patch_h;
    __syncthreads();  // the previous tile's MMAs are done with the patch, dz and kbt
    if (kStages > 0 && warp == 0 && tile + kStages - 1 < tile_end)
      issue(tile + kStages - 1, (it + kStages - 1) % kStages);
    u32 mw[2][2];  // the bulk path's mask words (DyRuns::mask_words)
    if (kStages > 0) runs.mask_words(tile, tid, mw);
    for (int k = tid; k < kWgradDepth; k += kConvThreads) {  // bytes
      const int e = koff[k];
      kbt[k] = ((e & 0xffff) + ring_slot(base, e >> 16, p.patch_h) * p.patch_w) * 4;
    }
    // The patch, and (register path) dz into shared memory as floats,
    // [channel][position], zero past the output's edge; each lane stores 4
    // consecutive positions of one channel (16 bytes: a quarter warp's stores
    // cover the 32 banks once).
    const bool patch_vec = x_vec && ((ow0 * p.sw - p.pw) & 3) == 0;
    if (kChannelsLast) {
      load_patch<T, kPasses, true>(patch, p, x + (long long)n * image, c0, oh0 * p.sh - p.ph,
                                   ow0 * p.sw - p.pw, tid, 0, p.patch_h, 0);
    } else if (kStages > 0) {  // dy is on its way: the patch alone
      load_patch_nchw<T, kPasses, 2>(patch, p, x + (long long)n * image, c0, oh0 * p.sh - p.ph,
                                     ow0 * p.sw - p.pw, tid, patch_vec, p.patch_h - fresh, fresh,
                                     base);
    } else {  // a warp per channel, a lane per 4 positions of its row
      const int lane4 = lane * 4;
      const int row = lane4 >> p.c_log2, col = lane4 & (cols - 1);
      const int valid = row < rows ? max(0, min(4, row_len - col)) : 0;
      const long long e_lane =
          ((long long)n * p.cout + tile_n) * out_plane + (long long)(oh0 + row) * p.ow + ow0 + col;
      constexpr int kLines = 4;  // lines per batch, their loads in flight together
      constexpr int kStride = kLines * kConvThreads / 32;
      T d[kLines][4];
      u32 bits[kLines];
      auto load_lines = [&](int line0) {
#pragma unroll
        for (int b = 0; b < kLines; ++b) {
          const int line = line0 + b * (kConvThreads / 32);
          const int ok = tile_n + line < p.cout ? valid : 0;
          const long long e = e_lane + line * out_plane;
          load_dz4(dy + e, p.mask, e, ok, dz_vec, d[b], bits[b]);
        }
      };
      auto store_lines = [&](int line0) {
#pragma unroll
        for (int b = 0; b < kLines; ++b) {
          const int line = line0 + b * (kConvThreads / 32);
          const int ok = tile_n + line < p.cout ? valid : 0;
          float4 v;
          float* vj = &v.x;
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // computed for every j, then selected: no branch
            const float dz = Num<T>::to_op(op.backward(d[b][j], (bits[b] >> j) & 1u));
            vj[j] = j < ok ? dz : 0.f;
          }
          *reinterpret_cast<float4*>(dzs + line * kDS + lane4) = v;
        }
      };
      // The first lines' loads are in flight while the patch is copied.
      load_lines(warp);
      load_patch_nchw<T, kPasses, 2>(patch, p, x + (long long)n * image, c0, oh0 * p.sh - p.ph,
                                     ow0 * p.sw - p.pw, tid, patch_vec, p.patch_h - fresh, fresh,
                                     base);
      store_lines(warp);
#pragma unroll 1
      for (int line0 = warp + kStride; line0 < kBN; line0 += kStride) {
        load_lines(line0);
        store_lines(line0);
      }
    }
    if (kChannelsLast) {  // a warp per 4 positions, a lane per channel (two halves of 32)
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
          float4 v;
          float* vj = &v.x;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int r = (ml + j) >> p.c_log2, c = (ml + j) & (cols - 1);
            const bool ok = r < rows && c < row_len && tile_n + h * 32 + lane < p.cout;
            vj[j] = ok ? Num<T>::to_op(op.backward(d[h][j], bit[h][j] & 1u)) : 0.f;
          }
          *reinterpret_cast<float4*>(dzs + (h * 32 + lane) * kDS + ml) = v;
        }
      }
    }

    // The bulk path: wait for this tile's copies, then realign each line's
    // mask bits (bit p: position p) from the words loaded above.
    const int stage = kStages > 0 ? it % kStages : 0;
    u32 shift_bytes = 0;  // where this thread's lines' runs start in their rows
    if (kStages > 0) {
      shift_bytes = runs.shift_bytes(tile, wm * 32 + g);
      bar_wait(bar0 + 8 * stage, (it / kStages) & 1);
      runs.realign(tile, tid, mw, maligned);
    }
    __syncthreads();

    // The MMAs over this warp's half of the tile, 8 positions a step (a step
    // lies in one output row of the rectangle: C >= 32).
    for (int p0 = wk * 64; p0 < wk * 64 + 64; p0 += 8) {
      const int r = p0 >> p.c_log2, c = p0 & (cols - 1);
      if (r >= rows || c >= row_len) continue;  // no output position in the step
      const int mo = r * p.sh * p.patch_w + c * p.sw;
      const int mo0 = (mo + 2 * t * p.sw) * 4, mo1 = mo0 + p.sw * 4;
      const u32 live = (u32)(c + 2 * t < row_len) | (u32)(c + 2 * t + 1 < row_len) << 1;
      if (kStages > 0) {
        const DzRaw<T> a{raw_row + stage * kRawBytes + shift_bytes + p0 * (int)sizeof(T),
                         mask_row + (p0 >> 5) * 4, (p0 & 31) + 2 * t, op};
        if (c + 8 <= row_len)
          wgrad_step<T, kPasses, false>(acc, accb, a, kb_addr, patch_addr, mo0, mo1, 3u, ones);
        else
          wgrad_step<T, kPasses, true>(acc, accb, a, kb_addr, patch_addr, mo0, mo1, live, ones);
      } else if (c + 8 <= row_len) {
        const DzFloats a{a_row + p0 * 4};
        wgrad_step<T, kPasses, false>(acc, accb, a, kb_addr, patch_addr, mo0, mo1, 3u, ones);
      } else {
        const DzFloats a{a_row + p0 * 4};
        wgrad_step<T, kPasses, true>(acc, accb, a, kb_addr, patch_addr, mo0, mo1, live, ones);
      }
    }
  }
  __syncthreads();  // done with the patch: the halves' sums take its place
  if (kFaddBias<T, kPasses>) {  // the quad's sums of each row, in a fixed order
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int q = 0; q < 4; q += 2) {
        accb[i][q] = add_rn(accb[i][q], __shfl_xor_sync(0xffffffffu, accb[i][q], 1));
        accb[i][q] = add_rn(accb[i][q], __shfl_xor_sync(0xffffffffu, accb[i][q], 2));
      }
  }

  // The second half's sums into shared memory, added to the first half's in
  // order, then this split's partial weight (and bias) gradient out. Bias
  // sums: column 0 of accb, in the lanes t == 0 (q = 0: channel g, 2: g + 8).
  float* red = reinterpret_cast<float*>(patch);  // [kBN][kWgradDepth]
  if (wk == 1) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = wm * 32 + i * 16 + g + (q >> 1) * 8;
#pragma unroll
        for (int j = 0; j < kWgradCols; ++j)
          red[col * kWgradDepth + 8 * j + 2 * t + (q & 1)] = acc[i][j][q];
        if (t == 0 && (q & 1) == 0) bsum[col] = accb[i][q];
      }
  }
  __syncthreads();
  if (wk == 1) return;
  const int k_first = c0 * khw;
  float* part = p.part + (long long)blockIdx.x * p.cout * k_total;
  float* bpart = p.part + (long long)p.splits * p.cout * k_total + (long long)blockIdx.x * p.cout;
  const bool with_bias = blockIdx.y < col_tiles;  // the bias: the first chunk's blocks
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int col = wm * 32 + i * 16 + g + (q >> 1) * 8;
      if (tile_n + col >= p.cout) continue;
#pragma unroll
      for (int j = 0; j < kWgradCols; ++j) {
        const int k = 8 * j + 2 * t + (q & 1);
        if (k < kc)
          part[(long long)(tile_n + col) * k_total + k_first + k] =
              add_rn(acc[i][j][q], red[col * kWgradDepth + k]);
      }
      if (with_bias && t == 0 && (q & 1) == 0)
        bpart[tile_n + col] = add_rn(accb[i][q], bsum[col]);
    }
}

template <typename T, int kPasses, bool kChannelsLast, int kStages>
__global__ void __launch_bounds__(kConvThreads, 3) conv2d_wgrad_kernel(const ConvParams p) {
  wgrad_tiles<T, kPasses, kChannelsLast, kStages, false>(p, nullptr);
}

// The bulk path with dy by tensor copies: one copy-engine operation per tile
// instead of one per line (_conv.wgrad_tmap: dy's planes a whole number of
// 16-byte units apart, so that every line's run starts at the same offset in
// its unit, and a box of kBM + 8 elements per line lands as the line copies do).
template <typename T, int kPasses, int kStages>
__global__ void __launch_bounds__(kConvThreads, 3)
    conv2d_wgrad_kernel_tmap(const ConvParams p, const __grid_constant__ TensorMap dy_map) {
  wgrad_tiles<T, kPasses, false, kStages, true>(p, &dy_map);
}

// ---- On warpgroup MMAs (sm_90a) ----
//
// conv2d_wgrad_kernel_wg<T, kPasses, kDy> (kDy 0: dy by plain loads, 1: bulk
// copies per line) and conv2d_wgrad_kernel_wg_tmap<T, kPasses> (tensor
// copies): 3 x 3 filters, stride 1, dilation 1, NCHW, one-row tiles (C =
// 128), chunks of at most 8 input channels (_conv.wgrad_wgmma). The same
// grid, splits and partial sums as the kernels above; the block's 4 warps
// are one warpgroup, warp w taking output channels 16 w .. 16 w + 15 and
// every position of the tile:
//   acc[r][co][(s, ci)] += dz[co][m] * x[ci][oh - ph + r][ow0 + m - pw + s]
// summed over the tile's positions m, 8 a step: per step and pass three
// m64n24k8 wgmmas (one per filter row r), A = dz from registers (DzRaw: from
// the raw dy rows and the realigned mask, as the bulk path forms it), B = the
// input rows expanded in shared memory. Each input row is stored once per
// shift s (its 8 channels x 128 positions, split into TF32 parts), K-major
// core matrices with a step's even positions at depths 0-3 and odd ones at
// 4-7 (the A fragment's depth t is position 2t, t + 4 is 2t + 1: a thread's
// two dz values lie side by side). The expanded rows form a ring of three
// (input row oh - ph + r of output row oh in slot (oh + r) % 3): the next
// output row expands one new row. Positions past the output's edge have zero
// A and B operands (x there may be inf).
//
// The bias gradient sums the dz floats (two FADDs per value, reduced over
// the quad at the end in a fixed order). A block's sums run over all of its
// positions in one order fixed by the shape: deterministic, and the same
// bits whichever way dy came in (the three kDy paths fill the same rows).
// Different bits from the mma.sync kernels (another order of the terms).
constexpr int kWgSteps = kBM / 8;         // 8-position steps per tile
constexpr int kWgGroup = kWgSteps * 256;  // bytes: one shift of a row (8 ch x 128 positions)
constexpr int kWgSlot = 3 * kWgGroup;     // one input row's three shifts
constexpr int kWgPart = 3 * kWgSlot;      // the ring, per TF32 part

// Expands input row ih (image n, channels c0 .. c0 + cc - 1; zeros outside
// the image, past cc and at positions from row_len on) into ring slot `slot`
// (shared address of the ring's big part). Thread (ci = tid % 8, step j =
// tid / 8) loads the 10 values of positions 8j .. 8j + 7 and their two
// shifts, splits each once and stores 16 bytes per core matrix and part.
template <typename T, int kPasses>
__device__ __forceinline__ void expand_row(u32 ring, int slot, const ConvParams& p, const T* x,
                                           int n, int c0, int cc, int ih, int ow0, int row_len,
                                           int tid) {
  const int ci = tid & 7, j = tid >> 3;
  const bool ok = ci < cc && ih >= 0 && ih < p.h;
  const T* src = x + (((long long)n * p.cin + c0 + ci) * p.h + ih) * p.w_in;
  const int col0 = ow0 + 8 * j - p.pw;
  T e[10];  // the loads first: all in flight together
#pragma unroll
  for (int u = 0; u < 10; ++u) {
    const int col = col0 + u;
    e[u] = ldg_if(src + col, ok && col >= 0 && col < p.w_in);
  }
  u32 big[10], small[10];
#pragma unroll
  for (int u = 0; u < 10; ++u) split<kPasses>(Num<T>::to_op(e[u]), big[u], small[u]);
  const int valid = row_len - 8 * j;  // positions of this step inside the output
#pragma unroll
  for (int s = 0; s < 3; ++s) {
    const u32 at = ring + slot * kWgSlot + s * kWgGroup + j * 256 + ci * 16;
#pragma unroll
    for (int part = 0; part < (kPasses == 3 ? 2 : 1); ++part) {
      const u32(&v)[10] = part ? small : big;
      u32 even[4], odd[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        even[e] = 2 * e < valid ? v[2 * e + s] : 0u;
        odd[e] = 2 * e + 1 < valid ? v[2 * e + 1 + s] : 0u;
      }
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                   " st.shared.v4.b32 [%0+128], {%5, %6, %7, %8};"
                   :: "r"(at + part * kWgPart), "r"(even[0]), "r"(even[1]), "r"(even[2]),
                      "r"(even[3]), "r"(odd[0]), "r"(odd[1]), "r"(odd[2]), "r"(odd[3])
                   : "memory");
    }
  }
}

template <bool B>
struct Flag {
  static constexpr bool value = B;
};

// split<3>(x) in fewer operations, where big is finite (x finite and not
// rounding up past the largest TF32 value: then split<3> gives the same
// words); returns whether it is (if not, split<3> must redo it).
__device__ __forceinline__ bool split_finite(float x, u32& big, u32& small) {
  const u32 r = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  float d;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(x), "f"(__uint_as_float(r)));
  big = r;
  small = __float_as_uint(d);
  return finite_bits(r);
}

template <typename T, int kPasses, int kDy>
__device__ __forceinline__ void wgrad_tiles_wg(const ConvParams& p, const TensorMap* dy_map) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  constexpr int kRawBytes = kBN * kRawStride<T>;
  extern __shared__ __align__(16) float smem[];
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.y);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int col_tiles = (p.cout + kBN - 1) / kBN;
  const int tile_n = (blockIdx.y % col_tiles) * kBN;
  const int c0 = (blockIdx.y / col_tiles) * p.cc;  // this block's chunk of input channels
  const int cc = min(p.cc, p.cin - c0);

  // Shared memory (_conv.wgrad_wg_smem), from the first 128-byte boundary:
  // the ring [kParts][3 slots][3 shifts][kWgSteps][2][8][4 words] | raw dy
  // [kBN][kRawStride bytes] | the realigned mask [kBN][4] | an mbarrier.
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  const u32 ring = (s0 + 127) & ~127u;
  const u32 raw0 = ring + kParts * kWgPart;
  T* rows = reinterpret_cast<T*>(reinterpret_cast<char*>(smem) + (raw0 - s0));
  u32* maligned = reinterpret_cast<u32*>(reinterpret_cast<char*>(rows) + kRawBytes);
  const u32 bar = raw0 + kRawBytes + kBN * 16;
  if (kDy > 0 && tid == 0) bar_init(bar, 32);

  const DivLeakyRelu<T> op = block_op<T>(p);
  const long long out_plane = (long long)p.oh * p.ow;
  const int tiles = p.n * p.tiles_h * p.tiles_w;
  const int tile_first = blockIdx.x * p.tiles_per_split;
  const int tile_end = min(tiles, tile_first + p.tiles_per_split);
  const DyRuns<T, kDy == 2> runs{&p, dy, dy_map, tile_n, 1, kBM, out_plane};
  // This thread's A rows: line 16 w + g (and + 8) at position 2t.
  const u32 raw_row = raw0 + (warp * 16 + g) * kRawStride<T> + 2 * t * (int)sizeof(T);
  const u32 mask_row = (u32)__cvta_generic_to_shared(maligned) + (warp * 16 + g) * 16;

  float acc[3][12], accb[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 3; ++r)
#pragma unroll
    for (int i = 0; i < 12; ++i) acc[r][i] = 0.f;

  for (int tile = tile_first, it = 0; tile < tile_end; ++tile, ++it) {
    const int th = tile % p.tiles_h;
    const int tw = (tile / p.tiles_h) % p.tiles_w;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th, ow0 = tw * kBM;
    const int row_len = min(kBM, p.ow - ow0);
    __syncthreads();  // the previous tile's MMAs (waited for) are done with the ring and dy
    if (kDy > 0 && warp == 0) runs.issue(tile, raw0, bar, lane);
    u32 mw[2][2];
    runs.mask_words(tile, tid, mw);
    if (kDy == 0) runs.load(tile, rows, tid);
    // The rows the previous output row did not have: the last, or all three.
    const bool next_row = th > 0 && tile > tile_first;
    for (int r = next_row ? 2 : 0; r < 3; ++r)
      expand_row<T, kPasses>(ring, (oh0 + r) % 3, p, x, n, c0, cc, oh0 - p.ph + r, ow0, row_len,
                             tid);
    wgmma_fence_smem();  // the wgmmas read the ring through the async proxy
    const u32 shift = kDy > 0 ? runs.shift_bytes(tile, warp * 16 + g) : 0u;
    if (kDy > 0) bar_wait(bar, it & 1);
    runs.realign(tile, tid, mw, maligned);
    __syncthreads();

    // A (dz) of step j: rows g, g + 8 at positions 8j + 2t (depth t) and + 1
    // (depth t + 4), a[part][h + 2q] for row g + 8h, position 2t + q; zero past
    // the output's edge (guard: the step reaches past it). The bias sums take
    // them too. Three passes split by split_finite, and by split<3> again in
    // the rare thread whose values are not all finite.
    auto load_a_as = [&](auto guard, int j, u32(&a)[2][4]) {
      const int p0 = 8 * j;
      const DzRaw<T> dz{raw_row + shift + p0 * (int)sizeof(T), mask_row + (p0 >> 5) * 4,
                        (p0 & 31) + 2 * t, op};
      float v[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dz(0, h, v[h], v[h + 2]);
        if (decltype(guard)::value) {
          v[h] = p0 + 2 * t < row_len ? v[h] : 0.f;
          v[h + 2] = p0 + 2 * t + 1 < row_len ? v[h + 2] : 0.f;
        }
        accb[h] = add_rn(accb[h], v[h]);
        accb[h] = add_rn(accb[h], v[h + 2]);
      }
      bool finite = true;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (kPasses == 3)
          finite &= split_finite(v[i], a[0][i], a[1][i]);
        else
          split<1>(v[i], a[0][i], a[1][i]);
      }
      if (kPasses == 3 && !finite) {
#pragma unroll
        for (int i = 0; i < 4; ++i) split<3>(v[i], a[0][i], a[1][i]);
      }
    };
    auto load_a = [&](int j, u32(&a)[2][4]) {
      if (8 * j + 8 <= row_len)
        load_a_as(Flag<false>{}, j, a);
      else
        load_a_as(Flag<true>{}, j, a);
    };
    u64 desc[3];  // filter row r's B: its input row's slot, shift 0 (SBO: the next shift)
#pragma unroll
    for (int r = 0; r < 3; ++r) desc[r] = wgmma_desc(ring + ((oh0 + r) % 3) * kWgSlot, kWgGroup);
    constexpr u64 kSmall = kWgPart >> 4;
    auto mma = [&](int j, const u32(&a)[2][4]) {
      wgmma_fence();
      if (kPasses == 3) {
#pragma unroll
        for (int r = 0; r < 3; ++r) wgmma_tf32_n24(acc[r], a[1], desc[r] + 16 * j);
#pragma unroll
        for (int r = 0; r < 3; ++r) wgmma_tf32_n24(acc[r], a[0], desc[r] + 16 * j + kSmall);
      }
#pragma unroll
      for (int r = 0; r < 3; ++r) wgmma_tf32_n24(acc[r], a[0], desc[r] + 16 * j);
      wgmma_commit();
    };
    auto settle = [&]() {
      wgmma_wait_all();
#pragma unroll
      for (int r = 0; r < 3; ++r) wgmma_hold(acc[r]);
    };
    // Step j's MMAs run while step j + 1's operands load (two register sets).
    const int steps = (row_len + 7) >> 3;
    u32 a0[2][4], a1[2][4];
    load_a(0, a0);
    for (int j = 0; j < steps; j += 2) {
      mma(j, a0);
      if (j + 1 < steps) load_a(j + 1, a1);
      settle();
      if (j + 1 < steps) {
        mma(j + 1, a1);
        if (j + 2 < steps) load_a(j + 2, a0);
        settle();
      }
    }
  }

  // The quad's bias sums in a fixed order, then this split's partial weight
  // (and bias) gradient: acc[r][4 s + q] is channel 16 w + g + 8 (q / 2),
  // column (s, ci = 2t + q % 2) of filter row r.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    accb[h] = add_rn(accb[h], __shfl_xor_sync(0xffffffffu, accb[h], 1));
    accb[h] = add_rn(accb[h], __shfl_xor_sync(0xffffffffu, accb[h], 2));
  }
  const int k_total = p.cin * 9;
  float* part = p.part + (long long)blockIdx.x * p.cout * k_total;
  float* bpart = p.part + (long long)p.splits * p.cout * k_total + (long long)blockIdx.x * p.cout;
  const bool with_bias = blockIdx.y < col_tiles;  // the bias: the first chunk's blocks
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int co = tile_n + warp * 16 + g + 8 * (q >> 1), ci = 2 * t + (q & 1);
    if (co >= p.cout) continue;
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
      for (int s = 0; s < 3; ++s)
        if (ci < cc) part[(long long)co * k_total + (c0 + ci) * 9 + r * 3 + s] = acc[r][4 * s + q];
    if (with_bias && t == 0 && (q & 1) == 0) bpart[co] = accb[q >> 1];
  }
}

template <typename T, int kPasses, int kDy>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 ? 2 : 3)
    conv2d_wgrad_kernel_wg(const ConvParams p) {
  wgrad_tiles_wg<T, kPasses, kDy>(p, nullptr);
}

template <typename T, int kPasses>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 ? 2 : 3)
    conv2d_wgrad_kernel_wg_tmap(const ConvParams p, const __grid_constant__ TensorMap dy_map) {
  wgrad_tiles_wg<T, kPasses, 2>(p, &dy_map);
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
// bias partials; summed in double, rounded once to T. A block takes 32
// consecutive outputs (one 128-byte line of each split's partials per warp
// load) and its kFinishWarps warps split the splits into contiguous ranges:
// warp w sums its range in order, then the warps' sums are added in order of
// w. The order is fixed by the shape: deterministic. (One thread per output
// walking all splits left the GPU nearly empty, latency-bound: 14-24 us at
// the seed shape's 264-396 splits.)
constexpr int kFinishWarps = 8;
template <typename T>
__global__ void __launch_bounds__(32 * kFinishWarps) conv2d_wgrad_finish(const ConvParams p) {
  __shared__ double sums[kFinishWarps][32];
  const long long k_total = (long long)p.cin * p.kh * p.kw;
  const long long nw = p.cout * k_total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long i = (long long)blockIdx.x * 32 + lane;
  const bool live = i < nw + (p.gb ? p.cout : 0);
  const bool is_w = i < nw;
  const float* src = is_w ? p.part + i : p.part + p.splits * nw + (i - nw);
  const long long stride = is_w ? nw : p.cout;
  const int per = (p.splits + kFinishWarps - 1) / kFinishWarps;
  const int k0 = min(p.splits, warp * per), k1 = min(p.splits, k0 + per);
  double s = 0.0;
  if (live) {
#pragma unroll 4
    for (int k = k0; k < k1; ++k) s += to_double(__ldg(src + (long long)k * stride));
  }
  sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || !live) return;
#pragma unroll
  for (int w = 1; w < kFinishWarps; ++w) s += sums[w][lane];
  const T v = from_double<T>(s);
  if (is_w)
    static_cast<T*>(p.gw)[i] = v;
  else
    static_cast<T*>(p.gb)[i - nw] = v;
}

}  // namespace cupy_act
