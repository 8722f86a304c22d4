"""The fused convolution's modules compiled by NVRTC (no GPU needed): one
compile per (architecture, module) in a test run, on a worker thread.

NVRTC releases the GIL while it compiles, so ``prefetch`` (called by
conftest.py once the run's tests are selected) starts the compiles the
selected ``test_fused_kernel_ptx`` cases need, and they run on a second core
while the rest of the suite runs; ``compiled`` waits for its result.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor

from cupy_act import _conv

SOURCES = {  # the fused convolution's modules: source and instantiations
    "forward": (_conv.SOURCE, _conv.all_kernel_names()),
    "wgrad": (_conv.WGRAD_SOURCE, _conv.all_wgrad_kernel_names()),
    "dgrad": (_conv.DGRAD_SOURCE, _conv.all_dgrad_kernel_names()),
}
OPTIONS = ("--std=c++17", "-ftz=true", "--device-as-default-execution-space")

_pool = ThreadPoolExecutor(max_workers=1)
_futures: dict[tuple[str, str], Future] = {}


def _compile(arch: str, source: str) -> tuple[str, str]:
    """(PTX, ptxas log) of ``source``'s module for sm_``arch``: the PTX is what
    NVVM handed ptxas, whose -v log reports registers and spills."""
    from cupy_backends.cuda.libs import nvrtc

    from cupy_act._source import assembled_source

    fname, names = SOURCES[source]
    prog = nvrtc.createProgram(assembled_source(fname), fname, (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, (*OPTIONS, f"-arch=sm_{arch}", "-Xptxas=-v"))
        return nvrtc.getPTX(prog).decode(), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def prefetch(pairs) -> None:
    """Start compiling each (arch, source) of ``pairs`` not started yet."""
    for key in pairs:
        if key not in _futures:
            _futures[key] = _pool.submit(_compile, *key)


@functools.cache
def compiled(arch: str, source: str = "forward") -> tuple[str, str]:
    """(PTX, ptxas log) of one module, compiled once per test run."""
    prefetch([(arch, source)])
    return _futures[(arch, source)].result()
