"""``fuse_batchnorm_act_fx``: BatchNorm -> activation pairs fused in a traced graph.

``fuse_batchnorm_act`` finds pairs by module structure (timm's
``BatchNormAct2d``, ``nn.Sequential``). Models such as torchvision's ResNets
call their BatchNorm and activation from ``forward`` (``self.bn1`` then a
``self.relu`` shared by the whole block), which only the call graph shows:
this traces the model with ``torch.fx`` and fuses every ``nn.BatchNorm2d``
whose one use is an activation (``nn.ReLU`` / ``nn.LeakyReLU`` modules, ours
too, ``F.relu``, ``torch.relu``, ``F.leaky_relu`` with a constant slope and
their in-place forms, ``Tensor.relu``), or an addition whose one use is
such an activation (a residual block's tail: ``out = bn3(out); out +=
identity; relu(out)`` becomes ``bn3(out, identity)``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as tf
from torch import fx, nn

from . import adopt
from . import batchnorm as bn
from . import batchnorm_fuse as fuse

__all__ = ["fuse_batchnorm_act_fx"]

_RELU_FUNCTIONS = (tf.relu, tf.relu_, torch.relu, torch.relu_)
_LEAKY_FUNCTIONS = (tf.leaky_relu, tf.leaky_relu_)
_RELU_METHODS = ("relu", "relu_")


def _activation(node: fx.Node, source: fx.Node, modules: dict) -> tuple[str, float] | None:
    """(act, slope) where ``node`` applies ReLU or LeakyReLU to ``source`` alone, else None."""
    if not node.args or node.args[0] is not source:
        return None
    if node.op == "call_module":
        act = fuse._act_of(modules[node.target])
        return act if act is not None and act[0] != "identity" and len(node.args) == 1 else None
    if node.op == "call_method" and node.target in _RELU_METHODS and len(node.args) == 1:
        return "relu", 0.0
    if node.op != "call_function":
        return None
    extra = {k: v for k, v in node.kwargs.items() if k != "inplace"}
    if node.target in _RELU_FUNCTIONS and len(node.args) == 1 and not extra:
        return "relu", 0.0
    if node.target in _LEAKY_FUNCTIONS:
        slope = node.args[1] if len(node.args) > 1 else extra.pop("negative_slope", 0.01)
        if len(node.args) <= 3 and not extra and isinstance(slope, (int, float)):
            return "leaky_relu", float(slope)
    return None


_ADDS = (operator.add, operator.iadd, torch.add)


def _residual_tail(node: fx.Node, modules: dict):
    """(add node, the other operand, activation node, (act, slope)) where
    ``node``'s one use adds one other tensor node to it (``+``, ``+=``,
    ``torch.add`` without alpha) and that sum's one use is an activation of
    it, else None."""
    add = next(iter(node.users)) if len(node.users) == 1 else None
    if add is None or add.op != "call_function" or add.target not in _ADDS or add.kwargs:
        return None
    if len(add.args) != 2 or len(add.users) != 1 or node not in add.args:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    if not isinstance(other, fx.Node) or other is node:
        return None
    user = next(iter(add.users))
    act = _activation(user, add, modules)
    return None if act is None else (add, other, user, act)


def _reads_conv(node: fx.Node, modules: dict) -> bool:
    """Whether ``node`` (a BatchNorm call) reads an ``nn.Conv2d``'s output."""
    src = node.args[0] if node.args else None
    return (
        isinstance(src, fx.Node)
        and src.op == "call_module"
        and isinstance(modules.get(src.target), nn.Conv2d)
    )


def _fresh_conv_output(node: fx.Node, modules: dict) -> bool:
    """Whether ``node`` (a BatchNorm call) reads a convolution's output that
    nothing else reads: the in-place mode may write over it."""
    src = node.args[0] if node.args else None
    return (
        isinstance(src, fx.Node)
        and src.op == "call_module"
        and isinstance(modules.get(src.target), nn.Conv2d)
        and len(src.users) == 1
    )


