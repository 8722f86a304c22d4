"""BatchNorm followed by an activation, as one module: ``BatchNormAct2d``.

The module is ``nn.BatchNorm2d`` (its constructor arguments, parameters,
buffers and ``state_dict``, its running-statistics semantics: momentum or a
cumulative average, ``num_batches_tracked``, eval with or without tracked
statistics) with ReLU, LeakyReLU or identity applied to the normalized output,
as timm's ``BatchNormAct2d`` does, optionally after adding a residual
(``forward(input, residual)``, a residual block's tail).

On a dense CUDA tensor (NCHW or channels-last, float32 / float16 / bfloat16,
float32 parameters) it runs ``FusedBatchNormAct``, cupy_act's kernels
(``cuda/batchnorm.cu``). Training: the statistics, then normalization,
affine, activation and the 1-bit mask in one pass; the backward reads dy, the
mask and x for its two reductions and again for dx. Eval: one elementwise
pass from the running statistics. ``memory="inplace"`` writes y over x and
keeps only y for the backward (InPlace-ABN). Accurate to float32 (errors
against float64 within twice eager PyTorch's; docs/batchnorm.md), not
bit-equal to PyTorch's kernels, whose reduction order is theirs;
deterministic. Under torch.compile the same kernels run as ``torch.library``
ops where ``set_compiled_batchnorm``'s policy puts them (``_bn_ops``; by
default the in-place mode's modules), and elsewhere PyTorch's operations are
traced, which Inductor fuses. Everywhere else (CPU, float64, other strides,
torch.func, forward-mode AD) the normalization is PyTorch's own
(``nn.BatchNorm2d.forward``), then the residual's addition (PyTorch's) and
the activation cupy_act's, in place on the normalization's fresh output: bit
for bit PyTorch's BatchNorm, addition and activation.

``fuse_batchnorm_act`` swaps timm's ``BatchNormAct2d`` and ``nn.Sequential``
BatchNorm -> ReLU / LeakyReLU pairs for it.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn

from .. import _batchnorm as _bn
from . import _bn_kernels as _K
from . import _bn_ops, _impl, modules
from . import functional as F
from ._bn_graph import set_compiled_folding
from ._bn_ops import set_compiled_batchnorm

__all__ = ["BatchNormAct2d", "set_compiled_batchnorm", "set_compiled_folding"]

ACTS = ("relu", "leaky_relu", "identity")
_ACT_CLASSES = {
    nn.ReLU: "relu",
    modules.ReLU: "relu",
    nn.LeakyReLU: "leaky_relu",
    modules.LeakyReLU: "leaky_relu",
    nn.Identity: "identity",
}


MEMORY = ("default", "inplace")
# torch 2.13 added nn.BatchNorm2d(..., *, bias=True)
_BN_TAKES_BIAS = "bias" in inspect.signature(nn.BatchNorm2d.__init__).parameters


def _invertible(act: str, slope: float) -> bool:
    """Whether the activation's output determines its input (the in-place mode)."""
    return act in _bn.INVERTIBLE and (act != "leaky_relu" or slope > 0)


def _memory_mode(memory, act: str, slope: float, where: str = "BatchNormAct2d") -> str:
    if memory not in MEMORY:
        raise ValueError(f"{where}: memory={memory!r} is not supported; expected one of {MEMORY}")
    if memory == "inplace" and not _invertible(act, slope):
        what = f"leaky_relu with negative_slope={slope}" if act == "leaky_relu" else act
        raise ValueError(
            f"{where}: memory='inplace' needs an invertible activation (identity, or "
            f"leaky_relu with negative_slope > 0), got {what}"
        )
    return memory


def _act_name(act_layer, where: str) -> str:
    """The activation's name (one of ACTS) from a name, an activation class or None."""
    if act_layer is None:
        return "identity"
    if isinstance(act_layer, str):
        name = act_layer.lower().replace("-", "_")
        if name in ACTS:
            return name
    elif act_layer in _ACT_CLASSES:
        return _ACT_CLASSES[act_layer]
    raise ValueError(
        f"{where}: act_layer={act_layer!r} is not supported; expected one of {ACTS}, "
        f"nn.ReLU, nn.LeakyReLU, nn.Identity or None"
    )


