"""Turn array arguments into CuPy arrays and check them, naming what is wrong.

Accepted: ``cupy.ndarray``, any object with ``__cuda_array_interface__`` and any
DLPack producer whose memory is on a CUDA device. Host arrays (NumPy, CPU
tensors) are refused with a hint instead of being copied silently.
"""

from __future__ import annotations

import operator
import types
from typing import Any, TypeAlias

import numpy

from ._kernels import DTYPES

_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13
_HOST_HINT = (
    "cupy_act runs on CUDA devices: move the data there first "
    "(cupy.asarray(a) for NumPy, tensor.cuda() for PyTorch, or use cupy_act.torch)"
)
SUPPORTED = ", ".join(DTYPES)

# What the CuPy-level API accepts as an array: a cupy.ndarray, or any object
# exporting DLPack or __cuda_array_interface__ on a CUDA device (checked at run
# time by as_device_array, which no static type can express).
GPUArray: TypeAlias = Any


def _dtype_error(fname: str, name: str, dtype, allowed) -> TypeError:
    return TypeError(f"{fname}: {name} has dtype {dtype}; supported: {', '.join(allowed)}")


_NAMES: dict[tuple[int, str], str] = {}  # (dtype.num, byte order) -> str(dtype)


def dtype_name(dtype) -> str:
    """``str(dtype)``, cached: on the GPU host str() and .name of a NumPy dtype
    took 1.7 us per call, a tenth of a CuPy API call (2026-11-22, c777bc8)."""
    key = (dtype.num, dtype.byteorder)
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = str(dtype)
    return name


def _check_dtype(dtype, name: str, fname: str, allowed) -> None:
    if dtype_name(dtype) not in allowed:
        raise _dtype_error(fname, name, dtype, allowed)


def _cuda_array_interface(obj):
    try:
        return obj.__cuda_array_interface__
    except Exception:  # absent, or refused by the producer (e.g. bfloat16 tensors)
        return None


def as_device_array(obj, name: str, fname: str, allowed=DTYPES):
    """``obj`` as a ``cupy.ndarray`` without copying; TypeError for host data or bad dtypes."""
    import cupy

    if type(obj) is cupy.ndarray or isinstance(obj, cupy.ndarray):
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
    dev, like_dev = arr.data.device_id, like.data.device_id  # (no Device objects)
    if dev != like_dev:
        raise ValueError(f"{fname}: {name} is on device {dev}, the input on device {like_dev}")


def mask_nbytes(n: int) -> int:
    """Bytes of the mask for ``n`` elements: ceil(n / 8) rounded up to 16."""
    if n < 0:
        raise ValueError(f"mask_nbytes: n must be >= 0, got {n}")
    return (n + 127) // 128 * 16


def check_mask(mask, n: int, like, fname: str):
    """A mask buffer for ``n`` elements on ``like``'s device, as a cupy array."""
    mask = as_device_array(mask, "mask", fname, allowed=("uint8",))
    expected = mask_nbytes(n)
    if mask.ndim != 1 or mask.size != expected:
        raise ValueError(
            f"{fname}: mask has shape {mask.shape}, expected ({expected},): "
            f"mask_nbytes({n}) uint8 bytes for {n} elements"
        )
    if not c_contiguous(mask):
        raise ValueError(f"{fname}: mask must be contiguous, got strides {mask.strides}")
    data = mask.data
    if data.ptr % 4:
        raise ValueError(
            f"{fname}: mask must start on a 4-byte boundary, got address {data.ptr:#x}"
        )
    if data.device_id != like.data.device_id:
        raise ValueError(
            f"{fname}: mask is on device {mask.data.device_id}, the input on device "
            f"{like.data.device_id}"
        )
    return mask


def c_contiguous(a) -> bool:
    """``a.flags.c_contiguous`` of a cupy array, without making a flags object
    (CuPy's private ``_c_contiguous`` where it exists, measured on the hot path)."""
    return a.flags.c_contiguous


def _init_c_contiguous() -> None:
    global c_contiguous
    try:
        import cupy
    except OSError:  # an unusable kernel cache dir: _launch's import names it
        return

    if isinstance(getattr(cupy.ndarray, "_c_contiguous", None), types.GetSetDescriptorType):
        c_contiguous = operator.attrgetter("_c_contiguous")  # type: ignore[assignment]


_init_c_contiguous()
