"""conv2d_div_leaky_relu: the fused kernel (accuracy against float64, masks,
gradients, non-finite inputs, layouts, compile, graphs) and the algorithm switch.

The fused kernel cannot match cuDNN's summation order, so its forward is held
to a stated accuracy (see ``bound``) over many shapes; "exact" stays bit for bit.
CPU-only machines run the NVRTC/PTX checks, the argument checks and the
fallbacks.
"""

import functools
import itertools
import math
import random
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

import torch.nn.functional as F  # noqa: E402
from ptx import SOURCES, compiled  # noqa: E402

import cupy_act.torch as ct  # noqa: E402
from cupy_act import _conv, _source, _timing, mask_nbytes, testing  # noqa: E402
from cupy_act.torch import _conv_checks, _impl, conv  # noqa: E402

gpu = pytest.mark.gpu
DIVISOR, SLOPE = 2.0, 0.01


def block(x, w, b, stride=1, padding=0, dilation=1, divisor=DIVISOR, slope=SLOPE):
    return F.leaky_relu(F.conv2d(x, w, b, stride, padding, dilation) / divisor, slope)


# ---- NVRTC: compiles without a GPU; the PTX has what the design relies on ----


# sm_80 (mma.sync, cp.async) and sm_90a (warpgroup MMAs, tensor copies) hold
# every PTX feature the checks read; sm_90, 100 and 120 compile the sm_80 code
# for other targets: the exhaustive run (-m slow) checks them too.
ARCHS = ["80", "90a", *(pytest.param(a, marks=pytest.mark.slow) for a in ("90", "100", "120"))]


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_kernel_ptx(arch, source):
    """Tensor-core TF32 MMAs (on sm_90a the forward's warpgroup MMAs and the
    weight gradient's beside its mma.sync kernels; mma.sync elsewhere), no
    flushing arithmetic, no local memory, and the parameter block the host
    packs; ptxas reports no spills, and serializes no warpgroup MMAs (it
    does, with a warning, where it cannot prove them safe)."""
    ptx, log = compiled(arch, source)
    sm90a = arch == "90a"
    mma_sync = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
    assert mma_sync != (sm90a and source == "forward")
    wgmma = {"forward": "m64n64k8", "wgrad": "m64n24k8"}
    for src, shape in wgmma.items():
        has = f"wgmma.mma_async.sync.aligned.{shape}.f32.tf32.tf32" in ptx
        assert has == (sm90a and source == src), shape
    assert "serialized" not in log, log
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, -8192;", ptx)  # to_tf32's rounding mask
    assert ".ftz" not in ptx
    assert ".local" not in ptx and "__local_depot" not in ptx
    assert len(re.findall(r"^\.(?:visible|weak) \.entry ", ptx, re.M)) == len(SOURCES[source][1])
    sizes = set(re.findall(r"\.param \.align \d+ \.b8 \S+_param_0\[(\d+)\]", ptx))
    assert sizes == {str(_conv.kernels._PARAMS.size)}
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log


def test_sm90a_target_survives_cupys_own_arch_option():
    """On compute capability 9.0 the modules compile for sm_90a (the forward's
    warpgroup MMAs); CuPy appends its own -arch=sm_90 after our options, and
    NVRTC must still build for sm_90a."""
    from cupy_backends.cuda.libs import nvrtc

    from cupy_act._loader import CUPY_ADDED_OPTIONS
    from cupy_act._source import assembled_source

    assert _conv.arch_options(90) == ("-arch=sm_90a",)
    assert all(_conv.arch_options(sm) == () for sm in (80, 86, 89, 100, 103, 120))
    prog = nvrtc.createProgram(assembled_source(_conv.SOURCE), _conv.SOURCE, (), ())
    try:
        nvrtc.addNameExpression(prog, _conv.kernel_name("float32", 3, False))
        opts = ("--std=c++17", *_conv.arch_options(90), *CUPY_ADDED_OPTIONS, "-arch=sm_90")
        nvrtc.compileProgram(prog, opts)
        ptx = nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)
    assert re.search(r"^\.target sm_90a$", ptx, re.M)
    assert "wgmma.mma_async" in ptx


# ---- geometry and arguments (anywhere) ----


GEOMETRIES = [  # (x shape, w shape, stride, padding, dilation)
    ((2, 3, 9, 11), (5, 3, 3, 3), 1, 0, 1),
    ((1, 1, 7, 7), (1, 1, 7, 7), 1, 0, 1),
    ((2, 4, 17, 5), (3, 4, 3, 1), (2, 1), (1, 0), (1, 2)),
    ((1, 2, 30, 31), (4, 2, 5, 5), 3, 2, 2),
    ((1, 3, 8, 8), (2, 3, 1, 1), 2, 0, 1),
]


@pytest.mark.parametrize("xs, ws, stride, padding, dilation", GEOMETRIES)
def test_geometry_matches_conv2d(xs, ws, stride, padding, dilation):
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    y = F.conv2d(torch.zeros(xs), torch.zeros(ws), None, stride, padding, dilation)
    assert g.out_shape == tuple(y.shape)


@pytest.mark.parametrize(
    "xs, ws, kw, match",
    [
        ((2, 3, 9), (5, 3, 3, 3), {}, "input must be 4-D"),
        ((2, 3, 9, 9), (5, 3, 3), {}, "weight must be 4-D"),
        ((2, 3, 9, 9), (5, 2, 3, 3), {}, "groups other than 1"),
        ((2, 3, 9, 9), (5, 3, 3, 3), dict(stride=0), "stride=0"),
        ((2, 3, 9, 9), (5, 3, 3, 3), dict(padding=-1), "padding=-1"),
        ((2, 3, 9, 9), (5, 3, 3, 3), dict(dilation=(1, 2, 3)), "dilation"),
        ((2, 3, 9, 9), (5, 3, 3, 3), dict(stride=1.5), "stride=1.5"),
        ((2, 3, 2, 2), (5, 3, 3, 3), {}, "output would be 0 x 0"),
    ],
)
def test_geometry_errors_name_the_value(xs, ws, kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        _conv.geometry("f", xs, ws, **kw)


def test_geometry_kept_per_arguments_still_checks_each_call():
    """geometry() keeps what passed its checks: the same object for the same
    arguments, a fresh one where they differ, and every bad value still
    raises after a good one was kept (True is not the stride 1; a pair as a
    list is the tuple's)."""
    xs, ws = (2, 3, 9, 9), (5, 3, 3, 3)
    g = _conv.geometry("f", xs, ws, 1, (1, 1), 1)
    assert _conv.geometry("f", torch.Size(xs), ws, 1, (1, 1), 1) is g
    assert _conv.geometry("f", xs, ws, [1, 1], [1, 1], 1) == g
    assert _conv.geometry("f", xs, ws, 1, 0, 1) != g
    for kw, match in ((dict(stride=True), "stride=True"), (dict(padding=(-1, 1)), "padding")):
        with pytest.raises(ValueError, match=re.escape(match)):
            _conv.geometry("f", xs, ws, **{"stride": 1, "padding": (1, 1), **kw})
    with pytest.raises(ValueError, match="groups other than 1"):
        _conv.geometry("f", (2, 4, 9, 9), ws, 1, (1, 1), 1)


def test_fits_guards_32_bit_offsets():
    g = _conv.geometry("f", (1, 2**16, 2**8, 2**8), (1, 2**16, 1, 1))
    assert not _conv.fits(g, 3)
    assert _conv.fits(_conv.geometry("f", (4, 8, 64, 64), (16, 8, 3, 3)), 3)


@pytest.mark.parametrize("xs, ws, stride, padding, dilation", GEOMETRIES)
def test_tiling_fits_shared_memory(xs, ws, stride, padding, dilation):
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    t = _conv.tiling(g, 3)
    assert t is not None and _conv.EPILOGUE_BYTES <= t.smem <= _conv.SMEM_TARGET[3]
    rows, cols = _conv.TILE_M >> t.c_log2, 1 << t.c_log2
    assert t.tiles_h * rows >= g.oh and t.tiles_w * cols >= g.ow
    assert t.kc_pad % 8 == 0 and t.kc_pad >= t.cc * g.kh * g.kw and 1 <= t.cc <= g.cin


@pytest.mark.parametrize("wgmma", [False, True], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("n_passes", [1, 3])
@pytest.mark.parametrize("xs, ws, stride, padding, dilation", GEOMETRIES)
def test_launch_tiling_spaces_patch_rows_within_the_same_limit(
    xs, ws, stride, padding, dilation, n_passes, wgmma
):
    """The launch's patch rows are 0-31 words further apart than ``tiling``'s,
    the shared memory within the same limit, the rest unchanged, and the MMA
    loads (mma.sync's or sm_90a's) take no more wavefronts."""
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    t, spaced = _conv.tiling(g, n_passes), _conv.launch_tiling(g, n_passes, wgmma)
    assert t.patch_w <= spaced.patch_w < t.patch_w + 32
    assert spaced._replace(patch_w=t.patch_w, smem=t.smem) == t
    limit = _conv.SMEM_TARGET[n_passes] if t.smem <= _conv.SMEM_TARGET[n_passes] else _conv.SMEM_MAX
    assert spaced.smem <= limit
    cost, kernel = _conv.shapes._patch_wavefronts, "forward_wgmma" if wgmma else "forward"
    assert cost(g, kernel, t, spaced.patch_w) <= cost(g, kernel, t, t.patch_w)


def test_seed_patch_loads_take_one_wavefront_each():
    """At the seed shape (8 -> 64 channels, 3 x 3, 126 x 126 outputs), 130-word
    patch rows put the forward's A loads 2 wavefronts deep and the weight
    gradient's B loads up to 4; the spaced rows (138 and 139 words) take one
    per load: 9 depth steps x 2 x 2 loads, and 3 ring rotations x 9 column
    tiles x 2 loads. The sm_90a forward's loads (4 consecutive positions per
    lane) take 2 at 130 and 138 words, one at 131: 9 depth steps x 2 x 4."""
    g = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))
    t = _conv.tiling(g, 3)
    assert t.patch_w == 130 and _conv.launch_tiling(g, 3).patch_w == 138
    assert _conv.shapes._patch_wavefronts(g, "forward", t, 130) == 72
    assert _conv.shapes._patch_wavefronts(g, "forward", t, 138) == 36
    assert _conv.launch_tiling(g, 3, True).patch_w == 131
    assert _conv.shapes._patch_wavefronts(g, "forward_wgmma", t, 138) == 144
    assert _conv.shapes._patch_wavefronts(g, "forward_wgmma", t, 131) == 72
    w = _conv.wgrad_tiling(g, 3)
    assert _conv.shapes._patch_wavefronts(g, "wgrad", w, 130) == 164
    assert _conv.shapes._patch_wavefronts(g, "wgrad", w, 139) == 54


