"""The fused convolution's geometry: a call's sizes checked as ``F.conv2d``
checks them, the bytes each kernel may index (``extents``), the block's output
tile and how a tiling's patch is laid out in shared memory. Shared by the
forward, the weight gradient and the input gradient; pure Python (no CUDA)."""

from __future__ import annotations

from typing import NamedTuple

from .. import _launch
from .._kernels import ITEMSIZE

THREADS = 128  # kConvThreads
TILE_M, TILE_N = 128, 64  # output positions x output channels per block (kBM, kBN)
DTYPES = ("float32", "float16", "bfloat16")  # float64 stays on PyTorch's convolution
PRECISIONS = ("fp32", "tf32")
_INT32 = 2**31
PATCH_PART = 4096  # kPatchPart: words of the patch per part, with three passes
SMEM_MAX = 99 * 1024  # the most every sm_80+ device gives one block


def passes(dtype: str, precision: str) -> int:
    """TF32 passes per product: 3 (the 3xTF32 split) for float32 at "fp32"
    precision, else 1 (16-bit inputs are exact in TF32, see conv2d.cu)."""
    return 3 if dtype == "float32" and precision == "fp32" else 1


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
