"""torch.compile's default route: our activations trace into PyTorch operations.

The compiled forward and backward graphs hold no ``cupy_act::`` op, autograd
saves no more than with PyTorch's activations, and Inductor's code gives
compiled PyTorch's bits; the measured candidates (packed masks in traced
operations, the convolution block's kernel epilogue) keep their bits too.
The custom-op route (``set_compile_route("kernels")``) keeps its own tests
here; the conformance rows cover the compile modes end to end.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as TF  # noqa: E402
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition  # noqa: E402
from torch import nn  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402
from cupy_act._arrays import mask_nbytes  # noqa: E402
from cupy_act.torch import _traced  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Tests that compile with Inductor: its C++ compiles on the CPU (40 s of the
# default run on a 2-core machine) run in the exhaustive pass (-m slow);
# tests/test_torch_adapter.py keeps one Inductor CPU compile in the default.
INDUCTOR_DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), DEVICES[1]]
COMPILE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B = (1, -1, 1, 1)  # a per-channel bias's view


def _twice(f):
    """f on a non-leaf copy of x (in-place ops need one under autograd)."""
    return lambda x, b: f(x * 1, b)


# name -> (ours, PyTorch's): functions (x, b) -> y of a 4-D x and a per-channel b
CASES = {
    "relu": (lambda x, b: ct.relu(x), lambda x, b: torch.relu(x)),
    "relu_": (_twice(lambda x, b: ct.relu(x, True)), _twice(lambda x, b: torch.relu_(x))),
    "leaky_relu": (lambda x, b: ct.leaky_relu(x, 0.2), lambda x, b: TF.leaky_relu(x, 0.2)),
    "leaky_relu_": (
        _twice(lambda x, b: ct.leaky_relu(x, 0.2, True)),
        _twice(lambda x, b: TF.leaky_relu(x, 0.2, True)),
    ),
    # PyTorch refuses a negative slope in place under autograd: its out-of-place form
    "leaky_relu_negative_": (
        _twice(lambda x, b: ct.leaky_relu(x, -0.3, True)),
        _twice(lambda x, b: TF.leaky_relu(x, -0.3)),
    ),
    "div_leaky_relu": (
        lambda x, b: ct.div_leaky_relu(x, -1.7, 0.1),
        lambda x, b: TF.leaky_relu(x / -1.7, 0.1),
    ),
    "div_leaky_relu_bias": (
        lambda x, b: ct.div_leaky_relu(x, 2.0, 0.01, bias=b),
        lambda x, b: TF.leaky_relu((x + b.view(B)) / 2.0, 0.01),
    ),
    "div_leaky_relu_bias_": (
        _twice(lambda x, b: ct.div_leaky_relu(x, 2.0, 0.01, inplace=True, bias=b)),
        _twice(lambda x, b: TF.leaky_relu(x.add_(b.view(B)).div_(2.0), 0.01, inplace=True)),
    ),
    "modules": (
        lambda x, b: ct.LeakyReLU(0.1, inplace=True)(ct.DivLeakyReLU(3.0)(ct.ReLU()(x))),
        lambda x, b: nn.LeakyReLU(0.1, inplace=True)(TF.leaky_relu(nn.ReLU()(x) / 3.0)),
    ),
    "activations_mode": (
        lambda x, b: _in_mode(lambda: TF.leaky_relu(torch.relu(x), 0.3)),
        lambda x, b: TF.leaky_relu(torch.relu(x), 0.3),
    ),
}


def _in_mode(f):
    with ct.activations_mode():
        return f()


class Recorder:
    """An AOTAutograd backend that keeps the forward and backward graphs and runs
    them as they are (no C++ compiler needed), partitioned by Inductor's min-cut
    (after ``joint_pass(graph)`` on the joint graph, where given, as Inductor's
    joint-graph hook runs)."""

    def __init__(self, joint_pass=None):
        self.graphs = []
        self.joint_pass = joint_pass

    def __call__(self, gm, example_inputs):
        def keep(g, _inputs):
            self.graphs.append(g)
            return make_boxed_func(g)

        def partition(joint, *args, **kwargs):
            if self.joint_pass is not None:
                self.joint_pass(joint.graph)
                joint.recompile()
            return min_cut_rematerialization_partition(joint, *args, **kwargs)

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=keep, bw_compiler=keep, partition_fn=partition
        )

    def code(self) -> str:
        return "\n".join(g.code for g in self.graphs)

    def saved_bytes(self) -> int:
        """Bytes the backward graphs take from the forward: their inputs but the tangents."""
        total = 0
        for g in self.graphs[1:]:
            for node in g.graph.find_nodes(op="placeholder"):
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor) and not node.name.startswith("tangents"):
                    total += val.numel() * val.element_size()
        return total


def data(device, dtype=torch.float32, shape=(2, 3, 4, 5)):
    """x, bias and an upstream gradient, with NaN, infinities, signed zeros and
    subnormals mixed in."""
    return testing.make_inputs(device, dtype, shape)[:3]


def fwd_bwd(f, x, b, dy):
    """(y, dx, db) of f(x, b) for upstream dy (db: zeros where f ignores b)."""
    xr, br = (t.detach().clone().requires_grad_(True) for t in (x, b))
    y = f(xr, br)
    dx, db = torch.autograd.grad(y, (xr, br), dy, allow_unused=True)
    return y.detach(), dx, torch.zeros_like(b) if db is None else db


def record(f, x, b, dy, **kw):
    rec = Recorder()
    torch._dynamo.reset()
    out = fwd_bwd(torch.compile(f, backend=rec, fullgraph=True, **kw), x, b, dy)
    return out, rec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_graphs_hold_pytorch_ops_and_save_no_more(name, device):
    ours, theirs = CASES[name]
    x, b, dy = data(device)
    got, rec = record(ours, x, b, dy)
    want, rec_torch = record(theirs, x, b, dy)
    assert len(rec.graphs) == 2, "expected one forward and one backward graph"
    assert "cupy_act" not in rec.code(), rec.code()
    assert rec.saved_bytes() <= rec_torch.saved_bytes(), (rec.code(), rec_torch.code())
    for a, e, what in zip(got, want, ("y", "dx", "dbias")):
        testing.assert_bits_equal(a, e, f"{name} {what}")  # (aten ops run as traced: eager bits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_packed_mask_candidate_gives_pytorch_bits(name, device, monkeypatch):
    """The measured candidate ``_traced.ACT_MASK``: every activation under autograd
    saves a packed mask (in place too), with PyTorch's results and gradients."""
    monkeypatch.setattr(_traced, "ACT_MASK", (8, "flat"))
    ours, theirs = CASES[name]
    x, b, dy = data(device)
    got, rec = record(ours, x, b, dy)
    want = fwd_bwd(theirs, x, b, dy)
    assert "cupy_act" not in rec.code() and "lshift" in rec.code(), rec.code()
    for a, e, what in zip(got, want, ("y", "dx", "dbias")):
        testing.assert_bits_equal(a, e, f"{name} {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_shapes_and_export(device):
    f = CASES["div_leaky_relu_bias"][0]
    rec = Recorder()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=rec, fullgraph=True, dynamic=True)
    for n in (2, 5, 7):
        x, b, dy = data(device, shape=(n, 3, 4, 5))
        got, want = fwd_bwd(compiled, x, b, dy), fwd_bwd(CASES["div_leaky_relu_bias"][1], x, b, dy)
        for a, e in zip(got, want):
            testing.assert_bits_equal(a, e, f"dynamic n={n}")
    assert len(rec.graphs) == 2, "one dynamic graph pair should serve every size"
    assert "cupy_act" not in rec.code()

    class M(nn.Module):
        def forward(self, x):
            return ct.leaky_relu(ct.relu(x), 0.2, inplace=True)

    x = data(device)[0]
    exported = torch.export.export(M(), (x,))
    assert "cupy_act" not in str(exported.graph_module.code)
    testing.assert_bits_equal(exported.module()(x), TF.leaky_relu(torch.relu(x), 0.2))


