"""The fused BatchNorm + activation kernels on torch tensors: allocation,
pointers and the launch of each pass (``cupy_act._batchnorm``), shared by the
eager autograd Function (``batchnorm.FusedBatchNormAct``) and the compiled
route's ops (``_bn_ops``). Callers check the tensors first; every launch
also compares each buffer's bytes with what the pass indexes.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .. import _batchnorm as _bn
from . import _impl


class Mode(NamedTuple):
    """What one call computes, beyond its tensors."""

    act: str
    slope: float
    evaluate: bool  # normalize with the running statistics
    inplace: bool  # y over x (eager) / the backward from y (both): InPlace-ABN
    grad: bool  # a backward may follow: write the mask


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


_nbytes = _impl.nbytes
layout_of = _impl.is_channels_last  # (the kernels walk x channels-last where it is dense so)


def arranged(t, channels_last: bool):
    """``_impl.arrange``, None staying None."""
    return None if t is None else _impl.arrange(t, channels_last)


def shape_of(x: torch.Tensor, act: str, channels_last: bool) -> _bn.Shape:
    shape = x.shape
    return _bn.shape(
        x.device.index, _impl.DTYPE_NAMES[x.dtype], act, channels_last, x.numel(),
        shape[2] * shape[3], shape[1],
    )  # fmt: skip


def mask_words(n: int) -> int:
    """int32 words of a 1-bit mask of n elements."""
    return -(-n // 32)


try:  # (private: the public function wraps it)
    _capturing = torch._C._cuda_isCurrentStreamCapturing
except AttributeError:  # pragma: no cover - depends on the torch version
    _capturing = torch.cuda.is_current_stream_capturing

# Zeroed counters for the NCHW reductions (_bn.arrivals). A launch leaves them
# zero for the next on its stream, and kernels on one stream run in order, so
# one set serves a (device, stream) for good, and one more the CUDA graphs
# captured on it (a graph replays its kernels in capture order; graphs of one
# capture stream are not replayed concurrently by CUDA-graph trees). The sets
# are device memory of their own (cudaMalloc through CuPy's runtime, never
# freed), outside torch's caching allocator: one made during torch.compile's
# CUDA-graph warm-up run would otherwise come from the graph's pool, which
# refuses it afterwards. A capture that finds no set (none can be allocated
# while capturing) zeroes a fresh one in the graph, at a memset node per call.
_ARRIVALS = 65536  # (channels <= 65535)
_MAX_SETS = 64  # (streams made per step: beyond this, fresh zeroed counters per call)
_arrival_sets: dict[tuple[int, int, bool], int] = {}
_lock = threading.Lock()


def _new_set(device: int) -> int:
    import cupy

    with cupy.cuda.Device(device):
        ptr = cupy.cuda.runtime.malloc(4 * _ARRIVALS)
        cupy.cuda.runtime.memset(ptr, 0, 4 * _ARRIVALS)
        cupy.cuda.runtime.deviceSynchronize()  # (zero before any stream uses it)
    return ptr


def arrivals(s: _bn.Shape, stream: int, dev: torch.device) -> tuple[int, int, object]:
    """(address, bytes, owner) of zeroed counters for a pass ((0, 0, None) where
    it needs none); ``owner`` keeps a graph's fresh counters alive."""
    if not _bn.arrivals(s):
        return 0, 0, None
    capturing = _capturing()
    key = (s.device, stream, capturing)
    ptr = _arrival_sets.get(key)
    if ptr is None and not capturing:
        with _lock:
            ptr = _arrival_sets.get(key)
            if ptr is None and len(_arrival_sets) < _MAX_SETS:
                ptr = _arrival_sets[key] = _new_set(s.device)
                # and the set for graphs captured on this stream, made now: a
                # capture cannot allocate it
                _arrival_sets.setdefault((s.device, stream, True), _new_set(s.device))
    if ptr is None:
        fresh = torch.zeros(s.channels, dtype=torch.int32, device=dev)
        return fresh.data_ptr(), 4 * s.channels, fresh
    return ptr, 4 * _ARRIVALS, None


