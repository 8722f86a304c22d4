"""The fused BatchNorm + activation as operators that compiled graphs call.

    cupy_act::batchnorm_act(x, weight?, bias?, residual?, running_mean?, running_var?,
                            eps, act, slope, evaluate, from_output, grad, post?=None,
                            update_mean!?=None, update_var!?=None, momentum=0.0)
        -> (y, stats, mask)
    cupy_act::batchnorm_act_backward(src, dy, mask, weight?, bias?, stats, residual?,
                                     act, slope, evaluate, from_output,
                                     need_weight, need_bias, need_residual)
        -> (dx, grad_weight, grad_bias, grad_residual)

Registered through ``torch.library.Library`` (``define``, ``impl``, a fake
kernel each): the dispatcher calls the implementation directly, without
``custom_op``'s per-call Python layers. The autograd formula is
``BatchNormActFunction``, an ``autograd.Function`` over the two ops,
which Dynamo traces into the forward and backward graphs; registered on the
op itself (``torch.library.register_autograd``) it would be a Python kernel
that every call of the op in a compiled graph passes through (measured:
``autograd_impl`` -> ``forward_no_grad`` -> the implementation, about 4.5 us
a call on a 2-core CPU host, 2026-11-29), where the Function costs nothing
after tracing.

y is a new tensor in both memory modes. ``from_output`` (the in-place
mode) makes autograd save y instead of x (and the residual, which the
inversion subtracts), so x, typically a convolution's output, dies after
the call: InPlace-ABN's saving without mutating x. A training forward
updates the running statistics it is given as ``update_mean`` and
``update_var``, mutable arguments, in the kernel that finishes the
statistics, as the eager path does: the same bits. A separate mutating op
after the forward cost a launch per module, 0.12 ms of a 17.4 ms
cspdarknet53 step (H200, 2026-11-29). Functionalization wraps such a call in
``auto_functionalized`` and Inductor's reinplacing hands the op the
module's own buffers, no copies; ``_bn_graph`` looks through the wrapper.

Layout: tagged ``flexible_layout`` (where torch has the tag), so Inductor
hands the op its tensors in the layout it chose (channels-last after its
convolutions) instead of copying them to the traced strides. Each op walks a
dense channels-last input channels-last and anything else in C order
(copying what is neither), and every output's size depends on the input's
shape alone: the fake kernels size them for whatever layout arrives. Under
Inductor, each op's own lowering (``_bn_lowering``) asks for dy and the
residual in the first input's order, and the backward reads a channel slice
of dy where it lies (``_bn_kernels.skipped``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _batchnorm as _bn
from . import _bn_graph, _bn_lowering, _impl
from . import _bn_kernels as _K

_FLEXIBLE = tuple(t for t in (getattr(torch.Tag, "flexible_layout", None),) if t is not None)
_F32 = torch.float32
_DTYPES = (_F32, torch.float16, torch.bfloat16)
_ACTS = tuple(_bn.ACTS)

_lib = torch.library.Library("cupy_act", "FRAGMENT")
_lib.define(
    "batchnorm_act(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, "
    "Tensor? running_mean, Tensor? running_var, float eps, str act, float slope, "
    "bool evaluate, bool from_output, bool grad, Tensor? post=None, "
    "Tensor(a!)? update_mean=None, Tensor(b!)? update_var=None, float momentum=0.0) "
    "-> (Tensor, Tensor, Tensor)",
    tags=_FLEXIBLE,
)
_lib.define(
    "batchnorm_act_backward(Tensor src, Tensor dy, Tensor mask, Tensor? weight, Tensor? bias, "
    "Tensor stats, Tensor? residual, str act, float slope, bool evaluate, bool from_output, "
    "bool need_weight, bool need_bias, bool need_residual) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=_FLEXIBLE,
)

_FWD = "cupy_act::batchnorm_act"
_BWD = "cupy_act::batchnorm_act_backward"


def _fail(fname: str, what: str) -> None:
    raise ValueError(f"{fname}: {what}")


def _check_x(fname: str, name: str, x) -> None:
    if isinstance(x, Tensor) and not _impl.on_gpu(x) and x.device.type != "meta":
        raise TypeError(f"{fname}: {name} is on {x.device}; the kernels take CUDA tensors")
    if not isinstance(x, Tensor) or x.dim() != 4 or x.dtype not in _DTYPES:
        got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        _fail(fname, f"{name} must be a 4-D float32 / float16 / bfloat16 tensor, got {got}")
    if x.shape[1] > 65535:
        _fail(fname, f"{name} has {x.shape[1]} channels; the kernels take at most 65535")


def _check_channels(fname: str, x: Tensor, names: tuple, *tensors) -> None:
    """Each of ``tensors`` (named ``names``) None or a per-channel float32
    tensor of x's channels on x's device."""
    c, dev = x.shape[1], x.get_device()
    for name, t in zip(names, tensors):
        if t is None:
            continue
        # (get_device: an int, cheaper than comparing devices; -1 for every
        # device but CUDA, where the devices themselves are compared)
        if t.dtype is _F32 and t.shape == (c,) and t.get_device() == dev:
            if dev >= 0 or t.device == x.device:
                continue
        _fail(
            fname,
            f"{name} must be a float32 tensor of shape ({c},) on {x.device}, got "
            f"{t.dtype} of shape {tuple(t.shape)} on {t.device}",
        )


def _check_like(fname: str, name: str, t, x: Tensor) -> None:
    """A tensor of x's shape, dtype and device (or None)."""
    if t is None:
        return
    if t.shape != x.shape or t.dtype != x.dtype or t.device != x.device:
        _fail(
            fname,
            f"{name} has shape {tuple(t.shape)}, {t.dtype} on {t.device}; expected "
            f"{tuple(x.shape)}, {x.dtype} on {x.device}",
        )


