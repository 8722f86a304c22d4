"""Shared fixtures: the ``gpu`` marker skips cleanly where no CUDA device is usable."""

import pytest


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device, or no CuPy
        return 0


GPU_COUNT = _gpu_count()


def pytest_collection_modifyitems(config, items):
    if GPU_COUNT:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
