"""BatchNormAct2d and fuse_batchnorm_act, against nn.BatchNorm2d followed by
PyTorch's activation: outputs, gradients and running statistics bit for bit,
state_dict compatibility, the fuser on Sequential pairs and on timm's module
shape, and the compiled graphs. CPU here; CUDA with the ``gpu`` marker."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from test_compile_route import Recorder  # noqa: E402
from torch import nn  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# act_layer, negative_slope -> PyTorch's activation module
ACTS = {
    "relu": lambda s: nn.ReLU(),
    "leaky_relu": lambda s: nn.LeakyReLU(s),
    "identity": lambda s: nn.Identity(),
}


def _same(a, e, what):
    if e.is_floating_point():
        testing.assert_bits_equal(a, e, what)
    else:  # (num_batches_tracked)
        assert torch.equal(a, e), (what, a, e)


def _pair(act, slope, momentum, device, channels=5):
    """(ours, PyTorch's BatchNorm2d + activation), the same random affine state."""
    kwargs = {"negative_slope": slope} if act == "leaky_relu" else None
    ours = ct.BatchNormAct2d(channels, momentum=momentum, act_layer=act, act_kwargs=kwargs)
    theirs = nn.Sequential(nn.BatchNorm2d(channels, momentum=momentum), ACTS[act](slope))
    with torch.no_grad():
        ours.weight.uniform_(-2, 2)  # (negative scales too)
        ours.bias.uniform_(-1, 1)
    theirs[0].load_state_dict(ours.state_dict())
    return ours.to(device), theirs.to(device)


def _steps(model, xs, gys):
    """Outputs and input and parameter gradients of training steps, then an eval output."""
    out = []
    model.train()
    for x, gy in zip(xs, gys):
        x = x.detach().clone().requires_grad_(True)
        y = model(x)
        y.backward(gy)
        params = [p.grad.clone() for p in model.parameters()]
        out += [y.detach(), x.grad, *params]
        model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        out.append(model(xs[0]))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize(
    "act,slope", [("relu", 0.0), ("leaky_relu", 0.2), ("leaky_relu", -0.3), ("identity", 0.0)]
)
def test_matches_batchnorm_then_activation(act, slope, momentum, layout, device, monkeypatch):
    """The path without the fused kernels (CPU; CUDA with FUSED off, as in eval):
    PyTorch's normalization and our activation, bit for bit."""
    monkeypatch.setattr(ct.batchnorm, "FUSED", False)
    ours, theirs = _pair(act, slope, momentum, device)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(4, 5, 6, 7, generator=gen) * 3 + 1).to(device, memory_format=fmt)]
    xs += [torch.randn(4, 5, 6, 7, generator=gen).to(device, memory_format=fmt) for _ in range(2)]
    gys = [torch.randn(4, 5, 6, 7, generator=gen).to(device) for _ in xs]
    got, want = _steps(ours, xs, gys), _steps(theirs, xs, gys)
    for i, (a, e) in enumerate(zip(got, want)):
        testing.assert_bits_equal(a, e, f"output {i}")
    for key, e in theirs[0].state_dict().items():
        _same(ours.state_dict()[key], e, key)


