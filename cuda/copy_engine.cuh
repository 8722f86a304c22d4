// copy_engine.cuh: asynchronous copies from global into shared memory for
// the fused convolution's kernels. Per thread (cp.async, sm_80 and later):
// a few bytes each, completing by this thread's waits. The copy engine
// (sm_90): bulk and tensor copies, each completing on an mbarrier that counts
// the bytes; other architectures never launch those paths (_conv decides per
// device), there they trap.
#pragma once
#include "numerics.cuh"

namespace cupy_act {

// Asynchronous copy of kBytes (4, 8 or 16) from src to shared address dst, of
// which the first `src_bytes` (kBytes or 0) are read and the rest zero-filled
// (no access at src when 0). Lands by cp_async_wait / cp_async_wait_all.
template <int kBytes>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
               :: "r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes) : "memory");
}

// This thread's copies issued since the last commit, as one group.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Until at most N of this thread's most recent copy groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// This thread's copies landed (then a barrier shows them to all).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// An mbarrier whose phases complete after `arrivals` arrivals (and the bytes
// they announce).
__device__ __forceinline__ void bar_init(u32 bar, u32 arrivals) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n fence.mbarrier_init.release.cluster;"
               :: "r"(bar), "r"(arrivals) : "memory");
#else
  __trap();
#endif
}

// One arrival on `bar`, and `bytes` more that must land before the phase
// completes.
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

// The same for a 4-D map, coordinates (c0, c1, c2, c3).
__device__ __forceinline__ void tensor_copy_4d(u32 dst, const TensorMap& map, int c0, int c1,
                                               int c2, int c3, u32 bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];"
      :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
         "r"(bar)
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

}  // namespace cupy_act
