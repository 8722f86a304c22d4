"""PyTorch's own forward of each op and its mask predicate, as the registry
(``cupy_act._registry``) spells them: what the torch adapter's CPU path runs
and what ``cupy_act.testing`` compares against. Below both; needs torch."""

from __future__ import annotations

import torch

from . import _registry


def pre(op, x, divisor, bias):
    """What the activation sees: x, or (x [+ bias]) / divisor, as eager PyTorch
    computes and stores it (each op rounded to x's dtype)."""
    if not _registry.OPS[op].divisor:
        return x
    if bias is not None:
        x = x + bias.view(1, -1, *([1] * (x.dim() - 2)))
    return x / divisor


def reference(op, x, slope, divisor, bias):
    """(y, t): PyTorch's own forward of ``op`` (the registry's reference) and what
    the activation saw."""
    t = pre(op, x, divisor, bias)
    return _registry.OPS[op].torch_forward(torch, t, slope, None), t


def bits(op, t):
    """The mask bits from what the activation saw (the registry's predicate)."""
    return _registry.OPS[op].torch_bit(torch, t, None)
