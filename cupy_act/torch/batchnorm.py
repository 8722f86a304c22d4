"""BatchNorm followed by an activation, as one module: ``BatchNormAct2d``.

The module is ``nn.BatchNorm2d`` (its constructor arguments, parameters,
buffers and ``state_dict``, its running-statistics semantics: momentum or a
cumulative average, ``num_batches_tracked``, eval with or without tracked
statistics) with ReLU, LeakyReLU or identity applied to the normalized output,
as timm's ``BatchNormAct2d`` does.

Training on a dense NCHW CUDA tensor runs ``FusedBatchNormAct``, cupy_act's
kernels (``cuda/batchnorm.cu``): statistics, then normalization, affine,
activation and the 1-bit mask in one pass; the backward reads dy, the mask
and x for its two reductions and again for dx. Accurate to float32 (errors
against float64 within twice eager PyTorch's), not bit-equal to PyTorch's
kernels, whose reduction order is theirs; deterministic. Everywhere else
(eval with running statistics, CPU, channels-last unless
``FUSED_CHANNELS_LAST``, float64, torch.compile, torch.func, forward-mode AD)
the normalization is PyTorch's own (``nn.BatchNorm2d.forward``) and the
activation cupy_act's, in place on the normalization's fresh output: bit for
bit PyTorch's pair. Under torch.compile both trace into PyTorch operations,
which Inductor fuses.

``fuse_batchnorm_act`` swaps timm's ``BatchNormAct2d`` and ``nn.Sequential``
BatchNorm -> ReLU / LeakyReLU pairs for it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .. import _batchnorm as _bn
from . import _impl, adopt, modules
from . import functional as F

__all__ = ["BatchNormAct2d", "fuse_batchnorm_act"]

ACTS = ("relu", "leaky_relu", "identity")
_ACT_CLASSES = {
    nn.ReLU: "relu",
    modules.ReLU: "relu",
    nn.LeakyReLU: "leaky_relu",
    modules.LeakyReLU: "leaky_relu",
    nn.Identity: "identity",
}


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


class BatchNormAct2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by an activation (timm's ``BatchNormAct2d``
    signature, less its dropout layer).

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype:
            as ``nn.BatchNorm2d`` (``momentum=None``: cumulative average).
        apply_act: False makes the activation the identity.
        act_layer: ``"relu"``, ``"leaky_relu"``, ``"identity"`` (or None), or the
            class ``nn.ReLU`` / ``nn.LeakyReLU`` / ``nn.Identity``.
        act_kwargs: ``{"negative_slope": s}`` for LeakyReLU (default 0.01);
            ``inplace`` there is ignored (the activation always writes over the
            normalization's own output, which nothing else holds).
        inplace: accepted for timm's signature; see ``act_kwargs``.

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
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.act = _act_name(act_layer if apply_act else None, "BatchNormAct2d")
        kwargs = dict(act_kwargs or {})
        kwargs.pop("inplace", None)
        slope = kwargs.pop("negative_slope", 0.01)
        if kwargs:
            raise ValueError(
                f"BatchNormAct2d: act_kwargs {sorted(kwargs)} not supported; "
                f"accepted: negative_slope (LeakyReLU), inplace"
            )
        if self.act != "leaky_relu" and "negative_slope" in (act_kwargs or {}):
            raise ValueError(
                f"BatchNormAct2d: negative_slope given for act_layer {self.act!r}; "
                f"it applies to 'leaky_relu' only"
            )
        self.negative_slope = float(slope)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _fusable(self, input):
            return _fused_forward(self, input)
        y = super().forward(input)  # PyTorch's normalization and running statistics
        if self.act == "relu":
            return F.relu(y, inplace=True)
        if self.act == "leaky_relu":
            return F.leaky_relu(y, self.negative_slope, inplace=True)
        return y

    def extra_repr(self) -> str:
        act = f"act={self.act!r}"
        if self.act == "leaky_relu":
            act += f", negative_slope={self.negative_slope}"
        return f"{super().extra_repr()}, {act}"


# The fused CUDA kernels where they apply (False: always PyTorch's
# normalization, then our activation; for measurement). Channels-last inputs
# only with FUSED_CHANNELS_LAST: their kernels are correct but slower than
# PyTorch's there (H100, 32 x 32 x 256 x 256 float32: forward + backward 1.74
# against 1.22 ms; NCHW 1.11 against 4.43 ms; scripts/bn_bench.py).
FUSED = True
FUSED_CHANNELS_LAST = False
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fusable(m: BatchNormAct2d, x: torch.Tensor) -> bool:
    """Training statistics on a dense 4-D CUDA tensor, float32 parameters and
    buffers, outside torch.compile, torch.func transforms and forward-mode AD."""
    if not (FUSED and x.is_cuda and x.dim() == 4 and x.dtype in _FUSED_DTYPES):
        return False
    if not (m.training or m.running_mean is None):
        return False  # eval with running statistics: PyTorch's, then our activation
    if F._is_compiling() or F._functorch_active() or F._forward_ad_active():
        return False
    tensors = (m.weight, m.bias, m.running_mean, m.running_var)
    if any(t is not None and (t.dtype != torch.float32 or t.device != x.device) for t in tensors):
        return False
    if x.numel() // max(x.shape[1], 1) <= 1 or x.shape[1] > 65535:
        return False  # (one value per channel: PyTorch's path raises its error; the
        # reduction's grid has a row of blocks per channel)
    return x.is_contiguous() or (FUSED_CHANNELS_LAST and _impl.is_channels_last(x))


def _fused_forward(m: BatchNormAct2d, x: torch.Tensor) -> torch.Tensor:
    """nn.BatchNorm2d.forward's running-statistics bookkeeping, then the kernels."""
    factor = 0.0 if m.momentum is None else m.momentum
    update = m.training and m.track_running_stats and m.running_mean is not None
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        if m.momentum is None:  # cumulative moving average
            factor = 1.0 / float(m.num_batches_tracked)
    running = (m.running_mean, m.running_var) if update else (None, None)
    return FusedBatchNormAct.apply(
        x, m.weight, m.bias, *running, float(factor), float(m.eps), m.act, m.negative_slope
    )


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


