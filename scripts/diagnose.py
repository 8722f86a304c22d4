"""One-off diagnostics behind docs/performance-notes.md (development tools).

    PYTHONPATH=. python scripts/diagnose.py mask   # where forward-with-mask loses time
    PYTHONPATH=. python scripts/diagnose.py bias   # the conv epilogue with and without bias
    PYTHONPATH=. python scripts/diagnose.py cupy   # host cost of each step of a CuPy API call
    PYTHONPATH=. python scripts/diagnose.py torch  # the same for a cupy_act.torch call
    PYTHONPATH=. python scripts/diagnose.py autograd  # where relu's fwd+bwd loses time
    PYTHONPATH=. python scripts/diagnose.py wake   # fwd+bwd against added host work

mask: builds variants of the forward-with-mask kernel by editing its mask
store in the assembled source (never store it; store a constant word, so no
shuffles are needed; store with st.global.cs or .wt) at several vectors per
thread, and times leaky_relu on 4096 x 393216 float32 and the same bytes of
bfloat16 as multiples of a device copy, three rounds in one run.
bias: times div_leaky_relu at the conv model's output shape (128 x 64 x
126 x 126 float32), NCHW and channels-last, with and without the bias.
cupy: host time per call (least of 9 repeats of 5000 calls, 65,536 float32) of
each step cupy_act.leaky_relu takes, beside the whole call and a
cupy.ElementwiseKernel, to show where the CuPy API's time goes.
torch: the same for cupy_act.torch.leaky_relu beside F.leaky_relu, with ways
to allocate the mask, and the bare launch (its arguments packed once) through
CuPy's driver wrapper and through ctypes, beside torch's cheapest launches.
autograd: host time per call (as scripts/overhead.py, 65,536 float32) of
relu's autograd forward + backward and of its forward alone, taking our
layers away one at a time down to the design floor (``bare_relu`` in
scripts/overhead.py), swapping our forward or backward for the bare one, and
giving the bare Function more inputs, set_materialize_grads(False) or a
tuple on ctx (what ours has and it has not). (With the cyclic garbage
collector off the rows moved by no more than their noise, H200 host.)
wake: whether a fwd+bwd's wall time grows by the host work added to it. The
design floor's Function is timed with d us of busy work added to its forward
(on the calling thread) or to its backward (on the autograd engine's device
thread), d = 0 to 16, beside F.relu, ours and a Python Function around
torch.relu; each row gives wall time and process CPU time per call (all
threads; a thread asleep waiting for another costs none).
"""

from __future__ import annotations

import argparse
import copy
import threading

import cupy
import numpy
import torch

from cupy_act import _kernels, _launch, _loader, _source
from cupy_act._arrays import mask_nbytes
from cupy_act._registry import OPS
from cupy_act.testing import median_ms

_STORE = "      p.mask[base / 32 + (lane % G) * V + lane / G] = mine;"
_ADDR = "p.mask + base / 32 + (lane % G) * V + lane / G"
VARIANTS = {
    "base": _STORE,
    "nostore": "      if (mine == (u32)p.n) p.mask[base / 32 + (lane % G) * V + lane / G] = mine;",
    "const": "      p.mask[base / 32 + (lane % G) * V + lane / G] = (u32)base;",
    "cs": f'      asm volatile("st.global.cs.u32 [%0], %1;" :: "l"({_ADDR}), "r"(mine) '
    ': "memory");',
    "wt": f'      asm volatile("st.global.wt.u32 [%0], %1;" :: "l"({_ADDR}), "r"(mine) '
    ': "memory");',
}


