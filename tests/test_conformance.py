"""The conformance suite: every row of tests/conformance_rows.py, each in a fresh
subprocess (first use of a process, thread, device or kernel cache is what
several rows test, and earlier tests in this process would hide it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conformance_rows import ROWS  # noqa: E402
from conftest import GPU_COUNT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "conformance_rows.py"


# Inductor's C++ compiles of the CPU rows (compile_*, export_*: 3-5 s each on
# a 2-core machine, more with a cold cache) run in the exhaustive pass
# (pytest -m slow, which .ci/run runs too); on a GPU every row runs. So do
# the CPU rows of the torch.func transforms other than grad and vmap (3 s
# each, 18 s in all on a 2-core machine, where README's test command came to
# 186-211 s with its install); func_grad and func_vmap stay.
INDUCTOR_ROWS = ("compile", "export")
COMPOSED_FUNC_ROWS = ("func_hessian", "func_jacfwd", "func_jacrev", "func_jvp", "func_vjp",
                      "func_per_sample_grads")  # fmt: skip


def _marks(name: str, device: str) -> list:
    if device.startswith("cuda"):
        return [pytest.mark.gpu]
    slow = name.startswith(INDUCTOR_ROWS) or name in COMPOSED_FUNC_ROWS
    return [pytest.mark.slow] if slow else []


PARAMS = [
    pytest.param(name, device, marks=_marks(name, device), id=f"{name}-{device}")
    for name, r in ROWS.items()
    for device in r.devices
]


@pytest.mark.parametrize("name,device", PARAMS)
def test_row(name, device):
    r = ROWS[name]
    gpus = max(r.gpus, 2 if device == "cuda:1" else 0)
    if GPU_COUNT < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {GPU_COUNT}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(r.env or {}))
    proc = subprocess.run(
        [*(r.launcher or (sys.executable,)), str(SCRIPT), name, device],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"PASS {name} {device}" in proc.stdout, out[-6000:]


def test_every_registry_op_has_an_independent_case():
    """Each op is checked against a hand-written PyTorch expression, not only
    against the registry's own reference."""
    from conformance_rows import cases

    from cupy_act._registry import OPS

    assert set(OPS) <= {c.name for c in cases()}
