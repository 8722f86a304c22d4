"""PyTorch adapter: results and gradients bit for bit, in place, saved memory,
double backward, torch.compile, opcheck, modules; on CPU and (marked) CUDA."""

import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as TF  # noqa: E402
from torch import nn  # noqa: E402

import cupy_act  # noqa: E402
import cupy_act.torch as ct  # noqa: E402
from cupy_act import testing  # noqa: E402
from cupy_act._registry import OPS  # noqa: E402
from cupy_act.testing import assert_bits_equal  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPE_IDS = [str(d)[6:] for d in testing.DTYPES]
CASES = testing.cases()  # (op, slope, divisor) for every registry op
CASE_IDS = [testing.case_id(c) for c in CASES]


def call(op, x, slope, divisor, **kw):
    return testing.call(ct, op, x, slope, divisor, **kw)


def make(n, dtype, device, layout, seed=0):
    if layout == "contiguous":
        return testing.make_input(n, dtype, device, seed)
    if layout == "misaligned":
        return testing.make_input(n + 1, dtype, device, seed)[1:]
    if layout == "strided":
        return testing.make_input(2 * n, dtype, device, seed)[::2]
    t = testing.make_input(2 * 3 * 5 * n, dtype, device, seed).view(2, 3, 5, n)
    return t.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "misaligned", "strided", "channels_last"])
@pytest.mark.parametrize("n", [0, 1, 33, 4097])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_and_gradient_bit_exact(case, n, layout, dtype, device):
    op, slope, divisor = case
    x = make(n, dtype, device, layout)
    dy = make(n, dtype, device, layout, seed=1)
    rkw = dict(slope=slope, divisor=divisor)
    expected_y = testing.forward(op, x, **rkw)
    expected_dx = testing.backward(op, x, dy, **rkw)
    with torch.no_grad():
        assert_bits_equal(call(op, x, slope, divisor), expected_y, "no-grad forward")
    # On the CPU, PyTorch's NaN payloads depend on the layout (vectorized or
    # strided loops), and clone() makes a strided tensor contiguous: each
    # expectation is computed on exactly the tensors the op receives.
    xr = x.detach().clone().requires_grad_(True)
    y = call(op, xr, slope, divisor)
    assert_bits_equal(y, testing.forward(op, xr.detach(), **rkw), "forward")
    (dx,) = torch.autograd.grad(y, xr, dy)
    assert_bits_equal(dx, testing.backward(op, xr.detach(), dy, **rkw), "gradient")
    # in place, under autograd, on a non-leaf
    xr2 = x.detach().clone().requires_grad_(True)
    h = xr2.clone()
    v0 = h._version
    out = call(op, h, slope, divisor, inplace=True)
    assert out is h and h._version > v0
    assert_bits_equal(out, testing.forward(op, xr2.detach(), **rkw), "in-place forward")
    (dx2,) = torch.autograd.grad(out, xr2, dy)
    assert_bits_equal(dx2, testing.backward(op, xr2.detach(), dy, **rkw), "in-place gradient")
    if device == "cuda":  # on the GPU the layout changes nothing
        assert_bits_equal(y, expected_y, "forward vs the original layout")
        assert_bits_equal(dx, expected_dx, "gradient vs the original layout")


