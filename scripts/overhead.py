"""Host time per call on a small tensor (launch-bound), against torch.nn.functional.

    PYTHONPATH=. python scripts/overhead.py [--n 65536] [--calls 2000]

For each case: the wall time of --calls back-to-back calls divided by --calls
(after warm-up: every case runs --calls times before the first is timed), the
least of --repeats repeats, measured in one run with torch's and our repeats
interleaved. The least is the run the rest of the machine disturbed least: on
a shared host the median of the same runs moved by 10-20% between runs (seen
on an H200 machine). "fwd" calls the activation with no gradient needed;
"fwd+bwd" runs autograd forward and backward (torch.autograd.grad) from a
leaf that requires grad; the "x*1" rows call the op on x * 1 (a non-leaf, as
in a model, so in place is allowed), out of place and in place, forward alone
under autograd and forward + backward, and compare our in-place calls with
our out-of-place ones. The CuPy rows time every op and kind of the CuPy API,
with and without out= (and mask=), against a cupy.ElementwiseKernel
(LeakyReLU) that allocates its output and one that writes into a given one,
with a copy and cupy.maximum as further anchors. Last come the floors: the
design floor (``bare_relu``: relu with nothing but the necessary work), also
as a Function of our signature (5 inputs, ctx.args, no materialized grads),
and a Python autograd.Function around torch's own relu.

``--conv``: instead, the fused convolution block on a tiny input: PyTorch's
eager block, ours as it trains in eager mode, and ours through the custom op
that torch.compile and torch.func take.

``--conv-nograd``: instead, the no-grad "fused_tf32" forward's host path:
part by part at the seed's geometry for one image (back to back, and one
call right after a synchronize), the seed's single shots (the whole call,
without the checks, the prepared launch alone; ``torch.neg`` also after the
host waited for 0.27 and 1 ms of GPU work), and the path's steps with a
host clock after each.

``--conv-train``: instead, the seed block's training forward and steps
(``conv2d_div_leaky_relu(...).backward(gy)``, "fused" and "fused_tf32", x
needing a gradient or not) in single shots, the adapter's path now and as
the twenty-ninth session left it, interleaved; then (not with ``--no-clocks``)
such steps with a host clock around each function of the adapter's path:
when each started and how long it took, from the step's start, against when
the GPU ended the forward and the step. ``PYTHONPATH=<another tree>`` times
that tree's adapter with this script.

``--bn``: instead, BatchNorm + LeakyReLU on a small N x C x H x W tensor
(``--shape``), training, the input a non-leaf and the parameters trained:
PyTorch's pair (``nn.BatchNorm2d``, ``nn.LeakyReLU(inplace=True)``),
``cupy_act.torch.BatchNormAct2d`` in both memory modes, and its floor: the
same module and bookkeeping with ``BareBatchNormAct`` in place of the kernels'
Function (it allocates what ours allocates and launches nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import cupy_act.torch as ct
from cupy_act import testing


def per_call_us(fns, calls: int, repeats: int) -> list[float]:
    """Least time per call of each function, their repeats interleaved (so a
    slow spell of the host hits all of them alike)."""
    for fn in fns:
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-cupy", action="store_true", help="skip the CuPy API rows")
    ap.add_argument("--bn", action="store_true", help="the BatchNorm + LeakyReLU rows only")
    ap.add_argument("--shape", nargs=4, type=int, default=[8, 64, 16, 16], help="for --bn")
    ap.add_argument("--conv", action="store_true", help="the fused convolution block's rows only")
    ap.add_argument(
        "--conv-nograd", action="store_true", help="the no-grad fused forward's host path, by part"
    )
    ap.add_argument(
        "--conv-train", action="store_true", help="a fused training step's host path, by function"
    )
    ap.add_argument("--no-clocks", action="store_true", help="--conv-train's single shots only")
    args = ap.parse_args()
    if args.conv_train:
        conv_train_shots()
        if not args.no_clocks:
            conv_train_steps()
        return
    if args.conv_nograd:
        conv_nograd_rows(args.calls, args.repeats)
        conv_nograd_steps()
        return
    if args.bn:
        bn_rows(args.shape, args.calls, args.repeats)
        return
    if args.conv:
        conv_rows(args.calls, args.repeats)
        return
    x = torch.randn(args.n, device="cuda")
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg), xg, g)

    def on_nonleaf(f, backward):  # on x * 1 (a non-leaf, as in a model): in place is allowed
        if backward:
            return lambda: torch.autograd.grad(f(xg * 1), xg, g)
        return lambda: f(xg * 1)

    def leaky(inplace=False):
        return lambda t: F.leaky_relu(t, 0.01, inplace=inplace)

    def ct_leaky(inplace=False):
        return lambda t: ct.leaky_relu(t, 0.01, inplace=inplace)

    def relu(inplace=False):
        return lambda t: F.relu(t, inplace=inplace)

    def ct_relu(inplace=False):
        return lambda t: ct.relu(t, inplace=inplace)

    cases = [
        ("relu fwd", lambda: F.relu(x), lambda: ct.relu(x)),
        ("leaky_relu fwd", lambda: F.leaky_relu(x, 0.01), lambda: ct.leaky_relu(x, 0.01)),
        (
            "div_leaky_relu fwd",
            lambda: F.leaky_relu(x / 2.0, 0.01),
            lambda: ct.div_leaky_relu(x, 2.0, 0.01),
        ),
        ("relu fwd+bwd", fwd_bwd(F.relu), fwd_bwd(ct.relu)),
        ("leaky_relu fwd+bwd", fwd_bwd(leaky()), fwd_bwd(ct_leaky())),
        (
            "div_leaky_relu fwd+bwd",
            fwd_bwd(lambda t: F.leaky_relu(t / 2.0, 0.01)),
            fwd_bwd(lambda t: ct.div_leaky_relu(t, 2.0, 0.01)),
        ),
    ]
    # In place against out of place, both under autograd on x * 1: the forward
    # alone (the graph is built, not run) and forward + backward.
    for name, ref, ours in (("relu", relu, ct_relu), ("leaky_relu", leaky, ct_leaky)):
        for backward, what in ((False, "fwd (grad)"), (True, "fwd+bwd")):
            for inplace in (False, True):
                cases.append(
                    (
                        f"{name} {what} x*1{' in place' if inplace else ''}",
                        on_nonleaf(ref(inplace), backward),
                        on_nonleaf(ours(inplace), backward),
                    )
                )
    print(
        f"\nhost time per call, {args.n} float32 elements, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}"
    )
    print(f"{'case':34s} {'torch us':>9s} {'cupy_act us':>12s} {'ratio':>7s}")
    ours_us = {}
    # Every case runs once before any is timed, so the first row is not also
    # the process's first work (the host's clocks and caches settle first).
    per_call_us([f for _, ref, ours in cases for f in (ref, ours)], args.calls, 1)
    for name, ref, ours in cases:
        t_ref, t_ours = per_call_us((ref, ours), args.calls, args.repeats)
        ours_us[name] = t_ours
        print(f"{name:34s} {t_ref:9.2f} {t_ours:12.2f} {t_ours / t_ref:6.2f}x")
    print("cupy_act in place / out of place, same run:")
    for name in ours_us:
        if name.endswith(" in place"):
            oop = name[: -len(" in place")]
            print(f"  {oop:32s} {ours_us[name] / ours_us[oop]:6.3f}x")

    # The floor for any Python autograd.Function: one that only calls torch's own
    # relu and threshold_backward, timed against F.relu in the same way; then
    # the floor of this design, timed against F.relu and ours.
    if not args.no_cupy:
        cupy_rows(args.n, args.calls, args.repeats)
    design_floor_rows(x, xg, g, args.calls, args.repeats)
    for label, ref, floor in (
        ("torch.relu", fwd_bwd(F.relu), fwd_bwd(_TorchRelu.apply)),
        (
            "torch.relu_, x*1",
            on_nonleaf(relu(True), True),
            on_nonleaf(lambda t: _TorchRelu.apply(t, True), True),
        ),
    ):
        t_ref, t_floor = per_call_us((ref, floor), args.calls, args.repeats)
        print(
            f"floor: a Python autograd.Function around {label}, fwd+bwd {t_floor:.2f} us "
            f"= {t_floor / t_ref:.2f}x torch's {t_ref:.2f} us"
        )


def cupy_rows(n: int, calls: int, repeats: int) -> None:
    """The CuPy API against CuPy's own calls, every op and kind, with and without out=."""
    import cupy

    import cupy_act

    # (from the host: the lean CUDA extras install no cuRAND for cupy.random)
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
    dy = cupy.asarray(rng.standard_normal(n, dtype=numpy.float32))
    y, y2 = cupy.empty_like(x), cupy.empty_like(x)
    ek = cupy.ElementwiseKernel("T x, T s", "T y", "y = x > 0 ? x : x * s", "cupy_act_leaky")
    _, mask = cupy_act.leaky_relu_with_mask(x, 0.01)
    mask2 = cupy.empty_like(mask)
    anchors = {  # CuPy's own: a new output, and into y
        "new": lambda: ek(x, cupy.float32(0.01)),
        "out": lambda: ek(x, cupy.float32(0.01), y),
    }
    ours = [
        ("relu", lambda: cupy_act.relu(x), lambda: cupy_act.relu(x, out=y2)),
        (
            "leaky_relu",
            lambda: cupy_act.leaky_relu(x, 0.01),
            lambda: cupy_act.leaky_relu(x, 0.01, out=y2),
        ),
        (
            "div_leaky_relu",
            lambda: cupy_act.div_leaky_relu(x, 2.0),
            lambda: cupy_act.div_leaky_relu(x, 2.0, out=y2),
        ),
        (
            "relu_with_mask",
            lambda: cupy_act.relu_with_mask(x),
            lambda: cupy_act.relu_with_mask(x, out=y2, mask=mask2),
        ),
        (
            "leaky_relu_with_mask",
            lambda: cupy_act.leaky_relu_with_mask(x, 0.01),
            lambda: cupy_act.leaky_relu_with_mask(x, 0.01, out=y2, mask=mask2),
        ),
        (
            "div_leaky_relu_with_mask",
            lambda: cupy_act.div_leaky_relu_with_mask(x, 2.0),
            lambda: cupy_act.div_leaky_relu_with_mask(x, 2.0, out=y2, mask=mask2),
        ),
        (
            "relu_backward",
            lambda: cupy_act.relu_backward(dy, mask),
            lambda: cupy_act.relu_backward(dy, mask, out=y2),
        ),
        (
            "leaky_relu_backward",
            lambda: cupy_act.leaky_relu_backward(dy, mask, 0.01),
            lambda: cupy_act.leaky_relu_backward(dy, mask, 0.01, out=y2),
        ),
        (
            "div_leaky_relu_backward",
            lambda: cupy_act.div_leaky_relu_backward(dy, mask, 2.0),
            lambda: cupy_act.div_leaky_relu_backward(dy, mask, 2.0, out=y2),
        ),
    ]
    print(f"\nCuPy API, host time per call, {n} float32 elements (x: cupy.ElementwiseKernel's)")
    copy, maximum = per_call_us(
        (lambda: y.__setitem__(Ellipsis, x), lambda: cupy.maximum(x, 0, out=y)), calls, repeats
    )
    print(f"anchors: y[...] = x {copy:.2f} us, cupy.maximum(x, 0, out=y) {maximum:.2f} us")
    print(
        f"{'op':26s} {'EK new':>8s} {'ours':>8s} {'x':>6s} "
        f"{'EK out=':>8s} {'ours out=':>9s} {'x':>6s}"
    )
    for name, new, out in ours:
        t = per_call_us((anchors["new"], new, anchors["out"], out), calls, repeats)
        print(
            f"{name:26s} {t[0]:8.2f} {t[1]:8.2f} {t[1] / t[0]:5.2f}x {t[2]:8.2f} {t[3]:9.2f} "
            f"{t[3] / t[2]:5.2f}x"
        )


