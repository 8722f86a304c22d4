"""The op registry: one entry per activation, from which everything op-specific
is derived (kernel instantiations and launch shapes, the CuPy-level and torch
argument handling, the plain-torch CPU path and reference, the self-check,
the benchmarks and the tests' parametrizations).

An op is ``y = act((x + bias) / divisor)``: ``act`` is the C++ functor in
``cuda/activations.cuh``, ``divisor`` and ``bias`` exist only where the entry
says so, and the backward needs one mask bit per element. The PyTorch side of
an entry (its reference) is given as functions of the ``torch`` module, so
this module imports no torch (CuPy-only users never load it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The launch shape of one kind: 16-byte vectors per thread and trip of the
# kernel's loop, by item size (2, 4 or 8 bytes), a template argument of each
# kernel. Measured on an H200 at 4096 x 393216 with scripts/tune.py
# (docs/elementwise.md): one vector for 4- and 8-byte types (99-100% of
# the copy's speed; two cost 0.3-0.7%, four 2-3%); for 16-bit types two
# (98.8-99.1% for every op), except where one measured faster: leaky_relu
# forward and backward (99.7-100.4%) and div_leaky_relu backward (100.2%; relu
# and div_leaky_relu forward dropped to 95-97% with one). With a mask, two in
# every dtype (float32 1.025-1.036x the copy time, against 1.039-1.051x with
# one and 1.042-1.050x with eight); at most 32 / (16 / item size).
ONE_16BIT = {2: 1, 4: 1, 8: 1}
TWO_16BIT = {2: 2, 4: 1, 8: 1}
TWO = {2: 2, 4: 2, 8: 2}


@dataclass(frozen=True)
class Op:
    """One activation, everything the layers above need to know about it."""

    name: str  # Python name: cupy_act.<name>, cupy_act.torch.<name>
    functor: str  # C++ functor template in cuda/activations.cuh
    # launch shape per kind ("forward", "forward_mask", "backward"): item size -> vectors
    unroll: dict
    # PyTorch's forward of the activation on t (what it sees after bias and
    # division), writing into ``out`` if given (None: a new tensor)
    torch_forward: Callable  # (torch, t, slope, out) -> y
    # the bit the backward branches on, from t: the mask predicate, into ``out`` if given
    torch_bit: Callable  # (torch, t, out) -> bool tensor
    # PyTorch's backward kernel fed a stand-in for t whose sign is the bit,
    # writing into ``out`` if given (None: a new tensor)
    torch_backward: Callable  # (torch, dy, sign, slope, out) -> dx, before any division
    # PyTorch's in-place forward on t (what torch.compile traces for inplace=True;
    # its autograd reads the output, so it holds only for a slope >= 0)
    torch_forward_: Callable  # (torch, t, slope) -> t
    slope: bool = False  # takes negative_slope
    divisor: bool = False  # takes divisor (and an optional per-channel bias)
    # for ops with a divisor: the op that applies the mask without dividing
    # (its backward kernel turns the divided tangent into the output's tangent)
    undivided: str | None = None
    reference: str = ""  # the PyTorch expression, for documentation


def _relu_forward(torch, t, slope, out=None):
    return torch.relu(t) if out is None else torch.ops.aten.relu.out(t, out=out)


def _leaky_forward(torch, t, slope, out=None):
    if out is None:
        return torch.nn.functional.leaky_relu(t, slope)
    return torch.ops.aten.leaky_relu.out(t, slope, out=out)


def _relu_forward_(torch, t, slope):
    return torch.relu_(t)


def _leaky_forward_(torch, t, slope):
    return torch.nn.functional.leaky_relu_(t, slope)


def _not_at_most_zero(torch, t, out=None):
    # set for x > 0 and for NaN: relu passes NaN through
    return ~(t <= 0) if out is None else torch.le(t, 0, out=out).logical_not_()


def _greater_than_zero(torch, t, out=None):
    return t > 0 if out is None else torch.gt(t, 0, out=out)


def _threshold_backward(torch, dy, sign, slope, out):
    op = torch.ops.aten.threshold_backward
    return op(dy, sign, 0) if out is None else op.grad_input(dy, sign, 0, grad_input=out)


def _leaky_backward(torch, dy, sign, slope, out):
    op = torch.ops.aten.leaky_relu_backward
    if out is None:
        return op(dy, sign, slope, False)
    return op.grad_input(dy, sign, slope, False, grad_input=out)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "relu",
            "Relu",
            {"forward": TWO_16BIT, "forward_mask": TWO, "backward": TWO_16BIT},
            _relu_forward,
            _not_at_most_zero,
            _threshold_backward,
            _relu_forward_,
            reference="torch.relu(x)",
        ),
        Op(
            "leaky_relu",
            "LeakyRelu",
            {"forward": ONE_16BIT, "forward_mask": TWO, "backward": ONE_16BIT},
            _leaky_forward,
            _greater_than_zero,
            _leaky_backward,
            _leaky_forward_,
            slope=True,
            reference="F.leaky_relu(x, negative_slope)",
        ),
        Op(
            "div_leaky_relu",
            "DivLeakyRelu",
            {"forward": TWO_16BIT, "forward_mask": TWO, "backward": ONE_16BIT},
            _leaky_forward,
            _greater_than_zero,
            _leaky_backward,
            _leaky_forward_,
            slope=True,
            divisor=True,
            undivided="leaky_relu",
            reference="F.leaky_relu((x + bias.view(1, -1, 1, ...)) / divisor, negative_slope)",
        ),
    )
}

KINDS = ("forward", "forward_mask", "backward")  # order = the Kind enum in cuda/elementwise.cu
