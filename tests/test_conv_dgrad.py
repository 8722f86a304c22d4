"""The fused convolution block's input gradient (cuda/conv2d_dgrad.cu).

Where x needs a gradient, the backward of ``conv2d_div_leaky_relu``'s fused
algorithms takes it in one pass over dy and the mask for 3 x 3 filters at
stride 1 (``conv.FUSED_DGRAD``), instead of the mask backward (dz written and
read again) and cuDNN's data gradient. It cannot match cuDNN's summation
order, so it is held to a stated accuracy against float64 (``dgrad_bound``)
over random shapes (odd sizes, every padding it takes, several channel
groups and column tiles), both layouts and three dtypes; the same inputs
give the same bits.
"""

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from test_conv import DIVISOR, EPS, FUSED_KINDS, SLOPE, _layout, _xwb  # noqa: E402
from test_conv_wgrad import (  # noqa: E402
    _assert_close,
    _count_calls,
    _forward,
    assert_within,
    block_inputs,
)

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _conv, testing  # noqa: E402
from cupy_act.torch import _impl, _library, conv  # noqa: E402

gpu = pytest.mark.gpu
conv2d_input = torch.nn.grad.conv2d_input


def dgrad_cases(count: int, seed: int = 23):
    """(x shape, w shape, stride, padding, dilation) the kernel takes: 3 x 3,
    stride 1, dilation 1, padding 0-2 per side; odd sizes, batch 1, input
    channels past one group of 8, outputs up to 300 wide (3 column tiles)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        p = (rng.randint(0, 2), rng.randint(0, 2))
        h, w = rng.randint(1, 40), rng.choice([rng.randint(1, 70), rng.randint(120, 300)])
        if h + 2 * p[0] < 3 or w + 2 * p[1] < 3:
            continue
        xs = (rng.choice([1, 1, 2, 3]), rng.randint(1, 19), h, w)
        out.append((xs, (rng.randint(1, 80), xs[1], 3, 3), 1, p, 1))
    return out


CASES = dgrad_cases(32)
# Tall images, more input rows than the device runs blocks: blocks own runs of
# rows that cross images and column tiles; and the column-tile edges.
WIDE_CASES = [
    ((3, 8, 300, 128), (64, 8, 3, 3), 1, 0, 1),
    ((2, 5, 260, 150), (20, 5, 3, 3), 1, 1, 1),
    ((4, 3, 200, 129), (17, 3, 3, 3), 1, (2, 1), 1),
    ((2, 12, 150, 254), (33, 12, 3, 3), 1, 2, 1),
    ((1, 2, 700, 256), (9, 2, 3, 3), 1, (1, 2), 1),
]


# ---- where it applies (anywhere) ----


@pytest.mark.parametrize(
    "xs, ws, stride, padding, dilation, fits",
    [
        ((128, 8, 128, 128), (64, 8, 3, 3), 1, 0, 1, True),  # the seed model
        ((2, 3, 9, 9), (5, 3, 3, 3), 1, 2, 1, True),
        ((2, 3, 9, 9), (5, 3, 3, 3), 1, 3, 1, False),  # padding past kh - 1
        ((2, 3, 9, 9), (5, 3, 3, 3), 2, 1, 1, False),  # stride
        ((2, 3, 9, 9), (5, 3, 3, 3), 1, 1, 2, False),  # dilation
        ((2, 3, 9, 9), (5, 3, 5, 5), 1, 1, 1, False),  # 5 x 5
        ((2, 3, 9, 9), (5, 3, 1, 1), 1, 0, 1, False),  # 1 x 1
        ((1, 3, 9, 9), (1000, 3, 3, 3), 1, 1, 1, False),  # the weights exceed shared memory
    ],
)
def test_dgrad_fits_3x3_stride_1(xs, ws, stride, padding, dilation, fits):
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    assert _conv.dgrad_fits(g, 3) is fits
    if fits:
        assert _conv.dgrad_smem(g, 3) <= _conv.SMEM_MAX


@pytest.mark.parametrize("w", [1, 2, 3, 50, 125, 126, 127, 128, 129, 130, 252, 253, 254, 300, 1000])
@pytest.mark.parametrize("pw", [0, 1, 2])
def test_column_tiles_own_every_input_column_once(w, pw):
    """The kernel's column tiles (conv2d_dgrad.cu's lo / hi, restated here):
    every input column is owned by exactly one tile, and every dz column it
    reads lies in that tile's 128."""
    if w + 2 * pw < 3:
        pytest.skip("no output")
    g = _conv.geometry("f", (1, 1, 3, w), (1, 1, 3, 3), 1, (0, pw))
    tiles = _conv.dgrad_column_tiles(g)
    owner = {}
    for j in range(tiles):
        z0 = j * _conv.DGRAD_STRIDE
        lo = 0 if j == 0 else max(0, z0 + 2 - pw)
        hi = w if j == tiles - 1 else min(w, z0 + _conv.DGRAD_COLS - pw)
        for iw in range(lo, hi):
            assert iw not in owner
            owner[iw] = j
            for s in range(3):
                ow = iw + pw - s
                if 0 <= ow < g.ow:
                    assert z0 <= ow < z0 + _conv.DGRAD_COLS, (iw, j, ow)
    assert sorted(owner) == list(range(w))


