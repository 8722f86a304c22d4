"""The fused convolution's weight and bias gradients (``cuda/conv2d_wgrad.cu``):
the tiling, the split of the tiles over one wave of blocks, the sm_90 paths'
conditions (dy by bulk or tensor copies, warpgroup MMAs) and the prepared
launches per shape. docs/conv-gradients.md."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from .. import _tensormap
from .._kernels import CTYPES, ITEMSIZE
from . import kernels
from .forward import fits
from .kernels import (
    _GRAD_ADDRESSES,
    _GRADS_AT,
    ConvKernel,
    Prepared,
    _fire_with_map,
    _instantiation,
    _params,
    _prepared,
    _scalars,
    module_keys,
)
from .shapes import (
    DTYPES,
    PATCH_PART,
    TILE_M,
    TILE_N,
    Extents,
    Geometry,
    Tiling,
    _layouts,
    _spaced,
    _tiling,
    check_extents,
    extents,
    passes,
)

WGRAD_SOURCE = "conv2d_wgrad.cu"


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


class WgradKernels(NamedTuple):
    """The weight gradient's kernels for one (device, dtype, passes, layout)."""

    main: ConvKernel
    bulk: ConvKernel | None  # the bulk-copy version (NCHW only)
    tmap: ConvKernel | None  # the bulk-copy version by tensor copies (NCHW only)
    finish: ConvKernel
    # sm_90a, NCHW (wgrad_wgmma): on warpgroup MMAs, dy by plain loads, bulk
    # copies, tensor copies
    wg: tuple[ConvKernel, ConvKernel, ConvKernel] | None = None


_wgrad_kernels: dict[tuple, WgradKernels] = {}  # (device, dtype, passes, channels_last)


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
    kernels._allow_smem(ks.main, tl.smem)
    resident = kernels._blocks(device, ks.main, tl.smem)
    bulk_smem = tmap_smem = wg_smem = 0
    dy_map = None
    sm, itemsize = kernels._sm(device), ITEMSIZE[dtype]
    if ks.bulk is not None and wgrad_bulk(g, tl, channels_last, sm, itemsize):
        bulk_smem = wgrad_bulk_smem(dtype, tl)
        kernels._allow_smem(ks.bulk, bulk_smem)
        resident = kernels._blocks(device, ks.bulk, bulk_smem)
    if ks.tmap is not None and wgrad_tmap(g, tl, channels_last, sm, itemsize):
        tmap_smem = wgrad_bulk_smem(dtype, tl, tmap=True)
        dy_map = _dy_map(g, itemsize)
        kernels._allow_smem(ks.tmap, tmap_smem)
        resident = kernels._blocks(device, ks.tmap, tmap_smem)
    if ks.wg is not None and wgrad_wgmma(g, tl, channels_last, sm):
        wg_smem = wgrad_wg_smem(dtype, n_passes)
        for k in ks.wg:
            kernels._allow_smem(k, wg_smem)
        resident = kernels._blocks(device, ks.wg[0], wg_smem)
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
