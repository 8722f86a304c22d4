"""``python -m cupy_act``: self-check, then a short benchmark.

On a GPU: every op, kind and dtype is checked bit for bit against PyTorch eager
(random data with special values mixed in), then a short table compares the
kernels with PyTorch and a device copy. Without a GPU it says so and runs the
CPU checks: NVRTC compiles every kernel and the PTX is inspected.
Exits non-zero on any mismatch.

    python -m cupy_act [--precompile] [--size N]
"""

from __future__ import annotations

import argparse
import sys
import time


def _say(msg: str) -> None:
    print(msg, flush=True)


def cpu_checks() -> int:
    """Compile every instantiation with NVRTC for sm_80, sm_90, sm_100 and sm_120; no GPU needed."""
    from . import _loader

    failures = 0
    for arch in (80, 90, 100, 120):
        t0 = time.perf_counter()
        ptx, log, names = _loader.compile_ptx(arch)
        ok = not log.strip() and ".ftz" not in ptx and len(names) > 0
        failures += not ok
        _say(
            f"  NVRTC sm_{arch}: {len(names)} kernels, {time.perf_counter() - t0:.1f} s, "
            f"{'ok' if ok else 'FAILED: ' + log.strip()}"
        )
    return failures


def gpu_checks(size: int) -> int:
    """Bit equality with PyTorch for every op, kind and dtype."""
    import cupy
    import torch

    import cupy_act

    from . import testing

    failures = 0
    for dtype in testing.DTYPES:
        for op, slope, divisor in testing.cases(slopes=(0.2,), divided=((0.01, 2.0),)):
            kw, rkw = testing.op_kwargs(op, slope, divisor), {"slope": slope, "divisor": divisor}
            xt = testing.make_input(size, dtype, seed=1)
            dyt = testing.make_input(size, dtype, seed=2)
            x = cupy.from_dlpack(xt)
            try:
                y = getattr(cupy_act, op)(x, **kw)
                testing.assert_bits_equal(
                    torch.from_dlpack(y), testing.forward(op, xt, **rkw), "forward"
                )
                y, m = getattr(cupy_act, op + "_with_mask")(x, **kw)
                testing.assert_bits_equal(
                    torch.from_dlpack(y), testing.forward(op, xt, **rkw), "with mask"
                )
                bits = torch.from_dlpack(cupy_act.unpack_mask(m, size))
                assert torch.equal(bits, testing.mask_bits(op, xt, rkw.get("divisor"))), (
                    "mask bits differ"
                )
                dx = getattr(cupy_act, op + "_backward")(cupy.from_dlpack(dyt), m, **kw)
                testing.assert_bits_equal(
                    torch.from_dlpack(dx), testing.backward(op, xt, dyt, **rkw), "backward"
                )
                status = "ok"
            except AssertionError as e:
                failures += 1
                status = f"MISMATCH: {e}"
            _say(f"  {op:16s} {str(dtype)[6:]:9s} forward, mask, backward: {status}")
    return failures


def short_benchmark(n: int) -> None:
    """Median CUDA-event times against PyTorch and a device copy (float32)."""
    import cupy
    import torch
    import torch.nn.functional as F

    import cupy_act

    from . import testing

    x = torch.randn(n, device="cuda")
    dy = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    cx, cdy, cy = cupy.from_dlpack(x), cupy.from_dlpack(dy), cupy.from_dlpack(y)
    mask = cupy.empty(cupy_act.mask_nbytes(n), dtype=cupy.uint8)

    def ms(fn):  # 5 calls per timing, so the host's per-call work overlaps the GPU's
        return testing.median_ms(fn, iters=10, reps=5)

    cases = [
        ("device copy", lambda: y.copy_(x), 8 * n),
        ("torch F.leaky_relu", lambda: F.leaky_relu(x, 0.01), 8 * n),
        ("cupy_act leaky_relu", lambda: cupy_act.leaky_relu(cx, 0.01, out=cy), 8 * n),
        (
            "cupy_act leaky_relu_with_mask",
            lambda: cupy_act.leaky_relu_with_mask(cx, 0.01, out=cy, mask=mask),
            8 * n + n // 8,
        ),
        (
            "torch leaky_relu_backward",
            lambda: torch.ops.aten.leaky_relu_backward(dy, x, 0.01, False),
            12 * n,
        ),
        (
            "cupy_act leaky_relu_backward",
            lambda: cupy_act.leaky_relu_backward(cdy, mask, 0.01, out=cy),
            8 * n + n // 8,
        ),
        ("torch x / 2 then F.leaky_relu", lambda: F.leaky_relu(x / 2, 0.01), 16 * n),
        ("cupy_act div_leaky_relu", lambda: cupy_act.div_leaky_relu(cx, 2, out=cy), 8 * n),
    ]
    _say(
        f"\n  float32, {n} elements, {torch.cuda.get_device_name()}; per call, median of 10 "
        f"CUDA-event timings of 5 calls each"
    )
    _say(f"  {'':32s} {'ms':>8s} {'GB/s':>7s} {'% of copy BW':>13s}")
    copy_bw = None
    for name, fn, nbytes in cases:  # printed as measured
        t = ms(fn)
        copy_bw = copy_bw or nbytes / t
        _say(f"  {name:32s} {t:8.3f} {nbytes / t / 1e6:7.0f} {100 * nbytes / t / copy_bw:12.1f}%")


def _gpu_count() -> tuple[int, str]:
    """(CUDA devices CuPy sees, why there are none in words)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount(), "no device"
    except Exception as e:  # no driver, or no device
        text = str(e)
        if "insufficient" in text or "no CUDA-capable device" in text or "libcuda" in text:
            return 0, f"no NVIDIA driver or device: {text}"
        return 0, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupy_act", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--precompile",
        action="store_true",
        help="compile every kernel for the current GPU now and report the time",
    )
    ap.add_argument("--size", type=int, default=(1 << 20) + 7, help="elements per check")
    ap.add_argument("--bench-size", type=int, default=1 << 28, help="elements in the benchmark")
    args = ap.parse_args(argv)

    gpus, why = _gpu_count()
    if not gpus:
        _say(
            f"cupy_act: no NVIDIA GPU found ({why}). The kernels need an NVIDIA GPU "
            f"(compute capability 8.0 or newer) and its driver; running the CPU checks only."
        )
        failures = cpu_checks()
        _say("CPU checks passed." if not failures else f"{failures} CPU check(s) FAILED.")
        return 1 if failures else 0

    import cupy

    from . import _conv, _loader

    if args.precompile:
        t0 = time.perf_counter()
        device = cupy.cuda.runtime.getDevice()
        _loader.load(device)
        if _conv.supported(device):  # (compute capability 8.0 or newer)
            _conv.load(device)
        _say(f"cupy_act: compiled or loaded all kernels in {time.perf_counter() - t0:.2f} s")
    try:
        import torch  # noqa: F401
    except ImportError:
        _say("cupy_act: PyTorch is the reference for the checks; install it (pip install torch).")
        return 1
    _say("cupy_act: checking every kernel bit for bit against PyTorch eager ...")
    failures = gpu_checks(args.size)
    if failures:
        _say(f"{failures} check(s) FAILED.")
        return 1
    _say("All checks passed. Short benchmark:")
    short_benchmark(args.bench_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
