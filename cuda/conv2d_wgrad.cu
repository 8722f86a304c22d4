// conv2d_wgrad.cu: the fused convolution block's weight and bias gradients,
// read once from the upstream gradient, the forward's 1-bit mask and x.
//
//   conv2d_wgrad_kernel<T, kPasses, kChannelsLast, kStages>  (grid: splits x column tiles x chunks)
//   conv2d_wgrad_kernel_tmap<T, kPasses, kStages>  (the same, dy by tensor copies)
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

// The copy engine (sm_90): bulk copies from global into shared memory, each
// completing on an mbarrier that counts the bytes. Other architectures never
// launch the bulk path (_conv.wgrad_bulk); there these trap.
__device__ __forceinline__ void bar_init(u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 32;\n fence.mbarrier_init.release.cluster;"
               :: "r"(bar) : "memory");
#else
  __trap();
#endif
}

// One arrival on `bar` (of the 32 its phase waits for), and `bytes` more
// that must land before the phase completes.
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  // The shared memory about to be overwritten was read by ordinary loads
  // (ordered before this by the block's barrier); order them before the copies.
  asm volatile("fence.proxy.async.shared::cta;\n"
               " mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
#else
  __trap();
#endif
}

// bytes (a multiple of 16) from src to shared address dst, both 16-byte aligned.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#else
  __trap();
#endif
}

// cuda.h's CUtensorMap: the opaque 128-byte descriptor of a tiled tensor copy,
// encoded on the host (cuTensorMapEncodeTiled, cupy_act/_tensormap.py) and
// passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
  u64 bits[16];
};

// The box of `map` at coordinates (c0, c1, c2) (elements, innermost first;
// c0 * sizeof(T) a multiple of 16) to shared address dst (128-byte aligned),
// completing on `bar`; parts of the box outside the tensor land as zeros.
__device__ __forceinline__ void tensor_copy_3d(u32 dst, const TensorMap& map, int c0, int c1,
                                               int c2, u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}

// Wait for the phase of `bar` with this parity (0, 1, 0, ... per use).
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
  u32 done;
  do {
    asm volatile(
        "{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n"
        " selp.u32 %0, 1, 0, q;\n}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
#else
  __trap();
#endif
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
    for (int s = 0; s < kStages; ++s) bar_init(bar0 + 8 * s);

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
  // One-row tiles (NCHW, C = 128) keep the patch as a ring of PH rows per
  // channel: a block's next tile (the next output row: th runs fastest)
  // loads only the sh rows it does not share with the previous one.
  const bool ring = !kChannelsLast && rows_per_tile == 1;
  // NCHW: dy's 4-element runs and the patch's groups line up with vectors.
  const bool dz_vec = (p.ow & 3) == 0 && ((u64)dy & (4 * sizeof(T) - 1)) == 0;
  const bool x_vec = (p.w_in & 3) == 0 && ((u64)x & (4 * sizeof(T) - 1)) == 0;

  // The bulk path (_conv.wgrad_bulk: a tile's positions in each channel are
  // one run of dy, starting at an even element). The first element of tile
  // `tile`'s line 0, and the run's length.
  constexpr int kVec = 16 / sizeof(T);  // elements per 16 bytes
  auto tile_run = [&](int tile, long long& e0, int& len) {
    const int th = tile % p.tiles_h, tw = (tile / p.tiles_h) % p.tiles_w;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th * rows_per_tile, ow0 = tw * cols;
    e0 = ((long long)n * p.cout + tile_n) * out_plane + (long long)oh0 * p.ow + ow0;
    len = (min(rows_per_tile, p.oh - oh0) - 1) * p.ow + min(cols, p.ow - ow0);
  };
  // Warp 0 has the copy engine bring each line's run of dy, widened to whole
  // 16-byte units (the run's first element lands e % kVec elements into its
  // row), and the 16-byte units of mask words that hold its bits, into
  // stage `stage`; each lane counts its own bytes on the stage's barrier.
  // Lines past cout are not copied (their rows' sums are never written).
  auto issue = [&](int tile, int stage) {
    if (kTmap) {  // one box: every line's run, from the 16-byte unit it starts in
      const int th = tile % p.tiles_h, tw = (tile / p.tiles_h) % p.tiles_w;
      const int n = tile / (p.tiles_w * p.tiles_h);
      const int pos = th * rows_per_tile * p.ow + tw * cols;  // in the plane (< 2^31)
      const u32 bar = bar0 + 8 * stage;
      bar_expect(bar, lane == 0 ? kRawBytes : 0);
      if (lane == 0) tensor_copy_3d(raw0 + stage * kRawBytes, *dy_map, pos & -kVec, tile_n, n, bar);
      return;
    }
    long long e0;
    int len;
    tile_run(tile, e0, len);
    const int lines = min(kBN, p.cout - tile_n);
    u32 bytes = 0;
    for (int line = lane; line < lines; line += 32) {
      const int shift = (int)((e0 + line * out_plane) & (kVec - 1));
      bytes += ((shift + len + kVec - 1) / kVec) * 16;
    }
    const u32 bar = bar0 + 8 * stage;
    bar_expect(bar, bytes);
    for (int line = lane; line < lines; line += 32) {
      const long long e = e0 + line * out_plane;
      const int shift = (int)(e & (kVec - 1));
      bulk_copy(raw0 + stage * kRawBytes + line * kRawStride<T>, dy + (e - shift),
                ((shift + len + kVec - 1) / kVec) * 16, bar);
    }
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
    // The bulk path's mask words, by plain loads: item k = tid + 128 i of
    // line k / 4 takes bits 32 (k % 4) on of its run from two words (clamped
    // to the run's last word; bits past the run are never used), realigned
    // once the copies have landed.
    static_assert(kBN * 4 == 2 * kConvThreads, "two mask items per thread");
    u32 mw[2][2];
    if (kStages > 0) {
      long long e0;
      int len;
      tile_run(tile, e0, len);
      const int lines = min(kBN, p.cout - tile_n);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = tid + i * kConvThreads, line = k >> 2;
        const long long e = e0 + line * out_plane, last = (e + len - 1) >> 5;
        const long long w0 = (e >> 5) + (k & 3);
        mw[i][0] = line < lines ? __ldg(p.mask + min(w0, last)) : 0u;
        mw[i][1] = line < lines ? __ldg(p.mask + min(w0 + 1, last)) : 0u;
      }
    }
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
      long long e0;
      int len;
      tile_run(tile, e0, len);
      const u32 e_lo = (u32)e0, plane_lo = (u32)out_plane;  // low bits suffice
      shift_bytes = ((e_lo + (u32)(wm * 32 + g) * plane_lo) & (kVec - 1)) * sizeof(T);
      bar_wait(bar0 + 8 * stage, (it / kStages) & 1);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int k = tid + i * kConvThreads;
        maligned[k] = __funnelshift_r(mw[i][0], mw[i][1], (e_lo + (u32)(k >> 2) * plane_lo) & 31u);
      }
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
