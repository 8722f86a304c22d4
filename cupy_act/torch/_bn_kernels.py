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


_FIELD = {name: i for i, name in enumerate(_bn.Buffers._fields)}
_NONE = (0,) * len(_FIELD)


def bind(**arrays) -> tuple[_bn.Buffers, tuple]:
    """(Buffers, have) from the named arrays (``_bn.Buffers``' fields): a
    tensor, (address, bytes to the end of its buffer), or absent / None."""
    ptrs, have = list(_NONE), list(_NONE)
    for name, a in arrays.items():
        i = _FIELD.get(name)
        if i is None:
            raise TypeError(f"bind: unknown buffer {name!r}")
        if a is None:
            continue
        if isinstance(a, torch.Tensor):
            ptrs[i], have[i] = a.data_ptr(), _nbytes(a)
        else:
            ptrs[i], have[i] = a
    return _bn.Buffers(*ptrs), tuple(have)


def _ref(t) -> tuple[int, int]:
    """(address, bytes) of a tensor, (0, 0) for None: a Buffers entry and its size."""
    return (0, 0) if t is None else (t.data_ptr(), t.nbytes)


def at(t: torch.Tensor, offset: int) -> tuple[int, int]:
    """(address, bytes left) ``offset`` bytes into t."""
    return t.data_ptr() + offset, _nbytes(t) - offset


def arranged(t, channels_last: bool):
    """``_impl.arrange``, None staying None."""
    return None if t is None else _impl.arrange(t, channels_last)


def _row_pitch(sizes, strides, inner: int) -> int | None:
    """The stride between consecutive blocks of ``inner`` elements where the
    dims (``sizes``, ``strides``, innermost first) walk them one after
    another at one pitch (1 where there is at most one block), else None."""
    pitch, span = None, 1
    for size, stride in zip(sizes, strides):
        if size > 1:
            if pitch is None:
                if stride % span:
                    return None
                pitch = stride // span
            if stride != pitch * span:
                return None
        span *= size
    return inner if pitch is None else pitch