def _check_mode(fname: str, act: str, slope: float, from_output: bool) -> None:
    if act not in _ACTS:
        _fail(fname, f"act={act!r}; expected one of {_ACTS}")
    if from_output and not (act in _bn.INVERTIBLE and (act != "leaky_relu" or slope > 0)):
        _fail(fname, f"from_output needs an invertible activation, got {act} (slope {slope})")


_FWD_CHANNELS = ("weight", "bias", "running_mean", "running_var", "update_mean", "update_var")


def _check_forward(x, weight, bias, residual, running_mean, running_var, act, slope,
                   evaluate, from_output, post, update_mean=None,
                   update_var=None) -> None:  # fmt: skip
    _check_x(_FWD, "x", x)
    if residual is not None:
        _check_like(_FWD, "residual", residual, x)
        if post is not None:
            _fail(_FWD, "residual and post: the kernels take one or the other")
    if post is not None:
        _check_like(_FWD, "post", post, x)
        if from_output:
            _fail(_FWD, "from_output inverts the op's output, which post would change: pass one")
    _check_mode(_FWD, act, slope, from_output)
    if evaluate:
        if running_mean is None or running_var is None:
            _fail(_FWD, "evaluate=True needs running_mean and running_var")
    else:  # (a training forward reads no running statistics: it updates update_*)
        running_mean = running_var = None
    if (update_mean is None) != (update_var is None):
        _fail(_FWD, "update_mean and update_var go together: pass both or neither")
    if update_mean is not None:
        if evaluate:
            _fail(_FWD, "update_mean and update_var are a training forward's (evaluate=False)")
        for name, t in (("update_mean", update_mean), ("update_var", update_var)):
            if not t.is_contiguous():
                _fail(_FWD, f"{name} must be dense")
    _check_channels(_FWD, x, _FWD_CHANNELS, weight, bias, running_mean, running_var, update_mean,
                    update_var)  # fmt: skip
    if not evaluate and x.numel() // max(x.shape[1], 1) <= 1:
        raise ValueError(
            f"{_FWD}: expected more than 1 value per channel when training, got input size "
            f"{list(x.shape)}"
        )


def _outputs(x: Tensor, act: str, from_output: bool, grad: bool):
    """(y, stats, mask) of the forward's sizes: y in the layout the kernels
    walk x, the statistics of x's channels, the mask (empty where none)."""
    y = torch.empty_like(_impl.arrange(x, _K.layout_of(x)))
    stats = x.new_empty(_bn.stats_doubles(x.shape[1]), dtype=torch.float64)
    words = _K.mask_words(x.numel()) if grad and not from_output and act != "identity" else 0
    return y, stats, x.new_empty(words, dtype=torch.int32)


def _forward_impl(x, weight, bias, residual, running_mean, running_var, eps, act, slope,
                  evaluate, from_output, grad, post=None, update_mean=None, update_var=None,
                  momentum=0.0):  # fmt: skip
    _check_forward(
        x, weight, bias, residual, running_mean, running_var, act, slope, evaluate, from_output,
        post, update_mean, update_var,
    )  # fmt: skip
    if x.numel() == 0:
        return _outputs(x, act, from_output, grad)
    # (None stays None; every tensor in the layout the kernels walk x)
    cl = _K.layout_of(x)
    x = _impl.arrange(x, cl)
    if residual is not None:
        residual = _impl.arrange(residual, cl)
    if post is not None:
        post = _impl.arrange(post, cl)
    if weight is not None:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    # (evaluate: the running statistics read; training: those updated, if any)
    mean, var = (running_mean, running_var) if evaluate else (update_mean, update_var)
    y, stats, mask, _ = _K.forward(
        x, weight, bias, residual, mean, var, None, float(momentum), eps,
        _K.Mode(act, slope, evaluate, from_output, grad), split=True, post=post,
    )  # fmt: skip
    if mask is None:
        mask = x.new_empty(0, dtype=torch.int32)
    return y, stats, mask