@pytest.mark.parametrize(
    "setting, cin, ks, stride, expected",
    [(None, 8, 3, 1, True), (None, 16, 3, 1, False), (True, 16, 3, 1, True),
     (False, 8, 3, 1, False), (None, 8, 3, 2, False), (True, 8, 5, 1, False)],
)  # fmt: skip
def test_fused_input_gradient_switch(setting, cin, ks, stride, expected, monkeypatch):
    """FUSED_DGRAD None (the default) takes the kernel where it fits and one
    group of 8 input channels holds them all (where it measures faster), True
    wherever it fits, False never."""
    assert conv.FUSED_DGRAD is None  # the shipped default
    monkeypatch.setattr(conv, "FUSED_DGRAD", setting)
    x, w = torch.empty(2, cin, 16, 16), torch.empty(16, cin, 3 if ks == 3 else ks, ks)
    assert conv._dgrad_fits(x, w, [stride] * 2, [1, 1], [1, 1], False) is expected


def test_staged_kernel_where_pairs_and_shared_memory_allow():
    """dgrad_staged: 16-bit NCHW (where it measured faster), rows of even
    width (dy's pairs consecutive elements at even offsets) and the stages
    in shared memory; the seed shape's staged kernel keeps 3 blocks per SM
    of an H100 (228 KiB, 1 KiB each reserved); only 16-bit modules have
    staged kernels, NCHW ones."""
    seed = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))
    assert _conv.dgrad_staged(seed, 1, False, 2) and not _conv.dgrad_staged(seed, 1, True, 2)
    assert not _conv.dgrad_staged(seed, 3, False, 4) and not _conv.dgrad_staged(seed, 1, False, 4)
    assert 3 * (_conv.dgrad_smem(seed, 1, 2) + 1024) <= 228 * 1024
    stages = _conv.DGRAD_STAGES * 128 * 4 * (4 + 4)
    assert _conv.dgrad_smem(seed, 1, 2) - _conv.dgrad_smem(seed, 1) == stages
    odd_w = _conv.geometry("f", (1, 3, 9, 11), (6, 3, 3, 3), 1, 0)  # ow 9
    assert not _conv.dgrad_staged(odd_w, 1, False, 2)
    big = _conv.geometry("f", (1, 3, 9, 10), (300, 3, 3, 3), 1, 0)  # fits, but not staged
    assert _conv.dgrad_fits(big, 1) and not _conv.dgrad_staged(big, 1, False, 2)
    for dtype in _conv.DTYPES:
        staged = [n for n in _conv.dgrad_kernel_names(dtype) if n.endswith(", true>")]
        assert all(n.endswith(", false, true>") for n in staged)
        assert len(staged) == (0 if dtype == "float32" else 1)


