"""Fusing a model's BatchNorm + activation pairs into cupy_act's modules:
``fuse_batchnorm_act`` (module structure: ``nn.Sequential`` pairs, timm's
norm-act layers) and the helpers ``fuse_batchnorm_act_fx`` shares.
``nn.SyncBatchNorm`` pairs become ``SyncBatchNormAct2d``, the rest
``BatchNormAct2d``; ``convert_sync_batchnorm`` synchronizes a fused model.
"""

from __future__ import annotations

import warnings

from torch import nn

from . import adopt
from .batchnorm import _ACT_CLASSES, BatchNormAct2d, _invertible, _memory_mode
from .syncbatchnorm import SyncBatchNormAct2d, _module_like

__all__ = ["fuse_batchnorm_act", "convert_sync_batchnorm"]


def _fused(bn: nn.Module, act: str, slope: float, memory: str, after_conv: bool | None = None,
           kept_by_zero: bool = False) -> BatchNormAct2d | SyncBatchNormAct2d:  # fmt: skip
    """A BatchNormAct2d (a SyncBatchNormAct2d where bn is an nn.SyncBatchNorm,
    with its process group) holding bn's own parameters and buffers
    (optimizers and other references to them stay valid) and its training
    flag, in memory mode ``memory`` (``_mode_for``'s choice); ``after_conv``:
    whether its input is a convolution's output; ``kept_by_zero``: whether
    only a zero in the weight kept it from the in-place mode asked for."""
    sync = isinstance(bn, nn.SyncBatchNorm)
    group = bn.process_group if sync else None
    return _module_like(bn, act, slope, memory, group, after_conv, sync, kept_by_zero)


_FUSABLE = (nn.BatchNorm2d, nn.SyncBatchNorm)  # (exact types: subclasses may override forward)


def _act_of(module: nn.Module) -> tuple[str, float] | None:
    """(act name, slope) of an exact ReLU / LeakyReLU / Identity module, else None."""
    name = _ACT_CLASSES.get(type(module))
    if name is None:
        return None
    return name, float(getattr(module, "negative_slope", 0.01))


def _is_timm_bn_act(module: nn.Module) -> bool:
    """timm's BatchNormAct2d or SyncBatchNormAct (found by name and shape:
    timm is not a dependency)."""
    name = type(module).__name__
    return (
        (name == "BatchNormAct2d" and isinstance(module, nn.BatchNorm2d))
        or (name == "SyncBatchNormAct" and isinstance(module, nn.SyncBatchNorm))
    ) and (
        not isinstance(module, (BatchNormAct2d, SyncBatchNormAct2d))
        and isinstance(getattr(module, "act", None), nn.Module)
    )


