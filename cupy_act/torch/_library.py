"""``torch.library`` custom ops: what torch.compile, CUDA graphs and opcheck see.

    cupy_act::forward(x, op, slope, divisor, bias) -> y
    cupy_act::forward_mask(x, ...) -> (y, mask)         autograd: backward below
    cupy_act::backward(dy, mask, op, slope, divisor, channels_last) -> dx
                                                         autograd: itself (linear in dy)
    cupy_act::forward_mask_(x!, ...) -> mask             in place (mutates x)

Each has a fake (meta) implementation with the real one's shapes and strides.
The in-place op cannot carry an autograd formula (torch.library refuses them on
mutating ops); functional.py wraps it in an autograd.Function instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _registry
from .._scalars import check_scalars
from . import _impl


def _like(x: Tensor) -> Tensor:
    return torch.empty_like(_impl.arrange(x, _impl.is_channels_last(x)))


# The ops are public (``torch.ops.cupy_act.*``): each implementation (and
# fake) checks its arguments as the Python functions do before anything
# reaches a kernel. (Eager calls of those functions go to _impl after their
# own checks; these ops run under torch.compile and in the convolution's
# compiled backward.)


def _check_op(fname: str, op: str, slope: float, divisor: float, bias=None) -> None:
    """ValueError / TypeError naming a bad op name, number, or a bias the op
    does not take."""
    spec = _registry.OPS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise ValueError(f"{fname}: op={op!r}; expected one of {tuple(_registry.OPS)}")
    check_scalars(op, slope, divisor, fname)
    if bias is not None and not spec.divisor:
        raise ValueError(f"{fname}: op {op!r} takes no bias (only {_BIASED} do)")


_BIASED = tuple(name for name, spec in _registry.OPS.items() if spec.divisor)


def _checked_forward(fname: str, x, op: str, slope: float, divisor: float, bias):
    """The forward ops' checks (``_check_op``, ``_impl.check_tensors``); bias made dense."""
    _check_op(fname, op, slope, divisor, bias)
    return _impl.check_tensors(fname, x, bias)


@torch.library.custom_op("cupy_act::forward", mutates_args=())
def forward_op(x: Tensor, op: str, slope: float, divisor: float, bias: Tensor | None) -> Tensor:
    bias = _checked_forward("cupy_act::forward", x, op, slope, divisor, bias)
    return _impl.forward(x, op, slope, divisor, bias)


@forward_op.register_fake
def _(x, op, slope, divisor, bias):
    _checked_forward("cupy_act::forward", x, op, slope, divisor, bias)
    return _like(x)


@torch.library.custom_op("cupy_act::forward_mask", mutates_args=())
def forward_mask_op(
    x: Tensor, op: str, slope: float, divisor: float, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    bias = _checked_forward("cupy_act::forward_mask", x, op, slope, divisor, bias)
    return _impl.forward_mask(x, op, slope, divisor, bias)


@forward_mask_op.register_fake
def _(x, op, slope, divisor, bias):
    _checked_forward("cupy_act::forward_mask", x, op, slope, divisor, bias)
    return _like(x), _impl.new_mask(x)


@torch.library.custom_op("cupy_act::backward", mutates_args=())
def backward_op(
    dy: Tensor, mask: Tensor, op: str, slope: float, divisor: float, channels_last: bool
) -> Tensor:
    _check_backward(dy, mask, op, slope, divisor, channels_last)
    return _impl.backward(dy, mask, op, slope, divisor, channels_last)


@backward_op.register_fake
def _(dy, mask, op, slope, divisor, channels_last):
    _check_backward(dy, mask, op, slope, divisor, channels_last)
    return torch.empty_like(_impl.arrange(dy, channels_last))


def _check_backward(dy, mask, op, slope, divisor, channels_last) -> None:
    """The backward op's checks: the op and numbers, dy, and the mask the
    kernel will read for dy's elements in the order ``channels_last`` says."""
    fname = "cupy_act::backward"
    _check_op(fname, op, slope, divisor)
    _impl.check_tensors(fname, dy, None)
    _impl.check_mask(fname, mask, dy)
    if channels_last and dy.dim() not in (4, 5):
        raise ValueError(
            f"{fname}: channels_last=True needs a 4-D or 5-D dy (the mask in channels-last "
            f"memory order), got shape {tuple(dy.shape)}"
        )


@torch.library.custom_op("cupy_act::forward_mask_", mutates_args=("x",))
def forward_mask_inplace_op(
    x: Tensor, op: str, slope: float, divisor: float, bias: Tensor | None
) -> Tensor:
    bias = _checked_forward("cupy_act::forward_mask_", x, op, slope, divisor, bias)
    return _impl.forward_mask_(x, op, slope, divisor, bias)


@forward_mask_inplace_op.register_fake
def _(x, op, slope, divisor, bias):
    _checked_forward("cupy_act::forward_mask_", x, op, slope, divisor, bias)
    return _impl.new_mask(x)


def bias_grad(dx: Tensor) -> Tensor:
    """d loss / d bias: dx summed over every axis but the channel axis (1)."""
    return dx.sum(dim=[d for d in range(dx.dim()) if d != 1])


def _setup_forward_mask(ctx, inputs, output):
    x, op, slope, divisor, bias = inputs
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.args = (op, slope, divisor, _impl.is_channels_last(x))
    ctx.bias = bias is not None


def _backward_forward_mask(ctx, gy, gmask):
    (mask,) = ctx.saved_tensors
    op, slope, divisor, cl = ctx.args
    dx = backward_op(gy, mask, op, slope, divisor, cl)
    return dx, None, None, None, bias_grad(dx) if ctx.bias else None


forward_mask_op.register_autograd(_backward_forward_mask, setup_context=_setup_forward_mask)


def _setup_backward(ctx, inputs, output):
    dy, mask, op, slope, divisor, cl = inputs
    ctx.save_for_backward(mask)
    ctx.args = (op, slope, divisor, cl)


def _backward_backward(ctx, ggx):
    (mask,) = ctx.saved_tensors
    return backward_op(ggx, mask, *ctx.args), None, None, None, None, None


backward_op.register_autograd(_backward_backward, setup_context=_setup_backward)