def test_tiling_splits_channels_evenly_and_refuses_what_cannot_fit():
    t = _conv.tiling(_conv.geometry("f", (1, 64, 56, 56), (64, 64, 3, 3), 1, 1), 1)
    chunks = -(-64 // t.cc)
    assert chunks * t.cc - 64 < chunks  # no chunk short by more than one channel
    huge = _conv.geometry("f", (1, 1, 4000, 4000), (1, 1, 60, 60), 1, 0, 20)
    assert _conv.tiling(huge, 1) is None and not _conv.fits(huge, 1)


def test_passes():
    assert _conv.passes("float32", "fp32") == 3
    assert _conv.passes("float32", "tf32") == 1
    assert _conv.passes("bfloat16", "fp32") == _conv.passes("float16", "fp32") == 1


def _xwb(xs=(2, 3, 9, 11), ws=(5, 3, 3, 3), device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(xs, generator=g, device=device, dtype=dtype)
    w = torch.randn(ws, generator=g, device=device, dtype=dtype) * 0.3
    b = torch.randn(ws[0], generator=g, device=device, dtype=dtype)
    return x, w, b


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(algorithm="fast"), ValueError, "algorithm='fast'"),
        (dict(divisor=0.0), ValueError, "divisor"),
        (dict(negative_slope=True), TypeError, "negative_slope"),
        (dict(bias=torch.zeros(4)), RuntimeError, "but got bias of size [4]"),
        (dict(bias=torch.zeros(5, dtype=torch.float64)), RuntimeError, "bias type (torch.float64"),
        (dict(padding="full"), ValueError, "padding='full'"),
        (dict(padding="same", stride=2), ValueError, "needs stride 1"),
    ],
)
def test_torch_api_errors(kw, exc, match):
    x, w, b = _xwb()
    args = dict(bias=b, divisor=DIVISOR) | kw
    with pytest.raises(exc, match=re.escape(match)):
        ct.conv2d_div_leaky_relu(x, w, **args)


def test_torch_api_refuses_non_tensors():
    x, w, _ = _xwb()
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        ct.conv2d_div_leaky_relu(x, w.numpy(), None, DIVISOR)


@pytest.mark.parametrize("algorithm", conv.ALGORITHMS)
@pytest.mark.parametrize("xs, ws, stride, padding, dilation", GEOMETRIES[:3])
def test_cpu_every_algorithm_is_eager(algorithm, xs, ws, stride, padding, dilation):
    """On the CPU every algorithm falls back to PyTorch's convolution: bit for
    bit the eager block (in channels-last layout for "channels_last"), with
    gradients (x, weight, bias)."""
    x, w, b = _xwb(xs, ws)
    cl = algorithm == "channels_last"
    leaves = [t.clone().requires_grad_() for t in (_layout(x, cl), _layout(w, cl), b)]
    ref = block(*leaves, stride, padding, dilation)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    y = ct.conv2d_div_leaky_relu(*ours, DIVISOR, SLOPE, stride, padding, dilation, algorithm)
    testing.assert_bits_equal(y, ref.contiguous(memory_format=_fmt(y)), algorithm)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(ref, leaves, gy)
    for a, e, what in zip(torch.autograd.grad(y, ours, gy), want, ("x", "weight", "bias")):
        testing.assert_bits_equal(a, e.contiguous(memory_format=_fmt(a)), f"{algorithm} d{what}")


def _fmt(y):
    return torch.channels_last if _impl.is_channels_last(y) else torch.contiguous_format


def test_module_algorithm_and_state_dict():
    m = ct.ConvDivLeakyReLU(3, 5, 3, 2.0, algorithm="fused", stride=2, padding=1)
    assert set(m.state_dict()) == {"conv.weight", "conv.bias"}
    assert "algorithm='fused'" in repr(m)
    cl = ct.ConvDivLeakyReLU(3, 5, 3, 2.0, channels_last=True)
    assert cl.algorithm == "channels_last" and cl.channels_last
    cl.channels_last = False
    assert cl.algorithm == "exact" and not cl.channels_last
    with pytest.raises(ValueError, match="algorithm='x'"):
        ct.ConvDivLeakyReLU(3, 5, 3, 2.0, algorithm="x")
    ref = testing.ConvDivLeakyReLUModel(3, 5, 3, 2.0)
    ref.conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 9, 9)
    testing.assert_bits_equal(m(x), ref(x))


def test_module_grouped_conv_takes_the_exact_path():
    m = ct.ConvDivLeakyReLU(4, 6, 3, 2.0, algorithm="fused", groups=2)
    ref = testing.ConvDivLeakyReLUModel(4, 6, 3, 2.0)
    ref.conv = torch.nn.Conv2d(4, 6, 3, groups=2)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, 8, 8)
    testing.assert_bits_equal(m(x), ref(x))


def test_auto_candidates_follow_the_accuracy_class():
    assert conv.candidates(torch.float32, False)[:2] == ("exact", "fused")
    assert "fused_tf32" in conv.candidates(torch.float32, True)
    assert "fused_tf32" not in conv.candidates(torch.float32, False)
    assert "channels_last" in conv.candidates(torch.bfloat16, False)


# ---- GPU: accuracy of the fused kernel over many shapes ----


def random_cases(count: int, seed: int = 11):
    """(x shape, w shape, stride, padding, dilation): odd sizes, channels not
    multiples of 8, batch 1, kernels 1x1 to 7x7."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        k = (rng.choice([1, 2, 3, 5, 7]), rng.choice([1, 3, 4, 7]))
        d = (rng.choice([1, 1, 2]), rng.choice([1, 2]))
        s = (rng.choice([1, 1, 2, 3]), rng.choice([1, 2]))
        p = (rng.randint(0, 3), rng.randint(0, 3))
        h, w = rng.randint(1, 40), rng.randint(1, 70)
        xs = (rng.choice([1, 1, 2, 3]), rng.randint(1, 19), h, w)
        ws = (rng.randint(1, 80), xs[1], *k)
        if any(
            (n + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 < 1 for i, n in enumerate((h, w))
        ):
            continue
        out.append((xs, ws, s, p, d))
    return out


CASES = random_cases(40)
EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def bound(x, w, b, stride, padding, dilation, dtype, tf32, slope=SLOPE):
    """Per-element error bound against the float64 reference.

    Before the activation, z = (conv + bias) / d: products |a b| 2^-20 for
    the 3xTF32 split (below its worst case, 5 * 2^-22 with every error of one
    sign, see conv2d.cu, which the errors of random data do not reach),
    2^-10 for TF32, summed: the float64 convolution of |x| and |w| scales it;
    the float32 accumulation adds K eps |.| on the same scale, the
    epilogue's roundings 4 ulp of the output type on it. The activation
    scales z's error by its slope where z < 0 (by 1 where the error could
    cross zero), so that a wrong slope cannot hide in z's bound; rounding
    the output adds 4 ulp of it.
    """
    xd, wd = x.double(), w.double()
    mag = F.conv2d(xd.abs(), wd.abs(), b.double().abs(), stride, padding, dilation) / abs(DIVISOR)
    k = w[0].numel()
    prod = 2.0**-10 if tf32 else 2.0**-20
    z = F.conv2d(xd, wd, b.double(), stride, padding, dilation) / DIVISOR
    pre = (prod + (k + 2) * 2.0**-24 + 4 * EPS[dtype]) * mag
    factor = torch.where((z < 0) & (z.abs() > pre), abs(slope), 1.0)
    ref = F.leaky_relu(z, slope)
    return ref, factor * pre + 4 * EPS[dtype] * ref.abs() + 1e-30


def _layout(t, cl):
    return t.contiguous(memory_format=torch.channels_last) if cl else t


def negative_only(gy, x, w, b, stride=1, padding=0, dilation=1):
    """gy where the block's float64 output is negative, else 0: a gradient
    made entirely of the slope's branch."""
    bd = None if b is None else b.double()
    y = block(x.double(), w.double(), bd, stride, padding, dilation)
    assert (y < 0).any() and (y > 0).any()
    return torch.where(y < 0, gy, torch.zeros_like(gy))


# (dtype, algorithm) pairs of the fused kernels' accuracy grids
FUSED_KINDS = [
    (torch.float32, "fused"),
    (torch.float32, "fused_tf32"),
    (torch.float16, "fused"),
    (torch.bfloat16, "fused"),
]


