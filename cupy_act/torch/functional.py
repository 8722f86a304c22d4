"""Functional API with ``torch.nn.functional``'s conventions.

Eager calls go straight to the tensor-level implementation: an autograd
Function saves only the 1-bit mask, and with no gradient needed no mask is
made at all. Under ``torch.compile`` the same calls go through the
``torch.library`` custom ops (``_library.py``), which the compiler sees as
opaque nodes with fake implementations and registered autograd formulas.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._arrays import SUPPORTED
from .._scalars import check_divisor, check_real
from . import _impl, _library

__all__ = ["relu", "leaky_relu", "div_leaky_relu"]

Tensor = torch.Tensor


class _Backward(torch.autograd.Function):
    """dx = f'(mask) * dy. Linear in dy, so its own backward is itself (double backward)."""

    @staticmethod
    def forward(ctx, dy, mask, op, slope, divisor, channels_last):
        ctx.save_for_backward(mask)
        ctx.args = (op, slope, divisor, channels_last)
        return _impl.backward(dy, mask, op, slope, divisor, channels_last)

    @staticmethod
    def backward(ctx, ggx):
        (mask,) = ctx.saved_tensors
        return _Backward.apply(ggx, mask, *ctx.args), None, None, None, None, None


def _dx(ctx, gy):
    (mask,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: keep the backward differentiable
        return _Backward.apply(gy, mask, *ctx.args)
    return _impl.backward(gy, mask, *ctx.args)


class _Act(torch.autograd.Function):
    """y = f(x [+ bias]); saves the mask only."""

    @staticmethod
    def forward(ctx, x, bias, op, slope, divisor):
        y, mask, cl = _impl.forward_mask_layout(x, op, slope, divisor, bias)
        ctx.save_for_backward(mask)
        ctx.args = (op, slope, divisor, cl)
        return y

    @staticmethod
    def backward(ctx, gy):
        dx = _dx(ctx, gy)
        gb = _library.bias_grad(dx) if ctx.needs_input_grad[1] else None
        return dx, gb, None, None, None


class _ActInplace(torch.autograd.Function):
    """x = f(x [+ bias]) in place (marked dirty: its version counter moves)."""

    @staticmethod
    def forward(ctx, x, bias, op, slope, divisor):
        ctx.args = (op, slope, divisor, _impl.is_channels_last(x))
        if torch.compiler.is_compiling():
            mask = _library.forward_mask_inplace_op(x, op, slope, divisor, bias)
        else:
            mask = _impl.forward_mask_(x, op, slope, divisor, bias)
        ctx.mark_dirty(x)
        ctx.save_for_backward(mask)
        return x

    backward = _Act.backward


def _check(fname: str, x, divisor, slope, bias) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fname}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _impl.DTYPE_NAMES:
        raise TypeError(f"{fname}: input has dtype {x.dtype}; supported: {SUPPORTED}")
    if type(slope) is not float:
        check_real(slope, "negative_slope", fname)
    if divisor is not None and not (type(divisor) is float and divisor and math.isfinite(divisor)):
        check_divisor(divisor, fname)
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"{fname}: bias must be a torch.Tensor, got {type(bias).__name__}")
        if x.dim() < 2 or bias.shape != (x.shape[1],):
            raise ValueError(
                f"{fname}: bias has shape {tuple(bias.shape)}, expected (channels,) = "
                f"({x.shape[1] if x.dim() > 1 else '?'},) for input of shape {tuple(x.shape)}"
            )
        if bias.dtype != x.dtype or bias.device != x.device:
            raise TypeError(
                f"{fname}: bias is {bias.dtype} on {bias.device}, input is {x.dtype} on {x.device}"
            )


# Function.apply's Python wrapper binds arguments and unwraps dead functorch
# wrappers on every call (about 2 us); outside functorch transforms the C++
# apply it ends in is called directly, after the same unwrapping of x and bias.
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_act_apply = super(torch.autograd.Function, _Act).apply


def _act(x, bias, op, slope, divisor):
    if _are_functorch_transforms_active():
        return _Act.apply(x, bias, op, slope, divisor)
    return _act_apply(_unwrap_if_dead(x), None if bias is None else _unwrap_if_dead(bias),
                      op, slope, divisor)


def _apply(fname, op, x, slope, divisor, bias, inplace):
    _check(fname, x, divisor if op == "div_leaky_relu" else None, slope, bias)
    slope, divisor = float(slope), float(divisor)
    if bias is not None:
        bias = bias.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad)
    )
    compiling = torch.compiler.is_compiling()
    if inplace:
        if needs_grad:
            return _ActInplace.apply(x, bias, op, slope, divisor)
        if compiling:
            _library.forward_mask_inplace_op(x, op, slope, divisor, bias)
        else:
            _impl.forward_mask_(x, op, slope, divisor, bias, with_mask=False)
            torch.autograd.graph.increment_version(x)
        return x
    if compiling:
        if needs_grad:
            return _library.forward_mask_op(x, op, slope, divisor, bias)[0]
        return _library.forward_op(x, op, slope, divisor, bias)
    if needs_grad:
        return _act(x, bias, op, slope, divisor)
    return _impl.forward(x, op, slope, divisor, bias)


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU, bit for bit ``torch.relu``; autograd saves a 1-bit mask instead of the output.

    Args:
        input: float16, bfloat16, float32 or float64 tensor, on CUDA or CPU.
        inplace: write into ``input`` (marked dirty for autograd).
    """
    return _apply("cupy_act.torch.relu", "relu", input, 0.0, 1.0, None, inplace)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """LeakyReLU, bit for bit ``F.leaky_relu`` and its gradient; saves a 1-bit mask.

    Unlike PyTorch, ``inplace=True`` works under autograd for any slope
    (0 and negative ones included): the backward needs only the mask.
    """
    return _apply("cupy_act.torch.leaky_relu", "leaky_relu", input, negative_slope, 1.0, None,
                  inplace)


def div_leaky_relu(
    input: Tensor,
    divisor: float,
    negative_slope: float = 0.01,
    inplace: bool = False,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``F.leaky_relu((input + bias) / divisor, negative_slope)`` in one fused pass.

    Bit for bit the eager two-op expression, forward and backward (with ``bias``,
    ``bias.view(1, -1, 1, ...)`` is added first, as a convolution's bias).
    Saves a 1-bit mask; the bias gradient is the input gradient summed over all
    axes but 1.
    """
    return _apply("cupy_act.torch.div_leaky_relu", "div_leaky_relu", input, negative_slope,
                  divisor, bias, inplace)
