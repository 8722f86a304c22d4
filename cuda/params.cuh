// params.cuh: the one argument block every kernel takes, by value.
//
// The host packs it with struct.Struct in cupy_act/_launch.py; field order, sizes
// and offsets must match that format string (all fields are 8 bytes, no padding).
#pragma once

namespace cupy_act {

struct Params {
  const void* x;         // forward: input x;  backward: upstream gradient dy
  void* y;               // forward: output y; backward: dx (may equal x: in place)
  u32* mask;             // 1 bit per element, see elementwise.cu; unused by FORWARD
  const void* bias;      // per-channel bias added before the op, or null
  long long n;           // number of elements
  long long mask_words;  // 32-bit words in the mask buffer (padding included)
  long long inner;       // bias channel of element i is (i / inner) % channels
  long long channels;
  u64 slope;         // op-type bits of negative_slope (float: low 32 bits)
  u64 scale;         // op-type bits of 1 / divisor (taken in double, then rounded)
  u64 alpha;         // op-type bits of 1: the bias multiplier (see add_bias)
  double inv_inner;  // 1 / inner and 1 / channels in double, for quot() in elementwise.cu
  double inv_channels;
};

}  // namespace cupy_act
