// conv2d_dgrad.cu: the fused convolution block's input gradient, read once
// from the upstream gradient and the forward's 1-bit mask (dz never goes to
// memory). 3 x 3 filters, stride 1, dilation 1, zero padding up to 2
// (_conv.dgrad_fits).
//
//   conv2d_dgrad_kernel<T, kPasses, kChannelsLast>      (grid: blocks x groups of 8 input channels)
//     dx[n][ci][ih][iw] = sum over co, r, s of dz[n][co][oh][ow] * w[co][ci][r][s],
//                         oh = ih + ph - r, ow = iw + pw - s (inside dz)
//
// dz = d loss / d (conv + bias) is the elementwise op's backward of dy and the
// mask bit (DivLeakyRelu<T>::backward, as the weight gradient forms it).
//
// A GEMM, then col2im in registers. Per row oh of dz and 128 of its positions
// (4 warps x 2 MMA row tiles of 16), the tensor cores compute
//   Q[ow][(r, s, ci)] = sum over co of dz[oh][ow][co] * w[co][ci][r][s]
// with A = dz straight from global memory into MMA fragments (each dz value
// formed once: no im2col copies) and B = the weights, split once into
// shared memory in fragment order. Tap (r, s) of row oh belongs to input row
// ih = oh - ph + r, so each warp keeps three sets of accumulators R[ow][s][ci],
// one per input row in flight (a ring: the set of row ih is (ih - ih_a) % 3,
// static in code unrolled by three rows), and adds tap (r, s) of Q into the
// set of row oh - ph + r: the sum over r happens in the accumulators. After
// row oh, input row oh - ph has all its terms (r = 0 is the last); its set
// goes through shared memory, where dx[ih][iw][ci] = sum over s of
// R[iw + pw - s][s][ci] (s in order), is rounded to T and written, and the
// set is zeroed for the row three further on.
//
// Work: a block owns a contiguous run of input rows (n, column tile, ih),
// rows fastest; each stretch of one image and column tile processes the dz
// rows from ih_a + ph - 2 on, two more than it writes. Column tiles are 128
// dz positions apart less the kw - 1 = 2 they share (a tile owns the input
// columns whose dz columns all lie in it), so an output row up to 128 wide
// is one tile. The accumulators of positions past dz's edge hold products
// of zeros and are never read; channels past cout have zero weights.
//
// dy and the mask reach the MMAs one of two ways. kStaged (dy pairs in
// single loads: _conv.dgrad_staged): each thread copies the dy pairs and mask
// words it will read, kDgradStages - 1 depth steps ahead, into its own slots
// of shared memory by cp.async (zero-filled where an element does not
// exist): copies in flight hold no registers, and no thread reads another's
// slots, so no barrier. Else plain predicated loads into registers, one step
// ahead (three passes: the next row's first step too).
//
// Precision as the forward's: 3xTF32 for float32 ("fp32", products within
// 5 * 2^-22 |a b|), one TF32 pass otherwise (exact for 16-bit dz and
// weights), float32 sums; non-finite values as split() says. Deterministic:
// every sum has an order fixed by the shape (no atomics, no split reduction).
#include "conv2d_tiles.cuh"
#include "copy_engine.cuh"
#include "params.cuh"
#include "activations.cuh"

namespace cupy_act {

constexpr int kDgradTaps = 9;           // 3 x 3
constexpr int kDgradCols = 128;         // dz positions of a block's row
constexpr int kDgradStride = kDgradCols - 2;  // column tiles share kw - 1 dz columns
constexpr int kDgradRS = 25;            // words per position of the row sums: 3 x 8, + 1 (odd)
constexpr int kDgradStages = 4;         // kStaged: depth steps in shared memory (3 ahead)

template <int V>
struct Phase {
  static constexpr int value = V;
};

// src[0], src[1] from a (2 * sizeof(T))-byte aligned address where `pred`, else zeros.
template <typename T>
__device__ __forceinline__ void ldg2_if(const T* src, bool pred, T (&d)[2]) {
  union {
    T e[2];
    u32 w[2];
  } r;
  if (sizeof(T) == 4)
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @q ld.global.nc.v2.b32 {%0, %1}, [%2];\n}"
        : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(src), "r"((int)pred));
  else
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.b32 %0, 0;\n"
        " @q ld.global.nc.b32 %0, [%1];\n}"
        : "=r"(r.w[0]) : "l"(src), "r"((int)pred));
  d[0] = r.e[0];
  d[1] = r.e[1];
}

