"""The kernel and the op-type scalars of one call, cached for both adapters."""

from __future__ import annotations

from . import _loader
from ._launch import Launch
from ._registry import OPS
from ._scalars import check_scalars, kernel_scalars

_plans: dict = {}  # key -> Launch; bounded below


def plan(
    dev: int, op: str, dtype: str, kind: str, has_bias: bool, slope, divisor, fname: str
) -> Launch:
    """The kernel and scalars of one call, the scalars checked and rounded as ATen does.

    The key holds the scalars' types as well as their values (``True == 1``, but
    a bool slope is refused), so only an accepted call is ever cached. A zero
    slope is not cached: 0.0 and -0.0 are equal keys with different results.
    An unhashable scalar falls through to the checks, which name it.
    """
    key = (dev, op, dtype, kind, has_bias, slope, type(slope), divisor, type(divisor))
    try:
        return _plans[key]
    except (KeyError, TypeError):
        pass
    check_scalars(op, slope, divisor, fname)
    s, scale = kernel_scalars(op, slope, divisor, dtype == "float64", fname)
    p = Launch(_loader.kernel(dev, op, dtype, kind, has_bias), s, scale)
    if slope or not OPS[op].slope:
        if len(_plans) >= 4096:  # bound the cache against endless distinct scalars
            _plans.clear()
        _plans[key] = p
    return p
