"""BatchNormAct2d with a residual, and under torch.compile: the ops
(``cupy_act::batchnorm_act`` and its backward and running-statistics ops)
where the policy puts them, what the compiled graphs save, and on CUDA the
compiled results against the eager kernels (bit for bit) and float64. CPU
here; CUDA with the ``gpu`` marker."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from test_batchnorm import ACTS, DEVICES, MODES, UNIT, _layout, _same  # noqa: E402
from test_compile_route import Recorder  # noqa: E402
from test_mismatched_inputs import launched  # noqa: E402, F401, F811  (a fixture)
from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402
from cupy_act.torch import _bn_graph, _bn_ops, _impl  # noqa: E402
from cupy_act.torch import batchnorm as bnmod  # noqa: E402


def _pair(act, slope, memory="default", channels=5):
    kwargs = {"negative_slope": slope} if act == "leaky_relu" else None
    ours = ct.BatchNormAct2d(channels, act_layer=act, act_kwargs=kwargs, memory=memory)
    with torch.no_grad():
        ours.weight.copy_(
            torch.linspace(0.5, 2, channels) * torch.tensor([1.0, -1.0]).repeat(channels)[:channels]
        )  # fmt: skip  (|w| in [0.5, 2], both signs)
        ours.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    bn = nn.BatchNorm2d(channels)
    bn.load_state_dict(ours.state_dict())
    return ours, bn, ACTS[act](slope)


def _residual_steps(model, xs, rs, gys, theirs=None):
    """Training steps and an eval step of act(bn(x) + r): outputs, the
    gradients of x, r and the parameters, then the buffers. ``theirs``:
    (bn, act) in PyTorch's modules, as torchvision's blocks write it."""
    out = []
    for i, (x, r, gy) in enumerate(zip(xs, rs, gys)):
        model.train(i < len(xs) - 1)
        x = x.detach().clone().requires_grad_(True)
        r = r.detach().clone().requires_grad_(True)
        if theirs is None:
            y = model(x * 1, r)  # (a non-leaf input: the in-place mode writes over it)
        else:
            bn, act = theirs
            y = bn(x * 1)
            y += r
            y = act(y)
        y.backward(gy)
        out += [y.detach(), x.grad, r.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad(set_to_none=True)
    return out + [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,slope", [("relu", 0.0), ("leaky_relu", 0.2), ("identity", 0.0)])
def test_residual_matches_batchnorm_add_activation(act, slope, device, monkeypatch):
    """forward(x, residual) is bn(x) += residual, then the activation: bit for
    bit PyTorch's on the path without the fused kernels (CPU; CUDA with FUSED
    off), outputs and the gradients of x, the residual and the parameters."""
    monkeypatch.setattr(bnmod, "FUSED", False)
    ours, bn, act_module = _pair(act, slope)
    ours, bn = ours.to(device), bn.to(device)
    gen = torch.Generator().manual_seed(0)
    xs, rs, gys = ([torch.randn(4, 5, 6, 7, generator=gen).to(device) * 2 + 1 for _ in range(3)]
                   for _ in range(3))  # fmt: skip
    got = _residual_steps(ours, xs, rs, gys)
    want = _residual_steps(bn, xs, rs, gys, (bn, act_module))
    assert len(got) == len(want)
    for i, (a, e) in enumerate(zip(got, want)):
        _same(a, e, f"output {i}")


def test_residual_broadcasts_and_is_checked():
    """A residual of another shape takes PyTorch's addition (broadcasting as
    ``y + r``); one that is not a tensor is named."""
    ours = ct.BatchNormAct2d(3)
    x, r = torch.randn(2, 3, 4, 4), torch.randn(3, 1, 1)
    bn = nn.BatchNorm2d(3)
    testing.assert_bits_equal(ours(x, r), torch.relu(bn(x) + r))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor or None, got float"):
        ours(x, 1.0)


def test_policy_switch():
    previous = ct.set_compiled_batchnorm("everywhere")
    try:
        assert previous == "inplace"
        assert _bn_ops.takes(False, "default") and _bn_ops.takes(None, "default")
        ct.set_compiled_batchnorm("after_conv")
        assert _bn_ops.takes(True, "default") and _bn_ops.takes(None, "default")
        assert not _bn_ops.takes(False, "inplace")
        ct.set_compiled_batchnorm("inplace")
        assert _bn_ops.takes(True, "inplace") and _bn_ops.takes(None, "inplace")
        assert not _bn_ops.takes(True, "default") and not _bn_ops.takes(False, "inplace")
        assert _bn_ops.takes(True, "default", True) and not _bn_ops.takes(False, "default", True)
        ct.set_compiled_batchnorm("traced")
        assert not _bn_ops.takes(True, "inplace") and not _bn_ops.takes(True, "default", True)
        with pytest.raises(ValueError, match="policy='fast'; expected one of"):
            ct.set_compiled_batchnorm("fast")
    finally:
        ct.set_compiled_batchnorm(previous)


class _Net(nn.Module):
    """conv -> bn -> relu (after a convolution), then bn -> leaky_relu (not),
    then conv -> bn (+ the first block's output) -> relu."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        a = torch.relu(self.bn1(self.conv(x)))
        b = nn.functional.leaky_relu(self.bn2(a), 0.1)
        out = self.bn3(self.conv3(b))
        out += a
        return torch.relu(out)


class _LeakyFirst(_Net):
    """_Net with LeakyReLU after bn1 (an invertible pair after a convolution)."""

    def forward(self, x):
        a = nn.functional.leaky_relu(self.bn1(self.conv(x)), 0.1)
        b = torch.relu(self.bn2(a))
        out = self.bn3(self.conv3(b))
        out += a
        return torch.relu(out)


def test_fusers_mark_what_reads_a_convolution():
    gm, count = ct.fuse_batchnorm_act_fx(_Net())
    assert count == 3
    assert [gm.bn1.after_conv, gm.bn2.after_conv, gm.bn3.after_conv] == [True, False, True]
    pairs = (nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4), nn.ReLU())
    seq, _ = ct.fuse_batchnorm_act(nn.Sequential(*pairs))
    assert [seq[1].after_conv, seq[3].after_conv] == [True, False]
    assert ct.BatchNormAct2d(4).after_conv is None


