"""``conv2d_div_leaky_relu``: the reference block ``leaky_relu(conv2d(x) / d)``
with a choice of algorithm.

- ``"exact"`` (default): PyTorch's convolution without its bias, then bias,
  division, LeakyReLU and the mask in one elementwise pass: bit for bit the
  eager block, forward and backward.
- ``"channels_last"``: the same in channels-last layout, where cuDNN uses TF32
  tensor cores if ``torch.backends.cudnn.allow_tf32`` (PyTorch's default);
  returns a channels-last output.
- ``"fused"``: ``cuda/conv2d.cu``, one kernel for convolution and epilogue,
  written once; FP32 accuracy (3xTF32) for float32, exact products with
  float32 accumulation for 16-bit types. Not bit-identical to cuDNN.
- ``"fused_tf32"``: the fused kernel with one TF32 pass (torch.compile's
  accuracy); the same as ``"fused"`` for 16-bit types.
- ``"auto"``: the fastest of the above for this shape and device, timed on
  first use and cached, among those whose accuracy ``allow_tf32`` permits;
  where the call needs a gradient, the fastest forward + backward for the
  inputs that need one (each such set cached apart; timed on detached
  views: the caller's gradients and random state are not touched).

Where the fused kernel does not apply (CPU tensors, float64, a padding string
it cannot express, an image beyond 2^31 elements) ``"fused"`` falls back to
``"exact"``. Training through the fused kernel saves x, the weight and the
1-bit mask; backward applies the mask, then PyTorch's convolution backward,
or, where they apply, one kernel for the weight and bias gradients from dy,
the mask and x (``cuda/conv2d_wgrad.cu``: by default where one channel chunk
holds the whole filter depth and the input is not 16-bit channels-last, see
``FUSED_WGRAD``) and one for the input gradient from dy, the mask and the
weight (``cuda/conv2d_dgrad.cu``: 3 x 3 filters, stride 1, see
``FUSED_DGRAD``); dz then never goes to memory.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _conv
from .._arrays import mask_nbytes
from .._scalars import check_divisor, check_real
from . import _conv_auto, _impl, _library, _traced
from . import functional as F

__all__ = [
    "conv2d_div_leaky_relu",
    "set_compiled_epilogue",
    "ALGORITHMS",
    "candidates",
    "auto_choices",
]

from ._conv_auto import auto_choices, candidates
from ._conv_checks import _FUSED_DTYPES, ALGORITHMS, FNAME, _check, _checked
from ._conv_tensors import _kept_forward, fused_dgrad, fused_forward, fused_wgrad

# The custom ops are public (``torch.ops.cupy_act.*``): each checks every
# tensor it hands a kernel against the others and the geometry, as
# conv2d_div_leaky_relu does, before anything is launched.
_OP = "cupy_act::conv2d_div_leaky_relu"


def _check_fused(fname: str, x: str, dtype_of, tensors) -> None:
    """TypeError naming ``dtype_of`` (called ``x`` in the message) unless it
    is a CUDA tensor of a dtype the fused kernels take, or the first of
    ``tensors`` ((name, tensor or None), ...) not of its dtype and device."""
    if not isinstance(dtype_of, Tensor):
        raise TypeError(f"{fname}: {x} must be a torch.Tensor, got {type(dtype_of).__name__}")
    if dtype_of.dtype not in _FUSED_DTYPES or not _impl.on_gpu(dtype_of):
        raise TypeError(
            f"{fname}: {x} is {dtype_of.dtype} on {dtype_of.device}; the fused kernels take "
            f"CUDA tensors of {', '.join(_conv.DTYPES)}"
        )
    for name, t in tensors:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{fname}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype_of.dtype or t.device != dtype_of.device:
            raise TypeError(
                f"{fname}: {name} is {t.dtype} on {t.device}, {x} is {dtype_of.dtype} on "
                f"{dtype_of.device}"
            )


def _check_shape(fname: str, name: str, t: Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fname}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _geometry_fits(fname: str, g, dtype: torch.dtype, tf32: bool, fits, what: str) -> None:
    n_passes = _conv.passes(_impl.DTYPE_NAMES[dtype], "tf32" if tf32 else "fp32")
    if not fits(g, n_passes):
        raise ValueError(f"{fname}: {g} is beyond the fused {what} kernel")


@torch.library.custom_op("cupy_act::conv2d_div_leaky_relu", mutates_args=())
def fused_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    divisor: float,
    negative_slope: float,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    tf32: bool,
    with_mask: bool,
) -> tuple[Tensor, Tensor]:
    _check_fused(_OP, "input", x, (("weight", weight), ("bias", bias)))
    _check(x, weight, bias, divisor, negative_slope, "fused")
    g = _conv.geometry(_OP, x.shape, weight.shape, stride, padding, dilation)
    _geometry_fits(_OP, g, x.dtype, tf32, _conv.fits, "forward")
    return fused_forward(
        x, weight, bias, divisor, negative_slope, stride, padding, dilation, tf32, with_mask
    )


@fused_op.register_fake
def _(x, weight, bias, divisor, negative_slope, stride, padding, dilation, tf32, with_mask):
    g = _conv.geometry(FNAME, x.shape, weight.shape, stride, padding, dilation)
    fmt = torch.channels_last if _impl.is_channels_last(x) else torch.contiguous_format
    y = torch.empty(g.out_shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    n = mask_nbytes(y.numel()) if with_mask else 0
    return y, x.new_empty(n, dtype=torch.uint8)


# The ops' registration: ``torch.library.Library`` (define, impl, fake), not
# ``custom_op``, whose Python layers each call in a compiled graph would pass
# through; the autograd formulas are autograd.Functions (``_FusedCompiled``;
# ``fused_op``, the custom op torch.func takes, has its own).
_lib = torch.library.Library("cupy_act", "FRAGMENT")
_GEOMETRY = "int[] stride, int[] padding, int[] dilation, bool tf32"
_lib.define(
    "conv2d_div_leaky_relu_forward(Tensor x, Tensor weight, Tensor? bias, float divisor, "
    f"float negative_slope, {_GEOMETRY}, bool with_mask) -> (Tensor, Tensor)"
)
_lib.define(
    "conv2d_div_leaky_relu_wgrad(Tensor x, Tensor gy, Tensor mask, int[] weight_shape, "
    f"bool with_bias, float divisor, float negative_slope, {_GEOMETRY}) -> (Tensor, Tensor)"
)
_lib.define(
    "conv2d_div_leaky_relu_dgrad(Tensor gy, Tensor mask, Tensor weight, int[] x_shape, "
    f"bool channels_last, float divisor, float negative_slope, {_GEOMETRY}) -> Tensor"
)


def _register(name: str, impl, fake):
    """impl on every backend (its checks name a CPU tensor), fake for tracing;
    returns the op's overload."""
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cupy_act::{name}", fake, lib=_lib)
    return getattr(torch.ops.cupy_act, name).default


