"""Autograd forward + backward on the CPU: cupy_act's plain-torch path against torch.

    PYTHONPATH=. python scripts/cpu_path.py [--log2n 24] [--rounds 15]

Each round times torch's op and ours once each, alternating, on the same
float32 input and upstream gradient; printed is the least time of each over
the rounds (the runs the rest of the machine disturbed least) and their ratio,
for every registry op. Beside them, the floor of any mask-saving CPU path
built from PyTorch's own kernels (none reads a mask): the forward, the mask
as a bool tensor (one comparison, no packing), and the backward kernel fed a
0/1 stand-in made from it, written over the stand-in, without autograd.
"""

from __future__ import annotations

import argparse
import time

import torch

import cupy_act.torch as ct
from cupy_act import _reference, testing
from cupy_act._registry import OPS


def floor(op, x, dy, slope, divisor):
    """The torch-kernel floor (see the module docstring)."""
    y, t = _reference.reference(op, x, slope, divisor, None)
    stand_in = torch.empty_like(dy).copy_(_reference.bits(op, t))
    dx = OPS[op].torch_backward(torch, dy, stand_in, slope, stand_in)
    return y, dx.div_(divisor) if OPS[op].divisor else dx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << args.log2n, generator=g)
    dy = torch.randn(1 << args.log2n, generator=g)
    print(f"autograd fwd+bwd, 2^{args.log2n} float32 on the CPU, {torch.get_num_threads()} threads")
    print(
        f"{'op':16s} {'torch ms':>9s} {'cupy_act ms':>12s} {'ratio':>7s} "
        f"{'floor ms':>9s} {'ratio':>7s}"
    )
    for op in OPS:
        kw = testing.op_kwargs(op, 0.01, 2.0)

        def ref(u, op=op):
            return testing.forward(op, u, 0.01, 2.0)

        def ours(u, op=op, kw=kw):
            return getattr(ct, op)(u, **kw)

        best = {}
        for _ in range(args.rounds):
            for name, f in (("torch", ref), ("ours", ours)):
                xr = x.detach().requires_grad_(True)
                t0 = time.perf_counter()
                torch.autograd.grad(f(xr), xr, dy)
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            floor(op, x, dy, 0.01, 2.0)
            best["floor"] = min(best.get("floor", 1e9), (time.perf_counter() - t0) * 1e3)
        print(
            f"{op:16s} {best['torch']:9.1f} {best['ours']:12.1f} "
            f"{best['ours'] / best['torch']:6.2f}x {best['floor']:9.1f} "
            f"{best['floor'] / best['torch']:6.2f}x"
        )


if __name__ == "__main__":
    main()