def test_state_dict_is_batchnorm2d():
    bn = nn.BatchNorm2d(3)
    bn(torch.randn(2, 3, 4, 4))  # (running statistics and a batch count)
    ours = ct.BatchNormAct2d(3, act_layer="leaky_relu")
    assert list(ours.state_dict()) == list(bn.state_dict())
    ours.load_state_dict(bn.state_dict())
    for key, e in bn.state_dict().items():
        _same(ours.state_dict()[key], e, key)
    assert "act='leaky_relu', negative_slope=0.01" in repr(ours)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"act_layer": "gelu"}, r"act_layer='gelu' is not supported; expected one of"),
        ({"act_layer": nn.SiLU}, r"act_layer=<class .*SiLU'> is not supported"),
        ({"act_kwargs": {"alpha": 1.0}}, r"act_kwargs \['alpha'\] not supported"),
        ({"act_kwargs": {"negative_slope": 0.1}}, r"negative_slope given for act_layer 'relu'"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ct.BatchNormAct2d(3, **kwargs)


def test_timm_signature_and_apply_act():
    m = ct.BatchNormAct2d(3, apply_act=False, act_layer=nn.LeakyReLU)
    assert m.act == "identity"
    slope = {"negative_slope": 0.1}
    m = ct.BatchNormAct2d(3, act_layer=nn.LeakyReLU, act_kwargs=slope, inplace=False)
    assert (m.act, m.negative_slope) == ("leaky_relu", 0.1)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.1),
        nn.BatchNorm2d(8),  # (no activation after it: stays)
        nn.Flatten(),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_fuse_sequential_pairs(device, monkeypatch):
    monkeypatch.setattr(ct.batchnorm, "FUSED", False)  # (the fuser's bits; kernels below)
    ref = _cnn().to(device)
    model = copy.deepcopy(ref)
    weight = model[1].weight
    keys = list(model.state_dict())
    model, count = ct.fuse_batchnorm_act(model)
    assert count == 2
    assert type(model[1]) is ct.BatchNormAct2d and type(model[2]) is nn.Identity
    assert (model[4].act, model[4].negative_slope) == ("leaky_relu", 0.1)
    assert type(model[6]) is nn.BatchNorm2d
    assert model[1].weight is weight, "the fused module holds the same parameters"
    assert list(model.state_dict()) == keys
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, 9, 9, device=device) for _ in range(2)]
    gys = [torch.randn(2, 8 * 5 * 5, device=device) for _ in xs]
    for i, (a, e) in enumerate(zip(_steps(model, xs, gys), _steps(ref, xs, gys))):
        testing.assert_bits_equal(a, e, f"output {i}")


class BatchNormAct2d(nn.BatchNorm2d):
    """The shape of timm's BatchNormAct2d (timm is not a test dependency)."""

    def __init__(self, n, act, drop=None):
        super().__init__(n)
        self.drop = drop or nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_fuse_timm_shaped_modules(device, monkeypatch):
    monkeypatch.setattr(ct.batchnorm, "FUSED", False)  # (the fuser's bits; kernels below)
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        BatchNormAct2d(4, nn.LeakyReLU(0.1, inplace=True)),
        nn.Conv2d(4, 4, 3),
        BatchNormAct2d(4, nn.ReLU()),
        BatchNormAct2d(4, nn.Identity()),
        BatchNormAct2d(4, nn.ReLU(), drop=nn.Dropout(0.0)),  # (dropout: left alone)
        BatchNormAct2d(4, nn.GELU()),  # (not ours to fuse)
    ).to(device)
    model, count = ct.fuse_batchnorm_act(copy.deepcopy(ref))
    assert count == 3
    ours = [type(m) is ct.BatchNormAct2d for m in model]
    assert ours == [False, True, False, True, True, False, False]
    assert [model[i].act for i in (1, 3, 4)] == ["leaky_relu", "relu", "identity"]
    assert list(model.state_dict()) == list(ref.state_dict())
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, 8, 8, device=device) for _ in range(2)]
    gys = [torch.randn(2, 4, 4, 4, device=device) for _ in xs]
    for i, (a, e) in enumerate(zip(_steps(model, xs, gys), _steps(ref, xs, gys))):
        testing.assert_bits_equal(a, e, f"output {i}")
    top, n = ct.fuse_batchnorm_act(BatchNormAct2d(4, nn.ReLU()))
    assert n == 1 and type(top) is ct.BatchNormAct2d


def test_fuse_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        ct.fuse_batchnorm_act(3)


@pytest.mark.parametrize("act", ["relu", "leaky_relu"])
def test_compiled_graphs_are_batchnorm_and_activation(act):
    """Under torch.compile the module traces into aten's batch norm and the
    activation (which Inductor fuses), no cupy_act op, saving no more than
    PyTorch's pair."""
    recs = []
    for model in _pair(act, 0.2, 0.1, "cpu"):
        recs.append(Recorder())
        torch._dynamo.reset()
        x = torch.randn(4, 5, 6, 7, requires_grad=True)
        torch.compile(model, backend=recs[-1], fullgraph=True)(x).sum().backward()
    ours, theirs = recs
    assert "cupy_act" not in ours.code() and "batch_norm" in ours.code(), ours.code()
    assert ours.saved_bytes() <= theirs.saved_bytes(), (ours.code(), theirs.code())