def _forward_impl(x, weight, bias, divisor, negative_slope, stride, padding, dilation, tf32,
                  with_mask):  # fmt: skip
    """The fused forward, its launch kept per kind of call (``_checked``, as
    eager keeps it): what a compiled graph calls."""
    fname = _OP + "_forward"
    _check_fused(fname, "input", x, (("weight", weight), ("bias", bias)))
    c = _checked(x, weight, bias, divisor, negative_slope, stride, padding, dilation, "fused")
    if not c.fusable[1 if tf32 else 0]:
        raise ValueError(f"{fname}: {c.g or 'the padding'} is beyond the fused forward kernel")
    y, mask = _kept_forward(
        x, weight, bias, c.g, c.launches, float(divisor), float(negative_slope), tf32, with_mask
    )
    return y, x.new_empty(0, dtype=torch.uint8) if mask is None else mask


def _forward_fake(x, weight, bias, divisor, negative_slope, stride, padding, dilation, tf32,
                  with_mask):  # fmt: skip
    g = _conv.geometry(FNAME, x.shape, weight.shape, stride, padding, dilation)
    fmt = torch.channels_last if _impl.is_channels_last(x) else torch.contiguous_format
    y = torch.empty(g.out_shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    n = mask_nbytes(y.numel()) if with_mask else 0
    return y, x.new_empty(n, dtype=torch.uint8)


def _wgrad_impl(x, gy, mask, weight_shape, with_bias, divisor, negative_slope, stride, padding,
                dilation, tf32):  # fmt: skip
    fname = _OP + "_wgrad"
    _check_fused(fname, "x", x, (("gy", gy),))
    check_divisor(divisor, fname)
    check_real(negative_slope, "negative_slope", fname)
    g = _conv.geometry(fname, x.shape, weight_shape, stride, padding, dilation)
    _check_shape(fname, "gy", gy, g.out_shape)
    _impl.check_mask(fname, mask, gy)
    _geometry_fits(fname, g, x.dtype, tf32, _conv.wgrad_fits, "weight-gradient")
    return fused_wgrad(
        x, gy, mask, weight_shape, with_bias, divisor, negative_slope, stride, padding,
        dilation, tf32,
    )  # fmt: skip


def _wgrad_fake(x, gy, mask, weight_shape, with_bias, *args):
    gw = torch.empty(tuple(weight_shape), dtype=x.dtype, device=x.device)
    return gw, x.new_empty(weight_shape[0] if with_bias else 0)


def _dgrad_impl(gy, mask, weight, x_shape, channels_last, divisor, negative_slope, stride,
                padding, dilation, tf32):  # fmt: skip
    fname = _OP + "_dgrad"
    _check_fused(fname, "gy", gy, (("weight", weight),))
    check_divisor(divisor, fname)
    check_real(negative_slope, "negative_slope", fname)
    g = _conv.geometry(fname, x_shape, weight.shape, stride, padding, dilation)
    _check_shape(fname, "gy", gy, g.out_shape)
    _impl.check_mask(fname, mask, gy)
    _geometry_fits(fname, g, gy.dtype, tf32, _conv.dgrad_fits, "input-gradient")
    return fused_dgrad(
        gy, mask, weight, x_shape, channels_last, divisor, negative_slope, stride, padding,
        dilation, tf32,
    )  # fmt: skip


def _dgrad_fake(gy, mask, weight, x_shape, channels_last, *args):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(tuple(x_shape), dtype=gy.dtype, device=gy.device, memory_format=fmt)


forward_op = _register("conv2d_div_leaky_relu_forward", _forward_impl, _forward_fake)
wgrad_op = _register("conv2d_div_leaky_relu_wgrad", _wgrad_impl, _wgrad_fake)
dgrad_op = _register("conv2d_div_leaky_relu_dgrad", _dgrad_impl, _dgrad_fake)


def _save(ctx, x, weight, bias, mask, slope, divisor, stride, padding, dilation, tf32, g) -> None:
    """What the backward reads: x, the weight and the mask, the scalars and
    the geometry ``g``."""
    ctx.no_mask = False
    ctx.save_for_backward(x, weight, mask)
    ctx.args = (slope, divisor, stride, padding, dilation, _impl.is_channels_last(x), tf32)
    ctx.bias = None if bias is None else [bias.shape[0]]
    ctx.g = g


def _setup(ctx, inputs, output):
    x, weight, bias, divisor, slope, stride, padding, dilation, tf32, with_mask = inputs
    if not with_mask:
        ctx.no_mask = True
        return
    g = _conv.geometry(FNAME, x.shape, weight.shape, stride, padding, dilation)
    _save(ctx, x, weight, bias, output[1], slope, divisor, stride, padding, dilation, tf32, g)
    ctx.mark_non_differentiable(output[1])


def _grads(ctx, gy, eager: bool) -> tuple:
    """(gx, gw, gb): the weight and bias gradients from the fused
    weight-gradient kernel (dy, the mask and x) and the input gradient from
    the fused input-gradient kernel (dy, the mask and the weight) where they
    apply (``_route``); the rest from the mask backward of the elementwise op
    (dz) and PyTorch's convolution backward. Where both kernels apply, dz is
    never in memory. ``eager``: the kernels' functions run them, else the
    custom ops (torch.compile, torch.func)."""
    if ctx.no_mask:
        raise RuntimeError(f"{FNAME}: this fused call ran without a mask; it has no backward")
    x, w, mask = ctx.saved_tensors
    slope, divisor, stride, padding, dilation, cl, tf32 = ctx.args
    need = ctx.needs_input_grad
    with_bias = ctx.bias is not None and need[2]
    gx = gw = gb = None
    wgrad_fits, dgrad_fits = _route(x, w, ctx.g, stride, padding, dilation, tf32)
    fused_w = (need[1] or with_bias) and wgrad_fits
    mask_backward = _impl.backward if eager else _library.backward_op
    if fused_w:
        args = (x, gy, mask, list(w.shape), with_bias, divisor, slope, stride, padding, dilation)
        gw, gb = fused_wgrad(*args, tf32, ctx.g) if eager else wgrad_op(*args, tf32)
        gw, gb = gw if need[1] else None, gb if with_bias else None
    if fused_w or not (need[1] or with_bias):  # only the input gradient left, if any
        if need[0] and dgrad_fits:
            args = (gy, mask, w, list(x.shape), cl, divisor, slope, stride, padding, dilation)
            gx = fused_dgrad(*args, tf32, ctx.g) if eager else dgrad_op(*args, tf32)
        elif need[0]:
            d = mask_backward(gy, mask, "div_leaky_relu", slope, divisor, cl)
            gx = torch.ops.aten.convolution_backward(
                d, x, w, None, stride, padding, dilation, False, [0, 0], 1, [True, False, False]
            )[0]
        return gx, gw, gb
    # d loss / d (conv + bias): the mask backward of the elementwise op.
    d = mask_backward(gy, mask, "div_leaky_relu", slope, divisor, cl)
    out_mask = [need[0], need[1], with_bias]
    return torch.ops.aten.convolution_backward(
        d, x, w, ctx.bias, stride, padding, dilation, False, [0, 0], 1, out_mask
    )


def _backward(ctx, gy, gmask):
    """fused_op's backward (``_grads`` through the custom ops)."""
    return *_grads(ctx, gy, False), *(None,) * 7


class _FusedEager(torch.autograd.Function):
    """fused_op where it trains in eager mode: the same forward, saved tensors
    and backward, calling the kernels' functions instead of the custom ops,
    whose dispatch and autograd wrapping cost about 55 us of host time per
    forward and 50 per backward (H200 host, ``scripts/overhead.py --conv``).
    torch.compile, torch.func transforms and forward-mode AD take fused_op.
    The backward is not differentiable again (fused_op's is not either).
    ``c``: the call's ``_checked`` (geometry, hyper-parameters, kept launches)."""

    @staticmethod
    def forward(ctx, x, weight, bias, divisor, slope, tf32, c):
        y, mask = _kept_forward(x, weight, bias, c.g, c.launches, divisor, slope, tf32, True)
        stride, padding, dilation = c.spd
        _save(ctx, x, weight, bias, mask, slope, divisor, stride, padding, dilation, tf32, c.g)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        return *_grads(ctx, gy, True), *(None,) * 4


class _FusedCompiled(torch.autograd.Function):
    """The fused block where torch.compile traces a training call: the
    forward op (``forward_op``, its launch kept per kind of call) and the
    backward's ops (``_grads``), which Dynamo traces into the graphs; the
    Function itself costs nothing in the compiled code."""

    @staticmethod
    def forward(ctx, x, weight, bias, divisor, slope, stride, padding, dilation, tf32, g):
        # (``g``, the call's geometry, comes in: a traced Function may not
        # write the geometries' table, as working it out here might)
        y, mask = forward_op(x, weight, bias, divisor, slope, stride, padding, dilation, tf32, True)
        _save(ctx, x, weight, bias, mask, slope, divisor, stride, padding, dilation, tf32, g)
        return y

    @staticmethod
    def backward(ctx, gy):
        return *_grads(ctx, gy, False), *(None,) * 7


# Function.apply's Python wrapper binds no arguments here (no setup_context)
# and, outside functorch transforms (which take fused_op), only unwraps dead
# functorch wrappers before the C++ apply: that, inline, on the three tensors
# (about 2 us less per forward; functional.py does the same for the
# activations). Without the private API, the public apply.
try:
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    _fused_eager_apply = super(torch.autograd.Function, _FusedEager).apply

    def _train(x, weight, bias, divisor, slope, tf32, c) -> Tensor:
        b = None if bias is None else _unwrap_if_dead(bias)
        return _fused_eager_apply(
            _unwrap_if_dead(x), _unwrap_if_dead(weight), b, divisor, slope, tf32, c
        )
except AttributeError:  # pragma: no cover - depends on the torch version
    _train = _FusedEager.apply


_routes: dict[tuple, tuple[bool, bool]] = {}


def _route(x: Tensor, w: Tensor, g, stride, padding, dilation, tf32: bool) -> tuple[bool, bool]:
    """(``_wgrad_fits``, ``_dgrad_fits``) of a backward, kept per geometry,
    dtype, device, layout and setting of ``FUSED_WGRAD`` and ``FUSED_DGRAD``
    (under torch.compile: worked out each time)."""
    cl = _impl.is_channels_last(x)
    key: tuple | None = None
    r = None
    if not torch.compiler.is_compiling():  # (a traced backward may not write the table)
        try:
            key = (g, x.dtype, x.device, tf32, cl, FUSED_WGRAD, FUSED_DGRAD)
            r = _routes.get(key)
        except TypeError:  # unhashable (symbolic) sizes
            key = r = None
    if r is None:
        r = (
            _wgrad_fits(x, w, stride, padding, dilation, tf32, g),
            _dgrad_fits(x, w, stride, padding, dilation, tf32, g),
        )
        if key is not None:
            if len(_routes) >= 256:
                _routes.clear()
            _routes[key] = r
    return r


def _wgrad_fits(x: Tensor, w: Tensor, stride, padding, dilation, tf32: bool, g=None) -> bool:
    """Whether the fused weight-gradient kernel takes this geometry (the
    forward's kernel ran, so the dtype and device are its), per ``FUSED_WGRAD``;
    ``g``: the geometry, if worked out already."""
    if FUSED_WGRAD is False:
        return False
    if g is None:
        g = _conv.geometry(FNAME, x.shape, w.shape, stride, padding, dilation)
    n_passes = _conv.passes(_impl.DTYPE_NAMES[x.dtype], "tf32" if tf32 else "fp32")
    if not _conv.wgrad_fits(g, n_passes):
        return False
    if FUSED_WGRAD is True:
        return True
    sm = _conv.kernels._sm(x.device.index) if x.is_cuda else 0
    chunks = _conv.wgrad_chunks(g, n_passes)
    return _wgrad_default(chunks, n_passes, x.dtype == torch.float32, _impl.is_channels_last(x), sm)


def _wgrad_default(chunks: int, n_passes: int, float32: bool, channels_last: bool, sm: int) -> bool:
    """FUSED_WGRAD None: whether the kernel takes a geometry whose filter depth
    needs ``chunks`` channel chunks (each reads dy and the mask once more), on
    a device of compute capability ``sm`` (9.0: 90; 0 for none)."""
    if channels_last:
        return chunks == 1 and float32
    if sm == 90:
        return chunks <= (4 if n_passes == 1 else 3)
    return chunks == 1


# The fused weight gradient (cuda/conv2d_wgrad.cu); where x needs a gradient
# too, that one still comes from dz (materialized) and cuDNN's data gradient.
# None (the default): where it measures faster than the mask
# backward + cuDNN's weight gradient (_wgrad_default), that is where one
# chunk of input channels holds the whole filter depth (cin * kh * kw <= 72,
# so dy and the mask are read once), except 16-bit channels-last (cuDNN's
# fastest case); on compute capability 9.0 (dy by the copy engine, 3 x 3 at
# stride 1 on warpgroup MMAs), NCHW, up to three chunks, four with one pass
# (measured on float32; 16-bit types take the same one-pass kernel).
# H100, seed shape, backward alone: 0.60-0.63x (float32 NCHW), 0.68-0.82x
# (float32 NHWC), 0.73-0.78x (16-bit NCHW); 16-bit NHWC 1.45-1.48x and
# several chunks 0.9-1.7x (docs/conv-gradients.md).
# H200, backward GPU time against the mask backward + cuDNN's weight gradient
# (scripts/conv_bench.py): 2 chunks (16to32) 0.71x "fused", 0.54x
# "fused_tf32"; 3 chunks (stem) 0.70x / 0.45x; 4 chunks (5x5) 1.09x / 0.69x;
# 8 chunks (64to64) 1.70x / 1.38x.
# True: wherever the kernel fits. False: never.
FUSED_WGRAD: bool | None = None


def _dgrad_fits(x: Tensor, w: Tensor, stride, padding, dilation, tf32: bool, g=None) -> bool:
    """Whether the fused input-gradient kernel takes this geometry, per
    ``FUSED_DGRAD``; ``g``: the geometry, if worked out already."""
    if FUSED_DGRAD is False:
        return False
    if g is None:
        g = _conv.geometry(FNAME, x.shape, w.shape, stride, padding, dilation)
    n_passes = _conv.passes(_impl.DTYPE_NAMES[x.dtype], "tf32" if tf32 else "fp32")
    if not _conv.dgrad_fits(g, n_passes):
        return False
    return FUSED_DGRAD is True or _conv.dgrad_groups(g) == 1


# The fused input gradient (cuda/conv2d_dgrad.cu, 3 x 3 filters, stride 1,
# dilation 1, padding <= 2). None (the default): where it measures faster than
# the mask backward + cuDNN's data gradient, that is where one group of 8
# input channels holds them all (each group reads dy again). H100, input
# gradient alone: seed shape (8 channels) 0.31-0.56x float32, 0.57-0.92x
# 16-bit; 16 channels 0.96-1.29x, 64 channels 2.0-3.2x (2026-11-24, c59ae9b;
# docs/conv-gradients.md). True: wherever it fits. False: never.
FUSED_DGRAD: bool | None = None


fused_op.register_autograd(_backward, setup_context=_setup)


def conv2d_div_leaky_relu(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    divisor: float | None = None,
    negative_slope: float = 0.01,
    stride=1,
    padding=0,
    dilation=1,
    algorithm: str = "exact",
    allow_tf32: bool = False,
) -> Tensor:
    """``F.leaky_relu(F.conv2d(input, weight, bias, stride, padding, dilation) / divisor,
    negative_slope)`` with the algorithm named (see the module docstring).

    Args:
        input: (N, Cin, H, W), or (Cin, H, W) unbatched; weight: (Cout, Cin, kH, kW);
            bias: (Cout,) or None, all of one dtype and device (groups = 1, zero
            padding).
        divisor: required (a finite, non-zero number), as ``div_leaky_relu``
            takes it.
        stride, padding, dilation: as ``F.conv2d`` takes them.
        algorithm: "exact" (bit-identical to eager, the default), "channels_last",
            "fused", "fused_tf32" or "auto".
        allow_tf32: lets "auto" pick algorithms with TF32 accuracy
            ("fused_tf32", and "channels_last" while cuDNN may use TF32).
    Returns:
        The output; channels-last where the input is, or for "channels_last".
    Autograd saves a 1-bit mask instead of the convolution's output (and for
    the fused algorithms never materialises that output at all).
    """
    if divisor is None:
        raise TypeError(
            f"{FNAME}() missing required argument 'divisor' (a finite, non-zero number)"
        )
    if isinstance(input, Tensor) and input.dim() == 3:  # unbatched, as F.conv2d takes it
        return conv2d_div_leaky_relu(
            input.unsqueeze(0), weight, bias, divisor, negative_slope, stride, padding, dilation,
            algorithm, allow_tf32,
        ).squeeze(0)  # fmt: skip
    c = _checked(input, weight, bias, divisor, negative_slope, stride, padding, dilation, algorithm)
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if algorithm == "auto":
        # which of (input, weight, bias) ask for a gradient (None: no grad mode, or none)
        grads = None
        if needs_grad:
            grads = (
                input.requires_grad,
                weight.requires_grad,
                bias is not None and bias.requires_grad,
            )
        algorithm = _conv_auto.choose(
            conv2d_div_leaky_relu, input, weight, bias, divisor, negative_slope, stride, c,
            dilation, padding, allow_tf32, grads,
        )  # fmt: skip
    tf32 = algorithm == "fused_tf32"
    if algorithm.startswith("fused") and c.fusable[1 if tf32 else 0]:
        divisor, negative_slope = float(divisor), float(negative_slope)
        compiling = torch.compiler.is_compiling()
        transformed = F._functorch_active() or F._forward_ad_active()
        if needs_grad and not (compiling or transformed):
            return _train(input, weight, bias, divisor, negative_slope, tf32, c)
        spd = [list(v) for v in c.spd]
        if compiling and not transformed:
            if needs_grad:
                return _FusedCompiled.apply(
                    input, weight, bias, divisor, negative_slope, *spd, tf32, c.g
                )
            return forward_op(input, weight, bias, divisor, negative_slope, *spd, tf32, False)[0]
        if needs_grad or compiling:  # (torch.func, forward-mode AD: the custom op)
            return fused_op(input, weight, bias, divisor, negative_slope, *spd, tf32, needs_grad)[0]
        return _kept_forward(
            input, weight, bias, c.g, c.launches, divisor, negative_slope, tf32, False
        )[0]
    cl = algorithm == "channels_last"
    return _unfused(input, weight, bias, divisor, negative_slope, stride, padding, dilation, cl)


# The epilogue under torch.compile where it trains (without a gradient to
# compute it is the activations' traced forward): None (the activations'
# route: traced PyTorch operations, Inductor choosing what to save), a packed
# 1-bit mask in traced operations ((word bits, layout) as _traced.pack takes
# them), or "kernels" (cupy_act's kernel and mask as custom ops).
# set_compile_route("kernels") puts our kernels here too. set_compiled_epilogue
# is the public switch; other packings are for scripts/models.py --models block.
COMPILED_EPILOGUE: str | tuple[int, str] | None = None
COMPILED_EPILOGUES = {"traced": None, "packed": (8, "flat"), "kernels": "kernels"}


def set_compiled_epilogue(epilogue: str) -> str:
    """Choose what the elementwise part of ``conv2d_div_leaky_relu``'s ``"exact"``
    and ``"channels_last"`` algorithms becomes under ``torch.compile`` when it
    trains; returns the previous choice. Dynamo recompiles on a change.

    - ``"traced"`` (the default): PyTorch's operations, as the activations'
      route gives them. Inductor fuses them with what follows (pooling, a next
      layer's elementwise work) and saves one boolean per element, as for
      PyTorch's own block. Never slower than compiled PyTorch.
    - ``"packed"``: traced operations that save a 1-bit mask packed into bytes,
      written by the same kernel as the output. Where the block ends the
      compiled region (its output goes to the loss or leaves the graph, as in
      the seed model) it measured 0.96x compiled PyTorch's forward + backward
      with 1/8 of its saved activation state; where Inductor would fuse the
      block into a following pooling, 1.25x (the output is then written and
      read again). On an H100, ``scripts/models.py --models block``.
    - ``"kernels"``: cupy_act's CUDA epilogue and mask as opaque custom ops
      (the same time and memory as ``"packed"`` on the block alone, equally
      unfusable).

    The fused algorithms are one custom op whatever the choice.
    """
    global COMPILED_EPILOGUE
    if epilogue not in COMPILED_EPILOGUES:
        raise ValueError(
            f"set_compiled_epilogue: epilogue={epilogue!r}; expected one of "
            f"{tuple(COMPILED_EPILOGUES)}"
        )
    names = {v: k for k, v in COMPILED_EPILOGUES.items()}
    previous = names.get(COMPILED_EPILOGUE, str(COMPILED_EPILOGUE))
    COMPILED_EPILOGUE = COMPILED_EPILOGUES[epilogue]
    return previous


def _unfused(x, weight, bias, divisor, slope, stride, padding, dilation, channels_last):
    """PyTorch's convolution, then the fused elementwise epilogue ("exact" and
    "channels_last"); under torch.compile, as ``COMPILED_EPILOGUE`` says."""
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        weight = weight.contiguous(memory_format=torch.channels_last)
    # CPU convolutions add their bias inside the kernel, with other rounding
    # than a separate add: keep it there to stay bit-exact.
    inner = None if x.is_cuda else bias
    pre = torch.nn.functional.conv2d(x, weight, inner, stride, padding, dilation)
    outer = bias if x.is_cuda else None
    how = COMPILED_EPILOGUE
    if not torch.compiler.is_compiling() or how is None or F._compile.kernels:
        return F.div_leaky_relu(pre, divisor, slope, bias=outer)
    d, s = float(divisor), float(slope)
    if how == "kernels":
        return F._compiled("div_leaky_relu", pre, s, d, outer, False, kernels=True)
    return _traced.packed_mask_act(pre, outer, "div_leaky_relu", s, d, *how)


# ---- "auto": time the candidates once per shape ----
