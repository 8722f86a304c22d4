// conv2d.cu: 2-D convolution + bias + divide + LeakyReLU (+ 1-bit mask), fused.
//
//   conv2d_kernel<T, kPasses, kChannelsLast>
//     y = leaky_relu((conv2d(x, w) + bias) / divisor, slope)    written once
//
// An implicit GEMM on tensor cores (mma.sync m16n8k8 TF32, sm_80 and later):
//   rows    m = (n, oh, ow)            M = N * OH * OW   (output positions)
//   columns j = co                     Cout              (output channels)
//   depth   k = (ci, kh, kw) for NCHW, (kh, kw, ci) for NHWC: the weight's own
//           memory order in both layouts, so its rows are read as they lie.
// A[m][k] is the input under the filter tap, gathered on the fly (zero outside
// the padded image); B[k][j] is the weight. Each 128-thread block computes a
// 128 x 64 tile of the output over the whole depth, 8 at a time, with the next
// depth slice loaded into registers while the tensor cores work on the current
// one (two shared-memory buffers, one barrier per slice).
//
// Precision. kPasses = 3 is the 3xTF32 split: every float a is a_big + a_small
// with a_big = tf32(a) and a_small = tf32(a - a_big), and a * b is summed as
// a_small * b_big + a_big * b_small + a_big * b_big (the small * small term,
// below 2^-22 |a b|, is dropped), so products keep about 21 of float32's 24
// bits and the sum accumulates in float32: FP32 accuracy, not bit equality
// with cuDNN, whose summation order no one can match. kPasses = 1 is plain
// TF32 (10-bit mantissas, what cuDNN and torch.compile use with TF32 allowed).
// float16 and bfloat16 inputs convert to float exactly and fit TF32 exactly,
// so one pass gives exact products with float32 accumulation.
// Non-finite inputs: the correction terms take inf and NaN operands as 0, so
// only a_big * b_big carries them and they propagate as in an FP32 sum
// (inf * 0 = NaN, inf - inf = NaN). |a| within 2^-11 of FLT_MAX rounds to inf.
//
// Epilogue. The tile goes through shared memory so that each warp then holds
// 32 consecutive output elements of one channel (NCHW) or one position
// (NHWC): stores are coalesced, and the mask bits of a run come from one
// ballot. The value is rounded to T (the convolution's output), then bias,
// division and LeakyReLU are the elementwise op's own functor and add_bias,
// so they round exactly as eager PyTorch's separate ops do.
//
// Mask: the format of elementwise.cu (bit i % 32 of word i / 32 is element i,
// in the output's memory order). The buffer is zeroed before the launch. A run
// of 32 consecutive elements covers at most two words; a word whose 32 bits
// all come from this warp's runs is stored, every other word (the ends of a
// stretch of runs, runs broken by an image or tile edge) is OR-ed in
// atomically, since a neighbouring block owns its other bits.
#include "numerics.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

struct ConvParams {
  const void* x;       // input, NCHW or NHWC (per kChannelsLast), dense
  const void* w;       // weight, dense in the same order: (Cout, K) row-major
  const void* bias;    // (Cout,) or null
  void* y;             // output, the input's layout
  u32* mask;           // zeroed mask buffer, or null: no mask
  long long m_total;   // N * OH * OW
  int cin, h, w_in;    // input channels and size
  int cout, oh, ow;    // output channels and size
  int kh, kw;          // filter size
  int sh, sw, ph, pw, dh, dw;  // stride, zero padding, dilation
  int k;               // Cin * KH * KW
  int pad_;            // (keeps the next fields 8-byte aligned)
  u64 slope, scale, alpha;  // float bits, as in Params
};

constexpr int kConvThreads = 128;
constexpr int kBM = 128;        // output positions per block
constexpr int kBN = 64;         // output channels per block
constexpr int kBK = 8;          // depth per slice
constexpr int kAS = kBM + 8;    // A slice row stride: (t * kAS + g) % 32 distinct
constexpr int kBS = kBK + 4;    // B slice row stride: (g * kBS + t) % 32 distinct
constexpr int kAStage = kBK * kAS;
constexpr int kBStage = kBN * kBS;
constexpr int kCS = kBM + 4;    // epilogue tile, NCHW: [kBN][kCS]
constexpr int kCSL = kBN + 4;   // epilogue tile, NHWC: [kBM][kCSL]
constexpr int kSmemFloats = kBM * kCSL > 2 * (kAStage + kBStage) ? kBM * kCSL
                                                                  : 2 * (kAStage + kBStage);

__device__ __forceinline__ u32 to_tf32(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ bool finite_bits(u32 b) { return (b & 0x7f800000u) != 0x7f800000u; }

// x = big + small (see the top); small is 0 where big is not finite.
__device__ __forceinline__ void split_tf32(float x, u32& big, u32& small) {
  big = to_tf32(x);
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(__uint_as_float(big)));
  small = finite_bits(big) ? to_tf32(r) : 0u;
}

