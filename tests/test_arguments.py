"""Argument checking that needs no GPU: refused inputs, scalars, mask sizes."""

import subprocess
import sys

import numpy
import pytest

pytest.importorskip("cupy")

import cupy_act  # noqa: E402
from cupy_act import _scalars  # noqa: E402
from cupy_act._kernels import all_kernel_names  # noqa: E402


class FakeDeviceArray:
    """Exports a __cuda_array_interface__ with a chosen typestr (never dereferenced)."""

    def __init__(self, typestr, shape=(4,)):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (0, False),
            "version": 3,
        }


ALL_FORWARD = [
    lambda x: cupy_act.relu(x),
    lambda x: cupy_act.leaky_relu(x, 0.1),
    lambda x: cupy_act.div_leaky_relu(x, 2.0),
    lambda x: cupy_act.relu_with_mask(x),
    lambda x: cupy_act.leaky_relu_with_mask(x),
    lambda x: cupy_act.div_leaky_relu_with_mask(x, 3),
]


@pytest.mark.parametrize("call", ALL_FORWARD)
def test_host_numpy_array_refused_with_hint(call):
    with pytest.raises(TypeError, match=r"host numpy\.ndarray.*cupy\.asarray"):
        call(numpy.ones(3, numpy.float32))


def test_cpu_torch_tensor_refused_with_hint():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"x \(Tensor\) is in host memory.*tensor\.cuda\(\)"):
        cupy_act.relu(torch.ones(3))
    with pytest.raises(TypeError, match=r"dy \(Tensor\) is in host memory"):
        cupy_act.relu_backward(torch.ones(3), None)


@pytest.mark.parametrize("bad", [[1.0, 2.0], None, "x", 3.0])
def test_non_arrays_refused(bad):
    with pytest.raises(TypeError, match="must be a CuPy array"):
        cupy_act.relu(bad)


@pytest.mark.parametrize(
    "typestr,name",
    [
        ("<i4", "int32"),
        ("|b1", "bool"),
        ("<c8", "complex64"),
        ("|u1", "uint8"),
        ("<i8", "int64"),
        ("<c16", "complex128"),
    ],
)
def test_unsupported_dtypes_named(typestr, name):
    with pytest.raises(TypeError, match=f"x has dtype {name}; supported: float32"):
        cupy_act.leaky_relu(FakeDeviceArray(typestr))