def _check_accuracy(shape, seed, dtype, algorithm, cl):
    xs, ws, stride, padding, dilation = shape
    x, w, b = _xwb(xs, ws, "cuda", dtype, seed=seed)
    x, w = _layout(x, cl), _layout(w, cl)
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, stride, padding, dilation, algorithm)
    assert y.shape == tuple(F.conv2d(x, w, None, stride, padding, dilation).shape)
    assert _impl.is_channels_last(y) == (cl and _impl.is_channels_last(x))
    ref, tol = bound(x, w, b, stride, padding, dilation, dtype, algorithm == "fused_tf32")
    err = (y.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g}, {worst:.2f}x the bound"


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_forward_accuracy(case, dtype, algorithm, cl):
    _check_accuracy(CASES[case], case, dtype, algorithm, cl)


# Dilated geometries: (x shape, w shape, stride, padding, dilation)
DILATED = [
    ((2, 4, 17, 25), (9, 4, 3, 3), 1, 2, 2),
    ((1, 3, 30, 31), (16, 3, 5, 3), (2, 1), 1, (3, 2)),
    ((2, 8, 20, 20), (64, 8, 3, 3), 1, 0, (1, 4)),
]


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(DILATED)), ids=[f"dilated{i}" for i in range(3)])
def test_fused_forward_with_dilation_within_the_bound(case, dtype, algorithm, cl):
    """Dilations above 1 in one or both directions: every element within the
    float64 bound (a kernel that ignored the dilation would read other rows)."""
    _check_accuracy(DILATED[case], 500 + case, dtype, algorithm, cl)


# One-pass shapes whose patch (words, with the zero plane) is odd and, with
# what follows it (a tile's mask words, the bias), larger than the epilogue
# tile: the weights after it start 16-byte aligned (as the wgmma descriptors
# need, conv2d.cu) only because the kernel rounds up (with the sm_90a
# kernel's row spacing).
ODD_PATCH_CASES = [
    ((1, 8, 22, 78), (8, 8, 3, 1), (2, 3), 0, (3, 1)),
    ((1, 2, 56, 127), (8, 2, 6, 1), (1, 3), 0, (3, 2)),
]


def test_host_sizes_mirror_the_kernels_constants():
    """_conv's shared-memory sizes are conv2d_tiles.cuh's constexprs (evaluated
    from the source here): a change on one side only would misplace the
    kernel's parts (the mbarrier after the bias, the weights)."""
    text = (_source.cuda_dir() / "conv2d_tiles.cuh").read_text()
    consts: dict = {}
    for name, expr in re.findall(r"constexpr int (k\w+) = ([^;]+);", text):
        m = re.fullmatch(r"(.+) \? (.+) : (.+)", expr)
        py = f"({m[2]}) if ({m[1]}) else ({m[3]})" if m else expr
        consts[name] = eval(py, {}, dict(consts))
    mirrors = {
        "kConvThreads": _conv.THREADS,
        "kBM": _conv.TILE_M,
        "kBN": _conv.TILE_N,
        "kEpilogueFloats": _conv.EPILOGUE_FLOATS,
        "kAfterPatchWords": _conv.AFTER_PATCH_WORDS,
        "kPatchPart": _conv.PATCH_PART,
        "kWeightStride": _conv.WEIGHT_STRIDE,
        "kWeightPart": _conv.WEIGHT_PART,
        "kSeamStride": _conv.SEAM_STRIDE,
    }
    assert consts["kSeamFloats"] * 4 == _conv.SEAM_BYTES
    assert {k: consts[k] for k in mirrors} == mirrors


def test_odd_patch_cases_have_odd_patches():
    for xs, ws, stride, padding, dilation in ODD_PATCH_CASES:
        t = _conv.launch_tiling(_conv.geometry("f", xs, ws, stride, padding, dilation), 1, True)
        words = (t.cc + 1) * t.patch_h * t.patch_w
        assert words + _conv.AFTER_PATCH_WORDS > _conv.EPILOGUE_FLOATS and words % 2, t
        assert t.smem % 16 == 0


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize(
    "dtype, algorithm", [k for k in FUSED_KINDS if k[1] != "fused" or k[0] != torch.float32]
)
@pytest.mark.parametrize("case", range(len(ODD_PATCH_CASES)))
def test_fused_forward_accuracy_after_an_odd_patch(case, dtype, algorithm, cl):
    _check_accuracy(ODD_PATCH_CASES[case], case, dtype, algorithm, cl)


# Outputs wider than 64 (one-row tiles: NCHW keeps the patch as a ring of
# rows, in the forward on sm_90a and in the weight gradient) with more tiles
# than the device runs blocks, so that blocks walk runs of consecutive rows
# across image boundaries: strides, dilations, padding, 1x1 to 7x7, several
# chunks and column tiles (70 channels: a second tile of 6).
WIDE_CASES = [
    ((4, 5, 260, 150), (20, 5, 3, 3), 1, 1, 1),
    ((2, 3, 600, 141), (17, 3, 7, 7), 2, 3, 1),
    ((2, 8, 500, 133), (64, 8, 5, 5), 1, 0, 1),
    ((3, 4, 700, 200), (9, 4, 3, 5), (3, 1), (2, 1), (2, 1)),
    ((1, 2, 1500, 300), (70, 2, 1, 1), 1, 0, 1),
    ((2, 7, 800, 129), (5, 7, 3, 3), (1, 2), 1, (2, 1)),
]


def test_wide_cases_take_the_forwards_ring_of_rows():
    """WIDE_CASES exercise the forward's ring (one-row tiles, every input
    channel in one chunk, more tiles than an H100's 132 SMs run blocks of
    them at once) at 3 of 6 shapes, one and three passes, and one-row tiles
    with several chunks (no ring) at the rest."""
    ring = 0
    for xs, ws, stride, padding, dilation in WIDE_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes in (1, 3):
            t = _conv.launch_tiling(g, n_passes)
            assert t.c_log2 == 7
            assert g.n * t.tiles_h * t.tiles_w > 4 * 132 // -(-g.cout // _conv.TILE_N)
            ring += g.cin <= t.cc
    assert ring == 3 * 2


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(WIDE_CASES)), ids=[f"wide{i}" for i in range(6)])
def test_fused_forward_on_wide_outputs(case, dtype, algorithm, cl):
    """Within the float64 bound, and the mask bit set exactly where the output
    is > 0, in its memory order."""
    _check_accuracy(WIDE_CASES[case], 100 + case, dtype, algorithm, cl)
    xs, ws, stride, padding, dilation = WIDE_CASES[case]
    x, w, b = _xwb(xs, ws, "cuda", dtype, seed=100 + case)
    x, w = _layout(x, cl), _layout(w, cl)
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)  # (its pairs)
    spd = (g.stride, g.padding, g.dilation)
    y, mask = conv.fused_forward(x, w, b, DIVISOR, SLOPE, *spd, algorithm == "fused_tf32", True)
    bits = _impl.mask_to_bits(mask.cpu(), tuple(y.shape), _impl.is_channels_last(y))
    assert torch.equal(bits, (y > 0).cpu())


# Ring shapes whose new rows arrive by asynchronous copies into a staging
# area (sm_90a, NCHW, _conv.ring_staged): two column tiles; two fresh rows
# per tile (stride 2) under vertical dilation, padding 4 (a zero column
# group at the left) and a third column tile of 8; the seed's rows.
STAGED_CASES = [
    ((2, 6, 500, 256), (16, 6, 3, 3), 1, 0, 1),
    ((2, 3, 700, 260), (10, 3, 3, 5), (2, 1), 4, (2, 1)),
    ((4, 8, 300, 128), (64, 8, 3, 3), 1, 0, 1),
]


def test_staged_cases_stage_and_wide_cases_do_not_all():
    """STAGED_CASES take the staging area at one and three passes, 32- and
    16-bit, with runs of several tiles per block; some WIDE_CASES keep the
    ring without it (rows not lined up with 4-column groups)."""
    for xs, ws, stride, padding, dilation in STAGED_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes, itemsize in ((1, 4), (3, 4), (1, 2)):
            t = _conv.launch_tiling(g, n_passes, True)
            assert _conv.ring_staged(g, t, n_passes, itemsize)
            assert g.n * t.tiles_h * t.tiles_w >= 2 * 4 * 132 // -(-g.cout // _conv.TILE_N)
    plain = 0
    for xs, ws, stride, padding, dilation in WIDE_CASES:
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        t = _conv.launch_tiling(g, 1, True)
        plain += g.cin <= t.cc and not _conv.ring_staged(g, t, 1, 4)
    assert plain >= 2


def test_forward_tmap_takes_aligned_rings_on_sm90_only(monkeypatch):
    """The ring's rows come by tensor copies (_conv.forward_tmap) for the
    staged cases and the seed shape at both precisions and 16-bit, where x
    is 16-byte aligned, on compute capability 9.0, with x's rows and the
    left padding whole 16-byte units, where the driver encodes maps; the box
    fits its shared memory at a 128-byte boundary; the map's box is the
    fresh rows of the chunk's channels."""
    monkeypatch.setattr(_conv._tensormap, "available", lambda: False)
    g = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))
    assert not _conv.forward_tmap(g, _conv.launch_tiling(g, 3, True), 3, 4, 256, 90)
    monkeypatch.setattr(_conv._tensormap, "available", lambda: True)
    seed = ((128, 8, 128, 128), (64, 8, 3, 3), 1, 0, 1)
    took = []
    for xs, ws, stride, padding, dilation in (*STAGED_CASES, seed):
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes, itemsize in ((1, 4), (3, 4), (1, 2)):
            t = _conv.launch_tiling(g, n_passes, True)
            units = (g.padding[1] * itemsize % 16, g.w * itemsize % 16) == (0, 0)
            assert _conv.forward_tmap(g, t, n_passes, itemsize, 256, 90) == units
            assert not _conv.forward_tmap(g, t, n_passes, itemsize, 256 + 8, 90)
            assert not _conv.forward_tmap(g, t, n_passes, itemsize, 256, 80)
            took.append(units)
            if not units:
                continue
            m = _conv.forward._x_map(g, t, itemsize)
            box = m._args[4]
            assert box[0] * itemsize % 16 == 0 and t.patch_w <= box[0] < t.patch_w + 16 // itemsize
            assert (box[1], box[2], box[3]) == (min(g.stride[0], t.patch_h), t.cc, 1)
            assert list(m._args[2]) == [g.w, g.h, g.cin, g.n]
    # (16-bit in the second case: rows of 520 bytes under a padding of 8)
    assert took.count(False) == 1
    g = _conv.geometry("f", *seed)
    t = _conv.launch_tiling(g, 3, True)
    assert _conv.forward_tmap(g, t, 3, 4, 256, 90)
    monkeypatch.setattr(_conv.forward, "FORWARD_TMAP", False)
    assert not _conv.forward_tmap(g, t, 3, 4, 256, 90)
    monkeypatch.setattr(_conv.forward, "FORWARD_TMAP", True)
    # float32: tensor copies only where the cp.async staging would run
    for xs, ws, stride, padding, dilation in (*WIDE_CASES, *STAGED_CASES):
        g = _conv.geometry("f", xs, ws, stride, padding, dilation)
        for n_passes in (1, 3):
            t = _conv.launch_tiling(g, n_passes, True)
            if _conv.forward_tmap(g, t, n_passes, 4, 256, 90):
                assert _conv.ring_staged(g, t, n_passes, 4)


