"""Functional API with ``torch.nn.functional``'s conventions.

``_apply`` picks one of four routes per call, cheapest first where it is safe:

- no gradient, no transform: the kernel alone (``_impl``), no mask made;
- eager autograd: ``_autograd.EagerAct`` through the C++ ``Function.apply``
  (the Python wrapper costs about 2 us per call), or ``EagerActInplace``;
- torch.func transforms or forward-mode AD: ``Act.apply`` or
  ``ActInplace.apply``, whose ``vmap`` and ``jvp`` rules the transforms call;
- torch.compile: by default the registry's PyTorch operations, traced into the
  graph (``_traced.py``), which Inductor fuses with their neighbours and
  rematerializes as it does PyTorch's own activations; with
  ``set_compile_route("kernels")`` the ``torch.library`` custom ops
  (``_library.py``) instead: cupy_act's kernels and 1-bit masks inside the
  compiled graph, as opaque nodes the compiler cannot fuse.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from .._scalars import check_divisor, check_real
from . import _autograd, _impl, _library, _traced

__all__ = ["relu", "leaky_relu", "div_leaky_relu", "set_compile_route"]

COMPILE_ROUTES = ("traced", "kernels")


def _route_from_env() -> bool:
    """Whether CUPY_ACT_COMPILE_ROUTE asks for the kernels (default: traced)."""
    route = os.environ.get("CUPY_ACT_COMPILE_ROUTE", "traced")
    if route not in COMPILE_ROUTES:
        raise ValueError(
            f"CUPY_ACT_COMPILE_ROUTE={route!r}; expected one of {COMPILE_ROUTES} "
            f"(or unset, for 'traced')"
        )
    return route == "kernels"


# (read by compiled code: Dynamo guards on its value, so a change recompiles)
_compile = SimpleNamespace(kernels=_route_from_env())


def set_compile_route(route: str) -> str:
    """Choose what cupy_act's activations become under ``torch.compile``; returns
    the previous route. Graphs compiled afterwards follow the new one (Dynamo
    recompiles on the change).

    - ``"traced"`` (the default): PyTorch's own operations for the activation,
      which Inductor fuses with its neighbours (a BatchNorm before it, a bias
      and division) and rematerializes: a compiled model runs as fast and as
      light as with PyTorch's activations, with the same bits. (The convolution
      block can keep a packed 1-bit mask instead: ``set_compiled_epilogue``.)
    - ``"kernels"``: cupy_act's CUDA kernels as opaque custom ops with their
      1-bit masks, as in eager mode. Inductor cannot fuse them: each costs an
      extra read and write of its tensor each way, and training steps measured
      up to 1.4x slower than with ``"traced"``; the saved state is the mask.

    The environment variable ``CUPY_ACT_COMPILE_ROUTE`` sets the route at import.
    Eager calls, CuPy, torch.func and forward-mode AD always run the kernels.
    """
    if route not in COMPILE_ROUTES:
        raise ValueError(f"set_compile_route: route={route!r}; expected one of {COMPILE_ROUTES}")
    previous = COMPILE_ROUTES[_compile.kernels]
    _compile.kernels = route == "kernels"
    return previous


def _flag(value, name: str, fname: str) -> bool:
    """A switch given as something else: a tensor or an array (an argument in
    the wrong place, such as a bias in ``inplace``'s) is refused by name;
    other values count by their truth, as PyTorch's functions take them."""
    if isinstance(value, Tensor) or hasattr(value, "__cuda_array_interface__"):
        raise TypeError(
            f"{fname}: {name} must be a bool, got a {type(value).__name__} (a bias goes in as "
            f"bias=...)"
        )
    return bool(value)


def _slope(value, fname: str) -> float:
    """negative_slope as a Python float, or TypeError/ValueError naming it."""
    check_real(value, "negative_slope", fname)
    return float(value)


def _divisor(value, fname: str) -> float:
    """divisor as a Python float, or TypeError/ValueError naming it."""
    check_divisor(value, fname)
    return float(value)


# Private torch APIs on the hot path, each with a public fallback that is
# slower but gives the same results, so a torch upgrade costs speed only:
# - Function.apply's Python wrapper binds arguments and unwraps dead functorch
#   wrappers (about 2 us); outside transforms we call the C++ apply it ends in,
#   after the same unwrapping of x and bias;
# - forward-mode AD is active iff a dual level is open (a module global).
_functorch_active = _autograd._functorch_active
try:
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    _eager_act = super(torch.autograd.Function, _autograd.EagerAct).apply
    _eager_act_ = super(torch.autograd.Function, _autograd.EagerActInplace).apply

    def _act(x, bias, op, slope, divisor):
        b = None if bias is None else _unwrap_if_dead(bias)
        return _eager_act(_unwrap_if_dead(x), b, op, slope, divisor)

    def _act_(x, bias, op, slope, divisor):
        b = None if bias is None else _unwrap_if_dead(bias)
        return _eager_act_(_unwrap_if_dead(x), b, op, slope, divisor)
except AttributeError:  # pragma: no cover - depends on the torch version
    _act = _autograd.EagerAct.apply
    _act_ = _autograd.EagerActInplace.apply


# (read inline in _apply; without the private global, a stand-in says "active")
_fwd_levels = (
    _forward_ad
    if isinstance(getattr(_forward_ad, "_current_level", None), int)
    else SimpleNamespace(_current_level=0)
)


_is_compiling = torch.compiler.is_compiling  # (Dynamo folds it by identity)


def _forward_ad_active() -> bool:
    return _fwd_levels._current_level >= 0


def _apply(fname, op, x, slope, divisor, bias, inplace):
    # slope and divisor are Python floats here, checked by the public function
    # that takes them (relu takes none: its call checks only the tensor). The
    # common call (a tensor of a supported dtype, no bias) passes the tensor
    # checks in one expression; anything else goes through
    # _impl.check_tensors, which names what is wrong.
    if not (bias is None and isinstance(x, Tensor) and x.dtype in _impl.DTYPE_NAMES):
        bias = _impl.check_tensors(fname, x, bias)
    if inplace is not False and inplace is not True:
        inplace = _flag(inplace, "inplace", fname)
    if _is_compiling():
        return _compiled(op, x, slope, divisor, bias, inplace)
    if _functorch_active() or _fwd_levels._current_level >= 0:  # transforms, forward AD
        fn = _autograd.ActInplace if inplace else _autograd.Act
        return fn.apply(x, bias, op, slope, divisor)[0]
    # (inline, and the tensor's flag first: an inference call skips the mode query)
    needs_grad = (
        x.requires_grad or (bias is not None and bias.requires_grad)
    ) and torch.is_grad_enabled()
    if inplace:
        if needs_grad:
            return _act_(x, bias, op, slope, divisor)
        _impl.forward_mask_(x, op, slope, divisor, bias, with_mask=False)
        torch.autograd.graph.increment_version(x)
        return x
    if needs_grad:
        return _act(x, bias, op, slope, divisor)
    return _impl.forward(x, op, slope, divisor, bias)


def _compiled(op, x, slope, divisor, bias, inplace, kernels=False):
    """The route under torch.compile: traced PyTorch operations, or the custom ops
    (which carry their own autograd) with the kernels route or ``kernels``."""
    if not (kernels or _compile.kernels):
        return _traced.apply(op, x, slope, divisor, bias, inplace)
    needs_grad = _impl.needs_grad(x, bias)
    if inplace:
        if needs_grad:
            return _autograd.ActInplaceCompiled.apply(x, bias, op, slope, divisor)
        _library.forward_mask_inplace_op(x, op, slope, divisor, bias)
        return x
    if needs_grad:
        return _library.forward_mask_op(x, op, slope, divisor, bias)[0]
    return _library.forward_op(x, op, slope, divisor, bias)


_RELU, _LEAKY, _DIV = (f"cupy_act.torch.{op}" for op in __all__[:3])  # (for error messages)


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """ReLU, bit for bit ``torch.relu``; autograd saves a 1-bit mask instead of the output.

    Args:
        input: float16, bfloat16, float32 or float64 tensor, on CUDA or CPU.
        inplace: write into ``input`` (marked dirty for autograd).
    """
    return _apply(_RELU, "relu", input, 0.0, 1.0, None, inplace)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """LeakyReLU, bit for bit ``F.leaky_relu`` and its gradient; saves a 1-bit mask.

    Unlike PyTorch, ``inplace=True`` works under autograd for any slope
    (0 and negative ones included): the backward needs only the mask.
    """
    if type(negative_slope) is not float:  # (the common case costs one type check)
        negative_slope = _slope(negative_slope, _LEAKY)
    return _apply(_LEAKY, "leaky_relu", input, negative_slope, 1.0, None, inplace)


def div_leaky_relu(
    input: Tensor,
    divisor: float,
    negative_slope: float = 0.01,
    inplace: bool = False,
    *,
    bias: Tensor | None = None,
) -> Tensor:
    """``F.leaky_relu((input + bias) / divisor, negative_slope)`` in one fused pass.

    Bit for bit the eager two-op expression, forward and backward (with ``bias``,
    ``bias.view(1, -1, 1, ...)`` is added first, as a convolution's bias).
    Saves a 1-bit mask; the bias gradient is the input gradient summed over all
    axes but 1.
    """
    if type(negative_slope) is not float:
        negative_slope = _slope(negative_slope, _DIV)
    if not (type(divisor) is float and divisor and divisor - divisor == 0.0):  # finite, non-zero
        divisor = _divisor(divisor, _DIV)
    return _apply(_DIV, "div_leaky_relu", input, negative_slope, divisor, bias, inplace)