// big, or 0 where it is not finite: the operand of a correction term.
__device__ __forceinline__ u32 finite_or_zero(u32 big) { return finite_bits(big) ? big : 0u; }

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

// Mask words from warp-wide runs of 32 consecutive elements (see the top).
// Every call is warp-uniform; lane 0 does the word writes.
struct MaskRuns {
  long long next = -1;  // first element after the previous clean run
  long long pend = -1;  // word that holds the previous run's high bits, if any
  u32 high = 0;         // those bits

  __device__ __forceinline__ void flush(u32* mask, int lane) {
    if (pend >= 0 && lane == 0) atomicOr(mask + pend, high);
    pend = -1;
  }
  // e: this lane's element (valid lanes), bit: its mask bit.
  __device__ __forceinline__ void put(u32* mask, int lane, bool valid, long long e, bool bit) {
    const long long e0 = __shfl_sync(0xffffffffu, e, 0);
    const bool clean = __all_sync(0xffffffffu, valid && e == e0 + lane);
    const u32 bits = __ballot_sync(0xffffffffu, valid && bit);
    if (!clean) {
      flush(mask, lane);
      next = -1;
      if (valid && bit) atomicOr(mask + (e >> 5), 1u << (e & 31));
      return;
    }
    const int sh = (int)(e0 & 31);
    const long long word = e0 >> 5;
    u32 low = bits << sh;
    if (next == e0 && pend == word) {  // the previous run filled the rest: complete
      low |= high;
      pend = -1;
      if (lane == 0) mask[word] = low;
    } else {
      flush(mask, lane);
      if (lane == 0) {
        if (sh == 0)
          mask[word] = low;  // the whole word is this run
        else
          atomicOr(mask + word, low);
      }
    }
    if (sh != 0) {
      high = bits >> (32 - sh);
      pend = word + 1;
    }
    next = e0 + 32;
  }
};

