// conv2d.cu: 2-D convolution + bias + divide + LeakyReLU (+ 1-bit mask), fused.
//
//   conv2d_kernel<T, kPasses, kChannelsLast>
//     y = leaky_relu((conv2d(x, w) + bias) / divisor, slope)    written once
//   conv2d_kernel_tmap<T, kPasses>
//     the same (NCHW, sm_90), the ring's new rows by tensor copies
//
// An implicit GEMM on tensor cores (TF32; on sm_90a warpgroup MMAs, wgmma.cuh,
// elsewhere mma.sync m16n8k8, sm_80 and later):
//   rows    m = output positions (n, oh, ow)
//   columns j = output channels co
//   depth   k = (ci, kh, kw), the weight's OIHW order
// A persistent grid: each 128-thread block walks a run of consecutive output
// tiles of 128 positions (a rectangle of R rows x C columns of one image, C =
// 32, 64 or 128, R = 128 / C; the runs go down the rows first) by 64
// channels. Per tile and chunk of cc input channels
// it copies the input patch under the rectangle (cc planes of PH x PW, zero
// where the padding is) into shared memory with plain coalesced loads, and
// the chunk's weights (kept for every tile when one chunk holds all input
// channels), then runs the MMAs from shared memory. The A operand needs no
// per-element index arithmetic: the patch offset of (m, k) is moff(m) +
// koff(k), moff fixed per thread, koff from a table built once per block.
// Depth padded up to a multiple of 8 points koff at a plane of zeros, so inf
// and NaN in x never meet a padding weight. Operands are converted (and, with
// three passes, split) once, when they are copied in.
// MMAs: with mma.sync warp (wm, wn) takes 64 positions x 32 channels, loading
// both operands' fragments; with wgmma (compute capability 9.0, where _conv
// compiles for sm_90a) the block is one warpgroup, two m64n64k8 MMAs per
// depth step (positions 0-63, 64-127), A fragments from the patch as before,
// the weights read by the tensor cores from shared memory (stored as K-major
// core matrices), the next step's A loading while a step's MMAs run. Per
// element the terms sum in the same order; the tensor cores' internal sums
// of 8 products may round differently from mma.sync's, so the two paths
// agree to FP32 accuracy, not bit for bit (each is deterministic).
//
// Precision. kPasses = 3 is the 3xTF32 split: every float a is a_big + a_small
// with a_big = tf32(a) and a_small = a - a_big (exact; the tensor cores read
// its top TF32 bits, within 2^-21 |a|), and a * b is summed as
// a_small * b_big + a_big * b_small + a_big * b_big (the small * small term,
// below 2^-22 |a b|, is dropped), so products are within 5 * 2^-22 |a b|
// and the sum accumulates in float32: FP32 accuracy, not bit equality
// with cuDNN, whose summation order no one can match. kPasses = 1 is plain
// TF32 (10-bit mantissas, what cuDNN and torch.compile use with TF32 allowed).
// float16 and bfloat16 inputs convert to float exactly and fit TF32 exactly,
// so one pass gives exact products with float32 accumulation.
// Non-finite inputs: see split(); they propagate as in an FP32 sum (inf * 0 =
// NaN, inf - inf = NaN), except that a product of two non-finite operands
// (inf in x under an inf weight) gives NaN. |a| within 2^-11 of FLT_MAX
// rounds to inf.
//
// Epilogue. With wgmma each value is stored from the accumulators where it lies
// (epilogue_wgmma_nchw / _nhwc): no trip through shared memory, so the patch
// survives the tile, and one-row tiles keep it as a ring of rows (the next
// output row copies only its sh new input rows, brought into a staging area of
// shared memory while the tile before runs, by one tensor copy
// (conv2d_kernel_tmap) or cp.async, or prefetched into L2 where staging does
// not fit: stage_rows). With mma.sync the tile goes through
// shared memory so that each lane then holds 16 output elements of one line (a
// channel's positions for NCHW, a position's channels for NHWC) in runs of 4
// consecutive ones: four 16-byte shared loads, stores as wide as alignment
// allows, and the per-line work (address, bias, mask) shared by 16 elements.
// Either way the value is rounded to T (the convolution's output), then bias,
// division and LeakyReLU are the elementwise op's own functor and add_bias, so
// they round exactly as eager PyTorch's separate ops do.
//
// Mask: the format of elementwise.cu (bit i % 32 of word i / 32 is element i,
// in the output's memory order). The buffer is zeroed before the launch.
// The bits of one output row (NCHW) or position (NHWC) of the tile are
// consecutive elements, held 16 per lane by a group of lanes; each word goes
// in by an atomic OR (the words at either end have bits a neighbour owns;
// store_mask_word, put_mask_word).
#include "conv2d_tiles.cuh"
#include "wgmma.cuh"
#include "copy_engine.cuh"
#include "params.cuh"
#include "activations.cuh"
#include "conv2d_stores.cuh"
#include "conv2d_epilogue.cuh"

