"""Tensor-map descriptors (``CUtensorMap``) for the kernels' tensor copies.

``cuTensorMapEncodeTiled`` is a host function of the CUDA driver (no GPU work,
no context): it packs a tensor's address, sizes and strides and a copy's box
into 128 opaque bytes that a kernel takes by value (a ``__grid_constant__``
parameter) and hands to ``cp.async.bulk.tensor``. CuPy does not wrap it, so it
is called through ctypes from the driver library the process already uses.
Where that library or the function is missing (no driver, a CUDA 11 driver),
``available()`` is False and callers keep their other paths.
"""

from __future__ import annotations

import ctypes
import sys
import threading

# CUtensorMapDataType: the copies move bits, so unsigned integers of the
# element's width (no float conversion, no flush of subnormals).
_DATA_TYPE = {2: 1, 4: 2, 8: 4}  # itemsize -> UINT16, UINT32, UINT64
SWIZZLE_NONE = 0  # CUtensorMapSwizzle: boxes land row after row, as in global memory
_L2_256B = 3  # CUtensorMapL2promotion: fetch whole 256-byte sectors into L2
MAP_BYTES = 128  # sizeof(CUtensorMap); the driver wants it 64-byte aligned

_u32p = ctypes.POINTER(ctypes.c_uint32)
_u64p = ctypes.POINTER(ctypes.c_uint64)
_encode = None
_looked = False
_lock = threading.Lock()


def _function():
    """cuTensorMapEncodeTiled from the driver library, or None."""
    global _encode, _looked
    if _looked:
        return _encode
    with _lock:
        if not _looked:
            name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
            try:
                f = ctypes.CDLL(name).cuTensorMapEncodeTiled
            except (OSError, AttributeError):
                f = None
            if f is not None:
                f.restype = ctypes.c_int
                f.argtypes = [
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                    _u64p, _u64p, _u32p, _u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int,
                ]  # fmt: skip
            _encode = f
            _looked = True
    return _encode


def available() -> bool:
    """Whether descriptors can be encoded here (the driver has the function)."""
    return _function() is not None


class TiledMap:
    """A tiled tensor of fixed sizes whose descriptor is encoded per address.

    ``dims`` are element counts, innermost first; ``strides`` the byte strides
    of dims 1 on (multiples of 16); ``box`` the elements one copy brings per
    dimension (at most 256; the innermost times ``itemsize`` a multiple of
    16), landing unswizzled. Parts of a box outside the tensor land as
    zeros. A copy's innermost coordinate must start a 16-byte unit.
    """

    __slots__ = ("_args", "_last")

    def __init__(self, itemsize: int, dims, strides, box) -> None:
        if len(strides) != len(dims) - 1 or len(box) != len(dims):
            raise ValueError(
                f"TiledMap: {len(dims)} dims need {len(dims) - 1} strides and {len(dims)} box "
                f"sizes, got {len(strides)} and {len(box)}"
            )
        if any(s % 16 for s in strides) or (box[0] * itemsize) % 16:
            raise ValueError(
                f"TiledMap: strides {tuple(strides)} and the box's innermost "
                f"{box[0] * itemsize} bytes must be multiples of 16"
            )
        rank = len(dims)
        self._args = (
            _DATA_TYPE[itemsize], rank,
            (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * rank)(*strides, 0),
            (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        )  # fmt: skip
        self._last: tuple = (None, None, 0)  # (address, buffer, descriptor's address)

    def at(self, address: int) -> tuple:
        """(buffer, host address) of the descriptor for a tensor at device
        ``address`` (16-byte aligned): 128 bytes, valid while the caller
        keeps the buffer (a launch copies them); the last one is reused for
        the same address. Raises RuntimeError if the driver refuses."""
        last = self._last
        if last[0] == address:
            return last[1:]
        f = _function()
        if f is None:
            raise RuntimeError("cupy_act: the CUDA driver has no cuTensorMapEncodeTiled")
        buf = ctypes.create_string_buffer(MAP_BYTES + 64)
        at = -(-ctypes.addressof(buf) // 64) * 64
        dtype, rank, dims, strides, box, steps = self._args
        err = f(at, dtype, rank, address, dims, strides, box, steps, 0, SWIZZLE_NONE, _L2_256B, 0)
        if err:
            raise RuntimeError(
                f"cupy_act: cuTensorMapEncodeTiled failed (CUresult {err}) for a tensor at "
                f"{address:#x} of {list(dims)} elements"
            )
        self._last = (address, buf, at)
        return buf, at
