"""The public API's shape, without a GPU: one positional order for the CuPy
and torch functions (arrays, then numbers; bias, out and mask by keyword),
a required divisor, clear errors where an argument lands in the wrong place,
no silently ignored flag, and the fused convolution only where the device
has the tensor cores it needs."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import cupy_act  # noqa: E402
import cupy_act.torch as ct  # noqa: E402
from cupy_act import _conv  # noqa: E402
from cupy_act.torch import _conv_checks, _impl  # noqa: E402

CUPY_FUNCTIONS = [n for n in cupy_act.__all__ if callable(getattr(cupy_act, n))]


def _keywords(name: str) -> set:
    """What ``name`` takes by keyword only: the buffers it writes (out=, a
    mask it returns), and the elementwise ops' bias (the convolution takes
    (x, weight, bias) as F.conv2d does)."""
    kw = {"out", "precision", "with_mask"}
    if name.endswith("_with_mask"):
        kw.add("mask")
    if name != "conv2d_div_leaky_relu":
        kw.add("bias")
    return kw


@pytest.mark.parametrize("name", CUPY_FUNCTIONS)
def test_cupy_functions_take_buffers_by_keyword(name):
    params = inspect.signature(getattr(cupy_act, name)).parameters.values()
    for p in params:
        if p.name in _keywords(name):
            assert p.kind is p.KEYWORD_ONLY, (name, p.name)


@pytest.mark.parametrize("op", ["relu", "leaky_relu", "div_leaky_relu"])
def test_positional_order_is_the_same_in_cupy_and_torch(op):
    """The torch function's positional parameters (less input and inplace)
    are the CuPy one's, in the same order."""
    cupy_pos = [
        p.name for p in inspect.signature(getattr(cupy_act, op)).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD
    ][1:]  # fmt: skip
    torch_pos = [
        p.name for p in inspect.signature(getattr(ct, op)).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "inplace"
    ][1:]  # fmt: skip
    assert cupy_pos == torch_pos


def test_a_tensor_where_a_flag_or_number_belongs_is_named():
    x, b = torch.randn(2, 3, 4, 4), torch.randn(3)
    with pytest.raises(TypeError, match="inplace must be a bool, got a Tensor .*bias="):
        ct.div_leaky_relu(x, 2.0, 0.01, b)  # (the CuPy order of old: bias fourth)
    with pytest.raises(TypeError, match="divisor must be a real number"):
        ct.div_leaky_relu(x, b, 2.0)
    assert torch.equal(ct.relu(x * 1, 1), torch.relu(x))  # (a truthy non-tensor: as PyTorch)


@pytest.mark.parametrize("fn", [ct.conv2d_div_leaky_relu, cupy_act.conv2d_div_leaky_relu])
def test_convolution_requires_its_divisor(fn):
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    with pytest.raises(TypeError, match="missing required argument 'divisor'"):
        fn(x, w)


@pytest.mark.parametrize("algorithm", ["fused", "fused_tf32", "auto"])
def test_channels_last_flag_is_not_ignored(algorithm):
    with pytest.raises(ValueError, match="channels_last=True .* algorithm='channels_last'"):
        ct.ConvDivLeakyReLU(3, 4, 3, 2.0, channels_last=True, algorithm=algorithm)
    assert ct.ConvDivLeakyReLU(3, 4, 3, 2.0, channels_last=True).algorithm == "channels_last"


@pytest.mark.parametrize("sm, fused", [(75, False), (80, True), (90, True)])
def test_fused_convolution_needs_compute_capability_8(sm, fused, monkeypatch):
    """Below 8.0 the kinds of call the fused kernel would run take "exact"."""
    monkeypatch.setattr(_impl, "on_gpu", lambda x: True)
    monkeypatch.setattr(_conv.kernels, "_sm", lambda device: sm)
    monkeypatch.setattr(_conv_checks, "_checks", {})
    x, w, b = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(4)
    c = _conv_checks._checked(x, w, b, 2.0, 0.01, 1, 0, 1, "fused")
    assert c.fusable == (fused, fused)
