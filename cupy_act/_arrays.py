"""Turn array arguments into CuPy arrays and check them, naming what is wrong.

Accepted: ``cupy.ndarray``, any object with ``__cuda_array_interface__`` and any
DLPack producer whose memory is on a CUDA device. Host arrays (NumPy, CPU
tensors) are refused with a hint instead of being copied silently.
"""

from __future__ import annotations

import contextlib

import numpy

from ._kernels import DTYPES

_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13
_HOST_HINT = (
    "cupy_act runs on CUDA devices: move the data there first "
    "(cupy.asarray(a) for NumPy, tensor.cuda() for PyTorch, or use cupy_act.torch)"
)
SUPPORTED = ", ".join(DTYPES)


def _dtype_error(fname: str, name: str, dtype, allowed) -> TypeError:
    return TypeError(f"{fname}: {name} has dtype {dtype}; supported: {', '.join(allowed)}")


def _check_dtype(dtype, name: str, fname: str, allowed) -> None:
    if str(dtype) not in allowed:
        raise _dtype_error(fname, name, dtype, allowed)


def _cuda_array_interface(obj):
    try:
        return obj.__cuda_array_interface__
    except Exception:  # absent, or refused by the producer (e.g. bfloat16 tensors)
        return None


def as_device_array(obj, name: str, fname: str, allowed=DTYPES):
    """``obj`` as a ``cupy.ndarray`` without copying; TypeError for host data or bad dtypes."""
    import cupy

    if isinstance(obj, cupy.ndarray):
        _check_dtype(obj.dtype, name, fname, allowed)
        return obj
    if isinstance(obj, (numpy.ndarray, numpy.generic)):
        raise TypeError(f"{fname}: {name} is a host numpy.{type(obj).__name__}; {_HOST_HINT}")
    cai = _cuda_array_interface(obj)
    # A void typestr (torch exports bfloat16 as "<V2") says nothing of the
    # dtype: DLPack, below, carries it.
    if cai is not None and not (hasattr(obj, "__dlpack__") and "V" in cai["typestr"]):
        try:
            dtype = numpy.dtype(cai["typestr"])
        except TypeError:
            raise _dtype_error(fname, name, cai["typestr"], allowed) from None
        _check_dtype(dtype, name, fname, allowed)
        return cupy.asarray(obj)
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None:
        dev_type = int(dlpack_device()[0])
        if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            raise TypeError(
                f"{fname}: {name} ({type(obj).__name__}) is in host memory "
                f"(DLPack device type {dev_type}); {_HOST_HINT}"
            )
        arr = cupy.from_dlpack(obj)
        _check_dtype(arr.dtype, name, fname, allowed)
        return arr
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        raise TypeError(f"{fname}: {name} ({type(obj).__name__}) is a host array; {_HOST_HINT}")
    raise TypeError(
        f"{fname}: {name} must be a CuPy array or a GPU array exporting DLPack or "
        f"__cuda_array_interface__, got {type(obj).__name__}"
    )


def check_like(arr, name: str, like, fname: str, shape=None) -> None:
    """``arr`` must match ``like``'s dtype and device (and ``shape``, default like's)."""
    shape = like.shape if shape is None else shape
    if arr.dtype != like.dtype:
        raise TypeError(f"{fname}: {name} has dtype {arr.dtype}, expected {like.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{fname}: {name} has shape {arr.shape}, expected {shape}")
    if arr.device.id != like.device.id:
        raise ValueError(
            f"{fname}: {name} is on device {arr.device.id}, the input on device {like.device.id}"
        )


def mask_nbytes(n: int) -> int:
    """Bytes of the mask for ``n`` elements: ceil(n / 8) rounded up to 16."""
    if n < 0:
        raise ValueError(f"mask_nbytes: n must be >= 0, got {n}")
    return (n + 127) // 128 * 16


def check_mask(mask, n: int, like, fname: str):
    """A mask buffer for ``n`` elements on ``like``'s device, as a cupy array."""
    mask = as_device_array(mask, "mask", fname, allowed=("uint8",))
    expected = mask_nbytes(n)
    if mask.shape != (expected,):
        raise ValueError(
            f"{fname}: mask has shape {mask.shape}, expected ({expected},): "
            f"mask_nbytes({n}) uint8 bytes for {n} elements"
        )
    if not mask.flags.c_contiguous:
        raise ValueError(f"{fname}: mask must be contiguous, got strides {mask.strides}")
    if mask.data.ptr % 4:
        raise ValueError(
            f"{fname}: mask must start on a 4-byte boundary, got address {mask.data.ptr:#x}"
        )
    if mask.device.id != like.device.id:
        raise ValueError(
            f"{fname}: mask is on device {mask.device.id}, the input on device {like.device.id}"
        )
    return mask


def overlaps(a, b) -> bool:
    """Whether the memory spans of two cupy arrays intersect."""
    if a.size == 0 or b.size == 0:
        return False

    def span(arr):
        lo = hi = arr.data.ptr
        for extent, stride in zip(arr.shape, arr.strides):
            if stride > 0:
                hi += (extent - 1) * stride
            else:
                lo += (extent - 1) * stride
        return lo, hi + arr.itemsize

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def on_device(device_id: int):
    """Make ``device_id`` current for the block, switching only when needed."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)
