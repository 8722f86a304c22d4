"""Conformance rows: one per way users call activations, each compared bit for bit
with PyTorch's own op in the same scenario.

    python tests/conformance_rows.py ROW DEVICE     (DEVICE: cpu, cuda or cuda:1)

runs one row in this process and prints ``PASS ROW DEVICE`` last. The test suite
(tests/test_conformance.py) runs every row in a fresh subprocess: the first
backward of a process, the first launch on a thread and a cold kernel cache
behave differently once earlier work in the same process has happened.

Every row checks the three ops (ReLU, LeakyReLU, divide + LeakyReLU, the last
also with a per-channel bias) against their PyTorch expressions, on test data
with NaN, infinities, signed zeros and subnormals mixed in, out of place and in
place where PyTorch allows it, and the modules where the scenario is about
models.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# cupy_act.testing and cupy_act.torch, imported by main(), except for the rows
# whose subject is the import itself (own_imports)
testing = ct = None
SHAPE = (2, 3, 4, 5)  # 120 elements: per-sample masks do not end on a byte boundary


@dataclass
class Row:
    fn: Callable
    devices: tuple  # device kinds the row runs on: "cpu", "cuda", "cuda:1"
    launcher: tuple = ()  # e.g. torchrun for the distributed rows
    gpus: int = 0  # GPUs needed
    env: dict | None = None  # environment the process starts with
    own_imports: bool = False  # the row imports cupy_act itself


ROWS: dict[str, Row] = {}


def row(*devices, launcher=(), gpus=0, env=None, own_imports=False):
    def register(fn):
        ROWS[fn.__name__] = Row(fn, devices, launcher, gpus, env, own_imports)
        return fn

    return register


# ---- the ops: ours and PyTorch's, out of place and in place ----


@dataclass
class Case:
    name: str
    ours: Callable  # (x, b) -> y
    ref: Callable
    ours_: Callable | None = None  # in place, or None where PyTorch has no in-place form
    ref_: Callable | None = None

    def variants(self):
        """(ours, PyTorch's, label) out of place, then in place."""
        return ((self.ours, self.ref, ""), (self.ours_, self.ref_, " in place"))


def _bview(b):
    return b.view(1, -1, 1, 1)


def cases() -> list[Case]:
    return [
        Case(
            "relu",
            lambda x, b: ct.relu(x),
            lambda x, b: torch.relu(x),
            lambda x, b: ct.relu(x, inplace=True),
            lambda x, b: F.relu(x, inplace=True),
        ),
        Case(
            "leaky_relu",
            lambda x, b: ct.leaky_relu(x, 0.2),
            lambda x, b: F.leaky_relu(x, 0.2),
            lambda x, b: ct.leaky_relu(x, 0.2, True),
            lambda x, b: F.leaky_relu(x, 0.2, True),
        ),
        Case(
            "div_leaky_relu",
            lambda x, b: ct.div_leaky_relu(x, -1.7, 0.1),
            lambda x, b: F.leaky_relu(x / -1.7, 0.1),
            lambda x, b: ct.div_leaky_relu(x, -1.7, 0.1, inplace=True),
            lambda x, b: F.leaky_relu(x.div_(-1.7), 0.1, inplace=True),
        ),
        Case(
            "div_leaky_relu_bias",
            lambda x, b: ct.div_leaky_relu(x, 2.0, 0.01, bias=b),
            lambda x, b: F.leaky_relu((x + _bview(b)) / 2.0, 0.01),
            lambda x, b: ct.div_leaky_relu(x, 2.0, 0.01, inplace=True, bias=b),
            lambda x, b: F.leaky_relu(x.add_(_bview(b)).div_(2.0), 0.01, inplace=True),
        ),
    ]


def data(device, dtype=torch.float32, seed=0, shape=SHAPE):
    """x and bias (with special values), a finite upstream gradient (a bias
    gradient is a sum over it: special values would make it NaN, and NaN
    compares nothing) and a tangent of x's shape."""
    x, b, _, t = testing.make_inputs(device, dtype, shape, seed)
    return x, b, testing.make_grad(x.numel(), dtype, device, seed + 2).view(x.shape), t


def special_grad(device, dtype=torch.float32, seed=0, shape=SHAPE):
    """An upstream gradient with special values (NaN, infinities, signed
    zeros, subnormals): for y and dx, in a case of its own."""
    return testing.make_inputs(device, dtype, shape, seed)[2]


def same(actual, expected, what):
    """Bit equality of tensors, or of (nested) tuples of them."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            same(a, e, f"{what}[{i}]")
        return
    if expected is None:
        assert actual is None, f"{what}: expected None"
        return
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}"
    testing.assert_bits_equal(actual.detach(), expected.detach(), what)


def fwd_bwd(f, x, b, dy, wrt_bias=True, via_backward=False):
    """f(x, b) and the gradients w.r.t. x (and b) for upstream dy, by autograd
    (``torch.autograd.grad``, or ``.backward()`` where grad() is refused)."""
    xr = x.detach().clone().requires_grad_(True)
    br = b.detach().clone().requires_grad_(wrt_bias)
    y = f(xr, br)
    if via_backward:
        y.backward(dy)
        grads = (xr.grad, br.grad) if wrt_bias else (xr.grad,)
    else:
        grads = torch.autograd.grad(y, (xr, br) if wrt_bias else (xr,), dy, allow_unused=True)
    if wrt_bias and grads[1] is None:  # ops without a bias
        grads = (grads[0], torch.zeros_like(b))
    if wrt_bias and dy.isfinite().all():  # (the data exercises the bias gradient compared)
        assert grads[1].isfinite().all(), "a finite dy gave a bias gradient with NaN"
    # copies: under reduce-overhead, outputs live in the CUDA-graph pool and the
    # next compiled function's replay (the reference's) would overwrite them
    return y.detach().clone(), tuple(None if g is None else g.clone() for g in grads)


def same_compiled(actual, expected, what):
    """Under torch.compile: y and dx bit for bit; the bias gradient, a reduction
    the compiler may reorder, to float32 rounding (NaN where PyTorch has NaN)."""
    (y, (dx, db)), (ry, (rdx, rdb)) = actual, expected
    same((y, dx), (ry, rdx), what)
    torch.testing.assert_close(db, rdb, rtol=1e-5, atol=1e-6, equal_nan=True, msg=what)


def check_fwd_bwd(
    device, wrap=lambda f: f, what="", in_place=True, ref_wrap=None, compare=same, **kw
):
    """Forward and gradients of every case: ours through ``wrap`` against PyTorch's
    through ``ref_wrap`` (default: the same wrap)."""
    ref_wrap = wrap if ref_wrap is None else ref_wrap
    x, b, dy, _ = data(device)
    special = special_grad(device)

    def clone_first(f):
        return lambda u, v: f(u.clone(), v)

    for c in cases():
        pairs = [(c.ours, c.ref, "")]
        if in_place and c.ours_ is not None:
            pairs.append((clone_first(c.ours_), clone_first(c.ref_), " in place"))
        for ours, ref, tag in pairs:
            compare(
                fwd_bwd(wrap(ours), x, b, dy, **kw),
                fwd_bwd(ref_wrap(ref), x, b, dy, **kw),
                f"{what} {c.name}{tag}",
            )
            # special values in dy: y and dx (the bias gradient would be NaN)
            (y, grads), (ry, rgrads) = (
                fwd_bwd(wrap(ours), x, b, special, **kw),
                fwd_bwd(ref_wrap(ref), x, b, special, **kw),
            )
            same((y, grads[0]), (ry, rgrads[0]), f"{what} {c.name}{tag}, special dy")


def mlp(ours: bool, seed=0) -> nn.Module:
    """Linear layers around every activation module: ours, or PyTorch's."""
    torch.manual_seed(seed)

    class TorchDivLeakyReLU(nn.Module):
        def forward(self, x):
            return F.leaky_relu(x / 2.0, 0.01)

    acts = (
        [ct.LeakyReLU(0.2), ct.ReLU(), ct.DivLeakyReLU(2.0), ct.LeakyReLU(0.1, inplace=True)]
        if ours
        else [nn.LeakyReLU(0.2), nn.ReLU(), TorchDivLeakyReLU(), nn.LeakyReLU(0.1, inplace=True)]
    )
    layers = [nn.Linear(8, 16)]
    for a in acts:
        layers += [a, nn.Linear(16, 16)]
    return nn.Sequential(*layers[:-1], nn.Linear(16, 4))


def in_threads(*fns):
    """Run each function on a new thread of its own, all at once; re-raise the
    first exception any of them raised."""
    errors = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in fns]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def sgd_losses(model, step, device, seed, steps):
    """Losses of ``steps`` SGD steps of ``model`` (called through ``step``, e.g.
    its compiled or distributed wrapper) on random batches from ``seed``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        xb = torch.randn(16, 8, generator=g).to(device)
        loss = step(xb).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return torch.stack(out)


def conv_models(device):
    torch.manual_seed(0)
    ref = testing.ConvDivLeakyReLUModel(3, 4, 3, 2.0).to(device)
    ours = ct.ConvDivLeakyReLU(3, 4, 3, divisor=2.0).to(device)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


# ---- first use: process, thread, device, cache ----


@row("cuda")
def first_backward_fused_conv(device):
    """The process's first backward is the fused convolution block's, as eager
    training runs it (a plain autograd.Function): its weight- and
    input-gradient kernels launch from the autograd engine's device thread,
    which has no CUDA context of its own yet. The gradients bit for bit those
    of the same block through its custom op (conv.fused_op) afterwards."""
    fused_conv_against_op(device, "fused conv first backward")


def fused_conv_against_op(device, what: str) -> None:
    """The fused block's eager training step (forward, weight and input
    gradients) on ``device``, bit for bit that of its custom op
    (conv.fused_op)."""
    from cupy_act.torch import conv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 20, 130, generator=g).to(device).requires_grad_()
    w = (torch.randn(16, 8, 3, 3, generator=g) * 0.1).to(device).requires_grad_()
    b = torch.randn(16, generator=g).to(device).requires_grad_()
    gy = torch.randn(2, 16, 18, 128, generator=g).to(device)
    y = ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm="fused")
    assert type(y.grad_fn).__name__ == "_FusedEagerBackward", type(y.grad_fn)
    assert y.device == x.device, what
    got = torch.autograd.grad(y, (x, w, b), gy)
    y_op = conv.fused_op(x, w, b, 2.0, 0.01, [1, 1], [0, 0], [1, 1], False, True)[0]
    same((y, got), (y_op, torch.autograd.grad(y_op, (x, w, b), gy)), what)


@row("cpu", "cuda", "cuda:1")
def first_backward(device):
    """The process's first backward is ours (on CUDA: the autograd engine's device
    thread, with no CUDA context of its own yet)."""
    results = []
    for c in cases():
        x, b, dy, _ = data(device)
        results.append((c.name, fwd_bwd(c.ours, x, b, dy)))  # ours first: nothing ran before
    for name, got in results:
        c = next(c for c in cases() if c.name == name)
        x, b, dy, _ = data(device)
        same(got, fwd_bwd(c.ref, x, b, dy), f"first backward {name}")


@row("cpu", "cuda")
def new_thread(device):
    """A new thread whose first CUDA work is ours: torch adapter and CuPy-level API."""
    x, b, dy, _ = data(device)
    got = {}

    def work():
        for c in cases():
            got[c.name] = fwd_bwd(c.ours, x, b, dy)

    in_threads(work)
    for c in cases():
        same(got[c.name], fwd_bwd(c.ref, x, b, dy), f"thread {c.name}")
    if device.startswith("cuda"):
        import cupy

        import cupy_act

        cx = cupy.from_dlpack(x.contiguous())
        out = cupy.empty_like(cx)
        mask = cupy.empty(cupy_act.mask_nbytes(cx.size), dtype=cupy.uint8)
        torch.cuda.synchronize()

        def cupy_work():  # out= and mask= given: no allocation makes a context first
            cupy_act.leaky_relu_with_mask(cx, 0.2, out=out, mask=mask)
            cupy.cuda.get_current_stream().synchronize()

        in_threads(cupy_work)
        same(torch.from_dlpack(out), F.leaky_relu(x, 0.2), "CuPy API on a new thread")


@row("cpu", "cuda")
def threads_on_own_streams(device):
    """8 threads at once, each on its own stream (CUDA) with its own data."""
    outs = {}

    def work(i):
        x, b, dy, _ = data(device, seed=10 * i)
        if device.startswith("cuda"):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                outs[i] = [fwd_bwd(c.ours, x, b, dy) for c in cases()]
            s.synchronize()
        else:
            outs[i] = [fwd_bwd(c.ours, x, b, dy) for c in cases()]

    in_threads(*(lambda i=i: work(i) for i in range(8)))
    for i in range(8):
        x, b, dy, _ = data(device, seed=10 * i)
        for c, got in zip(cases(), outs[i]):
            same(got, fwd_bwd(c.ref, x, b, dy), f"thread {i} {c.name}")


@row("cuda", gpus=2)
def second_device(device):
    """Tensors on cuda:1 while cuda:0 is current (and the other way round):
    the activations, the fused convolution block's training step (its mask
    zeroed and its kernels launched in the tensors' device's context) and
    BatchNormAct2d's (bit for bit the same step with its device current)."""
    for dev, current in (("cuda:1", 0), ("cuda:0", 1)):
        with torch.cuda.device(current):
            x, b, dy, _ = data(dev)
            for c in cases():
                got = fwd_bwd(c.ours, x, b, dy)
                assert got[0].device == x.device
                same(got, fwd_bwd(c.ref, x, b, dy), f"{dev} while cuda:{current} {c.name}")
            fused_conv_against_op(dev, f"{dev} while cuda:{current} fused conv")
            with torch.cuda.device(dev):  # the same step with its own device current
                expected = batchnorm_act_step(dev)
            same(batchnorm_act_step(dev), expected, f"{dev} while cuda:{current} BatchNormAct2d")
            assert torch.cuda.current_device() == current


