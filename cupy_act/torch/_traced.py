"""The route under torch.compile: each op as the PyTorch operations of its
registry entry, which Dynamo traces into the graph like any other code.

Inductor then fuses the activation with its neighbours (a BatchNorm's
normalization before it, a bias and a division, a layout conversion) and picks
by min-cut what the backward keeps or recomputes; an opaque custom op would
cost one more read and write of the activation each way and pin its output.
The operations are those a user of PyTorch's own activation writes, so the
compiler sees the graph of ``torch.relu`` / ``F.leaky_relu`` / the divided
expression and generates the same code: compiled results are compiled
PyTorch's bit for bit.

``apply`` saves what Inductor chooses (no mask). ``packed_mask_act`` keeps a
packed 1-bit mask in traced operations instead, for an activation that ends a
fusion region (after a convolution, whose cuDNN kernel Inductor cannot fuse
into), where Inductor would otherwise save a one-byte boolean: y is read
through the packed word, so Inductor writes both in one kernel. Measured on an
H100 (docs/torch-adapter.md, 2026-11-24): the seed-003 block alone 0.96x
torch.compile's forward + backward with 1/8 of its activation state; but the
block feeding pooling 1.25x (Inductor no longer fuses the epilogue into the
pooling), and cspdarknet53 with a mask on every (in-place) activation 1.25x.
So no default uses it: ``conv.set_compiled_epilogue("packed")``
selects it for a block that ends the region, ``ACT_MASK`` for the models'
measurement.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _reference, _registry
from . import _impl


def pre(op: str, x: Tensor, divisor: float, bias, inplace: bool) -> Tensor:
    """What the activation sees, as PyTorch computes it: x, or (x [+ bias]) / divisor
    (in place: ``x.add_(bias).div_(divisor)``, as the reference writes it)."""
    if not inplace:
        return _reference.pre(op, x, divisor, bias)
    if not _registry.OPS[op].divisor:
        return x
    if bias is not None:
        x.add_(bias.view(1, -1, *([1] * (x.dim() - 2))))
    return x.div_(divisor)


# A packed mask for every activation under autograd, (word bits, layout) as
# ``pack`` takes them, or None: Inductor's choice. A knob for the candidates of
# scripts/models.py (its "ours+mask" variant).
ACT_MASK: tuple[int, str] | None = None


def apply(op: str, x: Tensor, slope: float, divisor: float, bias, inplace: bool) -> Tensor:
    """y = op(x) in PyTorch operations; in place returns x, updated.

    In place uses PyTorch's in-place activation where its autograd holds: its
    backward reads the output, whose sign gives the branch only for a slope
    >= 0 (ReLU's is 0). A negative slope, which PyTorch refuses under autograd,
    goes through ``InplaceAct``, whose gradient is the out-of-place one, as
    cupy_act's eager in-place ops give.
    """
    spec = _registry.OPS[op]
    packing = ACT_MASK if _impl.needs_grad(x, bias) else None
    if not inplace:
        if packing is not None:
            return packed_mask_act(x, bias, op, slope, divisor, *packing)
        return spec.torch_forward(torch, pre(op, x, divisor, bias, False), slope, None)
    t = pre(op, x, divisor, bias, True)
    if slope >= 0 and packing is None:
        return spec.torch_forward_(torch, t, slope)
    return InplaceAct.apply(t, spec.undivided or op, slope, packing)


class InplaceAct(torch.autograd.Function):
    """t = act(t) in place (marked dirty), saving the mask bits taken before, as
    booleans or packed (``packing``: None, or (word bits, layout) as ``pack``
    takes them): the out-of-place gradient for any slope. (Writing an
    out-of-place result back with ``copy_`` would add copy_'s zero gradient
    for the overwritten input, and 0 + -0 loses the sign of a zero gradient.)
    ``op`` is undivided here: the division, if any, was done in place before,
    with its own gradient."""

    @staticmethod
    def forward(ctx, t, op, slope, packing):
        spec = _registry.OPS[op]
        bits = spec.torch_bit(torch, t, None)
        ctx.save_for_backward(bits if packing is None else pack(bits, *packing))
        ctx.mark_dirty(t)
        ctx.args = (op, slope, packing, t.shape, _impl.is_channels_last(t))
        spec.torch_forward_(torch, t, slope)
        return t  # (Dynamo needs the dirty input itself returned)

    @staticmethod
    def backward(ctx, gy):
        (saved,) = ctx.saved_tensors
        op, slope, packing, shape, channels_last = ctx.args
        bits = saved if packing is None else unpack(saved, shape, channels_last, packing[1])
        return _impl.backward_from_bits(op, gy, bits, slope, 1.0), None, None, None


# ---- the packed mask in traced operations ----
#
# Bit j of word k stands for element k + j * words of t's elements in memory
# order (``layout="strided"``: the eight or 32 loads of a word are each
# coalesced across neighbouring words, and the packing is a reduction over the
# outer axis of a (bits, words) view), or for element k * bits + j
# (``"flat"``: a word packs consecutive elements). Elements past n are 0.

_WORDS = {8: torch.uint8, 32: torch.int32}


def _memory_order(t: Tensor) -> Tensor:
    """t's elements in memory order, flat (a view for dense C-order or channels-last t)."""
    if _impl.is_channels_last(t):
        t = t.permute(_impl._cl_perm(t.dim()))
    return t.reshape(-1)


def _from_memory_order(flat: Tensor, shape, channels_last: bool) -> Tensor:
    """The inverse of _memory_order: flat elements back into ``shape``."""
    if not channels_last:
        return flat.view(shape)
    perm = _impl._cl_perm(len(shape))
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return flat.view([shape[p] for p in perm]).permute(inverse)


def _grid(t: Tensor, word: int, layout: str) -> Tensor:
    """t's elements in memory order, zero-padded to whole words, as the
    (bits, words) grid of ``"strided"`` or the (words, bits) grid of ``"flat"``."""
    flat = _memory_order(t)
    pad = -flat.numel() % word
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(word, -1) if layout == "strided" else flat.view(-1, word)


def _shifts(word: int, dtype: torch.dtype, device, layout: str) -> Tensor:
    """Bit j's shift, along the grid's bit axis."""
    shifts = torch.arange(word, dtype=dtype, device=device)
    return shifts.view(-1, 1) if layout == "strided" else shifts


def _pack_grid(bits: Tensor, word: int, layout: str) -> Tensor:
    dtype = _WORDS[word]
    shifts = _shifts(word, dtype, bits.device, layout)
    # distinct powers of two: the sum is the bitwise or, exact in the word's dtype
    return (bits.to(dtype) << shifts).sum(0 if layout == "strided" else 1, dtype=dtype)


def _unpack_grid(mask: Tensor, layout: str, test: bool) -> Tensor:
    word = 8 if mask.dtype == torch.uint8 else 32
    shifts = _shifts(word, mask.dtype, mask.device, layout)
    words = mask.view(1, -1) if layout == "strided" else mask.view(-1, 1)
    return (words & (1 << shifts)) != 0 if test else ((words >> shifts) & 1).bool()


def pack(bits: Tensor, word: int = 8, layout: str = "strided") -> Tensor:
    """Booleans -> a packed mask of ``word``-bit words (8 or 32), in memory order."""
    return _pack_grid(_grid(bits, word, layout), word, layout)


def unpack(
    mask: Tensor, shape, channels_last: bool, layout: str = "strided", test: bool = False
) -> Tensor:
    """The inverse of ``pack``: booleans of ``shape``, channels-last or in C order.

    ``test`` reads a bit as ``word & (1 << j) != 0`` instead of ``(word >> j) & 1``:
    the same booleans from other operations, so that a forward's unpacking is
    not merged with the backward's (merged, the partitioner saves the unpacked
    booleans, which the backward then reads, instead of the mask).
    """
    flat = _unpack_grid(mask, layout, test).reshape(-1)[: math.prod(shape)]
    return _from_memory_order(flat, shape, channels_last)


class PackedMaskAct(torch.autograd.Function):
    """y = op(grid) on a packing grid of what the activation sees (``_grid``),
    in traced PyTorch operations, saving only the packed mask; the backward is
    the registry's PyTorch backward fed the bits (``_impl.backward_from_bits``),
    so the gradient is PyTorch's bit for bit. ``op`` is undivided here: the
    bias and the division stay outside, with autograd's own gradients, as the
    grid's views do (a view made inside a Function could not be written in
    place after it). For torch.compile (no jvp or vmap rule: Dynamo refuses them).
    """

    @staticmethod
    def forward(ctx, grid, op, slope, word, layout):
        spec = _registry.OPS[op]
        mask = _pack_grid(spec.torch_bit(torch, grid, None), word, layout)
        ctx.save_for_backward(mask)
        ctx.args = (op, slope, layout)
        # y read through the packed word: where the bit is set every op's
        # forward is t itself (t > 0, or relu's NaN passed through), so the
        # select gives the forward's bits. It makes y a consumer of the packing
        # reduction over the same (words, bits) iteration space, which Inductor
        # emits in the reduction's kernel (as it does a normalization after its
        # statistics); computed apart, or on t's own shape, the two read t in
        # two kernels (docs/torch-adapter.md).
        bits = _unpack_grid(mask, layout, test=True)
        return torch.where(bits, grid, spec.torch_forward(torch, grid, slope, None))

    @staticmethod
    def backward(ctx, gy):
        (mask,) = ctx.saved_tensors
        op, slope, layout = ctx.args
        bits = _unpack_grid(mask, layout, test=False)
        return _impl.backward_from_bits(op, gy, bits, slope, 1.0), None, None, None, None


def packed_mask_act(x, bias, op, slope, divisor, word=8, layout="strided") -> Tensor:
    """y = op((x [+ bias]) / divisor) in traced operations, saving a packed
    mask (``PackedMaskAct``) where autograd needs one."""
    if not _impl.needs_grad(x, bias):
        return apply(op, x, slope, divisor, bias, False)
    t = _reference.pre(op, x, divisor, bias)
    undivided = _registry.OPS[op].undivided or op
    y = PackedMaskAct.apply(_grid(t, word, layout), undivided, slope, word, layout)
    return _from_memory_order(y.reshape(-1)[: t.numel()], t.shape, _impl.is_channels_last(t))
