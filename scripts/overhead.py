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

``--bn``: instead, BatchNorm + LeakyReLU on a small N x C x H x W tensor
(``--shape``), training, the input a non-leaf and the parameters trained:
PyTorch's pair (``nn.BatchNorm2d``, ``nn.LeakyReLU(inplace=True)``),
``cupy_act.torch.BatchNormAct2d`` in both memory modes, and its floor: the
same module and bookkeeping with ``BareBatchNormAct`` in place of the kernels'
Function (it allocates what ours allocates and launches nothing). Then the
same compiled with ``torch.compile`` (default mode: no CUDA graphs, so each
call's host work counts), PyTorch's pair against the in-place module (the
default policy's op, ``cupy_act::batchnorm_act`` and its backward), and the
two ops called as a compiled graph calls them: the host cost a compiled step
pays per BatchNorm where no CUDA graph replays it, and the floor of such an
op: one registered the same way that only allocates what our forward does.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy
import torch
import torch.nn.functional as F

import cupy_act.torch as ct


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
    args = ap.parse_args()
    import measure  # (scripts/measure.py, beside this script)

    measure.require_gpu("overhead.py")
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
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, count, factor, eps,
                mode):  # fmt: skip
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
        return torch.empty_like(x), gw, gb, *(None,) * 7


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
    compiled_bn_rows(x, g, pair, mods["ours in place"], calls, repeats)


def _floor_op():
    """A custom op (registered once) as ours are (``Library.define`` + a
    Python ``impl``) that allocates what our forward op allocates (y, the
    statistics, the work area, the mask) and does nothing else: the host
    cost of any such op, before checks and launches."""
    if _floor_libs:
        return torch.ops.cupy_act_floor.alloc
    lib = torch.library.Library("cupy_act_floor", "FRAGMENT")
    lib.define("alloc(Tensor x, int[] sizes) -> (Tensor, Tensor, Tensor)")

    def alloc(x, sizes):
        stats, work, words = sizes
        x.new_empty(work, dtype=torch.float64)  # (the work area, dead at once)
        return (torch.empty_like(x), x.new_empty(stats, dtype=torch.float64),
                x.new_empty(words, dtype=torch.int32))  # fmt: skip

    lib.impl("alloc", alloc, "CompositeExplicitAutograd")
    _floor_libs.append(lib)  # (the registration lives as long as the library object)
    return torch.ops.cupy_act_floor.alloc


_floor_libs: list = []


def op_calls(x, g, ours) -> dict:
    """Our forward and backward ops called as a compiled graph calls them
    (in-place mode, training, the running statistics updated) on x and g,
    and the floor op allocating what the forward does: name -> a call."""
    c = x.shape[1]
    w, b = ours.weight.detach(), ours.bias.detach()
    rm, rv = ours.running_mean.clone(), ours.running_var.clone()
    op = torch.ops.cupy_act
    args = (x.detach(), w, b, None, None, None, 1e-5, "leaky_relu", 0.01, False, True, True,
            None, rm, rv, 0.1)  # fmt: skip
    y, stats, mask = op.batchnorm_act(*args)
    floor = _floor_op()
    sizes = (stats.numel(), 2 * c * 1024, mask.numel())  # (the work area: a typical split count)
    return {
        "our forward op": lambda: op.batchnorm_act(*args),
        "our backward op": lambda: op.batchnorm_act_backward(
            y, g, mask, w, b, stats, None, "leaky_relu", 0.01, False, True, True, True, False
        ),
        "floor op (no kernels)": lambda: floor(x, sizes),
    }


def compiled_bn_rows(x, g, pair, ours, calls: int, repeats: int) -> None:
    """Host time per compiled fwd+bwd call (torch.compile, default mode) of
    PyTorch's pair and of our in-place module, and of our two ops alone."""
    torch._dynamo.reset()
    steps = {}
    # (two functions, two code objects: Dynamo keeps its compiled entries per
    # code object, and one lambda compiled for both modules would have each
    # call check the other module's guards too)
    theirs_fn = torch.compile(lambda t: pair(t * 1), dynamic=False)
    ours_fn = torch.compile(lambda t: ours(t * 1), dynamic=False)
    for name, m, fn in (("pytorch, compiled", pair, theirs_fn),
                        ("ours in place, compiled", ours, ours_fn)):  # fmt: skip
        wrt = (x, *m.parameters())
        steps[name] = lambda fn=fn, wrt=wrt: torch.autograd.grad(fn(x), wrt, g)
    steps |= op_calls(x, g, ours)
    us = per_call_us(list(steps.values()), calls, repeats)
    print(f"\ncompiled (default mode, no CUDA graphs), {x.shape[1]} channels: host time per call")
    for (name, _), t in zip(steps.items(), us):
        print(f"{name:26s}{t:10.2f} us {t / us[0]:5.2f}x", flush=True)
    torch._dynamo.reset()


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
