"""The fused convolution block's weight and bias gradients (cuda/conv2d_wgrad.cu).

Where x needs no gradient (a first layer, the seed model), the backward of
``conv2d_div_leaky_relu``'s fused algorithms can be one pass over dy, the
mask and x (``conv.FUSED_WGRAD``: by default where one channel chunk holds
the whole filter depth, and on compute capability 9.0 where up to three or
four do, where it measures faster).
It cannot match cuDNN's summation order, so it is held to a stated accuracy
against float64 (see ``wgrad_bound``) over the forward's 40 random shapes,
both layouts and three dtypes; the same inputs give the same bits.
"""

import ctypes
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

from test_conv import (  # noqa: E402
    CASES,
    DIVISOR,
    EPS,
    FUSED_KINDS,
    GEOMETRIES,
    SLOPE,
    WIDE_CASES,
    _layout,
    _record_launches,
    _xwb,
    negative_only,
)

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _conv, testing  # noqa: E402
from cupy_act.torch import _impl, _library, conv  # noqa: E402

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
conv2d_weight = torch.nn.grad.conv2d_weight


# ---- tiling (anywhere) ----


@pytest.mark.parametrize("n_passes", [1, 3])
@pytest.mark.parametrize("xs, ws, stride, padding, dilation", GEOMETRIES)
def test_wgrad_tiling_fits_shared_memory(xs, ws, stride, padding, dilation, n_passes):
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    t = _conv.wgrad_tiling(g, n_passes)
    assert t is not None and t.smem <= _conv.WGRAD_SMEM
    rows, cols = _conv.TILE_M >> t.c_log2, 1 << t.c_log2
    assert t.tiles_h * rows >= g.oh and t.tiles_w * cols >= g.ow
    assert t.kc_pad % 8 == 0 and t.cc * g.kh * g.kw <= t.kc_pad <= _conv.WGRAD_DEPTH
    if n_passes == 3:
        assert (t.cc + 1) * t.patch_h * t.patch_w <= _conv.PATCH_PART


def test_wgrad_tiling_takes_the_seed_shape_and_refuses_deep_filters():
    seed = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))
    t = _conv.wgrad_tiling(seed, 3)
    assert t is not None and t.cc == 8 and t.kc_pad == 72  # one chunk: dy read once
    nine = _conv.geometry("f", (1, 2, 20, 20), (4, 2, 9, 9))  # depth 81 per channel
    assert _conv.wgrad_tiling(nine, 1) is None and not _conv.wgrad_fits(nine, 1)


@pytest.mark.parametrize(
    "setting, cin, dtype, cl, expected",
    [
        (None, 8, torch.float32, False, True),
        (None, 8, torch.float32, True, True),
        (None, 8, torch.float16, False, True),
        (None, 8, torch.bfloat16, True, False),
        (None, 9, torch.float32, False, False),
        (None, 64, torch.float32, False, False),
        (True, 64, torch.float32, False, True),
        (True, 8, torch.float16, True, True),
        (False, 8, torch.float32, False, False),
    ],
)
def test_fused_weight_gradient_default_where_it_measures_faster(
    setting, cin, dtype, cl, expected, monkeypatch
):
    """FUSED_WGRAD None (the default) takes the kernel where one chunk holds
    the filter depth (cin * 9 <= 72: dy read once), but not for 16-bit
    channels-last (cuDNN is faster there); True wherever it fits, False never."""
    assert conv.FUSED_WGRAD is None  # the shipped default
    monkeypatch.setattr(conv, "FUSED_WGRAD", setting)
    x, w = torch.empty(2, cin, 16, 16, dtype=dtype), torch.empty(16, cin, 3, 3, dtype=dtype)
    x = _layout(x, cl)
    assert conv._wgrad_fits(x, w, [1, 1], [1, 1], [1, 1], False) is expected
    g = _conv.geometry("f", x.shape, w.shape, 1, 1)
    assert _conv.wgrad_chunks(g, 3) == (1 if cin <= 8 else 2 if cin < 64 else 8)


@pytest.mark.parametrize(
    "chunks, n_passes, float32, cl, sm, expected",
    [
        (1, 3, True, False, 80, True),
        (2, 3, True, False, 80, False),
        (1, 1, False, True, 90, False),  # 16-bit channels-last: cuDNN's
        (2, 3, True, True, 90, False),
        (3, 3, True, False, 90, True),
        (4, 3, True, False, 90, False),
        (4, 1, True, False, 90, True),
        (4, 1, False, False, 90, True),
        (5, 1, False, False, 90, False),
        (8, 3, True, False, 90, False),
    ],
)
def test_fused_weight_gradient_default_by_chunks_and_device(
    chunks, n_passes, float32, cl, sm, expected
):
    """The default's rule: one chunk (NCHW, or float32 channels-last); on
    compute capability 9.0, NCHW, up to three chunks with three passes and
    four with one (where they measured faster on an H200)."""
    assert conv._wgrad_default(chunks, n_passes, float32, cl, sm) is expected


