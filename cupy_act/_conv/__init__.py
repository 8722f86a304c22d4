"""The fused convolution kernels' host side, on raw device pointers (no CuPy
or torch arrays), one module per kernel:

- ``shapes``: a call's sizes checked as ``F.conv2d`` checks them, the bytes
  each kernel indexes, the output tile and the patch's layouts;
- ``kernels``: the compiled modules (one ``cupy.RawModule`` per dtype and
  source, compiled on the first call that needs it: the first activation
  call never pays for them), device queries, prepared launches;
- ``forward`` (``cuda/conv2d.cu``), ``wgrad`` (``cuda/conv2d_wgrad.cu``, the
  weight and bias gradients) and ``dgrad`` (``cuda/conv2d_dgrad.cu``, the
  input gradient): each kernel's tiling, conditions and launch.

The array-level entry (``cupy_act.conv``) and the torch adapter
(``cupy_act.torch.conv``) check their arrays, allocate, and call ``launch`` /
``launch_wgrad`` / ``launch_dgrad``. Settings that tests switch
(``forward.FORWARD_TMAP``, ``forward.FORWARD_SEAMS``, ``dgrad.DGRAD_STAGED``)
are read from their modules at each plan; set them there.
"""

from .. import _launch, _tensormap
from . import dgrad, forward, kernels, shapes, wgrad
from .dgrad import (
    DGRAD_COLS,
    DGRAD_SOURCE,
    DGRAD_STAGES,
    DGRAD_STRIDE,
    DgradKernels,
    DgradLaunch,
    all_dgrad_kernel_names,
    dgrad_column_tiles,
    dgrad_fits,
    dgrad_groups,
    dgrad_kernel_names,
    dgrad_kernels,
    dgrad_launch,
    dgrad_smem,
    dgrad_staged,
    launch_dgrad,
)
from .forward import (
    AFTER_PATCH_WORDS,
    EPILOGUE_BYTES,
    EPILOGUE_FLOATS,
    SEAM_BYTES,
    SEAM_SMEM_MAX,
    SEAM_STRIDE,
    SMEM_TARGET,
    SOURCE,
    WEIGHT_PART,
    WEIGHT_STRIDE,
    ForwardKernels,
    ForwardLaunch,
    all_kernel_names,
    fits,
    forward_kernel_names,
    forward_launch,
    forward_tmap,
    kernel,
    launch,
    launch_tiling,
    load,
    ring_staged,
    seam_bytes,
    seams_pay,
    tiling,
)
from .kernels import (
    MIN_SM,
    ConvKernel,
    Prepared,
    arch_options,
    kernel_name,
    module_keys,
    supported,
)
from .shapes import (
    DTYPES,
    PATCH_PART,
    PRECISIONS,
    SMEM_MAX,
    THREADS,
    TILE_M,
    TILE_N,
    Extents,
    Geometry,
    Tiling,
    check_extents,
    extents,
    geometry,
    pair,
    passes,
)
from .wgrad import (
    DZ_STRIDE,
    WG_RING_PART,
    WGRAD_DEPTH,
    WGRAD_SMEM,
    WGRAD_SOURCE,
    WGRAD_STAGES,
    WgradKernels,
    WgradLaunch,
    WgradPlan,
    all_wgrad_kernel_names,
    launch_wgrad,
    wgrad_bulk,
    wgrad_bulk_smem,
    wgrad_chunks,
    wgrad_fits,
    wgrad_kernels,
    wgrad_launch,
    wgrad_plan,
    wgrad_tiling,
    wgrad_tmap,
    wgrad_wg_smem,
    wgrad_wgmma,
)
