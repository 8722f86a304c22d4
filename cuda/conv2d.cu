// conv2d.cu: 2-D convolution + bias + divide + LeakyReLU (+ 1-bit mask), fused.
//
//   conv2d_kernel<T, kPasses, kChannelsLast>
//     y = leaky_relu((conv2d(x, w) + bias) / divisor, slope)    written once
//
// An implicit GEMM on tensor cores (mma.sync m16n8k8 TF32, sm_80 and later):
//   rows    m = output positions (n, oh, ow)
//   columns j = output channels co
//   depth   k = (ci, kh, kw), the weight's OIHW order
// Each 128-thread block computes a 128 x 64 tile: 128 output positions, a
// rectangle of R rows x C columns (C = 32, 64 or 128, R = 128 / C) of one
// image, for 64 output channels. It walks the input channels in chunks of cc:
// per chunk it copies the input patch under the rectangle (cc planes of
// PH x PW, zero where the padding is) and the chunk's weights (64 x cc*kH*kW)
// into shared memory with plain coalesced loads, then runs the MMAs from
// there. The A operand needs no per-element index arithmetic: the patch offset
// of (m, k) is moff(m) + koff(k), moff in registers, koff from a table built
// once per block. Depth padded up to a multiple of 8 points koff at a plane
// of zeros (so inf and NaN in x never meet a padding weight).
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
// in the output's memory order). The buffer is zeroed before the launch. The
// ballots of one output row (NCHW) or position (NHWC) of the tile are
// consecutive elements: a word they cover entirely is stored, the words at
// either end are OR-ed in atomically, since a neighbour owns their other bits.
#include "numerics.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

struct ConvParams {
  const void* x;               // input, NCHW or NHWC (per kChannelsLast), dense
  const void* w;               // weight, OIHW, dense
  const void* bias;            // (Cout,) or null
  void* y;                     // output, the input's layout
  u32* mask;                   // zeroed mask buffer, or null: no mask
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
};

constexpr int kConvThreads = 128;
constexpr int kBM = 128;       // output positions per block
constexpr int kBN = 64;        // output channels per block
constexpr int kCS = kBM + 4;   // epilogue tile, NCHW: [kBN][kCS]
constexpr int kCSL = kBN + 4;  // epilogue tile, NHWC: [kBM][kCSL]
// Dynamic shared memory: max(epilogue tile, table + patch + weights); the host
// (cupy_act/_conv.py) computes the same sizes.
constexpr int kEpilogueFloats = kBM * kCSL > kBN* kCS ? kBM * kCSL : kBN * kCS;