def skipped(gy: torch.Tensor, channels_last: bool) -> tuple[torch.Tensor, int]:
    """(gy, skip) for a backward's dy: gy itself where it is dense in the
    kernels' layout but for a wider pitch between its rows of C values
    (channels-last) or its samples (NCHW), as a channel slice of a
    concatenation's gradient is, with ``skip`` the extra elements per row or
    sample; else gy in that layout (a copy unless it is already) and 0."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if gy.is_contiguous(memory_format=fmt):  # (the usual dy: no strides to read)
        return gy, 0
    n, c, h, w = gy.shape
    st = gy.stride()
    if channels_last:
        inner_ok, block = c <= 1 or st[1] == 1, c
        pitch = _row_pitch((w, h, n), (st[3], st[2], st[0]), c)
    else:
        block = c * h * w
        inner_ok = all(size <= 1 or st[d] == want
                       for d, size, want in ((3, w, 1), (2, h, w), (1, c, h * w)))  # fmt: skip
        pitch = _row_pitch((n,), (st[0],), block)
    if inner_ok and pitch is not None and pitch >= block and gy.numel():
        return gy, pitch - block
    return arranged(gy, channels_last), 0


def _dy(gy: torch.Tensor, skip: int) -> tuple[int, int]:
    """(address, bytes to the end of its storage) of a dy read with ``skip``."""
    if not skip:
        return gy.data_ptr(), _nbytes(gy)
    return gy.data_ptr(), gy.untyped_storage().nbytes() - gy.storage_offset() * gy.element_size()


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
            eps: float, mode: Mode, out=None, split: bool = False, post=None):  # fmt: skip
    """The forward pass: (y, stats, mask, shape). x dense in C order or
    channels-last, ``residual`` and ``post`` (or None) in x's layout (y =
    act(bn(x) + residual) + post); ``out``: where y goes
    (x itself in the eager in-place mode), else a new tensor. Training
    (``mode.evaluate`` False) updates the running statistics where given and
    increments ``count`` (num_batches_tracked) where given. ``stats`` holds the
    mean and invstd used and the batch moments (``_bn.Pass``), then, unless
    ``split``, the pass's work area (one allocation; the compiled op returns
    the statistics alone and allocates the work area apart). The mask is None
    where no backward reads one (no gradient, the identity, or from y)."""
    s = shape_of(x, mode.act, layout_of(x))
    y, mask = _outputs(x, s, mode, out)
    xp, yp = x.data_ptr(), y.data_ptr()
    rp, rn = _ref(residual)
    pp, pn = _ref(post)
    ps = _bn.prepare(s, xp | yp | rp | pp, "eval" if mode.evaluate else "forward")
    dev = x.device
    if split:
        stats = torch.empty(ps.stats, dtype=torch.float64, device=dev)
        work = torch.empty(ps.work, dtype=torch.float64, device=dev)
        wp = work.data_ptr()
    else:
        stats = torch.empty(ps.stats + ps.work, dtype=torch.float64, device=dev)
        wp = stats.data_ptr() + 8 * ps.stats
    sp, sn, wn = stats.data_ptr(), stats.nbytes, 8 * ps.work
    stream = _impl._raw_stream(s.device)
    counters, counted, _keep = (0, 0, None) if mode.evaluate else arrivals(s, stream, dev)
    mp, mn = _ref(mask)
    wtp, wtn = _ref(weight)
    bp, bn = _ref(bias)
    rmp, rmn = _ref(running_mean)
    rvp, rvn = _ref(running_var)
    cp, cn = _ref(count)
    c4 = 4 * s.channels
    # (Buffers' fields in order, and the bytes to the end of each buffer: what
    # bind makes from names, spelled out on the per-call path, 3.5 us a call
    # less on a 2-core CPU host)
    b = (xp, 0, yp, mp, wtp, bp,  # x, dy, y, mask, weight, bias
         sp, sp + c4, wp, rmp, rvp,  # mean, invstd, partial, running_mean, running_var
         0, 0, wp + ps.coef, cp, counters,  # grad_weight, grad_bias, coef, num_batches, arrivals
         rp, 0, sp + ps.moments, pp)  # residual, grad_residual, moments, post  # fmt: skip
    have = (x.nbytes, 0, y.nbytes, mn, wtn, bn,
            sn, sn - c4, wn, rmn, rvn,
            0, 0, wn - ps.coef, cn, counted,
            rn, 0, sn - ps.moments, pn)  # fmt: skip
    flags = _bn.EVAL if mode.evaluate else 0
    _bn.run(ps, stream, b, have, factor, eps, mode.slope, flags)
    return y, stats, mask, s


def _outputs(x, s: _bn.Shape, mode: Mode, out):
    """(y, mask) of a forward: y ``out`` or new, the mask where a backward reads one."""
    y = torch.empty_like(x) if out is None else out
    mask = None
    if mode.grad and not mode.inplace and mode.act != "identity":
        mask = torch.empty(mask_words(s.n), dtype=torch.int32, device=x.device)
    return y, mask


def _stats_at(stats, c: int, ps: _bn.Pass) -> dict:
    """The mean, invstd and moments addresses of a forward's statistics."""
    return {"mean": at(stats, 0), "invstd": at(stats, 4 * c), "moments": at(stats, ps.moments)}


def _flags(mode: Mode) -> int:
    return (_bn.EVAL if mode.evaluate else 0) | (_bn.FROM_OUTPUT if mode.inplace else 0)


def _backward_pass(mode: Mode) -> str:
    return "backward_from_output" if mode.inplace else "backward"


def _grads(c: int, dev, need_w: bool, need_b: bool):
    # (each gradient its own allocation: a parameter's .grad may keep it)
    gw = torch.empty(c, dtype=torch.float32, device=dev) if need_w else None
    gb = torch.empty(c, dtype=torch.float32, device=dev) if need_b else None
    return gw, gb


