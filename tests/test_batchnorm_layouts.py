"""The fused BatchNorm kernels' layouts beyond a dense tensor: a backward's dy
read where it lies when it is a channel slice (a concatenation's gradient,
as in CSP networks), and the channels-last elementwise grids that keep each
thread on its channels. Launch plans on the CPU; the kernels with ``gpu``."""

import copy

import pytest
from conftest import record_bn_launches

torch = pytest.importorskip("torch")

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _batchnorm, _launch  # noqa: E402
from cupy_act.torch import _bn_kernels as K  # noqa: E402
from cupy_act.torch import _impl  # noqa: E402

FLOOR = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _in(layout: str, t):
    return t.contiguous(memory_format=torch.channels_last) if layout == "cl" else t.contiguous()


def _slice(shape, layout, before, after, dtype=torch.float32, device="cpu"):
    """Channels [before, before + C) of a tensor of C + before + after channels."""
    n, c, h, w = shape
    big = _in(layout, torch.randn(n, before + c + after, h, w, dtype=dtype, device=device))
    return big[:, before : before + c]


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize(
    "shape,before,after",
    [((4, 6, 5, 7), 2, 3), ((2, 8, 4, 4), 8, 0), ((3, 5, 1, 1), 0, 4), ((1, 6, 3, 3), 1, 1)],
)
def test_channel_slices_are_read_where_they_lie(shape, before, after, layout):
    """A channel slice of a tensor in the kernels' layout is dy itself, with
    the extra elements per row (channels-last) or sample (NCHW) as its skip;
    a dense tensor's skip is 0."""
    gy = _slice(shape, layout, before, after)
    n, c, h, w = shape
    got, skip = K.skipped(gy, layout == "cl")
    cl_rows, nchw_samples = before + after, (before + after) * h * w
    want = cl_rows if layout == "cl" else (nchw_samples if n > 1 else 0)
    if layout == "cl" and n * h * w == 1:
        want = 0  # (one row: no pitch)
    assert got is gy and skip == want
    dense = _in(layout, torch.randn(shape))
    assert K.skipped(dense, layout == "cl") == (dense, 0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 6, 5, 7)[:, :, 1:4],  # rows cut short: not one pitch
        lambda: torch.randn(4, 6, 5, 7).transpose(2, 3),
        lambda: torch.ones(()).expand(4, 6, 5, 7),  # (what sum().backward() hands in)
        lambda: torch.randn(4, 6, 5, 7)[::2],  # (NCHW: every other sample has a pitch; CL not)
    ],
    ids=["cut-rows", "transposed", "expanded", "every-other-sample"],
)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_other_strides_are_copied_to_the_kernels_layout(make, layout):
    gy = make()
    got, skip = K.skipped(gy, layout == "cl")
    fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
    if skip:
        assert layout == "nchw" and got is gy and skip == 6 * 5 * 7
        return
    assert got.is_contiguous(memory_format=fmt) and torch.equal(got, gy)


