"""Tensor-level implementations behind the PyTorch adapter (no autograd here).

CUDA tensors go to the generic kernel through the shared launcher with raw
``data_ptr()`` values and torch's raw current-stream handle: no CuPy arrays, no
stream objects, no host synchronisation; outputs and masks come from torch's
caching allocator. CPU tensors use plain torch with the same semantics and the
same packed 1-bit mask, so models run and train anywhere.

Layout: a C-contiguous input is processed in C order; a channels-last (4-D) or
channels-last-3d (5-D) input in memory order, so its output keeps that format
and its mask follows memory order (``channels_last=True`` tells the backward);
anything else is made contiguous first.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy
import torch
from torch import Tensor

from .. import _registry
from .._arrays import SUPPORTED, mask_nbytes
from .._kernels import DTYPES
from .._plan import plan
from .._reference import bits, reference

DTYPE_NAMES = {getattr(torch, name): name for name in DTYPES}  # torch.float32 -> "float32"
_FNAMES = {op: f"cupy_act.torch.{op}" for op in _registry.OPS}  # for error messages
_CL_FORMAT = {4: torch.channels_last, 5: torch.channels_last_3d}

try:  # the raw handle, without building a torch.cuda.Stream object per call
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or CPU-only builds

    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def on_gpu(x: torch.Tensor) -> bool:
    """Whether the fused BatchNorm and convolution kernels take x: a CUDA
    tensor. (Asked here alone, so that the CPU tests' launch recorder can run
    those paths on CPU tensors with fake kernels.)"""
    return x.is_cuda


def is_channels_last(x: torch.Tensor) -> bool:
    """Dense channels-last (and not also C-contiguous): processed in memory order.

    False for a vmap BatchedTensor, whose memory format cannot be queried: the
    vmap rules in ``_autograd`` hand the kernels contiguous physical tensors.
    """
    fmt = _CL_FORMAT.get(x.dim())
    if fmt is None or x.is_contiguous():
        return False
    try:
        return x.is_contiguous(memory_format=fmt)
    except RuntimeError:  # "NYI: querying is_contiguous inside of vmap ..."
        return False


def needs_grad(x: torch.Tensor, bias) -> bool:
    """Whether autograd records a call on x (and bias)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or (bias is not None and bias.requires_grad)
    )


def nbytes(t) -> int:
    """Bytes of a dense tensor (0 for None): what a kernel may index from its address."""
    return 0 if t is None else t.numel() * t.element_size()


