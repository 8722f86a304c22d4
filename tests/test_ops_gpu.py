"""CuPy-level API on the GPU: bit equality with PyTorch eager CUDA for every op,
kind, dtype, size and layout; masks; out=, in place, streams, huge inputs."""

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import cupy_act  # noqa: E402
from cupy_act import testing  # noqa: E402
from cupy_act.testing import assert_bits_equal  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 3, 31, 32, 33, 127, 128, 129, 4097, 2**20 + 7]
LAYOUTS = ["contiguous", "misaligned", "transposed", "step2"]
# (op, negative_slope, divisor) for every registry op; 1/d for d = -1.7 and 9.1
# rounds differently in float32 and in double
CASES = testing.cases(
    slopes=(0.01, -0.3), divided=((0.01, 2.0), (0.2, -3.7), (0.01, -1.7), (0.01, 9.1))
)
CASE_IDS = [testing.case_id(c) for c in CASES]
DTYPE_IDS = [str(d).replace("torch.", "") for d in testing.DTYPES]


def make_layout(n, dtype, layout, seed=0):
    """A tensor of about n elements in the requested memory layout."""
    if layout == "contiguous":
        return testing.make_input(n, dtype, seed=seed)
    if layout == "misaligned":  # data pointer one element past an aligned start
        return testing.make_input(n + 1, dtype, seed=seed)[1:]
    if layout == "transposed":
        return testing.make_input(3 * n, dtype, seed=seed).view(3, n).t()
    return testing.make_input(2 * n, dtype, seed=seed)[::2]


def poison(shape, dtype):
    """A buffer full of a NaN pattern that no kernel here produces."""
    pattern = {
        torch.float32: 0x7FBADBAD,
        torch.float64: 0x7FF4BADBADBADBAD,
        torch.float16: 0x7D5A,
        torch.bfloat16: 0x7F5A,
    }[dtype]
    itype = testing.INT_VIEW[dtype]
    return torch.full(shape, pattern, dtype=itype, device="cuda").view(dtype)


def fns(op):
    return (
        getattr(cupy_act, op),
        getattr(cupy_act, op + "_with_mask"),
        getattr(cupy_act, op + "_backward"),
    )


kwargs = testing.op_kwargs


def ref_kwargs(slope, divisor):
    return {"slope": slope, "divisor": divisor}