def batchnorm_act_step(device):
    """A training step of BatchNormAct2d (LeakyReLU) on ``device``: its fused
    kernels' output, input gradient and parameters' gradients."""
    g = torch.Generator().manual_seed(0)
    m = ct.BatchNormAct2d(8, act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.1}).to(device)
    x = torch.randn(4, 8, 6, 10, generator=g).to(device).requires_grad_()
    y = m(x)
    assert y.device == x.device
    grads = torch.autograd.grad(
        y, (x, m.weight, m.bias), torch.randn(y.shape, generator=g).to(device)
    )
    return (y, *grads, m.running_mean, m.running_var)


@row("cuda", env={"CUPY_CACHE_DIR": "/proc"})
def cache_dir_unwritable(device):
    """CUPY_CACHE_DIR names a directory no file can be made in (/proc, even for
    root): one warning, then the kernels compile in memory."""
    import warnings

    assert os.environ.get("CUPY_CACHE_DIR") == "/proc", "run with the row's env"
    x, b, dy, _ = data(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for c in cases():
            same(fwd_bwd(c.ours, x, b, dy), fwd_bwd(c.ref, x, b, dy), f"in-memory {c.name}")
    ours = [w for w in caught if "CUPY_CACHE_DIR" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "'/proc' cannot be written" in str(ours[0].message)


@row("cpu", "cuda", env={"CUPY_CACHE_DIR": "/dev/null/kernel_cache"}, own_imports=True)
def cache_dir_uncreatable(device):
    """CUPY_CACHE_DIR where no directory can be made: CuPy 14 fails at import, and
    importing cupy_act says which variable to set instead of a bare OSError."""
    import importlib

    assert os.environ.get("CUPY_CACHE_DIR", "").startswith("/dev/null/"), "run with the row's env"
    try:
        importlib.import_module("cupy_act.torch")
    except RuntimeError as e:
        msg = str(e)
        assert "CUPY_CACHE_DIR" in msg and "'/dev/null/kernel_cache' cannot be written" in msg, msg
    else:
        import cupy

        assert cupy.__version__.startswith("13"), "CuPy 14 makes the cache directory at import"


@row("cpu", "cuda", own_imports=True)
def private_api_fallback(device):
    """cupy_act imported where the private torch APIs it uses are missing: the
    public fallbacks give the same results (a torch upgrade costs speed only)."""
    import importlib

    global ct, testing
    hidden = [
        (torch._C._functorch, "unwrap_if_dead"),
        (torch._C, "_are_functorch_transforms_active"),
        (torch._C, "_cuda_getCurrentRawStream"),
        (torch.autograd.forward_ad, "_current_level"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name in hidden if hasattr(obj, name)]
    for obj, name, _ in saved:
        delattr(obj, name)
    try:
        ct = importlib.import_module("cupy_act.torch")
        testing = importlib.import_module("cupy_act.testing")
        from cupy_act.torch import _autograd, functional
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    assert _autograd._functorch_active() and functional._forward_ad_active()  # fallbacks in use
    check_fwd_bwd(device, what="fallback")
    forward_ad(device)
    func_grad(device)


# ---- torch.func and forward-mode AD ----


@row("cpu", "cuda")
def func_grad(device):
    """torch.func.grad, of x and of the bias, out of place and in place."""
    x, b, dy, _ = data(device)
    for c in cases():
        for ours, ref, tag in c.variants():

            def loss(f):
                return lambda u, v: (f(u.clone(), v) * dy).sum()

            same(
                torch.func.grad(loss(ours), argnums=(0, 1))(x, b),
                torch.func.grad(loss(ref), argnums=(0, 1))(x, b),
                f"grad {c.name}{tag}",
            )


@row("cpu", "cuda")
def func_vjp(device):
    x, b, dy, _ = data(device)
    for c in cases():
        (y1, f1), (y2, f2) = torch.func.vjp(c.ours, x, b), torch.func.vjp(c.ref, x, b)
        g1, g2 = f1(dy), f2(dy)
        if c.name != "div_leaky_relu_bias":  # without a bias, PyTorch's bias cotangent is zeros
            g1, g2 = g1[0], g2[0]
        same((y1, g1), (y2, g2), f"vjp {c.name}")


@row("cpu", "cuda")
def func_jvp(device):
    """torch.func.jvp: tangents of x and of the bias, out of place and in place."""
    x, b, _, t = data(device)
    tb = testing.make_input(b.numel(), b.dtype, device, 9)
    for c in cases():
        for ours, ref, tag in c.variants():

            def fn(f):
                return lambda u, v: f(u.clone(), v)

            same(
                torch.func.jvp(fn(ours), (x, b), (t, tb)),
                torch.func.jvp(fn(ref), (x, b), (t, tb)),
                f"jvp {c.name}{tag}",
            )
            same(
                torch.func.jvp(lambda u: fn(ours)(u, b), (x,), (t,)),
                torch.func.jvp(lambda u: fn(ref)(u, b), (x,), (t,)),
                f"jvp x only {c.name}{tag}",
            )


def _jacobians(device, transform):
    x, b, _, _ = data(device)
    for c in cases():
        same(
            transform(c.ours, argnums=(0, 1))(x, b),
            transform(c.ref, argnums=(0, 1))(x, b),
            f"{transform.__name__} {c.name}",
        )


@row("cpu", "cuda")
def func_jacrev(device):
    _jacobians(device, torch.func.jacrev)


@row("cpu", "cuda")
def func_jacfwd(device):
    _jacobians(device, torch.func.jacfwd)


@row("cpu", "cuda")
def func_hessian(device):
    x, b, dy, _ = data(device, shape=(2, 3, 2, 2))
    for c in cases():

        def loss(f):
            return lambda u: (f(u, b) * dy).sum()

        same(
            torch.func.hessian(loss(c.ours))(x),
            torch.func.hessian(loss(c.ref))(x),
            f"hessian {c.name}",
        )


@row("cpu", "cuda")
def func_vmap(device):
    """vmap over x (batch axis 0 and 1), over a per-sample bias, over both, in place."""
    xs, _, _, _ = data(device, shape=(3, 2, 3, 4, 5))
    b = testing.make_input(3, xs.dtype, device, 4)
    bb = testing.make_input(9, xs.dtype, device, 5).view(3, 3)
    for c in cases():
        same(
            torch.func.vmap(c.ours, in_dims=(0, None))(xs, b),
            torch.func.vmap(c.ref, in_dims=(0, None))(xs, b),
            f"vmap {c.name}",
        )
        same(
            torch.func.vmap(c.ours, in_dims=(1, None))(xs, b),
            torch.func.vmap(c.ref, in_dims=(1, None))(xs, b),
            f"vmap dim 1 {c.name}",
        )
        same(
            torch.func.vmap(c.ours, in_dims=(0, 0))(xs, bb),
            torch.func.vmap(c.ref, in_dims=(0, 0))(xs, bb),
            f"vmap x and bias {c.name}",
        )
        same(
            torch.func.vmap(c.ours, in_dims=(None, 0))(xs[0], bb),
            torch.func.vmap(c.ref, in_dims=(None, 0))(xs[0], bb),
            f"vmap bias only {c.name}",
        )
        same(
            torch.func.vmap(lambda u, v: c.ours_(u.clone(), v), in_dims=(0, None))(xs, b),
            torch.func.vmap(lambda u, v: c.ref_(u.clone(), v), in_dims=(0, None))(xs, b),
            f"vmap in place {c.name}",
        )


@row("cpu", "cuda")
def func_per_sample_grads(device):
    """Per-sample gradients: vmap(grad(loss)) with functional_call, on the modules."""
    from torch.func import functional_call, grad, vmap

    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(6, 8, generator=g).to(device)
    targets = torch.randn(6, 4, generator=g).to(device)
    ours, ref = mlp(True).to(device), mlp(False).to(device)

    def per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, y):
            return F.mse_loss(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, inputs, targets)

    got, want = per_sample(ours), per_sample(ref)
    for k in want:
        same(got[k], want[k], f"per-sample grad {k}")
    conv_ours, conv_ref = conv_models(device)
    xs = torch.randn(3, 2, 3, 6, 6, generator=g).to(device)

    def conv_per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x):
            return functional_call(model, p, (x,)).square().sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, xs)

    got, want = conv_per_sample(conv_ours), conv_per_sample(conv_ref)
    for k in want:
        same(got[k], want[k], f"conv per-sample grad {k}")