@pytest.fixture
def stand_ins():
    """CPU kernels for the ops that return zeros of the fake kernels' sizes
    (the graphs run; their values are not looked at), removed afterwards."""
    lib = torch.library.Library("cupy_act", "IMPL")

    def zeros(fake):
        return lambda *args: tuple(t.zero_() for t in fake(*args))

    lib.impl("batchnorm_act", zeros(_bn_ops._forward_fake), "CPU")
    lib.impl("batchnorm_act_backward", zeros(_bn_ops._backward_fake), "CPU")
    yield
    lib._destroy()


def _compiled_graphs(model, x, monkeypatch, policy):
    """The forward and backward graphs torch.compile makes of a training step
    with the kernels' path taken as if x were on CUDA (the ops run as
    ``stand_ins``)."""
    monkeypatch.setattr(_impl, "on_gpu", lambda t: True)
    monkeypatch.setattr(_bn_ops, "POLICY", policy)
    torch._dynamo.reset()
    rec = Recorder()
    step = torch.compile(lambda t: model(t).sum(), backend=rec, fullgraph=True)
    step(x).backward()
    torch._dynamo.reset()
    return rec


@pytest.mark.parametrize(
    "policy,memory,ops",
    [
        ("everywhere", "default", 3),
        ("after_conv", "default", 2),
        ("inplace", "default", 0),
        ("inplace", "inplace", 1),
        ("inplace", "zeroed", 1),
        ("traced", "inplace", 0),
    ],
)
def test_ops_placed_by_policy(policy, memory, ops, monkeypatch, stand_ins):
    """The forward graph calls the op at every fused module the policy names
    (each updating its module's running statistics, no separate op), the
    backward graph its backward op as often; "traced" leaves PyTorch's
    operations. (With memory="inplace" only bn1, LeakyReLU after a
    convolution, is in place: the others' activations are ReLUs. "zeroed":
    bn1's weight zero, so the fuser keeps it in the default mode, marked
    ``kept_by_zero``, where "inplace" places the op too.)"""
    net = _LeakyFirst()
    if memory == "zeroed":
        nn.init.zeros_(net.bn1.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the pairs kept in the default mode are named)
        asked = "default" if memory == "default" else "inplace"
        gm, _ = ct.fuse_batchnorm_act_fx(net, memory=asked)
    modes = ["default" if memory == "zeroed" else memory, "default", "default"]
    assert [gm.bn1.memory, gm.bn2.memory, gm.bn3.memory] == modes
    assert gm.bn1.kept_by_zero == (memory == "zeroed")
    rec = _compiled_graphs(gm, torch.randn(2, 3, 6, 6, requires_grad=True), monkeypatch, policy)
    forward = rec.graphs[0].code
    assert forward.count("cupy_act.batchnorm_act.default") == ops
    assert sum(map(_bn_graph._is_op, rec.graphs[0].graph.nodes)) == ops
    if ops:
        assert rec.graphs[1].code.count("cupy_act.batchnorm_act_backward.default") == ops
    assert ("native_batch_norm" in forward or "batch_norm" in forward) == (ops < 3)


