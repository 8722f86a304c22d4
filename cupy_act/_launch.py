"""The one generic launcher: every op and kind goes through ``launch``.

It packs the ``Params`` block of ``cuda/params.cuh`` into a per-thread buffer and
calls ``cuLaunchKernel`` directly with raw device pointers and the raw stream
handle, so a launch creates no CuPy arrays and no stream objects. The grid is
one block per ``kernel.per_block`` elements, capped at ``kernel.max_blocks``
(a multiple of the blocks the device holds at once, see ``_loader``); the
kernel's grid-stride loop covers anything beyond.
"""

from __future__ import annotations

import ctypes
import struct
import threading

from ._loader import Kernel

# Params: x, y, mask, bias (pointers), n, mask_words, inner, channels, then the
# slope, scale and alpha (= 1) bits: a float in the low 4 bytes, or a double;
# then 1 / inner and 1 / channels as doubles.
_PARAMS_F32 = struct.Struct("<QQQQqqqqf4xf4xf4xdd")
_PARAMS_F64 = struct.Struct("<QQQQqqqqddddd")
assert _PARAMS_F32.size == _PARAMS_F64.size == 104


class _Scratch(threading.local):
    """Per-thread argument buffer: cuLaunchKernel copies it before returning."""

    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(_PARAMS_F64.size)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self.argv)


_scratch = _Scratch()

try:  # `cupy.cuda.driver` is an attribute of cupy.cuda, not an importable module
    import cupy

    _launch_kernel = cupy.cuda.driver.launchKernel
except ImportError:  # pragma: no cover - CuPy is a dependency
    _launch_kernel = None


def launch(
    kernel: Kernel,
    stream: int,
    n: int,
    x: int,
    y: int,
    mask: int = 0,
    mask_words: int = 0,
    bias: int = 0,
    inner: int = 1,
    channels: int = 1,
    slope: float = 0.0,
    scale: float = 1.0,
) -> None:
    """Launch ``kernel`` over ``n`` elements on ``stream`` (a raw handle).

    Pointers are raw device addresses; ``slope`` and ``scale`` are already
    rounded to the op type (float for every dtype but float64). The caller
    makes the kernel's device current and skips empty inputs.
    """
    blocks = min(-(-n // kernel.per_block), kernel.max_blocks)
    pack = _PARAMS_F64 if kernel.wide else _PARAMS_F32
    s = _scratch
    pack.pack_into(s.buf, 0, x, y, mask, bias, n, mask_words, inner, channels, slope, scale, 1.0,
                   1.0 / inner, 1.0 / channels)
    _launch_kernel(kernel.ptr, blocks, 1, 1, kernel.threads, 1, 1, 0, stream, s.argv_ptr, 0)