def test_dgrad_launch_picks_its_kernel_per_call(monkeypatch):
    """launch_dgrad through the prepared launch (fake kernels, no GPU): the
    staged kernel where dgrad_staged allows and dy is pair-aligned, else the
    one by plain loads; both cover every input row with the grid; dx in
    ConvParams' gradient field; DGRAD_STAGED False never stages; an empty
    input launches nothing."""
    from test_conv import _record_launches

    launched = _record_launches(monkeypatch)
    kernels = _conv.DgradKernels(_conv.ConvKernel(1, 7, None), _conv.ConvKernel(2, 7, None))
    monkeypatch.setattr(_conv.dgrad, "dgrad_kernels", lambda *args: kernels)
    monkeypatch.setattr(_conv.dgrad, "_dgrad_launches", {})
    seed = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))

    def go(g, dy, dtype="float32"):
        launched.clear()
        e = _conv.extents(g, dtype)
        _conv.launch_dgrad(
            0, dtype, "fp32", False, g, 5, dy, 32, 48, 64, 0.01, 2.0, "f",
            have=(e.y, e.mask, e.w, e.x),
        )  # fmt: skip
        return launched

    for dtype, dy, ptr in (("float32", 256, 1), ("float16", 260, 2), ("float16", 258, 1)):
        ((got, grid, smem, f, desc),) = go(seed, dy, dtype)
        n_passes = 3 if dtype == "float32" else 1
        assert got == ptr and desc is None
        assert smem == _conv.dgrad_smem(seed, n_passes, 2 if ptr == 2 else 0)
        assert f[:5] == (0, 48, 0, dy, 32)
        rows = seed.n * seed.h  # one column tile
        assert grid[1] == 1 and grid[0] * f[-2] >= rows and (grid[0] - 1) * f[-2] < rows
        assert (
            _conv.kernels._GRAD_ADDRESSES.unpack_from(
                _conv.kernels._scratch.buf, _conv.kernels._GRADS_AT
            )[0]
            == 64
        )
    odd = _conv.geometry("f", (2, 3, 9, 11), (5, 3, 3, 3), 1, 0)  # ow 9
    assert go(odd, 256, "float16")[0][0] == 1
    monkeypatch.setattr(_conv.dgrad, "DGRAD_STAGED", False)
    assert go(seed, 256, "float16")[0][0] == 1
    assert go(_conv.geometry("f", (0, 8, 12, 12), (64, 8, 3, 3)), 256) == []


# ---- GPU ----


def dgrad_bound(dz, w, x_shape, spd, dtype, tf32):
    """The float64 input gradient from dz and a per-element bound on ours.

    Products: 2^-20 relative for the 3xTF32 split (see test_conv.bound),
    2^-10 for TF32 (16-bit values are exact); the float32 sums over cout x 9
    terms add that many units of 2^-24, on the scale of the sum of |dz w|;
    rounding the result to its dtype adds 2 eps of it, or half its subnormal
    spacing where it is that small.
    """
    s, p, d = spd
    wd, dzd = w.double(), dz.double()
    ref = conv2d_input(x_shape, wd, dzd, s, p, d)
    mag = conv2d_input(x_shape, wd.abs(), dzd.abs(), s, p, d)
    terms = w.shape[0] * w.shape[2] * w.shape[3] + 2
    prod = 2.0**-10 if tf32 else 2.0**-20
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps / 2
    return ref, (prod + terms * 2.0**-24) * mag + 2 * EPS[dtype] * ref.abs() + tiny


def _inputs(xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed):
    """x, w, the fused forward's mask and spd, an upstream gradient, dz, tf32."""
    x, w, _, mask, spd, gy, dz = block_inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed, 20_000 + seed
    )
    return x, w, mask, spd, gy, dz, algorithm == "fused_tf32"


def _dgrad(gy, mask, w, x, spd, tf32):
    cl = _impl.is_channels_last(x)
    return conv.fused_dgrad(gy, mask, w, list(x.shape), cl, DIVISOR, SLOPE, *spd, tf32)