def _chain(relu, leaky, div):
    """Every op in one function: out of place and in place, with a bias."""

    def f(x, b):
        h = relu(x * 1)
        h = leaky(h - 0.5, 0.2, False) + leaky(x, -0.3, False)
        h = leaky(h * 1, 0.1, True)
        return div(h, 2.0, 0.01, b, False) + div(x * 1, -1.7, 0.1, None, True)

    return f


OURS_CHAIN = _chain(
    ct.relu, ct.leaky_relu, lambda x, d, s, b, i: ct.div_leaky_relu(x, d, s, i, bias=b)
)


def _torch_div(x, d, s, b, inplace):
    if b is not None:
        x = x.add_(b.view(B)) if inplace else x + b.view(B)
    return TF.leaky_relu(x.div_(d) if inplace else x / d, s, inplace)


TORCH_CHAIN = _chain(torch.relu, TF.leaky_relu, _torch_div)


@pytest.mark.parametrize("device", INDUCTOR_DEVICES)
@pytest.mark.parametrize("dtype", COMPILE_DTYPES, ids=lambda d: str(d)[6:])
def test_inductor_gives_compiled_pytorch_bits(dtype, device):
    """Inductor (C++ on the CPU, Triton on CUDA): ours compiled equals PyTorch's
    activations compiled, forward and gradients, on special values in x and
    dy; the bias gradient also from a finite dy, where it is a number to
    compare (a sum over NaNs is NaN in both)."""
    x, b, dy = data(device, dtype, shape=(4, 8, 6, 10))
    finite = testing.make_grad(dy.numel(), dtype, device, 7).view(dy.shape)
    torch._dynamo.reset()
    ours = torch.compile(OURS_CHAIN, fullgraph=True)
    theirs = torch.compile(TORCH_CHAIN, fullgraph=True)
    for upstream, tag in ((dy, "special"), (finite, "finite")):
        got, want = fwd_bwd(ours, x, b, upstream), fwd_bwd(theirs, x, b, upstream)
        for a, e, what in zip(got, want, ("y", "dx", "dbias")):
            testing.assert_bits_equal(a, e, f"{dtype} {what} ({tag} dy)")
    assert want[2].isfinite().all()  # (the finite dy's bias gradient: numbers compared)


