"""NVRTC compiles every instantiation without a GPU; the PTX has what we rely on."""

import functools
import re

import pytest

pytest.importorskip("cupy")

from cupy_act import (
    _launch,  # noqa: E402
    _loader,  # noqa: E402
)
from cupy_act._kernels import all_kernel_names, kernel_name  # noqa: E402

compile_ptx = functools.lru_cache(maxsize=None)(_loader.compile_ptx)


# 100 and 120: Blackwell (B200, RTX 50xx), so users there are not the first to compile
@pytest.fixture(scope="module", params=[75, 80, 90, 100, 120])
def compiled(request):
    return request.param, compile_ptx(request.param)


def entries(ptx: str) -> dict[str, str]:
    """Kernel entry name -> its PTX body."""
    parts = re.split(r"(?=^\.(?:visible|weak) \.entry )", ptx, flags=re.MULTILINE)
    return {re.match(r"\.\w+ \.entry (\S+)\(", p).group(1): p for p in parts[1:]}


def test_every_instantiation_compiles_without_warnings(compiled):
    arch, (ptx, log, lowered) = compiled
    assert log.strip() == "", f"sm_{arch} compiler log: {log}"
    assert set(lowered) == set(all_kernel_names())
    assert set(lowered.values()) <= set(entries(ptx)), "a name expression has no kernel"


def test_no_flush_to_zero_and_no_local_memory(compiled):
    """-ftz=true is in the options, yet no instruction may flush subnormals."""
    _, (ptx, _, _) = compiled
    assert ".ftz" not in ptx
    assert ".local" not in ptx and "__local_depot" not in ptx


def test_param_block_matches_the_host_packing(compiled):
    _, (ptx, _, _) = compiled
    sizes = set(re.findall(r"\.param \.align \d+ \.b8 \S+_param_0\[(\d+)\]", ptx))
    assert sizes == {str(_launch._PARAMS_F32.size)} == {str(_launch._PARAMS_F64.size)}


VEC_LOAD = re.compile(r"\bld\.global(\.\w+)*\.v(4\.(u32|b32|f32)|2\.(u64|b64|f64))\b")
VEC_STORE = re.compile(r"\bst\.global(\.\w+)*\.v(4\.(u32|b32|f32)|2\.(u64|b64|f64))\b")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("kind", ["forward", "forward_mask", "backward"])
@pytest.mark.parametrize("op", ["relu", "leaky_relu", "div_leaky_relu"])
def test_sm90_kernels_use_128_bit_global_accesses(op, kind, dtype):
    ptx, _, lowered = compile_ptx(90)
    body = entries(ptx)[lowered[kernel_name(op, dtype, kind)]]
    assert VEC_LOAD.search(body), "no 128-bit global load"
    assert VEC_STORE.search(body), "no 128-bit global store"