@pytest.mark.parametrize("piece", [1 << 14, (1 << 14) + 24], ids=["piece_2^14", "piece_odd"])
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "expanded_dy"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cpu_path_in_pieces(case, layout, dtype, piece, monkeypatch):
    """The CPU path runs a piece at a time (masks; in float32 and float64 also
    the forward of an op with a divisor): over several pieces and an odd tail,
    masks, outputs and gradients are still PyTorch's bits, and so with pieces
    that start off the vector alignment (scalar loops where the whole tensor
    has vector lanes)."""
    from cupy_act.torch import _impl

    monkeypatch.setattr(_impl, "_PIECE", piece)  # (smaller pieces, same code)
    op, slope, divisor = case
    n = 5 * _impl._PIECE + 4097
    x = testing.make_input(n, dtype, "cpu", 7)
    dy = testing.make_input(n, dtype, "cpu", 8)
    if layout == "channels_last":  # 4-D, walked in memory order (N, H, W, C)
        shape = (1, 3, 17, n // 51)
        x = x[: math.prod(shape)].view(shape).contiguous(memory_format=torch.channels_last)
        dy = dy[: x.numel()].view(shape).contiguous(memory_format=torch.channels_last)
    elif layout == "expanded_dy":  # a broadcast gradient, as from y.sum(): the general path
        dy = dy[:1].expand(n)
    cl = layout == "channels_last"
    y, mask, mask_cl = _impl.forward_mask_layout(x, op, slope, divisor or 1.0, None)
    assert mask_cl == cl
    expected_bits = testing.mask_bits(op, x, divisor)
    assert torch.equal(_impl.mask_to_bits(mask, x.shape, cl), expected_bits)
    assert not _impl.unpack_bits(mask, mask.numel() * 8)[x.numel() :].any(), "padding bits"
    assert_bits_equal(y, testing.forward(op, x, slope, divisor), "forward")
    xr = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(call(op, xr, slope, divisor), xr, dy)
    assert_bits_equal(dx, testing.backward(op, x, dy, slope, divisor), "gradient")
    assert dx.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_registry_out_forms(case, dtype):
    """The registry's reference with ``out=`` (what the CPU path writes into its
    own buffers) gives the bits of its form without (PyTorch's op, checked
    against independent expressions in the conformance suite)."""
    op, slope, _ = case
    spec = OPS[op]
    t = testing.make_input(4099, dtype, "cpu", 11)
    y = torch.full_like(t, 7.0)  # poisoned: every element must be written
    assert spec.torch_forward(torch, t, slope, y) is y
    assert_bits_equal(y, spec.torch_forward(torch, t, slope, None), "forward out=")
    bits = torch.zeros(t.numel(), dtype=torch.bool)
    assert spec.torch_bit(torch, t, bits) is bits
    assert torch.equal(bits, spec.torch_bit(torch, t, None))
    assert 0 < int(bits.sum()) < t.numel()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("channels_last", [False, True])
# shapes whose vectors share one channel (NCHW, H*W % 8 == 0), cover a run of
# channels (channels-last, C % 8 == 0), or neither, on the kernels' vector path
@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (3, 16, 8, 9), (2, 12, 5, 6)])
def test_bias_forward_and_gradients(shape, channels_last, dtype, device):
    x = testing.make_input(math.prod(shape), dtype, device, 3).view(shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    b = testing.make_input(shape[1], dtype, device, 4)
    xr, br = x.clone().requires_grad_(True), b.clone().requires_grad_(True)
    y = ct.div_leaky_relu(xr, 2.0, 0.1, bias=br)
    assert_bits_equal(y, testing.forward("div_leaky_relu", x, 0.1, 2.0, b), "forward")
    # dy with special values (dx) and finite (the bias gradient: a sum over NaN
    # would be NaN, and NaN compares nothing)
    special = testing.make_input(x.numel(), dtype, device, 5).view(x.shape)
    finite = testing.make_grad(x.numel(), dtype, device, 6).view(x.shape)
    for dy in (special, finite):
        dx, db = torch.autograd.grad(y, (xr, br), dy, retain_graph=True)
        # (the reference's x.clone() is contiguous; ours keeps channels-last, which on
        # the CPU changes PyTorch's NaN payloads, so compare that layout on CUDA only)
        if device == "cuda" or not channels_last:
            assert_bits_equal(dx, testing.backward("div_leaky_relu", x, dy, 0.1, 2.0, b), "dx")
    xe, be = x.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ye = TF.leaky_relu((xe + be.view(1, -1, 1, 1)) / 2.0, 0.1)
    _, db_e = torch.autograd.grad(ye, (xe, be), finite)
    assert db_e.isfinite().all()
    # the same sum of the same dx, up to the order a layout gives it
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    torch.testing.assert_close(db, db_e, rtol=tol, atol=tol * db_e.abs().max().item())
    assert_bits_equal(db, db_e, "db")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
def test_saved_memory_is_the_mask_only(dtype, device):
    def chain(x):
        y = ct.relu(x)
        y = ct.leaky_relu(y.clone(), 0.2)
        return ct.div_leaky_relu(y.clone(), 3.0, 0.1)

    x = torch.randn(3, 1000, 7, device=device, dtype=dtype, requires_grad=True)
    y, saved = testing.saved_sizes(chain, x)
    n = x.numel()
    masks = [s for s in saved if s[0] == torch.uint8]
    assert masks == [(torch.uint8, cupy_act.mask_nbytes(n))] * 3, saved
    assert cupy_act.mask_nbytes(n) <= (n + 7) // 8 + 16
    # nothing else: clone saves nothing
    assert len(saved) == 3, saved
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradcheck_and_gradgradcheck_float64(case, device):
    op, slope, divisor = case
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4, 5, generator=g, dtype=torch.float64) + 0.1
    x = (x * torch.randint(0, 2, x.shape, generator=g) * 2 - x).to(device).requires_grad_(True)
    fn = lambda t: call(op, t, slope, divisor)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))
    b = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, c: ct.div_leaky_relu(t, 2.0, 0.1, bias=c), (x, b))