def test_prepared_params_take_each_calls_addresses_and_scalars():
    """A prepared launch's ConvParams (_conv.kernels._params, worked out once per
    shape) with one call's addresses and scalars filled in (Prepared.fill)
    are the fields the kernels read, in their places; a second call leaves
    nothing of the first."""
    g = _conv.geometry("f", (3, 5, 20, 30), (7, 5, 3, 3), 2, 1, 1)
    t = _conv.launch_tiling(g, 3)
    k = _conv.Prepared(0, 0, (1, 1), 128, t.smem, _conv.kernels._params(g, t, 0, 0, 0, 11, 13))
    for base, slope, scale in ((1, 0.25, 0.5), (100, -0.0, 3.0)):
        s = k.fill(base, base + 1, base + 2, base + 3, base + 4, slope, scale)
        _conv.kernels._GRAD_ADDRESSES.pack_into(
            s.buf, _conv.kernels._GRADS_AT, base + 5, base + 6, base + 7
        )
        f = _conv.kernels._PARAMS.unpack(s.buf.raw)
        assert f[:5] == tuple(range(base, base + 5))
        assert f[5:14] == (g.n, g.cin, g.h, g.w, g.cout, g.oh, g.ow, g.kh, g.kw)
        assert f[14:20] == (*g.stride, *g.padding, *g.dilation)
        assert f[20:27] == (t.c_log2, t.tiles_h, t.tiles_w, t.cc, t.kc_pad, t.patch_h, t.patch_w)
        assert f[27:31] == (0, slope, scale, 1.0)
        assert math.copysign(1, f[28]) == math.copysign(1, slope)
        assert f[31:] == (base + 5, base + 6, base + 7, 11, 13)


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"  # (device names)


def _record_launches(monkeypatch, sm: int = 90) -> list:
    """Fake kernels and driver calls for the prepared launches (no GPU): each
    launch is recorded as (CUfunction, grid, smem, ConvParams as unpacked, the
    tensor map's address or None)."""
    import ctypes

    launched = []

    def run(ptr, ctx, grid, threads, stream, argv, smem=0):
        desc = None
        if argv != _conv.kernels._scratch.argv_ptr:  # (params, map) as the kernel's two parameters
            params, desc = (ctypes.c_void_p * 2).from_address(argv)
            assert params == ctypes.addressof(_conv.kernels._scratch.buf)
        launched.append(
            (ptr, grid, smem, _conv.kernels._PARAMS.unpack(_conv.kernels._scratch.buf.raw), desc)
        )

    class FakeMap:
        def at(self, address):
            return (b"", 0xD0 + address % 16)

    monkeypatch.setattr(_conv._launch, "run", run)
    monkeypatch.setattr(_conv.kernels, "_sm", lambda device: sm)
    monkeypatch.setattr(_conv.kernels, "_device_name", lambda device: H100)
    monkeypatch.setattr(_conv.kernels, "_blocks", lambda device, k, smem: 3 * 132)
    monkeypatch.setattr(_conv.kernels, "_allow_smem", lambda k, nbytes: None)
    monkeypatch.setattr(_conv._tensormap, "available", lambda: True)
    monkeypatch.setattr(_conv.forward, "_x_map", lambda *args: FakeMap())
    monkeypatch.setattr(_conv.wgrad, "_dy_map", lambda *args: FakeMap())
    monkeypatch.setattr(_conv.forward, "_forward_launches", {})
    monkeypatch.setattr(_conv.wgrad, "_wgrad_plans", {})
    return launched


def test_forward_launch_picks_its_kernel_per_call(monkeypatch):
    """_conv.launch through the prepared launch (fake kernels, no GPU): the
    tensor-copy kernel (even CUfunction, with x's map as its second
    parameter) where forward_tmap allows it for this x, else the other; the
    persistent grid covers every tile; the call's addresses and scalars in
    ConvParams; an empty output launches nothing."""
    launched = _record_launches(monkeypatch)
    kernels = _conv.ForwardKernels(_conv.ConvKernel(1, 7, None), _conv.ConvKernel(2, 7, None))
    monkeypatch.setattr(_conv.forward, "kernel", lambda *args: kernels)
    seed = _conv.geometry("f", (128, 8, 128, 128), (64, 8, 3, 3))
    slope, scale = _conv.kernels._scalars(0.01, 2.0, "f")

    def go(g, x, precision="fp32"):
        launched.clear()
        have = _conv.extents(g, "float32")
        _conv.launch(
            0, "float32", precision, False, g, 5, x, 16, 32, 48, 64, 0.01, 2.0, "f", have=have
        )
        return launched

    for x, ptr in ((256, 2), (264, 1)):
        ((got, grid, smem, f, desc),) = go(seed, x)
        t = _conv.launch_tiling(seed, 3, True)
        assert got == ptr and smem == t.smem and desc == (0xD0 if ptr == 2 else None)
        assert f[:5] == (x, 16, 32, 48, 64) and f[28:30] == (slope, scale)
        assert grid[1] == 1 and grid[0] * f[-2] >= seed.n * t.tiles_h * t.tiles_w
        assert (grid[0] - 1) * f[-2] < seed.n * t.tiles_h * t.tiles_w
    assert go(seed, 256, "tf32")[0][0] == 2
    odd = _conv.geometry("f", *WIDE_CASES[2])  # 133 columns: no whole 16-byte rows
    assert go(odd, 256)[0][0] == 1
    monkeypatch.setattr(_conv.forward, "FORWARD_TMAP", False)
    assert go(seed, 256)[0][0] == 1
    assert go(_conv.geometry("f", (0, 8, 128, 128), (64, 8, 3, 3)), 256) == []


def test_eager_forward_keeps_its_launch_per_kind_of_call(monkeypatch):
    """conv._kept_forward (fake kernels, CPU tensors, no GPU) looks its
    launch up once per kind of call (conv._checked's), precision, layout and
    setting of the forward's switches, with or without a mask; every call
    launches on its own tensors' addresses (a strided weight's dense copy,
    not the view; a zeroed mask of its own where asked for) with the scalars
    of its slope, a zero slope with its own sign each time (0.0 and -0.0 are
    one kind of call); an empty output launches nothing."""
    import ctypes

    launched = _record_launches(monkeypatch)
    kernels = _conv.ForwardKernels(_conv.ConvKernel(1, 7, None), _conv.ConvKernel(2, 7, None))
    monkeypatch.setattr(_conv.forward, "kernel", lambda *args: kernels)
    monkeypatch.setattr(_impl, "_raw_stream", lambda dev: 5)
    zeroed = []  # (the mask's address and bytes, launches before)

    def zero(ctx, ptr, nbytes, stream):
        assert (ctx, stream) == (7, 5)
        zeroed.append((ptr, nbytes, len(launched)))
        ctypes.memset(ptr, 0, nbytes)

    monkeypatch.setattr(_conv._launch, "zero", zero)
    looked = []
    lookup = _conv.forward_launch
    monkeypatch.setattr(_conv, "forward_launch", lambda *a: looked.append(a) or lookup(*a))

    def checked(g):
        spd = (g.stride, g.padding, g.dilation)
        return _conv_checks._Checked(g.padding, (True, True), spd, g, {}, {})

    x, w, b = _xwb((2, 8, 20, 20), (16, 8, 3, 3))
    g = _conv.geometry("f", x.shape, w.shape)
    c = checked(g)

    def go(c, slope=0.01, tf32=True, w=w, with_mask=False):
        launched.clear()
        zeroed.clear()
        y, mask = conv._kept_forward(x, w, b, c.g, c.launches, 2.0, slope, tf32, with_mask)
        assert y.shape == c.g.out_shape and (mask is not None) == with_mask
        if with_mask:  # zeroed whole, before the launch
            assert mask.dtype == torch.uint8 and mask.numel() == mask_nbytes(y.numel())
            assert zeroed == [(mask.data_ptr(), mask.numel(), 0)] and not mask.any()
            return y, [f for _, _, _, f, _ in launched], mask
        assert zeroed == []
        return y, [f for _, _, _, f, _ in launched]

    for _ in range(2):
        y, (f,) = go(c)
        assert f[:5] == (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 0)
        assert f[28:30] == _conv.kernels._scalars(0.01, 2.0, "f")
    for _ in range(2):  # the training forward: the same launch, a mask each call
        y, (f,), mask = go(c, with_mask=True)
        assert f[:5] == (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), mask.data_ptr())
    assert len(looked) == 1
    go(c, tf32=False)
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", False)
    go(c, tf32=False)
    assert len(looked) == 3
    strided = w.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    y, (f,) = go(c, w=strided)
    assert f[1] != strided.data_ptr()
    zero = checked(g)
    for slope in (-0.0, 0.0, -0.0):
        _, (f,) = go(zero, slope)
        assert math.copysign(1, f[28]) == math.copysign(1, slope)
    empty = checked(_conv.geometry("f", (0, 8, 20, 20), w.shape))
    assert go(empty)[1] == []


