"""The fused BatchNorm + activation kernels (``cuda/batchnorm.cu``): lazy
compilation and the launches, on raw device pointers (no CuPy or torch arrays).

One ``cupy.RawModule`` per dtype, compiled on the first call in that dtype.
The torch adapter (``cupy_act.torch.batchnorm``) checks and allocates, then
``prepare``s each pass (once per shape) and ``run``s it on its current stream.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import NamedTuple

from . import _launch, _loader
from ._kernels import CTYPES, ITEMSIZE

SOURCE = "batchnorm.cu"
THREADS = 256  # kBnThreads
DTYPES = ("float32", "float16", "bfloat16")
ACTS = {"identity": 0, "relu": 1, "leaky_relu": 2}  # BnAct
STATS, GRAD, GRAD_FROM_OUTPUT = 0, 1, 2  # BnPass
EVAL, FROM_OUTPUT, SUMS = 1, 2, 4  # BnFlags
# Elements per 16-byte vector (bn_load's V where the layout and alignment allow).
VECTOR = {"float32": 4, "float16": 8, "bfloat16": 8}
# Activations whose input the output determines (the in-place mode's backward).
INVERTIBLE = ("identity", "leaky_relu")

# BnParams: 20 pointers, 5 long longs, 4 doubles, a float and an int.
_PARAMS = struct.Struct("<20Q5q4dfi")
assert _PARAMS.size == 240
_scratch = _launch._Scratch(_PARAMS.size)


def _names(dtype: str) -> list[str]:
    t = CTYPES[dtype]
    names = []
    for cl in ("false", "true"):
        for v in (1, VECTOR[dtype]):
            names.append(f"cupy_act::bn_reduce<{t}, {cl}, {v}, {STATS}, 0>")
            for act, a in ACTS.items():
                names.append(f"cupy_act::bn_reduce<{t}, {cl}, {v}, {GRAD}, {a}>")
                names.append(f"cupy_act::bn_forward<{t}, {cl}, {v}, {a}>")
                names.append(f"cupy_act::bn_backward<{t}, {cl}, {v}, {a}, false>")
                if act in INVERTIBLE:
                    names.append(f"cupy_act::bn_reduce<{t}, {cl}, {v}, {GRAD_FROM_OUTPUT}, {a}>")
                    names.append(f"cupy_act::bn_backward<{t}, {cl}, {v}, {a}, true>")
    per_channel = ["bn_finalize_eval"] + [
        f"{k}<{p}>" for k in ("bn_finalize", "bn_finish_sums") for p in (STATS, GRAD)
    ]
    return names + [f"cupy_act::{k}" for k in per_channel]


def all_kernel_names() -> tuple[str, ...]:
    """Every instantiation, for the CPU-side NVRTC checks."""
    return tuple(dict.fromkeys(name for dtype in DTYPES for name in _names(dtype)))


class _Kernel(NamedTuple):
    ptr: int
    ctx: int
    function: object
    resident: int = 4  # blocks of THREADS per multiprocessor (the driver's occupancy)


_lock = threading.Lock()
_modules: dict[str, object] = {}
_kernels: dict[tuple, _Kernel] = {}  # (device, name)
_sms: dict[int, int] = {}


def _kernel(device: int, dtype: str, name: str) -> _Kernel:
    k = _kernels.get((device, name))
    if k is not None:
        return k
    with _lock:
        names = _names(dtype)
        ctx, functions = _loader.load_module(_modules, dtype, SOURCE, names, device)
        for n, f in zip(names, functions):
            resident = _launch.resident_blocks(ctx, f.ptr, THREADS)
            _kernels[(device, n)] = _Kernel(f.ptr, ctx, f, resident)
    return _kernels[(device, name)]


class Buffers(NamedTuple):
    """Device addresses of one call's arrays (0 where absent)."""

    x: int
    dy: int
    y: int
    mask: int
    weight: int
    bias: int
    mean: int
    invstd: int
    partial: int
    running_mean: int
    running_var: int
    grad_weight: int
    grad_bias: int
    coef: int
    num_batches: int  # num_batches_tracked, incremented by the forward
    arrivals: int  # (NCHW reductions) channels x u32, zero at launch: see arrivals()
    residual: int  # y = act(bn(x) + residual); the in-place backward reads it back
    grad_residual: int  # the backward's dz, the residual's gradient
    moments: int  # channels x (mean, biased variance) doubles of a training forward
    post: int  # added after the activation: out = act(bn(x)) + post