@pytest.mark.parametrize("device", DEVICES)
def test_signed_zero_slopes_are_told_apart(device):
    # 0.0 == -0.0, so a cache keyed on the slope's value would hand one the
    # other's rounded scalar; x * 0.0 and x * -0.0 differ in sign.
    x = testing.make_input(300, torch.float32, device)
    dy = testing.make_input(300, torch.float32, device, seed=1)
    for slope in (0.0, -0.0, 0.0, -0.0):
        with torch.no_grad():
            assert_bits_equal(ct.leaky_relu(x, slope), TF.leaky_relu(x, slope), f"slope {slope}")
        xr = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(ct.leaky_relu(xr, slope), xr, dy)
        assert_bits_equal(dx, testing.backward("leaky_relu", x, dy, slope=slope), f"{slope}")


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_rules(device):
    leaf = torch.randn(10, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        ct.leaky_relu(leaf, 0.1, inplace=True)
    # PyTorch refuses in-place leaky_relu backward for negative slopes; cupy_act does not
    a = torch.randn(10, device=device, requires_grad=True)
    with pytest.raises(RuntimeError):
        TF.leaky_relu(a * 1, -0.5, inplace=True).sum().backward()
    h = a * 1
    ct.leaky_relu(h, -0.5, inplace=True).sum().backward()
    assert torch.equal(a.grad, torch.where(a > 0, 1.0, -0.5))
    # a tensor another op saved, changed in place later: PyTorch's usual error
    w = torch.randn(10, device=device, requires_grad=True)
    h = a * 1
    z = h * w  # saves h
    ct.relu(h, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    # no-grad in place moves the version counter too
    t = torch.randn(10, device=device)
    v = t._version
    with torch.no_grad():
        ct.relu(t, inplace=True)
    assert t._version > v


def test_module_reprs_follow_torch():
    assert repr(ct.ReLU()) == repr(nn.ReLU()) and repr(ct.ReLU(True)) == repr(nn.ReLU(True))
    assert repr(ct.LeakyReLU(0.2, True)) == repr(nn.LeakyReLU(0.2, True))
    assert repr(ct.LeakyReLU()) == repr(nn.LeakyReLU())
    assert repr(ct.DivLeakyReLU(2.0)) == "DivLeakyReLU(divisor=2.0, negative_slope=0.01)"


def test_bad_arguments():
    x = torch.randn(4)
    with pytest.raises(TypeError, match="input has dtype torch.int64"):
        ct.relu(torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ct.relu([1.0])
    with pytest.raises(ValueError, match="divisor must be a finite, non-zero number, got 0"):
        ct.div_leaky_relu(x, 0)
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        ct.leaky_relu(x, "0.1")
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected"):
        ct.div_leaky_relu(torch.randn(2, 4, 3), 2.0, bias=torch.randn(3))


@pytest.mark.parametrize("device", DEVICES)
def test_conv_module_state_dict_round_trip(device):
    torch.manual_seed(0)
    eager = testing.ConvDivLeakyReLUModel(8, 16, 3, 2).to(device)
    ours = ct.ConvDivLeakyReLU(8, 16, 3, divisor=2).to(device)
    assert set(ours.state_dict()) == set(eager.state_dict()) == {"conv.weight", "conv.bias"}
    ours.load_state_dict(eager.state_dict())
    eager2 = testing.ConvDivLeakyReLUModel(8, 16, 3, 2).to(device)
    eager2.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 12, 12, device=device)
    y_e, y_o = eager(x), ours(x)
    assert_bits_equal(y_o, y_e, "ConvDivLeakyReLU forward")
    g = torch.randn_like(y_e)
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
        ge = torch.autograd.grad(y_e, list(eager.parameters()), g)
        go = torch.autograd.grad(y_o, list(ours.parameters()), g)
    for a, b, name in zip(go, ge, ("weight", "bias")):
        # the same input gradient into the same reductions: bias grad is
        # grad.sum((0, 2, 3)) both ways; weight grad is the same convolution backward
        assert_bits_equal(a, b, f"{name} gradient")
    cl = ct.ConvDivLeakyReLU(8, 16, 3, divisor=2, channels_last=True).to(device)
    cl.load_state_dict(eager.state_dict())
    torch.testing.assert_close(cl(x), y_e, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_trains_like_eager(device):
    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 32),
            ct.LeakyReLU(0.1),
            nn.Linear(32, 32),
            ct.DivLeakyReLU(2.0),
            nn.Linear(32, 32),
            ct.ReLU(),
            nn.Linear(32, 1),
        ).to(device)
        step_model = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        data = torch.randn(5, 64, 16, generator=g).to(device)
        losses = []
        for batch in data:
            loss = step_model(batch).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    torch._dynamo.reset()
    eager_losses, eager_params = run(False)
    comp_losses, comp_params = run(True)
    torch.testing.assert_close(comp_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(comp_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    from cupy_act.torch import _library as L

    x = torch.randn(2, 3, 4, 5, device=device)  # finite: opcheck compares with NaN != NaN
    b = torch.randn(3, device=device)
    for op, s, d in CASES:
        bias = b if OPS[op].divisor else None
        d = 1.0 if d is None else d
        torch.library.opcheck(L.forward_op, (x, op, s, d, bias))
        torch.library.opcheck(L.forward_mask_op, (x.clone().requires_grad_(True), op, s, d, bias))
        mask = L.forward_mask_op(x, op, s, d, bias)[1]
        torch.library.opcheck(
            L.backward_op, (x.clone().requires_grad_(True), mask, op, s, d, False)
        )
        torch.library.opcheck(L.forward_mask_inplace_op, (x.clone(), op, s, d, bias))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_refuses_a_mask_that_does_not_fit(device):
    """torch.ops.cupy_act.backward is public: a mask too short for dy (the kernel
    would read past it), of another dtype or device is refused, naming it."""
    from cupy_act.torch import _library as L

    dy = torch.randn(300, device=device)
    mask = L.forward_mask_op(dy, "relu", 0.0, 1.0, None)[1]
    assert L.backward_op(dy, mask, "relu", 0.0, 1.0, False).shape == dy.shape
    cases = [(mask[:-17], "uint8 of 31 elements"), (mask.view(torch.int8), "int8 of 48 elements")]
    if device == "cuda":  # (a meta mask would send the call to the fake implementation)
        cases.append((mask.cpu(), "uint8 of 48 elements on cpu"))
    for bad, what in cases:
        with pytest.raises(ValueError, match=f"mask is torch.{what}.*at least 48 bytes"):
            torch.ops.cupy_act.backward(dy, bad, "relu", 0.0, 1.0, False)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_keeps_dtype_and_checkpoint_works(device):
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(64, 64, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        assert ct.leaky_relu(x, 0.1).dtype == torch.float32
        assert ct.relu(x.bfloat16()).dtype == torch.bfloat16
    f = lambda t: ct.div_leaky_relu(ct.leaky_relu(t * 2, 0.2), 3.0)  # noqa: E731
    (g1,) = torch.autograd.grad(checkpoint(f, x, use_reentrant=False).sum(), x)
    (g2,) = torch.autograd.grad(f(x).sum(), x)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
@pytest.mark.parametrize("n", [1000, 4096])
def test_mask_bit_order_is_numpys_little_endian(n, offset, device):
    """Element i's bit is bit i % 8 of byte i / 8 (numpy.packbits with
    bitorder="little"), the padding zeros: whether the kernels take whole
    vectors (aligned) or single elements (offset), and on the CPU."""
    import numpy

    from cupy_act.torch import _impl

    x = testing.make_input(n + offset, torch.float32, device, 11)[offset:]
    for op in ("relu", "leaky_relu"):
        _, mask = _impl.forward_mask(x, op, 0.1, 1.0, None)
        bits = testing.mask_bits(op, x).cpu().numpy()
        want = numpy.zeros(cupy_act.mask_nbytes(n), dtype=numpy.uint8)
        want[: (n + 7) // 8] = numpy.packbits(bits, bitorder="little")
        assert numpy.array_equal(mask.cpu().numpy(), want), op