@pytest.mark.gpu
def test_fuse_timm_cspdarknet53(monkeypatch):
    """timm's own BatchNormAct2d modules, in the model of the issue: every one
    fused, the training step PyTorch's bit for bit (deterministic cuDNN)."""
    timm = pytest.importorskip("timm")
    monkeypatch.setattr(ct.batchnorm, "FUSED", False)  # (the fuser's bits; kernels below)
    torch.manual_seed(0)
    ref = timm.create_model("cspdarknet53", num_classes=10).cuda()
    timm_bn = sum(type(m).__name__ == "BatchNormAct2d" for m in ref.modules())
    model, count = ct.fuse_batchnorm_act(copy.deepcopy(ref))
    assert count == timm_bn > 60
    assert list(model.state_dict()) == list(ref.state_dict())
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, 64, 64, device="cuda") for _ in range(2)]
    gys = [torch.randn(2, 10, device="cuda") for _ in xs]
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        got, want = _steps(model, xs, gys), _steps(ref, xs, gys)
    for i, (a, e) in enumerate(zip(got, want)):
        testing.assert_bits_equal(a, e, f"output {i}")


# ---- the fused CUDA kernels: NVRTC (no GPU needed), then accuracy and determinism ----


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", ["relu", "leaky_relu", "identity"])
def test_launch_plan(act, channels_last, monkeypatch):
    """Each pass launches compiled instantiations (NCHW: the reduction finishes
    its channels, two launches a pass; channels-last: a finishing launch
    between); the reduction's grid is as wide as the partial buffer the
    caller sized from ``Plan.splits``; 16-byte vectors only where the shape
    and every pointer allow them; zeroed counters asked for where needed."""
    from types import SimpleNamespace

    from cupy_act import _batchnorm

    launched = []
    monkeypatch.setitem(_batchnorm._sms, 0, 132)
    monkeypatch.setattr(
        _batchnorm,
        "_kernel",
        lambda d, t, name: SimpleNamespace(ptr=name, ctx=0, function=None, resident=3),
    )
    monkeypatch.setattr(
        _batchnorm._launch,
        "run_all",
        lambda launches, threads, *a: launched.extend((p, g) for p, _, g in launches),
    )
    s = _batchnorm.shape(0, "bfloat16", act, channels_last, 32 * 48 * 64 * 64, 64 * 64, 48)
    p = _batchnorm.plan(s, 256 | 512)
    assert p.width == 8 and _batchnorm.plan(s, 256 | 520).width == 1
    assert _batchnorm.prepare(s, 256 | 520, "forward").plan.width == 1
    buffers = _batchnorm.Buffers(*range(1, len(_batchnorm.Buffers._fields) + 1))
    synced = ("forward_local", "forward_sync", "backward_local", "backward_sync")
    for which in ("forward", "backward", "eval", *synced):
        ps = _batchnorm.prepare(s, 256 | 512, which)
        assert ps.plan.width == p.width and ps.moments % 16 == 0 and ps.coef % 16 == 0
        # (mean and invstd, then the moments, the count and a pad)
        assert ps.moments >= 8 * 48 and ps.stats * 8 == ps.moments + 16 * 48 + 16
        assert ps.work * 8 == ps.coef + 16 * 48  # (partial sums, then coef)
        _batchnorm.run(ps, 0, buffers, ps.need, 0.1, 1e-5, 0.01, 0)
    # synchronized: the local sums (and the forward's count) where the moments go,
    # the totals read where the partial sums would be
    local = _batchnorm.prepare(s, 0, "forward_local")
    totals = _batchnorm.prepare(s, 0, "forward_sync")
    assert local.need.moments == totals.need.partial == 8 * (2 * 48 + 1)
    assert totals.need.moments == 16 * 48 + 16  # (the count kept for the backward, a pad)
    assert _batchnorm.prepare(s, 0, "backward_sync").need.partial == 16 * 48
    names = set(_batchnorm.all_kernel_names())
    assert all(name in names for name, _ in launched), launched
    per_pass = 3 if channels_last else 2
    kinds = [name.split("<")[0].split("::")[1] for name, _ in launched]
    finish = ["bn_finalize"] if channels_last else []
    assert kinds == [
        "bn_reduce", *finish, "bn_forward",
        "bn_reduce", *finish, "bn_backward",
        "bn_finalize_eval", "bn_forward",
        "bn_reduce", *finish, "bn_finish_sums", "bn_forward",
        "bn_reduce", *finish, "bn_finish_sums", "bn_backward",
    ]  # fmt: skip
    assert _batchnorm.arrivals(s) == (0 if channels_last else 48)
    blocks = -(-48 // 8 // 32) if channels_last else 48
    # (NCHW: about 32 blocks per multiprocessor; channels-last one wave at the
    # reduction's occupancy, 3 blocks per multiprocessor here)
    per_sm, share = (3, 8192) if channels_last else (32, 2048)
    splits = _batchnorm.plan(s, 256 | 512, per_sm).splits
    assert launched[0][1] == launched[per_pass][1] == (splits, blocks)
    # (a thread per channel: finalize_eval, finish_sums)
    assert launched[2 * per_pass][1] == launched[3 * per_pass + 1][1] == (1, 1)
    if channels_last:  # (the finishing launch: a warp per channel, 8 a block)
        assert launched[1][1] == launched[per_pass + 1][1] == (6, 1)
    assert splits == min(per_sm * 132 // blocks, -(-s.n // blocks // share))
    assert 1 < splits * share <= s.n // blocks + share  # each block's share >= share elements
    odd = _batchnorm.shape(0, "float32", act, channels_last, 2 * 6 * 5 * 5, 25, 6)
    assert not odd.vector and _batchnorm.plan(odd, 256).width == 1


@pytest.mark.parametrize("arch", [75, 80, 90])  # (7.5: README's T4 and RTX 20xx)
def test_kernels_compile_with_nvrtc(arch):
    """Every instantiation compiles, takes the parameter block the host packs,
    and uses no local memory."""
    import re

    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupy_act import _batchnorm
    from cupy_act._source import assembled_source

    names = _batchnorm.all_kernel_names()
    prog = nvrtc.createProgram(assembled_source(_batchnorm.SOURCE), "batchnorm.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        opts = ("--std=c++17", "-ftz=true", "--device-as-default-execution-space")
        nvrtc.compileProgram(prog, (*opts, f"-arch=compute_{arch}"))
        ptx = nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)
    entries = re.findall(r"^\.(?:visible|weak) \.entry ", ptx, re.M)
    assert len(entries) == len(set(names)) == 5 + 3 * 4 * 14  # (dtype, layout, width) x kernels
    sizes = set(re.findall(r"\.param \.align \d+ \.b8 \S+_param_0\[(\d+)\]", ptx))
    assert sizes == {str(_batchnorm._PARAMS.size)}
    assert "__local_depot" not in ptx


BN_SHAPES = [
    (4, 5, 6, 7),
    (3, 17, 9, 11),
    (8, 64, 33, 33),
    (2, 40, 1, 1),
    (1, 8, 5, 3),
    (2, 24, 16, 16),  # 16-byte vectors in both layouts and every dtype
    (3, 12, 8, 4),  # float32 vectors; 16-bit: per element in channels-last
    (16, 3, 40, 40),  # NCHW: 13 blocks per channel, the last to arrive finishes it
]
# float32: no more than twice eager PyTorch's own error against float64, plus
# this floor; 16-bit outputs: their rounding
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MODES = [
    ("relu", 0.0, "default"),
    ("leaky_relu", 0.1, "default"),
    ("identity", 0.0, "default"),
    ("leaky_relu", 0.1, "inplace"),
    ("identity", 0.0, "inplace"),
]


def _fused_steps(model, x, gy, steps=2):
    """Two training steps, then an eval step with a backward (as fine-tuning
    with frozen statistics does): outputs, gradients, buffers (float64)."""
    out = []
    for train in [True] * steps + [False]:
        model.train(train)
        xi = x.detach().clone().requires_grad_(True)
        y = model(xi.clone())  # (a non-leaf input: the in-place mode writes over it)
        y.backward(gy)
        out += [y.detach().double(), xi.grad.double()]
        out += [p.grad.double() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    model.train()
    out += [b.double() for b in model.buffers()]
    return out


def _layout(t, layout):
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "offset":  # one element into its storage: not 16-byte aligned
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)
    return t.contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
@pytest.mark.parametrize("act,slope,memory", MODES)
def test_fused_kernels_accuracy_and_determinism(
    act, slope, memory, shape, layout, dtype, monkeypatch
):
    """Training and eval steps against float64: errors at most twice eager
    PyTorch's plus FLOOR; the in-place mode's gradients, which recover xhat
    from the rounded y as (z - b) / w, within 8 u A more (u: the dtype's unit
    roundoff, A = max over channels of max |xhat| + 2 |b / w|: the
    inversion's amplification; xhat's error enters dx twice),
    and its outputs and statistics the default mode's bit for bit; two runs,
    the same bits."""
    monkeypatch.setattr(ct.batchnorm, "FUSED_CHANNELS_LAST", True)
    momentum = None if shape[1] == 17 else 0.1
    ours, theirs = _pair(act, slope, momentum, "cuda", shape[1])
    if memory == "inplace":  # |w| in [0.5, 2]: a bounded amplification
        with torch.no_grad():
            ours.weight.copy_(ours.weight.sign() * (0.5 + ours.weight.abs() * 0.75))
        theirs[0].load_state_dict(ours.state_dict())
        default = copy.deepcopy(ours)
        ours.memory = "inplace"
    ref64 = copy.deepcopy(theirs).double()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5
    gy = torch.randn(shape, device="cuda", generator=gen)
    x, gy = _layout(x.to(dtype), layout), gy.to(dtype)
    first = copy.deepcopy(ours)
    got = _fused_steps(ours, x, gy)
    want = _fused_steps(theirs, x, gy)  # eager PyTorch (float32 parameters)
    exact = _fused_steps(ref64, x.double(), gy.double())
    assert got[-1].item() == exact[-1].item() == 2, "num_batches_tracked"
    extra = 0.0
    if memory == "inplace":
        w, b = ref64[0].weight.detach(), ref64[0].bias.detach()
        # A per channel (each channel's xhat is its own), its largest over the channels
        xd = x.double()
        dims = (0, 2, 3)
        xhat = (xd - xd.mean(dims, keepdim=True)).abs().amax(dims) / xd.var(
            dims, unbiased=False
        ).sqrt()
        # xhat's error, up to 4 u A, enters dx twice (through xhat and the mean of dz xhat)
        extra = 8 * UNIT[dtype] * (xhat + 2 * (b / w).abs()).max().item()
        base = _fused_steps(default, x, gy)
        per_step = 2 + len(list(ours.parameters()))
        for i in [k * per_step for k in range(3)] + [-3, -2, -1]:  # outputs, buffers
            testing.assert_bits_equal(got[i], base[i], f"in place against default, output {i}")
    for i, (a, e) in enumerate(zip(got, exact)):
        scale = e.abs().max().item() + 1e-30
        err = (a - e).abs().max().item() / scale
        bound = FLOOR[dtype] + extra + 2 * (want[i] - e).abs().max().item() / scale
        assert err <= bound, f"output {i}: error {err:.2e} over {bound:.2e}"
    again = _fused_steps(first, x, gy)
    for i, (a, e) in enumerate(zip(again, got)):
        testing.assert_bits_equal(a, e, f"run to run, output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_fused_kernels_save_a_mask_or_the_output(memory):
    """Training on CUDA takes the kernels. Default: x, the statistics and a
    1-bit mask saved. In place: the output is the input's storage, the only
    tensor of its size saved; reading the input afterwards for a gradient
    raises PyTorch's in-place error."""
    ours = ct.BatchNormAct2d(5, act_layer="leaky_relu", memory=memory).cuda()
    x = torch.randn(4, 5, 6, 7, device="cuda", requires_grad=True)
    (_, sizes) = testing.saved_sizes(lambda t: ours(t * 1), x)  # (a non-leaf input)
    big = [s for s in sizes if s[1] == x.numel()]
    assert big == [(torch.float32, x.numel())], sizes
    words = (torch.int32, -(-x.numel() // 32))
    assert (words in sizes) == (memory == "default"), sizes
    if memory == "inplace":
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            ours(x)  # (PyTorch's own error for an in-place op on such a tensor)
    z = x * 1
    s = z.sin()  # (saves z, which the in-place mode then writes over)
    y = ours(z)
    assert (y.data_ptr() == z.data_ptr()) == (memory == "inplace")
    if memory == "inplace":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (y + s).sum().backward()
    else:
        (y + s).sum().backward()


@pytest.mark.gpu
def test_double_backward_is_refused_by_name():
    """With create_graph the first backward gives the same bits as without, and
    differentiating its result raises once_differentiable's error."""
    ours = ct.BatchNormAct2d(5, act_layer="leaky_relu").cuda().eval()  # (same stats twice)
    x = torch.randn(4, 5, 6, 7, device="cuda", requires_grad=True)
    (plain,) = torch.autograd.grad((ours(x * 1) ** 2).sum(), x)
    (dx,) = torch.autograd.grad((ours(x * 1) ** 2).sum(), x, create_graph=True)
    testing.assert_bits_equal(dx, plain)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()


@pytest.mark.gpu
def test_float64_default_dtype_does_not_change_the_kernels_buffers():
    """The kernels write float32 statistics and gradients whatever
    torch.get_default_dtype() says: the same bits with float64 as default."""
    ours = ct.BatchNormAct2d(6, act_layer="leaky_relu").cuda()
    x = torch.randn(4, 6, 5, 7, device="cuda")
    gy = torch.randn_like(x)
    got = []
    for default in (torch.float32, torch.float64):
        m = copy.deepcopy(ours)
        old = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            xi = x.clone().requires_grad_(True)
            m(xi * 1).backward(gy)
        finally:
            torch.set_default_dtype(old)
        got.append([xi.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var])
    for a, e in zip(*got):
        assert a.dtype == e.dtype == torch.float32
        testing.assert_bits_equal(a, e)


@pytest.mark.gpu
def test_nchw_reductions_leave_their_counters_zero_on_every_stream():
    """An NCHW reduction's blocks count their arrivals per channel and the last
    one finishes the channel: after training and eval passes (with backward)
    on the default stream, a side stream and a new thread, each stream's
    counters are zero again and every run gives the same bits."""
    import threading

    from cupy_act import _batchnorm

    ours = ct.BatchNormAct2d(3, act_layer="relu").cuda()
    x = torch.randn(16, 3, 40, 40, device="cuda")
    gy = torch.randn_like(x)
    s = _batchnorm.shape(0, "float32", "relu", False, x.numel(), 40 * 40, 3)
    assert _batchnorm.arrivals(s) == 3 and _batchnorm.plan(s, 0).splits > 8

    def steps(out):
        for train in (True, False):
            m = copy.deepcopy(ours).train(train)
            xi = x.clone().requires_grad_(True)
            y = m(xi * 1)
            y.backward(gy)
            out += [y, xi.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var]
        return out

    want = steps([])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = steps([])
    torch.cuda.current_stream().wait_stream(side)
    on_thread: list = []
    worker = threading.Thread(target=steps, args=(on_thread,))
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    for got in (on_side, on_thread):
        assert len(got) == len(want)
        for i, (a, e) in enumerate(zip(got, want)):
            testing.assert_bits_equal(a, e, f"output {i}")
    from cupy_act.torch import _bn_kernels

    sets = _bn_kernels._arrival_sets
    for stream in (side, torch.cuda.default_stream()):
        for graphs in (False, True):  # (the set for graphs captured there, made beside it)
            ptr = sets[(0, stream.cuda_stream, graphs)]
            import cupy

            words = cupy.ndarray(
                (_bn_kernels._ARRIVALS,),
                cupy.int32,
                cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(ptr, 4 * _bn_kernels._ARRIVALS, None), 0
                ),
            )
            assert not words.any(), stream


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_batches_are_counted_by_the_kernels_and_in_cuda_graphs(memory):
    """The training forward's kernels count num_batches_tracked (once per call,
    not in eval), also when replayed from a CUDA graph, whose replays repeat
    the eager steps' outputs, gradients and running statistics bit for bit.
    A count on another device takes PyTorch's path."""
    ours = ct.BatchNormAct2d(6, act_layer="leaky_relu", memory=memory).cuda()
    eager = copy.deepcopy(ours)
    x = torch.randn(16, 6, 24, 24, device="cuda")  # (5 reduction blocks per channel)
    gy = torch.randn_like(x)
    for _ in range(3):
        eager(x.clone()).backward(gy)
    eager.eval()
    eager(x.clone())
    assert eager.num_batches_tracked.item() == 3
    eager.train()

    graphed = copy.deepcopy(ours)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up on a side stream, as torch.cuda.graphs asks)
        graphed(static_x.clone()).backward(gy)
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        graphed.running_mean.zero_(), graphed.running_var.fill_(1)
        graphed.num_batches_tracked.zero_()
    graphed.zero_grad(set_to_none=False)  # (the graph accumulates into these)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = graphed(static_x.clone())
        y.backward(gy)
    with torch.no_grad():  # (capture ran nothing: start from the eager model's state)
        graphed.running_mean.zero_(), graphed.running_var.fill_(1)
        graphed.num_batches_tracked.zero_()
    ys = []
    for _ in range(3):
        graphed.zero_grad(set_to_none=False)
        graph.replay()
        ys.append(y.clone())
    torch.cuda.synchronize()
    want = copy.deepcopy(ours)
    for i in range(3):
        want.zero_grad(set_to_none=True)
        yw = want(x.clone())
        yw.backward(gy)
        testing.assert_bits_equal(ys[i], yw, f"replay {i}")
    assert graphed.num_batches_tracked.item() == want.num_batches_tracked.item() == 3
    for name in ("running_mean", "running_var", "weight", "bias"):
        a, b = getattr(graphed, name), getattr(want, name)
        if name in ("weight", "bias"):
            a, b = a.grad, b.grad
        testing.assert_bits_equal(a, b, name)

    other = copy.deepcopy(ours)
    other.num_batches_tracked = other.num_batches_tracked.cpu()
    assert not ct.batchnorm._fusable(other, x)
    other(x.clone())
    assert other.num_batches_tracked.item() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["default", "inplace"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_nan_and_inf_propagate_as_pytorch(train, memory):
    """A NaN or an inf in a channel: training makes the channel's statistics,
    so all its outputs and gradients, NaN as PyTorch's BatchNorm does; eval
    keeps them to their elements."""
    ours, theirs = _pair("leaky_relu", 0.1, 0.1, "cuda", 6)
    ours.memory = memory
    x = torch.randn(3, 6, 5, 8, device="cuda")
    x[1, 0, 2, 3], x[0, 2, 4, 4], x[2, 3, 0, 0] = float("nan"), float("inf"), -float("inf")
    gy = torch.randn_like(x)
    results = []
    for model in (ours, theirs):
        model.train(train)
        xi = x.clone().requires_grad_(True)
        y = model(xi.clone())
        y.backward(gy)
        bn = model if model is ours else model[0]
        results.append([y.detach(), xi.grad, bn.running_mean, bn.running_var])
    for i, (a, e) in enumerate(zip(*results)):
        assert torch.equal(a.isnan(), e.isnan()), f"output {i}: NaN positions"
        assert torch.equal(a.isinf(), e.isinf()), f"output {i}: inf positions"
        ok = a.isfinite()
        torch.testing.assert_close(a[ok], e[ok], rtol=1e-4, atol=1e-5, msg=f"output {i}")


@pytest.mark.gpu
def test_fuse_inplace_where_the_input_is_a_convolution_output():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.1),
        nn.BatchNorm2d(8),  # (input: not a convolution's output)
        nn.LeakyReLU(0.1),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),  # (not invertible)
    ).cuda()
    ref = copy.deepcopy(model)
    model, count = ct.fuse_batchnorm_act(model, memory="inplace")
    assert count == 3
    assert [model[i].memory for i in (1, 3, 6)] == ["inplace", "default", "default"]
    x = torch.randn(2, 3, 12, 12, device="cuda")
    for m in (model, ref):
        torch.manual_seed(0)
        m(x).sum().backward()
    for (name, a), e in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match=r"memory='in_place' is not supported; expected one of"):
        ct.fuse_batchnorm_act(model, memory="in_place")


