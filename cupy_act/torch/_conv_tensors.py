"""The fused convolution's kernels on torch tensors: operands in the kernel's
layout, outputs allocated, launches prepared (kept per kind of call where the
caller keeps them) and run on the current stream. ``conv.py``'s eager
Function and its ``torch.library`` ops call these; checks come first there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _conv
from .._arrays import mask_nbytes
from . import _impl
from ._conv_checks import FNAME


def fused_forward(
    x: Tensor, weight: Tensor, bias, divisor, slope, stride, padding, dilation, tf32, with_mask
) -> tuple[Tensor, Tensor]:
    """(y, mask) from the fused kernel; the mask is empty without ``with_mask``.

    x's layout decides the kernel's: channels-last in, channels-last out (and
    the mask in that memory order), else NCHW.
    """
    g = _conv.geometry(FNAME, x.shape, weight.shape, stride, padding, dilation)
    # (no kind of call to keep the launch in: looked up per call)
    y, mask = _kept_forward(x, weight, bias, g, {}, divisor, slope, tf32, with_mask)
    return y, x.new_empty(0, dtype=torch.uint8) if mask is None else mask


def _operands(x: Tensor, weight: Tensor, bias, g):
    """(x, weight, bias) dense in the kernel's layout, the output y, and
    whether that layout is channels-last (x's, where x is dense so)."""
    # (a single shot of the forward pays every step before its launch in
    # host time: a dense tensor is taken as it is, an NCHW y by new_empty)
    if _impl.is_channels_last(x):
        y = torch.empty(
            g.out_shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last
        )
        cl = True
    else:
        x = x if x.is_contiguous() else x.contiguous()
        y = x.new_empty(g.out_shape)
        cl = False
    w = weight if weight.is_contiguous() else weight.contiguous()  # OIHW in either layout
    b = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    return x, w, b, y, cl


_nbytes = _impl.nbytes


class _Kept(NamedTuple):
    """The eager forward's launch for one kind of call and layout (kept in its
    ``_Checked``): the prepared launch (None: an empty output) and the
    device. The scalars are not part of it: a zero slope's sign is not part
    of the kind of call, and ``_conv.kernels._scalars`` keeps the others."""

    run: _conv.ForwardLaunch | None
    dev: int


def _kept_forward(x: Tensor, weight: Tensor, bias, g, launches, divisor, slope, tf32, with_mask):
    """(y, mask) from the fused kernel on a worked-out geometry ``g``, the mask
    None without ``with_mask``; the prepared launch kept in ``launches`` (a
    kind of call's ``_Checked.launches``) per precision, layout and the
    forward's switches."""
    x, w, b, y, cl = _operands(x, weight, bias, g)
    key = (tf32, cl, _conv.forward.FORWARD_TMAP, _conv.forward.FORWARD_SEAMS)
    k = launches.get(key)
    if k is None:
        dev = x.get_device()
        run = None
        if g.n * g.oh * g.ow:
            run = _conv.forward_launch(
                dev, _impl.DTYPE_NAMES[x.dtype], "tf32" if tf32 else "fp32", cl, g
            )
        k = launches[key] = _Kept(run, dev)
    mask, nbytes = None, 0
    if with_mask:  # (zeroed by the launch, one driver call: the kernel ORs words in)
        nbytes = mask_nbytes(y.numel())
        mask = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if k.run is not None:
        sl, sc = _conv.kernels._scalars(slope, divisor, FNAME)
        k.run(
            _impl._raw_stream(k.dev),
            x.data_ptr(),
            w.data_ptr(),
            0 if b is None else b.data_ptr(),
            y.data_ptr(),
            0 if mask is None else mask.data_ptr(),
            sl,
            sc,
            nbytes,
            have=(_nbytes(x), _nbytes(w), _nbytes(b), _nbytes(y), nbytes),
        )
    return y, mask


def fused_wgrad(
    x: Tensor, gy: Tensor, mask: Tensor, weight_shape, with_bias: bool, divisor, slope,
    stride, padding, dilation, tf32: bool, g=None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(gw, gb) of the fused block from the upstream gradient and the forward's
    mask, in one pass over dy, the mask and x (``cuda/conv2d_wgrad.cu``); gb is
    empty without ``with_bias``. x's layout decides, as in the forward. ``g``:
    the geometry if worked out already."""
    if g is None:
        g = _conv.geometry(FNAME, x.shape, weight_shape, stride, padding, dilation)
    cl = _impl.is_channels_last(x)
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    gy = gy.contiguous(memory_format=fmt)
    dev = x.get_device()
    dtype = _impl.DTYPE_NAMES[x.dtype]
    run = _conv.wgrad_launch(dev, dtype, "tf32" if tf32 else "fp32", cl, g)
    part = torch.empty(run.plan.part_floats, dtype=torch.float32, device=x.device)
    gw = torch.empty(tuple(weight_shape), dtype=x.dtype, device=x.device)
    gb = x.new_empty(g.cout if with_bias else 0)
    _conv.launch_wgrad(
        run, _impl._raw_stream(dev), x.data_ptr(), gy.data_ptr(), mask.data_ptr(), gw.data_ptr(),
        gb.data_ptr() if with_bias else 0, part.data_ptr(), slope, divisor, FNAME,
        have=tuple(map(_nbytes, (x, gy, mask, gw, gb, part))),
    )  # fmt: skip
    return gw, gb


def fused_dgrad(
    gy: Tensor, mask: Tensor, weight: Tensor, x_shape, channels_last: bool, divisor, slope,
    stride, padding, dilation, tf32: bool, g=None,
) -> Tensor:  # fmt: skip
    """The input gradient of the fused block from the upstream gradient and
    the forward's mask, in one pass over dy and the mask
    (``cuda/conv2d_dgrad.cu``), in x's layout (``channels_last``). ``g``: the
    geometry if worked out already."""
    if g is None:
        g = _conv.geometry(FNAME, x_shape, weight.shape, stride, padding, dilation)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gy = gy.contiguous(memory_format=fmt)
    w = weight.contiguous()
    gx = torch.empty(tuple(x_shape), dtype=gy.dtype, device=gy.device, memory_format=fmt)
    dev = gy.get_device()
    _conv.launch_dgrad(
        dev, _impl.DTYPE_NAMES[gy.dtype], "tf32" if tf32 else "fp32", channels_last, g,
        _impl._raw_stream(dev), gy.data_ptr(), mask.data_ptr(), w.data_ptr(), gx.data_ptr(),
        slope, divisor, FNAME, have=tuple(map(_nbytes, (gy, mask, w, gx))),
    )  # fmt: skip
    return gx
