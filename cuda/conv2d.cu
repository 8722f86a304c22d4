// conv2d.cu: 2-D convolution + bias + divide + LeakyReLU (+ 1-bit mask), fused.
//
//   conv2d_kernel<T, kPasses, kChannelsLast>
//     y = leaky_relu((conv2d(x, w) + bias) / divisor, slope)    written once
//
// An implicit GEMM on tensor cores (mma.sync m16n8k8 TF32, sm_80 and later):
//   rows    m = output positions (n, oh, ow)
//   columns j = output channels co
//   depth   k = (ci, kh, kw), the weight's OIHW order
// A persistent grid: each 128-thread block walks output tiles of 128
// positions (a rectangle of R rows x C columns of one image, C = 32, 64 or
// 128, R = 128 / C) by 64 channels. Per tile and chunk of cc input channels
// it copies the input patch under the rectangle (cc planes of PH x PW, zero
// where the padding is) into shared memory with plain coalesced loads, and
// the chunk's weights (kept for every tile when one chunk holds all input
// channels), then runs the MMAs from shared memory. The A operand needs no
// per-element index arithmetic: the patch offset of (m, k) is moff(m) +
// koff(k), moff fixed per thread, koff from a table built once per block.
// Depth padded up to a multiple of 8 points koff at a plane of zeros, so inf
// and NaN in x never meet a padding weight. Operands are converted (and, with
// three passes, split) once, when they are copied in.
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
// Epilogue. The tile goes through shared memory so that each lane then holds
// 4 consecutive output elements (of one channel's row for NCHW, of one
// position's channels for NHWC): loads from shared memory and stores are 16
// bytes wide where alignment allows. The value is rounded to T (the
// convolution's output), then bias, division and LeakyReLU are the
// elementwise op's own functor and add_bias, so they round exactly as eager
// PyTorch's separate ops do.
//
// Mask: the format of elementwise.cu (bit i % 32 of word i / 32 is element i,
// in the output's memory order). The buffer is zeroed before the launch.
// The bits of one output row (NCHW) or position (NHWC) of the tile are
// consecutive elements: a word they cover entirely is stored, the words at
// either end are OR-ed in atomically, since a neighbour owns their other bits.
#include "conv2d_tiles.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

// The mask words of elements [e, e + len), consecutive: bits 32k .. 32k + 31
// of the stream (bit i is element e + i) are the word `w` of lanes 8 * (first
// + k) (see gather_word), count words in all; invalid elements' bits are 0.
// Lane j writes word (e >> 5) + j: stored if the elements cover all of it,
// else OR-ed in atomically (a neighbouring warp or block owns its other
// bits; the buffer starts zeroed, so zero words are skipped). Warp-uniform.
__device__ __forceinline__ void write_mask(u32* mask, int lane, long long e, int len, u32 w,
                                           int first, int count) {
  // word j = (bits[j] << sh) | (bits[j - 1] >> (32 - sh)), bits[-1] = bits[count] = 0
  u32 hi = __shfl_sync(0xffffffffu, w, (8 * (first + lane)) & 31);
  u32 lo = __shfl_sync(0xffffffffu, w, (8 * (first + lane - 1)) & 31);
  if (len <= 0) return;
  if (lane >= count) hi = 0;
  if (lane == 0 || lane > count) lo = 0;
  const int sh = (int)(e & 31);
  const long long w0 = e >> 5;
  const int words = (int)(((e + len - 1) >> 5) - w0) + 1;
  const u32 word = __funnelshift_l(lo, hi, sh);
  if (lane >= words || word == 0u) return;
  const long long wi = w0 + lane;
  if ((wi << 5) >= e && ((wi + 1) << 5) <= e + len)
    mask[wi] = word;
  else
    atomicOr(mask + wi, word);
}

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

// The epilogue of 4 consecutive output elements at dst, of which the first
// `valid` exist: round to T, add the channel's bias (bias[co + j] for a run
// of channels when kPerChannel, else bias[co]), then op.forward. Stores as
// wide as e's alignment allows; returns the 4 mask bits (element j: bit j).
template <bool kPerChannel, typename T, typename Op>
__device__ __forceinline__ u32 store4_(T* dst, const float4& v4, int valid, const Op& op,
                                       const T* bias, int co, typename Num<T>::op_t alpha) {
  const float in[4] = {v4.x, v4.y, v4.z, v4.w};
  union {
    T e[4];
    u32 w[sizeof(T)];  // the same 4 * sizeof(T) bytes as words
  } out;
  u32 bits = 0;
  T b = Num<T>::zero();
  if (bias && !kPerChannel && valid > 0) b = bias[co];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    T v = Num<T>::from_op(in[j]);
    if (bias && j < valid) v = add_bias(v, kPerChannel ? bias[co + j] : b, alpha);
    bool bit;
    out.e[j] = op.forward(v, bit);
    bits |= (u32)(bit && j < valid) << j;
  }
  const u64 at = (u64)dst;
  if (valid == 4 && (at & (4 * sizeof(T) - 1)) == 0) {  // one 4-element store
    if (sizeof(T) == 4)
      *reinterpret_cast<uint4*>(dst) = make_uint4(out.w[0], out.w[1], out.w[2], out.w[3]);
    else
      *reinterpret_cast<uint2*>(dst) = make_uint2(out.w[0], out.w[1]);
  } else if (valid == 4 && (at & (2 * sizeof(T) - 1)) == 0) {  // two 2-element stores
    if (sizeof(T) == 4) {
      reinterpret_cast<uint2*>(dst)[0] = make_uint2(out.w[0], out.w[1]);
      reinterpret_cast<uint2*>(dst)[1] = make_uint2(out.w[2], out.w[3]);
    } else {
      reinterpret_cast<u32*>(dst)[0] = out.w[0];
      reinterpret_cast<u32*>(dst)[1] = out.w[1];
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (j < valid) dst[j] = out.e[j];
  }
  return bits;
}

