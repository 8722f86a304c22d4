"""Adopting cupy_act in an existing model: swap its modules, or route its calls.

- ``replace_activations(model)`` swaps every ``nn.ReLU`` / ``nn.LeakyReLU`` in
  a module tree for ``cupy_act.torch.ReLU`` / ``LeakyReLU`` (same ``inplace``,
  same slope, same training flag, the same hook dictionaries), in place.
- ``activations_mode()`` is a ``TorchFunctionMode``: inside its ``with`` block,
  ``torch.relu``, ``torch.relu_``, ``F.relu``, ``F.relu_``, ``F.leaky_relu``,
  ``F.leaky_relu_`` and ``Tensor.relu`` / ``Tensor.relu_`` run cupy_act's ops,
  for models that call the functional forms (``nn.ReLU`` and ``nn.LeakyReLU``
  call them too, so the mode also covers modules that were not replaced).

Both give results and gradients bit for bit PyTorch's, as the ops do; what
changes is that autograd saves a 1-bit mask instead of a whole tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import nn
from torch.overrides import TorchFunctionMode

from . import functional as F
from . import modules

__all__ = ["replace_activations", "activations_mode"]

# The state of an nn.Module that hooks live in. The new module shares these
# dictionaries with the old one, so handles returned by register_*_hook keep
# working (they hold the dictionary itself), and a hook registered later on
# either module fires on the one in the model.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _swap(old: nn.Module, relu: bool, leaky_relu: bool) -> nn.Module | None:
    """Ours for an exact nn.ReLU / nn.LeakyReLU (subclasses may change forward), else None."""
    if relu and type(old) is nn.ReLU:
        new = modules.ReLU(inplace=old.inplace)
    elif leaky_relu and type(old) is nn.LeakyReLU:
        new = modules.LeakyReLU(old.negative_slope, inplace=old.inplace)
    else:
        return None
    new.train(old.training)
    for name in _HOOK_DICTS:
        if name in old.__dict__:
            setattr(new, name, getattr(old, name))
    if old._is_full_backward_hook is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
    return new


def _refuse(module: nn.Module, where: str, fname: str = "replace_activations") -> None:
    """TypeError for a module whose submodules ``fname`` must not swap: a
    TorchScript or a torch.compile'd one."""
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"{fname}: {where} is a TorchScript module ({type(module).__name__}); "
            f"its code is compiled and its submodules cannot be swapped. Call "
            f"{fname} on the eager model before torch.jit.script or trace."
        )
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        raise TypeError(
            f"{fname}: {where} is a torch.compile'd module; swapping its "
            f"submodules after compiling would leave compiled graphs of the old ones. Call "
            f"{fname}(model) first, then torch.compile(model)."
        )


def replace_activations(
    model: nn.Module, *, relu: bool = True, leaky_relu: bool = True
) -> tuple[nn.Module, int]:
    """Swap ``nn.ReLU`` / ``nn.LeakyReLU`` modules for cupy_act's, in place.

    Every module in the tree whose type is exactly ``nn.ReLU`` (if ``relu``) or
    ``nn.LeakyReLU`` (if ``leaky_relu``) is replaced by ``cupy_act.torch.ReLU``
    or ``LeakyReLU`` with the same ``inplace`` and ``negative_slope``, the same
    training flag and the same hook dictionaries. A module that sits in two
    places is replaced by one shared module; ``state_dict`` keys do not change
    (activations hold no parameters or buffers). Subclasses are left alone,
    since they may override ``forward``.

    Args:
        model: the module tree; changed in place.
        relu: replace ``nn.ReLU``.
        leaky_relu: replace ``nn.LeakyReLU``.

    Returns:
        ``(model, count)``: the model (a new module only when ``model`` itself is
        an ``nn.ReLU`` / ``nn.LeakyReLU``) and how many distinct modules were
        replaced.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or it (or a submodule) is a
            TorchScript or ``torch.compile``'d module, whose submodules cannot be
            swapped: replace first, then script or compile.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"replace_activations: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    _refuse(model, "the model")
    done: dict[int, nn.Module] = {}  # id(old) -> new, so shared modules stay shared
    top = _swap(model, relu, leaky_relu)
    if top is not None:
        return top, 1
    for path, parent in list(model.named_modules()):
        _refuse(parent, f"submodule {path!r}" if path else "the model")
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = done.get(id(child))
            if new is None:
                new = _swap(child, relu, leaky_relu)
                if new is None:
                    continue
                done[id(child)] = new
            parent._modules[name] = new
    return model, len(done)


def _call(inplace: bool, leaky: bool, args, kwargs):
    """Our op for one intercepted call, or NotImplemented if its arguments are
    not the plain form we route (the original function then runs)."""
    names = ("input", "negative_slope", "inplace") if leaky else ("input", "inplace")
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return NotImplemented
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in bound:
            return NotImplemented  # given twice: let PyTorch raise its own error
        bound[k] = v
    x = bound.get("input")
    if type(x) is not torch.Tensor or x.dtype not in _DTYPES or x.device.type not in _DEVICES:
        return NotImplemented  # subclasses, other dtypes and devices: PyTorch's own op
    inplace = inplace or bool(bound.get("inplace", False))
    if leaky:
        return F.leaky_relu(x, bound.get("negative_slope", 0.01), inplace)
    return F.relu(x, inplace)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICES = ("cuda", "cpu")

# function -> (always in place, leaky); Tensor methods take self as input.
_ROUTES = {
    torch.relu: (False, False),
    torch.relu_: (True, False),
    TF.relu: (False, False),
    TF.relu_: (True, False),
    TF.leaky_relu: (False, True),
    TF.leaky_relu_: (True, True),
    torch.Tensor.relu: (False, False),
    torch.Tensor.relu_: (True, False),
}


class activations_mode(TorchFunctionMode):  # noqa: N801 - used like a function: with activations_mode()
    """Route PyTorch's ReLU and LeakyReLU calls to cupy_act inside a ``with`` block.

    Covers ``torch.relu``, ``torch.relu_``, ``F.relu``, ``F.relu_``,
    ``F.leaky_relu``, ``F.leaky_relu_``, ``Tensor.relu`` and ``Tensor.relu_``,
    and so ``nn.ReLU`` / ``nn.LeakyReLU``, which call them. Calls with other
    dtypes, devices or tensor subclasses run PyTorch's own op. Nests with other
    modes; everything else passes through unchanged.

    A mode sees every torch call in its block, which costs host time on each;
    for models built from ``nn.ReLU`` / ``nn.LeakyReLU`` modules,
    ``replace_activations`` is the cheaper way.

    Example::

        with cupy_act.torch.activations_mode():
            loss = model(x).sum()
        loss.backward()
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTES.get(func)
        if route is not None:
            out = _call(*route, args, kwargs or {})
            if out is not NotImplemented:
                return out
        return func(*args, **(kwargs or {}))