def test_fuse_inplace_keeps_zero_weights_in_the_default_mode():
    """A zero-initialized weight (timm's zero_init_last) cannot be inverted: the
    fuser keeps that BatchNorm in the default mode, names it and marks it
    ``kept_by_zero`` (the compiled policy's mark, which convert_sync_batchnorm
    keeps); so for a ReLU pair (ReLU's output does not give back its input),
    with its reason and no mark; the default memory mode marks nothing."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.LeakyReLU(0.1))
    model.append(nn.Conv2d(4, 4, 3)).append(nn.BatchNorm2d(4)).append(nn.LeakyReLU(0.1))
    nn.init.zeros_(model[4].weight)
    plain = copy.deepcopy(model)
    match = r"1 BatchNorm\(s\) \(4\) keep memory='default', as they have a zero in their weight"
    with pytest.warns(UserWarning, match=match):
        model, count = ct.fuse_batchnorm_act(model, memory="inplace")
    assert count == 2 and [model[1].memory, model[4].memory] == ["inplace", "default"]
    assert [model[1].kept_by_zero, model[4].kept_by_zero] == [False, True]
    assert ct.convert_sync_batchnorm(model)[4].kept_by_zero
    plain, _ = ct.fuse_batchnorm_act(plain)
    assert not plain[4].kept_by_zero and plain[4].memory == "default"
    relu = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    nn.init.zeros_(relu[1].weight)
    with pytest.warns(UserWarning, match=r"\(1\) keep memory='default', as their activation does"):
        relu, count = ct.fuse_batchnorm_act(relu, memory="inplace")
    assert count == 1 and relu[1].memory == "default" and not relu[1].kept_by_zero
    assert ct.BatchNormAct2d(4).kept_by_zero is False


class _CalledFromForward(nn.Module):
    """BatchNorm and ReLU called from forward, as torchvision's blocks do."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