namespace cupy_act {

// acc += a * b over one depth step of 8 ([0] big, [1] small parts): big *
// big, after the two correction terms (the smallest first) with three passes.
template <int kPasses>
__device__ __forceinline__ void mma_step(float (&acc)[4][4][4], const u32 (&a)[2][4][4],
                                         const u32 (&b)[2][4][2]) {
  if (kPasses == 3) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_tf32(acc[i][j], a[1][i], b[0][j]);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_tf32(acc[i][j], a[0][i], b[1][j]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) mma_tf32(acc[i][j], a[0][i], b[0][j]);
}

// The wgmma path's A fragments for one depth step: M-half h, part [0] big,
// [1] small, q as in mma_step's (row g or g + 8, depth t or t + 4).
template <int kParts>
__device__ __forceinline__ void wgmma_load_a(u32 (&a)[2][2][4], const u32 (&addr)[2][2], u32 ko0,
                                             u32 ko1) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      lds<kParts, kPatchPart * 4>(addr[h][q & 1] + (q < 2 ? ko0 : ko1), a[h][0][q], a[h][1][q]);
}

// acc[h] += A_h B over one depth step, issued (not waited for): per element
// the terms in mma_step's order, small ones first.
template <int kPasses>
__device__ __forceinline__ void wgmma_step(float (&acc)[2][32], const u32 (&a)[2][2][4], u64 b) {
  constexpr u64 kSmall = kWgmmaWeightPart * 4 / 16;  // the weights' small part, in descriptor units
  wgmma_fence();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (kPasses == 3) {
      wgmma_tf32(acc[h], a[h][1], b);
      wgmma_tf32(acc[h], a[h][0], b + kSmall);
    }
    wgmma_tf32(acc[h], a[h][0], b);
  }
  wgmma_commit();
}

// One chunk's depth on the warpgroup MMAs: B (the weights) at descriptor b0
// for depth 0 (a depth step of 8 is 256 bytes on), A from the patch at
// addr[h][r] + koff. The next step's A fragments load while a step's MMAs
// run (two register sets).
template <int kPasses>
__device__ __forceinline__ void wgmma_chunk(float (&acc)[2][32], const u32 (&addr)[2][2],
                                            const int* koff, u64 b0, int kc_pad, int t) {
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  u32 a0[2][2][4], a1[2][2][4];
  wgmma_load_a<kParts>(a0, addr, koff[t], koff[t + 4]);
  for (int k0 = 0; k0 < kc_pad; k0 += 16) {
    wgmma_step<kPasses>(acc, a0, b0 + 2 * k0);
    const bool more = k0 + 8 < kc_pad;
    if (more) wgmma_load_a<kParts>(a1, addr, koff[k0 + 8 + t], koff[k0 + 12 + t]);
    wgmma_wait_all();
    wgmma_hold(acc[0]);
    wgmma_hold(acc[1]);
    if (more) {
      wgmma_step<kPasses>(acc, a1, b0 + 2 * (k0 + 8));
      if (k0 + 16 < kc_pad) wgmma_load_a<kParts>(a0, addr, koff[k0 + 16 + t], koff[k0 + 20 + t]);
      wgmma_wait_all();
      wgmma_hold(acc[0]);
      wgmma_hold(acc[1]);
    }
  }
}

// Input rows ih0 .. ih0 + nr - 1 of every channel of image xn, columns
// iw_base .. + PW - 1 (those in the image), into L2: a prefetch per 128-byte
// line, the block's threads over (row, line).
template <typename T>
__device__ __forceinline__ void prefetch_rows_l2(const ConvParams& p, const T* xn, int ih0, int nr,
                                                 int iw_base, int tid) {
  const int lo = max(iw_base, 0), hi = min(iw_base + p.patch_w, p.w_in);  // columns
  if (hi <= lo) return;
  constexpr int kPerLine = 128 / sizeof(T);
  const int lines = (hi - lo + kPerLine - 1) / kPerLine + 1;  // (the first may be partial)
  for (int i = tid; i < p.cc * nr * lines; i += kConvThreads) {
    const int row = i / lines, line = i - row * lines, c = row / nr, ih = ih0 + row - c * nr;
    if (c < p.cin && (unsigned)ih < (unsigned)p.h) {
      const T* src = xn + ((long long)c * p.h + ih) * p.w_in + min(lo + line * kPerLine, hi - 1);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
    }
  }
}