def check_mask(mask, expected_bits):
    """Mask bits equal the reference predicate; padding bits are zero."""
    n = expected_bits.numel()
    assert mask.dtype == cupy.uint8 and mask.shape == (cupy_act.mask_nbytes(n),)
    got = torch.from_dlpack(cupy_act.unpack_mask(mask, mask.size * 8))
    assert torch.equal(got[:n], expected_bits.flatten()), "mask bits differ from the reference"
    assert not got[n:].any(), "mask padding bits are not zero"


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_all_kinds_bit_exact(case, layout, n, dtype):
    op, slope, divisor = case
    fwd, fwd_mask, bwd = fns(op)
    kw, rkw = kwargs(op, slope, divisor), ref_kwargs(slope, divisor)
    xt = make_layout(n, dtype, layout)
    x = cupy.from_dlpack(xt)
    expected = testing.forward(op, xt, **rkw)

    y = fwd(x, **kw)
    assert y.flags.c_contiguous
    assert_bits_equal(torch.from_dlpack(y), expected, "forward")

    out = poison(xt.shape, dtype)
    mask = cupy.full(cupy_act.mask_nbytes(xt.numel()), 0xA5, dtype=cupy.uint8)
    y2, m = fwd_mask(x, **kw, out=cupy.from_dlpack(out), mask=mask)
    assert m is mask
    assert_bits_equal(out, expected, "forward with mask")
    check_mask(m, testing.mask_bits(op, xt, divisor))

    dyt = make_layout(n, dtype, layout, seed=1)
    dx_out = poison(xt.shape, dtype)
    bwd(cupy.from_dlpack(dyt), m, **kw, out=cupy.from_dlpack(dx_out))
    assert_bits_equal(dx_out, testing.backward(op, xt, dyt, **rkw), "backward")


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_in_place_and_misaligned_out(case, dtype):
    op, slope, divisor = case
    fwd, fwd_mask, bwd = fns(op)
    kw, rkw = kwargs(op, slope, divisor), ref_kwargs(slope, divisor)
    xt = testing.make_input(4097, dtype, seed=3)
    expected = testing.forward(op, xt, **rkw)
    # in place, contiguous
    xc = xt.clone()
    assert fwd(cupy.from_dlpack(xc), **kw, out=cupy.from_dlpack(xc)) is not None
    assert_bits_equal(xc, expected, "in place")
    # in place on a non-contiguous view
    buf = testing.make_input(2 * 4097, dtype, seed=4)
    buf[::2] = xt
    view = cupy.from_dlpack(buf)[::2]
    fwd_mask(view, **kw, out=view)
    assert_bits_equal(buf[::2], expected, "in place, strided")
    # misaligned output buffer
    outbuf = poison((4098,), dtype)
    fwd(cupy.from_dlpack(xt), **kw, out=cupy.from_dlpack(outbuf)[1:])
    assert_bits_equal(outbuf[1:], expected, "misaligned out")
    assert_bits_equal(outbuf[:1], poison((1,), dtype), "write before out")
    # output overlapping the input by one element
    sh = testing.make_input(4098, dtype, seed=5)
    sh[:4097] = xt
    s = cupy.from_dlpack(sh)
    fwd(s[:4097], **kw, out=s[1:])
    assert_bits_equal(sh[1:], expected, "overlapping out")


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "odd", "nchw_wide", "large"])
def test_bias_bit_exact(layout, dtype):
    # nchw_wide: H*W a multiple of every vector width, so the vector path takes
    # one bias per vector; the others step the channel element by element;
    # large: indices up to 2^24 through the kernel's reciprocal division
    shape = {
        "nchw": (2, 3, 5, 7),
        "channels_last": (4, 16, 9, 11),
        "odd": (3, 5, 1, 33),
        "nchw_wide": (3, 5, 16, 24),
        "large": (2, 7, 1000, 1003),
    }[layout]
    xt = testing.make_input(torch.Size(shape).numel(), dtype, seed=6).view(shape)
    if layout == "channels_last":
        xt = xt.contiguous(memory_format=torch.channels_last)
    bt = testing.make_input(shape[1], dtype, seed=7)
    for slope, divisor in [(0.01, 2.0), (0.3, -0.7)]:
        expected = testing.forward("div_leaky_relu", xt, slope, divisor, bt)
        y = cupy_act.div_leaky_relu(cupy.from_dlpack(xt), divisor, slope, bias=cupy.from_dlpack(bt))
        assert_bits_equal(torch.from_dlpack(y), expected, "bias forward")
        y, m = cupy_act.div_leaky_relu_with_mask(
            cupy.from_dlpack(xt), divisor, slope, bias=cupy.from_dlpack(bt)
        )
        assert_bits_equal(torch.from_dlpack(y), expected, "bias forward with mask")
        check_mask(m, testing.mask_bits("div_leaky_relu", xt, divisor, bt))
        dyt = testing.make_input(xt.numel(), dtype, seed=8).view(shape)
        dx = cupy_act.div_leaky_relu_backward(cupy.from_dlpack(dyt), m, divisor, slope)
        assert_bits_equal(
            torch.from_dlpack(dx),
            testing.backward("div_leaky_relu", xt, dyt, slope, divisor, bt),
            "bias backward",
        )


def test_conv_without_bias_then_fused_pass_matches_conv_with_bias():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 8, 34, 34, device="cuda", generator=g)
    w = torch.randn(64, 8, 3, 3, device="cuda", generator=g) * 0.2
    b = torch.randn(64, device="cuda", generator=g)
    expected = torch.nn.functional.leaky_relu(torch.nn.functional.conv2d(x, w, b) / 2, 0.01)
    pre = torch.nn.functional.conv2d(x, w, None)
    y = cupy_act.div_leaky_relu(cupy.from_dlpack(pre), 2, 0.01, bias=cupy.from_dlpack(b))
    assert_bits_equal(torch.from_dlpack(y), expected, "conv epilogue")


def test_torch_tensors_and_bfloat16_accepted_directly():
    for dtype in testing.DTYPES:
        xt = testing.make_input(1000, dtype, seed=9)
        y = cupy_act.leaky_relu(xt, 0.1)  # CAI, or DLPack for bfloat16
        assert_bits_equal(torch.from_dlpack(y), testing.forward("leaky_relu", xt, 0.1))


