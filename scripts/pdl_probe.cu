// How much programmatic dependent launch (PDL) saves between two kernels in a
// CUDA graph: a reduction-like kernel (264 blocks of 256 threads over n
// floats, one partial per block) and a finishing-like one (8 blocks summing
// the partials), alternated 200 times in one captured graph, launched plain,
// with the PDL attribute and griddepcontrol.wait at each kernel's start, and
// with griddepcontrol.launch_dependents after the wait as well. Prints the
// graph's median time per pair (15 replays, CUDA events) for four sizes,
// each variant run twice, interleaved. Hopper or later:
//
//   nvcc -O3 -arch=sm_90 -o /tmp/pdl_probe scripts/pdl_probe.cu && /tmp/pdl_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                               \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      printf("%s at line %d\n", cudaGetErrorString(e), __LINE__);              \
      return 1;                                                                \
    }                                                                          \
  } while (0)

// MODE 0: plain; 1: wait for the previous kernel; 2: wait, then let the next start
template <int MODE>
__device__ __forceinline__ void prologue() {
  if (MODE >= 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (MODE == 2) asm volatile("griddepcontrol.launch_dependents;");
}

template <int MODE>
__global__ void reduce_like(const float* __restrict__ x, float* __restrict__ part, long long n) {
  prologue<MODE>();
  float s = 0.f;
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
    s += x[i];
  __shared__ float sh[256];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int h = 128; h > 0; h >>= 1) {
    if (threadIdx.x < h) sh[threadIdx.x] += sh[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

template <int MODE>
__global__ void finish_like(const float* __restrict__ part, float* __restrict__ out, int parts) {
  prologue<MODE>();
  float s = 0.f;
  for (int i = threadIdx.x; i < parts; i += 32) s += part[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

template <int MODE>
int time_pairs(long long n, int pairs, const float* x, float* part, float* out, cudaStream_t st,
               float* ms) {
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t big = {}, small = {};
  big.gridDim = dim3(264);
  big.blockDim = dim3(256);
  big.stream = st;
  small.gridDim = dim3(8);
  small.blockDim = dim3(256);
  small.stream = st;
  if (MODE) {
    big.attrs = small.attrs = pdl;
    big.numAttrs = small.numAttrs = 1;
  }
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < pairs; ++r) {
    CHECK(cudaLaunchKernelEx(&big, reduce_like<MODE>, x, part, n));
    CHECK(cudaLaunchKernelEx(&small, finish_like<MODE>, (const float*)part, out, 264));
  }
  CHECK(cudaStreamEndCapture(st, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int w = 0; w < 3; ++w) CHECK(cudaGraphLaunch(ge, st));
  std::vector<float> t;
  for (int k = 0; k < 15; ++k) {
    cudaEventRecord(a, st);
    CHECK(cudaGraphLaunch(ge, st));
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float m;
    cudaEventElapsedTime(&m, a, b);
    t.push_back(m);
  }
  std::sort(t.begin(), t.end());
  *ms = t[t.size() / 2];
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return 0;
}

int main() {
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  const long long most = 1 << 24;
  float *x, *part, *out;
  CHECK(cudaMalloc(&x, sizeof(float) * most));
  CHECK(cudaMemset(x, 0, sizeof(float) * most));
  CHECK(cudaMalloc(&part, 264 * sizeof(float)));
  CHECK(cudaMalloc(&out, 8 * sizeof(float)));
  const int pairs = 200;
  for (long long n : {1ll << 16, 1ll << 20, 1ll << 22, 1ll << 24}) {
    for (int round = 0; round < 2; ++round) {
      float m0, m1, m2;
      if (time_pairs<0>(n, pairs, x, part, out, st, &m0)) return 1;
      if (time_pairs<1>(n, pairs, x, part, out, st, &m1)) return 1;
      if (time_pairs<2>(n, pairs, x, part, out, st, &m2)) return 1;
      printf("n=%lld  us per pair: plain %.2f  wait %.2f  wait + launch_dependents %.2f\n", n,
             1000 * m0 / pairs, 1000 * m1 / pairs, 1000 * m2 / pairs);
    }
  }
  return 0;
}