# ---- GPU ----


def _forward(x, w, b, stride, padding, dilation, tf32):
    s, p, d = (list(_conv.pair(v, n, "f", lo)) for v, n, lo in
               ((stride, "s", 1), (padding, "p", 0), (dilation, "d", 1)))  # fmt: skip
    y, mask = conv.fused_forward(x, w, b, DIVISOR, SLOPE, s, p, d, tf32, True)
    return y, mask, (s, p, d)


def wgrad_bound(x, dz, w_shape, spd, dtype, tf32):
    """References and per-element bounds for gw and gb from dz (float64).

    Products: 2^-20 relative for the 3xTF32 split (see test_conv.bound),
    2^-10 for TF32 (16-bit inputs are exact); the float32 sums over at most
    N x OH x OW positions add that many units of 2^-24, on the scale of the
    sum of |x dz|; rounding the result to its dtype adds 2 eps of it, or half
    its subnormal spacing where it is that small (float16 gradients near 1e-6
    do occur).
    """
    s, p, d = spd
    xd, dzd = x.double(), dz.double()
    gw = conv2d_weight(xd, w_shape, dzd, s, p, d)
    mag_w = conv2d_weight(xd.abs(), w_shape, dzd.abs(), s, p, d)
    gb, mag_b = dzd.sum((0, 2, 3)), dzd.abs().sum((0, 2, 3))
    terms = dz.shape[0] * dz.shape[2] * dz.shape[3] + 2
    prod = 2.0**-10 if tf32 else 2.0**-20
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps / 2  # half the subnormal spacing
    tol_w = (prod + terms * 2.0**-24) * mag_w + 2 * EPS[dtype] * gw.abs() + tiny
    tol_b = terms * 2.0**-24 * mag_b + 2 * EPS[dtype] * gb.abs() + tiny
    return (gw, tol_w), (gb, tol_b)


def block_inputs(xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed, gy_seed):
    """x, w, b (seeded), the fused forward's mask and (stride, padding,
    dilation), an upstream gradient from generator seed ``gy_seed`` and dz
    (the mask backward), for the gradient kernels' accuracy tests."""
    tf32 = algorithm == "fused_tf32"
    x, w, b = _xwb(xs, ws, "cuda", dtype, seed=seed)
    x, w = _layout(x, cl), _layout(w, cl)
    y, mask, spd = _forward(x, w, b, stride, padding, dilation, tf32)
    # gy from its own stream (not the order of the tests; not _xwb's, whose
    # values it would repeat: x and dy correlated, sums past float16's range)
    g = torch.Generator(y.device).manual_seed(gy_seed)
    gy = _layout(torch.randn(y.shape, generator=g, device=y.device, dtype=dtype), cl)
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, _impl.is_channels_last(y))
    return x, w, b, mask, spd, gy, dz


def _check_accuracy(xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed):
    tf32 = algorithm == "fused_tf32"
    x, w, b, mask, spd, gy, dz = block_inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, cl, seed, 10_000 + seed
    )
    gw, gb = conv.fused_wgrad(x, gy, mask, list(w.shape), True, DIVISOR, SLOPE, *spd, tf32)
    assert gw.shape == w.shape and gw.dtype == dtype and gb.shape == b.shape
    for ours, (ref, tol) in zip((gw, gb), wgrad_bound(x, dz, w.shape, spd, dtype, tf32)):
        assert_within(ours, ref, tol)


def assert_within(ours, ref, tol):
    """|ours - ref| <= tol everywhere; the message names the worst element."""
    ratio = (ours.double() - ref).abs() / tol
    i = int(ratio.argmax())
    worst = ratio.flatten()[i].item()
    got, want = ours.flatten()[i].item(), ref.flatten()[i].item()
    assert worst <= 1.0, f"{got!r} against {want!r}: {worst:.2f}x the bound"


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_weight_gradient_accuracy(case, dtype, algorithm, cl):
    _check_accuracy(*CASES[case], dtype, algorithm, cl, seed=case)


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(WIDE_CASES)), ids=[f"wide{i}" for i in range(6)])
def test_fused_weight_gradient_accuracy_on_wide_outputs(case, dtype, algorithm, cl):
    _check_accuracy(*WIDE_CASES[case], dtype, algorithm, cl, seed=100 + case)