def _sm_count(device: int) -> int:
    n = _sms.get(device)
    if n is None:
        import cupy

        n = _sms[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return n


class Shape(NamedTuple):
    """What one call's launches depend on: computed once per forward, kept for
    its backward."""

    device: int
    dtype: str
    act: str
    channels_last: bool
    n: int
    inner: int  # H x W
    channels: int
    vector: bool  # a 16-byte vector never straddles a channel (NCHW) / holds
    # V consecutive channels (channels-last)


def shape(device: int, dtype: str, act: str, channels_last: bool, n, inner, channels) -> Shape:
    v = VECTOR[dtype]
    vector = channels % v == 0 if channels_last else inner % v == 0
    return Shape(device, dtype, act, channels_last, n, inner, channels, vector)


class Plan(NamedTuple):
    """One pass's launch choices: elements per thread and trip, and the
    reduction's partial sums per channel (the caller's buffer holds
    channels x splits x 2 doubles)."""

    width: int
    splits: int


_plans: dict[tuple, Plan] = {}  # (Shape, aligned, resident) -> Plan


def plan(s: Shape, pointers: int, resident: int = 4) -> Plan:
    """The pass's plan: 16-byte vectors where the shape allows them and the
    call's array addresses (``pointers``, OR-ed together) are 16-byte aligned;
    reduction blocks over all channels: NCHW about 32 per multiprocessor, each
    block's share at least 2048 elements; channels-last one wave of blocks at
    ``resident`` per multiprocessor (the reduction kernel's occupancy, which
    ``prepare`` passes), each block's share at least 8192 elements: each
    thread walks its rows with several loads in flight, and a part wave
    (4 blocks per multiprocessor where 3 fit: 1.33 waves) leaves most
    multiprocessors idle at its end. Kept per (shape, alignment, resident)."""
    aligned = s.vector and not pointers & 15
    key = (s, aligned, resident if s.channels_last else 0)
    found = _plans.get(key)
    if found is not None:
        return found
    v = VECTOR[s.dtype] if aligned else 1
    if s.channels_last:
        cols = s.channels // v
        tiles = -(-cols // min(cols, 32))
        per_sm, share = resident, 8192
    else:
        tiles = s.channels
        per_sm, share = 32, 2048
    per_tile = max(1, s.n // max(tiles, 1))
    want = max(1, (per_sm * _sm_count(s.device)) // max(tiles, 1))
    found = Plan(v, int(max(1, min(want, -(-per_tile // share), 65535))))
    if len(_plans) > 4096:  # (shapes that keep changing: start over)
        _plans.clear()
    _plans[key] = found
    return found


class Pass(NamedTuple):
    """One pass over one shape, prepared once (kept per shape, alignment and
    pass): a call adds its pointers and scalars.

    A forward's statistics (``stats`` doubles, kept for its backward): mean
    and invstd (2 x channels floats, to a 16-byte boundary), then the
    moments (channels x 2 doubles, at byte ``moments``) and the count a
    synchronized forward normalized over (one double, and one of padding).
    A pass's work area
    (``work`` doubles, dead after it): partial sums (channels x splits x 2),
    then coef (four planes of C floats, at byte ``coef`` of the work area)."""

    shape: Shape
    plan: Plan
    stats: int
    moments: int
    work: int
    coef: int
    launches: tuple  # ((ptr, ctx, grid), ...) in order
    counts: tuple  # (n, inner, channels, splits), then (1 / inner, 1 / channels)
    inverses: tuple
    need: Buffers  # bytes the kernels may index from each Buffers address (see run)


# The kernels of each pass, by channels_last: NCHW reductions finish their channels.
PASSES: dict[str, dict[bool, tuple[str, ...]]] = {
    "forward": {False: ("reduce0", "forward"), True: ("reduce0", "finalize0", "forward")},
    "eval": {False: ("finalize_eval", "forward"), True: ("finalize_eval", "forward")},
    "backward": {False: ("reduce1", "backward"), True: ("reduce1", "finalize1", "backward")},
    "backward_from_output": {
        False: ("reduce2", "backward_from_output"),
        True: ("reduce2", "finalize1", "backward_from_output"),
    },
    # synchronized (SyncBatchNorm): "*_local" writes each channel's sums (SUMS
    # flag) for the host to all-reduce; "*_sync" finishes from the totals
    "forward_local": {False: ("reduce0",), True: ("reduce0", "finalize0")},
    "forward_sync": {False: ("finish_sums0", "forward"), True: ("finish_sums0", "forward")},
    "backward_local": {False: ("reduce1",), True: ("reduce1", "finalize1")},
    "backward_from_output_local": {False: ("reduce2",), True: ("reduce2", "finalize1")},
    "backward_sync": {False: ("finish_sums1", "backward"), True: ("finish_sums1", "backward")},
    "backward_from_output_sync": {
        False: ("finish_sums1", "backward_from_output"),
        True: ("finish_sums1", "backward_from_output"),
    },
}
_passes: dict[tuple, Pass] = {}  # (Shape, aligned, pass) -> Pass


def prepare(s: Shape, pointers: int, which: str) -> Pass:
    """The pass ``which`` (a key of PASSES) over shape ``s``; ``pointers``: the
    call's array addresses OR-ed together (16-byte vectors need all aligned).
    The forward's buffer is kept for its backward, which reads its head."""
    aligned = s.vector and not pointers & 15
    found = _passes.get((s, aligned, which))
    if found is not None:
        return found
    p = plan(s, pointers)
    reduce = [k for k in PASSES[which][s.channels_last] if k.startswith("reduce")]
    if s.channels_last and reduce:  # (one wave at the reduction's own occupancy)
        p = plan(s, pointers, _kernel(s.device, s.dtype, _name(s, p, reduce[0])).resident)
    head = (s.channels + 1) & ~1  # 2 x channels floats, to a 16-byte boundary
    launches = tuple(_launch_of(s, p, k) for k in PASSES[which][s.channels_last])
    counts = (s.n, s.inner, s.channels, p.splits)
    inverses = (1.0 / max(s.inner, 1), 1.0 / s.channels)  # (a synchronized rank may be empty)
    stats, work = stats_doubles(s.channels), s.channels * (2 * p.splits + 2)
    found = Pass(s, p, stats, 8 * head, work, 16 * s.channels * p.splits, launches, counts,
                 inverses, _need(s, p, which))  # fmt: skip
    if len(_passes) > 4096:  # (shapes that keep changing: start over)
        _passes.clear()
    _passes[(s, aligned, which)] = found
    return found


def stats_doubles(channels: int) -> int:
    """Doubles of a forward's statistics (``Pass``): mean and invstd, then the
    moments and the count (and a pad to 16 bytes)."""
    return ((channels + 1) & ~1) + 2 * channels + 2


def sums_doubles(channels: int) -> int:
    """Doubles of a synchronized pass's sums (what the processes all-reduce):
    two per channel, then the forward's count."""
    return 2 * channels + 1


def _need(s: Shape, p: Plan, which: str) -> Buffers:
    """Bytes the pass's kernels may read or write from each Buffers address
    (0: not indexed): x, y (and dy in a backward) hold n elements, the mask
    one bit per element in 32-bit words, every per-channel array C floats,
    the partial sums C x splits pairs of doubles, coef four floats per channel,
    the moments two doubles per channel, then the count and a pad.
    Synchronized passes: the sums (written by "*_local" into the moments
    address, read by "*_sync" from the partial address) two doubles per
    channel, then the forward's count."""
    data = s.n * ITEMSIZE[s.dtype]
    c4 = 4 * s.channels
    backward = which.startswith("backward")
    sums = 8 * sums_doubles(s.channels) if which.startswith("forward_") else 16 * s.channels
    partial = 16 * s.channels * p.splits
    moments = 16 * s.channels + 16  # (and the count, and a pad)
    if which.endswith("_local"):
        moments = sums
    elif which.endswith("_sync"):
        partial = sums
    return Buffers(
        x=data, dy=data if backward else 0, y=data, mask=4 * (-(-s.n // 32)), weight=c4,
        bias=c4, mean=c4, invstd=c4 + 8 * (s.channels & 1),  # (and the pad before the moments)
        partial=0 if which == "eval" else partial,
        running_mean=c4, running_var=c4, grad_weight=c4, grad_bias=c4, coef=16 * s.channels,
        num_batches=8, arrivals=c4, residual=data, grad_residual=data,
        moments=moments, post=data,
    )  # fmt: skip


def _refuse(ps: Pass, b: tuple, have: tuple) -> None:
    short = [
        f"{name} has {got} bytes, needs {need}"
        for name, ptr, got, need in zip(Buffers._fields, b, have, ps.need)
        if ptr and got < need
    ]
    raise _launch.SizeMismatch(
        f"cupy_act batchnorm launch refused ({ps.shape}): {'; '.join(short)}"
    )


def _name(s: Shape, p: Plan, kernel: str) -> str:
    """The instantiation of one kernel of a pass (a PASSES entry)."""
    t, cl, a = CTYPES[s.dtype], "true" if s.channels_last else "false", ACTS[s.act]
    if kernel == "finalize_eval":
        return f"cupy_act::bn_{kernel}"
    if kernel.startswith(("finish_sums", "finalize")):
        return f"cupy_act::bn_{kernel[:-1]}<{kernel[-1]}>"
    if kernel.startswith("reduce"):
        pass_ = int(kernel[-1])
        return f"cupy_act::bn_reduce<{t}, {cl}, {p.width}, {pass_}, {a if pass_ else 0}>"
    if kernel == "forward":
        return f"cupy_act::bn_forward<{t}, {cl}, {p.width}, {a}>"
    out = "true" if kernel == "backward_from_output" else "false"
    return f"cupy_act::bn_backward<{t}, {cl}, {p.width}, {a}, {out}>"


def _launch_of(s: Shape, p: Plan, kernel: str) -> tuple:
    """(ptr, ctx, grid) of one kernel of a pass: "finalize<P>" (a warp per
    channel), "finalize_eval" / "finish_sums<P>" (a thread
    per channel), "reduce<P>" (splits x channel tiles) or the elementwise
    "forward" / "backward" / "backward_from_output" (grid-stride)."""
    if kernel == "finalize_eval" or kernel.startswith("finish_sums"):
        grid = (-(-s.channels // THREADS), 1)
    elif kernel.startswith("finalize"):
        grid = (-(-s.channels // (THREADS // 32)), 1)
    elif kernel.startswith("reduce"):
        cols = s.channels // p.width
        grid = (p.splits, -(-cols // min(cols, 32)) if s.channels_last else s.channels)
    else:
        grid = (elementwise_blocks(s, p.width, 16 * _sm_count(s.device)), 1)
    k = _kernel(s.device, s.dtype, _name(s, p, kernel))
    return k.ptr, k.ctx, grid


def elementwise_blocks(s: Shape, width: int, cap: int) -> int:
    """Blocks of an elementwise pass (grid-stride, ``width`` elements per thread
    and trip): about ``cap``, at least one. Channels-last: one trip, or a
    multiple of the C / width vectors of a row per trip, so that every
    thread's vectors share their channels (bn_coefs: their coefficients
    loaded once)."""
    blocks = max(1, -(-(s.n // width) // THREADS))
    if blocks <= cap or not s.channels_last:
        return min(blocks, cap)
    cols = s.channels // width
    period = cols // math.gcd(cols, THREADS)  # (blocks whose threads span whole rows)
    return max(period, cap // period * period)


def outers(s: Shape) -> int:
    """Rows (channels-last) or samples (NCHW) of a tensor of shape ``s``: the
    units that a strided dy's skip (``run``'s ``dy_skip``) separates."""
    return s.n // s.channels if s.channels_last else s.n // max(s.channels * s.inner, 1)


def run(ps: Pass, stream: int, b: tuple, have: tuple, momentum: float, eps: float,
        slope: float, flags: int, dy_skip: int = 0) -> None:  # fmt: skip
    """The pass's kernels in order on ``stream``, on one parameter block (each
    launch copies it). ``b``: the addresses, ``Buffers`` or a tuple in its
    field order; ``have``: the bytes each address of ``b`` has to the
    end of its buffer; a launch that would index past one is refused
    (``SizeMismatch``: integer compares, the entry points check first).
    Forward: y (and the mask, where b.mask) from the batch
    statistics, updating the running statistics where b.running_mean ("eval":
    from the running statistics); b.mean, b.invstd, b.coef (and b.moments,
    where given) receive those used; b.residual, where given, is added before
    the activation, b.post after it; b.y may be b.x (in place). Backward: weight and bias
    gradients (where given), then dx into b.y (and dz into b.grad_residual,
    where given); FROM_OUTPUT: b.x holds the forward's output (the in-place
    mode; b.residual the forward's); EVAL: the forward normalized with the
    running statistics.
    Synchronized (flags | SUMS for "*_local"): "*_local" writes the local
    sums into b.moments (the backward: grad_weight and grad_bias too);
    "*_sync" reads the group's totals from b.partial and the forward's
    statistics at b.moments (their count). ``dy_skip``: elements of b.dy
    between one row (channels-last) or sample (NCHW) and the next beyond
    the dense tensor's (a channel slice; 16-byte vectors need its bytes in
    ``prepare``'s pointers): b.dy then spans that many more per row or
    sample but the last."""
    need = ps.need
    if dy_skip:
        extra = dy_skip * (outers(ps.shape) - 1) * ITEMSIZE[ps.shape.dtype]
        need = need._replace(dy=need.dy + extra)
    for ptr, got, want in zip(b, have, need):
        if ptr and got < want:
            _refuse(ps._replace(need=need), b, have)
    _PARAMS.pack_into(_scratch.buf, 0, *b, *ps.counts, dy_skip, momentum, eps, *ps.inverses,
                      slope, flags)  # fmt: skip
    _launch.run_all(ps.launches, THREADS, stream, _scratch.argv_ptr)


def arrivals(s: Shape) -> int:
    """u32 counters a training or backward pass needs in b.arrivals, zero at
    launch (it leaves them zero): an NCHW reduction's last block per channel
    finishes the channel; channels-last takes a separate launch and none."""
    return 0 if s.channels_last else s.channels