// dy at elements e and e + 1 and their mask words, loaded; dz formed later
// (form), so that a step's loads are in flight during the previous step's MMAs.
template <typename T>
struct DzPair {
  T d[2];
  u32 lo, hi;  // the mask words of e and, where e + 1 starts the next, of e + 1
  int sh;      // e % 32
};

// kVec: e is even and dy is (2 * sizeof(T))-aligned, and ok0 == ok1: one
// load of both; else one each. Predicated (no access where an element does
// not exist: zeros there).
template <bool kVec, typename T>
__device__ __forceinline__ void load_pair(DzPair<T>& q, const T* dy, const u32* mask, long long e,
                                          bool ok0, bool ok1) {
  const u32* m = mask + (e >> 5);
  q.sh = (int)(e & 31);
  q.lo = ldg_if(m, ok0 || ok1);
  if (kVec) {
    q.hi = 0u;
    ldg2_if(dy + e, ok0, q.d);
  } else {
    q.hi = ldg_if(m + 1, ok1 && q.sh == 31);
    q.d[0] = ldg_if(dy + e, ok0);
    q.d[1] = ldg_if(dy + e + 1, ok1);
  }
}

// The pair's dz values as floats, split into TF32 parts (big, small).
template <typename T, int kPasses>
__device__ __forceinline__ void form(const DzPair<T>& q, const DivLeakyRelu<T>& op, u32 (&big)[2],
                                     u32 (&small)[2]) {
  const u32 bits = __funnelshift_r(q.lo, q.hi, q.sh);
#pragma unroll
  for (int j = 0; j < 2; ++j)
    split<kPasses>(Num<T>::to_op(op.backward(q.d[j], (bits >> j) & 1u)), big[j], small[j]);
}