def test_wide_cases_walk_runs_of_one_row_tiles():
    """WIDE_CASES exercise what they are for (on an H100's 132 SMs)."""
    for xs, ws, stride, padding, dilation in WIDE_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        t = _conv.wgrad_tiling(g, 3)
        assert t is not None and t.c_log2 == 7
        columns = -(-g.cout // _conv.TILE_N) * _conv.wgrad_chunks(g, 3)
        assert g.n * t.tiles_h * t.tiles_w > 2 * 132 * 3 // columns


# Shapes the bulk-copy path takes (sm_90, NCHW, a tile's positions in each
# channel one run of dy from an even element): the seed's 126-wide rows (runs
# not 16-byte aligned), planes whose lines start at different offsets (98 x
# 7: float32 runs 8 bytes in on every other line, mask bits anywhere in a
# word), a short last tile (202 = 128 + 74 columns), two column tiles of
# 256, two and four rows per tile (C = ow = 64, 32), stride 2, dilation,
# 70 output channels (a second column tile of 6 lines), two chunks, batch 1,
# and more tiles than the device runs blocks at once.
BULK_CASES = [
    ((2, 8, 16, 128), (64, 8, 3, 3), 1, 0, 1),
    ((3, 3, 9, 100), (10, 3, 3, 3), 1, 0, 1),
    ((2, 12, 8, 202), (20, 12, 3, 3), 1, 1, 1),
    ((1, 3, 6, 256), (70, 3, 3, 3), 1, 1, 1),
    ((3, 5, 34, 66), (16, 5, 3, 3), 1, 0, 1),
    ((2, 2, 64, 64), (9, 2, 3, 3), 2, 1, 1),
    ((2, 4, 34, 34), (12, 4, 3, 3), 1, 1, 2),
    ((20, 6, 66, 130), (33, 6, 3, 3), 1, 0, 1),
]


def test_bulk_cases_take_the_bulk_path_and_others_do_not():
    """wgrad_bulk accepts BULK_CASES on sm_90 and later for float32, NCHW
    only; not sm_80, not odd output widths (runs from odd elements), not 2
    rows of a 128-wide output per tile, not a 16-bit dy of 41160 bytes (the
    last run's 16-byte unit would reach past it)."""
    for xs, ws, stride, padding, dilation in BULK_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes in (1, 3):
            t = _conv.wgrad_tiling(g, n_passes)
            assert _conv.wgrad_bulk(g, t, False, 90, 4) and _conv.wgrad_bulk(g, t, False, 120, 4)
            assert not _conv.wgrad_bulk(g, t, False, 89, 4)
            assert not _conv.wgrad_bulk(g, t, True, 90, 4)
            assert _conv.wgrad_bulk_smem("float32", t) <= _conv.WGRAD_SMEM
    g = _conv.geometry("f", (3, 3, 9, 100), (10, 3, 3, 3))  # 3 x 10 x 7 x 98 elements
    t = _conv.wgrad_tiling(g, 1)
    assert not _conv.wgrad_bulk(g, t, False, 90, 2)
    odd = _conv.geometry("f", (1, 3, 5, 103), (8, 3, 3, 3))  # 101 columns
    assert not _conv.wgrad_bulk(odd, _conv.wgrad_tiling(odd, 3), False, 90, 4)
    g = _conv.geometry("f", (1, 3, 4, 130), (8, 3, 3, 3))
    half = _conv.wgrad_tiling(g, 3)._replace(c_log2=6)  # 2 x 64 of a 128-wide output
    assert not _conv.wgrad_bulk(g, half, False, 90, 4)


# BULK_CASES whose dy planes are not a whole number of 16-byte units apart
# (no tensor map: the per-line bulk copies): the seed's 14 x 126 in 16-bit,
# 7 x 98 in every dtype.
NO_TMAP = {(0, 2), (1, 2), (1, 4)}


def test_tensor_copies_take_planes_16_bytes_apart(monkeypatch):
    """wgrad_tmap: the bulk path's shapes whose dy planes are 16-byte units
    apart, only where the driver encodes tensor maps; their shared memory
    fits three blocks per SM."""
    monkeypatch.setattr(_conv._tensormap, "available", lambda: True)
    for case, (xs, ws, stride, padding, dilation) in enumerate(BULK_CASES):
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for itemsize, dtype in ((4, "float32"), (2, "float16")):
            t = _conv.wgrad_tiling(g, 3 if itemsize == 4 else 1)
            want = (case, itemsize) not in NO_TMAP
            assert _conv.wgrad_tmap(g, t, False, 90, itemsize) == want, (case, itemsize)
            assert not _conv.wgrad_tmap(g, t, False, 80, itemsize)
            assert not _conv.wgrad_tmap(g, t, True, 90, itemsize)
            smem = _conv.wgrad_bulk_smem(dtype, t, tmap=True)
            assert smem <= _conv.WGRAD_SMEM
            # the per-line copies' rows, from a 128-byte boundary on
            assert smem == _conv.wgrad_bulk_smem(dtype, t) + 128
    monkeypatch.setattr(_conv._tensormap, "available", lambda: False)
    g = _conv.geometry("f", *BULK_CASES[0][:2])
    assert not _conv.wgrad_tmap(g, _conv.wgrad_tiling(g, 3), False, 90, 4)


def test_tiled_map_encodes_what_the_kernel_copies(monkeypatch):
    """_dy_map's descriptor: dy as (plane, channels, images) with byte strides,
    boxes of TILE_M + 8 positions (the per-line copies' rows) in TILE_N
    channels, unswizzled, bits as unsigned integers; encoded into a 64-byte
    aligned buffer, once per address; a driver error and a missing driver
    raise with the address."""
    from cupy_act import _tensormap

    calls = []

    def fake(at, dtype, rank, address, dims, strides, box, steps, inter, swizzle, l2, fill):
        calls.append((at, dtype, rank, address, list(dims)[:rank], list(strides)[: rank - 1],
                      list(box)[:rank], list(steps)[:rank], inter, swizzle, fill))  # fmt: skip
        return 0 if address != 0xBAD0 else 1

    monkeypatch.setattr(_tensormap, "_function", lambda: fake)
    g = _conv.geometry("f", (128, 8, 130, 130), (64, 8, 3, 3))
    for itemsize, code in ((4, 2), (2, 1)):
        calls.clear()
        m = _conv.wgrad._dy_map(g, itemsize)
        buf, at = m.at(0x7F0000001000)
        assert at % 64 == 0 and ctypes.addressof(buf) <= at <= ctypes.addressof(buf) + 64
        assert m.at(0x7F0000001000)[1] == at and len(calls) == 1  # the same address: reused
        plane = 128 * 128
        assert calls[0][1:] == (
            code, 3, 0x7F0000001000, [plane, 64, 128], [plane * itemsize, plane * itemsize * 64],
            [136, 64, 1], [1, 1, 1], 0, _tensormap.SWIZZLE_NONE, 0,
        )  # fmt: skip
        assert m.at(0x7F0000002000)[1] != at and len(calls) == 2
    with pytest.raises(RuntimeError, match="CUresult 1.*0xbad0"):
        m.at(0xBAD0)
    with pytest.raises(ValueError, match="multiples of 16"):
        _tensormap.TiledMap(2, (15876, 64, 128), (31752, 31752 * 64), (64, 64, 1))
    with pytest.raises(ValueError, match="3 dims need 2 strides"):
        _tensormap.TiledMap(4, (16, 64, 128), (64,), (32, 64, 1))
    monkeypatch.setattr(_tensormap, "_function", lambda: None)
    with pytest.raises(RuntimeError, match="no cuTensorMapEncodeTiled"):
        _conv.wgrad._dy_map(g, 4).at(0x7F0000001000)


@gpu
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(BULK_CASES)), ids=[f"bulk{i}" for i in range(8)])
def test_tensor_copies_match_the_bulk_copies_bit_for_bit(case, dtype, algorithm, monkeypatch):
    """Where dy comes by tensor copies (on sm_90 with a driver that encodes
    tensor maps), the same splits as the per-line bulk copies and the same
    bits."""
    xs, ws, stride, padding, dilation = BULK_CASES[case]
    tf32 = algorithm == "fused_tf32"
    x, w, b, mask, spd, gy, dz = block_inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, False, 500 + case, 600 + case
    )
    g = _conv.geometry("f", xs, ws, *spd)
    name, precision = _impl.DTYPE_NAMES[dtype], "tf32" if tf32 else "fp32"
    plan = _conv.wgrad_plan(x.get_device(), name, precision, False, g)
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("no bulk copies before compute capability 9.0")
    assert (plan.tmap_smem > 0) == ((case, x.element_size()) not in NO_TMAP)
    assert (plan.dy_map is not None) == (plan.tmap_smem > 0)
    args = (list(w.shape), True, DIVISOR, SLOPE, *spd, tf32)
    tensor = conv.fused_wgrad(x, gy, mask, *args)
    monkeypatch.setattr(_conv.wgrad, "_wgrad_plans", {})
    monkeypatch.setattr(_conv._tensormap, "available", lambda: False)
    bulk = _conv.wgrad_plan(x.get_device(), name, precision, False, g)
    assert bulk.tmap_smem == 0 and bulk.bulk_smem == plan.bulk_smem and bulk.splits == plan.splits
    for a, e in zip(conv.fused_wgrad(x, gy, mask, *args), tensor):
        testing.assert_bits_equal(a, e)


