"""Array-level API on CuPy arrays (and any DLPack / CUDA-array-interface producer).

Every function validates its arguments, allocates what is missing, and launches
the generic kernel on the input's device and CuPy's current stream. Outputs
are new C-contiguous arrays unless ``out=`` is given (``out=x`` works in place).
Masks hold one bit per element in C order: see ``unpack_mask``.
"""

from __future__ import annotations

import math

import numpy

from ._arrays import (
    GPUArray,
    as_device_array,
    c_contiguous,
    check_like,
    check_mask,
    dtype_name,
    mask_nbytes,
)
from ._launch import cupy  # (imported there: an unusable kernel cache dir is named)
from ._plan import plan
from ._scalars import check_scalars

__all__ = [
    "relu",
    "leaky_relu",
    "div_leaky_relu",
    "relu_with_mask",
    "leaky_relu_with_mask",
    "div_leaky_relu_with_mask",
    "relu_backward",
    "leaky_relu_backward",
    "div_leaky_relu_backward",
    "mask_nbytes",
    "unpack_mask",
]


def _run(fname, op, kind, src, *, out=None, mask=None, slope=0.0, divisor=None, bias=None):
    """Validate, allocate and launch one op; the shared body of every public function.

    The common call (a C-contiguous CuPy array on the current device, a cached
    plan) costs a few attribute reads besides the launch: no device switch, no
    flags objects, no copies.
    """
    check_scalars(op, slope, divisor, fname)  # first: a bad number is named before the array
    src = as_device_array(src, "dy" if kind == "backward" else "x", fname)
    dev = src.data.device_id
    dtype = dtype_name(src.dtype)
    launch = plan(dev, op, dtype, kind, bias is not None, slope, divisor, fname)
    if out is not None:
        out = as_device_array(out, "out", fname)
        check_like(out, "out", src, fname)
    cur = _get_device()
    if cur != dev:  # allocations and copies below go to the current device
        _set_device(dev)
    try:
        return _launch_on(fname, kind, src, out, mask, bias, launch)
    finally:
        if cur != dev:
            _set_device(cur)


def _launch_on(fname, kind, src, out, mask, bias, launch):
    x = src if c_contiguous(src) else cupy.ascontiguousarray(src)  # masks: C order
    n = x.size
    inner = channels = 1
    bias_ptr = biases = 0
    if bias is not None:
        if x.ndim < 2:
            raise ValueError(
                f"{fname}: bias needs an input with a channel axis (axis 1), got shape {x.shape}"
            )
        b = as_device_array(bias, "bias", fname)
        check_like(b, "bias", x, fname, shape=(x.shape[1],))
        b = cupy.ascontiguousarray(b)
        bias_ptr, biases, channels, inner = b.data.ptr, b.size, x.shape[1], math.prod(x.shape[2:])
    if kind == "backward" or mask is not None:
        mask = check_mask(mask, n, x, fname)
    elif kind == "forward_mask":
        mask = cupy.ndarray((mask_nbytes(n),), numpy.uint8)

    # Write straight into `out` when it is C-contiguous and either is x or
    # does not touch x; otherwise go through a temporary. Both are then
    # C-contiguous spans of the same size (check_like), so no general
    # overlap test is needed.
    direct = False
    if out is not None and c_contiguous(out):
        o, p, nb = out.data.ptr, x.data.ptr, x.nbytes
        direct = o == p or o >= p + nb or p >= o + nb
    y = out if direct else cupy.ndarray(x.shape, x.dtype)  # (cupy.empty, one frame less)
    if n:
        launch.checked(
            (n, y.size, 0 if mask is None else mask.size, biases),
            _current_stream().ptr,
            n,
            x.data.ptr,
            y.data.ptr,
            0 if mask is None else mask.data.ptr,
            0 if mask is None else mask.size // 4,
            bias_ptr,
            inner,
            channels,
        )
    if out is not None and not direct:
        out[...] = y
        y = out
    return (y, mask) if kind == "forward_mask" else y


_get_device = cupy.cuda.runtime.getDevice
_set_device = cupy.cuda.runtime.setDevice
_current_stream = cupy.cuda.get_current_stream


def relu(x: GPUArray, *, out: GPUArray | None = None) -> cupy.ndarray:
    """ReLU, bit for bit ``torch.relu``: NaN passes through, -0 and x < 0 give +0.

    Args:
        x: floating-point GPU array (float16, bfloat16, float32, float64).
        out: optional output of x's shape and dtype; ``out=x`` works in place.
    Returns:
        The output array.
    """
    return _run("cupy_act.relu", "relu", "forward", x, out=out)


def leaky_relu(
    x: GPUArray, negative_slope: float = 0.01, *, out: GPUArray | None = None
) -> cupy.ndarray:
    """LeakyReLU, bit for bit ``F.leaky_relu``: ``x > 0 ? x : x * negative_slope``.

    The product is taken in float32 for 16-bit inputs (float64 for float64) and
    rounded once; subnormals are never flushed.
    """
    return _run("cupy_act.leaky_relu", "leaky_relu", "forward", x, out=out, slope=negative_slope)


