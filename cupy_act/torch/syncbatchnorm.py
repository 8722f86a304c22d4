"""Synchronized BatchNorm followed by an activation: ``SyncBatchNormAct2d``.

The module is ``nn.SyncBatchNorm`` (its constructor, ``process_group``,
parameters, buffers, ``state_dict`` and semantics) with the activation,
residual and ``memory=`` of ``BatchNormAct2d``. In training, within a process
group of more than one process, each process reduces its own per-channel sums
with cupy_act's kernels, one all-reduce over the group combines them (sums of
x and x^2 and the count, float64: uneven batch sizes weigh as they should,
and a process with an empty batch still takes part), and the normalize +
activate + mask pass runs from the totals; the backward reduces its local
sums, all-reduces them (where the input needs a gradient, as PyTorch's
module does) and writes dx. ``grad_weight`` and ``grad_bias`` stay local, as
PyTorch's: data parallelism averages them. Outside a group, with one
process, or in eval it is ``BatchNormAct2d``.

Where the kernels do not apply (CPU, float64, other strides, torch.func,
forward-mode AD) it runs ``nn.SyncBatchNorm.forward`` (PyTorch's collectives,
its errors: training on CPU tensors in a group is refused as PyTorch refuses
it), then the residual and the activation. Under torch.compile a synchronized
call runs eagerly (``torch.compiler.disable``: one graph break per layer,
said once in a warning); eval and single-process calls follow
``BatchNormAct2d``'s compiled route.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import _bn_kernels as _K
from . import adopt
from . import batchnorm as _bnm
from . import functional as F

__all__ = ["SyncBatchNormAct2d"]


class SyncBatchNormAct2d(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` followed by an activation (the kernels take 4-D
    inputs; others, which nn.SyncBatchNorm accepts, take its path).

    Args:
        num_features, eps, momentum, affine, track_running_stats,
            process_group, device, dtype, bias: as ``nn.SyncBatchNorm``
            (``process_group=None``: the default group).
        apply_act, act_layer, act_kwargs, inplace, memory: as
            ``BatchNormAct2d`` (``memory="inplace"`` writes y over the input
            and keeps only y for the backward, InPlace-ABN's
            ``InPlaceABNSync``).

    ``forward(input, residual=None)`` computes ``act(bn(input) + residual)``
    with the statistics of the whole group in training. The ``state_dict``
    is ``nn.SyncBatchNorm``'s (and ``nn.BatchNorm2d``'s)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
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
        args = (num_features, eps, momentum, affine, track_running_stats, process_group)
        _bnm._init_normalization(self, nn.SyncBatchNorm, args, device, dtype, bias)
        where = "SyncBatchNormAct2d"
        _bnm._configure(self, act_layer if apply_act else None, act_kwargs, memory, where)

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``act(bn(input))`` or ``act(bn(input) + residual)``, the statistics
        reduced over the process group in training."""
        _bnm._check_residual(residual, "SyncBatchNormAct2d")
        group = _group(self)
        if group is None:  # (eval, one process, no group: BatchNormAct2d's paths)
            return _bnm._local_forward(self, input, residual, nn.SyncBatchNorm.forward)
        if F._is_compiling():
            _warn_compiled()
            return _eager_synced(self, input, residual, group)
        return _synced(self, input, residual, group)

    def extra_repr(self) -> str:
        return _bnm._extra_repr(self, super().extra_repr())


def _group(m: SyncBatchNormAct2d):
    """The process group to reduce over, as nn.SyncBatchNorm.forward decides
    (training with batch statistics, torch.distributed initialized, more
    than one process in the group), else None."""
    if not (m.training and dist.is_available() and dist.is_initialized()):
        return None
    group = m.process_group or dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _synced(m: SyncBatchNormAct2d, x: torch.Tensor, residual, group) -> torch.Tensor:
    """The kernels over the group where they take the call, else PyTorch's
    module (its collectives and errors), then the residual and activation."""
    t = _bnm._fused_tensors(m, x, synced=True)
    if t is None or not _bnm._residual_fits(m, x, residual):
        return _bnm._reference_forward(m, nn.SyncBatchNorm.forward, x, residual)
    w, b, r, mean, var, count, factor, eps, mode = _bnm._fused_args(m, x, t, residual)
    return SyncFusedBatchNormAct.apply(x, w, b, r, mean, var, count, factor, eps, mode, group)