@row("cpu", "cuda")
def forward_ad(device):
    """torch.autograd.forward_ad: dual tensors through every op, in place too."""
    import torch.autograd.forward_ad as fwAD

    x, b, _, t = data(device)
    tb = testing.make_input(b.numel(), b.dtype, device, 9)
    for c in cases():
        for ours, ref, tag in c.variants():
            res = []
            for f in (ours, ref):
                with fwAD.dual_level():
                    # (in place, a dual's tangent is updated in place: give each its own)
                    out = fwAD.unpack_dual(
                        f(fwAD.make_dual(x.clone(), t.clone()), fwAD.make_dual(b, tb.clone()))
                    )
                    assert out.tangent is not None, f"forward AD {c.name}{tag}: tangent dropped"
                    res.append((out.primal.clone(), out.tangent.clone()))
            same(res[0], res[1], f"forward AD {c.name}{tag}")


# ---- compilation, graphs, checkpointing, autocast, export ----

# Compiled rows compare ours, compiled, with PyTorch's ops compiled the same
# way, bit for bit: by default ours trace into the same PyTorch operations, so
# the compiler generates the same code. The kernels route's rows (our custom
# ops, opaque to the compiler) compare with PyTorch eager instead, whose bits
# the kernels keep while the compiler's own code for PyTorch's ops need not
# (on the CPU, inductor's leaky_relu backward keeps a signaling NaN that
# ATen's quiets). How often compiled PyTorch departs from eager PyTorch in the
# same scenario is printed, for the record.