class FusedBatchNormAct(torch.autograd.Function):
    """Training BatchNorm + activation in cupy_act's kernels (cuda/batchnorm.cu):
    saves x, the batch mean and invstd and the 1-bit mask. Gradients for x,
    weight and bias; no double backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, factor, eps, act, slope):
        cl = not x.is_contiguous() and _impl.is_channels_last(x)
        n, c = x.numel(), x.shape[1]
        dev = x.device
        inner = x.shape[2] * x.shape[3]
        s = _bn.shape(dev.index, _impl.DTYPE_NAMES[x.dtype], act, cl, n, inner, c)
        y = torch.empty_like(x)
        words = -(-n // 32)
        mask = None if act == "identity" else torch.empty(words, dtype=torch.int32, device=dev)
        mean = torch.empty(c, dtype=torch.float32, device=dev)
        invstd = torch.empty_like(mean)
        partial = torch.empty(c * s.splits * 2, dtype=torch.float64, device=dev)
        buffers = _bn.Buffers(
            x.data_ptr(), 0, y.data_ptr(), _ptr(mask), _ptr(weight), _ptr(bias),
            mean.data_ptr(), invstd.data_ptr(), partial.data_ptr(),
            _ptr(running_mean), _ptr(running_var), 0, 0, 0,
        )  # fmt: skip
        _bn.forward(s, torch.cuda.current_stream(dev).cuda_stream, buffers, factor, eps, slope)
        ctx.save_for_backward(x, weight, mean, invstd, mask)
        ctx.args = (s, slope)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight, mean, invstd, mask = ctx.saved_tensors
        s, slope = ctx.args
        fmt = torch.channels_last if s.channels_last else torch.contiguous_format
        gy = gy.contiguous(memory_format=fmt)
        dev, c = x.device, s.channels
        dx = torch.empty_like(x)
        need_w, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        gw = torch.empty(c, dtype=torch.float32, device=dev) if need_w else None
        gb = torch.empty(c, dtype=torch.float32, device=dev) if need_b else None
        coef = torch.empty(2 * c, dtype=torch.float32, device=dev)
        partial = torch.empty(c * s.splits * 2, dtype=torch.float64, device=dev)
        buffers = _bn.Buffers(
            x.data_ptr(), gy.data_ptr(), dx.data_ptr(), _ptr(mask), _ptr(weight), 0,
            mean.data_ptr(), invstd.data_ptr(), partial.data_ptr(), 0, 0,
            _ptr(gw), _ptr(gb), coef.data_ptr(),
        )  # fmt: skip
        _bn.backward(s, torch.cuda.current_stream(dev).cuda_stream, buffers, slope)
        return dx, gw, gb, None, None, None, None, None, None


def _fused(bn: nn.BatchNorm2d, act: str, slope: float) -> BatchNormAct2d:
    """A BatchNormAct2d holding bn's own parameters and buffers (optimizers and
    other references to them stay valid) and its training flag."""
    new = BatchNormAct2d(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        act_layer=act,
        act_kwargs={"negative_slope": slope} if act == "leaky_relu" else None,
        device="meta",
    )
    new._parameters = dict(bn._parameters)
    new._buffers = dict(bn._buffers)
    new.train(bn.training)
    for name in adopt._HOOK_DICTS:  # (handles from register_*_hook keep working)
        if name in bn.__dict__:
            setattr(new, name, getattr(bn, name))
    return new


def _act_of(module: nn.Module) -> tuple[str, float] | None:
    """(act name, slope) of an exact ReLU / LeakyReLU / Identity module, else None."""
    name = _ACT_CLASSES.get(type(module))
    if name is None:
        return None
    return name, float(getattr(module, "negative_slope", 0.01))


def _is_timm_bn_act(module: nn.Module) -> bool:
    """timm's BatchNormAct2d (found by name and shape: timm is not a dependency)."""
    return (
        type(module).__name__ == "BatchNormAct2d"
        and not isinstance(module, BatchNormAct2d)
        and isinstance(module, nn.BatchNorm2d)
        and isinstance(getattr(module, "act", None), nn.Module)
    )


