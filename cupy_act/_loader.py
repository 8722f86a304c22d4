"""Compile the kernels (lazily, per (op, dtype) and device) and hand out handles.

Each (op, dtype) has its own ``cupy.RawModule`` holding that op's kinds (and
bias variants) for that dtype, so a first call compiles only what it launches
(a few kernels, not all of them); CuPy compiles it with NVRTC on the first
``get_function`` on a device and keeps the cubin in its disk cache
(``~/.cupy/kernel_cache``), so later processes load it without compiling.
``load(device)`` builds every module (``python -m cupy_act --precompile``).
``compile_ptx`` runs NVRTC directly and needs no GPU: the tests use it to check
every instantiation on CPU-only machines.

Where CuPy's cache directory exists but cannot be written (read-only), the
module is compiled in memory instead, with one warning per process (see
``_get_functions``). Where it cannot even be created, CuPy 14 already fails at
``import cupy``; ``_launch`` turns that into an error that says what to set.
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from typing import NamedTuple

from ._kernels import DTYPES, ITEMSIZE, all_kernel_names, kernel_name, module_keys, unroll
from ._registry import OPS
from ._source import assembled_source

# Launch shape (see cuda/elementwise.cu): 128-thread blocks; the vectors per
# thread are per op, kind and dtype (_registry.py). Plain (not evict-first)
# accesses; one block per chunk of work: capping the grid at 8 or 64 waves of
# resident blocks with a grid-stride loop ran 5-8% slower, so the cap is set
# far out, where it only bounds the grid of enormous inputs.
THREADS = 128  # threads per block (kThreads)
STREAMING = 0  # evict-first loads and stores
GRID_WAVES = 1024  # grid cap, in multiples of the blocks resident at once


def options() -> tuple[str, ...]:
    """Our NVRTC options; CuPy appends -ftz=true, --device-as-default-execution-space
    and -arch=sm_XX for the device."""
    return (
        "--std=c++17",
        f"-DCUPY_ACT_THREADS={THREADS}",
        f"-DCUPY_ACT_STREAMING={STREAMING}",
    )


CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


class Kernel(NamedTuple):
    """A launchable instantiation on one device, with its launch shape."""

    ptr: int  # CUfunction handle
    threads: int  # threads per block
    per_block: int  # elements one block covers per trip of its loop
    max_blocks: int  # grid cap: GRID_WAVES x the blocks resident at once
    wide: bool  # float64: scalars are passed as doubles
    ctx: int  # CUcontext the module was loaded in: the device's primary context
    function: object  # the cupy Function, which keeps its module loaded


_lock = threading.Lock()
_modules: dict[tuple, object] = {}  # (op, dtype) -> cupy.RawModule
_cache: dict[tuple, Kernel] = {}  # (device, op, dtype, kind, bias) -> Kernel
_loaded: set[tuple] = set()  # (device, op, dtype)


def _raw_module(op: str, dtype: str):
    module = _modules.get((op, dtype))
    if module is None:
        import cupy

        module = _modules[(op, dtype)] = cupy.RawModule(
            code=assembled_source(),
            options=options(),
            name_expressions=[kernel_name(*key) for key in module_keys(op, dtype)],
        )
    return module


def kernel(device_id: int, op: str, dtype: str, kind: str, bias: bool = False) -> Kernel:
    """The instantiation for (op, dtype name, kind, bias) on ``device_id``.

    The first call for an (op, dtype) on a device compiles (or loads from
    CuPy's disk cache) that module; later calls are one dict lookup.
    """
    k = _cache.get((device_id, op, dtype, kind, bias))
    if k is None:
        load(device_id, op, dtype)
        k = _cache[(device_id, op, dtype, kind, bias)]
    return k


def load(device_id: int, op: str | None = None, dtype: str | None = None) -> None:
    """Compile or load the kernels of (op, dtype) for ``device_id`` now; every op
    and dtype where they are None (idempotent)."""
    for o in OPS if op is None else (op,):
        for d in DTYPES if dtype is None else (dtype,):
            if (device_id, o, d) in _loaded:
                continue
            with _lock:
                if (device_id, o, d) not in _loaded:
                    _cache.update(_build(device_id, o, d))
                    _loaded.add((device_id, o, d))


def reset() -> None:
    """Forget compiled modules (after changing THREADS or a registry launch shape)."""
    with _lock:
        _modules.clear()
        _cache.clear()
        _loaded.clear()


_in_memory = False  # set once CuPy's kernel cache turned out to be unwritable


def cache_dir_problem() -> str | None:
    """Why CuPy's kernel cache directory cannot be written, or None if it can."""
    # CuPy's documented location (its own lookup is private and has moved)
    path = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    try:  # a real write: os.access() says yes to root even on /proc
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{path!r} cannot be written ({e})"
    return None


def load_module(
    modules: dict, key, source: str, names: list[str], device: int, extra: tuple[str, ...] = ()
):
    """(context, the cupy Functions of ``names``) from ``modules[(key, extra)]`` on
    ``device``: a RawModule of the CUDA file ``source``, built on first use
    (compiled with the NVRTC options ``extra`` added, or loaded from CuPy's disk
    cache), in the device's primary context. For the modules outside the
    elementwise ones (the fused convolution, BatchNorm); callers hold their own
    lock. The Functions are taken while ``device`` is current: a RawKernel's
    ``kernel`` is the current device's, and another device's function in
    this context is an invalid handle at launch."""
    import cupy
    from cupy.cuda import driver

    module = modules.get((key, extra))
    if module is None:
        module = modules[(key, extra)] = cupy.RawModule(
            code=assembled_source(source), options=("--std=c++17", *extra), name_expressions=names
        )
    with cupy.cuda.Device(device):
        cupy.cuda.runtime.setDevice(device)  # make the primary context current
        return driver.ctxGetCurrent(), [f.kernel for f in _get_functions(module, names)]


def _get_functions(module, names) -> list:
    """``module.get_function`` for every name, compiling in memory where CuPy's
    disk cache cannot be written (CuPy would raise a bare OSError)."""
    global _in_memory
    if not _in_memory:
        try:
            return [module.get_function(name) for name in names]
        except OSError:
            problem = cache_dir_problem()
            if problem is None:  # not the cache: a real error
                raise
        _in_memory = True
        warnings.warn(
            f"cupy_act: CuPy's kernel cache directory {problem}; compiling the kernels in "
            f"memory instead, again in every process. Set CUPY_CACHE_DIR to a writable "
            f"directory to keep them (or CUPY_CACHE_IN_MEMORY=1 to silence this).",
            RuntimeWarning,
            stacklevel=2,
        )
    # CuPy reads CUPY_CACHE_IN_MEMORY at each compilation; we hold _lock here.
    saved = os.environ.get("CUPY_CACHE_IN_MEMORY")
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
    try:
        return [module.get_function(name) for name in names]
    finally:
        if saved is None:
            del os.environ["CUPY_CACHE_IN_MEMORY"]
        else:
            os.environ["CUPY_CACHE_IN_MEMORY"] = saved


def _build(device_id: int, op: str, dtype: str) -> dict[tuple, Kernel]:
    import cupy
    from cupy.cuda import driver

    module = _raw_module(op, dtype)
    keys = module_keys(op, dtype)
    table = {}
    with cupy.cuda.Device(device_id) as device:
        # Device() skips cudaSetDevice when device_id is already the runtime's
        # device, which on a thread without CUDA work leaves no context current.
        # Since CUDA 12, cudaSetDevice makes the primary context current: load
        # the module there and record it for the launcher's context check.
        cupy.cuda.runtime.setDevice(device_id)
        ctx = driver.ctxGetCurrent()
        sms = device.attributes["MultiProcessorCount"]
        functions = _get_functions(module, [kernel_name(*key) for key in keys])
        for key, function in zip(keys, functions):
            kind = key[2]
            size = ITEMSIZE[dtype]
            fn = function.kernel  # the cupy.cuda.Function
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, THREADS, 0)
            cap = min(max(1, per_sm) * sms * GRID_WAVES, 2**31 - 1)
            per_block = THREADS * unroll(op, dtype, kind) * (16 // size)
            table[(device_id, *key)] = Kernel(fn.ptr, THREADS, per_block, cap, size == 8, ctx, fn)
    return table


def compile_ptx(arch: int, extra: tuple[str, ...] = ()) -> tuple[str, str, dict[str, str]]:
    """Compile every instantiation to PTX for ``compute_<arch>``; no GPU needed.

    Uses the options CuPy would use. Returns (ptx, compiler log, name expression
    -> lowered (mangled) name).
    """
    import cupy  # noqa: F401  (sets up the NVRTC library search path)
    from cupy_backends.cuda.libs import nvrtc

    names = all_kernel_names()
    prog = nvrtc.createProgram(assembled_source(), "cupy_act.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        opts = options() + CUPY_ADDED_OPTIONS + (f"-arch=compute_{arch}",) + tuple(extra)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        ptx = nvrtc.getPTX(prog).decode()
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
    finally:
        nvrtc.destroyProgram(prog)
    return ptx, log, lowered