def _forward_fake(x, weight, bias, residual, running_mean, running_var, eps, act, slope,
                  evaluate, from_output, grad, post=None, update_mean=None, update_var=None,
                  momentum=0.0):  # fmt: skip
    if _bn_lowering.register():  # (Inductor traces the fakes before it lowers)
        _bn_graph.install()
    _check_forward(
        x, weight, bias, residual, running_mean, running_var, act, slope, evaluate, from_output,
        post, update_mean, update_var,
    )  # fmt: skip
    return _outputs(x, act, from_output, grad)


def _check_backward(src, dy, mask, weight, bias, stats, residual, act, slope, from_output):
    _check_x(_BWD, "src", src)
    _check_like(_BWD, "dy", dy, src)
    _check_channels(_BWD, src, ("weight", "bias"), weight, bias)
    _check_mode(_BWD, act, slope, from_output)
    c = src.shape[1]
    if stats.dtype != torch.float64 or stats.numel() < _bn.stats_doubles(c):
        _fail(_BWD, f"stats must be float64 with {_bn.stats_doubles(c)} elements for {c} channels")
    if from_output:
        _check_like(_BWD, "residual", residual, src)
    elif act != "identity":
        words = _K.mask_words(src.numel())
        if mask.dtype != torch.int32 or mask.numel() < words:
            _fail(_BWD, f"mask must be int32 with {words} words for {src.numel()} elements")
    dev = src.get_device()  # (as _check_channels compares devices)
    for t in (mask, stats):
        if t.get_device() != dev or dev < 0 and t.device != src.device:
            _fail(_BWD, f"every tensor must be on {src.device}, got one on {t.device}")


def _grads_like(src: Tensor, need_weight: bool, need_bias: bool, need_residual: bool):
    dx = torch.empty_like(_impl.arrange(src, _K.layout_of(src)))
    c = src.shape[1]
    gw = src.new_empty(c if need_weight else 0, dtype=torch.float32)
    gb = src.new_empty(c if need_bias else 0, dtype=torch.float32)
    gr = torch.empty_like(dx) if need_residual else src.new_empty(0)
    return dx, gw, gb, gr


def _backward_impl(src, dy, mask, weight, bias, stats, residual, act, slope, evaluate,
                   from_output, need_weight, need_bias, need_residual):  # fmt: skip
    _check_backward(src, dy, mask, weight, bias, stats, residual, act, slope, from_output)
    if src.numel() == 0:
        return _grads_like(src, need_weight, need_bias, need_residual)
    cl = _K.layout_of(src)
    src = _impl.arrange(src, cl)
    if weight is not None:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    dx, gw, gb, gr = _K.backward(
        src, dy, mask if mask.numel() else None, weight, bias, stats, residual,
        _K.shape_of(src, act, cl), _K.Mode(act, slope, evaluate, from_output, True),
        need_weight, need_bias, need_residual,
    )  # fmt: skip
    # (the schema returns four tensors: empty ones for the gradients not asked for)
    if gw is None:
        gw = src.new_empty(0, dtype=torch.float32)
    if gb is None:
        gb = src.new_empty(0, dtype=torch.float32)
    return dx, gw, gb, src.new_empty(0) if gr is None else gr


def _backward_fake(src, dy, mask, weight, bias, stats, residual, act, slope, evaluate,
                   from_output, need_weight, need_bias, need_residual):  # fmt: skip
    _bn_lowering.register()
    _check_backward(src, dy, mask, weight, bias, stats, residual, act, slope, from_output)
    return _grads_like(src, need_weight, need_bias, need_residual)


# (CompositeExplicitAutograd: every backend reaches the checks, which name a
# CPU tensor; no autograd kernel: see the module docstring)
_lib.impl("batchnorm_act", _forward_impl, "CompositeExplicitAutograd")
_lib.impl("batchnorm_act_backward", _backward_impl, "CompositeExplicitAutograd")
torch.library.register_fake(_FWD, _forward_fake, lib=_lib)
torch.library.register_fake(_BWD, _backward_fake, lib=_lib)


