"""Mismatched inputs, entry point by entry point: every tensor a kernel would
index is checked before the launch, and a mismatch gets PyTorch's own error
(where PyTorch's op refuses the same input: the same exception class and
message) or one that names the function and the value, with no kernel
launched.

The launches are recorded at the driver calls (``_launch._launch_kernel``,
``_launch._memset_async``). On the CPU the fused BatchNorm and convolution
paths run on CPU tensors with fake kernels (``_impl.on_gpu`` answers yes,
the kernels' handles and the device's SM count are stand-ins): the
launches are recorded, not made, so the table runs in CI. On a GPU
(``cuda`` cases) the same table runs on CUDA tensors with real kernels, the
launches recorded and made; the device run repeats it under
compute-sanitizer with the caching allocators off.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _batchnorm, _conv, _launch  # noqa: E402
from cupy_act.torch import _bn_kernels, _conv_checks, _impl, conv  # noqa: E402
from cupy_act.torch import batchnorm as bnmod  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def launched(monkeypatch, request):
    """The list of driver calls made from here on: ("launch", CUfunction) and
    ("memset", address). On "cpu", the fused paths' kernels are fakes and
    nothing reaches a driver."""
    device = request.getfixturevalue("device")
    calls: list = []
    real_launch, real_memset = _launch._launch_kernel, _launch._memset_async

    def launch(ptr, *args):
        calls.append(("launch", ptr))
        if device == "cuda":
            real_launch(ptr, *args)

    def memset(ptr, *args):
        calls.append(("memset", ptr))
        if device == "cuda":
            real_memset(ptr, *args)

    monkeypatch.setattr(_launch, "_launch_kernel", launch)
    monkeypatch.setattr(_launch, "_memset_async", memset)
    monkeypatch.setattr(
        _conv_checks, "_checks", {}
    )  # (kinds of call kept with this device's answers)
    if device == "cpu":
        _fake_kernels(monkeypatch)
    return calls


def _fake_kernels(monkeypatch):
    """The fused BatchNorm and convolution paths on CPU tensors: fake kernels
    in a fake context, a fake stream and SM count."""
    from test_conv import _record_launches

    run = _launch.run  # (the real one: its driver call is the one recorded)
    monkeypatch.setattr(_impl, "on_gpu", lambda x: True)
    monkeypatch.setattr(_impl, "_raw_stream", lambda device: 5)
    monkeypatch.setattr(_launch, "_ctx_get_current", lambda: 7)
    monkeypatch.setattr(_launch, "_ctx_set_current", lambda ctx: None)
    monkeypatch.setattr(_bn_kernels, "_capturing", lambda: False)
    monkeypatch.setattr(_bn_kernels, "_arrival_sets", {})
    monkeypatch.setattr(_bn_kernels, "_new_set", lambda device: 4096)
    monkeypatch.setattr(
        _batchnorm, "_kernel", lambda d, t, name: _batchnorm._Kernel(hash(name) % 997 + 1, 7, None)
    )
    monkeypatch.setattr(_batchnorm, "_kernels", {})
    monkeypatch.setattr(_batchnorm, "_passes", {})
    monkeypatch.setattr(_batchnorm, "_plans", {})
    monkeypatch.setitem(_batchnorm._sms, None, 132)
    # the convolution: the prepared launches of test_conv's recorder, fired
    # through the driver call recorded above
    _record_launches(monkeypatch)
    monkeypatch.setattr(_launch, "run", run)
    fake = _conv.ConvKernel(11, 7, None)
    monkeypatch.setattr(_conv.forward, "kernel", lambda *a: _conv.ForwardKernels(fake, None))
    monkeypatch.setattr(_conv.dgrad, "_dgrad_launches", {})


def _raised(f):
    """(exception class, message) of f(), or None where it returns."""
    try:
        f()
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return type(e), str(e)
    return None


# ---- BatchNormAct2d, fuse_batchnorm_act and fuse_batchnorm_act_fx ----


def _param(t):
    return nn.Parameter(t.detach(), requires_grad=True)


# (id, what to change in both modules (ours and nn.BatchNorm2d(16)), input shape).
# Each row's change is made the same way to both; the reference's error is the one expected.
BN_CASES = [
    ("channels_32", None, (4, 32, 5, 5)),
    ("channels_8", None, (4, 8, 5, 5)),
    ("weight_8", lambda m: setattr(m, "weight", _param(torch.randn(8))), (4, 16, 5, 5)),
    ("bias_32", lambda m: setattr(m, "bias", _param(torch.randn(32))), (4, 16, 5, 5)),
    ("running_mean_8", lambda m: setattr(m, "running_mean", torch.zeros(8)), (4, 16, 5, 5)),
    ("running_var_15", lambda m: setattr(m, "running_var", torch.ones(15)), (4, 16, 5, 5)),
    ("running_var_none", lambda m: setattr(m, "running_var", None), (4, 16, 5, 5)),
    ("weight_float64", lambda m: setattr(m, "weight", _param(m.weight.double())), None),
    ("params_float16", lambda m: m.half(), (4, 16, 5, 5)),
    ("running_float64", lambda m: setattr(m, "running_mean", m.running_mean.double()), None),
    ("weight_strided", lambda m: setattr(m, "weight", _param(m.weight.repeat(2)[::2])), None),
    ("count_float", lambda m: setattr(m, "num_batches_tracked", torch.tensor(0.0)), None),
    ("empty_batch", None, (0, 16, 5, 5)),
    (
        "weight_on_meta",
        lambda m: setattr(m, "weight", _param(torch.empty(16, device="meta"))),
        None,
    ),
    # (mismatches where the input is on a GPU; on the CPU the same device)
    ("weight_on_cpu", lambda m: setattr(m, "weight", _param(m.weight.cpu())), None),
    ("running_mean_on_cpu", lambda m: setattr(m, "running_mean", m.running_mean.cpu()), None),
    ("input_3d", None, (4, 16, 5)),
    ("input_5d", None, (4, 16, 5, 5, 2)),
    ("one_value_per_channel", None, (1, 16, 1, 1)),
    ("no_running_stats", lambda m: m.__init__(16, track_running_stats=False), (4, 32, 5, 5)),
]


def _bn_pair(memory: str, training: bool, change, device):
    """(ours, PyTorch's BatchNorm2d + LeakyReLU(0.1)) with one random state and
    ``change`` applied to both BatchNorms."""
    ours = ct.BatchNormAct2d(16, act_layer="leaky_relu", act_kwargs={"negative_slope": 0.1},
                             memory=memory)  # fmt: skip
    ref = nn.BatchNorm2d(16)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.linspace(0.5, 2.0, 16))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 16))
            m.running_mean.copy_(torch.linspace(-0.5, 0.5, 16))
            m.running_var.copy_(torch.linspace(0.5, 1.5, 16))
    for m in (ours, ref):
        m.to(device).train(training)
        if change is not None:
            with torch.no_grad():
                change(m)
    return ours, nn.Sequential(ref, nn.LeakyReLU(0.1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory", ["default", "inplace"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", BN_CASES, ids=[c[0] for c in BN_CASES])
def test_batchnorm_mismatch_raises_as_pytorch_without_launch(
    case, training, memory, device, launched
):
    """Each mismatch: nn.BatchNorm2d's exception class and message (or its
    result where it accepts the input), and no kernel launched."""
    name, change, shape = case
    ours, ref = _bn_pair(memory, training, change, device)
    x = torch.randn(shape or (4, 16, 5, 5), device=device)
    expected = _raised(lambda: ref(x.clone()))
    got = _raised(lambda: ours(x.clone()))
    if expected is not None:
        assert got == expected
        assert launched == []
        return
    assert got is None, got  # PyTorch accepts it: so do we, with its result (where the
    if device == "cuda" or not launched:  # kernels ran here, fakes: no result to compare)
        torch.testing.assert_close(ours(x.clone()), ref(x.clone()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batchnorm_mismatch_table_control_launches(training, device, launched):
    """The table's control: the same modules with matching inputs do reach
    the kernels (the recorder sees the fused path)."""
    ours, _ = _bn_pair("default", training, None, device)
    ours(torch.randn(4, 16, 5, 5, device=device))
    assert any(kind == "launch" for kind, _ in launched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fuser", ["fuse_batchnorm_act", "fuse_batchnorm_act_fx"])
def test_fused_model_channel_mismatch_raises_as_pytorch(fuser, device, launched):
    """A model the fusers made, wired for 16 channels and given 32: PyTorch's
    own model's error, and no launch."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.act = nn.BatchNorm2d(16), nn.ReLU()

        def forward(self, x):
            return self.act(self.bn(x))

    ref = Block().to(device)
    ours = Block().to(device)
    ours = ct.fuse_batchnorm_act_fx(ours)[0] if fuser.endswith("fx") else ct.fuse_batchnorm_act(
        nn.Sequential(ours.bn, ours.act))[0]  # fmt: skip
    assert any(isinstance(m, ct.BatchNormAct2d) for m in ours.modules())
    x = torch.randn(2, 32, 3, 3, device=device)
    expected = _raised(lambda: ref(x))
    assert expected is not None and _raised(lambda: ours(x)) == expected
    assert launched == []


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_without_bias_mismatch_free(device, launched):
    """``bias=False`` (nn.BatchNorm2d's keyword since torch 2.13) on every
    torch: a weight and no bias, the state_dict without one, the fused
    kernels launched; on a GPU the output is that of a zero bias, bit for bit."""
    m = ct.BatchNormAct2d(16, bias=False).to(device)
    assert m.bias is None and m.weight is not None and "bias" not in m.state_dict()
    if "bias" in bnmod.inspect.signature(nn.BatchNorm2d.__init__).parameters:
        assert set(m.state_dict()) == set(nn.BatchNorm2d(16, bias=False).state_dict())
    x = torch.randn(4, 16, 5, 5, device=device)
    y = m(x)
    assert any(kind == "launch" for kind, _ in launched)
    if device == "cuda":
        zero = ct.BatchNormAct2d(16).to(device)
        with torch.no_grad():
            zero.weight.copy_(m.weight)
            zero.bias.zero_()
        assert torch.equal(zero(x), y)


