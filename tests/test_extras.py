"""The CUDA extras install only what cupy_act loads: CuPy, NVRTC and the CUDA
runtime, not the math libraries of CuPy's ``ctk`` extra (2.3 GB).

Read from the installed metadata (no network): cupy-act's own requirements,
and through every distribution installed here, what they require in turn.
"""

import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement

# what cupy_act never loads: CuPy's ctk extra brings these
UNUSED = re.compile(r"cublas|cufft|curand|cusolver|cusparse|nvjitlink|npp|nvjpeg", re.I)
ALLOWED_CTK_PARTS = {"cudart", "nvrtc"}


def _requirements(dist: str, extras: set[str]) -> list[Requirement]:
    """The requirements of an installed ``dist`` that apply with ``extras``."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None:
            out.append(req)
        elif any(req.marker.evaluate({"extra": e}) for e in extras):
            out.append(req)
    return out


def _closure(extra: str) -> tuple[list[Requirement], set[str]]:
    """(cupy-act[extra]'s own requirements, every distribution name they reach
    through what is installed here)."""
    top = [r for r in _requirements("cupy-act", {extra}) if r.marker is not None]
    seen: set[str] = set()
    todo = [(r.name, set(r.extras)) for r in top]
    while todo:
        name, extras = todo.pop()
        key = f"{name.lower()}{sorted(extras)}"
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = _requirements(name, extras | {""})
        except metadata.PackageNotFoundError:  # not installed here: its own name only
            continue
        todo += [(r.name, set(r.extras)) for r in reqs]
    return top, {k.split("[")[0] for k in seen}


@pytest.fixture(scope="module")
def installed():
    try:
        return metadata.distribution("cupy-act")
    except metadata.PackageNotFoundError:
        pytest.skip("cupy-act is not installed (pip install -e .)")


@pytest.mark.parametrize("extra", ["cuda12", "cuda13"])
def test_cuda_extras_bring_only_what_the_package_loads(installed, extra):
    top, names = _closure(extra)
    assert top, f"no requirements for extra {extra!r}"
    cupy = [r for r in top if r.name.startswith("cupy-cuda")]
    assert len(cupy) == 1 and not cupy[0].extras, f"{extra}: CuPy with extras {cupy}"
    for r in top:
        if r.name == "cuda-toolkit":
            assert set(r.extras) <= ALLOWED_CTK_PARTS, f"{extra}: cuda-toolkit{sorted(r.extras)}"
        assert not UNUSED.search(r.name), f"{extra} asks for {r.name}"
    unused = sorted(n for n in names if UNUSED.search(n))
    assert not unused, f"{extra} pulls {unused}, which cupy_act never loads"


def test_the_closure_walks_installed_metadata(installed):
    """The walk above does reach through installed packages: where CuPy's ctk
    extra is installed, its metadata leads to the libraries the extras avoid."""
    try:
        metadata.distribution("cuda-toolkit")
    except metadata.PackageNotFoundError:
        pytest.skip("cuda-toolkit is not installed here")
    reqs = _requirements("cuda-toolkit", {"cublas"})
    assert any(UNUSED.search(r.name) for r in reqs), reqs