KERNELS_ROUTE = {"CUPY_ACT_COMPILE_ROUTE": "kernels"}


def _compiled_rows(device, **kw):
    torch._dynamo.reset()
    kernels = os.environ.get("CUPY_ACT_COMPILE_ROUTE") == "kernels"
    assert ct.functional._compile.kernels == kernels

    def compiled(f):
        return torch.compile(f, fullgraph=True, **kw)

    if kernels:
        ref, compare = (lambda f: f), same_compiled
    elif "max-autotune" in kw.get("mode", ""):  # (the bias gradient's reduction is autotuned
        ref, compare = compiled, same_compiled  # per graph: its order may differ)
    else:
        ref, compare = compiled, same
    check_fwd_bwd(device, wrap=compiled, ref_wrap=ref, compare=compare, what=f"compile {kw}")
    x, b, dy, _ = data(device)
    differ = 0
    for c in cases():
        got, want = fwd_bwd(compiled(c.ref), x, b, dy), fwd_bwd(c.ref, x, b, dy)
        differ += sum(
            int((testing.bits(a) != testing.bits(e)).sum())
            for a, e in zip((got[0], got[1][0]), (want[0], want[1][0]))
        )
    print(f"note: compiled PyTorch differs from eager PyTorch in {differ} elements of y and dx")