def fuse_batchnorm_act_fx(
    model: nn.Module, memory: str = "default", tracer: fx.Tracer | None = None
) -> tuple[fx.GraphModule, int]:
    """Trace ``model`` and fuse its BatchNorm -> activation pairs.

    Every ``nn.BatchNorm2d`` or ``nn.SyncBatchNorm`` (exact type, called at
    one place in the graph) whose output has one use, a ReLU or LeakyReLU of it, becomes a
    ``BatchNormAct2d`` holding the same parameters and buffers, and the
    activation call goes. Where that one use is an addition of another
    tensor whose one use is the activation (torchvision's Bottleneck and
    BasicBlock tails), the fused module takes the other tensor as its
    ``residual`` and the addition goes too. ``memory="inplace"`` applies where the BatchNorm
    reads an ``nn.Conv2d`` output used by nothing else and its weight has no
    zero now (a warning names those that do); the others get the default.
    Synchronized BatchNorms become ``SyncBatchNormAct2d`` (their process
    group kept).

    Args:
        model: a module ``torch.fx`` can trace (``fuse_batchnorm_act`` covers
            timm's and ``nn.Sequential`` models without tracing).
        memory: ``"default"`` or ``"inplace"`` (see ``BatchNormAct2d``).
        tracer: an ``fx.Tracer`` to trace with (default: ``fx.Tracer()``).

    Returns:
        ``(graph_module, count)``: a new ``fx.GraphModule`` sharing the model's
        parameters, buffers and other submodules (its ``state_dict`` keys are
        the model's, for every module the graph calls), and how many pairs
        were fused. ``model`` itself is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"fuse_batchnorm_act_fx: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    bn._memory_mode(memory, "identity", 0.0)  # (a bad value raises, naming it)
    adopt._refuse(model, "the model", "fuse_batchnorm_act_fx")
    try:
        graph = (tracer or fx.Tracer()).trace(model)
    except Exception as e:  # (fx raises several types for untraceable code)
        raise TypeError(
            f"fuse_batchnorm_act_fx: torch.fx cannot trace {type(model).__name__} "
            f"({type(e).__name__}: {e}); fuse_batchnorm_act fuses timm's and "
            f"nn.Sequential models without tracing"
        ) from e
    gm = fx.GraphModule(model, graph)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    count = 0
    kept: dict[str, list[str]] = {}
    unfused: list[str] = []
    for node in list(gm.graph.nodes):
        module = modules.get(node.target) if node.op == "call_module" else None
        if type(module) not in fuse._FUSABLE:
            continue
        user = next(iter(node.users)) if len(node.users) == 1 else None
        act = _activation(user, node, modules) if user is not None else None
        tail = _residual_tail(node, modules) if act is None else None
        if calls[node.target] != 1 or user is None or (act is None and tail is None):
            unfused.append(node.target)
            continue
        pair = act if act is not None else tail[3]  # type: ignore[index]
        fresh = _fresh_conv_output(node, modules)
        mode, zero = fuse._mode_for(module, pair, memory, fresh, kept, node.target)
        parent, _, name = node.target.rpartition(".")
        fused = fuse._fused(module, pair[0], pair[1], mode, _reads_conv(node, modules), zero)
        setattr(gm.get_submodule(parent), name, fused)
        if tail is None:
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        else:  # the call moves to the addition, where the residual exists
            add, other, act_node, _ = tail
            with gm.graph.inserting_before(add):
                call = gm.graph.call_module(node.target, (node.args[0], other))
            act_node.replace_all_uses_with(call)
            for dead in (act_node, add, node):
                gm.graph.erase_node(dead)
        count += 1
    fuse._warn_left("fuse_batchnorm_act_fx", kept, count, sorted(set(unfused)))
    gm.graph.lint()
    gm.recompile()
    return gm, count