def build(variant: str, mask_unroll: int, dtype: str):
    """(forward_mask kernel, forward kernel) of leaky_relu with the mask store replaced."""
    src = _source.assembled_source()
    assert _STORE in src, "the mask store in cuda/elementwise.cu changed; update _STORE"
    unroll = OPS["leaky_relu"].unroll  # edited in place, restored below
    saved = copy.deepcopy(unroll)
    size = _kernels.ITEMSIZE[dtype]
    unroll["forward_mask"][size] = mask_unroll
    try:
        names = [_kernels.kernel_name("leaky_relu", dtype, k) for k in ("forward_mask", "forward")]
        mod = cupy.RawModule(
            code=src.replace(_STORE, VARIANTS[variant]),
            options=_loader.options(),
            name_expressions=names,
        )
        out = []
        for name, kind in zip(names, ("forward_mask", "forward")):
            fn = mod.get_function(name).kernel
            per_block = _loader.THREADS * unroll[kind][size] * 16 // size
            out.append(
                _loader.Kernel(
                    fn.ptr,
                    _loader.THREADS,
                    per_block,
                    2**31 - 1,
                    size == 8,
                    cupy.cuda.driver.ctxGetCurrent(),
                    (fn, mod),
                )
            )
        return out
    finally:
        unroll.update(saved)


