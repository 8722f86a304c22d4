"""The fused convolution kernels (``cuda/conv2d.cu``, the forward;
``cuda/conv2d_wgrad.cu``, the weight and bias gradients;
``cuda/conv2d_dgrad.cu``, the input gradient): geometry checks,
lazy compilation and the launches, on raw device pointers (no CuPy or torch
arrays).

One ``cupy.RawModule`` per dtype and source, compiled on the first call that
needs it (the forward's on the first fused call in that dtype, the weight
gradient's on the first fused backward), separate from the elementwise
modules (the first activation call never pays for them). The array-level
entry (``cupy_act.conv``) and the torch adapter (``cupy_act.torch.conv``)
check their arrays, allocate, and call ``launch`` / ``launch_wgrad`` /
``launch_dgrad``.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from typing import NamedTuple

from . import _launch, _loader, _tensormap
from ._kernels import CTYPES, ITEMSIZE
from ._scalars import kernel_scalars

SOURCE = "conv2d.cu"
WGRAD_SOURCE = "conv2d_wgrad.cu"
DGRAD_SOURCE = "conv2d_dgrad.cu"
THREADS = 128  # kConvThreads
TILE_M, TILE_N = 128, 64  # output positions x output channels per block (kBM, kBN)
DTYPES = ("float32", "float16", "bfloat16")  # float64 stays on PyTorch's convolution
PRECISIONS = ("fp32", "tf32")
_INT32 = 2**31


def passes(dtype: str, precision: str) -> int:
    """TF32 passes per product: 3 (the 3xTF32 split) for float32 at "fp32"
    precision, else 1 (16-bit inputs are exact in TF32, see conv2d.cu)."""
    return 3 if dtype == "float32" and precision == "fp32" else 1


def kernel_name(dtype: str, n_passes: int, channels_last: bool) -> str:
    """The C++ name expression of one instantiation."""
    cl = "true" if channels_last else "false"
    return f"cupy_act::conv2d_kernel<{CTYPES[dtype]}, {n_passes}, {cl}>"


def module_keys(dtype: str) -> tuple[tuple[str, int, bool], ...]:
    """(dtype, passes, channels_last) of the instantiations in dtype's module."""
    counts = (3, 1) if dtype == "float32" else (1,)
    return tuple((dtype, n, cl) for n in counts for cl in (False, True))


def forward_kernel_names(dtype: str) -> tuple[str, ...]:
    """The forward module's instantiations for ``dtype``: the kernel per key
    of ``module_keys``, then per NCHW key its version with the ring's rows by
    tensor copies (``forward_tmap``)."""
    keys = module_keys(dtype)
    tmap = tuple(
        f"cupy_act::conv2d_kernel_tmap<{CTYPES[dtype]}, {n}>" for _, n, cl in keys if not cl
    )
    return (*(kernel_name(*k) for k in keys), *tmap)


def all_kernel_names() -> tuple[str, ...]:
    """Every fused-convolution forward instantiation, for the NVRTC checks."""
    return tuple(n for d in DTYPES for n in forward_kernel_names(d))


def wgrad_kernel_names(dtype: str) -> tuple[str, ...]:
    """The weight-gradient module's instantiations for ``dtype``: the main
    kernel per (passes, channels_last) of ``module_keys``, then its bulk-copy
    version (sm_90, NCHW: ``wgrad_bulk``) per NCHW key, then the bulk-copy
    version by tensor copies (``wgrad_tmap``) per NCHW key, then per NCHW key
    the sm_90a kernel on warpgroup MMAs (``wgrad_wgmma``) with dy by plain
    loads, by bulk copies and by tensor copies, then the finish."""
    t = CTYPES[dtype]
    keys = module_keys(dtype)
    main = tuple(
        f"cupy_act::conv2d_wgrad_kernel<{t}, {n}, {'true' if cl else 'false'}, 0>"
        for _, n, cl in keys
    )
    bulk = tuple(
        f"cupy_act::conv2d_wgrad_kernel<{t}, {n}, false, {WGRAD_STAGES}>"
        for _, n, cl in keys
        if not cl
    )
    tmap = tuple(
        f"cupy_act::conv2d_wgrad_kernel_tmap<{t}, {n}, {WGRAD_STAGES}>"
        for _, n, cl in keys
        if not cl
    )
    wg = tuple(
        name
        for _, n, cl in keys
        if not cl
        for name in (
            f"cupy_act::conv2d_wgrad_kernel_wg<{t}, {n}, 0>",
            f"cupy_act::conv2d_wgrad_kernel_wg<{t}, {n}, 1>",
            f"cupy_act::conv2d_wgrad_kernel_wg_tmap<{t}, {n}>",
        )
    )
    return (*main, *bulk, *tmap, *wg, f"cupy_act::conv2d_wgrad_finish<{t}>")


def all_wgrad_kernel_names() -> tuple[str, ...]:
    """Every weight-gradient instantiation, for the NVRTC checks."""
    return tuple(n for d in DTYPES for n in wgrad_kernel_names(d))


def dgrad_kernel_names(dtype: str) -> tuple[str, ...]:
    """The input-gradient module's instantiations for ``dtype``: the kernel
    per key of ``module_keys`` (dy by plain loads), then for 16-bit types
    the NCHW one with dy staged in shared memory by asynchronous copies
    (``dgrad_staged``)."""
    t = CTYPES[dtype]
    keys = module_keys(dtype)
    plain = tuple(
        f"cupy_act::conv2d_dgrad_kernel<{t}, {n}, {str(cl).lower()}, false>" for _, n, cl in keys
    )
    staged = tuple(
        f"cupy_act::conv2d_dgrad_kernel<{t}, {n}, false, true>"
        for _, n, cl in keys
        if ITEMSIZE[dtype] == 2 and not cl
    )
    return plain + staged


def all_dgrad_kernel_names() -> tuple[str, ...]:
    """Every input-gradient instantiation, for the NVRTC checks."""
    return tuple(n for d in DTYPES for n in dgrad_kernel_names(d))


class Geometry(NamedTuple):
    """One convolution's sizes, checked (groups = 1, symmetric zero padding)."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    oh: int
    ow: int

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cout, self.oh, self.ow)


def pair(value, name: str, fname: str, least: int) -> tuple[int, int]:
    """An int or a pair of ints, each at least ``least``, as a pair."""
    items = value if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= least for v in items
    ):
        raise ValueError(f"{fname}: {name}={value!r}; expected an int >= {least} or a pair of them")
    return int(items[0]), int(items[1])


_geometries: dict[tuple, Geometry] = {}


def _plain(value):
    """``value`` as part of a geometry's cache key: an int or a pair of ints
    (of type int exactly: True must not pass for 1), else None (not cached)."""
    if type(value) is int:
        return value
    if type(value) in (tuple, list) and len(value) == 2:
        if type(value[0]) is int and type(value[1]) is int:
            return (value[0], value[1])
    return None


def geometry(fname: str, x_shape, w_shape, stride=1, padding=0, dilation=1) -> Geometry:
    """Check shapes and hyper-parameters as ``F.conv2d`` would (groups = 1) and
    work out the output size; ValueError names what is wrong. Kept per set of
    arguments (a training step asks four times): only what passed the checks
    is kept, and symbolic sizes (torch.compile) are never kept."""
    parts = (_plain(stride), _plain(padding), _plain(dilation))
    key = None
    if None not in parts:
        key = (tuple(x_shape), tuple(w_shape), *parts)
        try:
            g = _geometries.get(key)
        except TypeError:  # unhashable (symbolic) sizes
            g = key = None
        if g is not None:
            return g
    g = _geometry(fname, x_shape, w_shape, stride, padding, dilation)
    if key is not None and all(type(v) is int for v in key[0] + key[1]):
        if len(_geometries) >= 256:
            _geometries.clear()
        _geometries[key] = g
    return g


def _geometry(fname: str, x_shape, w_shape, stride, padding, dilation) -> Geometry:
    """geometry(), uncached."""
    if len(x_shape) != 4:
        raise ValueError(f"{fname}: input must be 4-D (N, C, H, W), got shape {tuple(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(
            f"{fname}: weight must be 4-D (out_channels, in_channels, kH, kW), "
            f"got shape {tuple(w_shape)}"
        )
    n, cin, h, w = (int(v) for v in x_shape)
    cout, wcin, kh, kw = (int(v) for v in w_shape)
    if wcin != cin:
        raise ValueError(
            f"{fname}: weight has {wcin} input channels (shape {tuple(w_shape)}), input has "
            f"{cin} (shape {tuple(x_shape)}); groups other than 1 are not supported"
        )
    if min(cout, kh, kw, cin) < 1:
        raise ValueError(f"{fname}: weight shape {tuple(w_shape)} has an empty dimension")
    s = pair(stride, "stride", fname, 1)
    p = pair(padding, "padding", fname, 0)
    d = pair(dilation, "dilation", fname, 1)
    oh = (h + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    ow = (w + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    if oh < 1 or ow < 1:
        raise ValueError(
            f"{fname}: the output would be {oh} x {ow}: input {h} x {w} with padding {p} "
            f"is smaller than the dilated kernel ({d[0] * (kh - 1) + 1} x {d[1] * (kw - 1) + 1})"
        )
    return Geometry(n, cin, h, w, cout, kh, kw, s, p, d, oh, ow)


class Extents(NamedTuple):
    """Bytes the kernels of one geometry may index from each address: x, the
    weight (and its gradient), the bias (and its gradient), y (and dy), and
    the mask, whose bits cover y's elements in 32-bit words."""

    x: int
    w: int
    bias: int
    y: int
    mask: int


