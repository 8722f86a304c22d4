"""BatchNorm followed by an activation, as one module: ``BatchNormAct2d``.

The module is ``nn.BatchNorm2d`` (its constructor arguments, parameters,
buffers and ``state_dict``, its running-statistics semantics: momentum or a
cumulative average, ``num_batches_tracked``, eval with or without tracked
statistics) with ReLU, LeakyReLU or identity applied to the normalized output,
as timm's ``BatchNormAct2d`` does. The normalization is PyTorch's own
(``nn.BatchNorm2d.forward``); the activation is cupy_act's, in place on the
normalization's fresh output, so autograd keeps its 1-bit mask and not a
second copy of the activation. Under torch.compile both trace into PyTorch
operations, which Inductor fuses into one kernel forward and one backward.

``fuse_batchnorm_act`` swaps timm's ``BatchNormAct2d`` and ``nn.Sequential``
BatchNorm -> ReLU / LeakyReLU pairs for it. (A fused CUDA kernel for the
normalization and activation together is the next step; the module's
interface and state stay as they are.)
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import adopt, modules
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
