"""Host time per call on a small tensor (launch-bound), against torch.nn.functional.

    PYTHONPATH=. python scripts/overhead.py [--n 65536] [--calls 2000]

For each case: the wall time of --calls back-to-back calls divided by --calls
(after warm-up), the least of --repeats repeats, measured in one run. The least
is the run the rest of the machine disturbed least: on a shared host the median
of the same runs moved by 10-20% between runs (seen on an H200 machine). "fwd"
calls the activation with no gradient needed; "fwd+bwd" runs autograd forward
and backward (torch.autograd.grad) from a leaf that requires grad.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import cupy_act.torch as ct


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    x = torch.randn(args.n, device="cuda")
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg), xg, g)

    def fwd_bwd_(f):  # in place on a non-leaf (x * 1), as in a model
        return lambda: torch.autograd.grad(f(xg * 1), xg, g)

    cases = [
        ("relu fwd", lambda: F.relu(x), lambda: ct.relu(x)),
        ("leaky_relu fwd", lambda: F.leaky_relu(x, 0.01), lambda: ct.leaky_relu(x, 0.01)),
        (
            "div_leaky_relu fwd",
            lambda: F.leaky_relu(x / 2.0, 0.01),
            lambda: ct.div_leaky_relu(x, 2.0, 0.01),
        ),
        ("relu fwd+bwd", fwd_bwd(F.relu), fwd_bwd(ct.relu)),
        (
            "leaky_relu fwd+bwd",
            fwd_bwd(lambda t: F.leaky_relu(t, 0.01)),
            fwd_bwd(lambda t: ct.leaky_relu(t, 0.01)),
        ),
        (
            "div_leaky_relu fwd+bwd",
            fwd_bwd(lambda t: F.leaky_relu(t / 2.0, 0.01)),
            fwd_bwd(lambda t: ct.div_leaky_relu(t, 2.0, 0.01)),
        ),
        (
            "relu fwd+bwd in place",
            fwd_bwd_(lambda t: F.relu(t, inplace=True)),
            fwd_bwd_(lambda t: ct.relu(t, inplace=True)),
        ),
        (
            "leaky_relu fwd+bwd in place",
            fwd_bwd_(lambda t: F.leaky_relu(t, 0.01, inplace=True)),
            fwd_bwd_(lambda t: ct.leaky_relu(t, 0.01, inplace=True)),
        ),
    ]
    print(
        f"\nhost time per call, {args.n} float32 elements, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}"
    )
    print(f"{'case':28s} {'torch us':>9s} {'cupy_act us':>12s} {'ratio':>7s}")
    for name, ref, ours in cases:
        t_ref, t_ours = (
            per_call_us(ref, args.calls, args.repeats),
            per_call_us(ours, args.calls, args.repeats),
        )
        print(f"{name:28s} {t_ref:9.2f} {t_ours:12.2f} {t_ours / t_ref:6.2f}x")

    # The floor for any Python autograd.Function: one that only calls torch's own
    # relu and threshold_backward, timed against F.relu in the same way.
    t_ref = per_call_us(fwd_bwd(F.relu), args.calls, args.repeats)
    t_floor = per_call_us(fwd_bwd(_TorchRelu.apply), args.calls, args.repeats)
    print(
        f"floor: a Python autograd.Function around torch.relu, fwd+bwd {t_floor:.2f} us "
        f"= {t_floor / t_ref:.2f}x F.relu's {t_ref:.2f} us"
    )


class _TorchRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, gy):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(gy, y, 0)


if __name__ == "__main__":
    main()