def _init_normalization(m: nn.Module, base: type, args: tuple, device, dtype, bias: bool) -> None:
    """``base.__init__`` (nn.BatchNorm2d's or nn.SyncBatchNorm's) with ``bias``:
    torch < 2.13 has no such switch, so the module is made without its bias
    there (``args[3]`` is ``affine``)."""
    if _BN_TAKES_BIAS:
        base.__init__(m, *args, device, dtype, bias=bias)  # type: ignore[misc]
    else:
        base.__init__(m, *args, device, dtype)  # type: ignore[misc]
        if args[3] and not bias:
            m.register_parameter("bias", None)


def _configure(m: nn.Module, act_layer, act_kwargs, memory, where: str) -> None:
    """The activation's and memory mode's attributes of a fused module
    (``act``, ``negative_slope``, ``memory``, ``after_conv``, ``kept_by_zero``),
    checked."""
    m.act = _act_name(act_layer, where)
    kwargs = dict(act_kwargs or {})
    kwargs.pop("inplace", None)
    slope = kwargs.pop("negative_slope", 0.01)
    if kwargs:
        raise ValueError(
            f"{where}: act_kwargs {sorted(kwargs)} not supported; "
            f"accepted: negative_slope (LeakyReLU), inplace"
        )
    if m.act != "leaky_relu" and "negative_slope" in (act_kwargs or {}):
        raise ValueError(
            f"{where}: negative_slope given for act_layer {m.act!r}; it applies to "
            f"'leaky_relu' only"
        )
    m.negative_slope = float(slope)
    m.memory = _memory_mode(memory, m.act, m.negative_slope, where)
    # for the compiled route's policy (set_compiled_batchnorm), which the
    # fusers mark: whether the input is a convolution's output (None:
    # unknown), and whether memory="inplace" was asked and only a zero in the
    # weight kept the default mode
    m.after_conv = None
    m.kept_by_zero = False


def _extra_repr(m: nn.Module, normalization: str) -> str:
    act = f"act={m.act!r}"
    if m.act == "leaky_relu":
        act += f", negative_slope={m.negative_slope}"
    if m.memory != "default":
        act += f", memory={m.memory!r}"
    return f"{normalization}, {act}"


def _check_residual(residual, where: str) -> None:
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError(
            f"{where}: residual must be a torch.Tensor or None, got {type(residual).__name__}"
        )


def _reference_forward(m: nn.Module, normalize, input, residual) -> torch.Tensor:
    """PyTorch's normalization (``normalize``: nn.BatchNorm2d's or
    nn.SyncBatchNorm's forward, with their running statistics), then the
    residual's addition and the activation in place on its fresh output."""
    y = normalize(m, input)
    if residual is not None:  # (as torchvision's blocks write it: out += identity)
        y = y.add_(residual) if residual.shape == y.shape else y + residual
    if m.act == "relu":
        return F.relu(y, inplace=True)
    if m.act == "leaky_relu":
        return F.leaky_relu(y, m.negative_slope, inplace=True)
    return y


def _local_forward(m: nn.Module, input, residual, normalize) -> torch.Tensor:
    """The statistics of this process's batch: the compiled route's ops where
    they take the call, the fused kernels where they apply, else PyTorch's
    ``normalize`` (``_reference_forward``)."""
    if F._is_compiling():
        y = _compiled_forward(m, input, residual)
        if y is not None:
            return y
    tensors = _fused_tensors(m, input)
    if tensors is not None and _residual_fits(m, input, residual):
        return _fused_forward(m, input, tensors, residual)
    return _reference_forward(m, normalize, input, residual)