def bare_relu(x):
    """relu from Python as this design does it, with nothing but the work every
    call must do, for tensors shaped like x: (forward, Function, run). The
    forward allocates y and launches our kernel through CuPy's driver binding
    with an argument block packed in advance. The Function (to be called
    through the C++ apply, as ours is) also allocates and saves the mask; its
    backward allocates dx and launches the backward kernel. run(kind, src,
    dst, mask_ptr) is one such launch. No checks, no routing, no caches."""
    import cupy

    from cupy_act._launch import _HEAD
    from cupy_act._plan import plan

    launch_kernel = cupy.cuda.driver.launchKernel
    raw_stream = torch._C._cuda_getCurrentRawStream
    n, dev = x.numel(), x.get_device()
    words = (n + 127) // 128 * 4
    u8 = x.new_empty(0, dtype=torch.uint8)

    def bare(kind):
        p = plan(dev, "relu", "float32", kind, False, 0.0, 1.0, "design floor")
        k = p.kernel
        buf = ctypes.create_string_buffer(p._block0, len(p._block0))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        blocks = min(-(-n // k.per_block), k.max_blocks)
        return buf, argv, ctypes.addressof(argv), (k.ptr, blocks, 1, 1, k.threads, 1, 1, 0)

    blocks = {kind: bare(kind) for kind in ("forward", "forward_mask", "backward")}

    def run(kind, src, dst, mask):
        b = blocks[kind]
        _HEAD.pack_into(b[0], 0, src.data_ptr(), dst.data_ptr(), mask, 0, n, words, 1, 1)
        launch_kernel(*b[3], raw_stream(dev), b[2], 0)

    def forward(t):
        y = torch.empty_like(t)
        run("forward", t, y, 0)
        return y

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            y = torch.empty_like(t)
            m = u8.new_empty(words * 4)
            run("forward_mask", t, y, m.data_ptr())
            ctx.save_for_backward(m)
            return y

        @staticmethod
        def backward(ctx, gy):
            (m,) = ctx.saved_tensors
            dx = torch.empty_like(gy)
            run("backward", gy, dx, m.data_ptr())
            return dx

    return forward, Bare, run


def design_floor_rows(x, xg, g, calls: int, repeats: int) -> None:
    """The floor of this design (``bare_relu``) against torch and ours: the
    difference from ours is all of our Python glue, from torch the design's."""
    forward, bare, _ = bare_relu(x)

    class Shaped(torch.autograd.Function):  # the bare work in our Function's shape
        @staticmethod
        def forward(ctx, t, bias, op, slope, divisor):
            ctx.set_materialize_grads(False)
            ctx.args = (op, slope, divisor, False)
            return bare.forward(ctx, t)

        @staticmethod
        def backward(ctx, gy):
            return bare.backward(ctx, gy), None, None, None, None

    bare_apply = super(torch.autograd.Function, bare).apply  # the C++ apply, as ours
    shaped_apply = super(torch.autograd.Function, Shaped).apply
    t_ref, t_bare, t_shaped, t_ours = per_call_us(
        (
            lambda: torch.autograd.grad(F.relu(xg), xg, g),
            lambda: torch.autograd.grad(bare_apply(xg), xg, g),
            lambda: torch.autograd.grad(shaped_apply(xg, None, "relu", 0.0, 1.0), xg, g),
            lambda: torch.autograd.grad(ct.relu(xg), xg, g),
        ),
        calls,
        repeats,
    )
    t_fref, t_fbare, t_fours = per_call_us(
        (lambda: F.relu(x), lambda: forward(x), lambda: ct.relu(x)), calls, repeats
    )
    for label, r, floor, ours in (
        ("relu fwd", t_fref, t_fbare, t_fours),
        ("relu fwd+bwd", t_ref, t_bare, t_ours),
    ):
        print(
            f"design floor, {label}: {floor:.2f} us = {floor / r:.2f}x torch's "
            f"{r:.2f} us; ours {ours:.2f} us = {ours / r:.2f}x"
        )
    print(
        f"design floor in our Function's shape (5 inputs, ctx.args, no materialized "
        f"grads), relu fwd+bwd: {t_shaped:.2f} us = {t_shaped / t_ref:.2f}x"
    )


class BareBatchNormAct(torch.autograd.Function):
    """The floor of the fused BatchNorm's adapter: ``FusedBatchNormAct``'s
    signature and allocations (output, mask, statistics and scratch; dx, the
    parameter gradients and scratch) with no kernel launched. Its outputs
    hold garbage, and ``num_batches_tracked`` is not counted."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, count, factor, eps, mode):
        c = x.shape[1]
        y = x if mode.inplace else torch.empty_like(x)
        mask = None
        if not mode.inplace:
            mask = torch.empty(-(-x.numel() // 32), dtype=torch.int32, device=x.device)
        stats = torch.empty(4 * c, dtype=torch.float64, device=x.device)  # (and scratch)
        if mode.inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(y, weight, bias, stats, mask)
        ctx.args = mode
        return y

    @staticmethod
    def backward(ctx, gy):  # (ours takes once_differentiable's wrapper only with create_graph)
        x, weight, bias, stats, mask = ctx.saved_tensors
        c = x.shape[1]
        gw, gb = torch.empty(c, device=x.device), torch.empty(c, device=x.device)
        torch.empty(4 * c, dtype=torch.float64, device=x.device)  # (the scratch buffer)
        return torch.empty_like(x), gw, gb, *(None,) * 6


def bare_batchnorm(fn):
    """fn with BatchNormAct2d's kernels replaced by BareBatchNormAct."""
    from cupy_act.torch import batchnorm

    def bare(*args):
        saved = batchnorm._apply_fused
        batchnorm._apply_fused = BareBatchNormAct.apply
        try:
            return fn(*args)
        finally:
            batchnorm._apply_fused = saved

    return bare


def bn_rows(shape, calls: int, repeats: int) -> None:
    """Host time per call of BatchNorm + LeakyReLU: PyTorch's pair, ours in both
    memory modes, and ours with no kernels (the adapter's floor)."""
    from torch import nn

    n, c, h, w = shape
    x = torch.randn(n, c, h, w, device="cuda", requires_grad=True)
    g = torch.randn_like(x)
    pair = nn.Sequential(nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)).cuda()
    mods = {
        "pytorch": pair,
        "ours": ct.BatchNormAct2d(c, act_layer="leaky_relu").cuda(),
        "ours in place": ct.BatchNormAct2d(c, act_layer="leaky_relu", memory="inplace").cuda(),
    }
    mods["floor (no kernels)"] = bare_batchnorm(mods["ours"])

    def params(m):
        return tuple(getattr(m, "parameters", lambda: mods["ours"].parameters())())

    def forward(m):
        return lambda: m(x * 1)

    def fwd_bwd(m):
        wrt = (x, *params(m))
        return lambda: torch.autograd.grad(m(x * 1), wrt, g)

    print(
        f"\nBatchNorm + LeakyReLU host time per call, {tuple(shape)} float32, training,"
        f" {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"{'':22s}" + "".join(f"{k:>20s}" for k in mods))
    for what, make in (("fwd (grad)", forward), ("fwd+bwd", fwd_bwd)):
        us = per_call_us([make(m) for m in mods.values()], calls, repeats)
        cells = "".join(f"{t:12.2f} us {t / us[0]:4.2f}x" for t in us)
        print(f"{what:22s}{cells}", flush=True)


def conv_rows(calls: int, repeats: int) -> None:
    """Host time per call of the convolution block on a tiny input (the GPU's
    work negligible): PyTorch's eager block, ours ("fused") as it trains in
    eager mode, and ours through the custom op that torch.compile and
    torch.func take (conv.fused_op, its autograd registered on the op)."""
    import torch.nn.functional as F

    from cupy_act.torch import conv

    x = torch.randn(2, 8, 18, 18, device="cuda")
    w = (torch.randn(64, 8, 3, 3, device="cuda") * 0.1).requires_grad_()
    b = torch.randn(64, device="cuda").requires_grad_()
    g = torch.randn(2, 64, 16, 16, device="cuda")
    impls = {
        "pytorch": lambda: F.leaky_relu(F.conv2d(x, w, b) / 2.0, 0.01),
        "ours": lambda: ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm="fused"),
        "ours, custom op": lambda: conv.fused_op(
            x, w, b, 2.0, 0.01, [1, 1], [0, 0], [1, 1], False, True
        )[0],
    }
    kept = {k: f() for k, f in impls.items()}

    def fwd_bwd(k):
        return lambda: torch.autograd.grad(impls[k](), (w, b), g)

    def bwd(k):
        return lambda: torch.autograd.grad(kept[k], (w, b), g, retain_graph=True)

    print(
        f"\nconv -> divide -> LeakyReLU host time per call, x {tuple(x.shape)}, w "
        f"{tuple(w.shape)}, float32, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"{'':22s}" + "".join(f"{k:>20s}" for k in impls))
    for what, make in (("fwd (grad)", impls.get), ("fwd+bwd", fwd_bwd), ("bwd", bwd)):
        us = per_call_us([make(k) for k in impls], calls, repeats)
        cells = "".join(f"{t:12.2f} us {t / us[0]:4.2f}x" for t in us)
        print(f"{what:22s}{cells}", flush=True)


def after_sync_us(fns, calls: int) -> list[float]:
    """Median host time of one call of each function made right after a
    synchronize (the host's state in a single-shot timing), interleaved."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for i, fn in enumerate(fns):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return [statistics.median(t) for t in times]


def conv_nograd_rows(calls: int, repeats: int) -> None:
    """The no-grad "fused_tf32" forward's host path at the seed's geometry
    for one image (the GPU's work a few us), by part, against ``torch.neg``:
    per call back to back, and one call right after a synchronize."""
    import cupy

    from cupy_act import _conv, _launch
    from cupy_act.torch import _impl, conv

    x = torch.randn(1, 8, 128, 128, device="cuda")
    w = torch.randn(64, 8, 3, 3, device="cuda") * 0.1
    b = torch.randn(64, device="cuda")
    t = torch.randn(64, device="cuda")
    g = _conv.geometry("overhead", x.shape, w.shape, 1, 0, 1)
    y = torch.empty(g.out_shape, device="cuda")
    dev = x.get_device()
    stream = _impl._raw_stream(dev)
    ptrs = (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 0)
    run = _conv.forward_launch(dev, "float32", "tf32", False, g)
    c1 = conv._checked(x, w, b, 2.0, 0.01, 1, 0, 1, "fused_tf32")
    no_grad = (2.0, 0.01, True, False)  # divisor, slope, TF32, no mask
    slope, scale = _conv._scalars(0.01, 2.0, "overhead")
    empty = cupy.RawKernel('extern "C" __global__ void f(float* p) {}', "f").kernel
    ctx = run.main.ctx
    arg = ctypes.c_void_p(y.data_ptr())
    args = (ctypes.c_void_p * 1)(ctypes.addressof(arg))  # (kept alive while timed)
    argv = ctypes.addressof(args)
    parts = {
        "torch.neg (launch floor)": lambda: torch.neg(t),
        "ours, no grad": lambda: ct.conv2d_div_leaky_relu(
            x, w, b, 2.0, 0.01, algorithm="fused_tf32"
        ),
        "_checked": lambda: conv._checked(x, w, b, 2.0, 0.01, 1, 0, 1, "fused_tf32"),
        "_kept_forward": lambda: conv._kept_forward(x, w, b, c1.g, c1.launches, *no_grad),
        "torch.empty (y)": lambda: torch.empty(g.out_shape, dtype=x.dtype, device=x.device),
        "_conv.launch": lambda: _conv.launch(
            dev, "float32", "tf32", False, g, stream, *ptrs, 0.01, 2.0, "overhead", have=run.need
        ),
        "forward_launch (lookup)": lambda: _conv.forward_launch(dev, "float32", "tf32", False, g),
        "prepared launch": lambda: run(stream, *ptrs, slope, scale, have=run.need),
        "  its fill": lambda: run.tmap.fill(*ptrs, slope, scale),
        "  its x map": lambda: run.x_map.at(ptrs[0]),
        "  the kernel without map": lambda: run.main.fire(
            stream, run.main.fill(*ptrs, slope, scale).argv_ptr
        ),
        "  an empty kernel": lambda: _launch.run(empty.ptr, ctx, (1, 1), 32, stream, argv),
    }
    with torch.no_grad():
        loop = per_call_us(list(parts.values()), calls, repeats)
        cold = after_sync_us(list(parts.values()), 300)
    print(
        f"\nno-grad fused_tf32 forward, host time per call (us), x {tuple(x.shape)}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    print(f"{'':28s}{'back to back':>14s}{'after a sync':>14s}")
    for name, a, c in zip(parts, loop, cold):
        print(f"{name:28s}{a:14.2f}{c:14.2f}", flush=True)
    # The seed's forward as conv_bench times it: from the host's call to the
    # GPU's end, and with the GPU kept busy meanwhile (its time alone); and
    # the same launch with less of the host's path before it; two rounds.
    xs = torch.randn(128, 8, 128, 128, device="cuda")
    gs = _conv.geometry("overhead", xs.shape, w.shape, 1, 0, 1)
    ys = torch.empty(gs.out_shape, device="cuda")
    seed_run = _conv.forward_launch(dev, "float32", "tf32", False, gs)
    cs = conv._checked(xs, w, b, 2.0, 0.01, 1, 0, 1, "fused_tf32")
    seed_ptrs = (xs.data_ptr(), ptrs[1], ptrs[2], ys.data_ptr(), 0)
    shots = {
        "torch.neg": lambda: torch.neg(t),
        "seed forward": lambda: ct.conv2d_div_leaky_relu(
            xs, w, b, 2.0, 0.01, algorithm="fused_tf32"
        ),
        "  its _kept_forward": lambda: conv._kept_forward(xs, w, b, cs.g, cs.launches, *no_grad),
        "  its prepared launch": lambda: seed_run(stream, *seed_ptrs, slope, scale),
    }
    # torch.neg also after the GPU worked as long as the seed's kernel, the
    # host waiting (settle_ms): each single shot of the forward starts so.
    settled = {"torch.neg after 0.27 ms": 0.27, "torch.neg after 1 ms": 1.0}
    print("single shot, us (median of 41): host to GPU end, GPU alone, the host's share")
    with torch.no_grad():
        for _ in range(2):
            for name, fn in shots.items():
                one = testing.median_ms(fn, iters=41) * 1e3
                alone = testing.median_ms(fn, iters=41, queued_ms=4.0) * 1e3
                print(f"{name:28s}{one:10.1f}{alone:10.1f}{one - alone:10.1f}", flush=True)
            for name, ms in settled.items():
                one = testing.median_ms(shots["torch.neg"], iters=41, settle_ms=ms) * 1e3
                alone = testing.median_ms(shots["torch.neg"], iters=41, queued_ms=4.0) * 1e3
                print(f"{name:28s}{one:10.1f}{alone:10.1f}{one - alone:10.1f}", flush=True)


def conv_nograd_steps(samples: int = 200) -> None:
    """The no-grad "fused_tf32" seed forward's host path step by step: the
    steps of ``conv2d_div_leaky_relu`` and ``_kept_forward`` (a copy, with
    a host clock after each), each sample right after the host waited for
    0.27 ms of GPU work, as a single shot of the forward finds it. Median us
    per step."""
    from cupy_act import _conv
    from cupy_act.torch import _impl, conv

    x = torch.randn(128, 8, 128, 128, device="cuda")
    w = torch.randn(64, 8, 3, 3, device="cuda") * 0.1
    b = torch.randn(64, device="cuda")
    clock = time.perf_counter_ns
    args = (2.0, 0.01)
    names = ("checks", "grad mode and route", "operands and y", "kept launch, scalars",
             "pointers and stream", "launch")  # fmt: skip
    steps: list[list[float]] = [[] for _ in names]
    ys = []
    with torch.no_grad():
        for i in range(samples + 5):
            testing._queue_gpu(0.27)
            torch.cuda.synchronize()
            t = [clock()]
            c = conv._checked(x, w, b, *args, 1, 0, 1, "fused_tf32")
            t.append(clock())
            needs = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
            ok = "fused_tf32".startswith("fused") and c.fusable[1] and not needs
            divisor, slope = float(args[0]), float(args[1])
            ok = ok and not torch.compiler.is_compiling()
            t.append(clock())
            xd, wd, bd, y, cl = conv._operands(x, w, b, c.g)
            t.append(clock())
            k = c.launches.get((True, cl, _conv.FORWARD_TMAP, _conv.FORWARD_SEAMS))
            if k is None:
                conv._kept_forward(x, w, b, c.g, c.launches, divisor, slope, True, False)
                k = c.launches[(True, cl, _conv.FORWARD_TMAP, _conv.FORWARD_SEAMS)]
            sl, sc = _conv._scalars(slope, divisor, conv.FNAME)
            t.append(clock())
            stream = _impl._raw_stream(k.dev)
            p = (xd.data_ptr(), wd.data_ptr(), bd.data_ptr(), y.data_ptr(), 0)
            t.append(clock())
            k.run(stream, *p, sl, sc, have=k.run.need)
            t.append(clock())
            ys.append(y)
            del ys[:-1]
            if i >= 5:
                for j in range(len(names)):
                    steps[j].append((t[j + 1] - t[j]) / 1e3)
    torch.cuda.synchronize()
    print(f"\nthe no-grad forward's host path after 0.27 ms of GPU work, median us of {samples}")
    for name, v in zip(names, steps):
        print(f"  {name:28s}{statistics.median(v):8.2f}")
    print(f"  {'sum of medians':28s}{sum(statistics.median(v) for v in steps):8.2f}")


def _seed_block():
    """The seed block's x, weight, bias and an upstream gradient."""
    torch.manual_seed(0)
    x = torch.randn(128, 8, 128, 128, device="cuda")
    w = torch.randn(64, 8, 3, 3, device="cuda") * 0.1
    b = torch.randn(64, device="cuda")
    return x, w, b, torch.randn(128, 64, 126, 126, device="cuda")


class _FusedBefore(torch.autograd.Function):
    """The fused training forward as the twenty-ninth session left it (for
    ``conv_train_shots``): through Function.apply's Python wrapper, the mask
    by ``torch.zeros`` and the launch looked up per call (``_conv.launch``);
    the same backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, divisor, slope, tf32, c):
        from cupy_act import _conv, mask_nbytes
        from cupy_act.torch import _impl, conv

        x, w, b, y, cl = conv._operands(x, weight, bias, c.g)
        mask = torch.zeros(mask_nbytes(y.numel()), dtype=torch.uint8, device=x.device)
        dev = x.get_device()
        ptrs = (x.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr())
        precision = "tf32" if tf32 else "fp32"
        stream = _impl._raw_stream(dev)
        args = (*ptrs, mask.data_ptr(), slope, divisor, conv.FNAME)
        dtype = _impl.DTYPE_NAMES[x.dtype]
        have = _conv.extents(c.g, dtype)
        _conv.launch(dev, dtype, precision, cl, c.g, stream, *args, have=have)
        stride, padding, dilation = c.spd
        conv._save(ctx, x, weight, bias, mask, slope, divisor, stride, padding, dilation, tf32, c.g)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        from cupy_act.torch import conv

        return *conv._grads(ctx, gy, True), *(None,) * 4


def conv_train_shots(rounds: int = 41) -> None:
    """Single shots of the seed block's training forward (x needing no
    gradient) and whole steps, "fused" and "fused_tf32", as conv_bench times
    them, the adapter's path now and as it was (``_FusedBefore``), interleaved
    round after round; and the GPU's time alone (us)."""
    from cupy_act.torch import conv

    x0, w0, b0, gy = _seed_block()
    w, b = (t.clone().requires_grad_() for t in (w0, b0))
    x = x0.clone().requires_grad_()

    def before(xs, a):
        c = conv._checked(xs, w, b, 2.0, 0.01, 1, 0, 1, a)
        return _FusedBefore.apply(xs, w, b, 2.0, 0.01, a == "fused_tf32", c)

    def now(xs, a):
        return ct.conv2d_div_leaky_relu(xs, w, b, 2.0, 0.01, algorithm=a)

    def step(f, xs, a):
        def run():
            xs.grad = w.grad = b.grad = None
            f(xs, a).backward(gy)

        return run

    print(f"\nsingle shots, us (median of {rounds}, interleaved): now, before, GPU alone")
    for a in ("fused", "fused_tf32"):
        cases = {
            "forward, x no grad": {f: lambda f=f: f(x0, a) for f in (now, before)},
            "fwd+bwd, x no grad": {f: step(f, x0, a) for f in (now, before)},
            "fwd+bwd, x needs grad": {f: step(f, x, a) for f in (now, before)},
        }
        for name, fns in cases.items():
            t = testing.interleaved_median_ms(fns, rounds=rounds, single_shot=True)
            alone = testing.median_ms(fns[now], iters=rounds, queued_ms=4.0)
            print(f"  {a:11s}{name:24s}{t[now] * 1e3:9.1f}{t[before] * 1e3:9.1f}{alone * 1e3:9.1f}")


def conv_train_steps(samples: int = 40) -> None:
    """Single-shot training steps of the seed block with each of the adapter's
    functions on its path wrapped in host clocks (``--conv-train``). Per
    function, medians over the steps: calls per step, when the first began
    and how long all took (us from the step's start). The wrappers add about
    0.3 us per call."""
    from cupy_act import _conv
    from cupy_act.torch import conv

    calls: dict[str, list] = {}

    def wrap(owner, name: str) -> None:
        fn = getattr(owner, name)

        def clocked(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                calls.setdefault(name, []).append((t, time.perf_counter_ns()))

        setattr(owner, name, clocked)

    # (what a version has: the script also times an older tree's path)
    for owner, names in (
        (conv, ("_checked", "_kept_forward", "_forward", "_operands", "_save", "_grads",
                "_route", "fused_wgrad", "fused_dgrad")),
        (_conv, ("launch", "wgrad_launch", "launch_wgrad", "launch_dgrad")),
        (torch, ("zeros", "empty")),
    ):  # fmt: skip
        for name in names:
            if hasattr(owner, name):
                wrap(owner, name)
    x0, w0, b0, gy = _seed_block()
    clock = time.perf_counter_ns
    for algorithm in ("fused", "fused_tf32"):
        for x_grad in (False, True):
            x, w, b = (t.clone().requires_grad_(t is not x0 or x_grad) for t in (x0, w0, b0))
            table: dict[str, list] = {}
            for i in range(samples + 5):
                x.grad = w.grad = b.grad = None
                torch.cuda.synchronize()
                calls.clear()
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                t0 = clock()
                e[0].record()
                y = ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm=algorithm)
                e[1].record()
                t1 = clock()
                y.backward(gy)
                t2 = clock()
                e[2].record()
                e[2].synchronize()
                if i < 5:
                    continue
                rows = {
                    "forward returned": (1, t1 - t0, 0),
                    "backward returned": (1, t2 - t0, 0),
                    "GPU: forward ended": (1, e[0].elapsed_time(e[1]) * 1e6, 0),
                    "GPU: step ended": (1, e[0].elapsed_time(e[2]) * 1e6, 0),
                }
                for name, v in calls.items():
                    rows[name] = (len(v), v[0][0] - t0, sum(f - s for s, f in v))
                for name, r in rows.items():
                    table.setdefault(name, []).append(r)
            print(f"\n{algorithm}, x {'needs' if x_grad else 'needs no'} gradient: "
                  f"median of {samples} single-shot steps, us from the step's start")  # fmt: skip
            print(f"  {'':24s}{'calls':>6s}{'first at':>10s}{'took':>9s}")
            for name, v in sorted(
                table.items(), key=lambda kv: statistics.median(r[1] for r in kv[1])
            ):
                n, at, took = (statistics.median(r[j] for r in v) for j in range(3))
                print(f"  {name:24s}{n:6.0f}{at / 1e3:10.1f}{took / 1e3:9.1f}")


class _TorchRelu(torch.autograd.Function):
    """torch.relu (or relu_) and threshold_backward, saving the output as PyTorch does."""

    @staticmethod
    def forward(ctx, x, inplace=False):
        y = torch.relu_(x) if inplace else torch.relu(x)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, gy):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(gy, y, 0), None


if __name__ == "__main__":
    main()