def test_kernel_scalars_keep_the_sign_of_a_zero_slope():
    """_conv.kernels._scalars keeps rounded scalars per value, but 0.0 and -0.0 are
    equal keys with different results (x * -0.0 is +0.0 for negative x):
    each gets its own sign, in either order."""
    for first, second in ((0.0, -0.0), (-0.0, 0.0)):
        for slope in (first, second, first):
            got, _ = _conv.kernels._scalars(slope, 2.0, "f")
            assert math.copysign(1, got) == math.copysign(1, slope)


def test_checked_calls_are_kept_only_for_exact_plain_arguments():
    """conv._checked keeps what the checks settled per kind of call, and a
    kept call never lets a bad one through: True for 1 (equal keys) and a
    zero divisor still raise, as do wrong types; lists are checked each
    time, with the same result."""
    x, w, b = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(4)
    _conv_checks._checks.clear()
    first = conv._checked(x, w, b, 2.0, 0.01, 1, 1, 1, "fused")
    assert conv._checked(x, w, b, 2.0, 0.01, 1, 1, 1, "fused") is first
    assert len(_conv_checks._checks) == 1 and first.pad == (1, 1)
    assert conv._checked(x, w, b, 2.0, 0.01, [1, 1], [1, 1], (1, 1), "fused") == first
    assert len(_conv_checks._checks) == 2  # lists kept as pairs of exact ints
    with pytest.raises(ValueError, match="padding=True"):
        conv._checked(x, w, b, 2.0, 0.01, 1, True, 1, "fused")
    conv._checked(x, w, b, 2.0, 0.01, True, 1, 1, "fused")  # (CPU: F.conv2d's to check)
    assert len(_conv_checks._checks) == 2  # a bool is never part of a key
    with pytest.raises(ValueError, match="padding=\\(True, 1\\)"):
        conv._checked(x, w, b, 2.0, 0.01, 1, (True, 1), 1, "fused")
    with pytest.raises(ValueError, match="divisor"):
        conv._checked(x, w, b, 0.0, 0.01, 1, 1, 1, "fused")
    with pytest.raises(TypeError, match="negative_slope"):
        conv._checked(x, w, b, 2.0, True, 1, 1, 1, "fused")
    with pytest.raises(ValueError, match="algorithm"):
        conv._checked(x, w, b, 2.0, 0.01, 1, 1, 1, "fast")
    with pytest.raises(RuntimeError, match="bias type"):
        conv._checked(x, w, b.double(), 2.0, 0.01, 1, 1, 1, "fused")
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        conv._checked(x.numpy(), w, b, 2.0, 0.01, 1, 1, 1, "fused")
    assert conv._checked(x, w, None, 2, -0.0, 1, "same", 1, "auto").pad == (1, 1)
    assert not first.fusable[0] and first.g is None  # CPU tensors: PyTorch's path


@gpu
@pytest.mark.parametrize("dtype, algorithm", FUSED_KINDS)
@pytest.mark.parametrize("case", range(len(STAGED_CASES)), ids=[f"staged{i}" for i in range(3)])
def test_fused_forward_staged_rows_match_plain_loads(case, dtype, algorithm, monkeypatch):
    """Within the float64 bound, the mask bit set exactly where the output is
    > 0; and bit for bit the output and mask of the same input one element
    off 16-byte alignment (no staging: plain loads), and of the rows staged
    by cp.async instead of tensor copies."""
    _check_accuracy(STAGED_CASES[case], 200 + case, dtype, algorithm, False)
    xs, ws, stride, padding, dilation = STAGED_CASES[case]
    x, w, b = _xwb(xs, ws, "cuda", dtype, seed=200 + case)
    shifted = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(xs)
    shifted.copy_(x)
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    spd = (g.stride, g.padding, g.dilation)
    tf32 = algorithm == "fused_tf32"
    y, mask = conv.fused_forward(x, w, b, DIVISOR, SLOPE, *spd, tf32, True)
    y2, mask2 = conv.fused_forward(shifted, w, b, DIVISOR, SLOPE, *spd, tf32, True)
    monkeypatch.setattr(_conv.forward, "FORWARD_TMAP", False)
    y3, mask3 = conv.fused_forward(x, w, b, DIVISOR, SLOPE, *spd, tf32, True)
    bits = torch.int16 if y.element_size() == 2 else torch.int32
    assert torch.equal(y.view(bits), y2.view(bits))
    assert torch.equal(y.view(bits), y3.view(bits))
    assert torch.equal(mask, mask2) and torch.equal(mask, mask3)
    assert torch.equal(_impl.mask_to_bits(mask.cpu(), tuple(y.shape), False), (y > 0).cpu())


# Shapes whose float32 one-pass forward stores the line two rows share whole
# (the row seams, _conv.seam_bytes): 126 columns, with runs of several tiles
# per block; 98 columns under 40 channels (a partial channel tile); the
# narrowest, 66 columns, under two channel tiles (the second of 6); stride 2
# with padding.
SEAM_CASES = [
    ((16, 8, 130, 128), (64, 8, 3, 3), 1, 0, 1),
    ((3, 5, 68, 100), (40, 5, 3, 3), 1, 0, 1),
    ((2, 3, 50, 68), (70, 3, 3, 3), 1, 0, 1),
    ((2, 4, 103, 251), (16, 4, 3, 3), 2, 1, 1),
]


def test_seam_bytes_where_the_kernel_takes_them(monkeypatch):
    """With FORWARD_SEAMS on, the row seams' buffer goes to float32 one-pass
    NCHW forwards on sm_90 whose rows (one tile each) share lines: the seam
    cases and the seed shape, keeping three blocks per SM; not to three
    passes, 16-bit types, channels-last, other devices, rows of whole lines
    (128 columns), odd widths or planes of odd pairs. By default (None) only
    where seams_pay: on an H100, widths of 102 to 126 that are 2 mod 4; off,
    nowhere. The launch asks for it after the tiling's shared memory."""
    seed = ((128, 8, 128, 128), (64, 8, 3, 3), 1, 0, 1)

    def seams(case, n_passes=1, dtype="float32", sm=90, cl=False, name=H200):
        g = _conv.geometry("f", *case)
        tl = _conv.launch_tiling(g, n_passes, True)
        return _conv.seam_bytes(g, tl, n_passes, dtype, sm, cl, name)

    assert _conv.forward.FORWARD_SEAMS is None
    # by default: the seed and 110 columns on an H100; not 66, 98, 112 or
    # 124 columns (the seam cases' 66 and 98, the stem's 112, the 5x5
    # shape's 124), nor on an H200
    assert seams(seed, name=H100) == seams(SEAM_CASES[3], name=H100) == _conv.SEAM_BYTES
    assert seams(((2, 8, 128, 112), (64, 8, 3, 3), 1, 0, 1), name=H100) == _conv.SEAM_BYTES
    for w in (68, 114, 126):
        assert seams(((2, 8, 128, w), (64, 8, 3, 3), 1, 0, 1), name=H100) == 0, w
    assert seams(seed) == seams(SEAM_CASES[2], name=H100) == seams(SEAM_CASES[1], name=H100) == 0
    assert [ow for ow in range(64, 129) if _conv.seams_pay(H100, ow)] == list(range(102, 127, 4))
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", True)
    for case in (*SEAM_CASES, seed):
        assert seams(case) == _conv.SEAM_BYTES
        g = _conv.geometry("f", *case)
        assert _conv.launch_tiling(g, 1, True).smem + _conv.SEAM_BYTES <= _conv.SEAM_SMEM_MAX
        assert seams(case, n_passes=3) == seams(case, dtype="float16") == 0
        assert seams(case, cl=True) == seams(case, sm=80) == seams(case, sm=100) == 0
    for xs in ((2, 8, 128, 130), (2, 8, 128, 129), (2, 8, 127, 128), (2, 8, 20, 60)):
        assert seams((xs, (64, 8, 3, 3), 1, 0, 1)) == 0, xs  # 128, odd, 125 x 126, 58 columns
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", False)
    assert seams(seed) == seams(seed, name=H100) == 0
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", None)
    launched = _record_launches(monkeypatch)
    kernels = _conv.ForwardKernels(_conv.ConvKernel(1, 7, None), _conv.ConvKernel(2, 7, None))
    monkeypatch.setattr(_conv.forward, "kernel", lambda *args: kernels)
    g = _conv.geometry("f", *seed)
    _conv.launch(
        0, "float32", "tf32", False, g, 5, 256, 16, 32, 48, 64, 0.01, 2.0, "f",
        have=_conv.extents(g, "float32"),
    )  # fmt: skip
    assert launched[0][2] == _conv.launch_tiling(g, 1, True).smem + _conv.SEAM_BYTES
    monkeypatch.setattr(_conv.kernels, "_device_name", lambda device: H200)  # (another machine)
    monkeypatch.setattr(_conv.forward, "_forward_launches", {})
    _conv.launch(
        0, "float32", "tf32", False, g, 5, 256, 16, 32, 48, 64, 0.01, 2.0, "f",
        have=_conv.extents(g, "float32"),
    )  # fmt: skip
    assert launched[1][2] == _conv.launch_tiling(g, 1, True).smem