def _check_accuracy(xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed):
    x, w, mask, spd, gy, dz, tf32 = _inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed
    )
    gx = _dgrad(gy, mask, w, x, spd, tf32)
    assert gx.shape == x.shape and gx.dtype == dtype and gx.stride() == x.stride()
    assert_within(gx, *dgrad_bound(dz, w, x.shape, spd, dtype, tf32))


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_input_gradient_accuracy(case, dtype, algorithm, cl):
    _check_accuracy(*CASES[case], dtype, algorithm, cl, seed=case)


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(WIDE_CASES)), ids=[f"wide{i}" for i in range(5)])
def test_fused_input_gradient_accuracy_on_tall_and_wide_inputs(case, dtype, algorithm, cl):
    _check_accuracy(*WIDE_CASES[case], dtype, algorithm, cl, seed=200 + case)


def test_wide_cases_split_rows_and_columns():
    """WIDE_CASES exercise what they are for: more input rows than an H100
    runs blocks (132 SMs x 3), and together 1, 2 and 3 column tiles."""
    tiles = set()
    for xs, ws, stride, padding, dilation in WIDE_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        tiles.add(_conv.dgrad_column_tiles(g))
        assert g.n * g.h * _conv.dgrad_column_tiles(g) > 132 * 3
    assert tiles == {1, 2, 3}


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("algorithm", ["fused", "fused_tf32"])
def test_fused_input_gradient_repeats_bit_for_bit(algorithm, cl):
    x, w, mask, spd, gy, _, tf32 = _inputs(
        (6, 9, 90, 140), (40, 9, 3, 3), 1, 1, 1, torch.float32, algorithm, cl, 7
    )
    first = _dgrad(gy, mask, w, x, spd, tf32)
    for _ in range(3):
        testing.assert_bits_equal(_dgrad(gy, mask, w, x, spd, tf32), first)


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_non_finite_values_propagate_as_in_the_reference(cl):
    """A NaN in dy reaches exactly the input positions under its 3 x 3
    window, an inf weight makes its input channel inf or NaN where float64
    does; the finite rest stays within the bound."""
    x, w, mask, spd, gy, dz, _ = _inputs(
        (2, 3, 21, 40), (10, 3, 3, 3), 1, 1, 1, torch.float32, "fused", cl, 3
    )
    gy[1, 7, 3, 5] = float("nan")
    w = w.clone()
    w[2, 1, 0, 2] = float("inf")
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, cl)
    gx = _dgrad(gy, mask, w, x, spd, False)
    ref, tol = dgrad_bound(dz, w, x.shape, spd, torch.float32, False)
    assert torch.equal(gx.isnan(), ref.isnan()) and torch.equal(gx.isinf(), ref.isinf())
    assert gx.isnan().any() and gx.isinf().any()
    finite = ref.isfinite()
    assert ((gx.double() - ref).abs()[finite] <= tol[finite]).all()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(
    "case", [*range(0, len(CASES), 3), "wide0", "wide3", "wide4"], ids=lambda c: f"c{c}"
)
def test_staged_and_plain_loads_give_the_same_bits(case, dtype, monkeypatch):
    """The staged kernel (16-bit NCHW dy by asynchronous copies, the default
    where it applies) and the one by plain loads (DGRAD_STAGED False) form
    the same dz and add it in the same order: the same bits, over odd and
    even widths (where staging does not apply both take plain loads)."""
    shape = WIDE_CASES[int(case[4:])] if isinstance(case, str) else CASES[case]
    x, w, mask, spd, gy, _, tf32 = _inputs(*shape, dtype, "fused", False, 300)
    got = {}
    for staged in (True, False):
        monkeypatch.setattr(_conv.dgrad, "DGRAD_STAGED", staged)
        got[staged] = _dgrad(gy, mask, w, x, spd, tf32)
    assert got[True].isfinite().all()
    testing.assert_bits_equal(got[True], got[False])


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_upstream_gradient_gives_the_same_bits(dtype, cl, offset):
    """dy `offset` elements into its storage, rows of even length (the kernel's
    paired loads then fall back to single elements): the aligned dy's bits."""
    x, w, mask, spd, gy, _, _ = _inputs(
        (3, 5, 19, 38), (12, 5, 3, 3), 1, 1, 1, dtype, "fused", cl, 5
    )
    buf = torch.full((gy.numel() + offset,), float("nan"), device="cuda", dtype=dtype)
    moved = buf.as_strided(gy.shape, gy.stride(), offset)
    moved.copy_(gy)
    assert moved.stride() == gy.stride()
    want = _dgrad(gy, mask, w, x, spd, False)
    assert not want.isnan().any()
    testing.assert_bits_equal(_dgrad(moved, mask, w, x, spd, False), want)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("needs", ["x", "x_and_weight"])
