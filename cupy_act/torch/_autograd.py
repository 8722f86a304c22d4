"""Autograd for the eager path: ``torch.autograd.Function``s that save the 1-bit mask.

They are written in the ``setup_context`` style with explicit ``vmap`` and
``jvp`` rules, which is what torch.func (grad, vjp, jvp, jacrev, jacfwd,
hessian, vmap) and forward-mode AD need; ``generate_vmap_rule`` cannot be used
around a raw kernel. Under torch.compile the custom ops of ``_library`` are
used instead (Dynamo refuses Functions with a custom ``jvp``, hence
``ActInplaceCompiled``). Every path ends in the same gradient: ``Backward``,
linear in dy, for the input, and ``_library.bias_grad`` for the bias.

    Act                 (y, mask) = f(x [+ bias]); y differentiable, mask not
    ActInplace          (x, mask) with x = f(x [+ bias]) in place (marked dirty)
    EagerAct            y = f(x [+ bias]), for plain eager autograd only
    EagerActInplace     x = f(x [+ bias]) in place, for plain eager autograd only
    ActInplaceCompiled  the same without jvp and vmap, for torch.compile
    Backward            dx = f'(mask) * dy; its backward and jvp are itself

Forward mode: f is piecewise linear, so the tangent of y is the mask backward
applied to the tangent of what the activation sees, formed as PyTorch's own
forward AD forms it: (x_t [+ bias_t]) [/ divisor], then leaky_relu_backward or
threshold_backward with the saved mask, which gives PyTorch's bits. Tangents
and gradients are not materialized (``set_materialize_grads(False)``): an
input without a tangent adds nothing, as in PyTorch (0 + -0 would be +0).
"""

from __future__ import annotations

import math

import torch

from .. import _registry
from . import _impl, _library

try:  # private; without it every call takes the transform-aware path
    _functorch_active = torch._C._are_functorch_transforms_active
except AttributeError:  # pragma: no cover - depends on the torch version

    def _functorch_active() -> bool:
        return True


def _batch_first(t: torch.Tensor, dim, batch: int) -> torch.Tensor:
    """A vmap operand with its batch axis first (broadcast when it has none)."""
    return t.expand(batch, *t.shape) if dim is None else t.movedim(dim, 0)


