"""The wheel carries the CUDA sources: build it, install it into a fresh virtual
environment, and compile every kernel from the installed copy."""

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cupy")
pytest.importorskip("hatchling")

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_compiles(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = dist.glob("cupy_act-*.whl")
    with __import__("zipfile").ZipFile(wheel) as zf:  # PEP 561: type checkers read our hints
        assert "cupy_act/py.typed" in zf.namelist()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True
    )
    # Dependencies (CuPy, NVRTC, NumPy) come from this interpreter's site-packages,
    # placed after the fresh environment's own, so cupy_act resolves to the wheel.
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "zz_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = textwrap.dedent(f"""
        import cupy_act, cupy_act._source as s, cupy_act._loader as l
        assert cupy_act.__file__.startswith({str(venv)!r}), cupy_act.__file__
        assert s.cuda_dir() == __import__("pathlib").Path(cupy_act.__file__).parent / "cuda"
        ptx, log, names = l.compile_ptx(90)
        assert not log.strip() and len(names) == 44
        print("ok")
    """)
    # cuda-pathfinder searches only the running environment's site-packages for
    # NVRTC, so point the loader at this environment's copy.
    libdirs = {
        str(p.parent) for p in Path(sysconfig.get_paths()["purelib"]).glob("nvidia/**/libnvrtc.so*")
    }
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=os.pathsep.join([*libdirs, os.environ.get("LD_LIBRARY_PATH", "")]),
    )
    env.pop("PYTHONPATH", None)  # (a checkout on it would shadow the wheel)
    out = subprocess.run(
        [str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