def forward(x, weight, bias, residual, running_mean, running_var, count, factor: float,
            eps: float, mode: Mode, out=None, split: bool = False):  # fmt: skip
    """The forward pass: (y, stats, mask, shape). x dense in C order or
    channels-last, ``residual`` (or None) in x's layout; ``out``: where y goes
    (x itself in the eager in-place mode), else a new tensor. Training
    (``mode.evaluate`` False) updates the running statistics where given and
    increments ``count`` (num_batches_tracked) where given. ``stats`` holds the
    mean and invstd used and the batch moments (``_bn.Pass``), then, unless
    ``split``, the pass's work area (one allocation; the compiled op returns
    the statistics alone and allocates the work area apart). The mask is None
    where no backward reads one (no gradient, the identity, or from y)."""
    cl = layout_of(x)
    s = shape_of(x, mode.act, cl)
    c, dev = s.channels, x.device
    y = torch.empty_like(x) if out is None else out
    mask = None
    if mode.grad and not mode.inplace and mode.act != "identity":
        mask = torch.empty(mask_words(s.n), dtype=torch.int32, device=dev)
    xp, yp, rp = x.data_ptr(), y.data_ptr(), _ptr(residual)
    ps = _bn.prepare(s, xp | yp | rp, "eval" if mode.evaluate else "forward")
    if split:
        stats = torch.empty(ps.stats, dtype=torch.float64, device=dev)
        work = torch.empty(ps.work, dtype=torch.float64, device=dev)
        w, wb = work.data_ptr(), _nbytes(work)
    else:
        stats = torch.empty(ps.stats + ps.work, dtype=torch.float64, device=dev)
        w, wb = stats.data_ptr() + 8 * ps.stats, 8 * ps.work
    mean, sb = stats.data_ptr(), _nbytes(stats)
    stream = _impl._raw_stream(s.device)
    counters, counted, _keep = (0, 0, None) if mode.evaluate else arrivals(s, stream, dev)
    moments = mean + ps.moments
    b = _bn.Buffers(
        xp, 0, yp, _ptr(mask), _ptr(weight), _ptr(bias), mean, mean + 4 * c, w,
        _ptr(running_mean), _ptr(running_var), 0, 0, w + ps.coef, _ptr(count), counters,
        rp, 0, moments,
    )  # fmt: skip
    xb = _nbytes(x)
    have = (
        xb, 0, xb, _nbytes(mask), _nbytes(weight), _nbytes(bias), sb, sb - 4 * c, wb,
        _nbytes(running_mean), _nbytes(running_var), 0, 0, wb - ps.coef, _nbytes(count),
        counted, _nbytes(residual), 0, sb - ps.moments,
    )  # fmt: skip
    flags = _bn.EVAL if mode.evaluate else 0
    _bn.run(ps, stream, b, have, factor, eps, mode.slope, flags)
    return y, stats, mask, s


def backward(src, gy, mask, weight, bias, stats, residual, s: _bn.Shape, mode: Mode,
             need_w: bool, need_b: bool, need_r: bool):  # fmt: skip
    """(dx, gw, gb, gr) from the upstream gradient: ``src`` is the forward's x,
    or its y in the in-place mode (with the forward's ``residual``, which its
    inversion subtracts); gw, gb, gr None where not needed."""
    cl = s.channels_last
    gy = arranged(gy, cl)
    residual = arranged(residual, cl) if mode.inplace else None
    c, dev = s.channels, src.device
    dx = torch.empty_like(src)
    gr = torch.empty_like(src) if need_r else None
    sp, gp, dp = src.data_ptr(), gy.data_ptr(), dx.data_ptr()
    pointers = sp | gp | dp | _ptr(gr) | _ptr(residual)
    ps = _bn.prepare(s, pointers, "backward_from_output" if mode.inplace else "backward")
    # (each gradient its own allocation: a parameter's .grad may keep it)
    gw = torch.empty(c, dtype=torch.float32, device=dev) if need_w else None
    gb = torch.empty(c, dtype=torch.float32, device=dev) if need_b else None
    work = torch.empty(ps.work, dtype=torch.float64, device=dev)
    mean, w = stats.data_ptr(), work.data_ptr()
    stream = _impl._raw_stream(s.device)
    counters, counted, _keep = arrivals(s, stream, dev)
    b = _bn.Buffers(
        sp, gp, dp, _ptr(mask), _ptr(weight), _ptr(bias), mean, mean + 4 * c, w,
        0, 0, _ptr(gw), _ptr(gb), w + ps.coef, 0, counters, _ptr(residual), _ptr(gr), 0,
    )  # fmt: skip
    sb, wb = _nbytes(stats), _nbytes(work)
    have = (
        _nbytes(src), _nbytes(gy), _nbytes(dx), _nbytes(mask), _nbytes(weight), _nbytes(bias),
        sb, sb - 4 * c, wb, 0, 0, _nbytes(gw), _nbytes(gb), wb - ps.coef, 0, counted,
        _nbytes(residual), _nbytes(gr), 0,
    )  # fmt: skip
    flags = (_bn.EVAL if mode.evaluate else 0) | (_bn.FROM_OUTPUT if mode.inplace else 0)
    _bn.run(ps, stream, b, have, 0.0, 0.0, mode.slope, flags)
    return dx, gw, gb, gr


def update_running(running_mean, running_var, stats, s: _bn.Shape, momentum: float) -> None:
    """The running statistics from a training forward's moments (in ``stats``)."""
    ps = _bn.prepare(s, 0, "running")
    mean = stats.data_ptr()
    b = _bn.Buffers(
        0, 0, 0, 0, 0, 0, 0, 0, 0, running_mean.data_ptr(), running_var.data_ptr(), 0, 0, 0, 0,
        0, 0, 0, mean + ps.moments,
    )  # fmt: skip
    have = (0,) * 9 + (_nbytes(running_mean), _nbytes(running_var)) + (0,) * 7 + (
        _nbytes(stats) - ps.moments,
    )  # fmt: skip
    _bn.run(ps, _impl._raw_stream(s.device), b, have, momentum, 0.0, 0.0, 0)