def test_fusers_say_what_they_leave():
    """fuse_batchnorm_act warns where it fuses nothing or less than the model
    holds, naming the FX fuser for pairs a forward makes; both fusers refuse
    a compiled model, as replace_activations does; with nothing left over,
    nothing is said."""
    with pytest.warns(UserWarning, match="fused nothing: the model has no nn.BatchNorm2d"):
        _, count = ct.fuse_batchnorm_act(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    assert count == 0
    model = _CalledFromForward()
    with pytest.warns(UserWarning, match=r"fused 0 .* \(bn\) .*fuse_batchnorm_act_fx\(model\)"):
        _, count = ct.fuse_batchnorm_act(model)
    assert count == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm, count = ct.fuse_batchnorm_act_fx(model)
        assert count == 1
        _, count = ct.fuse_batchnorm_act(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))
        assert count == 1
    for fuser in (ct.fuse_batchnorm_act, ct.fuse_batchnorm_act_fx):
        name = fuser.__name__
        with pytest.raises(TypeError, match=rf"{name}: the model is a torch.compile'd module"):
            fuser(torch.compile(_CalledFromForward()))
        with pytest.raises(TypeError, match=rf"{name}\(model\) first, then torch.compile"):
            fuser(torch.compile(_CalledFromForward()))


