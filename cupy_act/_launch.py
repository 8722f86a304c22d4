"""The one generic launcher: every op and kind goes through a ``Launch``.

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
        # the buffer and a second argument (a kernel's tensor map: its host
        # address set per launch), so that no launch builds a pointer array
        self.argv2 = (ctypes.c_void_p * 2)(ctypes.addressof(self.buf), 0)
        self.argv2_ptr = ctypes.addressof(self.argv2)


_scratch = _Scratch()
_get_ident = threading.get_ident

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
    _memset_async = cupy.cuda.runtime.memsetAsync
except ImportError:  # pragma: no cover - CuPy is a dependency
    _launch_kernel = _ctx_get_current = _ctx_set_current = _memset_async = None


# The part every call fills in; the scalars after it are fixed per Launch.
_HEAD = struct.Struct("<QQQQqqqq")


class Launch:
    """One kernel with one call's scalars, packed once: what ``_plan.plan`` caches.

    ``slope`` and ``scale`` are already rounded to the op type (float for every
    dtype but float64). Calling it launches over ``n`` elements on ``stream`` (a
    raw handle) with raw device pointers; any thread may call it (see the module
    docstring); the caller skips empty inputs. Without a bias, each thread has
    its own argument block per Launch with the scalars already in place, and a
    call packs only the pointers and counts: 0.53 against 0.90 us per call for
    a whole pack into a thread-local block (2-core CPU machine, driver stubbed).
    """

    __slots__ = ("kernel", "slope", "scale", "_pack", "_block0", "_blocks", "_k")

    def __init__(self, kernel: Kernel, slope: float, scale: float) -> None:
        self.kernel, self.slope, self.scale = kernel, slope, scale
        self._pack = _PARAMS_F64 if kernel.wide else _PARAMS_F32
        self._block0 = self._pack.pack(0, 0, 0, 0, 0, 0, 1, 1, slope, scale, 1.0, 1.0, 1.0)
        self._blocks: dict = {}  # thread ident -> (block, argv address, argv)
        self._k = (kernel.ptr, kernel.ctx, kernel.threads, kernel.per_block, kernel.max_blocks)

    def _block(self) -> tuple:
        """This thread's argument block (a thread ident is unique among live threads)."""
        buf = ctypes.create_string_buffer(self._block0, len(self._block0))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        entry = self._blocks[_get_ident()] = (buf, ctypes.addressof(argv), argv)
        return entry

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
        ptr, ctx, threads, per_block, max_blocks = self._k
        if bias:  # the whole block, in the thread's scratch (the blocks above keep their tail)
            s = _scratch
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
            argv = s.argv_ptr
        else:
            block = self._blocks.get(_get_ident()) or self._block()
            _HEAD.pack_into(block[0], 0, x, y, mask, 0, n, mask_words, 1, 1)
            argv = block[1]
        blocks = -(-n // per_block)
        if blocks > max_blocks:
            blocks = max_blocks
        if _ctx_get_current() == ctx:  # (run's check, inline: one call less)
            _launch_kernel(ptr, blocks, 1, 1, threads, 1, 1, 0, stream, argv, 0)
        else:
            run(ptr, ctx, (blocks, 1), threads, stream, argv)

    def checked(
        self,
        have: tuple[int, int, int, int],
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
        """The call, after comparing the sizes it passes with the arrays'
        own: ``have`` = (elements of x, elements of y, bytes of the mask,
        elements of the bias). The kernel indexes n elements of x and y, n
        bits of the mask (mask_words words where it writes them) and
        ``channels`` biases, element i's at (i / inner) % channels. An
        entry point that missed a check gets ``SizeMismatch``, not a launch."""
        xs, ys, mask_bytes, biases = have
        short = []
        if xs < n or ys < n:
            short.append(f"x has {xs} and y {ys} elements, the launch covers n={n}")
        if mask and (8 * mask_bytes < n or 4 * mask_words > mask_bytes):
            short.append(f"the mask has {mask_bytes} bytes, the launch needs {-(-n // 8)} "
                         f"(and writes {4 * mask_words})")  # fmt: skip
        if bias and (biases < channels or inner < 1 or n % (inner * channels)):
            short.append(f"the bias has {biases} elements; channels={channels}, inner={inner}, "
                         f"n={n}")  # fmt: skip
        if short:
            raise SizeMismatch(f"cupy_act elementwise launch refused: {'; '.join(short)}")
        self(stream, n, x, y, mask, mask_words, bias, inner, channels)


class SizeMismatch(RuntimeError):
    """A launch refused by a launcher's own size checks: an array smaller than
    what the kernel would index. Every entry point checks its arguments
    first and raises its own error; this is the second line, for one that
    missed a check."""


def run(
    ptr: int, ctx: int, grid: tuple[int, int], threads: int, stream: int, argv: int, smem: int = 0
) -> None:
    """cuLaunchKernel(ptr) in context ``ctx`` (see the module docstring) with the
    argument pointer array at address ``argv`` and ``smem`` bytes of dynamic
    shared memory."""
    if _ctx_get_current() == ctx:  # (the common case inline: a call less)
        _launch_kernel(ptr, grid[0], grid[1], 1, threads, 1, 1, smem, stream, argv, 0)
        return
    in_context(ctx, _launch_kernel, ptr, grid[0], grid[1], 1, threads, 1, 1, smem, stream, argv, 0)


def zero(ctx: int, ptr: int, nbytes: int, stream: int) -> None:
    """cudaMemsetAsync(ptr, 0, nbytes) on ``stream`` in context ``ctx``: a
    buffer zeroed for a kernel's launch, as ``run`` launches it (the runtime
    takes the thread's current context), one driver call instead of a
    PyTorch operation's dispatch."""
    in_context(ctx, _memset_async, ptr, 0, nbytes, stream)


def in_context(ctx: int, call, *args):
    """``call(*args)`` with ``ctx`` current (see the module docstring): a
    launch, or a driver call on a kernel of that context (its attributes,
    its occupancy), from any thread and whatever device is current."""
    current = _ctx_get_current()
    if current == ctx:
        return call(*args)
    _ctx_set_current(ctx)
    try:
        return call(*args)
    finally:
        if current:  # another context was current: give it back
            _ctx_set_current(current)


def resident_blocks(ctx: int, ptr: int, threads: int, smem: int = 0) -> int:
    """Blocks of ``threads`` threads (and ``smem`` bytes of dynamic shared
    memory) of kernel ``ptr`` that one multiprocessor holds at once, at least
    1: the driver's occupancy, asked in the kernel's context (``in_context``:
    the caller's thread may have another device's current, and the driver
    then calls the handle invalid)."""
    from cupy.cuda import driver

    occupancy = driver.occupancyMaxActiveBlocksPerMultiprocessor
    return max(1, in_context(ctx, occupancy, ptr, threads, smem))


def run_all(launches: tuple, threads: int, stream: int, argv: int) -> None:
    """``run`` for each (ptr, ctx, grid) of ``launches`` (one context, one
    parameter block) in order, checking the context once."""
    current = _ctx_get_current()
    ctx = launches[0][1]
    if current != ctx:
        for ptr, ctx, grid in launches:
            run(ptr, ctx, grid, threads, stream, argv)
        return
    for ptr, _, grid in launches:
        _launch_kernel(ptr, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, 0)