def div_leaky_relu(
    x: GPUArray,
    divisor: float,
    negative_slope: float = 0.01,
    *,
    bias: GPUArray | None = None,
    out: GPUArray | None = None,
) -> cupy.ndarray:
    """``leaky_relu((x + bias) / divisor, negative_slope)`` in one pass.

    Bit for bit what PyTorch computes for ``F.leaky_relu(x / divisor, slope)``
    (with ``bias``: ``F.leaky_relu((x + bias.view(1, -1, 1, ..)) / divisor)``),
    each intermediate rounded to x's dtype as the eager ops store it.

    Args:
        x: floating-point GPU array; with ``bias``, channels on axis 1 (NCHW).
        divisor: finite, non-zero Python number.
        negative_slope: slope for inputs <= 0.
        bias: optional per-channel array of shape ``(x.shape[1],)``, x's dtype.
        out: optional output of x's shape and dtype.
    """
    return _run(
        "cupy_act.div_leaky_relu",
        "div_leaky_relu",
        "forward",
        x,
        out=out,
        slope=negative_slope,
        divisor=divisor,
        bias=bias,
    )


def relu_with_mask(
    x: GPUArray, *, out: GPUArray | None = None, mask: GPUArray | None = None
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``relu(x)`` and its 1-bit mask (``!(x <= 0)``: set for x > 0 and NaN), one pass.

    Returns:
        ``(y, mask)``; ``mask`` is a uint8 array of ``mask_nbytes(x.size)`` bytes
        (pass your own in ``mask=`` to reuse a buffer).
    """
    return _run("cupy_act.relu_with_mask", "relu", "forward_mask", x, out=out, mask=mask)


def leaky_relu_with_mask(
    x: GPUArray,
    negative_slope: float = 0.01,
    *,
    out: GPUArray | None = None,
    mask: GPUArray | None = None,
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``leaky_relu(x)`` and its 1-bit mask (``x > 0``), in one pass. Returns ``(y, mask)``."""
    return _run(
        "cupy_act.leaky_relu_with_mask",
        "leaky_relu",
        "forward_mask",
        x,
        out=out,
        mask=mask,
        slope=negative_slope,
    )


def div_leaky_relu_with_mask(
    x: GPUArray,
    divisor: float,
    negative_slope: float = 0.01,
    *,
    bias: GPUArray | None = None,
    out: GPUArray | None = None,
    mask: GPUArray | None = None,
) -> tuple[cupy.ndarray, cupy.ndarray]:
    """``div_leaky_relu`` and its mask (``(x + bias) / divisor > 0``). Returns ``(y, mask)``."""
    return _run(
        "cupy_act.div_leaky_relu_with_mask",
        "div_leaky_relu",
        "forward_mask",
        x,
        out=out,
        mask=mask,
        slope=negative_slope,
        divisor=divisor,
        bias=bias,
    )


def relu_backward(dy: GPUArray, mask: GPUArray, *, out: GPUArray | None = None) -> cupy.ndarray:
    """Gradient of ReLU from the mask: ``dy`` where the bit is set, else +0.

    Bit for bit PyTorch's ``threshold_backward(dy, relu(x), 0)``; x is not needed.
    """
    return _run("cupy_act.relu_backward", "relu", "backward", dy, out=out, mask=mask)


def leaky_relu_backward(
    dy: GPUArray, mask: GPUArray, negative_slope: float = 0.01, *, out: GPUArray | None = None
) -> cupy.ndarray:
    """Gradient of LeakyReLU from the mask, bit for bit ``aten.leaky_relu_backward``."""
    return _run(
        "cupy_act.leaky_relu_backward",
        "leaky_relu",
        "backward",
        dy,
        out=out,
        mask=mask,
        slope=negative_slope,
    )


def div_leaky_relu_backward(
    dy: GPUArray,
    mask: GPUArray,
    divisor: float,
    negative_slope: float = 0.01,
    *,
    out: GPUArray | None = None,
) -> cupy.ndarray:
    """Gradient of ``leaky_relu(x / divisor)`` w.r.t. x from the mask (and w.r.t. the
    pre-bias input: the bias gradient is its sum over all but the channel axis)."""
    return _run(
        "cupy_act.div_leaky_relu_backward",
        "div_leaky_relu",
        "backward",
        dy,
        out=out,
        mask=mask,
        slope=negative_slope,
        divisor=divisor,
    )


def unpack_mask(mask: GPUArray, n: int) -> cupy.ndarray:
    """The ``n`` mask bits as a boolean CuPy array (bit i of the mask is element i)."""
    mask = as_device_array(mask, "mask", "cupy_act.unpack_mask", allowed=("uint8",))
    if mask.size * 8 < n:
        raise ValueError(f"cupy_act.unpack_mask: mask has {mask.size} bytes, fewer than n={n} bits")
    return cupy.unpackbits(mask, bitorder="little")[:n].astype(bool)