# ---- the elementwise custom ops (torch.ops.cupy_act.*), called directly ----


def _x(device, shape=(2, 3, 4, 5), dtype=torch.float32):
    return torch.randn(shape, device=device, dtype=dtype)


OP_CASES = [
    # (id, op name, args after x, exception, words in the message)
    ("bias_length", "div_leaky_relu", (0.01, 2.0, "b4"), ValueError, "bias has shape (4,)"),
    ("bias_dtype", "div_leaky_relu", (0.01, 2.0, "b3f64"), TypeError, "bias is torch.float64"),
    ("bias_device", "div_leaky_relu", (0.01, 2.0, "b3meta"), TypeError, "on meta"),
    ("bias_for_relu", "relu", (0.0, 1.0, "b3"), ValueError, "takes no bias"),
    ("unknown_op", "gelu", (0.0, 1.0, None), ValueError, "op='gelu'"),
    ("zero_divisor", "div_leaky_relu", (0.01, 0.0, None), ValueError, "divisor"),
    ("nan_divisor", "div_leaky_relu", (0.01, math.nan, None), ValueError, "divisor"),
]


def _bias(code, device):
    return {
        None: None,
        "b3": torch.randn(3, device=device),
        "b4": torch.randn(4, device=device),
        "b3f64": torch.randn(3, device=device, dtype=torch.float64),
        "b3meta": torch.empty(3, device="meta"),
    }[code]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["forward", "forward_mask", "forward_mask_"])
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_custom_op_mismatch_raises_without_launch(case, which, device, launched):
    """torch.ops.cupy_act.forward / forward_mask / forward_mask_ called
    directly: a bias of the wrong length, dtype or device, a bias for an op
    without one, an unknown op, a bad divisor: the error names the op and the
    value, and nothing is launched."""
    _, op, (slope, divisor, bias), exc, words = case
    fn = getattr(torch.ops.cupy_act, which)
    x = _x(device)
    with pytest.raises(
        exc, match=f"cupy_act::{which}: .*" + words.replace("(", r"\(").replace(")", r"\)")
    ):
        fn(x, op, slope, divisor, _bias(bias, device))
    assert launched == []


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_mismatch_refuses_integer_input(device, launched):
    with pytest.raises(TypeError, match="cupy_act::forward: input has dtype torch.int32"):
        torch.ops.cupy_act.forward(torch.ones(3, dtype=torch.int32, device=device), "relu", 0.0,
                                   1.0, None)  # fmt: skip
    assert launched == []