// The ring's next rows, raw, into a staging area of shared memory by
// asynchronous copies (cp.async: no registers, no wait here) while this
// tile's MMAs and epilogue run; the next tile splits them into their ring
// slots (unstage_rows) with no global load in its way. Rows ih0 .. ih0 + nr
// - 1 of the cc channels of image xn, 4-column groups from iw_base: item i
// = (row c nr + l, group) at stage + 4 i, zero-filled outside the image.
// Only where load_patch's `vec` holds (each group one aligned vector, wholly
// inside the image or wholly outside). Committed as one group; the next
// tile waits for it (cp_async_wait_all) before its first barrier.
template <typename T>
__device__ __forceinline__ void stage_rows(T* stage, const ConvParams& p, const T* xn, int ih0,
                                           int nr, int iw_base, int tid) {
  constexpr int kBytes = 4 * sizeof(T);
  const int groups = (p.patch_w + 3) >> 2, rows = p.cc * nr;
  const int step_row = kConvThreads / groups, step_group = kConvThreads - step_row * groups;
  const u32 mr = div_magic(nr), dst0 = (u32)__cvta_generic_to_shared(stage);
  for (int row = tid / groups, group = tid - row * groups; row < rows;) {
    const int c = div_by(row, nr, mr), ih = ih0 + row - c * nr, iw = iw_base + 4 * group;
    const bool in = c < p.cin && (unsigned)ih < (unsigned)p.h && (unsigned)iw < (unsigned)p.w_in;
    const T* src = in ? xn + ((long long)c * p.h + ih) * p.w_in + iw : xn;
    cp_async<kBytes>(dst0 + (row * groups + group) * kBytes, src, in ? kBytes : 0);
    group += step_group;
    row += step_row;
    if (group >= groups) {
      group -= groups;
      ++row;
    }
  }
  cp_async_commit();
}

// The staged rows split into the patch: logical rows l0 .. l0 + nr - 1 of
// each channel into slots ring_slot(base, l), columns below PW. Staged row
// (c, l) starts at stage + (c nr + l) row_len: stage_rows' items (row_len
// 4 groups) or a tensor copy's box (row_len a whole number of 16-byte units).
template <typename T, int kPasses>
__device__ __forceinline__ void unstage_rows(u32* patch, const T* stage, const ConvParams& p,
                                             int l0, int nr, int base, int row_len, int tid) {
  const int groups = (p.patch_w + 3) >> 2, rows = p.cc * nr;
  const int step_row = kConvThreads / groups, step_group = kConvThreads - step_row * groups;
  const u32 mr = div_magic(nr);
  for (int row = tid / groups, group = tid - row * groups; row < rows;) {
    const int c = div_by(row, nr, mr), l = l0 + row - c * nr;
    float v[4];
    load4(stage + row * row_len + 4 * group, v);
    u32* dst = patch + (c * p.patch_h + ring_slot(base, l, p.patch_h)) * p.patch_w;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * group + j < p.patch_w) put_split<kPasses>(dst, 4 * group + j, kPatchPart, v[j]);
    group += step_group;
    row += step_row;
    if (group >= groups) {
      group -= groups;
      ++row;
    }
  }
}


// The weights of the chunk from input channel c0 (depth [c0 kh kw, + kc_pad),
// zero past K and past cout) split into shared memory: for mma.sync k-major
// rows of kWeightStride words; for wgmma [64][kc_pad] K-major core matrices
// (wgmma_b_word), a warp per core matrix (8 channels x 4 depths: 128
// contiguous bytes stored).
template <typename T, int kPasses>
__device__ __forceinline__ void load_weights(u32* bs, const ConvParams& p, const T* w, int tile_n,
                                             int c0, int tid) {
  const int lane = tid & 31, warp = tid >> 5;
  const int khw = p.kh * p.kw, kc = p.cc * khw, k_total = p.cin * khw, k_first = c0 * khw;
  auto weight = [&](int r, int k) {
    const int co = tile_n + r;
    return co < p.cout && k < kc && k_first + k < k_total
               ? Num<T>::to_op(w[(long long)co * k_total + k_first + k])
               : 0.f;
  };
  if constexpr (kWgmma) {
    const int kq = p.kc_pad >> 2;
    for (int cm = warp; cm < (kBN / 8) * kq; cm += kConvThreads / 32) {
      const int r = (cm / kq) * 8 + (lane >> 2), k = (cm % kq) * 4 + (lane & 3);
      put_split<kPasses>(bs, cm * 32 + lane, kWgmmaWeightPart, weight(r, k));
    }
    wgmma_fence_smem();  // the wgmmas read them through the async proxy
  } else {
    for (int r = warp; r < kBN; r += kConvThreads / 32) {
#pragma unroll 4
      for (int k = lane; k < p.kc_pad; k += 32)
        put_split<kPasses>(bs, k * kWeightStride + r, kWeightPart, weight(r, k));
    }
  }
}

// Blocks per SM the registers must allow (the shared memory plan in
// _conv.tiling fits them): three with three passes, four with one, except on
// sm_100 and later, where ptxas needs a few more than 128 registers, and for
// float32 NCHW on sm_90a, whose one pass measured faster with three (more
// registers for the epilogue: 453 against 478 and 461 against 467 us at the
// seed shape, Nsight, two calls; 16-bit types and NHWC the other way, 438
// against 410 and 441 against 406).
#if __CUDA_ARCH__ >= 1000
constexpr int kOnePassBlocks = 3;
#else
constexpr int kOnePassBlocks = 4;
#endif