def _seam_model(ow: int, oh: int, chans: int, y: int) -> dict[int, int]:
    """conv2d.cu's row seams as a model (float32, one block walking every row
    of one image, byte addresses from y): each warp-lane's store units (the
    aligned vectors of store_vectors, or store_shifted's on rows 8 bytes into
    a 16-byte unit), routed as epilogue_wgmma_nchw routes them (warp 0 to the
    line of the previous row's last element, other lanes near the row's end
    to that of the next row's first; the route of channel c % 8 at the same
    row, as the kernel works it out once per tile), and the seam lines
    stored whole after each tile (put_seams). Returns how often each element
    went out; asserts that each seam line fills whole."""
    plane, out, seam = oh * ow, {}, {}

    def put(at: int, nbytes: int) -> None:
        for e in range(at, at + nbytes, 4):
            out[e] = out.get(e, 0) + 1

    def row_start(c: int, r: int) -> int:
        return y + (c * plane + r * ow) * 4

    for r in range(oh):
        for c in range(chans):
            rs, rs8 = row_start(c, r), row_start(c % 8, r)
            for w, g in itertools.product(range(4), range(8)):
                col = 32 * w + 4 * g
                valid, nxt = max(0, min(4, ow - col)), max(0, min(4, ow - col - 4))
                a = rs + 4 * col
                if rs % 16 == 8:  # store_shifted's units
                    units = [(a + 8, 16)] if g < 7 and valid == 4 and nxt >= 2 else []
                    units += [(a, 8)] if g == 0 and valid >= 2 else []
                    units += [(a + 8, 8)] if valid == 4 and (g == 7 or nxt < 2) else []
                else:
                    units = [(a, 4 * valid)] if valid else []
                on = r > 0 if w == 0 else r + 1 < oh and col + 4 > ow - 32
                key8 = rs8 - 4 if w == 0 else rs8 + 4 * ow
                for u, n in units:
                    assert u // 128 == (u + n - 1) // 128  # (no unit crosses a line)
                    if on and ((u - rs + rs8) ^ key8) < 128:
                        lower = r - 1 if w == 0 else r
                        seam.setdefault((lower % 2, c, u // 128), set()).update(range(u, u + n, 4))
                    else:
                        put(u, n)
        for c in range(chans if r > 0 else 0):  # put_seams after the tile
            rs = row_start(c, r)
            if rs % 128:
                line = rs // 128 * 128
                assert seam.pop(((r - 1) % 2, c, rs // 128)) == set(range(line, line + 128, 4))
                put(line, 128)
    assert not seam
    return out


def test_seam_routes_send_every_element_out_once():
    """The row seams' rule (_seam_model) over the widths _conv.seam_bytes
    admits, heights from 2 and y at several 16-byte offsets from a line:
    every output element goes out exactly once, each seam line whole, and
    channels 8 apart route alike (the kernel's once-per-tile routes), which
    holds because the plane is a multiple of 4 elements."""
    checked = 0
    for ow, oh, y in itertools.product(range(66, 127, 4), (2, 3, 4), (0, 16, 48, 112)):
        if (oh * ow) % 4:
            continue
        got = _seam_model(ow, oh, 9, y)
        assert got == dict.fromkeys(range(y, y + 4 * 9 * oh * ow, 4), 1), (ow, oh, y)
        checked += 1
    assert checked > 40


def _forward_at(shape, seed: int, precision: str):
    """(forward, geometry, (x, w, b)) for a float32 NCHW case ``shape`` (x,
    weight shapes, stride, padding, dilation): forward(offset) launches the
    fused forward with y ``offset`` elements into a poisoned, 256-byte aligned
    buffer, asserts that every element was written and returns (y's bits as
    int32, mask)."""
    from test_ops_gpu import poison  # (a NaN pattern no kernel here writes)

    xs, ws, stride, padding, dilation = shape
    x, w, b = _xwb(xs, ws, "cuda", torch.float32, seed=seed)
    g = _conv.geometry("f", xs, ws, stride, padding, dilation)
    stream = torch.cuda.current_stream().cuda_stream
    n = math.prod(g.out_shape)
    mark = poison((1,), torch.float32).view(torch.int32)

    def forward(offset: int):
        y = poison((n + 64,), torch.float32)[offset : offset + n].view(g.out_shape)
        mask = torch.zeros(mask_nbytes(n), dtype=torch.uint8, device="cuda")
        ptrs = (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), mask.data_ptr())
        have = tuple(t.numel() * t.element_size() for t in (x, w, b, y, mask))
        _conv.launch(
            0, "float32", precision, False, g, stream, *ptrs, SLOPE, DIVISOR, "f", have=have
        )
        assert not (y.view(torch.int32) == mark).any(), offset
        return y.view(torch.int32).clone(), mask

    return forward, g, (x, w, b)


@gpu
@pytest.mark.parametrize("case", range(len(SEAM_CASES)), ids=[f"seam{i}" for i in range(4)])
def test_fused_forward_row_seams_match_each_tile_storing_its_rows(case, monkeypatch):
    """The float32 one-pass forward with its row seams: every output element
    written (outputs poisoned first), within the float64 bound, and bit for
    bit the output and mask of the same forward without the seams
    (FORWARD_SEAMS off); with y on a 128-byte boundary, 16 bytes past one
    (seams still taken) and 4 bytes past one (not 16-byte aligned: none)."""
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", True)  # (on any sm_90 device, any width)
    _check_accuracy(SEAM_CASES[case], 300 + case, torch.float32, "fused_tf32", False)
    forward, g, _ = _forward_at(SEAM_CASES[case], 300 + case, "tf32")
    runs = [forward(offset) for offset in (0, 4, 1)]
    monkeypatch.setattr(_conv.forward, "FORWARD_SEAMS", False)
    plain, plain_mask = forward(0)
    for y, mask in runs:
        assert torch.equal(y, plain) and torch.equal(mask, plain_mask)
    bits = _impl.mask_to_bits(plain_mask.cpu(), tuple(g.out_shape), False)
    assert torch.equal(bits, (plain.view(torch.float32) > 0).cpu())


# One-row tiles over the whole row at widths whose rows start at different
# places in a 16-byte unit: 126 columns (every other row 8 bytes in), 124
# (none, or every row with y 8 bytes off), 66 under two channel tiles,
# stride 2 with padding and 45 channels.
ALIGN_CASES = [
    ((3, 8, 20, 128), (64, 8, 3, 3), 1, 0, 1),
    ((2, 5, 9, 126), (64, 5, 3, 3), 1, 0, 1),
    ((2, 3, 7, 68), (70, 3, 3, 3), 1, 0, 1),
    ((2, 4, 15, 251), (45, 4, 3, 3), 2, 1, 1),
]


@gpu
@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("case", range(len(ALIGN_CASES)), ids=[f"align{i}" for i in range(4)])
def test_fused_forward_bits_do_not_depend_on_where_y_starts(case, precision):
    """y 0, 1, 2 and 3 elements into a poisoned buffer (each row's store
    path follows its alignment: 16-byte vectors, the shifted units, 8-byte
    or single stores; with the default seams rule): every element written,
    the output bit for bit and the mask equal across the four, the mask
    agreeing with y > 0, within the float64 bound; one and three passes."""
    forward, g, (x, w, b) = _forward_at(ALIGN_CASES[case], 400 + case, precision)
    (y0, m0), *rest = [forward(offset) for offset in (0, 1, 2, 3)]
    for y, mask in rest:
        assert torch.equal(y, y0) and torch.equal(mask, m0)
    bits = _impl.mask_to_bits(m0.cpu(), tuple(g.out_shape), False)
    assert torch.equal(bits, (y0.view(torch.float32) > 0).cpu())
    _, _, stride, padding, dilation = ALIGN_CASES[case]
    ref, tol = bound(x, w, b, stride, padding, dilation, torch.float32, precision == "tf32")
    err = (y0.view(torch.float32).double() - ref).abs()
    assert (err <= tol).all(), f"{(err / tol).max().item():.2f}x the bound"


@gpu
def test_fused_error_within_10x_eager_at_the_reference_shape():
    """The issue's accuracy class: max error against float64 at most 10x eager's
    (reduced batch of the reference shape)."""
    torch.backends.cudnn.allow_tf32 = False
    try:
        conv2 = torch.nn.Conv2d(8, 64, 3).cuda()
        w, b = conv2.weight.detach(), conv2.bias.detach()
        x = torch.randn(8, 8, 128, 128, device="cuda")
        ref = block(x.double(), w.double(), b.double())
        eager = (block(x, w, b).double() - ref).abs().max().item()
        y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, algorithm="fused")
        ours = (y.double() - ref).abs().max().item()
    finally:
        torch.backends.cudnn.allow_tf32 = True
    assert ours <= 10 * eager, (ours, eager)


@gpu
def test_exact_is_bit_identical_to_eager():
    x, w, b = _xwb((3, 5, 21, 19), (7, 5, 3, 3), "cuda")
    ref = block(x, w, b, 1, 1)
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 1, 1)
    testing.assert_bits_equal(y, ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_non_finite_inputs_propagate_as_in_eager(dtype, cl):
    x, w, b = _xwb((2, 4, 16, 20), (6, 4, 3, 3), "cuda", dtype)
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), device="cuda")[:12]] = float("nan")
    flat[torch.randperm(flat.numel(), device="cuda")[:12]] = float("inf")
    flat[torch.randperm(flat.numel(), device="cuda")[:12]] = float("-inf")
    x, w = _layout(x, cl), _layout(w, cl)
    ref = block(x.double(), w.double(), b.double(), 1, 1)
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 1, 1, algorithm="fused").double()
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y == float("inf"), ref == float("inf"))
    assert torch.equal(y == float("-inf"), ref == float("-inf"))