@pytest.mark.parametrize("divisor", [0, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
def test_zero_or_non_finite_divisor(divisor):
    with pytest.raises(
        ValueError, match=f"divisor must be a finite, non-zero number, got {divisor!r}"
    ):
        cupy_act.div_leaky_relu(FakeDeviceArray("<f4"), divisor)


@pytest.mark.parametrize("value", ["2", None, True, 1 + 2j, [2.0]])
def test_non_real_scalars(value):
    with pytest.raises(TypeError, match="divisor must be a real number"):
        cupy_act.div_leaky_relu(FakeDeviceArray("<f4"), value)
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        cupy_act.leaky_relu(FakeDeviceArray("<f4"), value)


def test_scalars_round_as_pytorch_does():
    f32 = numpy.float32
    # ATen: 1 / divisor in double, then rounded (differs from a float32 reciprocal)
    assert _scalars.reciprocal(-1.7, False, "f") == float(f32(1 / -1.7))
    assert _scalars.reciprocal(-1.7, False, "f") != float(f32(1) / f32(-1.7))
    assert _scalars.reciprocal(0.001, False, "f") == float(f32(1000.0))
    assert _scalars.reciprocal(3, True, "f") == 1 / 3
    assert _scalars.to_op_type(0.01, False, "s", "f") == float(f32(0.01))
    assert _scalars.to_op_type(2**60 + 1, False, "s", "f") == float(f32(2**60))
    assert _scalars.to_op_type(1e-45, False, "s", "f") > 0  # subnormal kept
    assert _scalars.to_op_type(float("nan"), False, "s", "f") != 0
    with pytest.raises(ValueError, match="out of range for float32"):
        _scalars.to_op_type(1e300, False, "negative_slope", "f")
    assert _scalars.to_op_type(1e300, True, "s", "f") == 1e300
    assert _scalars.reciprocal(1e-50, False, "f") == float("inf")  # as x / 1e-50 in ATen
    assert _scalars.reciprocal(1e300, False, "f") == 0.0
    with pytest.raises(ValueError, match="does not fit in int64"):
        _scalars.reciprocal(2**70, True, "f")


@pytest.mark.parametrize(
    "n,nbytes", [(0, 0), (1, 16), (128, 16), (129, 32), (2**31 + 1, 2**28 + 16)]
)
def test_mask_nbytes(n, nbytes):
    assert cupy_act.mask_nbytes(n) == nbytes
    assert nbytes % 16 == 0 and (n + 7) // 8 <= nbytes < (n + 7) // 8 + 16


def test_instantiation_table():
    """Every op x dtype x kind, plus forward kinds with bias for ops with a divisor;
    each (op, dtype) module holds its own, and launch shapes fit the mask store."""
    from cupy_act._kernels import DTYPES, ITEMSIZE, module_keys
    from cupy_act._registry import KINDS, OPS

    names = all_kernel_names()
    with_bias = sum(op.divisor for op in OPS.values())
    assert len(names) == len(set(names)) == len(DTYPES) * (len(OPS) * len(KINDS) + 2 * with_bias)
    for name, op in OPS.items():
        for dtype in DTYPES:
            keys = module_keys(name, dtype)
            assert {k[2] for k in keys} == set(KINDS) and all(k[:2] == (name, dtype) for k in keys)
            size = ITEMSIZE[dtype]
            assert op.unroll["forward_mask"][size] <= 32 // (16 // size)


def test_import_does_not_import_torch():
    code = "import sys, cupy_act; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_launch_makes_the_kernels_context_current(monkeypatch):
    """The launcher's context check, with the driver calls recorded (no GPU):
    for a kernel's launch, for a buffer zeroed before one and for a kernel's
    occupancy."""
    from cupy_act import _launch
    from cupy_act._loader import Kernel

    calls = []
    current = {"ctx": 0}
    monkeypatch.setattr(_launch, "_ctx_get_current", lambda: current["ctx"])

    def set_current(ctx):
        calls.append(("set", ctx))
        current["ctx"] = ctx

    monkeypatch.setattr(_launch, "_ctx_set_current", set_current)
    monkeypatch.setattr(
        _launch, "_launch_kernel", lambda *a: calls.append(("launch", current["ctx"]))
    )
    k = Kernel(
        ptr=1, threads=128, per_block=512, max_blocks=10, wide=False, ctx=0xC0, function=None
    )
    # no context current (a fresh thread): made current and left current
    _launch.Launch(k, 0.0, 1.0)(0, 100, 0, 0)
    assert calls == [("set", 0xC0), ("launch", 0xC0)] and current["ctx"] == 0xC0
    # the kernel's context current: one check, no switch
    calls.clear()
    _launch.Launch(k, 0.0, 1.0)(0, 100, 0, 0)
    assert calls == [("launch", 0xC0)]
    # another device's context current: switched for the launch, then restored
    calls.clear()
    current["ctx"] = 0xD1
    _launch.Launch(k, 0.0, 1.0)(0, 100, 0, 0)
    assert calls == [("set", 0xC0), ("launch", 0xC0), ("set", 0xD1)] and current["ctx"] == 0xD1
    # a buffer zeroed for a launch (_launch.zero): the same rule
    monkeypatch.setattr(
        _launch, "_memset_async", lambda *a: calls.append(("memset", current["ctx"], a))
    )
    calls.clear()
    _launch.zero(0xC0, 0x1000, 64, 5)
    assert calls == [("set", 0xC0), ("memset", 0xC0, (0x1000, 0, 64, 5)), ("set", 0xD1)]
    calls.clear()
    current["ctx"] = 0xC0
    _launch.zero(0xC0, 0x1000, 64, 5)
    assert calls == [("memset", 0xC0, (0x1000, 0, 64, 5))]
    # a kernel's occupancy (resident_blocks): asked in its context, at least 1
    from cupy.cuda import driver

    blocks = iter([3, 0])
    monkeypatch.setattr(
        driver,
        "occupancyMaxActiveBlocksPerMultiprocessor",
        lambda *a: calls.append(("occupancy", current["ctx"], a)) or next(blocks),
    )
    calls.clear()
    current["ctx"] = 0xD1
    assert _launch.resident_blocks(0xC0, 9, 256, 1024) == 3
    assert calls == [("set", 0xC0), ("occupancy", 0xC0, (9, 256, 1024)), ("set", 0xD1)]
    assert _launch.resident_blocks(0xC0, 9, 256) == 1  # (a kernel that fits none: one)


@pytest.mark.parametrize("wide", [False, True], ids=["float", "double"])
def test_launch_packs_the_params_block(monkeypatch, wide):
    """The block the driver receives, decoded: per-call fields and the scalars,
    without a bias (each thread's own block) and with one, from two threads."""
    import ctypes
    import threading

    from cupy_act import _launch
    from cupy_act._loader import Kernel

    pack = _launch._PARAMS_F64 if wide else _launch._PARAMS_F32
    seen = []
    monkeypatch.setattr(_launch, "_ctx_get_current", lambda: 0xC0)

    def record(ptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        block = ctypes.c_void_p.from_address(argv).value
        seen.append(((gx, bx, stream), pack.unpack(ctypes.string_at(block, pack.size))))

    monkeypatch.setattr(_launch, "_launch_kernel", record)
    k = Kernel(ptr=1, threads=128, per_block=512, max_blocks=3, wide=wide, ctx=0xC0, function=None)
    launch = _launch.Launch(k, 0.25, -0.5)
    launch(7, 1000, 0x100, 0x200)
    launch(7, 10**6, 0x300, 0x400, 0x500, 9, 0x600, 35, 4)
    launch(8, 1, 0x700, 0x800, 0x900, 1)  # no bias again: its block kept the scalars
    t = threading.Thread(target=launch, args=(9, 513, 0xA00, 0xB00))
    t.start()
    t.join()
    assert seen == [
        ((2, 128, 7), (0x100, 0x200, 0, 0, 1000, 0, 1, 1, 0.25, -0.5, 1.0, 1.0, 1.0)),
        ((3, 128, 7), (0x300, 0x400, 0x500, 0x600, 10**6, 9, 35, 4, 0.25, -0.5, 1.0, 1 / 35, 0.25)),
        ((1, 128, 8), (0x700, 0x800, 0x900, 0, 1, 1, 1, 1, 0.25, -0.5, 1.0, 1.0, 1.0)),
        ((2, 128, 9), (0xA00, 0xB00, 0, 0, 513, 0, 1, 1, 0.25, -0.5, 1.0, 1.0, 1.0)),
    ]
    assert len(launch._blocks) == 2  # one block per thread that launched without a bias


def test_unwritable_kernel_cache_compiles_in_memory(monkeypatch, tmp_path):
    """CUPY_CACHE_DIR under a file: one warning naming it, then in-memory compiles."""
    import os
    import warnings

    from cupy_act import _loader

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.setattr(_loader, "_in_memory", False)

    class Module:  # get_function fails as CuPy's does unless compiling in memory
        def get_function(self, name):
            if os.environ.get("CUPY_CACHE_IN_MEMORY") != "1":
                raise FileNotFoundError(2, "No such file or directory", str(blocker / "cache"))
            return name

    with pytest.warns(RuntimeWarning, match=r"a_file/cache.*cannot be written.*Set CUPY_CACHE_DIR"):
        assert _loader._get_functions(Module(), ["a", "b"]) == ["a", "b"]
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ  # restored
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert _loader._get_functions(Module(), ["c"]) == ["c"]

    class Broken:  # an OSError that is not about the cache is not swallowed
        def get_function(self, name):
            raise OSError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setattr(_loader, "_in_memory", False)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "writable"))
    with pytest.raises(OSError, match="libnvrtc"):
        _loader._get_functions(Broken(), ["a"])