// The kernels' body; kTmap: the ring's new rows by one tensor copy of x_map
// per tile where the staging area fits (else as without).
template <typename T, int kPasses, bool kChannelsLast, bool kTmap>
__device__ __forceinline__ void forward_tiles(const ConvParams& p, const TensorMap* x_map) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  static_assert(!kTmap || !kChannelsLast, "the tensor copies bring NCHW rows");
  extern __shared__ __align__(16) float smem[];
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cols = 1 << p.c_log2;
  const int tile_n = blockIdx.y * kBN;
  const int plane = p.patch_h * p.patch_w;
  const bool one_chunk = p.cin <= p.cc;  // the weights stay for every tile

  // Shared memory (see _conv.tiling): koff [kc_pad] | the patch, [cc + 1]
  // planes of PH x PW (the last one zero), then with three passes its small
  // parts at + kPatchPart, then for the wgmma epilogue the tile's mask words
  // [kBN][4] and the bias values [kBN]; the shared-memory epilogue's tile
  // reuses this space | the weights (load_weights), small parts at +
  // kWeightPart (wgmma: + kWgmmaWeightPart). On wgmma the ring's staging
  // area (stage_rows) takes unused space: after the bias, else after the
  // weights.
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  int* koff = reinterpret_cast<int*>(smem);
  u32* patch = reinterpret_cast<u32*>(smem) + p.kc_pad;
  const int patch_words = kParts == 2 ? 2 * kPatchPart : (p.cc + 1) * plane;
  const int region = patch_words + kAfterPatchWords;
  // (16-byte aligned: the wgmma descriptors address it in 16-byte units)
  const int region_alloc = ((region > kEpilogueFloats ? region : kEpilogueFloats) + 3) & ~3;
  u32* bs = patch + region_alloc;
  constexpr int kBS = kWeightStride;

  // Shared addresses of this thread's A rows at depth 0: with mma.sync eight
  // (4 row tiles x g, g + 8), with wgmma (sm_90a) four, warp w's rows of
  // M-half h being 64 h + 16 w + g (+ 8); with mma.sync its B column at depth
  // t. (wgmma: the weights [64][kc_pad] K-major, wgmma_b_word, 8-channel
  // groups kc_pad * 8 words apart.)
  const int wm = warp & 1, wn = warp >> 1;
  const u32 patch_addr = (u32)__cvta_generic_to_shared(patch);
  auto row_addr = [&](int ml) {  // output position ml of the tile
    return patch_addr + ((ml >> p.c_log2) * p.sh * p.patch_w + (ml & (cols - 1)) * p.sw) * 4;
  };
  u32 a_addr[4][2], a_wg[2][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a_addr[i][h] = row_addr(wm * 64 + i * 16 + g + h * 8);
      if (i < 2) a_wg[i][h] = row_addr(32 * warp + 4 * g + 2 * i + h);  // (the epilogue's P(i, h))
    }
  const u32 b_addr = (u32)__cvta_generic_to_shared(bs) + (t * kBS + wn * 32 + g) * 4;
  const u64 b_desc = wgmma_desc((u32)__cvta_generic_to_shared(bs), p.kc_pad * 32);

  Params ap;  // the elementwise functor's scalars, in registers (see in_register)
  ap.slope = in_register(p.slope);
  ap.scale = in_register(p.scale);
  const DivLeakyRelu<T> op(ap);
  const typename Num<T>::op_t alpha = scalar_from_bits<typename Num<T>::op_t>(in_register(p.alpha));
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const long long out_plane = (long long)p.oh * p.ow;
  const int tiles = p.n * p.tiles_h * p.tiles_w;
  const int image = p.cin * p.h * p.w_in;  // < 2^31 (_conv.fits)

  // NHWC epilogue: this lane's channels tile_n + 4 (lane % 8) + 32u + j (u =
  // 0, 1; j = 0 .. 3), how many exist and their bias values, for every tile.
  int valid_c[2];
  T bias_c[2][4];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int co = tile_n + 4 * (lane & 7) + 32 * u;
    valid_c[u] = max(0, min(4, p.cout - co));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      bias_c[u][j] = kChannelsLast && bias && j < valid_c[u] ? bias[co + j] : Num<T>::zero();
  }

  // The wgmma epilogue: NHWC pairs of channels stored together where `pair`;
  // after the patch, NCHW: the tile's mask words (epilogue_wgmma_nchw); the
  // block's bias values (zero past cout).
  const bool pair = (p.cout & 1) == 0 && ((u64)y & (2 * sizeof(T) - 1)) == 0;
  u32* tile_words = patch + patch_words;
  if (kWgmma && tid < kBN)
    bias_s<T>(tile_words)[tid] =
        bias && tile_n + tid < p.cout ? bias[tile_n + tid] : Num<T>::zero();

  // This block's run of tiles, the tile index running down the rows first
  // (tile = (n tiles_w + column) tiles_h + row), so that one-row tiles (C =
  // 128) on the wgmma path, which leaves the patch in place, keep it as a
  // ring of PH rows per channel when one chunk holds every input channel:
  // the next output row copies only its sh new input rows, row l of a tile
  // sitting in slot ring_slot(base, l) (koff follows it).
  const int tile_first = blockIdx.x * p.tiles_per_split;
  const int tile_end = min(tiles, tile_first + p.tiles_per_split);
  const bool ring = kWgmma && !kChannelsLast && one_chunk && p.c_log2 == 7;
  // The ring's next rows come by asynchronous copies (stage_rows) where their
  // vectors line up with the patch columns (load_patch's vec: iw_base = ow0
  // sw - pw, ow0 a multiple of 128) and the staging area fits in unused
  // shared memory: the region's, after the mask words and the bias, or else
  // the weights' tail past kc_pad depths; otherwise an L2 prefetch ahead of
  // plain loads.
  const int fresh_rows = min(p.sh, p.patch_h);
  const int stage_words = p.cc * fresh_rows * ((p.patch_w + 3) >> 2) * (int)sizeof(T);
  const int w_used = (kParts == 2 ? kWgmmaWeightPart : 0) + kBN * p.kc_pad;  // (multiples of 4)
  const int w_alloc = kParts == 2 ? 2 * kWeightPart : p.kc_pad * kWeightStride;
  const int stage_at = (region + 3) & ~3;
  // Row seams (float32 on wgmma, one pass, NCHW, one-row tiles holding the
  // output's whole width, so that a block's consecutive tiles are rows next
  // to each other in memory). The line two such rows share leaves whole once
  // both are in: the earlier tile puts its part in a buffer after the
  // weights (when the host allotted it: _conv.SEAM_BYTES), the next tile
  // adds its own, and the tile after stores the line after its first
  // barrier. Written in two parts a tile apart, these lines cost the seed
  // shape's one-pass forward 15% (a copy without them, 2026-11-27,
  // e9bbc1a); with the seams it took 287 us against 326 on an H100, the
  // lines' stores after the barrier 12 of those ("seams, no flush"). Only
  // where every store is a vector (even widths, planes of whole vectors, y
  // 16-byte aligned: no store_n), and rows are not whole lines anyway; the
  // host allots the buffer only where the seams pay (_conv.seams_pay).
  float* seam = nullptr;
  if constexpr (kWgmma && kPasses == 1 && !kChannelsLast && sizeof(T) == 4) {
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    float* buf = reinterpret_cast<float*>(bs + w_alloc);
    const bool fits = (u32)(buf + kSeamFloats - smem) * 4 <= dyn;
    if (fits && p.c_log2 == 7 && p.tiles_w == 1 && p.ow >= 64 && (p.ow & 1) == 0 &&
        (out_plane & 3) == 0 && out_plane < (1 << 28) && ((u64)y & 15) == 0 && !rows_on_lines(p, y))
      seam = buf;
  }
  bool seam_flush = false;  // the last tile's head line waits in the buffer (its row - 1's set)
  T* stage =
      reinterpret_cast<T*>(stage_at + stage_words <= region_alloc ? patch + stage_at : bs + w_used);
  const bool stage_ok = ring && (p.w_in & 3) == 0 && (p.pw & 3) == 0 &&
                        ((u64)x & (4 * sizeof(T) - 1)) == 0 &&
                        (stage_at + stage_words <= region_alloc || w_used + stage_words <= w_alloc);
  // With tensor copies (kTmap): one box of x_map per tile, cc channels x
  // fresh_rows rows x tma_len columns (PW rounded up to whole 16-byte units)
  // from (iw_base, ih, 0, n), zeros outside x, lands row after row at a
  // 128-byte aligned address (the copy engine's requirement) in the same
  // unused space, followed by its mbarrier (tma_bar); _conv.forward_tmap
  // mirrors this placement.
  constexpr int kUnit = 16 / sizeof(T);
  const int tma_len = (p.patch_w + kUnit - 1) / kUnit * kUnit;
  const u32 tma_bytes = p.cc * fresh_rows * tma_len * sizeof(T);
  const u32 smem_at = (u32)__cvta_generic_to_shared(smem);
  auto tma_place = [&](const u32* lo, const u32* hi) {  // 0 where it does not fit
    const u32 a = ((u32)__cvta_generic_to_shared(lo) + 127) & ~127u;
    return a + tma_bytes + 8 <= (u32)__cvta_generic_to_shared(hi) ? a : 0u;
  };
  u32 tma_at = 0;
  if (kTmap && ring && tma_len <= 256 && p.pw % kUnit == 0) {
    tma_at = tma_place(patch + stage_at, patch + region_alloc);
    if (tma_at == 0) tma_at = tma_place(bs + w_used, bs + w_alloc);
  }
  const bool tma = tma_at != 0;
  const u32 tma_bar = tma_at + tma_bytes;
  u32 tma_parity = 0;
  if (tma) {
    stage = reinterpret_cast<T*>(reinterpret_cast<char*>(smem) + (tma_at - smem_at));
    if (tid == 0) bar_init(tma_bar, 1);  // (the tile loop's first barrier shows it to all)
  }
  const int stage_len = tma ? tma_len : 4 * ((p.patch_w + 3) >> 2);
  bool staged = false;  // this tile's new rows wait in the staging area
  if (!ring) build_koff(koff, p, tid, 0);
  // The ring's koff changes with its base each tile: where one thread per
  // depth suffices, each keeps its depth's parts in registers (no division
  // per tile).
  const bool k_own = ring && p.kc_pad <= kConvThreads;
  const KDepth k_mine = k_own && tid < p.kc_pad ? k_depth(p, tid) : KDepth{0, -1};
  if (kWgmma)  // the zero plane, once (only the shared-memory epilogue overwrites it)
    for (int i = tid; i < plane; i += kConvThreads)
      put_split<kPasses>(patch, p.cc * plane + i, kPatchPart, 0.f);
  // NCHW on wgmma: the mask words of tile `at` wait in tile_words until
  // after the next barrier (the next tile's first, or the last one).
  const bool nchw_mask = kWgmma && !kChannelsLast && p.mask;
  TileAt at = tile_at(p, tile_first);  // this tile's rectangle: image n, rows oh0.., columns ow0..
  // The ring's first row of the tile (input row oh0 sh - ph) sits in slot
  // (oh0 sh) % PH, stepped along with the tiles (sh % PH on per row).
  const int base_step = ring ? p.sh % p.patch_h : 0;
  int base = ring ? at.oh0 * p.sh % p.patch_h : 0;

  for (int tile = tile_first; tile < tile_end; ++tile) {
    float acc[4][4][4], wacc[2][32];  // mma.sync's, wgmma's
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[i][j][q] = 0.f;
          wacc[i >> 1][(i & 1) * 16 + j * 4 + q] = 0.f;
        }

    for (int c0 = 0; c0 < p.cin; c0 += p.cc) {
      if (staged && tma) {
        bar_wait(tma_bar, tma_parity);
        tma_parity ^= 1;
      } else if (staged) {
        cp_async_wait_all();
      }
      __syncthreads();  // the previous MMAs and epilogue are done with shared memory
      if (c0 == 0 && tile > tile_first) {
        if (nchw_mask) put_tile_mask_nchw(p, tile_words, at, tile_n, tid);
        if (seam_flush)
          put_seams(seam + ((at.oh0 - 1) & 1) * kBN * kSeamStride, reinterpret_cast<float*>(y), p,
                    at, tile_n, tid);
        // the next tile: one row tile down, or the next column or image
        at.oh0 += kBM >> p.c_log2;
        if (ring)
          base = base + base_step >= p.patch_h ? base + base_step - p.patch_h : base + base_step;
        if (at.oh0 >= p.tiles_h * (kBM >> p.c_log2)) {
          at.oh0 = 0;
          if (ring) base = 0;
          at.ow0 += cols;
          if (at.ow0 >= p.tiles_w * cols) {
            at.ow0 = 0;
            ++at.n;
          }
        }
      }
      const int n = at.n, oh0 = at.oh0, ow0 = at.ow0;
      const int ih_base = oh0 * p.sh - p.ph, iw_base = ow0 * p.sw - p.pw;
      const T* xn = x + (long long)n * image;
      const int fresh = ring && oh0 > 0 && tile > tile_first ? fresh_rows : p.patch_h;
      if (!kWgmma && c0 == 0)
        for (int i = tid; i < plane; i += kConvThreads)
          put_split<kPasses>(patch, p.cc * plane + i, kPatchPart, 0.f);
      if (k_own && tid < p.kc_pad)
        koff[tid] = k_offset(p, k_mine, base);
      else if (ring && !k_own)
        build_koff(koff, p, tid, base);
      if (staged)
        unstage_rows<T, kPasses>(patch, stage, p, p.patch_h - fresh, fresh, base, stage_len, tid);
      else
        load_patch<T, kPasses, kChannelsLast>(patch, p, xn, c0, ih_base, iw_base, tid,
                                              p.patch_h - fresh, fresh, base);
      staged = false;
      if (!one_chunk || tile == tile_first) load_weights<T, kPasses>(bs, p, w, tile_n, c0, tid);
      __syncthreads();
      // The ring's next rows (those of the next output row) on their way
      // while this tile's MMAs and epilogue run: into the staging area, or
      // into L2 (its copy then waits on L2, not on DRAM).
      if (ring && tile + 1 < tile_end && oh0 + 1 < p.tiles_h) {
        const int ih_next = ih_base + p.patch_h + p.sh - fresh_rows;
        if (tma) {
          if (tid == 0) {
            bar_expect(tma_bar, tma_bytes);
            tensor_copy_4d(tma_at, *x_map, iw_base, ih_next, 0, n, tma_bar);
          }
        } else if (stage_ok) {
          stage_rows(stage, p, xn, ih_next, fresh_rows, iw_base, tid);
        } else {
          prefetch_rows_l2(p, xn, ih_next, fresh_rows, iw_base, tid);
        }
        staged = tma || stage_ok;
      }

      if constexpr (kWgmma) {
        wgmma_chunk<kPasses>(wacc, a_wg, koff, b_desc, p.kc_pad, t);
      } else {
        for (int k0 = 0; k0 < p.kc_pad; k0 += 8) {
          const u32 ko0 = koff[k0 + t], ko1 = koff[k0 + t + 4];
          const u32 kb = b_addr + k0 * kBS * 4;
          u32 a[2][4][4], b[2][4][2];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int q = 0; q < 4; ++q)  // q: (row g or g + 8) x (depth t or t + 4)
              lds<kParts, kPatchPart * 4>(a_addr[i][q & 1] + (q < 2 ? ko0 : ko1), a[0][i][q],
                                          a[1][i][q]);
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int q = 0; q < 2; ++q)  // q: depth t or t + 4
              lds<kParts, kWeightPart * 4>(kb + (q * 4 * kBS + j * 8) * 4, b[0][j][q], b[1][j][q]);
          mma_step<kPasses>(acc, a, b);
        }
      }
    }
    if constexpr (kWgmma) {
      // (all 64 channels exist: no per-channel test)
      const bool all = p.cout - tile_n >= kBN;
      if (kChannelsLast && all) {
        epilogue_wgmma_nhwc<T, true>(wacc, p, y, bias != nullptr, op, alpha, at, tile_n, tile_words,
                                     pair, warp, g, t);
      } else if (kChannelsLast) {
        epilogue_wgmma_nhwc<T, false>(wacc, p, y, bias != nullptr, op, alpha, at, tile_n,
                                      tile_words, pair, warp, g, t);
      } else {
        // the seam lines: with the row before (set (row - 1) % 2), with the
        // row after (set row % 2), where the neighbouring row is this block's
        float *head = nullptr, *tail = nullptr;
        if (seam != nullptr && tile > tile_first && at.oh0 > 0)
          head = seam + ((at.oh0 - 1) & 1) * kBN * kSeamStride;
        if (seam != nullptr && tile + 1 < tile_end && at.oh0 + 1 < p.oh)
          tail = seam + (at.oh0 & 1) * kBN * kSeamStride;
        seam_flush = head != nullptr;
        if (all)
          epilogue_wgmma_nchw<T, true>(wacc, p, y, bias != nullptr, op, alpha, at, tile_n,
                                       tile_words, head, tail, warp, g, t);
        else
          epilogue_wgmma_nchw<T, false>(wacc, p, y, bias != nullptr, op, alpha, at, tile_n,
                                        tile_words, head, tail, warp, g, t);
      }
    } else {
      const int n = at.n, oh0 = at.oh0, ow0 = at.ow0;
      __syncthreads();  // done with the patch: the epilogue tile takes its place

      // Epilogue: the tile into shared memory ...
      float* ct = reinterpret_cast<float*>(patch);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            // warp (wm, wn)'s row tile i, column tile j
            const int ml = wm * 64 + i * 16 + g + (q >> 1) * 8;
            const int nl = wn * 32 + j * 8 + 2 * t + (q & 1);
            ct[kChannelsLast ? ml * kCSL + nl : nl * kCS + ml] = acc[i][j][q];
          }
      __syncthreads();

      // ... then out. Values round to T, then bias, division and LeakyReLU (the
      // elementwise functor); stores are as wide as alignment allows.
      if (!kChannelsLast) {
        // NCHW: a line is one channel's 128 tile positions (R rows of C). Each
        // group of 8 lanes takes a line, lane j its positions 4j + 32u (u = 0
        // .. 3, each run of 4 within one tile row: C >= 32), 4 lines per warp
        // at a time: per u the group reads and writes 32 consecutive elements
        // (shared loads without bank conflicts, whole sectors stored); one bias
        // load per line. Mask: run u's 4 bits are bits 4j .. 4j + 3 of tile
        // word u (tile_word4x4). Output row r of the line (elements e_r .. e_r +
        // len - 1, not word-aligned) takes up to C / 32 + 1 words, so the
        // group's 8 lanes cover all rows' words: lane j writes word k of row r
        // (j = r (C / 32 + 1) + k), from tile words r C / 32 + k and the one
        // before it.
        const int grp = lane >> 3, j = lane & 7;
        int off[4], valid[4];  // run u: its offset from the line's first element, its length
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int pos = 4 * j + 32 * u, row = pos >> p.c_log2, col = pos & (cols - 1);
          off[u] = row * p.ow + col;
          valid[u] = oh0 + row < p.oh ? max(0, min(4, p.ow - ow0 - col)) : 0;
        }
        const long long e_tile =
            ((long long)n * p.cout + tile_n) * out_plane + (long long)oh0 * p.ow + ow0;
        const float* ct_lane = ct + grp * kCS + 4 * j;
        const int wpr = cols >> 5;     // tile words per row: 1, 2 or 4
        const int mr = j / (wpr + 1);  // the row whose mask word this lane writes
        const MaskLane mlane = mask_lane(lane & ~7, 2, mr * wpr, wpr, j - mr * (wpr + 1),
                                         mr < (kBM >> p.c_log2) && oh0 + mr < p.oh);
        const int len = mlane.use_hi || mlane.use_lo ? min(cols, p.ow - ow0) : 0;
        const int lines = min(kBN, p.cout - tile_n);
        for (int l0 = warp * 4; l0 < lines; l0 += kConvThreads / 8) {
          const int line = l0 + grp;  // (< kBN: the shared loads stay in the tile)
          const bool line_ok = line < lines;
          T b[4];
          b[0] = b[1] = b[2] = b[3] = bias && line_ok ? bias[tile_n + line] : Num<T>::zero();
          T* y_line = y + e_tile + line * out_plane;
          u32 nib[4];
#pragma unroll
          for (int u = 0; u < 4; ++u)
            nib[u] = epilogue_run4(ct_lane + l0 * kCS + 32 * u, y_line + off[u],
                                   line_ok ? valid[u] : 0, op, bias != nullptr, b, alpha);
          if (p.mask)  // row mr of the line
            put_mask_word(p.mask, tile_word4x4(nib, j), mlane,
                          e_tile + line * out_plane + mr * p.ow, line_ok ? len : 0);
        }
      } else {
        // NHWC: a line is one position's 64 channels. Each group of 8 lanes
        // takes a position, lane c its channels 4c + 32u (u = 0, 1), 4
        // positions per warp at a time: per u the group reads and writes 32
        // consecutive elements (no bank conflicts, whole sectors stored). The
        // lane's bias values stay in registers for every tile. Mask: the
        // position's bits (channels tile_n ..) are tile words 0 and 1
        // (tile_word2x8); its stretch takes up to 3 words: lane c writes word c.
        const int pp = lane >> 3, c = lane & 7;
        const float* ct_lane = ct + pp * kCSL + 4 * c;
        const MaskLane mlane = mask_lane(lane & ~7, 4, 0, 2, c, true);
        const int len = max(0, min(kBN, p.cout - tile_n));
        for (int ml0 = warp * 4; ml0 < kBM; ml0 += kConvThreads / 8) {
          const int ml = ml0 + pp;
          const int oh = oh0 + (ml >> p.c_log2), ow = ow0 + (ml & (cols - 1));
          const bool pos_ok = oh < p.oh && ow < p.ow;
          const long long e = (((long long)n * p.oh + oh) * p.ow + ow) * p.cout + tile_n;
          u32 nib[2];
#pragma unroll
          for (int u = 0; u < 2; ++u)
            nib[u] = epilogue_run4(ct_lane + ml0 * kCSL + 32 * u, y + e + 4 * c + 32 * u,
                                   pos_ok ? valid_c[u] : 0, op, bias != nullptr, bias_c[u], alpha);
          if (p.mask) put_mask_word(p.mask, tile_word2x8(nib, c), mlane, e, pos_ok ? len : 0);
        }
      }
    }
  }
  // the last tile's mask words and seam lines
  if ((nchw_mask || seam_flush) && tile_first < tile_end) {
    __syncthreads();
    if (nchw_mask) put_tile_mask_nchw(p, tile_words, at, tile_n, tid);
    if (seam_flush)
      put_seams(seam + ((at.oh0 - 1) & 1) * kBN * kSeamStride, reinterpret_cast<float*>(y), p, at,
                tile_n, tid);
  }
}

template <typename T, int kPasses, bool kChannelsLast>
__global__ void __launch_bounds__(kConvThreads,
                                  kPasses == 3 || (kWgmma && sizeof(T) == 4 && !kChannelsLast)
                                      ? 3
                                      : kOnePassBlocks) conv2d_kernel(const ConvParams p) {
  forward_tiles<T, kPasses, kChannelsLast, false>(p, nullptr);
}

// The ring's new rows by tensor copies (sm_90, NCHW, _conv.forward_tmap):
// one copy-engine operation per tile instead of a cp.async per 16 bytes from
// every thread.
template <typename T, int kPasses>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 || (kWgmma && sizeof(T) == 4)
                                                    ? 3
                                                    : kOnePassBlocks)
    conv2d_kernel_tmap(const ConvParams p, const __grid_constant__ TensorMap x_map) {
  forward_tiles<T, kPasses, false, true>(p, &x_map);
}

}  // namespace cupy_act