def _fused_with_mask(x, w, b, stride=1, padding=0, dilation=1, tf32=False):
    s, p, d = stride, padding, dilation
    return conv.fused_forward(x, w, b, DIVISOR, SLOPE, (s, s), (p, p), (d, d), tf32, True)


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize(
    "xs, ws, padding",
    [
        ((3, 5, 21, 19), (7, 5, 3, 3), 1),  # plane 399: runs cross channels
        ((2, 3, 8, 8), (33, 3, 3, 3), 0),  # plane 36, 33 channels
        ((1, 2, 5, 5), (70, 2, 3, 3), 0),  # plane 9 < 32: every run is broken
        ((4, 8, 32, 32), (64, 8, 3, 3), 1),  # aligned: whole words
        ((2, 8, 130, 3), (96, 8, 1, 1), 0),  # two column tiles
        ((2, 3, 41, 50), (9, 3, 3, 3), 0),  # 2 x 64 tiles, the last one row short
        ((1, 4, 7, 130), (70, 4, 3, 3), 1),  # 1 x 128 tiles, 2 across, 2 channel tiles
        ((2, 2, 5, 100), (5, 2, 3, 3), 0),  # rows of 98 in 128-column tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mask_decodes_to_the_backward_bits(xs, ws, padding, cl, dtype):
    """The mask bit is set exactly where the output is > 0 (slope > 0), in the
    output's memory order, and the bits past the end are 0."""
    x, w, b = _xwb(xs, ws, "cuda", dtype)
    x, w = _layout(x, cl), _layout(w, cl)
    y, mask = _fused_with_mask(x, w, b, 1, padding)
    cl_out = _impl.is_channels_last(y)
    assert mask.numel() == mask_nbytes(y.numel())
    bits = _impl.mask_to_bits(mask.cpu(), tuple(y.shape), cl_out)
    assert torch.equal(bits, (y > 0).cpu())
    tail = _impl.unpack_bits(mask.cpu(), mask.numel() * 8)[y.numel() :]
    assert not tail.any()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("upstream", ["all", "negative"])
def test_fused_gradients_match_eager(dtype, cl, with_bias, upstream):
    """Gradients of x, weight and bias within FP32 (bfloat16) accuracy of eager's;
    what autograd saves is x, the weight and a 1-bit mask. ``negative``: dy
    only where the output is negative, so that the whole gradient goes
    through the slope (a wrong slope cannot hide in the norm)."""
    torch.backends.cudnn.allow_tf32 = False
    try:
        x0, w0, b0 = _xwb((2, 6, 23, 17), (10, 6, 3, 3), "cuda", dtype)
        x0, w0 = _layout(x0, cl), _layout(w0, cl)
        b0 = b0 if with_bias else None
        gy = torch.randn(2, 10, 12, 9, device="cuda", dtype=dtype)
        if upstream == "negative":
            gy = negative_only(gy, x0, w0, b0, 2, 1)
        grads = []
        for alg in ("reference", "fused"):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            b = None if b0 is None else b0.clone().requires_grad_()
            if alg == "reference":
                y = block(x, w, b, 2, 1)
            else:
                y, sizes = testing.saved_sizes(
                    lambda: ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 2, 1, 1, alg)
                )
                mask_bytes = mask_nbytes(y.numel())
                assert sorted(n * t.itemsize for t, n in sizes) == sorted(
                    [x.numel() * x.element_size(), w.numel() * w.element_size(), mask_bytes]
                )
            y.backward(gy)
            grads.append([t.grad for t in (x, w, b) if t is not None])
    finally:
        torch.backends.cudnn.allow_tf32 = True
    rtol = 1e-4 if dtype == torch.float32 else 3e-2
    for ours, ref in zip(grads[1], grads[0]):
        rel = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel <= rtol, rel


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fused", "fused_tf32"])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_training_forward_zeroes_its_mask_on_poisoned_memory(tf32, cl):
    """The eager training forward's and the custom op's mask (torch.empty,
    zeroed by one driver call before the launch) and output are those of the
    launch into a mask from torch.zeros, bit for bit, where the allocator
    hands the mask out of blocks freed full of ones."""
    x, w, b = _xwb((3, 8, 30, 34), (16, 8, 3, 3), "cuda")
    x = _layout(x, cl)
    g = _conv.geometry("f", x.shape, w.shape)
    fmt = torch.channels_last if cl else torch.contiguous_format
    y_ref = torch.empty(g.out_shape, device="cuda", memory_format=fmt)
    m_ref = torch.zeros(mask_nbytes(y_ref.numel()), dtype=torch.uint8, device="cuda")
    ptrs = (x.data_ptr(), w.data_ptr(), b.data_ptr(), y_ref.data_ptr(), m_ref.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    precision = "tf32" if tf32 else "fp32"
    have = tuple(t.numel() * t.element_size() for t in (x, w, b, y_ref, m_ref))
    _conv.launch(0, "float32", precision, cl, g, stream, *ptrs, SLOPE, DIVISOR, "f", have=have)
    assert m_ref.any()  # (a mask of zeros would hide a missing memset)
    w = w.requires_grad_()
    for _ in range(3):
        for path in ("training", "custom op"):
            junk = [torch.full_like(m_ref, 255) for _ in range(16)]
            del junk  # (freed: the mask's allocation reuses one of these blocks)
            if path == "training":
                y = ct.conv2d_div_leaky_relu(
                    x, w, b, DIVISOR, SLOPE, algorithm="fused_tf32" if tf32 else "fused"
                )
                _, _, mask = y.grad_fn.saved_tensors
            else:
                spd = ((1, 1), (0, 0), (1, 1))
                y, mask = conv.fused_forward(x, w, b, DIVISOR, SLOPE, *spd, tf32, True)
            assert torch.equal(mask, m_ref), path
            testing.assert_bits_equal(y, y_ref, path)


@gpu
def test_fused_input_without_grad_skips_the_input_gradient():
    x, w, b = _xwb((2, 3, 9, 11), (5, 3, 3, 3), "cuda")
    w.requires_grad_()
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused").sum().backward()
    assert x.grad is None and w.grad is not None


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fused", "fused_tf32"])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("need", ["xwb", "wb", "x", "xw"])
def test_eager_training_is_the_custom_ops_bit_for_bit(need, cl, tf32):
    """Eager training runs the fused block as a plain autograd.Function (no
    custom-op dispatch): the same saved tensors and the same gradients, bit
    for bit, as through conv.fused_op (what torch.compile and torch.func
    take), whichever of x, the weight and the bias need one."""
    x0, w0, b0 = _xwb((2, 8, 20, 130), (16, 8, 3, 3), "cuda")
    x0, w0 = _layout(x0, cl), _layout(w0, cl)
    gy = _layout(torch.randn(2, 16, 18, 128, device="cuda"), cl)
    algorithm = "fused_tf32" if tf32 else "fused"
    results = []
    for route in ("eager", "op"):
        x, w, b = (t.clone().requires_grad_(k in need) for t, k in zip((x0, w0, b0), "xwb"))
        if route == "eager":
            y, sizes = testing.saved_sizes(
                lambda: ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, algorithm=algorithm)
            )
            assert type(y.grad_fn).__name__ == "_FusedEagerBackward"
        else:
            args = (x, w, b, DIVISOR, SLOPE, [1, 1], [0, 0], [1, 1], tf32, True)
            y, sizes = testing.saved_sizes(lambda: conv.fused_op(*args)[0])
        wrt = [t for t in (x, w, b) if t.requires_grad]
        saved = sorted(n * t.itemsize for t, n in sizes)
        results.append((y, saved, torch.autograd.grad(y, wrt, gy)))
    (ye, saved_e, grads_e), (yo, saved_o, grads_o) = results
    testing.assert_bits_equal(ye, yo)
    assert saved_e == saved_o
    for a, e in zip(grads_e, grads_o):
        testing.assert_bits_equal(a, e)


@gpu
def test_eager_training_refuses_a_second_derivative():
    """A second derivative through the fused block raises (its backward is
    once differentiable: the kernels have no derivative), not a silent zero."""
    x, w, b = _xwb((2, 3, 9, 11), (5, 3, 3, 3), "cuda")
    w.requires_grad_()
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused")
    (gw,) = torch.autograd.grad((y * y).sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gw.sum().backward()


@gpu
def test_fused_under_torch_compile_and_opcheck():
    x, w, b = _xwb((2, 3, 16, 16), (8, 3, 3, 3), "cuda")

    def f(x, w, b):
        return ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, 1, 1, algorithm="fused")

    compiled = torch.compile(f, fullgraph=True)
    testing.assert_bits_equal(compiled(x, w, b), f(x, w, b))
    xs = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled(*xs).sum().backward()
    xe = [t.clone().requires_grad_() for t in (x, w, b)]
    f(*xe).sum().backward()
    for a, e in zip(xs, xe):  # (the compiled graph may sum the bias gradient its own way)
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-6, atol=1e-6)
    args = (x, w, b, DIVISOR, SLOPE, [1, 1], [1, 1], [1, 1], False, True)
    torch.library.opcheck(conv.fused_op, args, test_utils=("test_schema", "test_faketensor"))