def _conv_cases():
    def ours(algorithm):
        return lambda x, w, b: ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm=algorithm)

    def theirs(channels_last):
        def f(x, w, b):
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
                w = w.contiguous(memory_format=torch.channels_last)
            return TF.leaky_relu(TF.conv2d(x, w, b) / 2.0, 0.01)

        return f

    return {
        "exact": (ours("exact"), theirs(False)),
        "channels_last": (ours("channels_last"), theirs(True)),
    }


def _conv_fwd_bwd(f, x, w, b, gy, x_grad):
    x = x.detach().clone().requires_grad_(x_grad)
    w, b = (t.detach().clone().requires_grad_(True) for t in (w, b))
    y = f(x, w, b)
    wrt = (x, w, b) if x_grad else (w, b)
    return (y.detach(), *torch.autograd.grad(y, wrt, gy))


# set_compiled_epilogue's choices; "route=kernels": "packed" under
# set_compile_route("kernels"), which puts our kernels there too; the other
# packings that scripts/models.py measures (conv.COMPILED_EPILOGUE's values)
EPILOGUES = ["traced", "packed", "kernels", "route=kernels", (8, "strided"), (32, "flat")]


@pytest.mark.parametrize("device", INDUCTOR_DEVICES)
@pytest.mark.parametrize("x_grad", [False, True], ids=["x_no_grad", "x_grad"])
@pytest.mark.parametrize("epilogue", EPILOGUES, ids=str)
@pytest.mark.parametrize("algorithm", ["exact", "channels_last"])
def test_conv_block_epilogues_under_compile(algorithm, epilogue, x_grad, device, monkeypatch):
    """The convolution block's epilogue under compile: by default ("traced")
    PyTorch operations, no cupy_act op, saving no more than PyTorch's block;
    "packed" (and the other packings) traced with a packed mask; "kernels"
    our kernel and its 1-bit mask. The masks replace at least a boolean per
    element of PyTorch's saved state. All give compiled PyTorch's bits (the
    bias gradient: its rounding)."""
    monkeypatch.setattr(ct.conv, "COMPILED_EPILOGUE", ct.conv.COMPILED_EPILOGUE)  # (restored)
    if epilogue == "route=kernels":
        monkeypatch.setattr(ct.functional._compile, "kernels", True)
        ct.set_compiled_epilogue("packed")
        epilogue = "kernels"
    elif isinstance(epilogue, str):
        ct.set_compiled_epilogue(epilogue)
        epilogue = ct.conv.COMPILED_EPILOGUE
    else:
        ct.conv.COMPILED_EPILOGUE = epilogue
    ours, theirs = _conv_cases()[algorithm]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 11, device=device)
    w, b = torch.randn(5, 3, 3, 3, device=device), torch.randn(5, device=device)
    gy = torch.randn(2, 5, 7, 9, device=device)
    recs = []
    for f in (ours, theirs):
        recs.append(Recorder())
        torch._dynamo.reset()
        _conv_fwd_bwd(torch.compile(f, backend=recs[-1], fullgraph=True), x, w, b, gy, x_grad)
    rec, rec_torch = recs
    code = rec.code()
    assert ("torch.ops.cupy_act.forward_mask" in code) == (epilogue == "kernels"), code
    n = gy.numel()
    if epilogue is None:
        assert rec.saved_bytes() <= rec_torch.saved_bytes(), (code, rec_torch.code())
    else:  # x and the weight for the convolution's backward, and the packed mask:
        # where PyTorch's compiled block keeps at least a boolean per element
        word = 8 if epilogue == "kernels" else epilogue[0]
        packed = mask_nbytes(n) if epilogue == "kernels" else -(-n // word) * word // 8
        conv_state = x.numel() * x.element_size() + w.numel() * w.element_size()
        assert rec.saved_bytes() == conv_state + packed, code
        assert rec.saved_bytes() <= rec_torch.saved_bytes() - n + packed, rec_torch.code()
    torch._dynamo.reset()
    got = _conv_fwd_bwd(torch.compile(ours, fullgraph=True), x, w, b, gy, x_grad)
    want = _conv_fwd_bwd(torch.compile(theirs, fullgraph=True), x, w, b, gy, x_grad)
    for i, (a, e) in enumerate(zip(got[:-1], want[:-1])):
        testing.assert_bits_equal(a, e, f"{algorithm} {epilogue} output {i}")
    # the bias gradient is a reduction whose order the compiler picks per graph
    # (ours differ in where the epilogue ends): float32 rounding apart
    torch.testing.assert_close(got[-1], want[-1], rtol=1e-6, atol=1e-6)


def test_set_compiled_epilogue():
    assert ct.conv.COMPILED_EPILOGUE is None, "the default: traced, Inductor's saved state"
    try:
        assert ct.set_compiled_epilogue("packed") == "traced"
        assert ct.conv.COMPILED_EPILOGUE == (8, "flat")
        assert ct.set_compiled_epilogue("kernels") == "packed"
    finally:
        assert ct.set_compiled_epilogue("traced") == "kernels"
    with pytest.raises(ValueError, match=r"epilogue='mask'.*\('traced', 'packed', 'kernels'\)"):
        ct.set_compiled_epilogue("mask")


@pytest.mark.gpu
@pytest.mark.parametrize("word", [8, 32])
def test_flat_packing_fuses_with_the_forward(word):
    """Inductor's Triton code writes y and the packed words of the "flat" layout
    in one kernel (y is read through the words on the packing's grid), so the
    mask costs no second read of the activation's input. (Its C++ code fuses
    them however y is written: no CPU case.)"""
    device = "cuda"
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    z = torch.randn(4, 16, 30, 30, device=device, requires_grad=True)
    torch._dynamo.reset()
    f = torch.compile(
        lambda z: _traced.packed_mask_act(z, None, "div_leaky_relu", 0.01, 2.0, word, "flat")
    )
    _, (forward, _) = run_and_get_code(lambda: f(z).backward(torch.randn_like(z)))
    assert forward.count("async_compile.triton(") == 1, forward


@pytest.mark.parametrize("word", [8, 32])
@pytest.mark.parametrize("layout", ["strided", "flat"])
@pytest.mark.parametrize("shape", [(3,), (2, 3, 4, 5), (1, 7, 3, 3), (2, 5, 1, 9)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_traced_pack_round_trip(channels_last, shape, layout, word):
    bits = torch.rand(shape) > 0.5
    if channels_last and len(shape) == 4:
        bits = bits.contiguous(memory_format=torch.channels_last)
    mask = _traced.pack(bits, word, layout)
    assert mask.numel() == -(-bits.numel() // word)
    assert mask.dtype == (torch.uint8 if word == 8 else torch.int32)
    cl = channels_last and len(shape) == 4
    for test in (False, True):
        assert torch.equal(_traced.unpack(mask, bits.shape, cl, layout, test), bits)


def test_kernels_route_puts_our_ops_in_the_graph_and_recompiles_on_a_switch():
    x, b, dy = data("cpu")
    rec = Recorder()
    torch._dynamo.reset()
    f = torch.compile(CASES["div_leaky_relu_bias"][0], backend=rec, fullgraph=True)
    want = fwd_bwd(CASES["div_leaky_relu_bias"][1], x, b, dy)
    assert ct.set_compile_route("kernels") == "traced"
    try:
        got = fwd_bwd(f, x, b, dy)
        assert "torch.ops.cupy_act.forward_mask" in rec.code()
        assert "torch.ops.cupy_act.backward" in rec.code()
    finally:
        assert ct.set_compile_route("traced") == "kernels"
    testing.assert_bits_equal(got[0], want[0], "kernels route y")
    testing.assert_bits_equal(got[1], want[1], "kernels route dx")
    rec.graphs.clear()
    fwd_bwd(f, x, b, dy)
    assert rec.graphs and "cupy_act" not in rec.code(), "the switch back did not recompile"
    with pytest.raises(ValueError, match=r"route='triton'.*\('traced', 'kernels'\)"):
        ct.set_compile_route("triton")


@pytest.mark.parametrize(
    "value,expect",
    [("kernels", "True"), ("traced", "False"), ("cuda", "ValueError: CUPY_ACT_COMPILE_ROUTE=")],
)
def test_route_from_the_environment(value, expect):
    code = (
        "try:\n import cupy_act.torch.functional as f; print(f._compile.kernels)\n"
        "except ValueError as e: print('ValueError:', e)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUPY_ACT_COMPILE_ROUTE=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert expect in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("fullgraph", [False, True])
def test_bad_arguments_keep_their_errors_under_compile(fullgraph):
    x = torch.randn(4, 3, requires_grad=True)
    calls = {
        r"negative_slope must be a real number.*'a'": lambda x: ct.leaky_relu(x, "a"),
        r"divisor": lambda x: ct.div_leaky_relu(x, 0.0),
        r"bias has shape \(5,\)": lambda x: ct.div_leaky_relu(x, 2.0, bias=torch.randn(5)),
    }
    for pattern, f in calls.items():
        torch._dynamo.reset()
        # without fullgraph the call falls back to eager and raises there; with it,
        # Dynamo's error carries ours
        with pytest.raises(RuntimeError if fullgraph else (TypeError, ValueError), match=pattern):
            torch.compile(f, backend="aot_eager", fullgraph=fullgraph)(x)