def test_autograd_takes_the_fused_input_gradient(dtype, cl, needs, monkeypatch):
    """Through autograd, x needing a gradient: the fused input gradient by
    default (counted; no mask backward where the weight's kernel applies
    too), within FP32 (bfloat16) accuracy of the previous path (mask
    backward + cuDNN without TF32, switched off)."""
    x0, w0, b0 = _xwb((3, 6, 23, 37), (10, 6, 3, 3), "cuda", dtype)
    x0, w0 = _layout(x0, cl), _layout(w0, cl)
    gy = _layout(torch.randn(3, 10, 23, 37, device="cuda", dtype=dtype), cl)
    dgrads = _count_calls(monkeypatch, conv, "fused_dgrad")
    masks = _count_calls(monkeypatch, _impl, "backward")
    monkeypatch.setattr(conv, "FUSED_WGRAD", True)
    grads = {}
    torch.backends.cudnn.allow_tf32 = False
    try:
        for fused in (None, False):
            monkeypatch.setattr(conv, "FUSED_DGRAD", fused)
            dgrads.clear(), masks.clear()
            x = x0.clone().requires_grad_()
            w = w0.clone().requires_grad_(needs == "x_and_weight")
            ct.conv2d_div_leaky_relu(x, w, b0, DIVISOR, SLOPE, 1, 1, 1, "fused").backward(gy)
            grads[fused] = (x.grad, w.grad)
            assert len(dgrads) == (1 if fused is None else 0)
            assert len(masks) == (0 if fused is None else 1)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    gx = grads[None][0]
    assert gx.dtype == dtype and gx.shape == x0.shape and gx.stride() == x0.stride()
    for ours, ref in zip(grads[None], grads[False]):
        _assert_close(ours, ref, dtype)


@gpu
def test_fused_input_gradient_under_torch_compile_and_opcheck():
    x, w, b = _xwb((2, 3, 16, 16), (8, 3, 3, 3), "cuda")

    def f(x, w, b):
        return ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 1, 1, algorithm="fused")

    compiled = torch.compile(f, fullgraph=True)
    got = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled(*got).square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    f(*ref).square().sum().backward()
    for a, e in zip(got, ref):
        testing.assert_bits_equal(a.grad, e.grad)
    y, mask, spd = _forward(x, w, b, 1, 1, 1, False)
    args = (torch.randn_like(y), mask, w, list(x.shape), False, DIVISOR, SLOPE, *spd, False)
    torch.library.opcheck(conv.dgrad_op, args, test_utils=("test_schema", "test_faketensor"))


@gpu
def test_empty_batch_gives_an_empty_input_gradient():
    x, w, b = _xwb((0, 3, 9, 11), (5, 3, 3, 3), "cuda")
    x.requires_grad_()
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, padding=1, algorithm="fused").sum().backward()
    assert x.grad.shape == x.shape


@gpu
def test_seed_block_input_gradient_within_10x_eager_error():
    """The seed model's layer at a reduced batch, from one forward's mask:
    the input gradient's error against float64 at most 10x that of cuDNN's
    data gradient (no TF32) on the same dz."""
    conv2 = torch.nn.Conv2d(8, 64, 3).cuda()
    w, b = conv2.weight.detach(), conv2.bias.detach()
    x = torch.randn(8, 8, 128, 128, device="cuda")
    y, mask, spd = _forward(x, w, b, 1, 0, 1, False)
    gy = torch.randn_like(y)
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, False)
    ref, _ = dgrad_bound(dz, w, x.shape, spd, torch.float32, False)
    torch.backends.cudnn.allow_tf32 = False
    try:
        eager = conv2d_input(x.shape, w, dz, *spd)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    gx = _dgrad(gy, mask, w, x, spd, False)
    err = (gx.double() - ref).abs().max().item()
    assert err <= 10 * (eager.double() - ref).abs().max().item(), err