def _save(ctx, x, op, slope, divisor, mask) -> None:
    """What every Function saves: the mask, and the scalars that go with it."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(mask)
    ctx.save_for_forward(mask)
    ctx.args = (op, slope, divisor, _impl.is_channels_last(x))
    ctx.shape = x.shape


def _input_grads(ctx, gy, backward=None):
    """(dx, dbias, None, None, None) from the saved mask (Act and ActInplace*).

    ``backward(gy, mask, op, slope, divisor, channels_last)`` gives dx; by
    default ``Backward`` where grad mode or a transform needs dx differentiable
    (double backward), else the kernel alone.
    """
    if gy is None:
        return None, None, None, None, None
    (mask,) = ctx.saved_tensors
    if backward is None:
        differentiable = torch.is_grad_enabled() or _functorch_active()
        backward = Backward.apply if differentiable else _impl.backward
    dx = backward(gy, mask, *ctx.args)
    return dx, _library.bias_grad(dx) if ctx.needs_input_grad[1] else None, None, None, None


def _tangent(ctx, x_t, bias_t):
    """The tangent of y, from those of x and the bias (None for no tangent)."""
    (mask,) = ctx.saved_tensors
    op, slope, divisor, cl = ctx.args
    t = x_t
    if bias_t is not None:  # x + bias.view(1, -1, 1, ...), as the reference adds it
        b = bias_t.view(1, -1, *([1] * (len(ctx.shape) - 2)))
        t = b.expand(ctx.shape) if t is None else t + b
    if t is None:
        return None
    spec = _registry.OPS[op]
    if spec.divisor:  # t / divisor first, then the undivided activation's own jvp
        t, op = t / divisor, spec.undivided
    return Backward.apply(t, mask, op, slope, 1.0, cl)


def _bias_as_add(x, bias, bias_dim, batch):
    """x + bias for vmap rules, added as the reference adds it: x (batch first,
    then x's logical axes) plus the shared or per-sample bias on logical axis 1.
    ``x + bias`` rounds to x's dtype exactly as the fused kernels' add does."""
    b = bias if bias_dim is None else _batch_first(bias, bias_dim, batch)
    return b.view(-1 if bias_dim is not None else 1, 1, b.shape[-1], *([1] * (x.dim() - 3)))


class Act(torch.autograd.Function):
    """(y, mask) = f(x [+ bias]); saves the mask only."""

    @staticmethod
    def forward(x, bias, op, slope, divisor):
        y, mask, _ = _impl.forward_mask_layout(x, op, slope, divisor, bias)
        return y, mask

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, op, slope, divisor = inputs
        ctx.mark_non_differentiable(output[1])
        _save(ctx, x, op, slope, divisor, output[1])

    @staticmethod
    def backward(ctx, gy, _gmask):
        return _input_grads(ctx, gy)

    @staticmethod
    def jvp(ctx, x_t, bias_t, *_):
        return _tangent(ctx, x_t, bias_t), None

    @staticmethod
    def vmap(info, in_dims, x, bias, op, slope, divisor):
        # The kernels run once over all samples, stacked and made contiguous
        # (so in C order); the stacked mask is then split into one per sample.
        batch = info.batch_size
        x = _batch_first(x, in_dims[0], batch)
        if bias is not None and in_dims[1] is not None:  # a bias per sample
            x, bias = x + _bias_as_add(x, bias, in_dims[1], batch), None
        # with a shared bias, merge the batch into axis 0 so channels stay on axis 1
        stacked = x.reshape(-1, *x.shape[2:]) if bias is not None else x
        y, mask = Act.apply(stacked.contiguous(), bias, op, slope, divisor)
        n = math.prod(x.shape[1:])
        return (y.view(x.shape), _impl.per_sample_masks(mask, batch, n)), (0, 0)


class ActInplace(torch.autograd.Function):
    """(x, mask) with x = f(x [+ bias]) in place: x is marked dirty (its version
    counter moves) and its tangent, if any, is updated in place."""

    @staticmethod
    def forward(x, bias, op, slope, divisor):
        return x, _impl.forward_mask_(x, op, slope, divisor, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, _, op, slope, divisor = inputs
        ctx.mark_dirty(x)
        ctx.mark_non_differentiable(output[1])
        _save(ctx, x, op, slope, divisor, output[1])

    backward = staticmethod(Act.backward)

    @staticmethod
    def jvp(ctx, x_t, bias_t, *_):
        y_t = _tangent(ctx, x_t, bias_t)
        return (y_t if x_t is None else x_t.copy_(y_t)), None

    @staticmethod
    def vmap(info, in_dims, x, bias, op, slope, divisor):
        # In place on the physical tensor through a batch-first view of it;
        # its mask (in the order the kernels walked that view) is then split
        # into one per sample.
        if in_dims[0] is None:
            raise ValueError(
                "vmap: cupy_act in-place activation of a tensor that is not batched, with a "
                "batched bias: the result would not fit in the input (as for PyTorch's "
                "in-place ops); use inplace=False"
            )
        batch = info.batch_size
        view = x.movedim(in_dims[0], 0)
        if bias is not None:  # add the bias in place first, as the reference does
            view.add_(_bias_as_add(view, bias, in_dims[1], batch))
        _, mask = ActInplace.apply(view, None, op, slope, divisor)
        n = math.prod(view.shape[1:])
        if _impl.is_channels_last(view):  # walked in memory order: back to each sample's C order
            masks = _impl.pack_rows(_impl.mask_to_bits(mask, view.shape, True).reshape(batch, n))
        else:  # walked in the view's C order (of a contiguous copy if need be): sample by sample
            masks = _impl.per_sample_masks(mask, batch, n)
        return (x, masks), (in_dims[0], 0)


# Plain eager autograd (no torch.func transform, no forward-mode AD, not
# compiling) is the hot path of training, and there the Functions above cost
# more host time than they need: a second (mask) output, the setup_context
# call and the state kept for jvp add about 3 us per activation to forward +
# backward (measured against these two, 2026-11-22). The two below return y
# alone, keep the mask on ctx as the old-style forward allows, and share the
# gradient (_input_grads) with the others; functional._apply uses them only
# where neither transforms nor forward AD can see them.


class EagerAct(torch.autograd.Function):
    """y = f(x [+ bias]), saving the mask; eager autograd only (no jvp, no vmap)."""

    @staticmethod
    def forward(ctx, x, bias, op, slope, divisor):
        y, mask, cl = _impl.forward_mask_layout(x, op, slope, divisor, bias)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mask)
        ctx.args = (op, slope, divisor, cl)
        return y

    @staticmethod
    def backward(ctx, gy):
        return _input_grads(ctx, gy)


class EagerActInplace(torch.autograd.Function):
    """x = f(x [+ bias]) in place (marked dirty), saving the mask; eager autograd only."""

    @staticmethod
    def forward(ctx, x, bias, op, slope, divisor):
        mask = _impl.forward_mask_(x, op, slope, divisor, bias)
        ctx.mark_dirty(x)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mask)
        ctx.args = (op, slope, divisor, _impl.is_channels_last(x))
        return x

    backward = staticmethod(EagerAct.backward)


class ActInplaceCompiled(torch.autograd.Function):
    """ActInplace for torch.compile: the custom op, and no jvp (Dynamo refuses it)."""

    @staticmethod
    def forward(ctx, x, bias, op, slope, divisor):
        mask = _library.forward_mask_inplace_op(x, op, slope, divisor, bias)
        ctx.mark_dirty(x)
        _save(ctx, x, op, slope, divisor, mask)
        return x

    @staticmethod
    def backward(ctx, gy):
        # AOTAutograd traces this outside Dynamo, where is_compiling() is False:
        # name the custom op (it has its own autograd for double backward).
        return _input_grads(ctx, gy, _library.backward_op)


class Backward(torch.autograd.Function):
    """dx = f'(mask) * dy. Linear in dy: its backward and its jvp are itself."""

    @staticmethod
    def forward(dy, mask, op, slope, divisor, channels_last):
        return _impl.backward(dy, mask, op, slope, divisor, channels_last)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mask = inputs[1]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(mask)
        ctx.save_for_forward(mask)
        ctx.args = inputs[2:]

    @staticmethod
    def backward(ctx, ggx):
        (mask,) = ctx.saved_tensors
        ggy = None if ggx is None else Backward.apply(ggx, mask, *ctx.args)
        return ggy, None, None, None, None, None

    @staticmethod
    def jvp(ctx, dy_t, *_):
        (mask,) = ctx.saved_tensors
        return None if dy_t is None else Backward.apply(dy_t, mask, *ctx.args)

    @staticmethod
    def vmap(info, in_dims, dy, mask, op, slope, divisor, channels_last):
        # Masks come per sample (from Act.vmap) or shared (jacrev's cotangent
        # batch over one forward). Samples' masks need not end on a byte, so
        # this runs ATen's own backward on the unpacked bits: the same bits.
        batch = info.batch_size
        dy = _batch_first(dy, in_dims[0], batch)
        masks = _batch_first(mask, in_dims[1], batch)
        bits = _impl.mask_to_bits(masks, dy.shape[1:], channels_last)
        return _impl.backward_from_bits(op, dy, bits, slope, divisor), 0