class BatchNormAct2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by an activation (timm's ``BatchNormAct2d``
    signature, less its dropout layer).

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype,
            bias: as ``nn.BatchNorm2d`` (``momentum=None``: cumulative average;
            ``bias=False``, keyword-only as in torch 2.13: a weight and no
            bias, on any torch version).
        apply_act: False makes the activation the identity.
        act_layer: ``"relu"``, ``"leaky_relu"``, ``"identity"`` (or None), or the
            class ``nn.ReLU`` / ``nn.LeakyReLU`` / ``nn.Identity``.
        act_kwargs: ``{"negative_slope": s}`` for LeakyReLU (default 0.01);
            ``inplace`` there is ignored (the activation always writes over the
            normalization's own output, which nothing else holds).
        inplace: accepted for timm's signature; see ``act_kwargs``.
        memory: ``"default"`` saves x (as PyTorch's BatchNorm does) and a 1-bit
            mask for the backward. ``"inplace"`` (InPlace-ABN, Rota Bulo et al.,
            CVPR 2018) writes y over the input and saves only y: the backward
            recovers the activation's input and the normalized x by inverting
            the activation and the affine transform. It needs an invertible
            activation (identity, or LeakyReLU with a positive slope) and no
            zero in ``weight`` (such a channel's gradients come out NaN), and
            it costs accuracy in the gradients where ``|bias| / |weight|`` is
            large (docs/batchnorm.md states the bound). The input must not be
            used by anything else (a convolution's output is the case it is
            made for); it holds y after the call where the fused kernels run
            (CUDA) and is left alone elsewhere.

    The ``state_dict`` is ``nn.BatchNorm2d``'s: weights load either way.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer=nn.ReLU,
        act_kwargs: dict | None = None,
        inplace: bool = True,
        device=None,
        dtype=None,
        memory: str = "default",
        *,
        bias: bool = True,
    ) -> None:
        args = (num_features, eps, momentum, affine, track_running_stats)
        _init_normalization(self, nn.BatchNorm2d, args, device, dtype, bias)
        _configure(self, act_layer if apply_act else None, act_kwargs, memory, "BatchNormAct2d")

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``act(bn(input))``, or ``act(bn(input) + residual)`` (the residual
        block's tail, apex's ``bn_add_relu``: one pass, and the backward
        returns the residual's gradient too)."""
        _check_residual(residual, "BatchNormAct2d")
        return _local_forward(self, input, residual, nn.BatchNorm2d.forward)

    def extra_repr(self) -> str:
        return _extra_repr(self, super().extra_repr())


# The fused CUDA kernels where they apply (False: always PyTorch's
# normalization, then our activation; for measurement), and on channels-last
# inputs (H100, 32 x 32 x 256 x 256 forward + backward: float32 0.81 ms
# against PyTorch's 1.22, bfloat16 0.55 against 1.52; scripts/bn_bench.py).
FUSED = True
FUSED_CHANNELS_LAST = True
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Tensors(NamedTuple):
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None


def _tensors(m: nn.BatchNorm2d) -> _Tensors:
    """The module's parameters and buffers. On a BatchNormAct2d itself they are
    read from its dictionaries, where ``nn.Module.__getattr__`` finds them
    (0.04 against 0.56 us each on a 2-core CPU machine, five per call); a
    subclass may define them otherwise (parametrizations make one), and a
    deleted one must raise as PyTorch's forward would, so those take getattr."""
    if type(m) is BatchNormAct2d:
        p, b = m._parameters, m._buffers
        try:
            return _Tensors(p["weight"], p["bias"], b["running_mean"], b["running_var"],
                            b["num_batches_tracked"])  # fmt: skip
        except KeyError:
            pass
    return _Tensors(m.weight, m.bias, m.running_mean, m.running_var, m.num_batches_tracked)


def _fused_tensors(m: nn.Module, x: torch.Tensor, synced: bool = False) -> _Tensors | None:
    """The module's tensors where the fused kernels apply, else None (then
    ``nn.BatchNorm2d.forward`` runs, which raises PyTorch's own error for
    what it refuses): a dense 4-D CUDA tensor outside torch.compile,
    torch.func transforms and forward-mode AD (checked before the module's
    dictionaries are read, which tracing need not see), and every tensor the
    kernels index checked against it (``_check_channels``, ``_kernel_tensors``).
    ``synced``: statistics over a process group, where one value per channel
    (or none) in this process is allowed."""
    if not (FUSED and _impl.on_gpu(x) and x.dim() == 4 and x.dtype in _FUSED_DTYPES):
        return None
    if F._is_compiling() or F._functorch_active() or F._forward_ad_active():
        return None
    t = _tensors(m)
    c = x.shape[1]
    mean, var = _statistics_passed(m, t, c)
    if not _kernel_tensors(x, t, mean, var, m.training and m.track_running_stats):
        return None
    per_channel = x.numel() // max(c, 1)
    least = 1 if _batch_statistics(m, t.running_mean) else 0
    if (per_channel <= least and not synced) or c > 65535:
        return None  # (one value per channel in training: PyTorch's path raises its
        # error; the reduction's grid has a row of blocks per channel)
    if x.is_contiguous() or (FUSED_CHANNELS_LAST and _impl.is_channels_last(x)):
        return t
    return None


def _statistics_passed(m: BatchNormAct2d, t: _Tensors, c: int) -> tuple:
    """(running_mean, running_var) as F.batch_norm is given them (updated or
    used; None where not), as nn.BatchNorm2d.forward decides, checked against
    the ``c`` channels with the parameters (``_check_channels``)."""
    passed = not m.training or m.track_running_stats
    mean, var = (t.running_mean, t.running_var) if passed else (None, None)
    _check_channels(c, m.training, mean, var, t.weight, t.bias)
    return mean, var


def _like(r: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether r has x's shape, dtype and device."""
    return r.shape == x.shape and r.dtype == x.dtype and r.device == x.device


def _check_channels(c: int, training: bool, mean, var, weight, bias) -> None:
    """RuntimeError, as ATen's batch_norm raises it (same order and words),
    where a tensor the kernels index per channel does not hold ``c``
    elements, or eval mode lacks a running statistic it normalizes with."""
    for name, t in (("running_mean", mean), ("running_var", var)):
        if t is not None:
            if t.numel() != c:
                raise RuntimeError(f"{name} should contain {c} elements not {t.numel()}")
        elif not training and (mean is not None or var is not None):
            return  # (one of the two: nn.BatchNorm2d's path raises its ValueError)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.numel() != c:
            raise RuntimeError(f"{name} should contain {c} elements not {t.numel()}")


def _kernel_tensors(x: torch.Tensor, t: _Tensors, mean, var, counts: bool) -> bool:
    """Whether the kernels can take the module's tensors as they are: float32,
    dense (a 1-D row per channel), on x's device; both running statistics or
    neither; an int64 ``num_batches_tracked`` of one element there where the
    kernels count (``counts``). Otherwise PyTorch's path takes them (it
    accepts strided parameters and raises for the rest)."""
    dev = x.device
    if (mean is None) != (var is None):
        return False
    for p in (t.weight, t.bias, mean, var):
        if p is not None and (p.dtype != torch.float32 or p.device != dev or not p.is_contiguous()):
            return False
    count = t.num_batches_tracked
    if counts and count is not None:
        if count.dtype != torch.int64 or count.device != dev or count.numel() != 1:
            return False
    return True


def _compiled_forward(m: BatchNormAct2d, x: torch.Tensor, residual) -> torch.Tensor | None:
    """Under torch.compile: ``_bn_ops.BatchNormActFunction`` over the
    ``cupy_act::batchnorm_act`` ops (the forward updating the running
    statistics) where the policy puts it (``_bn_ops.takes``) and the kernels
    take the call in any layout, else None (then PyTorch's operations,
    traced). The momentum's cumulative average (``momentum=None``) divides
    by the count, a tensor: traced."""
    zero = getattr(m, "kept_by_zero", False)  # (modules pickled before the mark)
    if not (_bn_ops.takes(m.after_conv, m.memory, zero) and _impl.on_gpu(x) and x.dim() == 4):
        return None
    if x.dtype not in _FUSED_DTYPES or x.shape[1] > 65535:
        return None
    if residual is not None and not _like(residual, x):
        return None
    if residual is x:  # (Dynamo traces no autograd.Function given one tensor twice)
        return None
    t = _tensors(m)
    c = x.shape[1]
    mean, var = _statistics_passed(m, t, c)
    batch = _batch_statistics(m, t.running_mean)
    update = m.training and m.track_running_stats and mean is not None
    if not _kernel_tensors(x, t, mean, var, False) or (update and m.momentum is None):
        return None
    if (batch and x.numel() // max(c, 1) <= 1) or (not batch and (mean is None or var is None)):
        return None  # (PyTorch's path raises its error)
    if m.training and m.track_running_stats and t.num_batches_tracked is not None:
        t.num_batches_tracked.add_(1)
    w, b = t.weight, t.bias
    grad = torch.is_grad_enabled() and any(
        v is not None and v.requires_grad for v in (x, w, b, residual)
    )
    y, _ = _bn_ops.BatchNormActFunction.apply(
        x, w, b, residual, None if batch else mean, None if batch else var, float(m.eps),
        m.act, m.negative_slope, not batch, m.memory == "inplace", grad,
        mean if update else None, var if update else None,
        float(m.momentum) if update else 0.0,
    )  # fmt: skip
    return y


def _residual_fits(m: BatchNormAct2d, x: torch.Tensor, residual) -> bool:
    """Whether the kernels take ``residual`` with x (None, or x's shape, dtype
    and device; in the in-place mode not x's storage, which y overwrites
    while the backward still reads the residual). Else PyTorch's path adds it
    (broadcasting, or raising, as ``out += residual`` would)."""
    if residual is None:
        return True
    if not _like(residual, x):
        return False
    if m.memory == "inplace" and x.numel():  # (empty tensors share no bytes)
        return residual.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    return True


def _fusable(m: BatchNormAct2d, x: torch.Tensor) -> bool:
    """Whether the fused kernels apply (``_fused_tensors``)."""
    return _fused_tensors(m, x) is not None


def _batch_statistics(m: nn.BatchNorm2d, running_mean) -> bool:
    """Whether the forward normalizes with the batch's statistics (as
    ``nn.BatchNorm2d.forward`` decides), else with the running ones."""
    return m.training or running_mean is None


def _fused_forward(m: BatchNormAct2d, x: torch.Tensor, t: _Tensors, residual) -> torch.Tensor:
    """nn.BatchNorm2d.forward's running-statistics bookkeeping, then the kernels."""
    return _apply_fused(x, *_fused_args(m, x, t, residual))


def _fused_args(m: nn.Module, x: torch.Tensor, t: _Tensors, residual) -> tuple:
    """FusedBatchNormAct's arguments after x: (weight, bias, residual,
    running_mean, running_var, count, factor, eps, mode), from nn.BatchNorm2d's
    running-statistics bookkeeping (``num_batches_tracked`` incremented here
    or by the kernels, ``count``; the cumulative average's factor)."""
    factor = 0.0 if m.momentum is None else m.momentum
    batch = _batch_statistics(m, t.running_mean)
    count = None  # num_batches_tracked where the kernels increment it
    if m.training and m.track_running_stats and t.num_batches_tracked is not None:
        if m.momentum is None:  # cumulative moving average: the factor needs the count now
            t.num_batches_tracked.add_(1)
            factor = 1.0 / float(t.num_batches_tracked)
        else:
            count = t.num_batches_tracked
    # running statistics: updated (training) or used (eval)
    mean, var = t.running_mean, t.running_var
    if batch and not (m.training and m.track_running_stats):
        mean = var = None
    w, b = t.weight, t.bias
    grad = torch.is_grad_enabled() and (
        x.requires_grad
        or (w is not None and w.requires_grad)
        or (b is not None and b.requires_grad)
        or (residual is not None and residual.requires_grad)
    )
    mode = _K.Mode(m.act, m.negative_slope, not batch, m.memory == "inplace", grad)
    if residual is not None:
        residual = _K.arranged(residual, _K.layout_of(x))
    return w, b, residual, mean, var, count, float(factor), float(m.eps), mode


class FusedBatchNormAct(torch.autograd.Function):
    """BatchNorm (+ residual) + activation in cupy_act's kernels (cuda/batchnorm.cu).

    Default mode: saves x, the mean and invstd used and the 1-bit mask. In
    place: writes y over x (marked dirty) and saves y, the mean and invstd
    (and the residual, which the inversion subtracts); the backward recovers
    the activation's input and xhat by inverting the activation and the
    affine transform. Gradients for x, weight, bias and the residual; no
    double backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, count, factor, eps,
                mode: _K.Mode):  # fmt: skip
        out = x if mode.inplace else None
        y, stats, mask, s = _K.forward(
            x, weight, bias, residual, running_mean, running_var, count, factor, eps, mode, out
        )
        if mode.inplace:
            ctx.mark_dirty(x)
        kept = residual if mode.inplace else None
        ctx.save_for_backward(y if mode.inplace else x, weight, bias, stats, mask, kept)
        ctx.args = (s, mode)
        return y

    @staticmethod
    def backward(ctx, gy):
        # (no graph to record: the kernels' outputs are plain tensors. With
        # create_graph, once_differentiable's wrapper says so if they are
        # differentiated again; without, it would only cost a no_grad block)
        if torch.is_grad_enabled():
            return _backward_once(ctx, gy)
        return _backward(ctx, gy)


def _backward(ctx, gy):
    src, weight, bias, stats, mask, residual = ctx.saved_tensors
    s, mode = ctx.args
    needs = ctx.needs_input_grad
    dx, gw, gb, gr = _K.backward(
        src, gy, mask, weight, bias, stats, residual, s, mode, needs[1], needs[2], needs[3]
    )
    return dx, gw, gb, gr, None, None, None, None, None, None


_backward_once = torch.autograd.function.once_differentiable(_backward)


# Function.apply's Python wrapper (argument binding, functorch unwrapping) is
# not needed where _fusable holds (no transform active); its C++ apply is
# called directly, with the public apply as the fallback.
try:
    _apply_fused = super(torch.autograd.Function, FusedBatchNormAct).apply
except AttributeError:  # pragma: no cover - depends on the torch version
    _apply_fused = FusedBatchNormAct.apply
