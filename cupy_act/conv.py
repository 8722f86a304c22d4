"""Array-level fused convolution: conv2d + bias + divide + LeakyReLU in one kernel.

    y = leaky_relu((conv2d(x, weight) + bias) / divisor, negative_slope)

computed by ``cuda/conv2d.cu`` (an implicit GEMM on tensor cores, sm_80 or
newer) and written once, with the optional 1-bit mask of the elementwise ops.
This is FP32-accurate (the 3xTF32 split), not bit-identical to cuDNN: see
docs/conv-forward.md for the measured error. Works on CuPy arrays and
any DLPack / CUDA-array-interface producer, on CuPy's current stream.
"""

from __future__ import annotations

import numpy

from . import _conv
from ._arrays import GPUArray, as_device_array, check_like, mask_nbytes
from ._launch import cupy
from ._scalars import check_divisor, check_real

__all__ = ["conv2d_div_leaky_relu"]


def _nhwc_dense(a) -> bool:
    """Whether a 4-D array is a dense channels-last (N, H, W, C in memory) view."""
    n, c, h, w = a.shape
    item = a.itemsize
    return (
        a.strides == (h * w * c * item, item, w * c * item, c * item) and not a.flags.c_contiguous
    )


def conv2d_div_leaky_relu(
    x: GPUArray,
    weight: GPUArray,
    bias: GPUArray | None = None,
    divisor: float | None = None,
    negative_slope: float = 0.01,
    stride=1,
    padding=0,
    dilation=1,
    *,
    precision: str = "fp32",
    with_mask: bool = False,
):
    """``leaky_relu((conv2d(x, weight) + bias) / divisor, negative_slope)``, fused.

    Args:
        x: (N, Cin, H, W) float32, float16 or bfloat16 GPU array. C-contiguous
            (NCHW), or a dense channels-last view (NHWC memory, e.g.
            ``a.transpose(0, 3, 1, 2)`` of an NHWC array): the output then is
            channels-last too. Anything else is copied to NCHW first.
        weight: (Cout, Cin, kH, kW), x's dtype and device (groups = 1).
        bias: optional (Cout,), x's dtype.
        divisor: required: a finite, non-zero Python number; negative_slope: a
            Python number; both rounded as PyTorch rounds them.
        stride, padding, dilation: an int or a pair, as ``F.conv2d`` takes them
            (zero padding).
        precision: "fp32" (float32 inputs: the 3xTF32 split, FP32 accuracy) or
            "tf32" (one TF32 pass, torch.compile's accuracy). 16-bit inputs are
            exact in TF32 either way: products exact, float32 accumulation.
        with_mask: also return the 1-bit mask of the output elements in memory
            order (bit set where the divided value is > 0), the mask the
            elementwise ``div_leaky_relu_backward`` reads.
    Returns:
        y, or (y, mask) with ``with_mask``.
    """
    fname = "cupy_act.conv2d_div_leaky_relu"
    if divisor is None:
        raise TypeError(
            f"{fname}() missing required argument 'divisor' (a finite, non-zero number)"
        )
    check_divisor(divisor, fname)
    check_real(negative_slope, "negative_slope", fname)
    if precision not in _conv.PRECISIONS:
        raise ValueError(f"{fname}: precision={precision!r}; expected one of {_conv.PRECISIONS}")
    x = as_device_array(x, "x", fname, allowed=_conv.DTYPES)
    w = as_device_array(weight, "weight", fname, allowed=_conv.DTYPES)
    g = _conv.geometry(fname, x.shape, w.shape, stride, padding, dilation)
    check_like(w, "weight", x, fname, shape=w.shape)
    if not _conv.fits(g, _conv.passes(str(x.dtype), precision)):
        raise ValueError(
            f"{fname}: {g} is beyond the fused kernel (an image or the filter of 2^31 "
            f"elements or more, or an input patch too large for shared memory)"
        )
    dev = x.data.device_id
    if not _conv.supported(dev):
        raise RuntimeError(
            f"{fname}: the fused kernel needs compute capability {_conv.MIN_SM // 10}.0 or newer "
            f"(TF32 tensor cores); device {dev} has {_conv.kernels._sm(dev) / 10:.1f}"
        )
    with cupy.cuda.Device(dev):
        channels_last = _nhwc_dense(x)
        w = cupy.ascontiguousarray(w)  # OIHW in either layout
        if channels_last:  # NHWC memory for x and y
            y_mem = cupy.empty((g.n, g.oh, g.ow, g.cout), x.dtype)
            y = y_mem.transpose(0, 3, 1, 2)
        else:
            x = cupy.ascontiguousarray(x)
            y = y_mem = cupy.empty(g.out_shape, x.dtype)
        bias_ptr = 0
        if bias is not None:
            b = as_device_array(bias, "bias", fname, allowed=_conv.DTYPES)
            check_like(b, "bias", x, fname, shape=(g.cout,))
            b = cupy.ascontiguousarray(b)
            bias_ptr = b.data.ptr
        mask = cupy.zeros(mask_nbytes(y.size), numpy.uint8) if with_mask else None
        _conv.launch(
            dev,
            str(x.dtype),
            precision,
            channels_last,
            g,
            cupy.cuda.get_current_stream().ptr,
            x.data.ptr,
            w.data.ptr,
            bias_ptr,
            y_mem.data.ptr,
            0 if mask is None else mask.data.ptr,
            negative_slope,
            divisor,
            fname,
            have=(
                x.nbytes,
                w.nbytes,
                0 if bias is None else b.nbytes,
                y_mem.nbytes,
                0 if mask is None else mask.nbytes,
            ),  # fmt: skip
        )
    return (y, mask) if with_mask else y
