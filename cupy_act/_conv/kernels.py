"""The fused convolution's compiled modules and prepared launches: one
``cupy.RawModule`` per dtype and source (the forward's, the weight gradient's,
the input gradient's), compiled on the first call that needs it and kept per
device; the device queries a launch plan needs (compute capability,
residency, shared-memory limits); ``Prepared``, a kernel's launch with its
``ConvParams`` packed once per shape and the call's addresses filled in per
call."""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

from .. import _launch, _loader
from .._kernels import CTYPES
from .._scalars import kernel_scalars
from .shapes import THREADS, Geometry, Tiling


def kernel_name(dtype: str, n_passes: int, channels_last: bool) -> str:
    """The C++ name expression of one instantiation."""
    cl = "true" if channels_last else "false"
    return f"cupy_act::conv2d_kernel<{CTYPES[dtype]}, {n_passes}, {cl}>"


def module_keys(dtype: str) -> tuple[tuple[str, int, bool], ...]:
    """(dtype, passes, channels_last) of the instantiations in dtype's module."""
    counts = (3, 1) if dtype == "float32" else (1,)
    return tuple((dtype, n, cl) for n in counts for cl in (False, True))


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


_lock = threading.Lock()
_modules: dict[object, object] = {}
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


_sms: dict[int, int] = {}
_names: dict[int, str] = {}


def _sm(device: int) -> int:
    """The device's compute capability as one number (9.0: 90)."""
    sm = _sms.get(device)
    if sm is None:
        import cupy

        sm = _sms[device] = int(cupy.cuda.Device(device).compute_capability)
    return sm


# The fused convolution's kernels need compute capability 8.0 (TF32 tensor
# cores: mma.sync m16n8k8, cp.async); older devices take PyTorch's path.
MIN_SM = 80


def supported(device: int) -> bool:
    """Whether the fused convolution's kernels run on ``device``."""
    return _sm(device) >= MIN_SM


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

        per_sm = _launch.resident_blocks(k.ctx, k.ptr, THREADS, smem)
        sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        n = _resident[key] = per_sm * sms
    return n


def _allow_smem(k: ConvKernel, nbytes: int) -> None:
    """Raise the kernel's dynamic shared memory limit to ``nbytes`` (past 48 KiB
    it must be asked for)."""
    if _smem_set.get(k.ptr, 48 * 1024) >= nbytes:
        return
    import cupy

    driver = cupy.cuda.driver
    attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _launch.in_context(k.ctx, driver.funcSetAttribute, k.ptr, attr, nbytes)  # (see in_context)
    _smem_set[k.ptr] = nbytes


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