def test_compiled_forward_updates_the_running_statistics(monkeypatch):
    """A compiled training step's op updates its module's running mean and
    variance itself (mutable arguments, through functionalization to the
    buffers), with the module's momentum; no other op does; in eval the op
    reads them and updates nothing. The CPU stand-in writes markers where
    the kernels would write the new statistics."""
    lib = torch.library.Library("cupy_act", "IMPL")

    def forward(*args, **kwargs):
        out = tuple(t.zero_() for t in _bn_ops._forward_fake(*args, **kwargs))
        names = [a.name for a in torch.ops.cupy_act.batchnorm_act.default._schema.arguments]
        given = dict(zip(names, args), **kwargs)
        if given.get("update_mean") is not None:
            given["update_mean"].fill_(given["momentum"] * 10)
            given["update_var"].fill_(7.0)
        return out

    lib.impl("batchnorm_act", forward, "CPU")
    lib.impl("batchnorm_act_backward",
             lambda *a: tuple(t.zero_() for t in _bn_ops._backward_fake(*a)), "CPU")  # fmt: skip
    try:
        gm, _ = ct.fuse_batchnorm_act_fx(_LeakyFirst())
        gm.bn2.momentum = 0.3
        rec = _compiled_graphs(gm, torch.randn(2, 3, 6, 6), monkeypatch, "everywhere")
        calls = [n for n in rec.graphs[0].graph.nodes if _bn_graph._is_op(n)]
        assert len(calls) == 3 and "batchnorm_running" not in rec.code()
        for bn, momentum in ((gm.bn1, 0.1), (gm.bn2, 0.3), (gm.bn3, 0.1)):
            assert torch.all(bn.running_mean == momentum * 10), bn.running_mean
            assert torch.all(bn.running_var == 7.0) and bn.num_batches_tracked == 1
        gm.eval()
        torch._dynamo.reset()
        rec = Recorder()
        with torch.no_grad():
            torch.compile(gm, backend=rec, fullgraph=True)(torch.randn(2, 3, 6, 6))
        torch._dynamo.reset()
        calls = [n for n in rec.graphs[0].graph.nodes if _bn_graph._is_op(n)]
        assert len(calls) == 3
        assert all(_bn_graph._arg(n, 13, "update_mean") is None for n in calls)
        assert torch.all(gm.bn1.running_var == 7.0) and gm.bn1.num_batches_tracked == 1
    finally:
        lib._destroy()


def test_residual_that_is_the_input_compiles(monkeypatch, stand_ins):
    """bn(x, residual=x) under fullgraph compile: PyTorch's operations (Dynamo
    traces no autograd.Function given the same tensor twice), no graph break;
    with another residual, the op."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), ct.BatchNormAct2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y, y if self.same else y * 2)

    model = Twice()
    for same, ops in ((True, 0), (False, 1)):
        model.same = same
        rec = _compiled_graphs(model, torch.randn(2, 3, 6, 6), monkeypatch, "everywhere")
        assert rec.graphs[0].code.count("cupy_act.batchnorm_act.default") == ops


def test_no_op_on_cpu_tensors():
    """On CPU tensors the compiled module is PyTorch's operations, bit for bit eager."""
    gm, _ = ct.fuse_batchnorm_act_fx(_Net())
    rec = Recorder()
    torch._dynamo.reset()
    x = torch.randn(2, 3, 6, 6)
    want = copy.deepcopy(gm)(x)
    got = torch.compile(gm, backend=rec)(x)
    torch._dynamo.reset()
    assert "cupy_act.batchnorm" not in rec.code()
    testing.assert_bits_equal(got, want)