def diagnose_mask() -> None:
    stream = torch.cuda.current_stream().cuda_stream
    for dtype, tdtype, top in (("float32", torch.float32, 8), ("bfloat16", torch.bfloat16, 4)):
        x = torch.randn((4096 * 4 // tdtype.itemsize, 393216), device="cuda", dtype=tdtype)
        y = torch.empty_like(x)
        n = x.numel()
        mask = torch.empty(mask_nbytes(n), dtype=torch.uint8, device="cuda")
        configs = [
            ("base", 1),
            ("base", 2),
            ("base", top),
            ("nostore", 1),
            ("nostore", top),
            ("const", 1),
            ("cs", 1),
            ("cs", 2),
            ("wt", 2),
        ]
        kernels = {c: build(*c, dtype) for c in configs}
        res = {}
        for _ in range(3):
            copy_ms = median_ms(lambda: y.copy_(x))
            res.setdefault("copy (ms)", []).append(copy_ms)
            for c in configs:
                run = _launch.Launch(kernels[c][0], 0.01, 1.0)
                xp, yp, mp = x.data_ptr(), y.data_ptr(), mask.data_ptr()
                t = median_ms(lambda: run(stream, n, xp, yp, mp, mask.numel() // 4))
                res.setdefault(f"{c[0]}, {c[1]} vectors/thread", []).append(t / copy_ms)
            run = _launch.Launch(kernels[configs[0]][1], 0.01, 1.0)
            t = median_ms(lambda: run(stream, n, x.data_ptr(), y.data_ptr()))
            res.setdefault("forward, no mask", []).append(t / copy_ms)
        print(f"{dtype}: time over the copy's, three rounds")
        for name, v in res.items():
            print(f"  {name:28s} " + " ".join(f"{t:.4f}" for t in v))


def diagnose_bias() -> None:
    import cupy_act.torch as ct

    pre = torch.randn(128, 64, 126, 126, device="cuda")
    b = torch.randn(64, device="cuda")
    with torch.no_grad():
        cl = pre.contiguous(memory_format=torch.channels_last)
        for name, t in (("NCHW", pre), ("channels-last", cl)):
            out = torch.empty_like(t)
            c = median_ms(lambda: out.copy_(t))
            nb = median_ms(lambda: ct.div_leaky_relu(t, 2.0))
            wb = median_ms(lambda: ct.div_leaky_relu(t, 2.0, bias=b))
            print(f"{name}: copy {c:.4f} ms, div_leaky_relu {nb:.4f} ms, with bias {wb:.4f} ms")


def diagnose_cupy() -> None:
    import cupy_act
    from cupy_act import _arrays, _plan, _scalars

    # (from the host: the lean CUDA extras install no cuRAND for cupy.random)
    x = cupy.asarray(numpy.random.default_rng(0).standard_normal(65536, dtype=numpy.float32))
    y = cupy.empty_like(x)
    ek = cupy.ElementwiseKernel("T x, T s", "T y", "y = x > 0 ? x : x * s", "diag_leaky")
    s32 = numpy.float32(0.01)
    launch = _plan.plan(0, "leaky_relu", "float32", "forward", False, 0.01, None, "f")
    stream = cupy.cuda.get_current_stream().ptr
    steps = {
        "EK new": lambda: ek(x, s32),
        "EK out=": lambda: ek(x, s32, y),
        "ours": lambda: cupy_act.leaky_relu(x, 0.01),
        "ours out=": lambda: cupy_act.leaky_relu(x, 0.01, out=y),
        "check_scalars": lambda: _scalars.check_scalars("leaky_relu", 0.01, None, "f"),
        "as_device_array": lambda: _arrays.as_device_array(x, "x", "f"),
        "x.data.device_id": lambda: x.data.device_id,
        "x.dtype.name": lambda: x.dtype.name,
        "plan": lambda: _plan.plan(0, "leaky_relu", "float32", "forward", False, 0.01, None, "f"),
        "getDevice": cupy.cuda.runtime.getDevice,
        "c_contiguous": lambda: _arrays.c_contiguous(x),
        "check_like": lambda: _arrays.check_like(y, "out", x, "f"),
        "cupy.empty": lambda: cupy.empty(x.shape, dtype=x.dtype),
        "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
        "launch": lambda: launch(stream, 65536, x.data.ptr, y.data.ptr),
    }
    _print_steps(steps)


def _print_steps(steps: dict) -> None:
    """Least host time per call of each step (9 repeats of 5000 calls each)."""
    import time

    for fn in steps.values():
        for _ in range(500):
            fn()
    torch.cuda.synchronize()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(9):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(5000):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / 5000 * 1e6)
    for name, us in best.items():
        print(f"{name:34s} {us:7.2f} us")


def diagnose_torch() -> None:
    import torch.nn.functional as F

    import cupy_act.torch as ct
    from cupy_act import _plan
    from cupy_act.torch import _impl, functional

    x = torch.randn(65536, device="cuda")
    y = torch.empty_like(x)
    mask = _impl.forward_mask(x, "leaky_relu", 0.01, 1.0, None)[1]
    u8, dev = torch.empty(8192, dtype=torch.uint8, device="cuda"), x.device
    launch = _plan.plan(0, "leaky_relu", "float32", "forward", False, 0.01, 1.0, "f")
    stream = _impl._raw_stream(0)
    steps = {
        "F.leaky_relu": lambda: F.leaky_relu(x, 0.01),
        "ct.leaky_relu": lambda: ct.leaky_relu(x, 0.01),
        "_impl.forward": lambda: _impl.forward(x, "leaky_relu", 0.01, 1.0, None),
        "_impl.forward_mask_layout": lambda: _impl.forward_mask_layout(
            x, "leaky_relu", 0.01, 1.0, None
        ),
        "_impl.backward": lambda: _impl.backward(x, mask, "leaky_relu", 0.01, 1.0, False),
        "_check": lambda: functional._check("f", "leaky_relu", x, 0.01, 1.0, None),
        "is_compiling": functional._is_compiling,
        "functorch_active": functional._functorch_active,
        "is_grad_enabled": torch.is_grad_enabled,
        "x.requires_grad": lambda: x.requires_grad,
        "x.is_cuda": lambda: x.is_cuda,
        "x.is_contiguous()": lambda: x.is_contiguous(),
        "torch.empty_like": lambda: torch.empty_like(x),
        "new_mask": lambda: _impl.new_mask(x),
        "x.new_empty(nb, dtype=u8)": lambda: x.new_empty(8192, dtype=torch.uint8),
        "u8.new_empty(nb)": lambda: u8.new_empty(8192),
        "torch.empty(nb, dtype=u8, device=)": lambda: torch.empty(
            8192, dtype=torch.uint8, device=dev
        ),
        "empty_like(u8 of nb)": lambda: torch.empty_like(u8),
        "x.numel()": lambda: x.numel(),
        "x.get_device()": lambda: x.get_device(),
        "x.data_ptr()": lambda: x.data_ptr(),
        "raw stream": lambda: _impl._raw_stream(0),
        "plan": lambda: _plan.plan(0, "leaky_relu", "float32", "forward", False, 0.01, 1.0, "f"),
        "launch": lambda: launch(stream, 65536, x.data_ptr(), y.data_ptr()),
        "lambda: None": lambda: None,
    }
    steps.update(_raw_launches(launch, stream, x, y))
    _print_steps(steps)


def diagnose_autograd() -> None:
    import torch.nn.functional as F
    from overhead import bare_relu, per_call_us

    import cupy_act.torch as ct
    from cupy_act.torch import _autograd, _impl, functional

    x = torch.randn(65536, device="cuda")
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    forward, bare, run = bare_relu(x)
    args = ("relu", 0.0, 1.0, False)

    class OursFwdBareBwd(bare):  # the bare Function's backward
        @staticmethod
        def forward(ctx, t):
            y, mask, _ = _impl.forward_mask_layout(t, "relu", 0.0, 1.0, None)
            ctx.save_for_backward(mask)
            return y

    class BareFwdOursBwd(torch.autograd.Function):  # (t, bias): _input_grads reads both
        @staticmethod
        def forward(ctx, t, bias):
            y = torch.empty_like(t)
            m = _impl._cuda_mask(t, t.get_device(), t.numel())
            run("forward_mask", t, y, m.data_ptr())
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(m)
            ctx.args = args
            return y

        @staticmethod
        def backward(ctx, gy):
            return _autograd._input_grads(ctx, gy)[:2]

    class OursImplBwd(OursFwdBareBwd):  # our forward, _impl.backward directly
        @staticmethod
        def backward(ctx, gy):
            (m,) = ctx.saved_tensors
            return _impl.backward(gy, m, *args)

    class BareAsOurs(torch.autograd.Function):  # bare work in our Function's shape
        @staticmethod
        def forward(ctx, t, bias, op, slope, divisor):
            ctx.set_materialize_grads(False)
            ctx.args = args
            return bare.forward(ctx, t)

        @staticmethod
        def backward(ctx, gy):
            return bare.backward(ctx, gy), None, None, None, None

    def shaped(n_args: int, materialize: bool, ctx_args: bool):
        """The bare Function with n_args inputs (the rest plain Python values),
        set_materialize_grads(False) or not, and a tuple on ctx or not."""

        class Shaped(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, *rest):
                if not materialize:
                    ctx.set_materialize_grads(False)
                if ctx_args:
                    ctx.args = args
                return bare.forward(ctx, t)

            @staticmethod
            def backward(ctx, gy):
                return (bare.backward(ctx, gy),) + (None,) * (n_args - 1)

        return super(torch.autograd.Function, Shaped).apply

    def cxx(fn):  # the C++ apply, as functional uses it
        return super(torch.autograd.Function, fn).apply

    def grad(f, *a):
        return lambda: torch.autograd.grad(f(xg, *a), xg, g)

    five = (None, "relu", 0.0, 1.0)
    rows = {
        "F.relu fwd (grad)": lambda: F.relu(xg),
        "design floor (bare) fwd (grad)": lambda: cxx(bare)(xg),
        "bare in our Function's shape (grad)": lambda: cxx(BareAsOurs)(xg, *five),
        "EagerAct, C++ apply fwd (grad)": lambda: cxx(_autograd.EagerAct)(xg, *five),
        "functional._act fwd (grad)": lambda: functional._act(xg, *five),
        "ct.relu fwd (grad)": lambda: ct.relu(xg),
        "F.relu fwd+bwd": grad(F.relu),  # (first: the bare launches need the
        # context that torch's backward makes current on the engine's device thread)
        "bare in our Function's shape": grad(cxx(BareAsOurs), *five),
        "bare, 5 inputs": grad(shaped(5, True, False), *five),
        "bare, 2 inputs": grad(shaped(2, True, False), args),
        "bare, set_materialize_grads(False)": grad(shaped(1, False, False)),
        "bare, ctx.args": grad(shaped(1, True, True)),
        "design floor (bare) fwd+bwd": grad(cxx(bare)),
        "ct.relu fwd+bwd": grad(ct.relu),
        "functional._act (no _apply)": grad(functional._act, None, "relu", 0.0, 1.0),
        "EagerAct through the C++ apply": grad(cxx(_autograd.EagerAct), None, "relu", 0.0, 1.0),
        "our fwd, _impl.backward": grad(cxx(OursImplBwd)),
        "our fwd, bare bwd": grad(cxx(OursFwdBareBwd)),
        "bare fwd, our bwd (_input_grads)": grad(cxx(BareFwdOursBwd), None),
        "F.relu fwd": lambda: F.relu(x),
        "design floor (bare) fwd": lambda: forward(x),
        "ct.relu fwd": lambda: ct.relu(x),
        "functional._apply fwd": lambda: functional._apply("f", "relu", x, 0.0, 1.0, None, False),
        "_impl.forward": lambda: _impl.forward(x, "relu", 0.0, 1.0, None),
    }
    times = per_call_us(list(rows.values()), 2000, 9)
    for name, us in zip(rows, times):
        print(f"{name:36s} {us:7.2f} us")


def diagnose_wake() -> None:
    import time

    import torch.nn.functional as F
    from overhead import _TorchRelu, bare_relu

    import cupy_act.torch as ct

    x = torch.randn(65536, device="cuda")
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    _, bare, _ = bare_relu(x)

    def busy(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def delayed(where: str, us: float):
        class Delayed(bare):
            @staticmethod
            def forward(ctx, t):
                if where == "fwd":
                    busy(us)
                return bare.forward(ctx, t)

            @staticmethod
            def backward(ctx, gy):
                if where == "bwd":
                    busy(us)
                return bare.backward(ctx, gy)

        return super(torch.autograd.Function, Delayed).apply

    def grad(f):
        return lambda: torch.autograd.grad(f(xg), xg, g)

    rows = {"F.relu": grad(F.relu), "ct.relu": grad(ct.relu)}
    rows["Python Function around torch.relu"] = grad(_TorchRelu.apply)
    for where in ("fwd", "bwd"):
        for us in (0, 1, 2, 4, 8, 16):
            rows[f"design floor + {us} us in {where}"] = grad(delayed(where, us))
    fns = list(rows.values())
    for fn in fns:
        for _ in range(500):
            fn()
    torch.cuda.synchronize()
    wall = [float("inf")] * len(fns)
    cpu = [float("inf")] * len(fns)
    calls = 2000
    for _ in range(9):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            wall[i] = min(wall[i], (time.perf_counter() - t0) / calls * 1e6)
            cpu[i] = min(cpu[i], (time.process_time() - c0) / calls * 1e6)
    print(f"{'relu fwd+bwd, 65536 float32':40s} {'wall us':>8s} {'cpu us':>8s}")
    for name, w, c in zip(rows, wall, cpu):
        print(f"{name:40s} {w:8.2f} {c:8.2f}")


def _raw_launches(launch, stream: int, x, y) -> dict:
    """The launch alone, its argument block packed once, through CuPy's driver
    wrapper and through ctypes; and the cheapest launches torch makes from
    Python: floors for any Python launcher."""
    import ctypes

    k = launch.kernel
    launch(stream, 65536, x.data_ptr(), y.data_ptr())  # fills this thread's block
    argv = launch._blocks[threading.get_ident()][1]
    drv = cupy.cuda.driver
    f = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    blocks = 65536 // k.per_block
    return {
        "raw: driver.launchKernel": lambda: drv.launchKernel(
            k.ptr, blocks, 1, 1, k.threads, 1, 1, 0, stream, argv, 0
        ),
        "raw: ctypes cuLaunchKernel": lambda: f(
            k.ptr, blocks, 1, 1, k.threads, 1, 1, 0, stream, argv, None
        ),
        "raw: driver.ctxGetCurrent": drv.ctxGetCurrent,
        "torch: y.zero_()": y.zero_,
        "torch: torch.cuda._sleep(0)": lambda: torch.cuda._sleep(0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["mask", "bias", "cupy", "torch", "autograd", "wake"])
    args = ap.parse_args()
    whats = {"mask": diagnose_mask, "bias": diagnose_bias, "cupy": diagnose_cupy}
    whats["torch"], whats["autograd"] = diagnose_torch, diagnose_autograd
    whats["wake"] = diagnose_wake
    whats[args.what]()


if __name__ == "__main__":
    main()
