// activations.cuh: one functor per op. The generic kernel in elementwise.cu
// calls, per element,
//   T forward(T x, bool& bit)   -> y, and the mask bit its backward needs
//   T backward(T dy, bool bit)  -> dx from the upstream gradient and that bit
// Each mirrors, operation for operation and rounding for rounding, what PyTorch's
// eager CUDA kernels compute, so results match bit for bit (see numerics.cuh for
// why every operation is spelled out).
#pragma once

namespace cupy_act {

// relu = clamp_min(x, 0) in ATen: NaN passes through with its payload, every
// other x <= 0 (including -0 and negative subnormals) becomes +0.
// Backward is threshold_backward(dy, y, 0): dy where y > 0 or y is NaN, else +0.
// y > 0 or NaN exactly where x > 0 or NaN, so one bit, !(x <= 0), serves both.
template <typename T_>
struct Relu {
  typedef T_ T;
  __device__ explicit Relu(const Params&) {}
  __device__ __forceinline__ T forward(T x, bool& bit) const {
    bit = not_at_most_zero(x);
    return bit ? x : Num<T>::zero();
  }
  __device__ __forceinline__ T backward(T dy, bool bit) const { return bit ? dy : Num<T>::zero(); }
};

// leaky_relu: `x > 0 ? x : x * slope` in the op type, rounded once. NaN is not
// > 0 and goes through the multiply (giving the hardware's canonical NaN).
// Backward is aten.leaky_relu_backward: `x > 0 ? dy : dy * slope`, again in the
// op type, so at x == 0 and where x is NaN the gradient is slope * dy. The bit
// is x > 0. Both branches of the backward pass through the op type, as ATen's
// do: for 16-bit types a NaN dy is re-encoded by the round trip.
template <typename T_>
struct LeakyRelu {
  typedef T_ T;
  typedef typename Num<T>::op_t op_t;
  op_t slope;
  __device__ explicit LeakyRelu(const Params& p) : slope(scalar_from_bits<op_t>(p.slope)) {}
  __device__ __forceinline__ T forward(T x, bool& bit) const {
    bit = greater_than_zero(x);
    // For x > 0 the round trip through the op type is exact, so x itself is returned.
    return bit ? x : Num<T>::from_op(mul_rn(Num<T>::to_op(x), slope));
  }
  __device__ __forceinline__ T backward(T dy, bool bit) const {
    const op_t g = Num<T>::to_op(dy);
    return Num<T>::from_op(bit ? g : mul_rn(g, slope));
  }
};

// div_leaky_relu = F.leaky_relu(x / divisor, slope) as two eager ops. ATen divides
// by a Python number as t = x * scale, with scale = 1 / divisor taken in double on
// the host and rounded to the op type, and stores t in T before leaky_relu reads it.
// Autograd then gives dx = leaky_relu_backward(dy, t) / divisor, that is
// g * scale with g rounded to T first. The bit is t > 0, which can differ from
// x > 0 (a product that underflows to 0, a negative divisor, a bias).
template <typename T_>
struct DivLeakyRelu {
  typedef T_ T;
  typedef typename Num<T>::op_t op_t;
  LeakyRelu<T> leaky;
  op_t scale;
  __device__ explicit DivLeakyRelu(const Params& p)
      : leaky(p), scale(scalar_from_bits<op_t>(p.scale)) {}
  __device__ __forceinline__ T forward(T x, bool& bit) const {
    const T t = Num<T>::from_op(mul_rn(Num<T>::to_op(x), scale));
    return leaky.forward(t, bit);
  }
  __device__ __forceinline__ T backward(T dy, bool bit) const {
    const T g = leaky.backward(dy, bit);
    return Num<T>::from_op(mul_rn(Num<T>::to_op(g), scale));
  }
};

}  // namespace cupy_act