@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_inplace_mode_saves_y_alone_under_compile(memory, monkeypatch, stand_ins):
    """The compiled in-place mode saves the op's output for the backward and
    not its input (which then dies); the default saves the input and a mask."""
    ours = ct.BatchNormAct2d(8, act_layer="leaky_relu", memory=memory)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    model = nn.Sequential(conv, ours)
    ours.after_conv = True
    x = torch.randn(2, 3, 6, 6)
    rec = _compiled_graphs(model, x, monkeypatch, "after_conv")
    call = next(n for n in rec.graphs[0].graph.nodes if _bn_graph._is_op(n))
    assert _bn_graph._arg(call, 10, "from_output") == (memory == "inplace")
    numel = _bn_graph._arg(call, 0, "x").meta["val"].numel()
    saved = [n for n in rec.graphs[1].graph.find_nodes(op="placeholder")
             if not n.name.startswith("tangents")]  # fmt: skip
    big = [n.name for n in saved if n.meta["val"].numel() == numel]
    # default: the convolution's output (x); in place: one of y's size (y, detached)
    assert big == ["convolution"] if memory == "default" else big[0] != "convolution", big
    assert len(big) == 1, big
    words = [n for n in saved if n.meta["val"].dtype == torch.int32]
    assert [n.meta["val"].numel() for n in words] == [-(-numel // 32) if memory == "default" else 0]


# ---- CUDA: the compiled ops against the eager kernels and float64 ----


def test_ops_name_cpu_tensors():
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TypeError, match="cupy_act::batchnorm_act: x is on cpu; the kernels take"):
        torch.ops.cupy_act.batchnorm_act(x, None, None, None, None, None, 1e-5, "relu", 0.0,
                                         False, False, False)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_ops_check_every_tensor_before_a_launch(device, launched):  # noqa: F811
    """The ops called directly: each tensor a kernel indexes is checked
    against x (shapes, dtypes, devices, buffer sizes) and the modes against
    the activation; the error names the op and the value, nothing launches."""
    x = torch.randn(4, 8, 6, 6, device=device)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    rm, rv = torch.zeros(8, device=device), torch.ones(8, device=device)
    mask = torch.zeros(-(-x.numel() // 32), dtype=torch.int32, device=device)
    stats = torch.zeros(8 + 16 + 2, dtype=torch.float64, device=device)
    op = torch.ops.cupy_act

    def fwd(x=x, w=w, b=b, r=None, rm=None, rv=None, act="relu", slope=0.0, ev=False,
            out=False, um=None, uv=None):  # fmt: skip
        return lambda: op.batchnorm_act(x, w, b, r, rm, rv, 1e-5, act, slope, ev, out, True,
                                        None, um, uv, 0.1)  # fmt: skip

    def bwd(src=x, dy=x, mask=mask, stats=stats, r=None, act="relu", out=False):
        return lambda: op.batchnorm_act_backward(
            src, dy, mask, w, b, stats, r, act, 0.1, False, out, True, True, r is not None
        )

    bad = {
        "weight length": (fwd(w=w[:4]), r"weight must be a float32 tensor of shape \(8,\)"),
        "bias dtype": (fwd(b=b.double()), "bias must be a float32 tensor"),
        "residual shape": (fwd(r=x[:, :4]), r"residual has shape \(4, 4, 6, 6\)"),
        "residual dtype": (fwd(r=x.double()), "residual has shape .*float64"),
        "act": (fwd(act="gelu"), "act='gelu'; expected one of"),
        "relu from y": (fwd(out=True), "from_output needs an invertible activation, got relu"),
        "eval without statistics": (fwd(ev=True), "evaluate=True needs running_mean"),
        "running_var length": (fwd(ev=True, rm=rm, rv=rv[:3]), "running_var must be a float32"),
        "x 3-D": (fwd(x=x[0]), "x must be a 4-D float32"),
        "x int": (fwd(x=x.int()), "x must be a 4-D float32"),
        "one value per channel": (fwd(x=x[:1, :, :1, :1]), "more than 1 value per channel"),
        "dy shape": (bwd(dy=x[:2]), r"dy has shape \(2, 8, 6, 6\)"),
        "mask short": (bwd(mask=mask[:2]), "mask must be int32 with 36 words"),
        "mask dtype": (bwd(mask=mask.float()), "mask must be int32"),
        "stats short": (bwd(stats=stats[:20]), "stats must be float64 with 26 elements"),
        "from y without residual's shape": (bwd(r=x[:, :2], act="leaky_relu", out=True),
                                            "residual has shape"),
        "update dtype": (fwd(um=rm.double(), uv=rv), "update_mean must be a float32 tensor"),
        "update length": (fwd(um=rm, uv=rv[:4]), r"update_var must be a float32 tensor of sh"),
        "update strided": (fwd(um=rm, uv=torch.ones(16, device=device)[::2]),
                           "update_var must be dense"),
        "update alone": (fwd(um=rm), "update_mean and update_var go together"),
        "update in eval": (fwd(ev=True, rm=rm, rv=rv, um=rm, uv=rv),
                           "update_mean and update_var are a training forward's"),
    }  # fmt: skip
    for what, (call, words) in bad.items():
        with pytest.raises((ValueError, TypeError), match="cupy_act::batchnorm.*" + words):
            call()
        assert launched == [], what
    fwd()()  # (the control: it launches)
    assert any(kind == "launch" for kind, _ in launched)


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["default", "inplace"])
@pytest.mark.parametrize("residual", [False, True])
def test_opcheck(memory, residual):
    """torch.library.opcheck on the two ops (schema, fake kernels, dynamo;
    their autograd is BatchNormActFunction's, tested with the compiled steps)."""
    from torch.library import opcheck

    x = torch.randn(4, 8, 6, 6, device="cuda")
    r = torch.randn_like(x) if residual else None
    w = torch.rand(8, device="cuda") + 0.5
    b = torch.randn(8, device="cuda")
    act = "leaky_relu"
    inplace = memory == "inplace"
    opcheck(torch.ops.cupy_act.batchnorm_act,
            (x, w, b, r, None, None, 1e-5, act, 0.1, False, inplace, True))  # fmt: skip
    rm, rv = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
    opcheck(torch.ops.cupy_act.batchnorm_act,
            (x, w, b, r, rm, rv, 1e-5, act, 0.1, True, inplace, True))  # fmt: skip
    y, stats, mask = torch.ops.cupy_act.batchnorm_act(
        x, w, b, r, None, None, 1e-5, act, 0.1, False, inplace, True
    )
    src = y if inplace else x
    opcheck(torch.ops.cupy_act.batchnorm_act_backward,
            (src, torch.randn_like(src), mask, w, b, stats, r, act, 0.1, False, inplace, True,
             True, residual))  # fmt: skip
    # (a training forward that updates running statistics: declared mutations)
    opcheck(
        torch.ops.cupy_act.batchnorm_act,
        (x, w, b, r, None, None, 1e-5, act, 0.1, False, inplace, True, None, rm, rv, 0.1),
    )


def _train_steps(model, xs, rs, gy, steps, graphs=False):
    """Outputs, gradients and buffers of training steps (cloned: a CUDA graph's
    outputs are overwritten by its next replay)."""
    out = []
    for i in range(steps):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        x = xs[i].detach().clone().requires_grad_(True)
        r = None if rs is None else rs[i].detach().clone().requires_grad_(True)
        y = model(x * 1) if r is None else model(x * 1, r)
        y.backward(gy)
        out += [t.clone() for t in (y.detach(), x.grad, *([] if r is None else [r.grad]))]
        out += [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
    return out + [b.clone() for b in model.buffers()]


# (act, slope, memory, residual, dtype, layout): each activation, both memory
# modes, with and without a residual, both dtypes and layouts, in five compiles
COMPILED_CASES = [
    ("relu", 0.0, "default", False, torch.float32, "contiguous"),
    ("relu", 0.0, "default", True, torch.bfloat16, "contiguous"),
    ("leaky_relu", 0.1, "default", False, torch.bfloat16, "channels_last"),
    ("leaky_relu", 0.1, "inplace", True, torch.bfloat16, "channels_last"),
    ("identity", 0.0, "inplace", True, torch.float32, "channels_last"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("act,slope,memory,residual,dtype,layout", COMPILED_CASES, ids=str)
def test_compiled_equals_eager_kernels(
    act, slope, memory, residual, dtype, layout, mode, monkeypatch
):
    """Compiled (Inductor, with and without CUDA graphs) training steps give
    the eager fused kernels' outputs, gradients, running statistics and counts
    bit for bit (the same kernels: the op in every module, "after_conv"),
    with no recompilation across steps."""
    monkeypatch.setattr(_bn_ops, "POLICY", "after_conv")
    torch._dynamo.reset()
    ours, _, _ = _pair(act, slope, memory, channels=16)
    ours = ours.cuda()
    ours.after_conv = True
    compiled_model = copy.deepcopy(ours)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (8, 16, 12, 12)
    xs = [_layout(torch.randn(shape, device="cuda", generator=gen).to(dtype), layout)
          for _ in range(4)]  # fmt: skip
    rs = [torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(4)]
    rs = rs if residual else None
    gy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    want = _train_steps(ours, xs, rs, gy, 4)
    step = torch.compile(compiled_model, mode=mode, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _train_steps(step, xs, rs, gy, 4, graphs=mode == "reduce-overhead")
    assert len(got) == len(want)
    for i, (a, e) in enumerate(zip(got, want)):
        _same(a, e, f"output {i}")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset"])
@pytest.mark.parametrize("act,slope,memory", MODES)
def test_residual_kernels_against_float64(act, slope, memory, layout, dtype):
    """act(bn(x) + r) in the fused kernels: outputs and the gradients of x, r
    and the parameters within FLOOR (float32: 4e-6 of the largest value;
    bfloat16: its rounding) plus twice eager PyTorch's own error against
    float64, and in the in-place mode the inversion's 8 u A more (``A`` as in
    test_batchnorm, with the residual's magnitude added to |b / w|)."""
    ours, bn, act_module = _pair(act, slope, memory, channels=24)
    ours, bn = ours.cuda(), bn.cuda()
    bn64 = copy.deepcopy(bn).double()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (4, 24, 10, 10)
    xs = [_layout((torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).to(dtype), layout)
          for _ in range(3)]  # fmt: skip
    rs = [torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(3)]
    gys = [torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(3)]
    calls = []
    apply = bnmod._apply_fused
    bnmod._apply_fused = lambda *a: calls.append(1) or apply(*a)
    try:
        got = _residual_steps(ours, xs, rs, gys)
    finally:
        bnmod._apply_fused = apply
    assert len(calls) == 3
    want = _residual_steps(bn, xs, rs, gys, (bn, act_module))
    exact = _residual_steps(
        bn64,
        [x.double() for x in xs],
        [r.double() for r in rs],
        [g.double() for g in gys],
        (bn64, act_module),
    )
    extra = 0.0
    if memory == "inplace":
        w, b = bn64.weight.detach().abs(), bn64.bias.detach().abs()
        amp = max(x.double().abs().max().item() for x in xs) + 2 * (
            (b + max(r.double().abs().max().item() for r in rs)) / w).max().item()  # fmt: skip
        extra = 8 * UNIT[dtype] * amp
    floor = {torch.float32: 4e-6, torch.bfloat16: 1.6e-2}[dtype]
    for i, (a, e) in enumerate(zip(got, exact)):
        if not a.is_floating_point():
            assert torch.equal(a, want[i].to(a.dtype)), i
            continue
        scale = e.abs().max().item() + 1e-30
        err = (a.double() - e).abs().max().item() / scale
        bound = floor + extra + 2 * (want[i].double() - e).abs().max().item() / scale
        assert err <= bound, f"output {i}: error {err:.2e} over {bound:.2e}"