@gpu
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(BULK_CASES)), ids=[f"bulk{i}" for i in range(8)])
def test_bulk_copy_path_accuracy_and_bits(case, dtype, algorithm):
    """The bulk-copy path (where the device has it) within the float64 bound,
    and bit for bit the register path's result (dy moved off 16-byte
    alignment takes that path: the same splits in the same order)."""
    xs, ws, stride, padding, dilation = BULK_CASES[case]
    tf32 = algorithm == "fused_tf32"
    x, w, b, mask, spd, gy, dz = block_inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, False, 300 + case, 400 + case
    )
    g = _conv.geometry("f", xs, ws, *spd)
    plan = _conv.wgrad_plan(x.get_device(), _impl.DTYPE_NAMES[dtype], "tf32" if tf32 else "fp32",
                            False, g)  # fmt: skip
    major, minor = torch.cuda.get_device_capability()
    bulk = _conv.wgrad_bulk(g, plan.tiling, False, 10 * major + minor, x.element_size())
    assert (plan.bulk_smem > 0) == bulk
    assert bulk or major < 9 or (case == 1 and dtype != torch.float32)
    args = (list(w.shape), True, DIVISOR, SLOPE, *spd, tf32)
    gw, gb = conv.fused_wgrad(x, gy, mask, *args)
    for ours, (ref, tol) in zip((gw, gb), wgrad_bound(x, dz, w.shape, spd, dtype, tf32)):
        assert_within(ours, ref, tol)
    buf = torch.full((gy.numel() + 1,), float("nan"), device="cuda", dtype=dtype)
    moved = buf[1:].view(gy.shape)
    moved.copy_(gy)
    assert moved.data_ptr() % 16 != 0
    for a, e in zip(conv.fused_wgrad(x, moved, mask, *args), (gw, gb)):
        testing.assert_bits_equal(a, e)


