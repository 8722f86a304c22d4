"""The fused BatchNorm + activation kernels (``cuda/batchnorm.cu``): lazy
compilation and the launches, on raw device pointers (no CuPy or torch arrays).

One ``cupy.RawModule`` per dtype, compiled on the first call in that dtype.
The torch adapter (``cupy_act.torch.batchnorm``) checks and allocates, then
calls ``forward`` and ``backward`` here, on its current stream.
"""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

from . import _launch, _loader
from ._kernels import CTYPES

SOURCE = "batchnorm.cu"
THREADS = 256  # kBnThreads
DTYPES = ("float32", "float16", "bfloat16")
ACTS = {"identity": 0, "relu": 1, "leaky_relu": 2}  # BnAct

# BnParams: 14 pointers, 4 long longs, 2 doubles, a float and an int.
_PARAMS = struct.Struct("<14Q4q2dfi")
assert _PARAMS.size == 168
_scratch = _launch._Scratch(_PARAMS.size)


def _names(dtype: str) -> list[str]:
    t = CTYPES[dtype]
    names = []
    for cl in ("false", "true"):
        for a in ACTS.values():
            names.append(f"cupy_act::bn_reduce<{t}, {cl}, 0, {a}>")
            names.append(f"cupy_act::bn_reduce<{t}, {cl}, 1, {a}>")
            names.append(f"cupy_act::bn_forward<{t}, {cl}, {a}>")
            names.append(f"cupy_act::bn_backward<{t}, {cl}, {a}>")
    return names + ["cupy_act::bn_finalize_stats", "cupy_act::bn_finalize_grad"]


def all_kernel_names() -> tuple[str, ...]:
    """Every instantiation, for the CPU-side NVRTC checks."""
    return tuple(dict.fromkeys(name for dtype in DTYPES for name in _names(dtype)))


class _Kernel(NamedTuple):
    ptr: int
    ctx: int
    function: object


_lock = threading.Lock()
_modules: dict[str, object] = {}
_kernels: dict[tuple, _Kernel] = {}  # (device, name)
_sms: dict[int, int] = {}


def _kernel(device: int, dtype: str, name: str) -> _Kernel:
    k = _kernels.get((device, name))
    if k is not None:
        return k
    with _lock:
        names = _names(dtype)
        ctx, functions = _loader.load_module(_modules, dtype, SOURCE, names, device)
        for n, f in zip(names, functions):
            _kernels[(device, n)] = _Kernel(f.kernel.ptr, ctx, f.kernel)
    return _kernels[(device, name)]


class Buffers(NamedTuple):
    """Device addresses of one call's arrays (0 where absent)."""

    x: int
    dy: int
    y: int
    mask: int
    weight: int
    bias: int
    mean: int
    invstd: int
    partial: int
    running_mean: int
    running_var: int
    grad_weight: int
    grad_bias: int
    coef: int


def _sm_count(device: int) -> int:
    n = _sms.get(device)
    if n is None:
        import cupy

        n = _sms[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return n


def splits(device: int, n: int, channels: int) -> int:
    """Partial sums per channel (the reduction grid's width): about 32 blocks
    per multiprocessor over all channels, each block's share at least 2048
    elements. The partial buffer holds channels x splits x 2 doubles."""
    per_channel = max(1, n // max(channels, 1))
    want = max(1, (32 * _sm_count(device)) // max(channels, 1))
    return int(max(1, min(want, -(-per_channel // 2048), 65535)))


class Shape(NamedTuple):
    """What one call's launches depend on: computed once per forward, kept for
    its backward (``splits`` sizes the caller's partial-sum buffer)."""

    device: int
    dtype: str
    act: str
    channels_last: bool
    n: int
    inner: int  # H x W
    channels: int
    splits: int


def shape(device: int, dtype: str, act: str, channels_last: bool, n, inner, channels) -> Shape:
    return Shape(device, dtype, act, channels_last, n, inner, channels, splits(device, n, channels))


def _run(s: Shape, kernel: str, stream: int, b: Buffers, momentum, eps, slope) -> None:
    """One kernel of the three a pass launches: "reduce<P>", "finalize_*" or the
    elementwise "forward" / "backward", on its grid."""
    if kernel.startswith("finalize"):
        name, grid = f"cupy_act::bn_{kernel}", (-(-s.channels // THREADS), 1)
    else:
        t, cl = CTYPES[s.dtype], "true" if s.channels_last else "false"
        if kernel.startswith("reduce"):
            name = f"cupy_act::bn_reduce<{t}, {cl}, {kernel[-1]}, {ACTS[s.act]}>"
            grid = (s.splits, -(-s.channels // 32) if s.channels_last else s.channels)
        else:
            name = f"cupy_act::bn_{kernel}<{t}, {cl}, {ACTS[s.act]}>"
            grid = (max(1, min(-(-s.n // THREADS), 32 * _sm_count(s.device))), 1)
    k = _kernel(s.device, s.dtype, name)
    scalars = (s.n, s.inner, s.channels, s.splits, momentum, eps, slope, 0)
    _PARAMS.pack_into(_scratch.buf, 0, *b, *scalars)
    _launch.run(k.ptr, k.ctx, grid, THREADS, stream, _scratch.argv_ptr)


def forward(s: Shape, stream: int, b: Buffers, momentum: float, eps: float, slope: float) -> None:
    """Statistics, running statistics (where b.running_mean), then y and the mask."""
    for kernel in ("reduce0", "finalize_stats", "forward"):
        _run(s, kernel, stream, b, momentum, eps, slope)


def backward(s: Shape, stream: int, b: Buffers, slope: float) -> None:
    """Weight and bias gradients (where given), then dx into b.y."""
    for kernel in ("reduce1", "finalize_grad", "backward"):
        _run(s, kernel, stream, b, 0.0, 0.0, slope)