def backward(src, gy, mask, weight, bias, stats, residual, s: _bn.Shape, mode: Mode,
             need_w: bool, need_b: bool, need_r: bool):  # fmt: skip
    """(dx, gw, gb, gr) from the upstream gradient: ``src`` is the forward's x,
    or its y in the in-place mode (with the forward's ``residual``, which its
    inversion subtracts); gw, gb, gr None where not needed. ``gy`` is read
    where it lies if ``skipped`` allows, else arranged in src's layout."""
    cl = s.channels_last
    gy, skip = skipped(gy, cl)
    residual = arranged(residual, cl) if mode.inplace else None
    dev = src.device
    dx = torch.empty_like(src)
    gr = torch.empty_like(src) if need_r else None
    xp, dyp, dxp = src.data_ptr(), gy.data_ptr(), dx.data_ptr()
    grp, grn = _ref(gr)
    rp, rn = _ref(residual)
    pointers = xp | dyp | dxp | grp | rp
    pointers |= skip * gy.element_size()  # (16-byte vectors: every row or sample aligned)
    ps = _bn.prepare(s, pointers, _backward_pass(mode))
    gw, gb = _grads(s.channels, dev, need_w, need_b)
    work = torch.empty(ps.work, dtype=torch.float64, device=dev)
    stream = _impl._raw_stream(s.device)
    counters, counted, _keep = arrivals(s, stream, dev)
    dyp, dyn = _dy(gy, skip)
    mp, mn = _ref(mask)
    wtp, wtn = _ref(weight)
    bp, bn = _ref(bias)
    gwp, gwn = _ref(gw)
    gbp, gbn = _ref(gb)
    sp, sn, wp, wn = stats.data_ptr(), stats.nbytes, work.data_ptr(), 8 * ps.work
    c4 = 4 * s.channels
    # (Buffers' fields in order, and the bytes to the end of each: see forward)
    b = (xp, dyp, dxp, mp, wtp, bp,  # x, dy, y, mask, weight, bias
         sp, sp + c4, wp, 0, 0,  # mean, invstd, partial, running_mean, running_var
         gwp, gbp, wp + ps.coef, 0, counters,  # grad_weight, grad_bias, coef, num_batches, arrivals
         rp, grp, 0, 0)  # residual, grad_residual, moments, post  # fmt: skip
    have = (src.nbytes, dyn, dx.nbytes, mn, wtn, bn,
            sn, sn - c4, wn, 0, 0,
            gwn, gbn, wn - ps.coef, 0, counted,
            rn, grn, 0, 0)  # fmt: skip
    _bn.run(ps, stream, b, have, 0.0, 0.0, mode.slope, _flags(mode), skip)
    return dx, gw, gb, gr


# ---- synchronized BatchNorm: local sums, then (after the caller's all-reduce) the rest ----


def _sums(s: _bn.Shape, x, pointers: int, which: str, mode: Mode, n: int, dy_skip: int = 0,
          **arrays):  # fmt: skip
    """The local pass ``which`` ("*_local"): each channel's sums into a new
    float64 tensor of ``n`` doubles (zeros where x is empty)."""
    dev = x.device
    sums = torch.empty(n, dtype=torch.float64, device=dev)
    if s.n == 0:
        return sums.zero_()
    ps = _bn.prepare(s, pointers, which)
    work = torch.empty(ps.work, dtype=torch.float64, device=dev)
    stream = _impl._raw_stream(s.device)
    counters, counted, _keep = arrivals(s, stream, dev)
    b, have = bind(x=x, partial=work, arrivals=(counters, counted), moments=sums, **arrays)
    flags = _bn.SUMS | (_flags(mode) if which.startswith("backward") else 0)
    _bn.run(ps, stream, b, have, 0.0, 0.0, mode.slope, flags, dy_skip)
    return sums