template <typename T, int kPasses, bool kChannelsLast>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 ? 2 : 4) conv2d_kernel(const ConvParams p) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  __shared__ __align__(16) float smem[kSmemFloats];
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long tile_m = (long long)blockIdx.x * kBM;
  const int tile_n = blockIdx.y * kBN;
  const int plane = p.oh * p.ow;

  // This thread gathers row m = tile_m + tid of A.
  const long long m_row = tile_m + tid;
  const bool row_ok = m_row < p.m_total;
  int ih0 = 0, iw0 = 0;
  const T* xb = x;
  {
    const long long n = row_ok ? m_row / plane : 0;
    const int pos = row_ok ? (int)(m_row - n * plane) : 0;
    ih0 = (pos / p.ow) * p.sh - p.ph;
    iw0 = (pos % p.ow) * p.sw - p.pw;
    xb = x + n * ((long long)p.cin * p.h * p.w_in);
  }
  // Depth counters of this thread's next slice: (ci, r, s) = channel and filter
  // tap, advanced one k at a time in the layout's order.
  int ci = 0, r = 0, s = 0;
  float a_next[kBK];
  float b_next[4];
  const int b_row = tid >> 1, b_col = (tid & 1) * 4;  // this thread's B elements

  auto load = [&](int k0) {
#pragma unroll
    for (int j = 0; j < kBK; ++j) {
      const int ih = ih0 + r * p.dh, iw = iw0 + s * p.dw;
      const bool ok = row_ok && k0 + j < p.k && (unsigned)ih < (unsigned)p.h &&
                      (unsigned)iw < (unsigned)p.w_in;
      const int off = kChannelsLast ? (ih * p.w_in + iw) * p.cin + ci
                                    : (ci * p.h + ih) * p.w_in + iw;
      a_next[j] = ok ? Num<T>::to_op(xb[off]) : 0.f;
      if (kChannelsLast) {  // k = (r, s, ci)
        if (++ci == p.cin) {
          ci = 0;
          if (++s == p.kw) {
            s = 0;
            ++r;
          }
        }
      } else {  // k = (ci, r, s)
        if (++s == p.kw) {
          s = 0;
          if (++r == p.kh) {
            r = 0;
            ++ci;
          }
        }
      }
    }
    const int co = tile_n + b_row;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = k0 + b_col + j;
      b_next[j] = co < p.cout && k < p.k ? Num<T>::to_op(w[(long long)co * p.k + k]) : 0.f;
    }
  };
  auto store = [&](int buf) {
    float* as = smem + buf * (kAStage + kBStage);
    float* bs = as + kAStage;
#pragma unroll
    for (int j = 0; j < kBK; ++j) as[j * kAS + tid] = a_next[j];
    *reinterpret_cast<float4*>(bs + b_row * kBS + b_col) =
        make_float4(b_next[0], b_next[1], b_next[2], b_next[3]);
  };

  // Warps tile the block 2 x 2: rows wm * 64 + [0, 64), columns wn * 32 + [0, 32).
  const int wm = warp & 1, wn = warp >> 1;
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  const int slices = (p.k + kBK - 1) / kBK;
  load(0);
  store(0);
  __syncthreads();
  for (int sl = 0; sl < slices; ++sl) {
    if (sl + 1 < slices) load((sl + 1) * kBK);  // in flight during the MMAs below
    const float* as = smem + (sl & 1) * (kAStage + kBStage);
    const float* bs = as + kAStage;
    u32 a[4][4], b[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float* col = as + wm * 64 + i * 16 + g;
      a[i][0] = __float_as_uint(col[t * kAS]);
      a[i][1] = __float_as_uint(col[t * kAS + 8]);
      a[i][2] = __float_as_uint(col[(t + 4) * kAS]);
      a[i][3] = __float_as_uint(col[(t + 4) * kAS + 8]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float* row = bs + (wn * 32 + j * 8 + g) * kBS;
      b[j][0] = __float_as_uint(row[t]);
      b[j][1] = __float_as_uint(row[t + 4]);
    }
    if (kPasses == 3) {
      u32 b_lo[4][2];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) split_tf32(__uint_as_float(b[j][q]), b[j][q], b_lo[j][q]);
      // One row tile at a time (fewer live registers): the correction terms
      // first (the smallest), each with finite operands only, then big * big.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 a_lo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) split_tf32(__uint_as_float(a[i][q]), a[i][q], a_lo[q]);
        const u32 ac[4] = {finite_or_zero(a[i][0]), finite_or_zero(a[i][1]),
                           finite_or_zero(a[i][2]), finite_or_zero(a[i][3])};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 bc[2] = {finite_or_zero(b[j][0]), finite_or_zero(b[j][1])};
          mma_tf32(acc[i][j], a_lo, bc);
          mma_tf32(acc[i][j], ac, b_lo[j]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_tf32(acc[i][j], a[i], b[j]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) a[i][q] = to_tf32(__uint_as_float(a[i][q]));
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) b[j][q] = to_tf32(__uint_as_float(b[j][q]));
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_tf32(acc[i][j], a[i], b[j]);
    }
    if (sl + 1 < slices) store((sl + 1) & 1);
    __syncthreads();
  }

  // Epilogue: the tile into shared memory (the slices are done with it) ...
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int ml = wm * 64 + i * 16 + g + (q >> 1) * 8;
        const int nl = wn * 32 + j * 8 + 2 * t + (q & 1);
        smem[kChannelsLast ? ml * kCSL + nl : nl * kCS + ml] = acc[i][j][q];
      }
  __syncthreads();

  // ... then out in warp-wide runs along memory: one channel's positions
  // (NCHW) or one position's channels (NHWC).
  Params ap;  // the elementwise functor's scalars
  ap.slope = p.slope;
  ap.scale = p.scale;
  const DivLeakyRelu<T> op(ap);
  const typename Num<T>::op_t alpha = scalar_from_bits<typename Num<T>::op_t>(p.alpha);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  MaskRuns runs;
  constexpr int kRuns = kChannelsLast ? kBN / 32 : kBM / 32;  // runs per line of the tile
  constexpr int kLines = kChannelsLast ? kBM : kBN;
  // NCHW: this lane's positions are the same on every line (channel), so each
  // run's element is base[u] + co * plane, its image and offset found once.
  long long base[kRuns];
  bool m_ok[kRuns];
#pragma unroll
  for (int u = 0; u < kRuns; ++u) {
    const long long m = tile_m + u * 32 + lane;
    m_ok[u] = m < p.m_total;
    const long long n = kChannelsLast || !m_ok[u] ? 0 : m / plane;
    base[u] = n * p.cout * plane + (m - n * plane);
  }
  for (int line = warp; line < kLines; line += kConvThreads / 32) {
#pragma unroll
    for (int u = 0; u < kRuns; ++u) {
      const int li = u * 32 + lane;  // index along the line
      long long e;
      bool valid;
      int co;
      if (kChannelsLast) {
        const long long m = tile_m + line;
        co = tile_n + li;
        valid = m < p.m_total && co < p.cout;
        e = m * p.cout + co;
      } else {
        co = tile_n + line;
        valid = m_ok[u] && co < p.cout;
        e = base[u] + (long long)co * plane;
      }
      bool bit = false;
      if (valid) {
        T v = Num<T>::from_op(smem[kChannelsLast ? line * kCSL + li : line * kCS + li]);
        if (bias) v = add_bias(v, bias[co], alpha);
        y[e] = op.forward(v, bit);
      }
      if (p.mask) runs.put(p.mask, lane, valid, e, bit);
    }
  }
  if (p.mask) runs.flush(p.mask, lane);
}

}  // namespace cupy_act