def arrange(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """x in the memory order the kernels walk: C order, or channels-last."""
    if channels_last:
        return x.contiguous(memory_format=_CL_FORMAT[x.dim()])
    return x.contiguous()


class _Launches(dict):
    """The adapter's own cache in front of _plan.plan: _launches[op, kind, dtype,
    device index, no_bias, slope, divisor] is the Launch, planned on a miss.
    Keyed by what a call has at hand (its scalars are always Python floats
    here): 0.3 us less per launch on the GPU host (2026-11-22, 760d700)
    than plan's key and name lookups."""

    def __missing__(self, key):
        op, kind, dtype, dev, no_bias, slope, divisor = key
        launch = plan(dev, op, DTYPE_NAMES[dtype], kind, not no_bias, slope, divisor, _FNAMES[op])
        if slope or not _registry.OPS[op].slope:  # as plan: 0.0 and -0.0 are one key
            if len(self) >= 4096:  # bounded, as plan's
                self.clear()
            self[key] = launch
        return launch


_launches = _Launches()


def check_tensors(fname: str, x, bias):
    """TypeError or ValueError naming what is wrong with x or bias; else bias,
    made contiguous (the kernels read it as one row of channels)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{fname}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"{fname}: input has dtype {x.dtype}; supported: {SUPPORTED}")
    if bias is None:
        return None
    if not isinstance(bias, Tensor):
        raise TypeError(f"{fname}: bias must be a torch.Tensor, got {type(bias).__name__}")
    if x.dim() < 2 or bias.shape != (x.shape[1],):
        raise ValueError(
            f"{fname}: bias has shape {tuple(bias.shape)}, expected (channels,) = "
            f"({x.shape[1] if x.dim() > 1 else '?'},) for input of shape {tuple(x.shape)}"
        )
    if bias.dtype != x.dtype or bias.device != x.device:
        raise TypeError(
            f"{fname}: bias is {bias.dtype} on {bias.device}, input is {x.dtype} on {x.device}"
        )
    return bias.contiguous()


def _address(t: Tensor) -> int:
    """A CUDA tensor's address; 0 for others, and for tensors without storage
    (the fake tensors torch.compile traces with)."""
    if not t.is_cuda:
        return 0
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def check_mask(fname: str, mask, dy: Tensor) -> None:
    """ValueError naming what is wrong, unless ``mask`` is a packed mask the
    backward kernel can read for dy's elements: uint8, dense, on dy's device,
    at least ``mask_nbytes(dy.numel())`` bytes, 4-byte aligned on CUDA (it
    reads 32-bit words)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{fname}: mask must be a torch.Tensor, got {type(mask).__name__}")
    need = mask_nbytes(dy.numel())
    address = _address(mask)
    if (
        mask.dtype != torch.uint8
        or mask.numel() < need
        or mask.device != dy.device
        or not mask.is_contiguous()
        or address % 4
    ):
        where = f" at address {address:#x}" if address % 4 else ""
        raise ValueError(
            f"{fname}: mask is {mask.dtype} of {mask.numel()} elements on {mask.device}"
            f"{'' if mask.is_contiguous() else ' (not contiguous)'}{where}; expected a dense "
            f"torch.uint8 tensor of at least {need} bytes on {dy.device}, 4-byte aligned (the "
            f"packed mask of the forward, for dy's {dy.numel()} elements)"
        )


def _launch_cuda(kind, op, x, y, mask, bias, slope, divisor, channels_last) -> None:
    """Launch kind over x into y (with a mask, a bias): any dense layout."""
    n = x.numel()
    if n == 0:
        return
    dev = x.get_device()
    launch = _launches[op, kind, x.dtype, dev, bias is None, slope, divisor]
    mask_ptr, mask_bytes = (0, 0) if mask is None else (mask.data_ptr(), mask.numel())
    # (a backward reads the mask's bits; a forward writes its words)
    mask_words = mask_bytes >> 2 if kind == "forward_mask" else 0
    have = (n, y.numel(), mask_bytes, 0 if bias is None else bias.numel())
    if bias is None:
        launch.checked(have, _raw_stream(dev), n, x.data_ptr(), y.data_ptr(), mask_ptr, mask_words)
        return
    channels = x.shape[1]
    inner = 1 if channels_last else math.prod(x.shape[2:])
    launch.checked(
        have,
        _raw_stream(dev),
        n,
        x.data_ptr(),
        y.data_ptr(),
        mask_ptr,
        mask_words,
        bias.data_ptr(),
        inner,
        channels,
    )


# ---- masks as torch tensors, and the plain-torch path (CPU; vmap rules) ----
#
# A mask lists its elements in the order the kernels walk them: C order, or for
# a channels-last input its memory order (N, spatial..., C). The plain-torch
# path below keeps the same order, so a mask means the same on every device.

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _cl_perm(dim: int) -> tuple[int, ...]:
    """The permutation that puts a channels-last tensor's axes in memory order."""
    return (0, *range(2, dim), 1)


def _host_array(t: torch.Tensor):
    """A zero-copy NumPy view of a plain CPU tensor, or None (CUDA, or a torch.func
    wrapper, which has no storage of its own)."""
    if t.device.type != "cpu":
        return None
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


# numpy's packbits and unpackbits release the GIL but run on one core; on a
# many-core host torch's own kernels around them do not, so a long 1-D mask
# is (un)packed in byte-aligned chunks, one per torch thread.
_CHUNK_MIN = 1 << 20  # bits per chunk at least: below this a thread costs more than it saves
_pool = None  # (pid, ThreadPoolExecutor): made on first need, again after a fork


def _in_chunks(work, n: int) -> None:
    """Run work(start, stop) over [0, n) in 8-aligned chunks, on torch's thread count."""
    chunks = min(torch.get_num_threads(), n // _CHUNK_MIN)
    if chunks < 2:
        work(0, n)
        return
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(os.cpu_count() or 1, "cupy_act_pack"))
    step = (-(-n // chunks) + 7) // 8 * 8
    bounds = [(i, min(i + step, n)) for i in range(0, n, step)]
    for f in [_pool[1].submit(work, a, b) for a, b in bounds]:
        f.result()


def _pack_host(bits: numpy.ndarray, out: numpy.ndarray) -> None:
    """out[: ceil(n / 8)] = the little-endian packed bits of a 1-D bool array."""

    def work(a, b):
        out[a // 8 : (b + 7) // 8] = numpy.packbits(bits[a:b], bitorder="little")

    _in_chunks(work, bits.size)


def _unpack_host(packed: numpy.ndarray, n: int) -> numpy.ndarray:
    """The first n bits of a 1-D packed mask, as a bool array."""
    out = numpy.empty(n, dtype=numpy.bool_)

    def work(a, b):
        part = numpy.unpackbits(packed[a // 8 : (b + 7) // 8], count=b - a, bitorder="little")
        out[a:b] = part.view(numpy.bool_)

    _in_chunks(work, n)
    return out


def pack_rows(bits: torch.Tensor) -> torch.Tensor:
    """(rows, n) booleans -> (rows, mask_nbytes(n)) packed masks, one per row."""
    rows, n = bits.shape
    host = _host_array(bits)
    if host is not None:  # numpy.packbits: about 15x faster than the torch ops below
        packed = numpy.zeros((rows, mask_nbytes(n)), dtype=numpy.uint8)
        if rows == 1:
            _pack_host(host[0], packed[0])
        else:
            packed[:, : (n + 7) // 8] = numpy.packbits(host, axis=1, bitorder="little")
        return torch.from_numpy(packed)
    padded = torch.zeros(rows, mask_nbytes(n) * 8, dtype=torch.uint8, device=bits.device)
    padded[:, :n] = bits
    weights = _BIT_WEIGHTS.to(bits.device)
    return (padded.view(rows, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bits of each packed mask along the last axis, as booleans."""
    host = _host_array(mask)
    if host is not None:
        if host.ndim == 1:
            return torch.from_numpy(_unpack_host(host, n))
        bits = numpy.unpackbits(host, axis=-1, count=n, bitorder="little")
        return torch.from_numpy(bits.view(numpy.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return ((mask.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :n].bool()


def bits_to_mask(bits: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Booleans of x's shape -> x's packed mask, in the kernels' element order."""
    if channels_last:
        bits = bits.permute(_cl_perm(bits.dim()))
    return pack_rows(bits.reshape(1, -1))[0]


def mask_to_bits(mask: torch.Tensor, shape, channels_last: bool) -> torch.Tensor:
    """Packed masks (..., nbytes) -> booleans (..., *shape): the inverse of bits_to_mask."""
    lead = tuple(mask.shape[:-1])
    flat = unpack_bits(mask, math.prod(shape))
    if not channels_last:
        return flat.view(*lead, *shape)
    perm = _cl_perm(len(shape))
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    k = len(lead)
    return flat.view(*lead, *(shape[p] for p in perm)).permute(*range(k), *(k + i for i in inverse))


def per_sample_masks(mask: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """The mask of ``batch`` stacked samples of n elements -> (batch, mask_nbytes(n)):
    a free view when n % 128 == 0 (each sample's mask ends on a 16-byte boundary)."""
    if n % 128 == 0:
        return mask.view(batch, mask_nbytes(n))
    return pack_rows(unpack_bits(mask, batch * n).view(batch, n))


def backward_from_bits(op, dy, bits, slope, divisor):
    """dx from dy and the bits (any device, any shape dy and bits share).

    The same ATen kernels autograd uses, fed a stand-in for x whose sign is the
    bit; differentiable, and it works on torch.func wrappers.
    """
    spec = _registry.OPS[op]
    dx = spec.torch_backward(torch, dy, torch.empty_like(dy).copy_(bits), slope, None)
    return dx / divisor if spec.divisor else dx


# ---- the CPU hot path: masks packed and unpacked a piece at a time ----
#
# Made whole, the mask's bits (1 byte each) are one more large buffer, whose
# page faults cost as much as its traffic (2^24 float32 on 2 cores: filling a
# new 64 MB buffer takes 21 ms, torch.relu 27 ms). Piece by piece the bits stay
# in cache and in reused heap memory. The pieces are large because each torch
# op on a piece costs a fork and join of every thread (NumPy on a pool of
# threads instead ran 1.4x slower on a 16-core host: it competes with torch's
# spinning OpenMP workers).
#
# Which steps may go piece by piece depends on the dtype and the kernel. For
# float32 and float64 every lane of ATen's vectorized forward loops computes
# what its scalar loop does (a comparison, a select or max, one multiply or
# divide; NaNs come out alike), so the forward of an op with a divisor runs a
# piece at a time, t = x / divisor written into y's piece and read there while
# in cache, instead of into a full-size temporary (16 threads, 2^24 float32:
# div_leaky_relu fwd+bwd 0.95-1.04x torch against 1.19-1.21x). Without a
# divisor, the whole-tensor forward and a separate pass for the bits measured
# faster on that host than the forward in pieces (relu 1.85-1.97x against
# 2.03-2.08x, leaky_relu 1.72-1.75x against 1.90-1.92x): each piece costs
# every op a fork and join of all threads. ATen's backward loops do not agree
# lane by lane (leaky_relu_backward passes a signalling NaN gradient unchanged
# in its scalar loop and quiets it in its vector loop), and where the scalar
# tails fall depends on how an op splits its range over threads; float16 and
# bfloat16 round NaNs differently in the two loops of the forward too. Those
# kernels run once over the whole tensor, as in PyTorch's own call; only the
# exact steps (the predicate, packing, unpacking, the 0/1 stand-in) go piece
# by piece.

_PIECE = 1 << 20  # elements per piece: 4 MiB of float32, 1 MiB of bits
_LANEWISE = (torch.float32, torch.float64)  # whose forwards may run piece by piece


def _walk_view(t: torch.Tensor, channels_last: bool):
    """t's elements in the kernels' walk order as a flat view, or None if that
    needs a copy (or t is no plain CPU tensor: torch.func wrappers have no storage)."""
    if channels_last:
        t = t.permute(_cl_perm(t.dim()))
    if not t.is_contiguous():
        return None
    flat = t.view(-1)
    return flat if _host_array(flat[:0].bool()) is not None else None


def _pack(bits: torch.Tensor, out: numpy.ndarray, a: int) -> None:
    """Pack bits (elements a.. of the walk, a % 8 == 0) into the mask out."""
    out[a // 8 : (a + bits.numel() + 7) // 8] = numpy.packbits(bits.numpy(), bitorder="little")


def host_mask(op, t, channels_last: bool) -> torch.Tensor:
    """The packed mask of what the activation saw, t, on the CPU (any layout)."""
    flat = _walk_view(t, channels_last)
    if flat is None:
        return bits_to_mask(bits(op, t), channels_last)
    n = flat.numel()
    out = numpy.zeros(mask_nbytes(n), dtype=numpy.uint8)
    bit_buf = torch.empty(min(n, _PIECE), dtype=torch.bool)  # (reused: no page faults)
    torch_bit = _registry.OPS[op].torch_bit
    for a in range(0, n, _PIECE):
        piece = flat[a : a + _PIECE]
        _pack(torch_bit(torch, piece, bit_buf[: piece.numel()]), out, a)
    return torch.from_numpy(out)


def _host_forward_mask(op, x, slope, divisor, channels_last):
    """(y, mask) on the CPU piece by piece for an op with a divisor (float32,
    float64, no bias), or None: t = x / divisor goes into y's piece, the
    predicate reads it there, and the activation then runs in place on it
    (PyTorch's kernel on the same t). Every step writes into memory it already
    has: a new buffer costs its page faults, as much as its traffic (above)."""
    spec = _registry.OPS[op]
    divided = spec.divisor and x.dtype in _LANEWISE
    flat = _walk_view(x, channels_last) if divided else None
    if flat is None:
        return None
    y = torch.empty_like(x)  # (dense x: the same strides, so the same walk)
    y_flat = _walk_view(y, channels_last)
    n = flat.numel()
    out = numpy.zeros(mask_nbytes(n), dtype=numpy.uint8)
    bit_buf = torch.empty(min(n, _PIECE), dtype=torch.bool)
    for a in range(0, n, _PIECE):
        t = torch.div(flat[a : a + _PIECE], divisor, out=y_flat[a : a + _PIECE])
        _pack(spec.torch_bit(torch, t, bit_buf[: t.numel()]), out, a)
        spec.torch_forward(torch, t, slope, t)
    return y, torch.from_numpy(out)


def _host_backward(op, dy, mask, slope, divisor, channels_last):
    """dx on the CPU without autograd, written over its own 0/1 stand-in; None
    where dy is not laid out in the mask's order (the general path then follows
    dy's layout, as PyTorch's kernel would)."""
    packed = _host_array(mask)
    if packed is None or _walk_view(dy, channels_last) is None:
        return None
    fmt = _CL_FORMAT[dy.dim()] if channels_last else torch.contiguous_format
    dx = torch.empty(dy.shape, dtype=dy.dtype, memory_format=fmt)
    flat = _walk_view(dx, channels_last)
    n = flat.numel()
    for a in range(0, n, _PIECE):
        b = min(a + _PIECE, n)
        piece = numpy.unpackbits(packed[a // 8 : (b + 7) // 8], count=b - a, bitorder="little")
        flat[a:b].copy_(torch.from_numpy(piece))  # (from uint8: twice as fast as from bool)
    spec = _registry.OPS[op]
    spec.torch_backward(torch, dy, dx, slope, dx)  # (out= is allowed: no autograd here)
    return dx.div_(divisor) if spec.divisor else dx


# ---- the four entry points ----

# On the CPU, PyTorch's own kernels treat NaN payloads differently in their
# vectorized and strided loops, so they run on the tensors exactly as given and
# only the results are copied (bits unchanged) into the agreed layout.


def _layout(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(x in the memory order the kernels walk, whether that is channels-last)."""
    if x.is_contiguous():
        return x, False
    cl = is_channels_last(x)
    return arrange(x, cl), cl


def new_mask(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised mask buffer for x's elements, on x's device."""
    return x.new_empty(mask_nbytes(x.numel()), dtype=torch.uint8)


_U8: dict = {}  # CUDA device index -> an empty uint8 tensor there


def _cuda_mask(x: torch.Tensor, dev: int, n: int) -> torch.Tensor:
    """new_mask for a CUDA tensor of n elements on device dev, in eager mode:
    new_empty() of a cached uint8 tensor takes no dtype argument, 0.7 us less
    per call on the GPU host (2026-11-22, 760d700)."""
    u8 = _U8.get(dev)
    if u8 is None:
        u8 = _U8[dev] = x.new_empty(0, dtype=torch.uint8)
    return u8.new_empty((n + 127) // 128 * 16)  # mask_nbytes(n)


# The hot calls (a CUDA tensor in C order, no bias) below launch inline, each
# tensor property read once: a Python call or a property costs 0.05-0.1 us on
# the GPU host, against 6-8 us for all of F.relu (scripts/overhead.py).


def forward(x, op: str, slope: float, divisor: float, bias):
    """y = op(x) without a mask (inference, or no gradient needed)."""
    if not x.is_cuda:
        return arrange(reference(op, x, slope, divisor, bias)[0], is_channels_last(x))
    if bias is not None or not x.is_contiguous():
        x, cl = _layout(x)
        y = torch.empty_like(x)
        _launch_cuda("forward", op, x, y, None, bias, slope, divisor, cl)
        return y
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        dev = x.get_device()
        launch = _launches[op, "forward", x.dtype, dev, True, slope, divisor]
        launch(_raw_stream(dev), n, x.data_ptr(), y.data_ptr())
    return y


def forward_mask(x, op: str, slope: float, divisor: float, bias):
    """(y, mask) in one pass."""
    return forward_mask_layout(x, op, slope, divisor, bias)[:2]


def forward_mask_layout(x, op: str, slope: float, divisor: float, bias):
    """(y, mask, channels_last): also says which element order the mask follows."""
    if not x.is_cuda:
        cl = is_channels_last(x)
        made = None if bias is not None else _host_forward_mask(op, x, slope, divisor, cl)
        if made is not None:
            return (*made, cl)
        y, t = reference(op, x, slope, divisor, bias)
        return arrange(y, cl), host_mask(op, t, cl), cl
    n = x.numel()
    dev = x.get_device()
    if bias is not None or not x.is_contiguous():
        x, cl = _layout(x)
        y = torch.empty_like(x)
        mask = _cuda_mask(x, dev, n)
        _launch_cuda("forward_mask", op, x, y, mask, bias, slope, divisor, cl)
        return y, mask, cl
    y = torch.empty_like(x)
    mask = _cuda_mask(x, dev, n)
    if n:
        launch = _launches[op, "forward_mask", x.dtype, dev, True, slope, divisor]
        words = (n + 127) // 128 * 4  # (the mask's size, from n: no tensor call)
        launch(_raw_stream(dev), n, x.data_ptr(), y.data_ptr(), mask.data_ptr(), words)
    return y, mask, False


def forward_mask_(x, op: str, slope: float, divisor: float, bias, with_mask: bool = True):
    """In place: x = op(x); returns the mask (or None without ``with_mask``)."""
    if not x.is_cuda:
        y, t = reference(op, x, slope, divisor, bias)
        mask = host_mask(op, t, is_channels_last(x)) if with_mask else None
        x.copy_(y)
        return mask
    work, cl = _layout(x)
    mask = _cuda_mask(x, x.get_device(), x.numel()) if with_mask else None
    _launch_cuda(
        "forward_mask" if with_mask else "forward", op, work, work, mask, bias, slope, divisor, cl
    )
    if work is not x:
        x.copy_(work)
    return mask


def backward(dy, mask, op: str, slope: float, divisor: float, channels_last: bool):
    """dx from dy and the mask; the layout flag says the mask's element order."""
    if not dy.is_cuda:
        dx = (
            None
            if torch.is_grad_enabled()
            else _host_backward(op, dy, mask, slope, divisor, channels_last)
        )
        if dx is None:  # differentiable (double backward), a wrapper, or dy in another layout
            b = mask_to_bits(mask, dy.shape, channels_last)
            dx = arrange(backward_from_bits(op, dy, b, slope, divisor), channels_last)
        return dx
    if channels_last or not dy.is_contiguous():
        dy = arrange(dy, channels_last)
    dx = torch.empty_like(dy)
    n = dy.numel()
    if n:
        if mask.numel() < (n + 127) // 128 * 16:  # (mask_nbytes(n): the bits it reads)
            check_mask("cupy_act::backward", mask, dy)
        dev = dy.get_device()
        launch = _launches[op, "backward", dy.dtype, dev, True, slope, divisor]
        # (the backward kernel reads n bits; mask_words sizes only the forward's writes)
        launch(_raw_stream(dev), n, dy.data_ptr(), dx.data_ptr(), mask.data_ptr())
    return dx