# Shapes the sm_90a kernel on warpgroup MMAs takes (3 x 3, stride 1, one-row
# tiles): the seed's 126-wide rows, padding 1 and 2, 3 and 7 channels per
# chunk (19 input channels: 7 + 7 + 5), one input channel, 80 output
# channels (a second column tile of 16), three column tiles (262 = 128 + 128
# + 6), a one-row output, odd widths (131, 99: dy by plain loads only), more
# tiles than the device runs blocks at once (runs across images).
WG_CASES = [
    ((2, 8, 16, 128), (64, 8, 3, 3), 1, 0, 1),
    ((3, 3, 9, 100), (10, 3, 3, 3), 1, 1, 1),
    ((1, 19, 5, 260), (80, 19, 3, 3), 1, 2, 1),
    ((2, 1, 3, 67), (1, 1, 3, 3), 1, 0, 1),
    ((4, 5, 40, 131), (33, 5, 3, 3), 1, 1, 1),
    ((20, 6, 66, 130), (33, 6, 3, 3), 1, 0, 1),
    ((2, 16, 7, 97), (64, 16, 3, 3), 1, 2, 1),
]


def test_wgrad_launch_picks_its_kernel_per_call(monkeypatch):
    """_conv.launch_wgrad through the prepared launch (fake kernels, no GPU),
    at the seed shape on compute capability 9.0 (the warpgroup kernel): dy
    by tensor copies (its map the second parameter) where dy and the mask
    are 16-byte aligned, else by plain loads; by bulk copies where the
    driver encodes no maps; the final sum with or without the bias's row;
    no positions: only the final sum, over zero splits."""
    launched = _record_launches(monkeypatch)
    k = [_conv.ConvKernel(p, 7, None) for p in range(10, 17)]
    kernels = _conv.WgradKernels(k[0], k[1], k[2], k[3], (k[4], k[5], k[6]))
    monkeypatch.setattr(_conv.wgrad, "wgrad_kernels", lambda *args: kernels)
    g = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))

    def go(g, dy, mask, gb, cl=False):
        launched.clear()
        run = _conv.wgrad_launch(0, "float32", "fp32", cl, g)
        e = _conv.extents(g, "float32")
        have = (e.x, e.y, e.mask, e.w, e.bias, 4 * run.plan.part_floats)
        _conv.launch_wgrad(run, 5, 16, dy, mask, 48, gb, 80, 0.01, 2.0, "f", have=have)
        return run, [(ptr, grid, desc) for ptr, grid, smem, f, desc in launched], launched

    run, got, raw = go(g, 256, 512, 64)
    outputs = 64 * (72 + 1)
    assert got == [(16, run.plan.grid, 0xD0), (13, (-(-outputs // 32), 1), None)]
    f = raw[0][3]
    assert f[0] == 16 and f[3:5] == (256, 512) and f[31:34] == (48, 64, 80)
    assert f[34:] == (run.plan.tiles_per_split, run.plan.splits)
    assert [p for p, *_ in go(g, 264, 512, 0)[1]] == [14, 13]
    assert go(g, 264, 512, 0)[1][1][1] == (-(-64 * 72 // 32), 1)  # no bias row
    assert [p for p, *_ in go(g, 256, 520, 64)[1]] == [14, 13]
    monkeypatch.setattr(_conv.wgrad, "_wgrad_plans", {})
    monkeypatch.setattr(_conv._tensormap, "available", lambda: False)
    assert [(p, d) for p, _, d in go(g, 256, 512, 64)[1]] == [(15, None), (13, None)]
    empty = _conv.geometry("f", (0, 8, 128, 128), (64, 8, 3, 3))
    run, got, raw = go(empty, 256, 512, 64)
    assert [p for p, *_ in got] == [13] and raw[0][3][-1] == 0


def test_warpgroup_kernel_takes_3x3_unit_stride_one_row_tiles():
    """wgrad_wgmma: WG_CASES on compute capability 9.0 only (sm_90a), NCHW
    only; not stride 2, dilation 2, 5 x 5 filters or two rows per tile. Its
    shared memory leaves 2 blocks per SM with three passes, 3 with one and 4
    for 16-bit inputs (228 KiB, 1 KiB reserved per block)."""
    for xs, ws, stride, padding, dilation in WG_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes in (1, 3):
            t = _conv.wgrad_tiling(g, n_passes)
            assert _conv.wgrad_wgmma(g, t, False, 90), xs
            assert not any(_conv.wgrad_wgmma(g, t, False, sm) for sm in (80, 89, 100, 120))
            assert not _conv.wgrad_wgmma(g, t, True, 90)
    five = ((2, 4, 20, 140), (8, 4, 5, 5), 1, 2, 1)
    for xs, ws, stride, padding, dilation in (*BULK_CASES[4:7], five):
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        assert not _conv.wgrad_wgmma(g, _conv.wgrad_tiling(g, 3), False, 90), xs
    for dtype, n_passes, blocks in (("float32", 3, 2), ("float32", 1, 3), ("float16", 1, 4)):
        smem = _conv.wgrad_wg_smem(dtype, n_passes)
        assert blocks * (smem + 1024) <= 228 * 1024 < (blocks + 1) * (smem + 1024)


@gpu
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(WG_CASES)), ids=[f"wg{i}" for i in range(7)])
def test_warpgroup_kernel_accuracy_and_the_same_bits_every_way(case, dtype, algorithm, monkeypatch):
    """On compute capability 9.0 the weight gradient of WG_CASES runs on
    warpgroup MMAs: within the float64 bound, and the same bits whether dy
    comes by tensor copies, by bulk copies per line (no tensor maps) or by
    plain loads (dy moved off 16-byte alignment)."""
    xs, ws, stride, padding, dilation = WG_CASES[case]
    tf32 = algorithm == "fused_tf32"
    x, w, b, mask, spd, gy, dz = block_inputs(
        xs, ws, stride, padding, dilation, dtype, algorithm, False, 700 + case, 800 + case
    )
    g = _conv.geometry("f", xs, ws, *spd)
    name, precision = _impl.DTYPE_NAMES[dtype], "tf32" if tf32 else "fp32"
    plan = _conv.wgrad_plan(x.get_device(), name, precision, False, g)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMAs on compute capability 9.0 only")
    assert plan.wg_smem == _conv.wgrad_wg_smem(name, plan.n_passes)
    args = (list(w.shape), True, DIVISOR, SLOPE, *spd, tf32)
    gw, gb = conv.fused_wgrad(x, gy, mask, *args)
    for ours, (ref, tol) in zip((gw, gb), wgrad_bound(x, dz, w.shape, spd, dtype, tf32)):
        assert_within(ours, ref, tol)
    buf = torch.full((gy.numel() + 1,), float("nan"), device="cuda", dtype=dtype)
    moved = buf[1:].view(gy.shape)
    moved.copy_(gy)
    for a, e in zip(conv.fused_wgrad(x, moved, mask, *args), (gw, gb)):
        testing.assert_bits_equal(a, e)
    monkeypatch.setattr(_conv.wgrad, "_wgrad_plans", {})
    monkeypatch.setattr(_conv._tensormap, "available", lambda: False)
    assert _conv.wgrad_plan(x.get_device(), name, precision, False, g).dy_map is None
    for a, e in zip(conv.fused_wgrad(x, gy, mask, *args), (gw, gb)):
        testing.assert_bits_equal(a, e)


@gpu
@pytest.mark.parametrize("algorithm", ["fused", "fused_tf32"])
def test_warpgroup_kernel_non_finite_values_as_in_the_reference(algorithm):
    """The warpgroup kernel (98-wide rows: 30 positions of the tile past the
    edge, whose operands are zeroed) with an inf in x and a NaN in dy: NaN
    and inf where float64 has them, the finite values within the bound."""
    x, w, b = _xwb((2, 3, 21, 100), (70, 3, 3, 3), "cuda")
    x[0, 1, 5, 40] = float("inf")
    x[1, 2, 7, 99] = float("-inf")  # read by columns 97 (s = 2) and 98 (past the edge, s = 1)
    tf32 = algorithm == "fused_tf32"
    y, mask, spd = _forward(x, w, b, 1, 0, 1, tf32)
    gy = torch.randn_like(y)
    gy[1, 7, 3, 5] = float("nan")
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, False)
    gw, gb = conv.fused_wgrad(x, gy, mask, list(w.shape), True, DIVISOR, SLOPE, *spd, tf32)
    (rw, tol_w), (rb, _) = wgrad_bound(x, dz, w.shape, spd, torch.float32, tf32)
    assert rw.isinf().any() and rw.isnan().any()
    for ours, ref in ((gw, rw), (gb, rb)):
        assert torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours.isinf(), ref.isinf())
    assert torch.equal(gw.isinf() & (gw > 0), rw.isinf() & (rw > 0))  # the same signs
    finite = rw.isfinite()
    assert ((gw.double() - rw).abs()[finite] <= tol_w[finite]).all()


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("algorithm", ["fused", "fused_tf32"])
def test_fused_weight_gradient_repeats_bit_for_bit(algorithm, cl):
    """Many splits (one wave of blocks over 640 tiles), two runs, the same bits."""
    x, w, b = _xwb((10, 8, 64, 130), (40, 8, 3, 3), "cuda")
    x, w = _layout(x, cl), _layout(w, cl)
    y, mask, spd = _forward(x, w, b, 1, 1, 1, algorithm == "fused_tf32")
    gy = torch.randn_like(y)
    args = (x, gy, mask, list(w.shape), True, DIVISOR, SLOPE, *spd, algorithm == "fused_tf32")
    first = conv.fused_wgrad(*args)
    for _ in range(3):
        for a, e in zip(conv.fused_wgrad(*args), first):
            testing.assert_bits_equal(a, e)


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_non_finite_values_propagate_as_in_the_reference(cl):
    """An inf in x that only positions past the output's edge would read
    (stride 2 leaves column 127 unread) changes nothing; a NaN in dy makes
    its channel's gradients NaN, as in float64."""
    x, w, b = _xwb((2, 3, 21, 128), (70, 3, 3, 3), "cuda")
    x[:, :, 5, 127] = float("inf")
    x = _layout(x, cl)
    y, mask, spd = _forward(x, w, b, 2, 0, 1, False)
    assert y.shape[3] == 63  # 63 of a 64-column tile: one column past the edge
    gy = torch.randn_like(y)
    gy[1, 7, 3, 5] = float("nan")
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, _impl.is_channels_last(y))
    gw, gb = conv.fused_wgrad(x, gy, mask, list(w.shape), True, DIVISOR, SLOPE, *spd, False)
    (rw, tol_w), (rb, _) = wgrad_bound(x, dz, w.shape, spd, torch.float32, False)
    assert torch.equal(gw.isnan(), rw.isnan()) and torch.equal(gb.isnan(), rb.isnan())
    assert gw.isnan().sum() == w[7].numel() and not gw.isinf().any()
    finite = ~rw.isnan()
    assert ((gw.double() - rw).abs()[finite] <= tol_w[finite]).all()


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_upstream_gradient_gives_the_same_bits(dtype, cl, offset):
    """dy `offset` elements into its storage (not 16-byte aligned), rows of
    odd length (35 columns, 12 channels): the kernel reads it element by
    element where vectors do not line up; the result is the aligned dy's,
    bit for bit."""
    x, w, b = _xwb((3, 5, 19, 37), (12, 5, 3, 3), "cuda", dtype)
    x, w = _layout(x, cl), _layout(w, cl)
    y, mask, spd = _forward(x, w, b, 1, 0, 1, False)
    gy = _layout(torch.randn(y.shape, device="cuda", dtype=dtype), cl)
    buf = torch.full((gy.numel() + offset,), float("nan"), device="cuda", dtype=dtype)
    moved = buf.as_strided(gy.shape, gy.stride(), offset)
    moved.copy_(gy)
    assert moved.data_ptr() % 16 != 0 and moved.stride() == gy.stride()
    args = (list(w.shape), True, DIVISOR, SLOPE, *spd, False)
    got, want = conv.fused_wgrad(x, moved, mask, *args), conv.fused_wgrad(x, gy, mask, *args)
    assert not want[0].isnan().any()
    for a, e in zip(got, want):
        testing.assert_bits_equal(a, e)


def _block_inputs(dtype, cl):
    """x, weight, bias and an upstream gradient for the autograd tests."""
    x, w, b = _xwb((3, 6, 23, 37), (10, 6, 3, 3), "cuda", dtype)
    gy = torch.randn(3, 10, 12, 19, device="cuda", dtype=dtype)
    return _layout(x, cl), _layout(w, cl), b, gy


def _count_calls(monkeypatch, module, name) -> list:
    """Wraps module.name so that each call appends to the returned list."""
    calls: list = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or fn(*a))
    return calls