class BatchNormActFunction(torch.autograd.Function):
    """y = act(bn(x) [+ residual]) through ``cupy_act::batchnorm_act``
    (updating ``update_mean`` and ``update_var``, the running statistics,
    where given); the backward through ``cupy_act::batchnorm_act_backward``.
    Saves x and the mask, or (``from_output``) y and the residual; the
    statistics either way. For torch.compile, which traces both into its
    graphs."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, eps, act, slope,
                evaluate, from_output, grad, update_mean=None, update_var=None,
                momentum=0.0):  # fmt: skip
        y, stats, mask = torch.ops.cupy_act.batchnorm_act(
            x, weight, bias, residual, running_mean, running_var, eps, act, slope, evaluate,
            from_output, grad, None, update_mean, update_var, momentum,
        )  # fmt: skip
        ctx.mark_non_differentiable(stats)
        ctx.save_for_backward(y if from_output else x, weight, bias, stats, mask,
                              residual if from_output else None)  # fmt: skip
        ctx.args = (act, slope, evaluate, from_output)
        return y, stats

    @staticmethod
    def backward(ctx, gy, gstats):
        src, weight, bias, stats, mask, residual = ctx.saved_tensors
        act, slope, evaluate, from_output = ctx.args
        need = ctx.needs_input_grad
        dx, gw, gb, gr = torch.ops.cupy_act.batchnorm_act_backward(
            src, gy, mask, weight, bias, stats, residual, act, slope, evaluate, from_output,
            need[1], need[2], need[3],
        )  # fmt: skip
        return (
            dx if need[0] else None,
            gw if need[1] else None,
            gb if need[2] else None,
            gr if need[3] else None,
            *(None,) * 11,
        )


# ---- where compiled graphs call the op ----
#
# "inplace" (the default): the BatchNormAct2d in memory="inplace" whose input
# is a convolution's output (the fusers mark them; a module built directly
# counts as one): InPlace-ABN's saving exists only through the op, and there
# it holds; and those the fusers were asked to make in-place but kept in the
# default mode for a zero in the weight alone (kept_by_zero: the
# zero-initialized last BatchNorm of a residual branch, whose output the
# shortcut's add takes, so the op saves its input and mask where Inductor
# keeps the input: cspdarknet53's 23 cost 16 MiB and gave 0.02x of the step);
# the others traced. Measured on an H200 (reduce-overhead, batch 32,
# docs/batchnorm.md): the op at every default-mode module costs 1.06x
# compiled PyTorch's peak in cspdarknet53 (x saved for the op, y for the next
# convolution; Inductor keeps the convolution's output and recomputes the
# rest), and ResNet-50 1.036x the step and 1.84x the peak. "after_conv":
# every module whose input is a convolution's output, either mode;
# "everywhere": every module the op takes; "traced": none (PyTorch's
# operations, as before the op existed).
POLICIES = ("inplace", "after_conv", "everywhere", "traced")
POLICY = "inplace"


def set_compiled_batchnorm(policy: str) -> str:
    """Choose where ``BatchNormAct2d`` runs cupy_act's kernels under
    ``torch.compile``; returns the previous choice. Dynamo recompiles on a
    change.

    - ``"inplace"`` (the default): modules with ``memory="inplace"`` whose
      input is a convolution's output, and those that ``fuse_batchnorm_act``
      or ``fuse_batchnorm_act_fx`` kept in the default mode only for a zero
      in the weight; the rest as PyTorch's operations, which Inductor fuses.
    - ``"after_conv"``: every module whose input is a convolution's output.
    - ``"everywhere"``: every module the kernels take.
    - ``"traced"``: none.
    """
    global POLICY
    if policy not in POLICIES:
        raise ValueError(f"set_compiled_batchnorm: policy={policy!r}; expected one of {POLICIES}")
    previous, POLICY = POLICY, policy
    return previous


def takes(after_conv: bool | None, memory: str, kept_by_zero: bool = False) -> bool:
    """Whether the policy puts the op at a module (``after_conv``: the fusers'
    mark, None where unknown; ``memory``: its memory mode; ``kept_by_zero``:
    the fusers' mark of an in-place module that a zero weight kept default)."""
    # (_bn_graph.FOLD is read here too, under Dynamo's tracing, so that its
    # guards hold it: set_compiled_folding then recompiles, as a change of
    # policy does, instead of reusing a graph compiled the other way)
    if POLICY == "traced" or _bn_graph.FOLD is None:
        return False
    if POLICY == "everywhere":
        return True
    asked = memory == "inplace" or kept_by_zero
    return after_conv is not False and (POLICY == "after_conv" or asked)
