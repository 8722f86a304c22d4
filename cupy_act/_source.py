"""Find the CUDA sources and assemble them into one self-contained string.

CuPy keys its compile cache on the source text only, not on headers reached
through ``-I``. Inlining our own ``#include "x.cuh"`` lines here makes every edit
of any ``.cuh`` change the key, so a stale binary can never be reused.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.MULTILINE)

MAIN_SOURCE = "elementwise.cu"


def cuda_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` files.

    An installed wheel carries them as ``cupy_act/cuda``; a source checkout has
    them in ``cuda/`` next to the package.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parent / "cuda"):
        if (candidate / MAIN_SOURCE).is_file():
            return candidate
    raise FileNotFoundError(
        f"cupy_act: CUDA sources not found (looked for {MAIN_SOURCE} in "
        f"{here / 'cuda'} and {here.parent / 'cuda'}); reinstall cupy-act"
    )


@functools.cache
def assembled_source(name: str = MAIN_SOURCE) -> str:
    """``name`` with its local includes inlined, each file once."""
    root = cuda_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (root / fname).read_text(encoding="utf-8")
        text = _PRAGMA_ONCE.sub("", text)
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)
