// wgmma.cuh: warpgroup MMAs (sm_90a wgmma.mma_async), TF32, for the fused
// convolution's forward and weight gradient. Compiled for sm_90a only (_conv adds -arch=sm_90a
// for compute capability 9.0); elsewhere kWgmma is false and these trap.
//
// One instruction: the block's 4 warps (a warpgroup) compute D[64][64] +=
// A[64][8] B[8][64]. A comes from registers, warp w holding rows 16 w ..
// 16 w + 15 in the m16n8k8 fragment (a0 = A[g][t], a1 = A[g+8][t], a2 =
// A[g][t+4], a3 = A[g+8][t+4]; g = lane / 4, t = lane % 4). B comes from
// shared memory through a descriptor, K-major without swizzle: 8 x 4 "core
// matrices" (8 columns n, 4 depths k, 128 contiguous bytes, n-rows of 16
// bytes), those of one group of 8 columns consecutive along k (LBO = 128
// bytes), the groups SBO bytes apart. D: warp w's rows 16 w + g (+ 8), d[4 j
// + q] at row g + 8 (q / 2), column 8 j + 2 t + q % 2, the m16n8 layout per
// 8 columns.
#pragma once
#include "numerics.cuh"

namespace cupy_act {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmma = true;
#else
constexpr bool kWgmma = false;
#endif

// The word of B element (column n, depth k) in the layout above, kq = depth / 4.
__device__ __forceinline__ int wgmma_b_word(int n, int k, int kq) {
  return ((n >> 3) * kq + (k >> 2)) * 32 + (n & 7) * 4 + (k & 3);
}

// The shared-memory descriptor of a B operand at shared address addr (16-byte
// aligned): start, LBO = 128 bytes, SBO = sbo bytes, no swizzle. Adding
// (bytes >> 4) moves its start.
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 sbo) {
  return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// Order register writes before the wgmmas that read them (A fragments just
// loaded, accumulators just zeroed).
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// Order this thread's shared-memory stores before the wgmmas' reads of
// them (the async proxy); then a barrier for the other threads' stores.
__device__ __forceinline__ void wgmma_fence_smem() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// Wait until every committed group has completed (its registers free).
__device__ __forceinline__ void wgmma_wait_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#else
  __trap();
#endif
}

// Keeps the compiler from moving accesses to the accumulators across the
// point where it stands (they belong to the asynchronous MMAs in between).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d += a b: A from registers (a), B through descriptor b; m64n64k8, TF32
// operands, float32 accumulators.
__device__ __forceinline__ void wgmma_tf32(float (&d)[32], const u32 (&a)[4], u64 b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
      : "memory");
#else
  __trap();
#endif
}

// d += a b as above, m64n24k8 (three groups of 8 columns: the weight
// gradient's filter row, conv2d_wgrad.cu).
__device__ __forceinline__ void wgmma_tf32_n24(float (&d)[12], const u32 (&a)[4], u64 b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n24k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, 1, 1, 1;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
      : "memory");
#else
  __trap();
#endif
}

}  // namespace cupy_act
