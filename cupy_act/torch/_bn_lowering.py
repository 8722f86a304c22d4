"""Inductor's lowering of the BatchNorm ops: the tensors that the kernels walk
alongside the op's first input arrive in its memory order.

The ops are tagged ``flexible_layout``: Inductor hands each input over in the
layout it chose. For the first input (x, or the backward's src) that is what
the kernels want: they walk a dense channels-last tensor channels-last and
anything else in C order. But dy and the residual must then follow that
order, and Inductor, free to choose, lays out the buffers it makes for them
in C order. In a channels-last compiled graph (Inductor's layout
optimization around convolutions) the gradient of a CSP stage's split
(``torch.cat`` of the two halves' gradients) came to the backward op NCHW
beside a channels-last src, and the op's transposing copy of it took 1.03 ms
of a 19.4 ms cspdarknet53 step (H200, batch 32, float32, 2026-11-29).

So, once Inductor is in the process, each op gets a lowering of its own: it
asks Inductor for dy and the residual in the stride order of x / src
(``ExternKernel.require_stride_order``: a buffer whose layout Inductor has not
fixed yet, such as a concatenation's, is then written that way, at no cost;
one already fixed otherwise is copied by a kernel Inductor generates), then
falls back to the op as its implicit fallback would. ``register`` runs from
the ops' fake kernels, which Inductor's tracing calls before it lowers.
Inductor's lowering tables are private: where they differ from what this
expects, nothing is registered and the ops stay plain ``flexible_layout``
fallbacks (correct, with the copy inside the op).
"""

from __future__ import annotations

import sys
import threading

import torch

# op name -> (the argument whose order the others follow, the followers)
FOLLOW = {
    "batchnorm_act": ("x", ("residual", "post")),
    "batchnorm_act_backward": ("src", ("dy", "residual")),
}
_lock = threading.Lock()
_state = {"registered": False}


def register() -> bool:
    """Install the lowerings once Inductor's lowering module is loaded;
    whether they are installed."""
    if _state["registered"]:
        return True
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None:  # (Inductor not in use: nothing to lower)
        return False
    with _lock:
        if not _state["registered"]:
            try:
                for name, (lead, followers) in FOLLOW.items():
                    _install(lowering, getattr(torch.ops.cupy_act, name).default, lead,
                             followers)  # fmt: skip
            except (AttributeError, TypeError, ImportError):  # pragma: no cover - torch version
                return False
            _state["registered"] = True
    return True


def _install(lowering, op, lead: str, followers: tuple[str, ...]) -> None:
    from torch._inductor import ir

    names = [a.name for a in op._schema.arguments]
    fallback = lowering.fallback_handler(op)

    def lower(*given, **kwargs):
        args = list(given)

        def get(name):
            i = names.index(name)
            return args[i] if i < len(args) else kwargs.get(name)

        def put(name, value):
            i = names.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value

        order = _order(ir, get(lead))
        if order is not None:
            for name in followers:
                if get(name) is not None:
                    put(name, ir.ExternKernel.require_stride_order(get(name), order))
        return fallback(*args, **kwargs)

    lowering.add_needs_realized_inputs(op)
    lowering.register_lowering(op, type_promotion_kind=None)(lower)


def _order(ir, node):
    """The stride order of ``node``'s fixed layout (None where it has none
    yet: the followers are then left to Inductor, as without this lowering)."""
    if node is None:
        return None
    try:
        layout = node.get_layout()
        if not isinstance(layout, ir.FixedLayout):
            return None
        return ir.get_stride_order(layout.stride)
    except Exception:  # (a node without a layout yet, strides it cannot order, another IR)
        return None
