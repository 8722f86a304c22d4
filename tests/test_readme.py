"""README keeps exactly two set-up commands, CI runs the test one, and every
Python block of README runs as written: on the CPU those that need no GPU,
on a GPU (the device suite) those that start with "# on an NVIDIA GPU"."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()
GPU_BLOCK = "# on an NVIDIA GPU"


def setup_commands():
    section = README.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.DOTALL)


def test_two_setup_commands_and_ci_runs_the_test_one():
    main_job, tests = setup_commands()
    assert "python3 -m cupy_act" in main_job
    assert "pytest" in tests
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert tests.strip() in [line.strip() for line in ci]


BLOCKS = re.findall(r"```python\n(.*?)\n```", README, flags=re.DOTALL)


def _params():
    for i, code in enumerate(BLOCKS):
        gpu = code.startswith(GPU_BLOCK)
        title = README[: README.index(code)].rsplit("\n## ", 1)[-1].split("\n", 1)[0]
        marks = [pytest.mark.gpu] if gpu else []
        yield pytest.param(code, marks=marks, id=f"{i}-{title[:24].replace(' ', '_')}")


def test_readme_has_python_blocks_of_both_kinds():
    assert len(BLOCKS) >= 4 and any(b.startswith(GPU_BLOCK) for b in BLOCKS)


@pytest.mark.parametrize("code", list(_params()))
def test_readme_block_runs_as_written(code, tmp_path):
    """Each block alone, in a fresh process with this checkout importable, from
    an empty directory (nothing it did not define itself)."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning:cupy_act", "-c", code],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