@row("cpu", "cuda")
def compile_default(device):
    _compiled_rows(device)


@row("cuda")
def compile_reduce_overhead(device):
    _compiled_rows(device, mode="reduce-overhead")


@row("cpu", "cuda")
def compile_max_autotune_no_cudagraphs(device):
    _compiled_rows(device, mode="max-autotune-no-cudagraphs")


@row("cpu", "cuda", env=KERNELS_ROUTE)
def compile_kernels_route(device):
    _compiled_rows(device)


@row("cuda", env=KERNELS_ROUTE)
def compile_kernels_route_reduce_overhead(device):
    _compiled_rows(device, mode="reduce-overhead")


@row("cpu", "cuda")
def compile_dynamic(device):
    """dynamic=True: one graph serves several sizes."""
    torch._dynamo.reset()
    for c in cases():
        f_ours = torch.compile(c.ours, fullgraph=True, dynamic=True)
        f_ref = torch.compile(c.ref, fullgraph=True, dynamic=True)
        for n in (2, 5, 7):
            x, b, dy, _ = data(device, shape=(n, 3, 4, 5))
            same(fwd_bwd(f_ours, x, b, dy), fwd_bwd(f_ref, x, b, dy), f"dynamic {c.name} n={n}")


@row("cpu", "cuda")
def compile_training_step(device):
    """A compiled model trains with the losses of the same model with torch's
    modules, compiled; eager, ours equal eager torch's."""

    def losses(model, compiled):
        step = torch.compile(model, fullgraph=True) if compiled else model
        return sgd_losses(model, step, device, seed=1, steps=3)

    torch._dynamo.reset()
    same(losses(mlp(True).to(device), False), losses(mlp(False).to(device), False), "eager")
    torch._dynamo.reset()
    same(losses(mlp(True).to(device), True), losses(mlp(False).to(device), True), "compiled")