template <typename T, int kPasses, bool kChannelsLast, bool kStaged>
__global__ void __launch_bounds__(kConvThreads, 3) conv2d_dgrad_kernel(const ConvParams p) {
  static_assert(kPasses == 1 || kPasses == 3, "one TF32 pass or the 3xTF32 split");
  constexpr int kParts = kPasses == 3 ? 2 : 1;
  extern __shared__ __align__(16) float smem[];
  const T* w = static_cast<const T*>(p.w);
  const T* dy = static_cast<const T*>(p.y);
  T* dx = static_cast<T*>(p.gw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ci0 = blockIdx.y * 8;
  const int nk = (p.cout + 7) >> 3;  // depth steps of 8 output channels
  const int part = nk * kDgradTaps * 64;  // words per part of the weights

  // Shared memory (see _conv.dgrad_smem): the weights, [step][tap][lane][2]
  // words per part (big, then small at + part), in B fragment order | the
  // finished row's sums, [128][kDgradRS] floats | kStaged: per stage, the
  // dy pairs [4][128 threads] then their mask words [4][128 threads].
  u32* ws = reinterpret_cast<u32*>(smem);
  float* rs = smem + kParts * part;
  constexpr u32 kPair = 2 * sizeof(T);
  constexpr u32 kStageBytes = 4 * kConvThreads * (kPair + 4);
  char* stages = reinterpret_cast<char*>(rs + kDgradCols * kDgradRS);
  // this thread's slot j (0 .. 3) of a stage: its dy pair and its mask word
  auto pair_slot = [&](int j) { return (j * kConvThreads + tid) * kPair; };
  auto word_slot = [&](int j) { return 4 * kConvThreads * kPair + (j * kConvThreads + tid) * 4; };
  // B[k][n] of step kk and tap (r, s): k = t, t + 4 the channels co = 8 kk + t,
  // + 4 (NHWC: 8 kk + 2t, + 1, the channels a thread's dz pair holds), n = g
  // the input channel ci0 + g.
  for (int i = tid; i < nk * kDgradTaps * 32; i += kConvThreads) {
    const int l = i & 31, tap = (i >> 5) % kDgradTaps, kk = i / (kDgradTaps * 32);
    const int ci = ci0 + (l >> 2), lt = l & 3;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int co = kk * 8 + (kChannelsLast ? 2 * lt + q : lt + 4 * q);
      const bool ok = co < p.cout && ci < p.cin;
      const float v = ok ? Num<T>::to_op(w[((long long)co * p.cin + ci) * 9 + tap]) : 0.f;
      put_split<kPasses>(ws, 2 * i + q, part, v);
    }
  }
  __syncthreads();

  Params ap;  // the elementwise functor's scalars
  ap.slope = p.slope;
  ap.scale = p.scale;
  const DivLeakyRelu<T> op(ap);
  const u32 b_addr = (u32)__cvta_generic_to_shared(ws) + lane * 8;
  const u32 small_bytes = part * 4;  // the small parts' distance
  const long long out_plane = (long long)p.oh * p.ow;
  const int ctiles = p.tiles_w;
  const long long units = (long long)p.n * ctiles * p.h;  // input rows of all column tiles
  const long long u_first = (long long)blockIdx.x * p.tiles_per_split;
  const long long u_end = min(units, u_first + p.tiles_per_split);
  const int nci = min(8, p.cin - ci0);  // this block's input channels
  // One load per dz pair: pairs are consecutive elements at even offsets
  // (always so where kStaged).
  const bool vec = kStaged || ((kChannelsLast ? (p.cout & 1) == 0 : (p.ow & 1) == 0) &&
                               ((u64)dy & (2 * sizeof(T) - 1)) == 0);

  float acc[3][2][3][4];  // [input row set][row tile i][s][fragment]

  for (long long u = u_first; u < u_end;) {
    const int ih_a = (int)(u % p.h);
    const long long nj = u / p.h;
    const int j = (int)(nj % ctiles), n = (int)(nj / ctiles);
    const int ih_b = (int)min((long long)p.h, ih_a + (u_end - u));
    u += ih_b - ih_a;
    const int oh_last = ih_b - 1 + p.ph;  // the last dz row this stretch reads
    const int z0 = j * kDgradStride;  // first dz column of the tile
    // The input columns this tile owns: those whose dz columns lie in it.
    const int lo = j == 0 ? 0 : max(0, z0 + 2 - p.pw);
    const int hi = j == ctiles - 1 ? p.w_in : min(p.w_in, z0 + kDgradCols - p.pw);
#pragma unroll
    for (int a = 0; a < 3; ++a)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int s = 0; s < 3; ++s)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[a][i][s][q] = 0.f;

    // This thread's dz pairs (i, h) at depth step kk of row oh: element
    // indices, and whether each element exists.
    const int pos0 = z0 + warp * 32 + (kChannelsLast ? g : 2 * g);
    // Element (i, h) of the pair at depth step kk of row oh: its index, and
    // whether its first (ok0) and second (ok1) elements exist (the staged
    // copies' and reads' view of load_with's indices, which keep their own
    // copy: through this lambda the float32 three-pass kernel spilled on sm_80).
    auto element = [&](int oh, int kk, int i, int h, bool& ok0, bool& ok1) {
      const int co0 = kk * 8 + (kChannelsLast ? 2 * t : t);
      const long long e00 =
          kChannelsLast ? (((long long)n * p.oh + oh) * p.ow + pos0) * p.cout + co0
                        : (((long long)n * p.cout + co0) * p.oh + oh) * (long long)p.ow + pos0;
      if (kChannelsLast) {  // position pos0 + 16i + 8h, channels co0, co0 + 1
        const bool pos_ok = pos0 + 16 * i + 8 * h < p.ow;
        ok0 = pos_ok && co0 < p.cout;
        ok1 = pos_ok && co0 + 1 < p.cout;
        return e00 + (16 * i + 8 * h) * p.cout;
      }
      // positions pos0 + 16i, + 1, channel co0 + 4h
      const bool co_ok = co0 + 4 * h < p.cout;
      ok0 = co_ok && pos0 + 16 * i < p.ow;
      ok1 = co_ok && pos0 + 16 * i + 1 < p.ow;
      return e00 + 16 * i + (h ? 4 * out_plane : 0);
    };
    auto load_with = [&](auto vec_c, DzPair<T> (&q)[2][2], int oh, int kk) {
      constexpr bool kVec = decltype(vec_c)::value == 1;
      const int co0 = kk * 8 + (kChannelsLast ? 2 * t : t);
      const long long e00 =
          kChannelsLast ? (((long long)n * p.oh + oh) * p.ow + pos0) * p.cout + co0
                        : (((long long)n * p.cout + co0) * p.oh + oh) * (long long)p.ow + pos0;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          bool ok0, ok1;
          long long e;
          if (kChannelsLast) {  // position pos0 + 16i + 8h, channels co0, co0 + 1
            const bool pos_ok = pos0 + 16 * i + 8 * h < p.ow;
            ok0 = pos_ok && co0 < p.cout;
            ok1 = pos_ok && co0 + 1 < p.cout;
            e = e00 + (16 * i + 8 * h) * p.cout;
          } else {  // positions pos0 + 16i, + 1, channel co0 + 4h
            const bool co_ok = co0 + 4 * h < p.cout;
            ok0 = co_ok && pos0 + 16 * i < p.ow;
            ok1 = co_ok && pos0 + 16 * i + 1 < p.ow;
            e = e00 + 16 * i + (h ? 4 * out_plane : 0);
          }
          load_pair<kVec>(q[i][h], dy, p.mask, e, ok0, ok1);
        }
    };
    auto load_step = [&](DzPair<T> (&q)[2][2], int oh, int kk) {
      if (vec)  // (uniform: one branch per step)
        load_with(Phase<1>(), q, oh, kk);
      else
        load_with(Phase<0>(), q, oh, kk);
    };
    DzPair<T> next[2][2];
    bool preloaded = false;  // next holds step 0 of the row about to run

    // kStaged: the copies run kDgradStages - 1 steps ahead of the MMAs over
    // the same sequence of (row, step): dz rows inside dz from the stretch's
    // first on, steps 0 .. nk - 1 each. One copy group per step (empty past
    // the stretch's last), step c in stage c % kDgradStages.
    int copy_oh = max(ih_a + p.ph - 2, 0), copy_kk = 0, copied = 0, used = 0;
    const int copy_end = min(oh_last, p.oh - 1);
    auto copy_next = [&]() {
      if (copy_oh <= copy_end) {
        const u32 at =
            (u32)__cvta_generic_to_shared(stages) + (copied & (kDgradStages - 1)) * kStageBytes;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            bool ok0, ok1;  // equal here (vec)
            const long long e = element(copy_oh, copy_kk, i, h, ok0, ok1);
            cp_async<kPair>(at + pair_slot(2 * i + h), ok0 ? dy + e : dy, ok0 ? kPair : 0);
            cp_async<4>(at + word_slot(2 * i + h), ok0 ? p.mask + (e >> 5) : p.mask, ok0 ? 4 : 0);
          }
        if (++copy_kk == nk) copy_kk = 0, ++copy_oh;
        ++copied;
      }
      cp_async_commit();
    };
    // The pairs of step kk of row oh from their stage (copied by this thread).
    auto staged = [&](DzPair<T> (&q)[2][2], int oh, int kk) {
      copy_next();
      cp_async_wait<kDgradStages - 1>();
      const char* at = stages + (used & (kDgradStages - 1)) * kStageBytes;
      ++used;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          bool ok0, ok1;
          const long long e = element(oh, kk, i, h, ok0, ok1);
          const int j = 2 * i + h;
          union {
            T e[2];
            u32 w[2];
          } d;
          if (sizeof(T) == 4) {
            const uint2 v = *reinterpret_cast<const uint2*>(at + pair_slot(j));
            d.w[0] = v.x, d.w[1] = v.y;
          } else {
            d.w[0] = *reinterpret_cast<const u32*>(at + pair_slot(j));
          }
          q[i][h].d[0] = d.e[0], q[i][h].d[1] = d.e[1];
          q[i][h].lo = *reinterpret_cast<const u32*>(at + word_slot(j));
          q[i][h].hi = 0u;
          q[i][h].sh = (int)(e & 31);
        }
    };
    if (kStaged)
      for (int c = 0; c + 1 < kDgradStages; ++c) copy_next();

    // Row oh of dz into the ring (phase U: the set of input row oh - ph + r
    // is (U + r) % 3), then input row oh - ph out if this stretch owns it.
    auto row = [&](auto phase, int oh) {
      constexpr int U = decltype(phase)::value;
      if ((unsigned)oh < (unsigned)p.oh) {  // (rows outside dz add nothing)
        if (!kStaged && !preloaded) load_step(next, oh, 0);
        // With three passes, step 0 of the next row is loaded during this
        // row's last MMAs and stays in flight while this row's input row
        // goes out (one pass: ptxas then spills at 168 registers).
        const bool more = !kStaged && kPasses == 3 && oh + 1 <= oh_last && oh + 1 < p.oh;
#pragma unroll 1
        for (int kk = 0; kk < nk; ++kk) {
          u32 a[2][2][4];  // [part][row tile][fragment]
          if (kStaged) staged(next, oh, kk);
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              u32 big[2], small[2];
              form<T, kPasses>(next[i][h], op, big, small);
              // NCHW: positions (2g, 2g + 1) at k = t + 4h: a[2h], a[2h + 1];
              // NHWC: channels (2t, 2t + 1) at row g + 8h: a[h], a[h + 2].
              const int f0 = kChannelsLast ? h : 2 * h, f1 = kChannelsLast ? h + 2 : 2 * h + 1;
              a[0][i][f0] = big[0], a[0][i][f1] = big[1];
              a[1][i][f0] = small[0], a[1][i][f1] = small[1];
            }
          if (!kStaged && (kk + 1 < nk || more))  // in flight during the MMAs
            load_step(next, kk + 1 < nk ? oh : oh + 1, kk + 1 < nk ? kk + 1 : 0);
          // Taps in groups of three (one r, one set): each pass's MMAs over a
          // group are six independent accumulators back to back.
          const u32 kb = b_addr + kk * (kDgradTaps * 32 * 8);
#pragma unroll
          for (int r = 0; r < 3; ++r) {
            float(&set)[2][3][4] = acc[(U + r) % 3];
            u32 b[2][3][2];  // [part][s][k = t, t + 4]
#pragma unroll
            for (int s = 0; s < 3; ++s) {
              const u32 addr = kb + (r * 3 + s) * (32 * 8);
              asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                           : "=r"(b[0][s][0]), "=r"(b[0][s][1]) : "r"(addr));
              if (kParts == 2)
                asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                             : "=r"(b[1][s][0]), "=r"(b[1][s][1]) : "r"(addr + small_bytes));
            }
            if (kPasses == 3) {
#pragma unroll
              for (int s = 0; s < 3; ++s)
#pragma unroll
                for (int i = 0; i < 2; ++i) mma_tf32(set[i][s], a[1][i], b[0][s]);
#pragma unroll
              for (int s = 0; s < 3; ++s)
#pragma unroll
                for (int i = 0; i < 2; ++i) mma_tf32(set[i][s], a[0][i], b[1][s]);
            }
#pragma unroll
            for (int s = 0; s < 3; ++s)
#pragma unroll
              for (int i = 0; i < 2; ++i) mma_tf32(set[i][s], a[0][i], b[0][s]);
          }
        }
      }
      preloaded = !kStaged && kPasses == 3 && (unsigned)oh < (unsigned)p.oh && oh + 1 <= oh_last &&
                  oh + 1 < p.oh;
      const int ih = oh - p.ph;  // complete now (r = 0 was its last term)
      float(&done)[2][3][4] = acc[U];
      if (ih >= ih_a) {
        __syncthreads();  // the previous row's readers are done with rs
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int pos = kChannelsLast ? warp * 32 + i * 16 + g + 8 * (q >> 1)
                                          : warp * 32 + i * 16 + 2 * g + (q >> 1);
#pragma unroll
            for (int s = 0; s < 3; ++s)
              rs[pos * kDgradRS + s * 8 + 2 * t + (q & 1)] = done[i][s][q];
          }
        __syncthreads();
        // dx[ih][iw][ci] = sum over s (in order) of R[iw + pw - s][s][ci],
        // for the dz columns that exist, rounded to T. NCHW: a warp per
        // channel, lanes along the row; NHWC: 8 lanes per position, one per
        // channel (consecutive in memory).
        auto put = [&](int ci, int iw, long long at) {
          float v = 0.f;
#pragma unroll
          for (int s = 0; s < 3; ++s) {
            const int ow = iw + p.pw - s;
            if ((unsigned)ow < (unsigned)p.ow) v = add_rn(v, rs[(ow - z0) * kDgradRS + s * 8 + ci]);
          }
          dx[at] = Num<T>::from_op(v);
        };
        if (kChannelsLast) {
          const int ci = tid & 7;
          const long long row = ((long long)n * p.h + ih) * p.w_in * p.cin + ci0 + ci;
          if (ci < nci)
            for (int iw = lo + (tid >> 3); iw < hi; iw += kConvThreads / 8)
              put(ci, iw, row + (long long)iw * p.cin);
        } else {
          for (int ci = warp; ci < nci; ci += kConvThreads / 32) {
            const long long row = (((long long)n * p.cin + ci0 + ci) * p.h + ih) * p.w_in;
            for (int iw = lo + lane; iw < hi; iw += 32) put(ci, iw, row + iw);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int s = 0; s < 3; ++s)
#pragma unroll
          for (int q = 0; q < 4; ++q) done[i][s][q] = 0.f;
    };

    // dz rows ih_a + ph - 2 .. ih_b - 1 + ph, three per trip (the ring's phases).
    for (int oh = ih_a + p.ph - 2; oh <= oh_last; oh += 3) {
      row(Phase<0>(), oh);
      if (oh + 1 <= oh_last) row(Phase<1>(), oh + 1);
      if (oh + 2 <= oh_last) row(Phase<2>(), oh + 2);
    }
  }
}

}  // namespace cupy_act
