"""Python-number arguments: validation and rounding to the kernel's op type.

PyTorch hands a Python ``negative_slope`` to its kernels as
``Scalar.to<opmath_t>()``: float for float16/bfloat16/float32, double for
float64 (an int is converted directly from int64). ``x / divisor`` becomes
``x * inv`` with ``inv = 1 / divisor`` taken in double on the host and then
rounded to the op type: measured on an H200 against torch 2.11, this matched
for every divisor tried, while a float32 reciprocal of float32(divisor)
differed for -1.7, 0.001 and 9.1. These helpers reproduce that rounding.
"""

from __future__ import annotations

import math
import numbers

import numpy

from ._registry import OPS

_INT64 = (-(2**63), 2**63)


def check_real(value, name: str, fname: str) -> None:
    """TypeError unless ``value`` is a real Python or NumPy number (not a bool)."""
    if type(value) is float:  # the common case, without the (slow) ABC checks below
        return
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{fname}: {name} must be a real number (int or float), "
            f"got {value!r} of type {type(value).__name__}"
        )
    if isinstance(value, numbers.Integral) and not _INT64[0] <= int(value) < _INT64[1]:
        raise ValueError(f"{fname}: {name}={value} does not fit in int64")


def check_divisor(divisor, fname: str) -> None:
    """Type and value checks that do not depend on the dtype."""
    check_real(divisor, "divisor", fname)
    if not math.isfinite(float(divisor)) or divisor == 0:
        raise ValueError(f"{fname}: divisor must be a finite, non-zero number, got {divisor!r}")


def to_op_type(value, double: bool, name: str, fname: str) -> float:
    """``value`` rounded as ``Scalar.to<opmath_t>()`` would, as a Python float.

    ``double`` selects float64 as the op type, else float32. A finite value
    beyond float32's range raises ValueError, as PyTorch's checked conversion does.
    """
    check_real(value, name, fname)
    with numpy.errstate(over="ignore"):
        if isinstance(value, numbers.Integral):
            v = numpy.int64(int(value))
            r = float(numpy.float64(v) if double else numpy.float32(v))
        else:
            r = float(value) if double else float(numpy.float32(float(value)))
    if math.isfinite(float(value)) and not math.isfinite(r):
        raise ValueError(
            f"{fname}: {name}={value!r} is out of range for float32, the op type "
            f"of float16/bfloat16/float32 inputs"
        )
    return r


def reciprocal(divisor, double: bool, fname: str) -> float:
    """``1 / divisor`` in double, rounded to the op type, as ATen multiplies by it."""
    check_divisor(divisor, fname)
    inv = 1.0 / float(divisor)  # finite, non-zero divisor: no exception here
    if double:
        return inv
    with numpy.errstate(over="ignore"):  # beyond float32's range: inf, as in ATen
        return float(numpy.float32(inv))


def check_scalars(op: str, slope, divisor, fname: str) -> None:
    """Type and value checks of the Python numbers ``op`` takes (per the registry)."""
    spec = OPS[op]
    if spec.slope:
        check_real(slope, "negative_slope", fname)
    if spec.divisor:
        check_divisor(divisor, fname)


def kernel_scalars(op: str, slope, divisor, double: bool, fname: str) -> tuple[float, float]:
    """The kernel's (slope, scale = 1 / divisor), rounded to the op type as ATen does."""
    spec = OPS[op]
    s = to_op_type(slope, double, "negative_slope", fname) if spec.slope else 0.0
    return s, reciprocal(divisor, double, fname) if spec.divisor else 1.0