// The 32-bit mask words of a warp's 128 consecutive bits, 4 per lane in lane
// order (lane l holds bits 4l .. 4l + 3 in `nib`): lane l gets word l / 8.
__device__ __forceinline__ u32 gather_word(u32 nib, int lane) {
  u32 w = nib << (4 * (lane & 7));
  w |= __shfl_xor_sync(0xffffffffu, w, 1);
  w |= __shfl_xor_sync(0xffffffffu, w, 2);
  w |= __shfl_xor_sync(0xffffffffu, w, 4);
  return w;
}

// Blocks per SM the registers must allow (the shared memory plan in
// _conv.tiling matches): three with three passes, four with one, except on
// sm_100 and later, where ptxas needs a few more than 128 registers.
#if __CUDA_ARCH__ >= 1000
constexpr int kOnePassBlocks = 3;
#else
constexpr int kOnePassBlocks = 4;
#endif

template <typename T, int kPasses, bool kChannelsLast>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 ? 3 : kOnePassBlocks)
    conv2d_kernel(const ConvParams p) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  extern __shared__ __align__(16) float smem[];
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int cols = 1 << p.c_log2;
  const int tile_n = blockIdx.y * kBN;
  const int khw = p.kh * p.kw;
  const int kc = p.cc * khw;
  const int plane = p.patch_h * p.patch_w;
  const int k_total = p.cin * khw;
  const bool one_chunk = p.cin <= p.cc;  // the weights stay for every tile

  // Shared memory (see _conv.tiling): koff [kc_pad] | the patch, [cc + 1]
  // planes of PH x PW (the last one zero), then with three passes its small
  // parts at + kPatchPart; the epilogue tile reuses this space | the
  // weights, [kc_pad][kWeightStride] (k-major), small parts at + kWeightPart.
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  int* koff = reinterpret_cast<int*>(smem);
  u32* patch = reinterpret_cast<u32*>(smem) + p.kc_pad;
  const int patch_words = kParts == 2 ? 2 * kPatchPart : (p.cc + 1) * plane;
  u32* bs = patch + (patch_words > kEpilogueFloats ? patch_words : kEpilogueFloats);
  constexpr int kBS = kWeightStride;

  build_koff(koff, p, tid);

  // Shared addresses of this thread's eight A rows (4 row tiles x g, g + 8)
  // at depth 0, and of its B column at depth t.
  const int wm = warp & 1, wn = warp >> 1;
  const u32 patch_addr = (u32)__cvta_generic_to_shared(patch);
  u32 a_addr[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ml = wm * 64 + i * 16 + g + h * 8;
      const int e = (ml >> p.c_log2) * p.sh * p.patch_w + (ml & (cols - 1)) * p.sw;
      a_addr[i][h] = patch_addr + e * 4;
    }
  const u32 b_addr = (u32)__cvta_generic_to_shared(bs) + (t * kBS + wn * 32 + g) * 4;

  Params ap;  // the elementwise functor's scalars
  ap.slope = p.slope;
  ap.scale = p.scale;
  const DivLeakyRelu<T> op(ap);
  const typename Num<T>::op_t alpha = scalar_from_bits<typename Num<T>::op_t>(p.alpha);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const long long out_plane = (long long)p.oh * p.ow;
  const int tiles = p.n * p.tiles_h * p.tiles_w;
  const int image = p.cin * p.h * p.w_in;  // < 2^31 (_conv.fits)

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // This tile's rectangle: image n, output rows oh0.., columns ow0..
    const int tw = tile % p.tiles_w;
    const int th = (tile / p.tiles_w) % p.tiles_h;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th * (kBM >> p.c_log2), ow0 = tw * cols;
    const int ih_base = oh0 * p.sh - p.ph, iw_base = ow0 * p.sw - p.pw;
    const T* xn = x + (long long)n * image;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

    for (int c0 = 0; c0 < p.cin; c0 += p.cc) {
      __syncthreads();  // the previous MMAs and epilogue are done with shared memory
      if (c0 == 0)
        for (int i = tid; i < plane; i += kConvThreads)
          put_split<kPasses>(patch, p.cc * plane + i, kPatchPart, 0.f);
      load_patch<T, kPasses, kChannelsLast>(patch, p, xn, c0, ih_base, iw_base, tid);
      // The chunk's weights, k-major: depth [c0 * kh * kw, + kc_pad), zero past K.
      if (!one_chunk || tile == (int)blockIdx.x) {
        const int k_first = c0 * khw;
        for (int r = warp; r < kBN; r += kConvThreads / 32) {
          const int co = tile_n + r;
#pragma unroll 4
          for (int k = lane; k < p.kc_pad; k += 32) {
            const float v = co < p.cout && k < kc && k_first + k < k_total
                                ? Num<T>::to_op(w[(long long)co * k_total + k_first + k])
                                : 0.f;
            put_split<kPasses>(bs, k * kBS + r, kWeightPart, v);
          }
        }
      }
      __syncthreads();

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
    __syncthreads();  // done with the patch: the epilogue tile takes its place

    // Epilogue: the tile into shared memory ...
    float* ct = reinterpret_cast<float*>(patch);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int ml = wm * 64 + i * 16 + g + (q >> 1) * 8;
          const int nl = wn * 32 + j * 8 + 2 * t + (q & 1);
          ct[kChannelsLast ? ml * kCSL + nl : nl * kCS + ml] = acc[i][j][q];
        }
    __syncthreads();

    // ... then out: each lane takes 4 consecutive elements of a line of the
    // tile (one 16-byte shared load), a line being one channel's 128
    // positions (NCHW: R rows of C) or, per half-warp, one position's 64
    // channels (NHWC). Values round to T, then bias, division and LeakyReLU
    // (the elementwise functor); stores are as wide as alignment allows.
    // Mask: each lane's 4 bits OR together across 8 lanes into the word of
    // 32 consecutive elements, and write_mask places the words of each
    // stretch of consecutive elements (an output row, a position).
    const int lane4 = lane * 4;
    if (!kChannelsLast) {
      const int row = lane4 >> p.c_log2, col = lane4 & (cols - 1);  // this lane's
      const int valid = oh0 + row < p.oh ? max(0, min(4, p.ow - ow0 - col)) : 0;
      // Element of channel tile_n, tile row 0, column 0; output rows of the
      // tile inside the image and their valid columns (a stretch each).
      const long long e_tile =
          ((long long)n * p.cout + tile_n) * out_plane + (long long)oh0 * p.ow + ow0;
      T* y_lane = y + e_tile + row * p.ow + col;
      const int rows = min(kBM >> p.c_log2, p.oh - oh0), row_len = min(cols, p.ow - ow0);
      const int per_row = cols >> 5;  // mask words per output row: 1, 2 or 4
      const int lines = min(kBN, p.cout - tile_n);
      for (int line = warp; line < lines; line += kConvThreads / 32) {
        const float4 v4 = *reinterpret_cast<const float4*>(ct + line * kCS + lane4);
        const u32 nib =
            store4_<false>(y_lane + line * out_plane, v4, valid, op, bias, tile_n + line, alpha);
        if (p.mask) {
          const u32 word = gather_word(nib, lane);
          const long long e_line = e_tile + line * out_plane;
          for (int r = 0; r < rows; ++r)  // (rows <= 4: one stretch per output row)
            write_mask(p.mask, lane, e_line + r * p.ow, row_len, word, r * per_row, per_row);
        }
      }
    } else {
      const int half = lane >> 4, c4 = (lane & 15) * 4;  // position line + half, channels c4..
      const int co = tile_n + c4;
      const int valid = max(0, min(4, p.cout - co));
      const int len = max(0, min(kBN, p.cout - tile_n));
      for (int line = warp * 2; line < kBM; line += kConvThreads / 16) {
        const int ml = line + half;
        const int oh = oh0 + (ml >> p.c_log2), ow = ow0 + (ml & (cols - 1));
        const bool pos_ok = oh < p.oh && ow < p.ow;
        const long long row = (((long long)n * p.oh + oh) * p.ow + ow) * p.cout;
        const float4 v4 = *reinterpret_cast<const float4*>(ct + ml * kCSL + c4);
        const u32 nib = store4_<true>(y + row + co, v4, pos_ok ? valid : 0, op, bias, co, alpha);
        if (p.mask) {
          const u32 word = gather_word(nib, lane);
          // the two positions' stretches: words 0-1 and 2-3
          const int ml0 = line, ml1 = line + 1;
          const int oh_a = oh0 + (ml0 >> p.c_log2), ow_a = ow0 + (ml0 & (cols - 1));
          const int oh_b = oh0 + (ml1 >> p.c_log2), ow_b = ow0 + (ml1 & (cols - 1));
          const bool ok_a = oh_a < p.oh && ow_a < p.ow, ok_b = oh_b < p.oh && ow_b < p.ow;
          write_mask(p.mask, lane, (((long long)n * p.oh + oh_a) * p.ow + ow_a) * p.cout + tile_n,
                     ok_a ? len : 0, word, 0, 2);
          write_mask(p.mask, lane, (((long long)n * p.oh + oh_b) * p.ow + ow_b) * p.cout + tile_n,
                     ok_b ? len : 0, word, 2, 2);
        }
      }
    }
  }
}

}  // namespace cupy_act