def sync_sums(x, mode: Mode) -> tuple[torch.Tensor, _bn.Shape]:
    """A synchronized training forward's first half: (sums, shape), sums
    holding x's per-channel sum and sum of squares (float64, [C][2]) and
    then its count per channel, for the caller to all-reduce over the group."""
    s = shape_of(x, mode.act, layout_of(x))
    n = _bn.sums_doubles(s.channels)
    return _sums(s, x, x.data_ptr(), "forward_local", mode, n), s


def sync_forward(x, weight, bias, residual, running_mean, running_var, count, factor: float,
                 eps: float, mode: Mode, s: _bn.Shape, sums, out=None):  # fmt: skip
    """Its second half, from the group's totals (``sums`` all-reduced): the
    statistics, the running statistics' update (PyTorch's rules, over the
    group's count), then y and the mask as ``forward``. Returns (y, stats,
    mask); ``stats`` also keeps the group's count for the backward."""
    y, mask = _outputs(x, s, mode, out)
    ps = _bn.prepare(s, x.data_ptr() | y.data_ptr() | _ptr(residual), "forward_sync")
    c = s.channels
    stats = torch.empty(ps.stats + 2 * c, dtype=torch.float64, device=x.device)  # (+ coef)
    b, have = bind(
        x=x, y=y, mask=mask, weight=weight, bias=bias, **_stats_at(stats, c, ps),
        partial=sums, running_mean=running_mean, running_var=running_var,
        coef=at(stats, 8 * ps.stats), num_batches=count, residual=residual,
    )  # fmt: skip
    _bn.run(ps, _impl._raw_stream(s.device), b, have, factor, eps, mode.slope, 0)
    return y, stats, mask


def sync_grad_sums(src, gy, mask, weight, bias, stats, residual, s: _bn.Shape, mode: Mode,
                   need_w: bool, need_b: bool, skip: int = 0):  # fmt: skip
    """A synchronized backward's first half: (sums, gw, gb), sums holding
    the local sum dz and sum dz * xhat per channel ([C][2] float64, for the
    caller to all-reduce), gw and gb the local weight and bias gradients
    (zeros where x is empty; None where not needed). ``gy`` and ``skip`` as
    ``skipped`` gives them, ``residual`` in x's layout (``arranged``)."""
    gw, gb = _grads(s.channels, src.device, need_w, need_b)
    if s.n == 0:
        for g in (gw, gb):
            if g is not None:
                g.zero_()
    pointers = src.data_ptr() | gy.data_ptr() | _ptr(residual) | skip * gy.element_size()
    sums = _sums(
        s, src, pointers, _backward_pass(mode) + "_local", mode, 2 * s.channels, skip,
        dy=_dy(gy, skip),
        mask=mask, weight=weight, bias=bias, mean=at(stats, 0), invstd=at(stats, 4 * s.channels),
        grad_weight=gw, grad_bias=gb, residual=residual,
    )  # fmt: skip
    return sums, gw, gb


def sync_backward(src, gy, mask, weight, bias, stats, residual, s: _bn.Shape, mode: Mode,
                  sums, need_r: bool, skip: int = 0):  # fmt: skip
    """Its second half, from the group's totals (``sums`` all-reduced): (dx, gr)."""
    dx = torch.empty_like(src)
    gr = torch.empty_like(src) if need_r else None
    pointers = src.data_ptr() | gy.data_ptr() | dx.data_ptr() | _ptr(gr) | _ptr(residual)
    pointers |= skip * gy.element_size()
    ps = _bn.prepare(s, pointers, _backward_pass(mode) + "_sync")
    c = s.channels
    coef = torch.empty(2 * c, dtype=torch.float64, device=src.device)
    b, have = bind(
        x=src, dy=_dy(gy, skip), y=dx, mask=mask, weight=weight, bias=bias,
        **_stats_at(stats, c, ps), partial=sums, coef=coef, residual=residual, grad_residual=gr,
    )  # fmt: skip
    _bn.run(ps, _impl._raw_stream(s.device), b, have, 0.0, 0.0, mode.slope, _flags(mode), skip)
    return dx, gr