__device__ __forceinline__ u32 to_tf32(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ bool finite_bits(u32 b) { return (b & 0x7f800000u) != 0x7f800000u; }

// The operands of x in kPasses passes, as stored in shared memory. One pass:
// tf32(x). Three: big = tf32(x), small = tf32(x - big); a non-finite x (or one
// whose big rounds to inf) is stored as big = 0, small = x, so that of the
// three products only small_a * big_b or big_a * small_b carries it, against
// the other operand's finite part, and no padding or correction term turns
// it into NaN (inf * 0) where the FP32 sum would not. (Both operands
// non-finite in one product gives NaN where the sum may give inf.)
template <int kPasses>
__device__ __forceinline__ void split(float x, u32& big, u32& small) {
  big = to_tf32(x);
  if (kPasses == 1) return;
  if (!finite_bits(big)) {
    small = big;
    big = 0u;
    return;
  }
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(__uint_as_float(big)));
  small = to_tf32(r);
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

// The mask words of elements [e, e + len), consecutive, whose bits are the
// runs bits[first], ..., bits[first + count - 1] (bit i of the stream is
// element e + i; count * 32 >= len; invalid elements' bits are 0). Lane j
// writes word (e >> 5) + j: stored if the elements cover all of it, else
// OR-ed in atomically (a neighbouring warp or block owns its other bits;
// the buffer starts zeroed, so zero words are skipped). Warp-uniform call.
template <int kMax>
__device__ __forceinline__ void write_mask(u32* mask, int lane, long long e, int len,
                                           const u32 (&bits)[kMax], int first, int count) {
  if (len <= 0) return;
  const int sh = (int)(e & 31);
  const long long w0 = e >> 5;
  const int words = (int)(((e + len - 1) >> 5) - w0) + 1;
  if (lane >= words) return;
  u32 hi = 0, lo = 0;  // word j = (bits[j] << sh) | (bits[j - 1] >> (32 - sh))
#pragma unroll
  for (int r = 0; r < kMax; ++r)
    if (r >= first && r < first + count) {
      if (lane == r - first) hi = bits[r];
      if (lane == r - first + 1) lo = bits[r];
    }
  const u32 word = __funnelshift_l(lo, hi, sh);
  if (word == 0u) return;
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

// A warp's walk over warp-wide copy items (hi, mid, lo), lo fastest, in steps
// of the warp count: counters instead of divisions per item.
struct Walk {
  int hi, mid, lo, n_mid, n_lo;
  __device__ __forceinline__ Walk(int start, int n_mid_, int n_lo_) : n_mid(n_mid_), n_lo(n_lo_) {
    lo = start % n_lo;
    const int q = start / n_lo;
    mid = q % n_mid;
    hi = q / n_mid;
  }
  __device__ __forceinline__ void step(int k) {
    lo += k;
    while (lo >= n_lo) {
      lo -= n_lo;
      if (++mid == n_mid) {
        mid = 0;
        ++hi;
      }
    }
  }
};

// Global -> shared copy of the items (hi < n_hi) of a Walk, 8 loads in flight
// per thread: item(walk, v) sets v and returns this lane's shared index (or
// -1: nothing to store), where split<kPasses>(v) goes, the small part at
// + small_at. All loads of a batch issue before any store waits.
template <int kPasses, typename Item>
__device__ __forceinline__ void copy_batched(Walk wk, int n_hi, u32* dst, int small_at, Item item) {
  constexpr int kWarps = kConvThreads / 32, kInFlight = 8;
  while (wk.hi < n_hi) {
    float v[kInFlight];
    int at[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      at[u] = wk.hi < n_hi ? item(wk, v[u]) : -1;
      wk.step(kWarps);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (at[u] >= 0) {
        u32 big, small;
        split<kPasses>(v[u], big, small);
        dst[at[u]] = big;
        if (kPasses == 3) dst[at[u] + small_at] = small;
      }
  }
}

template <typename T, int kPasses, bool kChannelsLast>
__global__ void __launch_bounds__(kConvThreads, kPasses == 3 ? 3 : 4)
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
  const long long k_total = (long long)p.cin * khw;
  const bool one_chunk = p.cin <= p.cc;  // the weights stay for every tile

  // Shared memory (see _conv.tiling): koff [kc_pad] | the patch, [cc + 1]
  // planes of PH x PW for each of the kPasses parts (one, or big and small;
  // the last plane zero), whose space the epilogue tile reuses | the
  // weights, [kBN][kc_pad + 4] for each part. Operands are stored split.
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  int* koff = reinterpret_cast<int*>(smem);
  u32* patch = reinterpret_cast<u32*>(smem) + p.kc_pad;
  const int part_floats = (p.cc + 1) * plane;
  const int patch_floats = kParts * part_floats;
  u32* bs = patch + (patch_floats > kEpilogueFloats ? patch_floats : kEpilogueFloats);
  const int bstride = p.kc_pad + 4;  // (g * bstride + t) % 32 distinct
  const int b_part = kBN * bstride;

  for (int k = tid; k < p.kc_pad; k += kConvThreads) {
    int off = p.cc * plane;  // depth padding: the zero plane
    if (k < kc) {
      const int ci = k / khw, rs = k - ci * khw, r = rs / p.kw, s = rs - r * p.kw;
      off = ci * plane + r * p.dh * p.patch_w + s * p.dw;
    }
    koff[k] = off;
  }

  // Patch offsets of this thread's eight A rows (4 row tiles x g, g + 8).
  const int wm = warp & 1, wn = warp >> 1;
  int moff[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ml = wm * 64 + i * 16 + g + h * 8;
      moff[i][h] = (ml >> p.c_log2) * p.sh * p.patch_w + (ml & (cols - 1)) * p.sw;
    }

  Params ap;  // the elementwise functor's scalars
  ap.slope = p.slope;
  ap.scale = p.scale;
  const DivLeakyRelu<T> op(ap);
  const typename Num<T>::op_t alpha = scalar_from_bits<typename Num<T>::op_t>(p.alpha);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const long long out_plane = (long long)p.oh * p.ow;
  const int segs = (p.patch_w + 31) >> 5, ksegs = (p.kc_pad + 31) >> 5;
  const int tiles = p.n * p.tiles_h * p.tiles_w;

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // This tile's rectangle: image n, output rows oh0.., columns ow0..
    const int tw = tile % p.tiles_w;
    const int th = (tile / p.tiles_w) % p.tiles_h;
    const int n = tile / (p.tiles_w * p.tiles_h);
    const int oh0 = th * (kBM >> p.c_log2), ow0 = tw * cols;
    const int ih_base = oh0 * p.sh - p.ph, iw_base = ow0 * p.sw - p.pw;

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
#pragma unroll
          for (int part = 0; part < kParts; ++part)
            patch[part * part_floats + p.cc * plane + i] = 0u;
      // The input patch of channels [c0, c0 + cc), zero outside the image: one
      // warp-wide item is 32 consecutive patch columns of one (channel, row),
      // channel-fastest for NHWC (a batch reads whole sectors), else
      // column-fastest.
      auto patch_item = [&](const Walk& wk, float& v, int c, int pr, int seg) {
        const int pc = seg * 32 + lane, ih = ih_base + pr, iw = iw_base + pc;
        if (pc >= p.patch_w) return -1;
        v = 0.f;
        if (c0 + c < p.cin && (unsigned)ih < (unsigned)p.h && (unsigned)iw < (unsigned)p.w_in) {
          const long long at = kChannelsLast
                                   ? (((long long)n * p.h + ih) * p.w_in + iw) * p.cin + c0 + c
                                   : (((long long)n * p.cin + c0 + c) * p.h + ih) * p.w_in + iw;
          v = Num<T>::to_op(x[at]);
        }
        return (c * p.patch_h + pr) * p.patch_w + pc;
      };
      if (kChannelsLast)
        copy_batched<kPasses>(
            Walk(warp, segs, p.cc), p.patch_h, patch, part_floats,
            [&](const Walk& wk, float& v) { return patch_item(wk, v, wk.lo, wk.hi, wk.mid); });
      else
        copy_batched<kPasses>(
            Walk(warp, p.patch_h, segs), p.cc, patch, part_floats,
            [&](const Walk& wk, float& v) { return patch_item(wk, v, wk.hi, wk.mid, wk.lo); });
      // The chunk's weights: rows co, depth [c0 * kh * kw, + kc_pad), zero past K.
      if (!one_chunk || tile == (int)blockIdx.x) {
        const long long k_first = (long long)c0 * khw;
        copy_batched<kPasses>(Walk(warp, kBN, ksegs), 1, bs, b_part, [&](const Walk& wk, float& v) {
          const int k = wk.lo * 32 + lane, co = tile_n + wk.mid;
          if (k >= p.kc_pad) return -1;
          v = co < p.cout && k < kc && k_first + k < k_total
                  ? Num<T>::to_op(w[(long long)co * k_total + k_first + k])
                  : 0.f;
          return wk.mid * bstride + k;
        });
      }
      __syncthreads();

      for (int k0 = 0; k0 < p.kc_pad; k0 += 8) {
        const int ko0 = koff[k0 + t], ko1 = koff[k0 + t + 4];
        u32 a[2][4][4], b[2][4][2];
#pragma unroll
        for (int part = 0; part < kParts; ++part) {
          const u32* pa = patch + part * part_floats;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            a[part][i][0] = pa[moff[i][0] + ko0];
            a[part][i][1] = pa[moff[i][1] + ko0];
            a[part][i][2] = pa[moff[i][0] + ko1];
            a[part][i][3] = pa[moff[i][1] + ko1];
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const u32* row = bs + part * b_part + (wn * 32 + j * 8 + g) * bstride + k0;
            b[part][j][0] = row[t];
            b[part][j][1] = row[t + 4];
          }
        }
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

    // ... then out in warp-wide runs along memory: 32 positions of one output
    // row and channel (NCHW; C >= 32, so a run never leaves its row) or 32
    // channels of one position (NHWC). The valid lanes of a run are a prefix.
    if (!kChannelsLast) {
      const int per_row = cols >> 5;  // runs per output row: 1, 2 or 4
      long long e0[kBM / 32];
      int len[kBM / 32];  // valid lanes of each run; of its row, for a row's first run
#pragma unroll
      for (int u = 0; u < kBM / 32; ++u) {
        const int oh = oh0 + ((u * 32) >> p.c_log2), ow = ow0 + ((u * 32) & (cols - 1));
        len[u] = oh < p.oh ? max(0, min(32, p.ow - ow)) : 0;
        e0[u] = (long long)n * p.cout * out_plane + (long long)oh * p.ow + ow;
      }
      T* y_lane = y + lane;
      for (int line = warp; line < kBN; line += kConvThreads / 32) {
        const int co = tile_n + line;
        if (co >= p.cout) break;  // (warp-uniform)
        T b = Num<T>::zero();
        if (bias) b = bias[co];
        const long long shift = co * out_plane;
        u32 bits[kBM / 32];
#pragma unroll
        for (int u = 0; u < kBM / 32; ++u) {
          bool bit = false;
          if (lane < len[u]) {
            T v = Num<T>::from_op(ct[line * kCS + u * 32 + lane]);
            if (bias) v = add_bias(v, b, alpha);
            y_lane[e0[u] + shift] = op.forward(v, bit);
          }
          bits[u] = __ballot_sync(0xffffffffu, bit);
        }
        if (p.mask) {
#pragma unroll
          for (int u = 0; u < kBM / 32; ++u)
            if (u % per_row == 0) {
              int row_len = 0;
#pragma unroll
              for (int r = u; r < kBM / 32; ++r)
                if (r < u + per_row) row_len += len[r];
              write_mask<kBM / 32>(p.mask, lane, e0[u] + shift, row_len, bits, u, per_row);
            }
        }
      }
    } else {
      const int len0 = max(0, min(32, p.cout - tile_n)),
                len1 = max(0, min(32, p.cout - tile_n - 32));
      for (int line = warp; line < kBM; line += kConvThreads / 32) {
        const int oh = oh0 + (line >> p.c_log2), ow = ow0 + (line & (cols - 1));
        if (oh >= p.oh || ow >= p.ow) continue;  // (warp-uniform)
        const long long row = (((long long)n * p.oh + oh) * p.ow + ow) * p.cout;
        u32 bits[kBN / 32];
#pragma unroll
        for (int u = 0; u < kBN / 32; ++u) {
          const int co = tile_n + u * 32 + lane;
          bool bit = false;
          if (lane < (u ? len1 : len0)) {
            T v = Num<T>::from_op(ct[line * kCSL + u * 32 + lane]);
            if (bias) v = add_bias(v, bias[co], alpha);
            y[row + co] = op.forward(v, bit);
          }
          bits[u] = __ballot_sync(0xffffffffu, bit);
        }
        if (p.mask) write_mask<kBN / 32>(p.mask, lane, row + tile_n, len0 + len1, bits, 0, 2);
      }
    }
  }
}

}  // namespace cupy_act
