"""Shared fixtures: the ``gpu`` marker skips cleanly where no CUDA device is usable;
``run_json`` runs a script of scripts/ in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device, or no CuPy
        return 0


GPU_COUNT = _gpu_count()


def pytest_configure(config):
    """Deliberate bugs (tests/mutants.py) where CUPY_ACT_MUTANT names them
    (scripts/mutants.py runs the tests so, once per mutant); CuPy's memory
    pool off where CUPY_ACT_NO_POOL=1 (compute-sanitizer sees an access past
    an array only where the array is an allocation of its own; PyTorch's
    caching allocator is turned off by PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""
    import mutants

    for m in mutants.apply_from_env():
        print(f"mutant applied: {m.name} ({m.what})")
    if os.environ.get("CUPY_ACT_NO_POOL") == "1":
        import cupy

        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)


def pytest_collection_modifyitems(config, items):
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected)
def pytest_collection_finish(session):
    """Start the NVRTC compiles the selected PTX tests need (tests/ptx.py), so
    that they run beside the rest of the suite."""
    pairs = [
        (item.callspec.params["arch"], item.callspec.params["source"])
        for item in session.items
        if getattr(item, "originalname", "") == "test_fused_kernel_ptx"
    ]
    if pairs:
        import ptx

        ptx.prefetch(pairs)


def run_json(script: str, args, out: Path, timeout: int = 900):
    """Run scripts/<script> with ``args`` and ``--json out`` (this checkout on
    PYTHONPATH); assert it succeeded and return the JSON it wrote."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args, "--json", str(out)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def record_bn_launches(monkeypatch) -> list:
    """BatchNorm launches recorded, not made: (kernel name, the packed
    parameter fields) per launch, on CPU tensors (kernels, SM count, stream,
    counters stubbed; the prepared passes and plans start empty)."""
    from types import SimpleNamespace

    from cupy_act import _batchnorm
    from cupy_act.torch import _bn_kernels, _impl

    launched: list = []

    def run_all(launches, threads, stream, argv):
        fields = _batchnorm._PARAMS.unpack(_batchnorm._scratch.buf.raw)
        launched.extend((name, fields) for name, _, _ in launches)

    monkeypatch.setattr(
        _batchnorm, "_kernel", lambda d, t, name: SimpleNamespace(ptr=name, ctx=0, resident=4)
    )
    monkeypatch.setattr(_batchnorm._launch, "run_all", run_all)
    monkeypatch.setattr(_batchnorm, "_passes", {})
    monkeypatch.setattr(_batchnorm, "_plans", {})
    monkeypatch.setitem(_batchnorm._sms, None, 132)
    monkeypatch.setattr(_impl, "_raw_stream", lambda device: 5)
    monkeypatch.setattr(_bn_kernels, "_capturing", lambda: False)
    monkeypatch.setattr(_bn_kernels, "_arrival_sets", {})
    monkeypatch.setattr(_bn_kernels, "_new_set", lambda device: 4096)
    return launched