BACKWARD_CASES = [
    # (id, mask from dy's device, channels_last, exception, words); dy has 120 elements
    ("mask_short", lambda d: torch.zeros(8, dtype=torch.uint8, device=d), False, ValueError,
     "cupy_act::backward: .*at least 16 bytes"),
    ("mask_dtype", lambda d: torch.zeros(16, dtype=torch.int8, device=d), False, ValueError,
     "cupy_act::backward: mask is torch.int8"),
    ("mask_strided", lambda d: torch.zeros(32, dtype=torch.uint8, device=d)[::2], False,
     ValueError, "cupy_act::backward: .*not contiguous"),
    ("mask_device", lambda d: torch.zeros(16, dtype=torch.uint8, device="meta"), False,
     ValueError, "cupy_act::backward: .*on meta"),
    ("mask_not_tensor", lambda d: b"\x00" * 16, False, RuntimeError,  # (the schema's own check)
     "cupy_act::backward.*Expected a value of type 'Tensor' for argument 'mask'"),
    ("channels_last_3d", lambda d: torch.zeros(16, dtype=torch.uint8, device=d), True,
     ValueError, "cupy_act::backward: channels_last=True needs a 4-D or 5-D dy"),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_backward_op_mismatch_raises_without_launch(case, device, launched):
    """torch.ops.cupy_act.backward called directly with a mask that cannot be
    the forward's for dy, or a layout dy cannot have."""
    _, make_mask, channels_last, exc, words = case
    dy = _x(device, (2, 3, 4, 5) if not channels_last else (2, 60))
    with pytest.raises(exc, match=words):
        torch.ops.cupy_act.backward(dy, make_mask(device), "leaky_relu", 0.01, 1.0, channels_last)
    assert launched == []


@pytest.mark.gpu
def test_backward_op_mismatch_refuses_misaligned_mask():
    dy = _x("cuda")
    mask = torch.zeros(130, dtype=torch.uint8, device="cuda")[1:129]
    with pytest.raises(ValueError, match="4-byte aligned"):
        torch.ops.cupy_act.backward(dy, mask, "relu", 0.0, 1.0, False)


# ---- the convolution block: the public function and its custom ops ----


def _conv_inputs(device, xs=(2, 3, 9, 11), ws=(5, 3, 3, 3)):
    g = torch.Generator("cpu").manual_seed(0)
    x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g) * 0.3
    return x.to(device), w.to(device), torch.randn(ws[0], generator=g).to(device)