_DY = _batchnorm.Buffers._fields.index("dy")
_SKIP = len(_batchnorm.Buffers._fields) + 4  # (dy_skip: after the pointers and 4 counts)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("before,width", [(8, 4), (1, 1)], ids=["aligned", "unaligned"])
def test_backward_launch_reads_the_slice(layout, before, width, monkeypatch):
    """The backward's launches get the slice's own address and its skip, and
    16-byte vectors only where every row or sample of it is aligned (NCHW
    with vectors: planes are whole vectors, so every channel slice is)."""
    launched = record_bn_launches(monkeypatch)
    shape = (4, 8, 6, 6)
    x = _in(layout, torch.randn(shape))
    mode = K.Mode("leaky_relu", 0.1, False, False, True)
    w, b = torch.rand(8) + 0.5, torch.randn(8)
    y, stats, mask, s = K.forward(x, w, b, None, None, None, None, 0.0, 1e-5, mode)
    gy = _slice(shape, layout, before, 8 - before)  # (CPU allocations: 64-byte aligned)
    launched.clear()
    K.backward(x, gy, mask, w, b, stats, None, s, mode, True, True, False)
    skip = 8 if layout == "cl" else 8 * 36
    assert launched and all(f[_DY] == gy.data_ptr() and f[_SKIP] == skip for _, f in launched)
    widths = {name.split(", ")[2] for name, _ in launched if name.count(",") >= 3}
    assert widths == {str(width if layout == "cl" else 4)}


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_a_skip_past_the_buffer_is_refused(layout, monkeypatch):
    """The dy a skipped pass indexes grows by the skip per row (channels-last)
    or sample (NCHW) but the last: a buffer one byte short of that is
    refused before the launch, one that holds it launches."""
    launched = record_bn_launches(monkeypatch)
    s = _batchnorm.shape(None, "float32", "relu", layout == "cl", 2 * 8 * 3 * 3, 9, 8)
    ps = _batchnorm.prepare(s, 256, "backward")
    b = _batchnorm.Buffers(*[256] * len(_batchnorm.Buffers._fields))
    have = list(ps.need)
    have[_DY] += 4 * 5 * ((2 * 9 if layout == "cl" else 2) - 1)
    _batchnorm.run(ps, 0, b, tuple(have), 0.0, 0.0, 0.0, 0, dy_skip=5)
    assert launched
    have[_DY] -= 1
    with pytest.raises(_launch.SizeMismatch, match="dy has"):
        _batchnorm.run(ps, 0, b, tuple(have), 0.0, 0.0, 0.0, 0, dy_skip=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("channels", [3, 24, 40, 64, 96, 1000, 1024, 4000])
@pytest.mark.parametrize("rows", [1, 37, 4096, 200_000])
def test_channels_last_elementwise_threads_keep_their_channels(channels, rows, dtype):
    """Every thread of a channels-last elementwise pass meets the same
    channels on every trip (its coefficients are loaded once): one trip, or
    a whole number of rows per trip."""
    for aligned in (True, False):
        s = _batchnorm.shape(0, dtype, "relu", True, rows * channels, 1, channels)
        width = _batchnorm.VECTOR[dtype] if aligned and s.vector else 1
        for cap in (132 * 16, 7, 1):
            blocks = _batchnorm.elementwise_blocks(s, width, cap)
            threads = blocks * _batchnorm.THREADS
            assert blocks >= 1 and (threads * width >= s.n or threads * width % channels == 0)
            assert blocks <= max(cap, channels // width)  # (about cap)


def _model(act, memory, c, dtype, device="cuda"):
    kwargs = {"negative_slope": 0.1} if act == "leaky_relu" else None
    m = ct.BatchNormAct2d(c, act_layer=act, act_kwargs=kwargs, memory=memory).to(device)
    with torch.no_grad():
        m.weight.uniform_(0.5, 2)
        m.bias.uniform_(-1, 1)
    return m


def _grads(m, x, gy, residual=None):
    xi = x.detach().clone().requires_grad_(True)
    y = m(xi * 1) if residual is None else m(xi * 1, residual)
    y.backward(gy)
    return [y.detach(), xi.grad, m.weight.grad, m.bias.grad]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("before,after", [(16, 8), (1, 2)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_backward_from_a_channel_slice_equals_the_dense_one(memory, before, after, layout, dtype):
    """dy a channel slice, read where it lies: the same gradients as from its
    dense copy, bit for bit where both take 16-byte vectors, else within the
    dtype's rounding (another vector width sums in another order)."""
    from cupy_act import testing

    shape = (6, 32, 12, 20)
    m = _model("leaky_relu", memory, shape[1], dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = _in(layout, torch.randn(shape, device="cuda", generator=gen).to(dtype))
    gy = _slice(shape, layout, before, after, dtype, "cuda")
    assert K.skipped(gy, layout == "cl")[0] is gy
    got = _grads(copy.deepcopy(m), x, gy)
    want = _grads(copy.deepcopy(m), x, _in(layout, gy.clone()))
    for i, (a, e) in enumerate(zip(got, want)):
        if before == 16:
            testing.assert_bits_equal(a, e, f"output {i}")
        else:
            scale = e.double().abs().max().item()
            err = (a.double() - e.double()).abs().max().item()
            assert err <= FLOOR[dtype] * scale, f"output {i}: {err:.2e} of {scale:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels", [24, 40, 56])
def test_channels_last_passes_over_many_trips_match_nchw(channels, dtype):
    """Channels-last inputs large enough that the elementwise grids wrap many
    times, with C / V not dividing a block (the grid rounded to whole rows):
    outputs and gradients equal NCHW's within the dtype's rounding (the
    statistics sum in another order), residual and its gradient included."""
    shape = (16, channels, 128, 128)  # (over 16 x 132 blocks of vectors on an H200)
    m = _model("leaky_relu", "default", channels, dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x, gy, r = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(3))
    r.requires_grad_(True)
    want = _grads(copy.deepcopy(m), x, gy, r) + [r.grad]
    r.grad = None
    cl = [_in("cl", t) for t in (x, gy, r.detach())]
    rc = cl[2].requires_grad_(True)
    got = _grads(copy.deepcopy(m), cl[0], cl[1], rc) + [rc.grad]
    assert _impl.is_channels_last(got[0])
    for i, (a, e) in enumerate(zip(got, want)):
        scale = e.double().abs().max().item()
        err = (a.double() - e.double()).abs().max().item()
        assert err <= 2 * FLOOR[dtype] * scale, f"output {i}: {err:.2e} of {scale:.2e}"


def _stand_in(name, seen):
    """A CPU kernel for the op ``name`` that records the strides of the tensor
    the lowering places (dy, or the forward's residual) and copies it out."""

    def backward(src, dy, mask, w, b, stats, r, act, slope, ev, fo, nw, nb, nr):
        seen.append(dy.stride())
        dx = torch.empty_like(src).copy_(dy)
        return dx, src.new_zeros(8 if nw else 0), src.new_zeros(8 if nb else 0), src.new_empty(0)

    def forward(x, w, b, r, rm, rv, eps, act, slope, ev, fo, grad):
        seen.append(r.stride())
        y = torch.empty_like(x).copy_(r)
        return y, x.new_zeros(64, dtype=torch.float64), x.new_empty(0, dtype=torch.int32)

    return backward if name == "batchnorm_act_backward" else forward


@pytest.mark.slow  # (Inductor's C++ compile)
@pytest.mark.parametrize("name", ["batchnorm_act_backward", "batchnorm_act"])
def test_inductor_lays_dy_and_the_residual_out_in_the_first_inputs_order(name, monkeypatch):
    """Compiled with Inductor (CPU; the op's kernel replaced by a stand-in that
    records what arrives): a concatenation feeding dy (the backward) or the
    residual (the forward) arrives channels-last beside a channels-last src
    or x, written so by Inductor's own kernel; Inductor alone lays it out NCHW
    and the op then copies it."""
    from torch._inductor import config

    from cupy_act.torch import _bn_lowering

    monkeypatch.setattr(_impl, "on_gpu", lambda t: True)  # (the checks take these CPU tensors)
    torch._dynamo.reset()
    seen: list = []
    lib = torch.library.Library("cupy_act", "IMPL")
    lib.impl(name, _stand_in(name, seen), "CPU")
    op = getattr(torch.ops.cupy_act, name)
    w, bias = torch.rand(8) + 0.5, torch.randn(8)
    stats, mask = torch.zeros(64, dtype=torch.float64), torch.empty(0, dtype=torch.int32)

    def f(lead, a, b):
        cat = torch.cat([a * 2, b + 1], 1)
        if name == "batchnorm_act":
            return op(lead, w, bias, cat, None, None, 1e-5, "relu", 0.0, False, False, True)[0]
        args = ("leaky_relu", 0.1, False, True, True, True, False)
        return op(lead, cat, mask, w, bias, stats, None, *args)[0]

    lead = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    a, b = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    try:
        with config.patch(force_disable_caches=True):  # (a cached graph would skip lowering)
            got = torch.compile(f, fullgraph=True)(lead, a, b)
    finally:
        lib._destroy()
        torch._dynamo.reset()
    assert _bn_lowering.register()
    assert seen == [(128, 1, 32, 8)]  # (channels-last strides of 2 x 8 x 4 x 4)
    assert torch.equal(got, torch.cat([a * 2, b + 1], 1))


class _Csp(torch.nn.Module):
    """A CSP stage's shape (timm's CrossStage): a convolution doubles the
    channels, its BatchNorm's output is split, one half goes through a
    convolution, and the halves are concatenated into the next one."""

    def __init__(self, c, memory):
        super().__init__()
        conv = torch.nn.Conv2d
        self.conv_exp, self.conv_b, self.conv_t = (
            conv(c, 2 * c, 1, bias=False), conv(c, c, 3, padding=1, bias=False),
            conv(2 * c, c, 1, bias=False),
        )  # fmt: skip
        self.bn_exp, self.bn_b, self.bn_t = (
            _model("leaky_relu", memory, k, None, "cpu") for k in (2 * c, c, c)
        )
        self.c = c

    def forward(self, x):
        xs, xb = self.bn_exp(self.conv_exp(x)).split(self.c, 1)
        return self.bn_t(self.conv_t(torch.cat([xs, self.bn_b(self.conv_b(xb))], 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["default", "inplace"])
def test_compiled_csp_stage_hands_the_ops_their_layout(memory, monkeypatch):
    """A channels-last CSP stage compiled with Inductor, the op at every
    BatchNorm: no tensor is copied inside the ops (dy of the split BatchNorm
    is the concatenation's gradient, which Inductor lays out channels-last
    for it), and the step matches eager's within float32 rounding."""
    copies = []
    for name in ("arranged", "skipped"):
        real = getattr(K, name)

        def recording(t, *a, _real=real, _name=name):
            out = _real(t, *a)
            got = out[0] if isinstance(out, tuple) else out
            if t is not None and got is not t:
                copies.append((_name, tuple(t.shape), t.stride()))
            return out

        monkeypatch.setattr(K, name, recording)
    previous = ct.set_compiled_batchnorm("everywhere")
    try:
        model = _Csp(32, memory).cuda().to(memory_format=torch.channels_last)
        gen = torch.Generator(device="cuda").manual_seed(3)
        x = torch.randn(4, 32, 24, 24, device="cuda", generator=gen)
        x = x.contiguous(memory_format=torch.channels_last)
        gy = torch.randn(4, 32, 24, 24, device="cuda", generator=gen)
        results = []
        for fn in (copy.deepcopy(model), torch.compile(copy.deepcopy(model))):
            copies.clear()
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.backward(gy)
            results.append([y.detach(), xi.grad])
    finally:
        ct.set_compiled_batchnorm(previous)
        torch._dynamo.reset()
    assert copies == []  # (the compiled step's)
    for a, e in zip(results[1], results[0]):
        err = (a - e).abs().max().item() / e.abs().max().item()
        assert err <= 1e-5, err
