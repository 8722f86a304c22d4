"""``conv2d_div_leaky_relu``'s argument checks, kept per kind of call: each
tensor against the others as ``F.conv2d`` checks them, the padding as a pair,
and whether the fused kernel may run the geometry (``_checked``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _conv
from .._scalars import check_divisor, check_real
from . import _impl

ALGORITHMS = ("exact", "channels_last", "fused", "fused_tf32", "auto")
FNAME = "cupy_act.torch.conv2d_div_leaky_relu"
_FUSED_DTYPES = {getattr(torch, d) for d in _conv.DTYPES}


def _padding(padding, weight: Tensor, dilation, stride):
    """Padding as a pair of ints, or None where the fused kernel cannot express it
    (asymmetric "same"). Strings as ``F.conv2d`` takes them."""
    if not isinstance(padding, str):
        return _conv.pair(padding, "padding", FNAME, 0)
    if padding == "valid":
        return (0, 0)
    if padding != "same":
        raise ValueError(f"{FNAME}: padding={padding!r}; expected 'valid', 'same' or ints")
    s, d = _conv.pair(stride, "stride", FNAME, 1), _conv.pair(dilation, "dilation", FNAME, 1)
    if s != (1, 1):
        raise ValueError(f"{FNAME}: padding='same' needs stride 1, got stride={stride!r}")
    total = [d[i] * (weight.shape[2 + i] - 1) for i in range(2)]
    if total[0] % 2 or total[1] % 2:
        return None
    return (total[0] // 2, total[1] // 2)


def _check(x, weight, bias, divisor, slope, algorithm) -> None:
    """The call's arguments, each tensor against the others: where
    ``F.conv2d`` refuses the same tensors, its exception class (RuntimeError)
    with the same facts; TypeError / ValueError naming the value elsewhere."""
    for name, t in (("input", x), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{FNAME}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in _impl.DTYPE_NAMES:
        supported = ", ".join(_impl.DTYPE_NAMES.values())
        raise TypeError(f"{FNAME}: input has dtype {x.dtype}; supported: {supported}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"{FNAME}: bias must be a torch.Tensor, got {type(bias).__name__}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise RuntimeError(
                f"{FNAME}: input type ({x.dtype} on {x.device}) and {name} type ({t.dtype} on "
                f"{t.device}) should be the same"
            )
    if x.dim() != 4:
        raise RuntimeError(
            f"{FNAME}: expected 3D (unbatched) or 4D (batched) input, but got input of size: "
            f"{list(x.shape)}"
        )
    if weight.dim() != 4 or weight.shape[1] != x.shape[1]:
        raise RuntimeError(
            f"{FNAME}: given groups=1, weight of size {list(weight.shape)}, expected "
            f"input{list(x.shape)} to have {weight.shape[1] if weight.dim() > 1 else '?'} "
            f"channels, but got {x.shape[1]} channels instead"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise RuntimeError(
            f"{FNAME}: given weight of size {list(weight.shape)}, expected bias to be "
            f"1-dimensional with {weight.shape[0]} elements, but got bias of size "
            f"{list(bias.shape)} instead"
        )
    check_divisor(divisor, FNAME)
    check_real(slope, "negative_slope", FNAME)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{FNAME}: algorithm={algorithm!r}; expected one of {ALGORITHMS}")


class _Checked(NamedTuple):
    """What the checks of a call settled (``_checked``)."""

    pad: tuple[int, int] | None  # the padding as a pair (None: not expressible, see _padding)
    fusable: tuple[bool, ...]  # whether the fused kernel runs it: FP32 (three passes), TF32
    spd: tuple  # stride, padding and dilation as pairs, where it does
    g: object  # the geometry (_conv.Geometry), where it does
    launches: dict  # the eager forward's, as they are first made (_kept_forward)
    choices: dict  # "auto"'s, as _choose finds them


_checks: dict[tuple, _Checked] = {}


def _checked(x, weight, bias, divisor, slope, stride, padding, dilation, algorithm) -> _Checked:
    """``_check`` and the padding, and where the fused kernel may run the
    geometry and whether it fits, kept per kind of call: the key holds what
    they read (the tensors' shapes, dtypes and devices, the hyper-parameters
    as exact ints or strings, the scalars with their types). Only calls that
    passed are kept; never while torch.compile traces (it would guard on the
    table)."""
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = (
                x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
                None if bias is None else (bias.shape, bias.dtype, bias.device),
                # (an int as it is: a call less each, the common case)
                stride if type(stride) is int else _exact(stride),
                padding if type(padding) is int else _exact(padding),
                dilation if type(dilation) is int else _exact(dilation),
                divisor, type(divisor), slope, type(slope), algorithm,
            )  # fmt: skip
            c = _checks.get(key)
        except (AttributeError, TypeError):  # not tensors, unhashable values: checked below
            key = c = None
        if c is not None:
            return c
    _check(x, weight, bias, divisor, slope, algorithm)
    pad = _padding(padding, weight, dilation, stride)
    fusable: tuple[bool, ...] = (False, False)
    spd: tuple = ()
    g = None
    fused_ok = _impl.on_gpu(x) and x.dtype in _FUSED_DTYPES
    if pad is not None and fused_ok and _conv.supported(x.device.index):
        g = _conv.geometry(FNAME, x.shape, weight.shape, stride, pad, dilation)
        name = _impl.DTYPE_NAMES[x.dtype]
        fusable = tuple(_conv.fits(g, _conv.passes(name, p)) for p in ("fp32", "tf32"))
        spd = (g.stride, g.padding, g.dilation)
    c = _Checked(pad, fusable, spd, g, {}, {})
    if key is not None and None not in key[7:10]:
        if len(_checks) >= 256:
            _checks.clear()
        _checks[key] = c
    return c


def _exact(value):
    """A hyper-parameter as part of ``_checked``'s key: a string, or what
    ``_conv.shapes._plain`` keeps (ints of type int exactly: True must not pass for
    1), else None (the call is not kept)."""
    return value if type(value) is str else _conv.shapes._plain(value)