@row("cuda")
def cuda_graph(device):
    """Forward and backward captured in a CUDA graph, replayed on new data."""

    def capture(f):
        x, b, dy, _ = data(device)
        xs = x.clone().requires_grad_(True)
        bs = b.clone().requires_grad_(True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                torch.autograd.grad(f(xs, bs), (xs, bs), dy, allow_unused=True)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = f(xs, bs)
            gx, gb = torch.autograd.grad(y, (xs, bs), dy, allow_unused=True)
        return graph, xs, bs, (y, gx, gb), dy  # (dy kept: the graph reads its memory)

    for c in cases():
        runs = [capture(c.ours), capture(c.ref)]
        for seed in (5, 6):
            x, b, _, _ = data(device, seed=seed)
            for graph, xs, bs, *_ in runs:
                with torch.no_grad():
                    xs.copy_(x)
                    bs.copy_(b)
                graph.replay()
            torch.cuda.synchronize()
            same(runs[0][3], runs[1][3], f"graph replay {c.name} seed {seed}")


def _checkpointed(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    def wrap(f):
        return lambda x, b: checkpoint(f, x, b, use_reentrant=use_reentrant)

    return wrap


@row("cpu", "cuda")
def checkpoint_reentrant(device):
    check_fwd_bwd(
        device,
        wrap=_checkpointed(True),
        what="checkpoint reentrant",
        in_place=False,
        via_backward=True,
    )  # reentrant checkpointing refuses autograd.grad


@row("cpu", "cuda")
def checkpoint_non_reentrant(device):
    check_fwd_bwd(device, wrap=_checkpointed(False), what="checkpoint non-reentrant")


def _autocast(device, dtype):
    kind = "cuda" if device.startswith("cuda") else "cpu"
    torch.manual_seed(0)
    lin = nn.Linear(5, 5).to(device)

    def wrap(f):
        def g(x, b):
            with torch.autocast(kind, dtype=dtype):
                h = lin(x)  # autocast: the activation sees a 16-bit tensor
                return f(h, b.to(h.dtype))

        return g

    x, b, dy, _ = data(device)
    for c in cases():
        (y, grads), (ry, rgrads) = fwd_bwd(wrap(c.ours), x, b, dy), fwd_bwd(wrap(c.ref), x, b, dy)
        assert y.dtype == ry.dtype == dtype, (y.dtype, ry.dtype)
        same((y, grads), (ry, rgrads), f"autocast {dtype} {c.name}")


@row("cpu", "cuda")
def autocast_fp16(device):
    _autocast(device, torch.float16)


@row("cpu", "cuda")
def autocast_bf16(device):
    _autocast(device, torch.bfloat16)


@row("cpu", "cuda")
def export(device):
    """torch.export: the exported program holds PyTorch's operations (with the
    kernels route, our custom ops) and gives PyTorch's bits."""
    x, b, _, _ = data(device)
    kernels = os.environ.get("CUPY_ACT_COMPILE_ROUTE") == "kernels"

    class M(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, u, v):
            return self.f(u, v)

    for c in cases():
        ep = torch.export.export(M(c.ours), (x, b))
        assert ("cupy_act" in str(ep.graph)) == kernels, ep.graph
        same(ep.module()(x, b), c.ref(x, b), f"export {c.name}")


@row("cpu", "cuda", env=KERNELS_ROUTE)
def export_kernels_route(device):
    export(device)


# ---- grad modes, determinism, bias, streams ----


@row("cpu", "cuda")
def no_grad(device):
    x, b, _, _ = data(device)
    with torch.no_grad():
        for c in cases():
            same(c.ours(x, b), c.ref(x, b), f"no_grad {c.name}")
            same(c.ours_(x.clone(), b), c.ref_(x.clone(), b), f"no_grad in place {c.name}")


@row("cpu", "cuda")
def inference_mode(device):
    with torch.inference_mode():
        x, b, _, _ = data(device)
        for c in cases():
            same(c.ours(x, b), c.ref(x, b), f"inference_mode {c.name}")
            same(c.ours_(x.clone(), b), c.ref_(x.clone(), b), f"inference_mode in place {c.name}")


@row("cpu", "cuda")
def deterministic_algorithms(device):
    torch.use_deterministic_algorithms(True)
    check_fwd_bwd(device, what="deterministic")


@row("cpu", "cuda")
def grad_only_on_bias(device):
    x, b, dy, _ = data(device)
    c = next(c for c in cases() if c.name == "div_leaky_relu_bias")
    results = []
    for f in (c.ours, c.ref):
        br = b.clone().requires_grad_(True)
        y = f(x, br)
        results.append((y, torch.autograd.grad(y, br, dy)))
    same(results[0], results[1], "grad only on the bias")


@row("cuda")
def side_stream(device):
    """On a non-default stream, behind queued work."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.randn(2048, 2048, device=device)
        for _ in range(10):
            a = a @ a * 1e-3  # a queue ahead of the ops
        check_fwd_bwd(device, what="side stream")
    s.synchronize()


# ---- distributed (torchrun, 2 processes) ----

_TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def _distributed_losses(device, wrap):
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dev = f"cuda:{rank}"
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    out = []
    for ours in (True, False):
        model = wrap(mlp(ours).to(dev))
        out.append(sgd_losses(model, model, dev, seed=100 + rank, steps=4))
    same(out[0], out[1], f"rank {rank}: losses, ours vs torch's modules")


@row("cuda", launcher=_TORCHRUN, gpus=2)
def ddp(device):
    from torch.nn.parallel import DistributedDataParallel

    _distributed_losses(device, lambda m: DistributedDataParallel(m))


@row("cuda", launcher=_TORCHRUN, gpus=2)
def fsdp2(device):
    from torch.distributed.fsdp import fully_shard

    def wrap(m):
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(m)

    _distributed_losses(device, wrap)


@row("cpu", "cuda", launcher=_TORCHRUN)
def ddp_batchnorm(device):
    """Fused BatchNorm + activation modules (the in-place mode) under DDP, over
    gloo so that both processes can share one GPU: the statistics stay local
    to each process, as nn.BatchNorm2d's; losses, parameters and statistics
    PyTorch's modules' bit for bit on the CPU, within float32 accuracy where
    CUDA runs the fused kernels."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(0.1),
            nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 6 * 6, 4),
        ).to(device)  # fmt: skip
        if fused:
            model, count = ct.fuse_batchnorm_act(model, memory="inplace")
            assert count == 2 and model[1].memory == "inplace", model
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(3):
            loss = ddp(torch.randn(4, 3, 10, 10, generator=g).to(device)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        stats = torch.stack([model[1].running_mean, model[4].running_var]).cpu()
        gathered = [torch.empty_like(stats) for _ in range(2)]
        dist.all_gather(gathered, stats)
        assert not torch.equal(gathered[0], gathered[1]), "statistics are local"
        results.append([torch.stack(losses), *model.parameters(), *gathered])
    for i, (a, e) in enumerate(zip(*results)):
        if device == "cpu":
            same(a.detach(), e.detach(), f"rank {rank}, tensor {i}")
        else:
            torch.testing.assert_close(a.detach().cpu(), e.detach().cpu(), rtol=1e-4, atol=1e-5)
    # (both ranks done before gloo's threads go: a rank leaving early aborted
    # the other at exit once on a 2-core CI machine)
    dist.barrier()
    dist.destroy_process_group()


@row("cuda", launcher=_TORCHRUN, gpus=2)
def sync_batchnorm(device):
    """SyncBatchNormAct2d over NCCL, a GPU per process: the kernels against a
    float64 whole-batch reference and nn.SyncBatchNorm, then DDP training
    (tests/sync_worker.py's "kernels" and "ddp" cases)."""
    import sync_worker

    sync_worker.kernels(device)
    sync_worker.ddp(device)
    dist_done()


def dist_done():
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


USAGE = """usage: python tests/conformance_rows.py ROW DEVICE

Runs one conformance row (tests/test_conformance.py runs each in a fresh
process) and prints "PASS ROW DEVICE". DEVICE is one the row lists: cpu,
cuda, cuda:1 (the distributed rows run under torchrun). Rows:
"""


def main(argv) -> int:
    global ct, testing
    if len(argv) != 2 or argv[0] not in ROWS or argv[1] not in ROWS[argv[0]].devices:
        rows = "\n".join(f"  {n}: {' '.join(r.devices)}" for n, r in ROWS.items())
        print(USAGE + rows, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else None)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    name, device = argv
    r = ROWS[name]
    import mutants  # (a deliberate bug where CUPY_ACT_MUTANT names one: tests/mutants.py)

    mutants.apply_from_env()
    if not r.own_imports:
        import cupy_act.testing as testing_module
        import cupy_act.torch as ct_module

        ct, testing = ct_module, testing_module
    r.fn(device)
    if os.environ.get("RANK", "0") == "0":
        print(f"PASS {name} {device}", flush=True)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    if "RANK" in os.environ:
        # A torchrun rank leaves without running C++ static destructors: gloo's
        # worker threads can still be joinable then, even after barrier() and
        # destroy_process_group(), and std::terminate aborted a rank that had
        # passed (CI, 2-core machine, twice). Every check ran above; a failure
        # raised before this line and exits non-zero as usual.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