@gpu
def test_fused_in_a_cuda_graph():
    x, w, b = _xwb((2, 3, 16, 16), (8, 3, 3, 3), "cuda")
    eager = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused")  # compile and load first
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    testing.assert_bits_equal(out, ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused"))
    assert not torch.equal(out, eager)


def test_interleaved_timing_rotates_the_order(monkeypatch):
    """Each round in an order of its own: no candidate always follows the
    same one (what ran before can slow a call), each is timed once per
    round, and the orders are the same from call to call. (Events faked:
    runs without a GPU.)"""
    calls = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            self.at = len(calls)

        def elapsed_time(self, other):
            return float(other.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    names = ["a", "b", "c"]
    times = testing.interleaved_median_ms({n: functools.partial(calls.append, n) for n in names},
                                          rounds=6, warmup=1)  # fmt: skip
    assert times == {n: 1.0 for n in names}
    timed = calls[len(names) :]
    rounds = [timed[i : i + 3] for i in range(0, len(timed), 3)]
    assert all(sorted(r) == names for r in rounds)
    before = {n: {r[r.index(n) - 1] for r in rounds if r[0] != n} for n in names}
    assert all(before[n] == set(names) - {n} for n in names), before
    calls.clear()
    testing.interleaved_median_ms({n: functools.partial(calls.append, n) for n in names},
                                  rounds=6, warmup=1)  # fmt: skip
    assert calls[len(names) :] == timed


@gpu
def test_auto_picks_a_candidate_and_caches_it():
    x, w, b = _xwb((4, 8, 32, 32), (16, 8, 3, 3), "cuda")
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    picked = [v for k, v in conv.auto_choices().items() if k[2] == tuple(x.shape)]
    assert len(picked) == 1 and picked[0] in conv.candidates(torch.float32, False)
    testing.assert_bits_equal(y, ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm=picked[0]))


@gpu
def test_auto_looks_its_choice_up_per_kind_of_call(monkeypatch):
    """A call of "auto" finds its choice in its kind of call's entry
    (conv._checked's) and times nothing again; cuDNN's TF32 switch and x's
    layout, which that kind does not hold, each make a choice of their own."""
    x, w, b = _xwb((2, 8, 21, 19), (16, 8, 3, 3), "cuda")  # (a shape of its own)
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    timed = []

    def timing(fns):
        timed.append(list(fns))
        return {name: 1.0 for name in fns}

    monkeypatch.setattr(_timing, "interleaved_median_ms", timing)
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    c = conv._checked(x, w, b, DIVISOR, 0.01, 1, 0, 1, "auto")
    assert timed == [] and len(c.choices) == 1
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", not torch.backends.cudnn.allow_tf32)
    ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    assert len(timed) == 1 and len(c.choices) == 2
    ct.conv2d_div_leaky_relu(_layout(x, True), w, b, DIVISOR, algorithm="auto")
    assert len(timed) == 2 and len(c.choices) == 3


@pytest.fixture
def deterministic_cudnn(monkeypatch):
    """cuDNN's deterministic algorithms (its weight gradient may otherwise sum
    in a different order run to run)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


@gpu
@pytest.mark.usefixtures("deterministic_cudnn")
def test_auto_times_forward_and_backward_when_training():
    """A call that needs a gradient is chosen by forward + backward time, in its
    own cache entry, on detached views: the caller's gradients come only from
    its own backward, equal to the picked algorithm's, and its random state
    is not drawn from."""
    x, w, b = _xwb((4, 8, 30, 30), (16, 8, 3, 3), "cuda")
    w.requires_grad_(True), b.requires_grad_(True)
    state = torch.cuda.get_rng_state()
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert w.grad is None and b.grad is None
    entries = {k[-1]: v for k, v in conv.auto_choices().items() if k[2] == tuple(x.shape)}
    # keyed by which of (x, weight, bias) need a gradient
    assert set(entries) == {(False, True, True)}, entries
    picked = entries[(False, True, True)]
    assert picked in conv.candidates(torch.float32, False)
    gy = torch.randn_like(y)
    y.backward(gy)
    w2, b2 = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    y2 = ct.conv2d_div_leaky_relu(x, w2, b2, DIVISOR, algorithm=picked)
    y2.backward(gy)
    testing.assert_bits_equal(y, y2)
    testing.assert_bits_equal(w.grad, w2.grad)
    testing.assert_bits_equal(b.grad, b2.grad)
    with torch.no_grad():
        ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="auto")
    # x needing a gradient too is a choice of its own (the input gradient's
    # kernels join the backward)
    ct.conv2d_div_leaky_relu(x.requires_grad_(), w, b, DIVISOR, algorithm="auto")
    entries = {k[-1] for k in conv.auto_choices() if k[2] == tuple(x.shape)}
    assert entries == {None, (False, True, True), (True, True, True)}, entries


@gpu
def test_fused_falls_back_where_it_does_not_apply():
    """float64 and an asymmetric 'same' padding run the exact path: bit for bit eager."""
    x, w, b = _xwb((2, 3, 9, 11), (5, 3, 3, 3), "cuda", torch.float64)
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, algorithm="fused")
    testing.assert_bits_equal(y, block(x, w, b))
    x, w, b = _xwb((2, 3, 9, 11), (5, 3, 2, 2), "cuda")
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, padding="same", algorithm="fused")
    testing.assert_bits_equal(y, block(x, w, b, padding="same"))


@gpu
def test_empty_batch():
    x, w, b = _xwb((0, 3, 9, 11), (5, 3, 3, 3), "cuda")
    y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, algorithm="fused")
    assert y.shape == (0, 5, 7, 9)


@gpu
@pytest.mark.parametrize("algorithm", ["fused", "fused_tf32"])
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
def test_fused_forward_of_strided_views_is_that_of_dense_copies(algorithm, cl):
    """x, weight and bias as strided views (every other column, a weight in
    the wrong memory order, every other bias) give the bits their dense copies
    give; a channels-last x keeps its layout, a strided one comes out NCHW."""
    x, w, b = _xwb((2, 5, 19, 46), (9, 5, 3, 3), "cuda")
    x = _layout(x, cl)
    b2 = torch.randn(18, device="cuda")
    views = {
        "x": (x[..., ::2], w, b),
        "weight": (x, w.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3), b),
        "bias": (x, w, b2[::2]),
    }
    for name, (xv, wv, bv) in views.items():
        assert not {"x": xv, "weight": wv, "bias": bv}[name].is_contiguous()
        # (a dense x as it is: its layout picks the kernel)
        dense = (xv.contiguous() if name == "x" else xv, wv.contiguous(), bv.contiguous())
        with torch.no_grad():
            y = ct.conv2d_div_leaky_relu(xv, wv, bv, DIVISOR, SLOPE, algorithm=algorithm)
            ref = ct.conv2d_div_leaky_relu(*dense, DIVISOR, SLOPE, algorithm=algorithm)
        testing.assert_bits_equal(y.contiguous(), ref.contiguous())
        assert y.is_contiguous() == (not cl or name == "x"), name


@gpu
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_cupy_entry_matches_the_torch_path(cl, precision):
    import cupy

    import cupy_act

    x, w, b = _xwb((2, 5, 19, 23), (9, 5, 3, 3), "cuda")
    x = _layout(x, cl)
    y_t, m_t = _fused_with_mask(x, w, b, 2, 1, 1, tf32=precision == "tf32")
    cx = cupy.from_dlpack(x)
    cw, cb = cupy.from_dlpack(w), cupy.from_dlpack(b)
    y, mask = cupy_act.conv2d_div_leaky_relu(
        cx, cw, cb, DIVISOR, SLOPE, 2, 1, precision=precision, with_mask=True
    )
    assert y.shape == tuple(y_t.shape) and y.strides == tuple(s * 4 for s in y_t.stride())
    testing.assert_bits_equal(torch.from_dlpack(y), y_t)
    assert torch.equal(torch.from_dlpack(mask), m_t)
    with pytest.raises(ValueError, match="precision='fp16'"):
        cupy_act.conv2d_div_leaky_relu(cx, cupy.from_dlpack(w), None, DIVISOR, precision="fp16")
    with pytest.raises(TypeError, match="float64"):
        cupy_act.conv2d_div_leaky_relu(cx.astype(cupy.float64), cupy.from_dlpack(w), None, DIVISOR)


@gpu
def test_conv_bench_script(tmp_path):
    """scripts/conv_bench.py runs end to end (one small shape, no compile)."""
    from conftest import run_json

    args = ["--no-compile", "--shapes", "16to32", "--iters", "2"]
    out = run_json(
        "conv_bench.py", [*args, "--markdown", str(tmp_path / "c.md")], tmp_path / "c.json"
    )
    impls = [r["impl"] for r in out["rows"]]
    forced = [f"{a} {s}" for s in ("wgrad-kernel", "mask-bwd") for a in ("fused", "fused_tf32")]
    assert impls == ["eager", "exact", "channels_last", "fused", "fused_tf32", "auto", *forced]
    assert all(r["forward_ms"] > 0 and r["max_err"] < 1e-2 for r in out["rows"])
    assert all(r["w_bwd_ms"] > 0 and r["w_fwd_bwd_ms"] > 0 for r in out["rows"])
    for key in ("forward", "fwd_bwd", "w_fwd_bwd", "w_bwd"):  # the queued sleep not timed
        assert all(0 < r[f"{key}_gpu_ms"] < 4.0 for r in out["rows"]), key
    assert sorted(out["floors"]) == ["function backward", "function forward", "launch"]
    # (ms: a floor in us would read 15 or more. Beside four other test
    # processes one run fell outside (0, 1 ms); the host's share is clipped at 0)
    assert all(0 <= v < 5.0 for v in out["floors"].values())
    (auto,) = [r for r in out["rows"] if r["impl"] == "auto"]
    for key in ("forward", "fwd_bwd"):  # auto's pick timed again: the comparison's control
        assert auto[f"{key}_pick"] in ("exact", "fused") and auto[f"{key}_il_again_ms"] > 0
    assert sum("its pick against itself" in t["what"] for t in out["targets"]) == 2
    text = (tmp_path / "c.md").read_text()
    assert "| 16to32 | fused |" in text and "| function backward |" in text