def fuse_batchnorm_act(model: nn.Module, memory: str = "default") -> tuple[nn.Module, int]:
    """Swap BatchNorm + activation pairs for ``BatchNormAct2d``, in place.

    Fuses timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (whose dropout
    is the identity) and, in every ``nn.Sequential``, an ``nn.BatchNorm2d``
    or ``nn.SyncBatchNorm`` directly followed by an ``nn.ReLU`` /
    ``nn.LeakyReLU`` (or cupy_act's), the activation becoming
    ``nn.Identity``. Synchronized BatchNorms become ``SyncBatchNormAct2d``
    (their process group kept), the others ``BatchNormAct2d``. The new
    modules hold the old parameters and buffers, so ``state_dict`` keys and
    values and optimizer references do not change. Subclasses are left
    alone (they may override ``forward``).

    ``memory="inplace"`` makes a fused module write over its input (see
    ``BatchNormAct2d``) where that input is known to be a convolution's output
    that nothing else reads: the BatchNorm follows an ``nn.Conv2d`` in an
    ``nn.Sequential``, or is the ``bn`` of timm's ``ConvNormAct`` (whose
    forward is conv, then bn); where the activation is invertible
    (identity, LeakyReLU with a positive slope); and where ``weight`` has no
    zero now (a warning names those that do). The others get the default.

    A warning names what it leaves: no BatchNorm at all, BatchNorms
    not followed by an activation it can see (pairs a model's ``forward``
    makes, as torchvision's ResNets do: ``fuse_batchnorm_act_fx`` fuses
    those), and, with ``memory="inplace"``, pairs kept in the default mode and
    why. A TorchScript or ``torch.compile``'d model is refused (fuse first,
    then compile).

    Returns:
        ``(model, count)``: the model (a new module when ``model`` itself is
        timm's ``BatchNormAct2d``) and how many pairs were fused::

            model, count = fuse_batchnorm_act(model, memory="inplace")
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fuse_batchnorm_act: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    _memory_mode(memory, "identity", 0.0)  # (a bad value raises, naming it)
    adopt._refuse(model, "the model", "fuse_batchnorm_act")
    if _is_timm_bn_act(model):
        act = _timm_act(model)
        return (_fused(model, *act, "default"), 1) if act is not None else (model, 0)
    count = 0
    kept: dict[str, list[str]] = {}
    for path, parent in list(model.named_modules()):
        adopt._refuse(parent, f"submodule {path!r}" if path else "the model", "fuse_batchnorm_act")
        children = list(parent._modules.items())
        for i, (name, child) in enumerate(children):
            if child is not None and _is_timm_bn_act(child):
                act = _timm_act(child)
                if act is not None:
                    fresh = name == "bn" and _is_conv_norm_act(parent)
                    label = f"{path}.{name}" if path else name
                    mode, zero = _mode_for(child, act, memory, fresh, kept, label)
                    parent._modules[name] = _fused(child, *act, mode, fresh or None, zero)
                    count += 1
            elif isinstance(parent, nn.Sequential) and type(child) in _FUSABLE:
                if i + 1 < len(children):
                    next_name, next_child = children[i + 1]
                    act = _act_of(next_child) if next_child is not None else None
                    if act is not None and act[0] != "identity":
                        fresh = i > 0 and isinstance(children[i - 1][1], nn.Conv2d)
                        label = f"{path}.{name}" if path else name
                        mode, zero = _mode_for(child, act, memory, fresh, kept, label)
                        parent._modules[name] = _fused(child, *act, mode, fresh, zero)
                        parent._modules[next_name] = nn.Identity()
                        count += 1
    unfused = [n for n, m in model.named_modules() if type(m) in _FUSABLE]
    _warn_left("fuse_batchnorm_act", kept, count, unfused)
    return model, count


def _names(names: list) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _warn_left(fname: str, kept: dict, count: int, unfused: list) -> None:
    """The fusers' warnings, each naming the modules (to the fuser's caller):
    BatchNorms fused in the default mode where memory="inplace" was asked
    (``kept``: reason -> names), and the ``nn.BatchNorm2d`` /
    ``nn.SyncBatchNorm`` not fused (``unfused``), or none in the model at all."""
    for reason, names in kept.items():
        warnings.warn(
            f"{fname}: {len(names)} BatchNorm(s) ({_names(names)}) keep memory='default', as "
            f"{reason}",
            stacklevel=3,
        )
    if not count and not unfused:
        warnings.warn(f"{fname}: fused nothing: the model has no nn.BatchNorm2d", stacklevel=3)
    elif unfused:
        hint = (
            "fuse_batchnorm_act_fx(model) follows the calls a model's forward makes"
            if fname == "fuse_batchnorm_act"
            else "each must be called at one place and feed only a ReLU or LeakyReLU, or an "
            "addition that feeds one"
        )
        warnings.warn(
            f"{fname}: fused {count} BatchNorm -> activation pair(s); {len(unfused)} "
            f"BatchNorm(s) ({_names(unfused)}) are not followed by an activation it can see "
            f"({hint})",
            stacklevel=3,
        )


def _timm_act(module: nn.Module) -> tuple[str, float] | None:
    """(act, slope) of timm's BatchNormAct2d where it can be fused (its dropout
    the identity), else None."""
    drop = getattr(module, "drop", None)
    if drop is not None and type(drop) is not nn.Identity:
        return None
    return _act_of(module.act)


# Why a pair asked for memory="inplace" keeps the default (the fusers' warnings)
_NOT_INVERTIBLE = (
    "their activation does not determine its input (ReLU; LeakyReLU needs a slope > 0)"
)
_NOT_FRESH = "their input is not a convolution's output that only they read"
_ZEROED = "they have a zero in their weight: the in-place mode cannot recover xhat there"


def _mode_for(bn: nn.BatchNorm2d, act: tuple, memory: str, fresh: bool, kept: dict,
              label: str) -> tuple[str, bool]:  # fmt: skip
    """The fused module's memory mode: "inplace" only where asked for, the
    activation ``act`` ((name, slope)) is invertible, the input is a fresh
    convolution output and the weight has no zero (checked now, once: a later
    exact zero is the in-place mode's documented condition). Where it asked
    and cannot, ``label`` joins ``kept[reason]``. Returns the mode and whether
    the zero alone kept the default (the compiled policy's ``kept_by_zero``)."""
    if memory != "inplace":
        return "default", False
    reason = None
    if not _invertible(*act):
        reason = _NOT_INVERTIBLE
    elif not fresh:
        reason = _NOT_FRESH
    elif bn.weight is not None and bool((bn.weight == 0).any()):
        reason = _ZEROED
    if reason is None:
        return memory, False
    kept.setdefault(reason, []).append(label)
    return "default", reason is _ZEROED


def _is_conv_norm_act(module: nn.Module) -> bool:
    """timm's ConvNormAct (by name and shape): forward is conv, then bn."""
    return type(module).__name__ in ("ConvNormAct", "ConvNormActAa") and isinstance(
        getattr(module, "conv", None), nn.Conv2d
    )


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm`` for a model with fused
    modules: each ``BatchNormAct2d`` (and timm's ``BatchNormAct2d`` that
    ``fuse_batchnorm_act`` would fuse) becomes a ``SyncBatchNormAct2d`` (same
    parameters, buffers, hooks, activation, memory mode and training flag),
    every other BatchNorm PyTorch's ``nn.SyncBatchNorm``, all in
    ``process_group`` (None: the default group). PyTorch's own function
    would turn either into a plain ``nn.SyncBatchNorm``, dropping the
    activation. Returns the model, or the new module where ``module``
    itself is a BatchNorm::

        model = convert_sync_batchnorm(model)  # before DDP, after or before fusing
    """
    if isinstance(module, SyncBatchNormAct2d):
        return module
    if isinstance(module, BatchNormAct2d):
        return _module_like(module, module.act, module.negative_slope, module.memory,
                            process_group, module.after_conv, True,
                            getattr(module, "kept_by_zero", False))  # fmt: skip
    act = _timm_act(module) if _is_timm_bn_act(module) else None
    if act is not None:
        return _module_like(module, *act, "default", process_group, sync=True)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