def fuse_batchnorm_act(model: nn.Module) -> tuple[nn.Module, int]:
    """Swap BatchNorm + activation pairs for ``BatchNormAct2d``, in place.

    Fuses timm's ``BatchNormAct2d`` (whose dropout is the identity) and, in
    every ``nn.Sequential``, an ``nn.BatchNorm2d`` directly followed by an
    ``nn.ReLU`` / ``nn.LeakyReLU`` (or cupy_act's), the activation becoming
    ``nn.Identity``. The new modules hold the old parameters and buffers, so
    ``state_dict`` keys and values and optimizer references do not change.
    Subclasses are left alone (they may override ``forward``), and so is
    ``nn.SyncBatchNorm``, with a warning: its statistics are reduced across
    processes, ``BatchNormAct2d``'s are local, as ``nn.BatchNorm2d``'s.

    Returns:
        ``(model, count)``: the model (a new module when ``model`` itself is
        timm's ``BatchNormAct2d``) and how many pairs were fused.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fuse_batchnorm_act: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if _is_timm_bn_act(model):
        new = _from_timm(model)
        return (new, 1) if new is not None else (model, 0)
    count, synced = 0, []
    for path, parent in list(model.named_modules()):
        children = list(parent._modules.items())
        for i, (name, child) in enumerate(children):
            if isinstance(child, nn.SyncBatchNorm):
                synced.append(f"{path}.{name}" if path else name)
            elif child is not None and _is_timm_bn_act(child):
                new = _from_timm(child)
                if new is not None:
                    parent._modules[name] = new
                    count += 1
            elif isinstance(parent, nn.Sequential) and type(child) is nn.BatchNorm2d:
                if i + 1 < len(children):
                    next_name, next_child = children[i + 1]
                    act = _act_of(next_child) if next_child is not None else None
                    if act is not None and act[0] != "identity":
                        parent._modules[name] = _fused(child, *act)
                        parent._modules[next_name] = nn.Identity()
                        count += 1
    if synced:
        warnings.warn(
            f"fuse_batchnorm_act: left {len(synced)} nn.SyncBatchNorm as they are "
            f"({', '.join(synced[:3])}{', ...' if len(synced) > 3 else ''}): their "
            f"statistics are reduced across processes, BatchNormAct2d's are local",
            stacklevel=2,
        )
    return model, count


def _from_timm(module: nn.Module) -> BatchNormAct2d | None:
    drop = getattr(module, "drop", None)
    act = _act_of(module.act)
    if act is None or (drop is not None and type(drop) is not nn.Identity):
        return None
    return _fused(module, *act)