@pytest.mark.gpu
def test_inplace_zero_weight_channel_is_loud_not_wrong():
    """The documented condition: where weight is 0 the in-place backward gives
    that channel NaN for grad_weight (xhat is lost), dx 0 as it should be, and
    the other channels their normal gradients."""
    ours, theirs = _pair("leaky_relu", 0.1, 0.1, "cuda", 4)
    with torch.no_grad():
        ours.weight[2] = 0.0
    theirs[0].load_state_dict(ours.state_dict())
    ours.memory = "inplace"
    x = torch.randn(3, 4, 5, 6, device="cuda")
    gy = torch.randn_like(x)
    grads = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        model(xi.clone()).backward(gy)
        grads.append([xi.grad, *(p.grad for p in model.parameters())])
    (dx, gw, gb), (dx_e, gw_e, gb_e) = grads
    assert gw[2].isnan() and not gw[[0, 1, 3]].isnan().any()
    assert torch.equal(dx[:, 2], torch.zeros_like(dx[:, 2]))
    torch.testing.assert_close(dx, dx_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw[[0, 1, 3]], gw_e[[0, 1, 3]], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gb, gb_e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_one_value_per_channel_is_refused_as_pytorch_does(device):
    m = ct.BatchNormAct2d(3).to(device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        m(torch.randn(1, 3, 1, 1, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_fused_running_statistics_match_pytorch(momentum, layout):
    """The kernels' running mean and (unbiased) running variance after three
    training steps, each within float32 rounding of nn.BatchNorm2d's (few
    values per channel: the unbiased variance is 8/7 of the biased one, a
    difference no bound here can hide), and the count."""
    ours, theirs = _pair("relu", 0.0, momentum, "cuda", 6)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(3):
        x = _layout(torch.randn(2, 6, 2, 2, device="cuda", generator=gen) * 3 + 1, layout)
        ours(x.clone())
        theirs(x.clone())
    for name in ("running_mean", "running_var"):
        a, e = getattr(ours, name), getattr(theirs[0], name)
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)
    assert ours.num_batches_tracked.item() == theirs[0].num_batches_tracked.item() == 3