def _assert_close(ours, ref, dtype):
    """Relative to the norm: FP32 accuracy, bfloat16's for bfloat16."""
    assert (ours is None) == (ref is None)
    if ref is not None:
        rel = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel <= (1e-5 if dtype == torch.float32 else 1e-2), rel


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("needs", ["weight_and_bias", "weight", "bias"])
@pytest.mark.parametrize("upstream", ["all", "negative"])
def test_autograd_without_an_input_gradient_takes_the_fused_pass(
    dtype, cl, needs, upstream, monkeypatch
):
    """Through autograd, x needing no gradient: the fused weight gradient, not
    the mask backward (counted), switched on and by default (one chunk: 6 x 9
    <= 72; not 16-bit channels-last), within FP32 (bfloat16) accuracy of the
    previous path (mask backward + PyTorch's convolution backward, switched
    off). ``negative``: dy only where the output is negative, so that the
    whole gradient goes through the slope (a wrong one cannot hide in the norm)."""
    x0, w0, b0, gy = _block_inputs(dtype, cl)
    if upstream == "negative":
        gy = negative_only(gy, x0, w0, b0, 2, 1)
    calls = _count_calls(monkeypatch, _impl, "backward")
    grads = {}
    torch.backends.cudnn.allow_tf32 = False
    try:
        for fused in (None, True, False):
            monkeypatch.setattr(conv, "FUSED_WGRAD", fused)
            calls.clear()
            w = w0.clone().requires_grad_(needs != "bias")
            b = b0.clone().requires_grad_(needs != "weight")
            ct.conv2d_div_leaky_relu(x0, w, b, DIVISOR, SLOPE, 2, 1, 1, "fused").backward(gy)
            grads[fused] = (w.grad, b.grad)
            kernel = fused or (fused is None and (dtype == torch.float32 or not cl))
            assert len(calls) == (0 if kernel else 1)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    if dtype == torch.float32 or not cl:  # the default took the kernel: its bits
        for default, forced in zip(grads[None], grads[True]):
            if default is not None:
                testing.assert_bits_equal(default, forced)
    for ours, ref in zip(grads[True], grads[False]):
        _assert_close(ours, ref, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_autograd_with_an_input_gradient_takes_the_kernel_for_the_weight(dtype, cl, monkeypatch):
    """x needing a gradient too: the weight and bias gradients from the kernel
    (counted), the input gradient from dz and cuDNN as before; switched off,
    the previous path; all three within FP32 (bfloat16) accuracy of it."""
    x0, w0, b0, gy = _block_inputs(dtype, cl)
    calls = _count_calls(monkeypatch, conv, "fused_wgrad")
    grads = {}
    torch.backends.cudnn.allow_tf32 = False
    try:
        for fused in (True, False):
            monkeypatch.setattr(conv, "FUSED_WGRAD", fused)
            calls.clear()
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 2, 1, 1, "fused").backward(gy)
            grads[fused] = (x.grad, w.grad, b.grad)
            assert len(calls) == (1 if fused else 0)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    for ours, ref in zip(grads[True], grads[False]):
        assert ours.dtype == dtype and ours.shape == ref.shape
        _assert_close(ours, ref, dtype)


