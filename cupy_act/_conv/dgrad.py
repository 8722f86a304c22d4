"""The fused convolution's input gradient (``cuda/conv2d_dgrad.cu``): where it
applies, its shared memory, the 16-bit staged path's condition and the
prepared launches per shape. docs/conv-gradients.md."""

from __future__ import annotations

from typing import NamedTuple

from .._kernels import CTYPES, ITEMSIZE
from . import kernels
from .kernels import (
    _GRAD_ADDRESSES,
    _GRADS_AT,
    ConvKernel,
    Prepared,
    _instantiation,
    _params,
    _prepared,
    _scalars,
    module_keys,
)
from .shapes import (
    _INT32,
    DTYPES,
    SMEM_MAX,
    THREADS,
    Geometry,
    Tiling,
    check_extents,
    extents,
    passes,
)

DGRAD_SOURCE = "conv2d_dgrad.cu"


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


class DgradKernels(NamedTuple):
    """The input gradient's kernels for one (device, dtype, passes, layout)."""

    loads: ConvKernel  # dy by plain loads
    staged: ConvKernel | None  # dy by asynchronous copies into shared memory (16-bit NCHW)


_dgrad_kernels: dict[tuple, DgradKernels] = {}  # (device, dtype, passes, channels_last)


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
            kernels._allow_smem(k, smem)  # (before the occupancy query)
            blocks = min(units, max(1, kernels._blocks(device, k, smem) // groups))
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