def _outside_graphs(fn):
    """fn run eagerly where torch.compile traces a call to it. torch's own
    lazy form (private: imports torch._dynamo at the first call, not when
    cupy_act.torch is imported), else the public torch.compiler.disable."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


_eager_synced = _outside_graphs(_synced)
_warned = False


def _warn_compiled() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "SyncBatchNormAct2d under torch.compile: a synchronized call (training in a process "
            "group) runs eagerly, outside the graph (torch.compiler.disable): one graph break "
            "per synchronized layer; eval and single-process calls are compiled",
            stacklevel=3,
        )


class SyncFusedBatchNormAct(torch.autograd.Function):
    """BatchNorm (+ residual) + activation over a process group, in
    cupy_act's kernels: local sums, one all-reduce, then the normalization
    (forward); local sums and gradients of weight and bias, one all-reduce
    (where x needs a gradient), then dx (backward). Saves what
    ``FusedBatchNormAct`` saves (y alone in the in-place mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, count, factor, eps,
                mode: _K.Mode, group):  # fmt: skip
        sums, s = _K.sync_sums(x, mode)
        dist.all_reduce(sums, group=group)
        out = x if mode.inplace else None
        y, stats, mask = _K.sync_forward(
            x, weight, bias, residual, running_mean, running_var, count, factor, eps, mode, s,
            sums, out,
        )  # fmt: skip
        if mode.inplace:
            ctx.mark_dirty(x)
        kept = residual if mode.inplace else None
        ctx.save_for_backward(y if mode.inplace else x, weight, bias, stats, mask, kept)
        ctx.args = (s, mode, group)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        src, weight, bias, stats, mask, residual = ctx.saved_tensors
        s, mode, group = ctx.args
        needs = ctx.needs_input_grad
        gy, skip = _K.skipped(gy, s.channels_last)
        sums, gw, gb = _K.sync_grad_sums(
            src, gy, mask, weight, bias, stats, residual, s, mode, needs[1], needs[2], skip
        )
        dx = gr = None
        if needs[0] or needs[3]:
            dist.all_reduce(sums, group=group)
            dx, gr = _K.sync_backward(
                src, gy, mask, weight, bias, stats, residual, s, mode, sums, needs[3], skip
            )
        return dx, gw, gb, gr, None, None, None, None, None, None, None


def _module_like(bn: nn.Module, act: str, slope: float, memory: str, process_group=None,
                 after_conv: bool | None = None, sync: bool = False,
                 kept_by_zero: bool = False) -> nn.Module:  # fmt: skip
    """A BatchNormAct2d, or a SyncBatchNormAct2d in ``process_group`` where
    ``sync``, holding bn's own parameters, buffers and hooks (optimizers and
    other references to them stay valid) and its training flag, with the
    activation ``act`` (and ``slope``) and the memory mode ``memory``;
    ``after_conv`` and ``kept_by_zero``: the compiled policy's marks
    (``_configure``)."""
    kwargs = {"negative_slope": slope} if act == "leaky_relu" else None
    args = (bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    new: nn.Module
    if sync:
        new = SyncBatchNormAct2d(*args, process_group, act_layer=act, act_kwargs=kwargs,
                                 device="meta", memory=memory)  # fmt: skip
    else:
        new = _bnm.BatchNormAct2d(*args, act_layer=act, act_kwargs=kwargs, device="meta",
                                  memory=memory)  # fmt: skip
    new._parameters = dict(bn._parameters)
    new._buffers = dict(bn._buffers)
    new.train(bn.training)
    new.after_conv = after_conv
    new.kept_by_zero = kept_by_zero
    for name in adopt._HOOK_DICTS:  # (handles from register_*_hook keep working)
        if name in bn.__dict__:
            setattr(new, name, getattr(bn, name))
    return new
