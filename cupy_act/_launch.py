"""The one generic launcher: every op and kind goes through ``launch``.

It packs the ``Params`` block of ``cuda/params.cuh`` into a per-thread buffer and
calls ``cuLaunchKernel`` directly with raw device pointers and the raw stream
handle, so a launch creates no CuPy arrays and no stream objects. The grid is
one block per ``kernel.per_block`` elements, capped at ``kernel.max_blocks``
(a multiple of the blocks the device holds at once, see ``_loader``); the
kernel's grid-stride loop covers anything beyond.

Context: a ``CUfunction`` belongs to the context its module was loaded in (the
device's primary context, see ``_loader``), and ``cuLaunchKernel`` uses the
calling thread's current context. A thread whose first CUDA work is ours has
none: the autograd engine's device thread for cuda:0, or a fresh user thread.
So each launch compares the current context with the kernel's (one driver call,
``cuCtxGetCurrent``, which also replaces a ``cudaGetDevice``) and otherwise
makes the kernel's context current around the launch. Where no context was
current it is left current, as PyTorch does for the same reason; another
device's context is restored afterwards.
"""

from __future__ import annotations

import ctypes
import struct
import threading

from ._loader import Kernel, cache_dir_problem

# Params: x, y, mask, bias (pointers), n, mask_words, inner, channels, then the
# slope, scale and alpha (= 1) bits: a float in the low 4 bytes, or a double;
# then 1 / inner and 1 / channels as doubles.
_PARAMS_F32 = struct.Struct("<QQQQqqqqf4xf4xf4xdd")
_PARAMS_F64 = struct.Struct("<QQQQqqqqddddd")
assert _PARAMS_F32.size == _PARAMS_F64.size == 104


class _Scratch(threading.local):
    """Per-thread argument buffer: cuLaunchKernel copies it before returning."""

    def __init__(self, size: int = _PARAMS_F64.size) -> None:
        self.buf = ctypes.create_string_buffer(size)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf))
        self.argv_ptr = ctypes.addressof(self.argv)
        self.bytes = memoryview(self.buf).cast("B")


_scratch = _Scratch()

try:  # `cupy.cuda.driver` is an attribute of cupy.cuda, not an importable module
    try:
        import cupy
    except OSError as e:  # CuPy >= 14 makes its kernel cache directory at import
        problem = cache_dir_problem()
        if problem is None:
            raise
        raise RuntimeError(
            f"cupy_act: CuPy cannot be imported: its kernel cache directory {problem}. "
            f"Set CUPY_CACHE_DIR to a directory that can be created and written, or unset "
            f"it (default ~/.cupy/kernel_cache)."
        ) from e

    _driver = cupy.cuda.driver
    _launch_kernel = _driver.launchKernel
    _ctx_get_current = _driver.ctxGetCurrent
    _ctx_set_current = _driver.ctxSetCurrent
except ImportError:  # pragma: no cover - CuPy is a dependency
    _launch_kernel = _ctx_get_current = _ctx_set_current = None


# The part every call fills in; the scalars after it are fixed per Launch.
_HEAD = struct.Struct("<QQQQqqqq")


class Launch:
    """One kernel with one call's scalars, packed once: what ``_plan.plan`` caches.

    ``slope`` and ``scale`` are already rounded to the op type (float for every
    dtype but float64). Calling it launches over ``n`` elements on ``stream`` (a
    raw handle) with raw device pointers; any thread may call it (see the module
    docstring); the caller skips empty inputs. Without a bias only the pointers
    and counts are packed per call: the rest of the block is copied from
    ``_tail`` (the whole pack costs twice as much host time).
    """

    __slots__ = ("kernel", "slope", "scale", "_pack", "_tail")

    def __init__(self, kernel: Kernel, slope: float, scale: float) -> None:
        self.kernel, self.slope, self.scale = kernel, slope, scale
        self._pack = _PARAMS_F64 if kernel.wide else _PARAMS_F32
        block = self._pack.pack(0, 0, 0, 0, 0, 0, 1, 1, slope, scale, 1.0, 1.0, 1.0)
        self._tail = block[_HEAD.size :]

    def __call__(
        self,
        stream: int,
        n: int,
        x: int,
        y: int,
        mask: int = 0,
        mask_words: int = 0,
        bias: int = 0,
        inner: int = 1,
        channels: int = 1,
    ) -> None:
        s = _scratch
        if bias:
            self._pack.pack_into(
                s.buf,
                0,
                x,
                y,
                mask,
                bias,
                n,
                mask_words,
                inner,
                channels,
                self.slope,
                self.scale,
                1.0,
                1.0 / inner,
                1.0 / channels,
            )
        else:
            _HEAD.pack_into(s.buf, 0, x, y, mask, 0, n, mask_words, 1, 1)
            s.bytes[_HEAD.size :] = self._tail
        k = self.kernel
        blocks = min(-(-n // k.per_block), k.max_blocks)
        if _ctx_get_current() == k.ctx:  # (run's check, inline: one call less)
            _launch_kernel(k.ptr, blocks, 1, 1, k.threads, 1, 1, 0, stream, s.argv_ptr, 0)
        else:
            run(k.ptr, k.ctx, (blocks, 1), k.threads, stream, s.argv_ptr)


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
    """Launch ``kernel`` once with these scalars (see ``Launch``, which callers
    that launch again with the same scalars keep instead)."""
    Launch(kernel, slope, scale)(stream, n, x, y, mask, mask_words, bias, inner, channels)


def run(
    ptr: int, ctx: int, grid: tuple[int, int], threads: int, stream: int, argv: int, smem: int = 0
) -> None:
    """cuLaunchKernel(ptr) in context ``ctx`` (see the module docstring) with the
    argument pointer array at address ``argv`` and ``smem`` bytes of dynamic
    shared memory."""
    current = _ctx_get_current()
    if current == ctx:
        _launch_kernel(ptr, grid[0], grid[1], 1, threads, 1, 1, smem, stream, argv, 0)
        return
    _ctx_set_current(ctx)
    try:
        _launch_kernel(ptr, grid[0], grid[1], 1, threads, 1, 1, smem, stream, argv, 0)
    finally:
        if current:  # another context was current: give it back
            _ctx_set_current(current)
