"""Compile the kernels (lazily, once per device per process) and hand out handles.

All instantiations live in one ``cupy.RawModule``; CuPy compiles it with NVRTC
on the first ``get_function`` on a device and keeps the cubin in its disk cache
(``~/.cupy/kernel_cache``), so later processes load it without compiling.
``compile_ptx`` runs NVRTC directly and needs no GPU: the tests use it to check
every instantiation on CPU-only machines.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from ._kernels import all_kernel_names
from ._source import assembled_source

# Launch shape (see cuda/elementwise.cu), measured with scripts/tune.py on an
# H200 at 4096 x 393216: 128-thread blocks; one 16-byte vector per thread for
# 4- and 8-byte types, two for 16-bit types; plain (not evict-first) accesses;
# and one block per chunk of work. Capping the grid at 8 or 64 waves of
# resident blocks with a grid-stride loop ran 5-8% slower, so the cap is set
# far out, where it only bounds the grid of enormous inputs.
THREADS = 128  # threads per block (kThreads)
UNROLL = {2: 2, 4: 1, 8: 1}  # itemsize -> 16-byte vectors per thread and trip
STREAMING = 0  # evict-first loads and stores
GRID_WAVES = 1024  # grid cap, in multiples of the blocks resident at once


def options() -> tuple[str, ...]:
    """Our NVRTC options; CuPy appends -ftz=true, --device-as-default-execution-space
    and -arch=sm_XX for the device."""
    return (
        "--std=c++17",
        f"-DCUPY_ACT_THREADS={THREADS}",
        *(f"-DCUPY_ACT_UNROLL_{size}={u}" for size, u in sorted(UNROLL.items())),
        f"-DCUPY_ACT_STREAMING={STREAMING}",
    )


CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


class Kernel(NamedTuple):
    """A launchable instantiation on one device."""

    ptr: int  # CUfunction handle
    resident: int  # blocks resident on the whole device at once (SMs x occupancy)
    function: object  # the cupy Function, which keeps its module loaded


_lock = threading.Lock()
_module = None
_tables: dict[int, dict[str, Kernel]] = {}


def _raw_module():
    global _module
    if _module is None:
        import cupy

        _module = cupy.RawModule(
            code=assembled_source(),
            options=options(),
            name_expressions=all_kernel_names(),
        )
    return _module


def kernels(device_id: int) -> dict[str, Kernel]:
    """Name expression -> Kernel for ``device_id``, compiling on first use."""
    table = _tables.get(device_id)
    if table is None:
        with _lock:
            table = _tables.get(device_id)
            if table is None:
                table = _build_table(device_id)
                _tables[device_id] = table
    return table


def reset() -> None:
    """Forget compiled modules (after changing THREADS/UNROLL/STREAMING)."""
    global _module
    with _lock:
        _module = None
        _tables.clear()


def _build_table(device_id: int) -> dict[str, Kernel]:
    import cupy
    from cupy.cuda import driver

    module = _raw_module()
    with cupy.cuda.Device(device_id) as device:
        sms = device.attributes["MultiProcessorCount"]
        table = {}
        for name in all_kernel_names():
            fn = module.get_function(name).kernel  # the cupy.cuda.Function
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, THREADS, 0)
            table[name] = Kernel(fn.ptr, max(1, per_sm) * sms, fn)
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
