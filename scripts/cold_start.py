"""Time to the first result of a fresh process, with an empty and a warm kernel cache.

    PYTHONPATH=. python scripts/cold_start.py [--runs 3]

Each measurement is a new Python process with its own CUPY_CACHE_DIR: it
imports torch and cupy_act, makes a CUDA tensor, then times its first
``cupy_act.torch.leaky_relu`` call (compiling or loading that op's module) to
a synchronized result, and then a first autograd forward + backward of
another op. "empty" starts from an empty cache directory, "warm" reuses the
one the empty run filled; "torch's own ops" makes the same calls with
torch.nn.functional, for the cost PyTorch itself has on first use. Last,
``python -m cupy_act --precompile`` in an empty cache reports the time to
build every module.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

# LIB is cupy_act.torch, or torch.nn.functional for the baseline: the same
# calls with PyTorch's own ops, whose first autograd backward of a process has
# a cost of its own (the engine's device threads)
CHILD = r"""
import time, torch
import {lib} as ct
x = torch.randn(1 << 20, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
ct.leaky_relu(x, 0.01)
torch.cuda.synchronize()
t1 = time.perf_counter()
xr = x.clone().requires_grad_(True)
torch.autograd.grad(ct.relu(xr), xr, x)
torch.cuda.synchronize()
print(f"first={{t1 - t0:.3f}} second_op_fwd_bwd={{time.perf_counter() - t1:.3f}}")
"""


def child(cache: str, *args: str) -> str:
    env = dict(os.environ, CUPY_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stdout + out.stderr)
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import measure  # (scripts/measure.py, beside this script)

    measure.require_gpu("cold_start.py")
    res: dict[str, list[float]] = {}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            for state, lib in (
                ("empty", "cupy_act.torch"),
                ("warm", "cupy_act.torch"),
                ("torch's own ops", "torch.nn.functional"),
            ):
                out = child(cache, "-c", CHILD.format(lib=lib))
                m = re.search(r"first=(\S+) second_op_fwd_bwd=(\S+)", out)
                res.setdefault(f"{state}: first leaky_relu call", []).append(float(m.group(1)))
                res.setdefault(f"{state}: then relu fwd+bwd", []).append(float(m.group(2)))
    with tempfile.TemporaryDirectory() as cache:
        out = child(
            cache, "-m", "cupy_act", "--precompile", "--size", "4097", "--bench-size", "4096"
        )
        m = re.search(r"compiled or loaded all kernels in (\S+) s", out)
        res["empty: --precompile (every module)"] = [float(m.group(1))]
    print(f"{'seconds to the first result (median of runs)':48s} {'s':>7s}")
    for name, v in res.items():
        print(f"{name:48s} {statistics.median(v):7.3f}")


if __name__ == "__main__":
    main()