CONV_CASES = [
    # (id, change to (x, w, b)) -- each refused by F.conv2d as well
    ("bias_length", lambda x, w, b: (x, w, b[:4])),
    ("bias_2d", lambda x, w, b: (x, w, b.view(5, 1))),
    ("bias_float64", lambda x, w, b: (x, w, b.double())),
    ("weight_float64", lambda x, w, b: (x, w.double(), b)),
    ("weight_in_channels", lambda x, w, b: (x, torch.cat([w, w], 1), b)),
    ("weight_3d", lambda x, w, b: (x, w[:, :, 0], b)),
    ("input_5d", lambda x, w, b: (x.unsqueeze(-1), w, b)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", conv.ALGORITHMS)
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_mismatch_raises_as_conv2d_without_launch(case, algorithm, device, launched):
    """conv2d_div_leaky_relu in every algorithm: where F.conv2d refuses the
    tensors, its exception class (RuntimeError), naming the sizes or types;
    nothing launched."""
    _, change = case
    x, w, b = change(*_conv_inputs(device))
    expected = _raised(lambda: torch.nn.functional.conv2d(x, w, b))
    assert expected is not None
    got = _raised(lambda: ct.conv2d_div_leaky_relu(x, w, b, 2.0, algorithm=algorithm))
    assert got is not None and got[0] is expected[0], (got, expected)
    assert launched == []


@pytest.mark.parametrize("device", DEVICES)
def test_conv_unbatched_input_is_accepted_as_conv2d(device, launched):
    """A 3-D (unbatched) input, which F.conv2d takes: the batched result's one image."""
    x, w, b = _conv_inputs(device)
    y = ct.conv2d_div_leaky_relu(x[0], w, b, 2.0)
    torch.testing.assert_close(y, ct.conv2d_div_leaky_relu(x[:1], w, b, 2.0)[0], rtol=0, atol=0)


def _op_args(x, w, b, with_mask=True):
    return (x, w, b, 2.0, 0.01, [1, 1], [0, 0], [1, 1], False, with_mask)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_op_mismatch_raises_without_launch(device, launched):
    """torch.ops.cupy_act.conv2d_div_leaky_relu and its gradients' ops called
    directly: every tensor checked against the others and the geometry."""
    x, w, b = _conv_inputs(device)
    op = torch.ops.cupy_act
    bad = {
        "bias length": lambda: op.conv2d_div_leaky_relu(*_op_args(x, w, b[:4])),
        "weight channels": lambda: op.conv2d_div_leaky_relu(*_op_args(x, w[:, :2], b)),
        "weight dtype": lambda: op.conv2d_div_leaky_relu(*_op_args(x, w.double(), b)),
        "input float64": lambda: op.conv2d_div_leaky_relu(*_op_args(x.double(), w, b)),
    }
    y_shape = (2, 5, 7, 9)
    gy = torch.randn(y_shape, device=device)
    mask = torch.zeros(math.prod(y_shape) // 8 + 16, dtype=torch.uint8, device=device)
    spd = ([1, 1], [0, 0], [1, 1])
    bad |= {
        "wgrad gy shape": lambda: op.conv2d_div_leaky_relu_wgrad(
            x, gy[:, :4], mask, list(w.shape), True, 2.0, 0.01, *spd, False),
        "wgrad mask short": lambda: op.conv2d_div_leaky_relu_wgrad(
            x, gy, mask[:32], list(w.shape), True, 2.0, 0.01, *spd, False),
        "wgrad mask dtype": lambda: op.conv2d_div_leaky_relu_wgrad(
            x, gy, mask.float(), list(w.shape), True, 2.0, 0.01, *spd, False),
        "wgrad weight shape": lambda: op.conv2d_div_leaky_relu_wgrad(
            x, gy, mask, [5, 4, 3, 3], True, 2.0, 0.01, *spd, False),
        "dgrad gy shape": lambda: op.conv2d_div_leaky_relu_dgrad(
            gy[:1], mask, w, list(x.shape), False, 2.0, 0.01, *spd, False),
        "dgrad mask short": lambda: op.conv2d_div_leaky_relu_dgrad(
            gy, mask[:32], w, list(x.shape), False, 2.0, 0.01, *spd, False),
        "dgrad weight dtype": lambda: op.conv2d_div_leaky_relu_dgrad(
            gy, mask, w.double(), list(x.shape), False, 2.0, 0.01, *spd, False),
        "dgrad divisor": lambda: op.conv2d_div_leaky_relu_dgrad(
            gy, mask, w, list(x.shape), False, 0.0, 0.01, *spd, False),
    }  # fmt: skip
    for what, call in bad.items():
        got = _raised(call)
        assert got is not None and got[0] in (RuntimeError, ValueError, TypeError), (what, got)
        assert "cupy_act" in got[1], (what, got)
    assert launched == []
    op.conv2d_div_leaky_relu(*_op_args(x, w, b))  # (the control: it launches)
    assert any(kind == "launch" for kind, _ in launched)


def test_conv_op_refuses_cpu_tensors():
    x, w, b = _conv_inputs("cpu")
    with pytest.raises(TypeError, match="the fused kernels take CUDA tensors"):
        torch.ops.cupy_act.conv2d_div_leaky_relu(*_op_args(x, w, b))


# ---- the launchers' own checks (the second line) ----


def test_launcher_mismatch_refused_elementwise():
    """Launch.checked compares the sizes it passes with the arrays' own: y,
    the mask (read or written) and the bias, before any driver call."""
    from cupy_act._loader import Kernel

    k = Kernel(ptr=1, threads=128, per_block=512, max_blocks=10, wide=False, ctx=0, function=None)
    launch = _launch.Launch(k, 0.0, 1.0)
    made = []
    real, _launch._launch_kernel = _launch._launch_kernel, lambda *a: made.append(a)
    real_ctx, _launch._ctx_get_current = _launch._ctx_get_current, lambda: 0
    try:
        for have, args in (
            ((100, 99, 0, 0), (0, 100, 8, 16)),  # y short
            ((100, 100, 12, 0), (0, 100, 8, 16, 24, 3)),  # mask of 96 bits for 100
            ((100, 100, 16, 0), (0, 100, 8, 16, 24, 5)),  # writes 5 words into 16 bytes
            ((100, 100, 0, 3), (0, 100, 8, 16, 0, 0, 32, 25, 4)),  # 3 biases for 4 channels
            ((100, 100, 0, 4), (0, 100, 8, 16, 0, 0, 32, 24, 4)),  # 100 is not 24 x 4 x ...
        ):
            with pytest.raises(_launch.SizeMismatch, match="elementwise launch refused"):
                launch.checked(have, *args)
        assert made == []
        launch.checked((100, 100, 16, 4), 0, 100, 8, 16, 24, 4, 32, 25, 4)
        assert len(made) == 1
    finally:
        _launch._launch_kernel, _launch._ctx_get_current = real, real_ctx


def test_launcher_mismatch_refused_batchnorm(monkeypatch):
    """_batchnorm.run refuses a call whose buffers hold less than the pass
    indexes (here: weight and running_var of 8 floats for 16 channels)."""
    made = []
    monkeypatch.setattr(_launch, "run_all", lambda *a: made.append(a))
    monkeypatch.setitem(_batchnorm._sms, 0, 132)
    monkeypatch.setattr(_batchnorm, "_kernel", lambda d, t, name: _batchnorm._Kernel(1, 0, None))
    monkeypatch.setattr(_batchnorm, "_passes", {})
    s = _batchnorm.shape(0, "float32", "relu", False, 4 * 16 * 25, 25, 16)
    ps = _batchnorm.prepare(s, 0, "forward")
    b = _batchnorm.Buffers(*range(1, len(_batchnorm.Buffers._fields) + 1))
    short = ps.need._replace(weight=32, running_var=32)
    with pytest.raises(_launch.SizeMismatch, match="weight has 32 bytes, needs 64.*running_var"):
        _batchnorm.run(ps, 0, b, short, 0.1, 1e-5, 0.0, 0)
    assert made == []
    _batchnorm.run(ps, 0, b, ps.need, 0.1, 1e-5, 0.0, 0)  # (the control)
    assert len(made) == 1


def test_launcher_mismatch_refused_conv(monkeypatch):
    """The convolution's three launchers refuse an address with fewer bytes
    than the geometry indexes, before any launch."""
    from test_conv import _record_launches

    made = _record_launches(monkeypatch)
    fake = _conv.ConvKernel(11, 7, None)
    monkeypatch.setattr(_conv.forward, "kernel", lambda *a: _conv.ForwardKernels(fake, None))
    g = _conv.geometry("f", (2, 3, 9, 11), (5, 3, 3, 3))
    e = _conv.extents(g, "float32")
    with pytest.raises(_launch.SizeMismatch, match="forward launch refused.*y has"):
        _conv.launch(0, "float32", "fp32", False, g, 5, 16, 32, 48, 64, 80, 0.01, 2.0, "f",
                     have=e._replace(y=e.y - 4))  # fmt: skip
    with pytest.raises(_launch.SizeMismatch, match="input-gradient launch refused.*mask"):
        _conv.launch_dgrad(0, "float32", "fp32", False, g, 5, 16, 32, 48, 64, 0.01, 2.0, "f",
                           have=(e.y, e.mask - 1, e.w, e.x))  # fmt: skip
    assert made == []
    _conv.launch(0, "float32", "fp32", False, g, 5, 16, 32, 48, 64, 80, 0.01, 2.0, "f", have=e)
    assert len(made) == 1


# ---- the CuPy functions (GPU arrays only) ----


@pytest.mark.gpu
def test_cupy_mismatch_raises_without_launch(monkeypatch):
    """out=, mask= and bias= of the wrong size, dtype or alignment: the error
    names the function and the value; nothing launched."""
    import cupy
    import numpy

    import cupy_act

    made = []
    real = _launch._launch_kernel
    monkeypatch.setattr(_launch, "_launch_kernel", lambda *a: made.append(a) or real(*a))
    x = cupy.ones((4, 3, 5), cupy.float32)
    u8 = numpy.uint8
    bad = {
        "out shape": lambda: cupy_act.relu(x, out=cupy.empty((4, 3, 4), cupy.float32)),
        "out dtype": lambda: cupy_act.relu(x, out=cupy.empty(x.shape, cupy.float16)),
        "mask short": lambda: cupy_act.relu_with_mask(x, mask=cupy.empty(8, u8)),
        "mask dtype": lambda: cupy_act.relu_with_mask(x, mask=cupy.empty(16, cupy.int8)),
        "mask misaligned": lambda: cupy_act.relu_with_mask(x, mask=cupy.empty(20, u8)[1:17]),
        "backward mask short": lambda: cupy_act.relu_backward(x, cupy.empty(4, u8)),
        "bias length": lambda: cupy_act.div_leaky_relu(x, 2.0, bias=cupy.ones(4, cupy.float32)),
        "bias dtype": lambda: cupy_act.div_leaky_relu(x, 2.0, bias=cupy.ones(3, cupy.float64)),
        "conv bias": lambda: cupy_act.conv2d_div_leaky_relu(
            cupy.ones((1, 3, 5, 5), cupy.float32), cupy.ones((4, 3, 3, 3), cupy.float32),
            cupy.ones(3, cupy.float32), 2.0),
    }  # fmt: skip
    for what, call in bad.items():
        got = _raised(call)
        assert got is not None and got[0] in (ValueError, TypeError), (what, got)
        assert "cupy_act." in got[1], (what, got)
    cupy.cuda.get_current_stream().synchronize()
    assert made == []