def extents(g: Geometry, dtype: str) -> Extents:
    """The ``Extents`` of geometry ``g`` in ``dtype``."""
    item = ITEMSIZE[dtype]
    outputs = g.n * g.cout * g.oh * g.ow
    return Extents(
        g.n * g.cin * g.h * g.w * item, g.cout * g.cin * g.kh * g.kw * item, g.cout * item,
        outputs * item, 4 * -(-outputs // 32),
    )  # fmt: skip


def check_extents(what: str, g: Geometry, named) -> None:
    """The launchers' second line of defence: ``_launch.SizeMismatch`` where an
    address of ``named`` ((name, address, bytes it has, bytes the kernel may
    index), ...) is not 0 and has fewer bytes than the kernel would index."""
    short = [f"{name} has {have} bytes, needs {need}" for name, ptr, have, need in named
             if ptr and have < need]  # fmt: skip
    if short:
        raise _launch.SizeMismatch(f"cupy_act {what} launch refused ({g}): {'; '.join(short)}")


def fits(g: Geometry, n_passes: int) -> bool:
    """Whether the kernel applies: 32-bit offsets within one image and filter,
    and a tiling whose shared memory the device allows (else PyTorch's path)."""
    return (
        g.cin * g.h * g.w < _INT32
        and g.cout * g.cin * g.kh * g.kw < _INT32
        and tiling(g, n_passes) is not None
    )


class Tiling(NamedTuple):
    """How one block covers its 128 x 64 output tile (see conv2d.cu)."""

    c_log2: int  # columns C = 2^c_log2 of the output rectangle; rows 128 / C
    tiles_h: int  # rectangles per image, down and across
    tiles_w: int
    cc: int  # input channels per chunk
    kc_pad: int  # cc * kh * kw rounded up to 8
    patch_h: int  # input patch rows and columns per channel
    patch_w: int
    smem: int  # dynamic shared memory, bytes


EPILOGUE_FLOATS = max(TILE_M * (TILE_N + 4), TILE_N * (TILE_M + 4))  # kEpilogueFloats
EPILOGUE_BYTES = 4 * EPILOGUE_FLOATS
AFTER_PATCH_WORDS = TILE_N * 5  # kAfterPatchWords: a tile's mask words, the bias (wgmma)
WEIGHT_STRIDE = 72  # kWeightStride: words per depth row of the weights
PATCH_PART = 4096  # kPatchPart: words of the patch per part, with three passes
WEIGHT_PART = 72 * WEIGHT_STRIDE  # kWeightPart: the weights' part (depth <= 72)
# Shared memory per block that lets the registers' occupancy fit an sm_90 SM
# (228 KiB, 1 KiB reserved per block): four blocks with one pass, three with
# three (conv2d.cu's launch bounds).
SMEM_TARGET = {1: 56 * 1024, 3: 76800}
SMEM_MAX = 99 * 1024  # the most every sm_80+ device gives one block
SEAM_STRIDE = 36  # kSeamStride: floats per channel's line in the row seams' buffer
SEAM_BYTES = 4 * 2 * TILE_N * SEAM_STRIDE  # kSeamFloats, after the weights
# The most shared memory a block of the float32 wgmma forward takes with its
# seam buffer: three blocks per SM (its launch bounds), 1 KiB each reserved.
SEAM_SMEM_MAX = 75 * 1024
# The float32 one-pass forward's row seams on sm_90a (conv2d.cu's
# forward_tiles: the line two rows share stored whole): None where they were
# measured to pay (seams_pay), True wherever the kernel takes them, False
# never (each tile stores its rows' end lines; tests compare the two).
FORWARD_SEAMS: bool | None = None


def seams_pay(device_name: str, ow: int) -> bool:
    """Where the row seams made the TF32 forward faster
    (``scripts/forward_stores.py --seams``): on an H100 (80GB HBM3), widths
    of 102 to 126 that are 2 mod 4 (every other row starts 8 bytes into a
    16-byte unit): 9-10% at 118 and 126 columns, 5% at 110, 1% at 106, none
    at 98. They cost 2-9% at the H100's other widths measured (66, 80, 112,
    124: the stem's and the 5x5 shape's among them) and 3-14% at every width
    measured on an H200, whose forward loses little to the lines two rows
    share."""
    return "H100" in device_name and 100 < ow < 128 and ow % 4 == 2


def _layouts(g: Geometry):
    """The tilings to try, best first: (c_log2, patch rows, patch columns,
    channels per chunk, padded depth, patch words with the zero plane) for
    the widest rectangle (C = 128, 64 or 32, at least the output width where
    possible) down to C = 32, and per rectangle the fewest, evenly sized
    channel chunks first."""
    c_log2 = 5 if g.ow <= 32 else 6 if g.ow <= 64 else 7
    for c in range(c_log2, 4, -1):
        rows = TILE_M >> c
        ph = (rows - 1) * g.stride[0] + (g.kh - 1) * g.dilation[0] + 1
        pw = ((1 << c) - 1) * g.stride[1] + (g.kw - 1) * g.dilation[1] + 1
        for cc in range(min(g.cin, 64), 0, -1):
            cc = -(-g.cin // -(-g.cin // cc))  # the same chunk count, evenly split
            kc_pad = -(-cc * g.kh * g.kw // 8) * 8
            yield c, ph, pw, cc, kc_pad, (cc + 1) * ph * pw


def _tiling(g: Geometry, c: int, cc: int, kc_pad: int, ph: int, pw: int, smem: int) -> Tiling:
    tiles = (-(-g.oh // (TILE_M >> c)), -(-g.ow // (1 << c)))
    return Tiling(c, *tiles, cc, kc_pad, ph, pw, smem)


def _forward_words(n_passes: int, cc: int, kc_pad: int, ph: int, pw: int) -> tuple[int, int, int]:
    """The forward's shared-memory parts, in words after koff: the patch (both
    parts with three passes), the region (the patch, a tile's mask words and
    the bias, or the epilogue tile in their place; rounded up so that the
    weights start 16-byte aligned, as conv2d.cu does) and the weights."""
    patch = 2 * PATCH_PART if n_passes == 3 else (cc + 1) * ph * pw
    region = -(-max(patch + AFTER_PATCH_WORDS, EPILOGUE_FLOATS) // 4) * 4
    return patch, region, 2 * WEIGHT_PART if n_passes == 3 else kc_pad * WEIGHT_STRIDE


def _forward_smem(n_passes: int, cc: int, kc_pad: int, ph: int, pw: int) -> int | None:
    """The forward's shared memory (bytes) for a patch of ph rows of pw words
    per channel; None where three passes cannot keep the small parts at their
    fixed distances (conv2d.cu: the patch part within PATCH_PART words, the
    depth per chunk within 72)."""
    if n_passes == 3 and ((cc + 1) * ph * pw > PATCH_PART or kc_pad > 72):
        return None
    _, region, weights = _forward_words(n_passes, cc, kc_pad, ph, pw)
    return 4 * (kc_pad + region + weights)


# The forward's ring rows by tensor copies (conv2d_kernel_tmap); False keeps
# the cp.async staging (tests compare the two).
FORWARD_TMAP = True


def forward_tmap(g: Geometry, tl: Tiling, n_passes: int, itemsize: int, x: int, sm: int) -> bool:
    """Whether the sm_90a forward (NCHW; ``sm`` 90) brings the ring's new rows
    by one tensor copy per tile (conv2d.cu's tma), x at device address ``x``:
    x 16-byte aligned, the driver encodes tensor maps, and the geometry
    allows it (``_tmap_fits``)."""
    return (
        FORWARD_TMAP
        and x % 16 == 0
        and _tmap_fits(g, tl, n_passes, itemsize, sm)
        and _tensormap.available()
    )


@functools.lru_cache(maxsize=4096)  # (per shape: on every launch's path)
def _tmap_fits(g: Geometry, tl: Tiling, n_passes: int, itemsize: int, sm: int) -> bool:
    """forward_tmap's geometry: a ring of one-row tiles in one channel chunk
    on compute capability 9.0; x's rows a whole number of 16-byte units long,
    and every box starting on a unit (the left padding a whole number of
    units); the box (cc channels, the fresh rows, PW rounded up to whole
    units) and its mbarrier in unused shared memory at a 128-byte boundary,
    as the kernel places them (after the bias, else after the weights, the
    dynamic shared memory starting on a 128-byte boundary)."""
    unit = 16 // itemsize
    if sm != 90 or tl.c_log2 != 7 or g.cin > tl.cc or tl.cc > 256:
        return False
    if g.w % unit or g.padding[1] % unit:
        return False
    length = -(-tl.patch_w // unit) * unit
    need = tl.cc * min(g.stride[0], tl.patch_h) * length * itemsize + 8
    patch, region, weights = _forward_words(n_passes, tl.cc, tl.kc_pad, tl.patch_h, tl.patch_w)
    w_used = (TILE_N * 72 if n_passes == 3 else 0) + TILE_N * tl.kc_pad
    gaps = (  # words from the start: after the bias, after the weights
        (tl.kc_pad + -(-(patch + AFTER_PATCH_WORDS) // 4) * 4, tl.kc_pad + region),
        (tl.kc_pad + region + w_used, tl.kc_pad + region + weights),
    )
    fits = any(-(-4 * lo // 128) * 128 + need <= 4 * hi for lo, hi in gaps)
    return length <= 256 and fits


def _x_map(g: Geometry, tl: Tiling, itemsize: int) -> _tensormap.TiledMap:
    """x (NCHW) as the forward's tensor map: columns (innermost), rows,
    channels, images; a box is the ring's fresh rows of the chunk's cc
    channels, PW columns rounded up to whole 16-byte units."""
    unit = 16 // itemsize
    row, plane = g.w * itemsize, g.h * g.w * itemsize
    box = (-(-tl.patch_w // unit) * unit, min(g.stride[0], tl.patch_h), tl.cc, 1)
    return _tensormap.TiledMap(itemsize, (g.w, g.h, g.cin, g.n), (row, plane, plane * g.cin), box)


def ring_staged(g: Geometry, tl: Tiling, n_passes: int, itemsize: int) -> bool:
    """Whether the sm_90a forward (NCHW) keeps the patch as a ring of rows whose
    new rows arrive by asynchronous copies into a staging area (conv2d.cu's
    stage_ok), for x 16-byte aligned: one-row tiles, one channel chunk, the
    rows' 4-element vectors lined up with the patch columns, and the staging
    area within unused shared memory (after the bias, else after the weights).
    The kernel decides for itself; tests use this to cover both ways."""
    if tl.c_log2 != 7 or g.cin > tl.cc or g.w % 4 or g.padding[1] % 4:
        return False
    patch, region, weights = _forward_words(n_passes, tl.cc, tl.kc_pad, tl.patch_h, tl.patch_w)
    stage = tl.cc * min(g.stride[0], tl.patch_h) * -(-tl.patch_w // 4) * itemsize
    w_used = (TILE_N * 72 if n_passes == 3 else 0) + TILE_N * tl.kc_pad
    at = -(-(patch + AFTER_PATCH_WORDS) // 4) * 4
    return at + stage <= region or w_used + stage <= weights


@functools.lru_cache(maxsize=4096)  # (a Python search: cached per shape)
def tiling(g: Geometry, n_passes: int) -> Tiling | None:
    """The widest rectangle (C = 128, 64 or 32, at least the output width where
    possible) and the fewest, evenly sized channel chunks whose shared memory
    stays within SMEM_TARGET (or SMEM_MAX with one pass); None if nothing fits.
    The patch rows are pw words apart here; ``launch_tiling`` spaces them for
    the launch."""
    limits = (SMEM_TARGET[n_passes],) if n_passes == 3 else (SMEM_TARGET[1], SMEM_MAX)
    for limit in limits:
        for c, ph, pw, cc, kc_pad, _ in _layouts(g):
            smem = _forward_smem(n_passes, cc, kc_pad, ph, pw)
            if smem is not None and smem <= limit:
                return _tiling(g, c, cc, kc_pad, ph, pw, smem)
    return None


@functools.lru_cache(maxsize=4096)
def launch_tiling(g: Geometry, n_passes: int, wgmma: bool = False) -> Tiling:
    """``tiling`` with the patch rows spaced for the MMA loads (``_spaced``;
    ``wgmma``: for the sm_90a kernel's, else mma.sync's) within the same
    shared-memory limit. Apart from ``tiling``, which ``fits`` calls where
    torch.compile traces: it would trace this search."""
    tl = tiling(g, n_passes)
    assert tl is not None, "callers check fits()"
    limit = SMEM_TARGET[n_passes] if tl.smem <= SMEM_TARGET[n_passes] else SMEM_MAX

    def smem(w: int) -> int | None:
        b = _forward_smem(n_passes, tl.cc, tl.kc_pad, tl.patch_h, w)
        return b if b is not None and b <= limit else None

    return _spaced(g, "forward_wgmma" if wgmma else "forward", tl, smem)


def _spaced(g: Geometry, kernel: str, tl: Tiling, smem) -> Tiling:
    """tl with the patch row stride in tl.patch_w .. + 31 that fits (``smem(w)``,
    bytes, not None; tl.patch_w does) and whose MMA loads take the fewest
    shared-memory wavefronts (``_patch_wavefronts``), the smallest such. The
    patch copy fills the extra columns too (zeros past the image)."""
    pw = tl.patch_w
    w = min(
        (w for w in range(pw, pw + 32) if smem(w) is not None),
        key=lambda w: (_patch_wavefronts(g, kernel, tl, w), w),
    )
    return tl._replace(patch_w=w, smem=smem(w))


# ConvParams of conv2d_tiles.cuh: x, w, bias, y, mask; 23 ints (4 bytes of
# padding); slope, scale, alpha (float bits in the low half of 8 bytes); gw,
# gb, part; tiles_per_split, splits.
_PARAMS = struct.Struct("<QQQQQ23i4xf4xf4xf4xQQQii")
assert _PARAMS.size == 192
_scratch = _launch._Scratch(_PARAMS.size)


class ConvKernel(NamedTuple):
    ptr: int  # CUfunction
    ctx: int  # the context it was loaded in
    function: object  # keeps the module loaded


class ForwardKernels(NamedTuple):
    """The forward's kernels for one (device, dtype, passes, layout)."""

    main: ConvKernel
    tmap: ConvKernel | None  # the ring's rows by tensor copies (NCHW only)


class WgradKernels(NamedTuple):
    """The weight gradient's kernels for one (device, dtype, passes, layout)."""

    main: ConvKernel
    bulk: ConvKernel | None  # the bulk-copy version (NCHW only)
    tmap: ConvKernel | None  # the bulk-copy version by tensor copies (NCHW only)
    finish: ConvKernel
    # sm_90a, NCHW (wgrad_wgmma): on warpgroup MMAs, dy by plain loads, bulk
    # copies, tensor copies
    wg: tuple[ConvKernel, ConvKernel, ConvKernel] | None = None


_lock = threading.Lock()
_modules: dict[object, object] = {}
_kernels: dict[tuple, ForwardKernels] = {}  # (device, dtype, passes, channels_last)
_wgrad_kernels: dict[tuple, WgradKernels] = {}  # the same keys
_dgrad_kernels: dict[tuple, DgradKernels] = {}  # the same keys
_smem_set: dict[int, int] = {}  # CUfunction -> dynamic shared memory allowed so far
_resident: dict[tuple, int] = {}  # (device, CUfunction, smem) -> blocks the device holds at once


_scalar_cache: dict[tuple, tuple[float, float]] = {}


def _scalars(negative_slope, divisor, fname: str) -> tuple[float, float]:
    """kernel_scalars of div_leaky_relu (float op type), kept for the values
    seen last (rounding them through NumPy costs a few microseconds per
    call); the types are part of the key (an int rounds as int64); values
    that raise, and a zero slope (whose sign matters), are never kept."""
    key: tuple | None = (negative_slope, divisor, type(negative_slope), type(divisor))
    try:
        r = _scalar_cache.get(key)  # type: ignore[arg-type]
    except TypeError:  # unhashable: the checks name it
        r = key = None
    if r is None:
        r = kernel_scalars("div_leaky_relu", negative_slope, divisor, False, fname)
        # 0.0 and -0.0 are equal keys with different results: zero is not kept
        if key is not None and negative_slope:
            if len(_scalar_cache) >= 64:
                _scalar_cache.clear()
            _scalar_cache[key] = r
    return r


def arch_options(sm: int) -> tuple[str, ...]:
    """NVRTC options for a device of compute capability ``sm`` (9.0: 90): the
    arch-specific sm_90a target on 9.0 devices, where the forward runs on
    warpgroup MMAs (cuda/wgmma.cuh; CuPy's own -arch=sm_90 then adds nothing);
    none elsewhere (mma.sync)."""
    return ("-arch=sm_90a",) if sm == 90 else ()


def _load(device: int, module_key, source: str, names) -> list[ConvKernel]:
    """``names`` from the module ``module_key`` of ``source`` on ``device``
    (compiled, or loaded from CuPy's disk cache, on first use); callers hold
    _lock."""
    extra = arch_options(_sm(device))
    ctx, functions = _loader.load_module(_modules, module_key, source, list(names), device, extra)
    return [ConvKernel(f.ptr, ctx, f) for f in functions]


def _instantiation(table: dict, key: tuple, module_key, source: str, names, entry):
    """table[key], key = (device, dtype, passes, channels_last); on a miss the
    dtype's module (its kernels ``names()``, in module_keys order first) is
    compiled or loaded once and every instantiation of it filed, as
    ``entry(kernel, all loaded, its index in module_keys)``."""
    k = table.get(key)
    if k is not None:
        return k
    with _lock:
        device, dtype = key[:2]
        loaded = _load(device, module_key, source, names())
        for i, (k2, kern) in enumerate(zip(module_keys(dtype), loaded)):
            table[(device, *k2)] = entry(kern, loaded, i)
    return table[key]


def kernel(device: int, dtype: str, n_passes: int, channels_last: bool) -> ForwardKernels:
    """The forward's kernels on ``device``; the first call per (device, dtype)
    compiles (or loads from CuPy's disk cache) that dtype's module."""
    keys = module_keys(dtype)
    nchw = [i for i, (_, _, cl) in enumerate(keys) if not cl]

    def entry(k, loaded, i):
        return ForwardKernels(k, loaded[len(keys) + nchw.index(i)] if i in nchw else None)

    return _instantiation(
        _kernels, (device, dtype, n_passes, channels_last), dtype, SOURCE,
        lambda: forward_kernel_names(dtype), entry,
    )  # fmt: skip


def wgrad_kernels(device: int, dtype: str, n_passes: int, channels_last: bool) -> WgradKernels:
    """The weight gradient's kernels on ``device``; the first call per (device,
    dtype) compiles (or loads) that dtype's module."""
    keys = module_keys(dtype)
    nchw = [i for i, (_, _, cl) in enumerate(keys) if not cl]

    def entry(k, loaded, i):
        if i not in nchw:
            return WgradKernels(k, None, None, loaded[-1])
        j = len(keys) + nchw.index(i)
        w = len(keys) + 2 * len(nchw) + 3 * nchw.index(i)
        wg = tuple(loaded[w : w + 3])
        return WgradKernels(k, loaded[j], loaded[j + len(nchw)], loaded[-1], wg)

    return _instantiation(
        _wgrad_kernels, (device, dtype, n_passes, channels_last), (dtype, "wgrad"),
        WGRAD_SOURCE, lambda: wgrad_kernel_names(dtype), entry,
    )  # fmt: skip


class DgradKernels(NamedTuple):
    """The input gradient's kernels for one (device, dtype, passes, layout)."""

    loads: ConvKernel  # dy by plain loads
    staged: ConvKernel | None  # dy by asynchronous copies into shared memory (16-bit NCHW)


def dgrad_kernels(device: int, dtype: str, n_passes: int, channels_last: bool) -> DgradKernels:
    """The input gradient's kernels on ``device``; the first call per (device,
    dtype) compiles (or loads) that dtype's module."""
    keys = module_keys(dtype)
    nchw = [i for i, (_, _, cl) in enumerate(keys) if not cl]

    def entry(k, loaded, i):
        staged = len(loaded) > len(keys) and i in nchw
        return DgradKernels(k, loaded[len(keys) + nchw.index(i)] if staged else None)

    return _instantiation(
        _dgrad_kernels, (device, dtype, n_passes, channels_last), (dtype, "dgrad"),
        DGRAD_SOURCE, lambda: dgrad_kernel_names(dtype), entry,
    )  # fmt: skip


def load(device: int) -> None:
    """Compile or load every fused-convolution module for ``device`` now."""
    for dtype in DTYPES:
        kernel(device, dtype, *module_keys(dtype)[0][1:])


_sms: dict[int, int] = {}
_names: dict[int, str] = {}


def _sm(device: int) -> int:
    """The device's compute capability as one number (9.0: 90)."""
    sm = _sms.get(device)
    if sm is None:
        import cupy

        sm = _sms[device] = int(cupy.cuda.Device(device).compute_capability)
    return sm


def _device_name(device: int) -> str:
    """The device's name ("NVIDIA H100 80GB HBM3"), kept per device."""
    name = _names.get(device)
    if name is None:
        import cupy

        raw = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        _names[device] = name
    return name


def _blocks(device: int, k: ConvKernel, smem: int) -> int:
    """Blocks of ``k`` resident at once on the device: the persistent grid."""
    key = (device, k.ptr, smem)
    n = _resident.get(key)
    if n is None:
        import cupy

        # (in the kernel's context: the caller's thread may have another
        # device's current, and the driver then calls the handle invalid)
        occupancy = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor
        per_sm = _launch.in_context(k.ctx, occupancy, k.ptr, THREADS, smem)
        sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        n = _resident[key] = max(1, per_sm) * sms
    return n


def _allow_smem(k: ConvKernel, nbytes: int) -> None:
    """Raise the kernel's dynamic shared memory limit to ``nbytes`` (past 48 KiB
    it must be asked for)."""
    if _smem_set.get(k.ptr, 48 * 1024) >= nbytes:
        return
    import cupy

    driver = cupy.cuda.driver
    attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _launch.in_context(k.ctx, driver.funcSetAttribute, k.ptr, attr, nbytes)  # (as in _blocks)
    _smem_set[k.ptr] = nbytes


def launch(
    device: int,
    dtype: str,
    precision: str,
    channels_last: bool,
    g: Geometry,
    stream: int,
    x: int,
    w: int,
    bias: int,
    y: int,
    mask: int,
    negative_slope,
    divisor,
    fname: str,
    *,
    have: tuple,
) -> None:
    """y = leaky_relu((conv2d(x, w) + bias) / divisor); the mask too if ``mask``.

    Pointers are raw device addresses of dense arrays: x and y NCHW or NHWC
    (``channels_last``), w always OIHW; the mask buffer must be zeroed.
    ``have``: the bytes of x, w, bias, y and the mask (``ForwardLaunch``).
    """
    slope, scale = _scalars(negative_slope, divisor, fname)
    if g.n * g.oh * g.ow == 0:
        return
    run = forward_launch(device, dtype, precision, channels_last, g)
    run(stream, x, w, bias, y, mask, slope, scale, have=have)


# ---- prepared launches: worked out once per shape, addresses filled in per call ----

# What changes per call in ConvParams: the five addresses at its start, the
# slope and scale (float bits, each in the low half of 8 bytes), gw, gb, part.
_ADDRESSES = struct.Struct("<QQQQQ")
_SCALAR_PAIR = struct.Struct("<f4xf")
_SCALARS_AT = struct.calcsize("<QQQQQ23i4x")
_GRAD_ADDRESSES = struct.Struct("<QQQ")
_GRADS_AT = struct.calcsize("<QQQQQ23i4xf4xf4xf4x")


class Prepared(NamedTuple):
    """One kernel's launch: grid, block and shared memory, and its ConvParams
    packed but for the addresses and the scalars (zeros there)."""

    ptr: int  # CUfunction
    ctx: int
    grid: tuple[int, int]
    threads: int
    smem: int
    params: bytes

    def fill(self, x, w, bias, y, mask, slope, scale) -> _launch._Scratch:
        """This thread's argument buffer holding these params with the call's
        addresses (x, w, bias, y, mask: the ConvParams fields) and scalars."""
        s = _scratch
        s.buf.raw = self.params
        _ADDRESSES.pack_into(s.buf, 0, x, w, bias, y, mask)
        _SCALAR_PAIR.pack_into(s.buf, _SCALARS_AT, slope, scale)
        return s

    def fire(self, stream: int, argv: int) -> None:
        _launch.run(self.ptr, self.ctx, self.grid, self.threads, stream, argv, self.smem)


def _prepared(k: ConvKernel, grid, smem: int, params: bytes, threads: int = THREADS) -> Prepared:
    _allow_smem(k, smem)
    return Prepared(k.ptr, k.ctx, grid, threads, smem, params)


def _fire_with_map(k: Prepared, s: _launch._Scratch, stream: int, desc: tuple) -> None:
    """Launch ``k`` with a tensor map (``desc``: its buffer, held till here by
    the caller, and address) as the kernel's second parameter."""
    s.argv2[1] = desc[1]
    k.fire(stream, s.argv2_ptr)


class ForwardLaunch(NamedTuple):
    """The forward of one geometry on one device (``forward_launch``): its
    kernel, and where the geometry allows, the one that brings the ring's
    rows by tensor copies with x's tensor map (taken where x is 16-byte
    aligned, checked per call)."""

    main: Prepared
    tmap: Prepared | None
    x_map: _tensormap.TiledMap | None
    g: Geometry
    need: Extents

    def __call__(
        self, stream: int, x, w, bias, y, mask, slope, scale, zero_bytes=0, *, have: tuple
    ) -> None:
        """Launch on raw addresses with the op-type scalars (``_scalars``);
        ``zero_bytes``: the mask's bytes to zero first (0: zeroed by the
        caller); ``have``: the bytes of x, w, bias, y and the mask, each
        compared with what the kernel indexes (``check_extents``)."""
        n = self.need
        if (  # (inline on the hot path: check_extents names what falls short)
            have[0] < n.x or have[1] < n.w or have[3] < n.y
            or (bias and have[2] < n.bias) or (mask and have[4] < max(n.mask, zero_bytes))
        ):  # fmt: skip
            check_extents("forward", self.g, (
                ("x", x, have[0], n.x), ("weight", w, have[1], n.w),
                ("bias", bias, have[2], n.bias), ("y", y, have[3], n.y),
                ("mask", mask, have[4], max(n.mask, zero_bytes)),
            ))  # fmt: skip
        if zero_bytes:
            _launch.zero(self.main.ctx, mask, zero_bytes, stream)
        if self.tmap is not None and self.x_map is not None and x % 16 == 0:
            # (the descriptor's buffer held till the launch: another thread
            # may replace the map's last one)
            desc = self.x_map.at(x)
            s = self.tmap.fill(x, w, bias, y, mask, slope, scale)
            _fire_with_map(self.tmap, s, stream, desc)
            return
        self.main.fire(stream, self.main.fill(x, w, bias, y, mask, slope, scale).argv_ptr)


_forward_launches: dict[tuple, ForwardLaunch] = {}


def seam_bytes(
    g: Geometry, tl: Tiling, n_passes: int, dtype: str, sm: int, cl: bool, device_name: str
) -> int:
    """The row seams' buffer (bytes) the sm_90a forward gets after its
    weights, 0 where conv2d.cu's forward_tiles would not use it: float32, one
    pass, NCHW, one-row tiles over the whole width (C = 128, one column
    tile), widths of 64 or more, even, not a multiple of 32 (rows of whole
    lines share none), planes of whole 4-element vectors (fewer than 2^28
    elements: a step of 8 planes in an int), and three blocks per SM kept;
    with FORWARD_SEAMS None, only where ``seams_pay``. (The kernel also wants
    y 16-byte aligned, per call.)"""
    wanted = FORWARD_SEAMS or (FORWARD_SEAMS is None and seams_pay(device_name, g.ow))
    ok = (
        wanted and sm == 90 and n_passes == 1 and dtype == "float32" and not cl
        and tl.c_log2 == 7 and tl.tiles_w == 1 and g.ow >= 64 and g.ow % 2 == 0
        and g.ow % 32 != 0 and g.oh * g.ow % 4 == 0 and g.oh * g.ow < 1 << 28
        and tl.smem + SEAM_BYTES <= SEAM_SMEM_MAX
    )  # fmt: skip
    return SEAM_BYTES if ok else 0


def forward_launch(
    device: int, dtype: str, precision: str, channels_last: bool, g: Geometry
) -> ForwardLaunch:
    """The forward's prepared launch for this geometry (kept per shape; the
    caller checked ``fits`` and a non-empty output). A persistent grid: each
    block walks a run of consecutive tiles (down the rows first), keeping its
    weights in shared memory when one chunk holds every channel, and on
    sm_90a one-row tiles' patch as a ring of rows."""
    # (the key holds what the call gave, not what follows from it: each call
    # a lookup and nothing more)
    key = (device, dtype, precision, channels_last, g, FORWARD_TMAP, FORWARD_SEAMS)
    run = _forward_launches.get(key)
    if run is not None:
        return run
    n_passes = passes(dtype, precision)
    sm, itemsize = _sm(device), ITEMSIZE[dtype]
    tl = launch_tiling(g, n_passes, sm == 90)
    ks = kernel(device, dtype, n_passes, channels_last)
    n_tiles = g.n * tl.tiles_h * tl.tiles_w
    col_tiles = math.ceil(g.cout / TILE_N)
    smem = tl.smem + seam_bytes(g, tl, n_passes, dtype, sm, channels_last, _device_name(device))

    def prepared(k: ConvKernel) -> Prepared:
        _allow_smem(k, smem)  # (before the occupancy query)
        per_block = math.ceil(n_tiles / max(1, _blocks(device, k, smem) // col_tiles))
        grid = (math.ceil(n_tiles / per_block), col_tiles)
        return _prepared(k, grid, smem, _params(g, tl, 0, 0, 0, per_block, 0))

    tmap = x_map = None
    # forward_tmap's rule, but for x's alignment (checked per call)
    if ks.tmap is not None and forward_tmap(g, tl, n_passes, itemsize, 0, sm):
        tmap, x_map = prepared(ks.tmap), _x_map(g, tl, itemsize)
    run = ForwardLaunch(prepared(ks.main), tmap, x_map, g, extents(g, dtype))
    if len(_forward_launches) >= 256:
        _forward_launches.clear()
    _forward_launches[key] = run
    return run


def _params(g: Geometry, tl: Tiling, *wgrad) -> bytes:
    """ConvParams with zero addresses and scalars (``Prepared.fill`` puts a
    call's in); ``wgrad``: gw, gb, part (zeros here too), tiles_per_split,
    splits (the forward: its tiles per block in tiles_per_split, the rest
    zeros)."""
    return _PARAMS.pack(
        0, 0, 0, 0, 0, g.n, g.cin, g.h, g.w, g.cout, g.oh, g.ow, g.kh, g.kw,
        *g.stride, *g.padding, *g.dilation, tl.c_log2, tl.tiles_h, tl.tiles_w, tl.cc, tl.kc_pad,
        tl.patch_h, tl.patch_w, 0, 0.0, 0.0, 1.0, *(wgrad or (0, 0, 0, 0, 0)),
    )  # fmt: skip


# ---- the weight and bias gradients (conv2d_wgrad.cu) ----

WGRAD_DEPTH = 72  # kWgradDepth: the depth per chunk (cc * kh * kw, padded with zeros)
DZ_STRIDE = TILE_M + 8  # kDS
# The bulk-copy path's stages (sets of buffers: raw dy and an mbarrier; see
# wgrad_bulk_smem). Two (copies a whole tile ahead) measured
# slower: 105 KB of shared memory leaves 2 blocks per SM.
WGRAD_STAGES = 1
# Three blocks per SM (the kernel's launch bounds): 228 KiB less 1 KiB each.
WGRAD_SMEM = 75 * 1024


def _wgrad_smem(n_passes: int, cc: int, ph: int, pw: int) -> int | None:
    """The weight gradient's shared memory (bytes) for a patch of ph rows of pw
    words per channel; None where it does not fit (WGRAD_SMEM, PATCH_PART)."""
    part = (cc + 1) * ph * pw
    if n_passes == 3 and part > PATCH_PART:
        return None
    region = max(2 * PATCH_PART if n_passes == 3 else part, TILE_N * WGRAD_DEPTH)
    words = 2 * WGRAD_DEPTH + -(-region // 4) * 4 + TILE_N * DZ_STRIDE + TILE_N
    return 4 * words if 4 * words <= WGRAD_SMEM else None


@functools.lru_cache(maxsize=4096)
def wgrad_tiling(g: Geometry, n_passes: int) -> Tiling | None:
    """The weight gradient's tiling: the forward's rectangles (C = 128, 64 or
    32), channel chunks of at most WGRAD_DEPTH depth (kc_pad is WGRAD_DEPTH:
    the kernel always runs 9 column tiles, the padding reading zeros), shared
    memory for the koff table and the tile's column offsets, the patch (or
    the halves' sums, 64 x 72, whichever is larger), the dz tile (64 x
    DZ_STRIDE floats) and 64 bias sums; None if nothing fits (then PyTorch's
    convolution backward). Patch rows pw words apart; ``wgrad_plan`` spaces
    them for the launch, as ``launch_tiling`` does."""
    for c, ph, pw, cc, kc_pad, _ in _layouts(g):
        smem = _wgrad_smem(n_passes, cc, ph, pw)
        if kc_pad <= WGRAD_DEPTH and smem is not None:
            return _tiling(g, c, cc, WGRAD_DEPTH, ph, pw, smem)
    return None


def _patch_wavefronts(g: Geometry, kernel: str, tl: Tiling, stride: int) -> int:
    """Shared-memory wavefronts of the patch loads in one step of a kernel's
    MMA loop, for patch rows ``stride`` words apart; a load takes as many
    wavefronts as the most distinct words in one of the 32 banks.

    "forward" (cuda/conv2d.cu, mma.sync): lane (g, t) reads position g (and
    g + 8) at depth k0 + t (and k0 + t + 4), summed over the depth steps k0.
    "forward_wgmma" (sm_90a): the same but positions 4g + q (q = 0 .. 3).
    "wgrad" (cuda/conv2d_wgrad.cu, wgrad_step): lane (g, t) of load q in
    column tile j reads depth 8j + g at position 2t + q, summed over the
    column tiles, both loads and, for one-row tiles (a ring of rows), every
    rotation of the ring. Depth past the chunk's reads the zero plane.
    """
    khw, ph, cc, kc_pad = g.kh * g.kw, tl.patch_h, tl.cc, tl.kc_pad
    plane = ph * stride
    sw, dh, dw = g.stride[1], g.dilation[0], g.dilation[1]
    ring = kernel == "wgrad" and tl.c_log2 == 7
    total = 0
    for base in range(ph) if ring else (0,):
        offs = []
        for k in range(kc_pad):
            if k < cc * khw:
                ci, rs = divmod(k, khw)
                r, s = divmod(rs, g.kw)
                offs.append(ci * plane + (base + r * dh) % ph * stride + s * dw)
            else:
                offs.append(cc * plane)
        if kernel == "wgrad":
            loads = [[off + (2 * t + q) * sw for off in offs[j : j + 8] for t in range(4)]
                     for j in range(0, kc_pad, 8) for q in range(2)]  # fmt: skip
        elif kernel == "forward_wgmma":
            loads = [[(4 * m + q) * sw + offs[k0 + h + t] for m in range(8) for t in range(4)]
                     for k0 in range(0, kc_pad, 8) for h in (0, 4) for q in range(4)]  # fmt: skip
        else:
            loads = [[(g8 + m) * sw + offs[k0 + h + t] for m in range(8) for t in range(4)]
                     for k0 in range(0, kc_pad, 8) for h in (0, 4) for g8 in (0, 8)]  # fmt: skip
        for words in loads:
            banks: dict[int, set[int]] = {}
            for a in words:
                banks.setdefault(a % 32, set()).add(a)
            total += max(len(v) for v in banks.values())
    return total


def wgrad_fits(g: Geometry, n_passes: int) -> bool:
    """Whether the weight-gradient kernel applies (else PyTorch's backward)."""
    return fits(g, n_passes) and wgrad_tiling(g, n_passes) is not None


def wgrad_chunks(g: Geometry, n_passes: int) -> int:
    """Channel chunks of the weight gradient's tiling (each reads dy once);
    the caller checked wgrad_fits()."""
    tl = wgrad_tiling(g, n_passes)
    assert tl is not None, "callers check wgrad_fits()"
    return math.ceil(g.cin / tl.cc)


def wgrad_bulk(g: Geometry, tl: Tiling, channels_last: bool, sm: int, itemsize: int) -> bool:
    """Whether the bulk-copy path may run (the pointers' 16-byte alignment is
    checked per launch): compute capability ``sm`` (e.g. 90) at least 9.0,
    NCHW, a tile's positions in each channel one run of dy (one-row tiles,
    C = 128, or whole rows, C = the output width) starting at an even
    element (the output width even), and dy a whole number of 16-byte units
    (each line's run is copied widened to whole units: none reaches past dy)."""
    cols = 1 << tl.c_log2
    return (
        sm >= 90
        and not channels_last
        and g.ow % 2 == 0
        and (cols == TILE_M or g.ow == cols)
        and (g.n * g.cout * g.oh * g.ow * itemsize) % 16 == 0
    )


def wgrad_tmap(g: Geometry, tl: Tiling, channels_last: bool, sm: int, itemsize: int) -> bool:
    """Whether the bulk path may bring dy by tensor copies (one per tile
    instead of one per line): where the bulk path may run, dy's planes (its
    channels) lie a whole number of 16-byte units apart, as a tensor map's
    strides must, and the driver encodes tensor maps (``_tensormap``)."""
    return (
        wgrad_bulk(g, tl, channels_last, sm, itemsize)
        and (g.oh * g.ow * itemsize) % 16 == 0
        and _tensormap.available()
    )


def wgrad_bulk_smem(dtype: str, tl: Tiling, tmap: bool = False) -> int:
    """The bulk-copy path's shared memory: the register path's less its dz
    tile, plus per stage (WGRAD_STAGES) a buffer of raw dy (TILE_M + 8
    elements per line) and an mbarrier, and the realigned mask (16 bytes per
    line); by tensor copies (``tmap``) 128 bytes more, for the stages to
    start on a 128-byte boundary."""
    stage = TILE_N * (TILE_M + 8) * ITEMSIZE[dtype] + 8
    slack = 128 if tmap else 0
    return tl.smem - 4 * TILE_N * DZ_STRIDE + WGRAD_STAGES * stage + TILE_N * 16 + slack


# The sm_90a kernel's ring (conv2d_wgrad.cu, kWgPart): per TF32 part, three
# input rows x three shifts x 8 channels x TILE_M positions, 4 bytes each.
WG_RING_PART = 3 * 3 * 8 * TILE_M * 4


def wgrad_wgmma(g: Geometry, tl: Tiling, channels_last: bool, sm: int) -> bool:
    """Whether the weight gradient runs on warpgroup MMAs (conv2d_wgrad_kernel_wg):
    compute capability 9.0 (its modules build for sm_90a), NCHW, 3 x 3
    filters at stride 1 and dilation 1 (each output row adds one input row to
    the ring), one-row tiles (C = 128) and chunks of at most 8 channels."""
    return (
        sm == 90
        and not channels_last
        and (g.kh, g.kw) == (3, 3)
        and g.stride == (1, 1)
        and g.dilation == (1, 1)
        and tl.c_log2 == 7
        and tl.cc <= 8
    )


def wgrad_wg_smem(dtype: str, n_passes: int) -> int:
    """conv2d_wgrad_kernel_wg's shared memory: 128 bytes to align the ring, the
    ring per TF32 part, raw dy (TILE_M + 8 elements per line), the realigned
    mask (16 bytes per line) and an mbarrier."""
    parts = 2 if n_passes == 3 else 1
    return 128 + parts * WG_RING_PART + TILE_N * ((TILE_M + 8) * ITEMSIZE[dtype] + 16) + 8


def _dy_map(g: Geometry, itemsize: int) -> _tensormap.TiledMap:
    """dy (NCHW) as tensor_copy_3d's map: positions of a plane (innermost),
    channels, images; a box is TILE_M + 8 positions (a tile's run from the
    16-byte unit it starts in) of TILE_N channels, unswizzled: the rows of
    the bulk path's raw dy."""
    plane = g.oh * g.ow * itemsize
    dims, box = (g.oh * g.ow, g.cout, g.n), (TILE_M + 8, TILE_N, 1)
    return _tensormap.TiledMap(itemsize, dims, (plane, plane * g.cout), box)


class WgradPlan(NamedTuple):
    """One weight-gradient launch: tiling, the split of the tiles, the grid and
    the float32 scratch it needs (partial sums per split); bulk_smem the
    bulk-copy kernel's shared memory where that path may run, else 0;
    tmap_smem likewise for tensor copies, and dy_map their tensor map;
    wg_smem the warpgroup kernel's where it runs (``wgrad_wgmma``: then it
    takes every launch, dy by tensor copies, bulk copies or plain loads, and
    the splits follow its residency)."""

    tiling: Tiling
    n_passes: int
    tiles_per_split: int
    splits: int
    grid: tuple[int, int]
    part_floats: int
    bulk_smem: int
    tmap_smem: int = 0
    dy_map: _tensormap.TiledMap | None = None
    wg_smem: int = 0  # the kernel on warpgroup MMAs' (wgrad_wgmma), else 0


class WgradLaunch(NamedTuple):
    """A weight-gradient plan's prepared launches (``wgrad_launch``): the
    kernel that reads dy by plain loads, the ones by bulk copies and by
    tensor copies where the plan has them (taken where dy and the mask are
    16-byte aligned, checked per call; the same splits in the same order,
    so the same bits either way), and the final sum without and with the
    bias. All share one ConvParams."""

    plan: WgradPlan
    loads: Prepared
    copies: Prepared | None
    tmap: Prepared | None
    finish: tuple[Prepared, Prepared]
    g: Geometry
    need: Extents

    def __call__(self, stream: int, x, dy, mask, gw, gb, part, slope, scale, *, have) -> None:
        """Launch on raw addresses with the op-type scalars (``_scalars``);
        ``have``: the bytes of x, dy, the mask, gw, gb and part, each
        compared with what the kernels index (``check_extents``)."""
        n = self.need
        check_extents("weight-gradient", self.g, (
            ("x", x, have[0], n.x), ("dy", dy, have[1], n.y), ("mask", mask, have[2], n.mask),
            ("gw", gw, have[3], n.w), ("gb", gb, have[4], n.bias),
            ("part", part, have[5], 4 * self.plan.part_floats),
        ))  # fmt: skip
        k, desc = self.loads, None
        if self.copies is not None and dy % 16 == 0 and mask % 16 == 0:
            k = self.copies
            if self.tmap is not None and self.plan.dy_map is not None:
                k, desc = self.tmap, self.plan.dy_map.at(dy)  # (buffer held till the launch)
        s = k.fill(x, 0, 0, dy, mask, slope, scale)
        _GRAD_ADDRESSES.pack_into(s.buf, _GRADS_AT, gw, gb, part)
        if k.grid[0]:  # (no positions: the final sum writes zeros)
            if desc is not None:
                _fire_with_map(k, s, stream, desc)
            else:
                k.fire(stream, s.argv_ptr)
        self.finish[1 if gb else 0].fire(stream, s.argv_ptr)


_wgrad_plans: dict[tuple, WgradLaunch] = {}


def wgrad_plan(device: int, dtype: str, precision: str, channels_last: bool, g: Geometry):
    """The plan for this geometry on ``device`` (cached): one wave of blocks,
    each a contiguous run of tiles, fixed by the shape and the device's SM
    count, so that runs repeat bit for bit."""
    return wgrad_launch(device, dtype, precision, channels_last, g).plan


def wgrad_launch(
    device: int, dtype: str, precision: str, channels_last: bool, g: Geometry
) -> WgradLaunch:
    """The plan for this geometry on ``device`` and its prepared launches (kept
    per shape; the caller checked ``wgrad_fits``)."""
    n_passes = passes(dtype, precision)
    key = (device, dtype, n_passes, channels_last, g)
    run = _wgrad_plans.get(key)
    if run is not None:
        return run
    tl = wgrad_tiling(g, n_passes)
    assert tl is not None, "callers check wgrad_fits()"
    tl = _spaced(g, "wgrad", tl, lambda w: _wgrad_smem(n_passes, tl.cc, tl.patch_h, w))
    ks = wgrad_kernels(device, dtype, n_passes, channels_last)
    _allow_smem(ks.main, tl.smem)
    resident = _blocks(device, ks.main, tl.smem)
    bulk_smem = tmap_smem = wg_smem = 0
    dy_map = None
    sm, itemsize = _sm(device), ITEMSIZE[dtype]
    if ks.bulk is not None and wgrad_bulk(g, tl, channels_last, sm, itemsize):
        bulk_smem = wgrad_bulk_smem(dtype, tl)
        _allow_smem(ks.bulk, bulk_smem)
        resident = _blocks(device, ks.bulk, bulk_smem)
    if ks.tmap is not None and wgrad_tmap(g, tl, channels_last, sm, itemsize):
        tmap_smem = wgrad_bulk_smem(dtype, tl, tmap=True)
        dy_map = _dy_map(g, itemsize)
        _allow_smem(ks.tmap, tmap_smem)
        resident = _blocks(device, ks.tmap, tmap_smem)
    if ks.wg is not None and wgrad_wgmma(g, tl, channels_last, sm):
        wg_smem = wgrad_wg_smem(dtype, n_passes)
        for k in ks.wg:
            _allow_smem(k, wg_smem)
        resident = _blocks(device, ks.wg[0], wg_smem)
    tiles = g.n * tl.tiles_h * tl.tiles_w
    columns = math.ceil(g.cout / TILE_N) * math.ceil(g.cin / tl.cc)
    splits = max(1, min(tiles, resident // columns))
    per = max(1, -(-tiles // splits))
    splits = max(1, -(-tiles // per))  # no empty split
    k_total = g.cin * g.kh * g.kw
    floats = splits * g.cout * (k_total + 1)
    plan = WgradPlan(
        tl, n_passes, per, splits, (splits, columns), floats, bulk_smem, tmap_smem, dy_map,
        wg_smem,
    )  # fmt: skip
    # No positions: no weight-gradient launch (an empty grid), and the final
    # sum over zero splits writes zeros.
    positions = g.n * g.oh * g.ow
    params = _params(g, tl, 0, 0, 0, per, splits if positions else 0)
    grid = plan.grid if positions else (0, columns)
    copies = tmap = None
    if wg_smem and ks.wg is not None:  # the same bits by any of its three ways to dy
        loads = _prepared(ks.wg[0], grid, wg_smem, params)
        if bulk_smem:
            copies = _prepared(ks.wg[1], grid, wg_smem, params)
            if dy_map is not None:
                tmap = _prepared(ks.wg[2], grid, wg_smem, params)
    else:
        loads = _prepared(ks.main, grid, tl.smem, params)
        if bulk_smem and ks.bulk is not None:
            copies = _prepared(ks.bulk, grid, bulk_smem, params)
            if dy_map is not None and ks.tmap is not None:
                tmap = _prepared(ks.tmap, grid, tmap_smem, params)
    finish = tuple(
        _prepared(ks.finish, (math.ceil(g.cout * (k_total + b) / FINISH_OUTPUTS), 1), 0, params,
                  FINISH_THREADS)
        for b in (0, 1)
    )  # fmt: skip
    run = WgradLaunch(plan, loads, copies, tmap, finish, g, extents(g, dtype))  # type: ignore[arg-type]
    _wgrad_plans[key] = run
    return run


# conv2d_wgrad_finish: a block of 8 warps per 32 outputs (kFinishWarps), the
# warps splitting the partial sums.
FINISH_THREADS = 256
FINISH_OUTPUTS = 32


def launch_wgrad(
    run: WgradLaunch,
    stream: int,
    x: int,
    dy: int,
    mask: int,
    gw: int,
    gb: int,
    part: int,
    negative_slope,
    divisor,
    fname: str,
    *,
    have: tuple,
) -> None:
    """gw (and gb if ``gb``) of ``leaky_relu((conv2d(x, w) + bias) / divisor)``
    from dy and the forward's mask: x, dy and the mask dense in one layout
    (NCHW or NHWC, the mask in dy's memory order), gw OIHW, ``part`` a float32
    buffer of ``run.plan.part_floats`` (``run`` this geometry's
    ``wgrad_launch``); ``have`` the bytes of each (``WgradLaunch``). Every
    element of gw and gb is written."""
    slope, scale = _scalars(negative_slope, divisor, fname)
    run(stream, x, dy, mask, gw, gb, part, slope, scale, have=have)


# ---- the input gradient (conv2d_dgrad.cu) ----

DGRAD_COLS = 128  # kDgradCols: dz positions per block row
DGRAD_STRIDE = DGRAD_COLS - 2  # kDgradStride: column tiles share kw - 1 dz columns
DGRAD_RS = 25  # kDgradRS: words per position of a finished row's sums
DGRAD_TAPS = 9
DGRAD_STAGES = 4  # kDgradStages: depth steps of dy in shared memory (staged kernel)
# The staged kernel where it applies; False keeps plain loads (tests compare the two).
DGRAD_STAGED = True


def dgrad_smem(g: Geometry, n_passes: int, staged_itemsize: int = 0) -> int:
    """Shared memory of the input-gradient kernel, bytes: the weights split
    in fragment order ([cout / 8 steps][9 taps][32 lanes][2] words per part)
    and one row's sums; for the staged kernel (``staged_itemsize``: dy's
    element size) per stage each thread's 4 dy pairs and their mask words."""
    parts = 2 if n_passes == 3 else 1
    steps = -(-g.cout // 8)
    stages = DGRAD_STAGES * THREADS * 4 * (2 * staged_itemsize + 4) if staged_itemsize else 0
    return 4 * (parts * steps * DGRAD_TAPS * 64 + DGRAD_COLS * DGRAD_RS) + stages


def dgrad_staged(g: Geometry, n_passes: int, channels_last: bool, itemsize: int) -> bool:
    """Whether the staged kernel runs (dy's address aside: it must be
    2 * itemsize aligned, checked per call): 16-bit NCHW, rows of even width
    (each thread's dz pairs two consecutive elements at an even offset) and
    the stages in shared memory. Where it measured faster: at the seed shape
    on an H100, float16 NCHW 381-390 us staged against 398-410 by plain
    loads; NHWC 315-322 against 309-316; float32 NCHW 463-476 against
    442-454 with three passes, the same with one."""
    return (
        itemsize == 2
        and not channels_last
        and g.ow % 2 == 0
        and dgrad_smem(g, n_passes, itemsize) <= SMEM_MAX
    )


def dgrad_fits(g: Geometry, n_passes: int) -> bool:
    """Whether the input-gradient kernel applies: 3 x 3 filters, stride 1,
    dilation 1, padding at most 2 (so every input column's dz columns lie
    in one column tile), 32-bit offsets within an image, and the weights in
    shared memory (else cuDNN's data gradient from a materialized dz)."""
    return (
        (g.kh, g.kw) == (3, 3)
        and g.stride == (1, 1)
        and g.dilation == (1, 1)
        and max(g.padding) <= 2
        and g.cout * g.oh * g.ow < _INT32
        and g.cin * g.h * g.w < _INT32
        and dgrad_smem(g, n_passes) <= SMEM_MAX
    )


def dgrad_groups(g: Geometry) -> int:
    """Groups of 8 input channels, one block column each (each reads dy)."""
    return -(-g.cin // 8)


def dgrad_column_tiles(g: Geometry) -> int:
    """Column tiles of the input gradient: enough that the last one holds
    every dz column an input column reads (those below min(ow, w + pw))."""
    need = min(g.ow, g.w + g.padding[1])
    return 1 + max(0, -(-(need - DGRAD_COLS) // DGRAD_STRIDE))


def launch_dgrad(
    device: int,
    dtype: str,
    precision: str,
    channels_last: bool,
    g: Geometry,
    stream: int,
    dy: int,
    mask: int,
    w: int,
    dx: int,
    negative_slope,
    divisor,
    fname: str,
    *,
    have: tuple,
) -> None:
    """dx of ``leaky_relu((conv2d(x, w) + bias) / divisor)`` from dy and the
    forward's mask (dy and dx dense in one layout, NCHW or NHWC, the mask in
    dy's memory order; w OIHW). Every element of dx is written. The caller
    checked ``dgrad_fits``. ``have``: the bytes of dy, the mask, w and dx,
    each compared with what the kernel indexes (``check_extents``)."""
    slope, scale = _scalars(negative_slope, divisor, fname)
    n = extents(g, dtype)
    check_extents("input-gradient", g, (
        ("dy", dy, have[0], n.y), ("mask", mask, have[1], n.mask), ("weight", w, have[2], n.w),
        ("dx", dx, have[3], n.x),
    ))  # fmt: skip
    run = dgrad_launch(device, dtype, precision, channels_last, g)
    if run is not None:
        k = run.staged if run.staged is not None and dy % run.pair_bytes == 0 else run.loads
        s = k.fill(0, w, 0, dy, mask, slope, scale)
        _GRAD_ADDRESSES.pack_into(s.buf, _GRADS_AT, dx, 0, 0)
        k.fire(stream, s.argv_ptr)


class DgradLaunch(NamedTuple):
    """The input gradient's prepared launches for one geometry: dy by plain
    loads, and where ``dgrad_staged`` allows, staged by asynchronous copies
    (taken where dy is ``pair_bytes`` aligned, checked per call; the same
    sums in the same order, so the same bits either way)."""

    loads: Prepared
    staged: Prepared | None
    pair_bytes: int


_dgrad_launches: dict[tuple, DgradLaunch | None] = {}


def dgrad_launch(
    device: int, dtype: str, precision: str, channels_last: bool, g: Geometry
) -> DgradLaunch | None:
    """The input gradient's prepared launches for this geometry (kept per
    shape; None where there is nothing to compute). One wave: each block a
    contiguous run of input rows (the ring's two extra dz rows per stretch
    are the cost of a split)."""
    key = (device, dtype, precision, channels_last, g, DGRAD_STAGED)
    if key in _dgrad_launches:
        return _dgrad_launches[key]
    units = g.n * dgrad_column_tiles(g) * g.h  # input rows of every column tile
    run = None
    if units:
        n_passes, itemsize = passes(dtype, precision), ITEMSIZE[dtype]
        ks = dgrad_kernels(device, dtype, n_passes, channels_last)
        groups = dgrad_groups(g)

        def prepared(k: ConvKernel, smem: int) -> Prepared:
            _allow_smem(k, smem)  # (before the occupancy query)
            blocks = min(units, max(1, _blocks(device, k, smem) // groups))
            per = -(-units // blocks)
            blocks = -(-units // per)
            tl = Tiling(7, 0, dgrad_column_tiles(g), 0, 0, 0, 0, smem)
            return _prepared(k, (blocks, groups), smem, _params(g, tl, 0, 0, 0, per, 0))

        staged = None
        if (
            ks.staged is not None
            and DGRAD_STAGED
            and dgrad_staged(g, n_passes, channels_last, itemsize)
        ):
            staged = prepared(ks.staged, dgrad_smem(g, n_passes, itemsize))
        run = DgradLaunch(prepared(ks.loads, dgrad_smem(g, n_passes)), staged, 2 * itemsize)
    if len(_dgrad_launches) >= 256:
        _dgrad_launches.clear()
    _dgrad_launches[key] = run
    return run