@pytest.fixture
def fused_wgrad(monkeypatch):
    """The fused weight gradient switched on wherever it fits (by default only
    where one chunk holds the filter depth)."""
    monkeypatch.setattr(conv, "FUSED_WGRAD", True)


@gpu
def test_fused_weight_gradient_under_torch_compile_and_opcheck(fused_wgrad):
    x, w, b = _xwb((2, 3, 16, 16), (8, 3, 3, 3), "cuda")

    def f(x, w, b):
        return ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 1, 1, algorithm="fused")

    compiled = torch.compile(f, fullgraph=True)
    got = [t.clone().requires_grad_(t is not x) for t in (x, w, b)]
    compiled(*got).square().sum().backward()
    ref = [t.clone().requires_grad_(t is not x) for t in (x, w, b)]
    f(*ref).square().sum().backward()
    for a, e in zip(got[1:], ref[1:]):
        testing.assert_bits_equal(a.grad, e.grad)
    y, mask, spd = _forward(x, w, b, 1, 1, 1, False)
    args = (x, torch.randn_like(y), mask, list(w.shape), True, DIVISOR, SLOPE, *spd, False)
    torch.library.opcheck(conv.wgrad_op, args, test_utils=("test_schema", "test_faketensor"))


@gpu
def test_empty_batch_gives_zero_gradients(fused_wgrad):
    x, w, b = _xwb((0, 3, 9, 11), (5, 3, 3, 3), "cuda")
    w.requires_grad_(), b.requires_grad_()
    w.grad = None
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused").sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@gpu
def test_seed_block_gradient_within_10x_eager_error():
    """The seed model's layer at a reduced batch (many tiles per split), from
    one forward's mask: the weight and bias gradients' error against float64
    at most 10x that of PyTorch's convolution backward (cuDNN, no TF32) on the
    same dz. (Gradients from two forwards' masks would differ wherever an
    output within rounding of 0 changed sign.)"""
    conv2 = torch.nn.Conv2d(8, 64, 3).cuda()
    w, b = conv2.weight.detach(), conv2.bias.detach()
    x = torch.randn(8, 8, 128, 128, device="cuda")
    y, mask, spd = _forward(x, w, b, 1, 0, 1, False)
    gy = torch.randn_like(y)
    dz = _library.backward_op(gy, mask, "div_leaky_relu", SLOPE, DIVISOR, False)
    (rw, _), (rb, _) = wgrad_bound(x, dz, w.shape, spd, torch.float32, False)
    torch.backends.cudnn.allow_tf32 = False
    try:
        ew, eb = conv2d_weight(x, w.shape, dz, *spd), dz.sum((0, 2, 3))
    finally:
        torch.backends.cudnn.allow_tf32 = True
    gw, gb = conv.fused_wgrad(x, gy, mask, list(w.shape), True, DIVISOR, SLOPE, *spd, False)
    for ours, eager, ref in ((gw, ew, rw), (gb, eb, rb)):
        err = (ours.double() - ref).abs().max().item()
        assert err <= 10 * (eager.double() - ref).abs().max().item(), err