def test_empty_input_launches_nothing():
    for op in ("relu", "leaky_relu"):
        fwd, fwd_mask, bwd = fns(op)
        x = cupy.empty((0, 3), dtype=cupy.float32)
        assert fwd(x).shape == (0, 3)
        y, m = fwd_mask(x)
        assert y.shape == (0, 3) and m.shape == (0,)
        assert bwd(x, m).shape == (0, 3)


def test_side_stream_queued_behind_long_kernel():
    """The kernel must run on the current stream, after work queued there."""
    spin = cupy.RawKernel(
        r"""
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {}
    }""",
        "spin",
    )
    n = 1 << 22
    xt = testing.make_input(n, torch.float32, seed=10)
    final = cupy.from_dlpack(xt)
    x = cupy.zeros(n, dtype=cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        spin((1,), (1,), (200_000_000,))  # about 0.1 s
        x[...] = final
        y, m = cupy_act.leaky_relu_with_mask(x, 0.05)
        dx = cupy_act.leaky_relu_backward(x, m, 0.05)
    s.synchronize()
    assert_bits_equal(torch.from_dlpack(y), testing.forward("leaky_relu", xt, 0.05))
    assert_bits_equal(torch.from_dlpack(dx), testing.backward("leaky_relu", xt, xt, 0.05))


def test_more_than_2_pow_31_elements():
    n = 2**31 + 77
    need = n * 2 * 4 + (1 << 30)  # x, y, reference, dx in float16, plus slack
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    xt = torch.empty(n, dtype=torch.float16, device="cuda")
    xt.view(torch.int16).random_(-(2**15), 2**15)
    y, m = cupy_act.div_leaky_relu_with_mask(cupy.from_dlpack(xt), 2.0, 0.1)
    yt = torch.from_dlpack(y)
    assert_bits_equal(yt, torch.nn.functional.leaky_relu(xt / 2.0, 0.1), "huge forward")
    del yt, y
    dx = cupy_act.div_leaky_relu_backward(cupy.from_dlpack(xt), m, 2.0, 0.1)
    t = xt / 2.0
    expected = torch.ops.aten.leaky_relu_backward(xt, t, 0.1, False) / 2.0
    del t
    assert_bits_equal(torch.from_dlpack(dx), expected, "huge backward")


def test_bad_out_mask_and_bias_are_refused():
    x = cupy.from_dlpack(testing.make_input(100, torch.float32))
    with pytest.raises(ValueError, match=r"out has shape \(99,\), expected \(100,\)"):
        cupy_act.relu(x, out=cupy.empty(99, cupy.float32))
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        cupy_act.relu(x, out=cupy.empty(100, cupy.float64))
    with pytest.raises(ValueError, match=r"mask has shape \(13,\), expected \(16,\)"):
        cupy_act.relu_backward(x, cupy.zeros(13, cupy.uint8))
    with pytest.raises(TypeError, match="mask has dtype int32"):
        cupy_act.relu_backward(x, cupy.zeros(4, cupy.int32))
    with pytest.raises(ValueError, match="4-byte boundary"):
        cupy_act.relu_backward(x, cupy.zeros(17, cupy.uint8)[1:])
    with pytest.raises(TypeError, match="x has dtype int32"):
        cupy_act.relu(cupy.zeros(3, cupy.int32))
    with pytest.raises(TypeError, match="x has dtype bool"):
        cupy_act.relu(cupy.zeros(3, cupy.bool_))
    with pytest.raises(TypeError, match="x has dtype complex64"):
        cupy_act.relu(cupy.zeros(3, cupy.complex64))
    x4 = cupy.zeros((2, 3, 4, 4), cupy.float32)
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(3,\)"):
        cupy_act.div_leaky_relu(x4, 2.0, bias=cupy.zeros(4, cupy.float32))
    with pytest.raises(TypeError, match="bias has dtype float16"):
        cupy_act.div_leaky_relu(x4, 2.0, bias=cupy.zeros(3, cupy.float16))
    with pytest.raises(ValueError, match="channel axis"):
        cupy_act.div_leaky_relu(cupy.zeros(5, cupy.float32), 2.0, bias=cupy.zeros(5, cupy.float32))
    with pytest.raises(ValueError, match="out of range for float32"):
        cupy_act.leaky_relu(x, 1e300)
