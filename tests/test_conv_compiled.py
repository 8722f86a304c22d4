"""conv2d_div_leaky_relu under torch.compile: the fused algorithm as the
lean ops (``forward_op``, ``wgrad_op``, ``dgrad_op``: Library ops without a
Python autograd kernel, the formula an autograd.Function Dynamo traces), and
``"auto"`` resolving to eager's choice. CPU: graphs recorded with the ops'
CPU stand-ins; CUDA with the ``gpu`` marker."""

import pytest

torch = pytest.importorskip("torch")

from test_compile_route import Recorder  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _conv, _timing, testing  # noqa: E402
from cupy_act.torch import _conv_auto, _conv_checks, _impl, conv  # noqa: E402


@pytest.fixture
def as_if_cuda(monkeypatch):
    """CPU tensors take the fused paths' decisions (compute capability 9.0) and
    the ops run as CPU stand-ins returning zeros of the fake kernels' sizes."""
    monkeypatch.setattr(_impl, "on_gpu", lambda x: True)
    monkeypatch.setattr(_conv.kernels, "_sm", lambda device: 90)
    monkeypatch.setattr(_conv_checks, "_checks", {})
    lib = torch.library.Library("cupy_act", "IMPL")
    for name, fake in (
        ("conv2d_div_leaky_relu_forward", conv._forward_fake),
        ("conv2d_div_leaky_relu_wgrad", conv._wgrad_fake),
        ("conv2d_div_leaky_relu_dgrad", conv._dgrad_fake),
    ):
        lib.impl(name, lambda *a, fake=fake: _zeroed(fake(*a)), "CPU")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    lib._destroy()


def _zeroed(out):
    return out.zero_() if isinstance(out, torch.Tensor) else tuple(t.zero_() for t in out)


@pytest.mark.parametrize("x_grad", [False, True])
def test_fused_training_compiles_to_the_lean_ops(x_grad, as_if_cuda):
    """A compiled training step of the fused block (8 -> 8 channels, 3 x 3,
    stride 1: both gradient kernels fit) calls the forward op in the forward
    graph and the weight- and input-gradient ops in the backward (the input
    gradient only where x needs one), never the custom op ``fused_op``,
    whose autograd is a Python kernel every call would pass through."""
    x = torch.randn(2, 8, 10, 10, requires_grad=x_grad)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    rec = Recorder()

    def step(x, w, b):
        return ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, 1, algorithm="fused").sum()

    torch.compile(step, backend=rec, fullgraph=True)(x, w, b).backward()
    forward, backward = rec.graphs[0].code, rec.graphs[1].code
    assert forward.count("cupy_act.conv2d_div_leaky_relu_forward.default") == 1
    assert "cupy_act.conv2d_div_leaky_relu.default" not in rec.code()
    assert backward.count("cupy_act.conv2d_div_leaky_relu_wgrad.default") == 1
    assert backward.count("cupy_act.conv2d_div_leaky_relu_dgrad.default") == int(x_grad)


def test_fused_inference_compiles_to_the_forward_op(as_if_cuda):
    x, w = torch.randn(2, 8, 10, 10), torch.randn(8, 8, 3, 3)
    rec = Recorder()
    torch.compile(
        lambda x, w: ct.conv2d_div_leaky_relu(x, w, None, 2.0, algorithm="fused"), backend=rec
    )(x, w)
    code = rec.code()
    assert "cupy_act.conv2d_div_leaky_relu_forward.default" in code
    assert "with_mask = False" in code or ", False)" in code  # (no mask without a backward)


@pytest.mark.parametrize("first", ["eager", "compiled"])
@pytest.mark.parametrize("grad", [False, True])
def test_auto_under_compile_is_eagers_choice(first, grad, monkeypatch):
    """Traced by Dynamo, "auto" takes the algorithm eager "auto" picks for the
    same call: measured once (by whichever runs first) and shared; the
    compiled output is that algorithm's (here "channels_last", made the
    fastest: a channels-last output)."""
    monkeypatch.setattr(_impl, "on_gpu", lambda x: True)
    monkeypatch.setattr(_conv.kernels, "_sm", lambda device: 75)  # (no fused kernel: CPU runs)
    monkeypatch.setattr(_conv_checks, "_checks", {})
    monkeypatch.setattr(_conv_auto, "_choices", {})
    timed = []

    def times(runs):
        timed.append(sorted(runs))
        return {name: (0.5 if name == "channels_last" else 1.0) for name in runs}

    monkeypatch.setattr(_timing, "interleaved_median_ms", times)
    x = torch.randn(2, 3, 9, 9, requires_grad=grad)
    w = torch.randn(4, 3, 3, 3, requires_grad=grad)

    def block(x, w):
        return ct.conv2d_div_leaky_relu(x, w, None, 2.0, algorithm="auto", allow_tf32=True)

    torch._dynamo.reset()
    try:
        runs = [lambda: block(x, w), lambda: torch.compile(block, backend="eager")(x, w)]
        outs = [run() for run in (runs if first == "eager" else runs[::-1])]
    finally:
        torch._dynamo.reset()
    assert timed == [["channels_last", "exact"]]
    assert list(_conv_auto.auto_choices().values()) == ["channels_last"]
    for y in outs:
        assert y.is_contiguous(memory_format=torch.channels_last)
    testing.assert_bits_equal(outs[0], outs[1])


# ---- CUDA ----


@pytest.mark.gpu
@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_fused_block_is_eagers_bits(mode, x_grad):
    """The compiled fused block (Inductor, with and without CUDA graphs) gives
    eager's output and gradients bit for bit (the same kernels), without
    recompiling across steps."""
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 8, 32, 32, device="cuda", generator=gen)
    w = (torch.randn(16, 8, 3, 3, device="cuda", generator=gen) * 0.2).requires_grad_()
    b = torch.randn(16, device="cuda", generator=gen).requires_grad_()
    gy = torch.randn(4, 16, 32, 32, device="cuda", generator=gen)

    def block(x, w, b):
        return ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, 1, algorithm="fused")

    def steps(fn, graphs=False):
        out = []  # (cloned: a CUDA graph's outputs are overwritten by its next replay)
        for _ in range(3):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            xi = x.clone().requires_grad_(x_grad)
            y = fn(xi, w, b)
            grads = torch.autograd.grad(y, [xi, w, b] if x_grad else [w, b], gy)
            out += [t.clone() for t in (y.detach(), *grads)]
        return out

    want = steps(block)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = steps(torch.compile(block, mode=mode), graphs=mode == "reduce-overhead")
    for i, (a, e) in enumerate(zip(got, want)):
        testing.assert_bits_equal(a, e, f"output {i}")
    torch._dynamo.reset()
