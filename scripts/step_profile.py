"""Where a training step's device time goes: the PyTorch profiler's kernels,
summed by what they compute (convolution, BatchNorm forward, BatchNorm
backward, activation, other), as the BatchNorm issue's table has it.

Used by ``scripts/models.py --profile``. Kernels are sorted by name:
cuDNN's and PyTorch's BatchNorm kernels, cupy_act's ``bn_*`` kernels and
Inductor's ``triton_*`` kernels named after the BatchNorm ops they hold (with
the activation, where Inductor fused it) are BatchNorm; activation kernels
alone are the activation; convolution and GEMM kernels (cuDNN, CUTLASS,
xmma, layout transforms) are the convolution; the rest (optimizer, loss,
pooling, additions) is other.
"""

from __future__ import annotations

import re

import torch

CATEGORIES = ("convolution", "BN fwd", "BN bwd", "activation", "other")

_BN_BWD = re.compile(
    r"batch_norm_backward|bn_bw|bn_backward|bn_finalize_grad|bn_reduce<[^>]*, [12], \d+>"
)
_BN_FWD = re.compile(
    r"batch_norm|bn_fw|bn_forward|bn_finalize_stats|bn_reduce<|welford|BatchNorm", re.I
)
_ACT = re.compile(r"leaky_relu|relu|threshold|act_kernel|cupy_act::", re.I)
_CONV = re.compile(
    r"conv|cudnn|xmma|gemm|cutlass|implicit|wgrad|dgrad|nchwToNhwc|nhwcToNchw|sm\d\d_", re.I
)


def category(kernel: str) -> str:
    """The CATEGORIES entry of a kernel's name."""
    if _BN_BWD.search(kernel):
        return "BN bwd"
    if _BN_FWD.search(kernel):
        return "BN fwd"
    if _CONV.search(kernel):
        return "convolution"
    if _ACT.search(kernel):
        return "activation"
    return "other"


def breakdown(step, steps: int = 3) -> dict:
    """Device milliseconds per step by category (and "total"), from ``steps``
    profiled calls of ``step()`` after one unprofiled one; "top other" lists
    the largest kernels counted as other, for checking the sorting."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = dict.fromkeys(CATEGORIES, 0.0)
    others: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us <= 0:
            continue
        c = category(e.key)
        out[c] += us / 1e3 / steps
        if c == "other":
            others[e.key[:60]] = others.get(e.key[:60], 0.0) + us / 1e3 / steps
    out["total"] = sum(out[c] for c in CATEGORIES)
    out["top other"] = sorted(others.items(), key=lambda kv: -kv[1])[:4]
    return out


def print_table(rows: dict) -> None:
    """rows: variant -> breakdown()."""
    print("    device ms / step  " + "".join(f"{c:>12s}" for c in (*CATEGORIES, "total")))
    for v, r in rows.items():
        cells = "".join(f"{r[c]:12.2f}" for c in (*CATEGORIES, "total"))
        print(f"    {v:18s}{cells}")
    for v, r in rows.items():
        top = ", ".join(f"{k} {ms:.2f}" for k, ms in r["top other"])
        print(f"    ({v}: largest 'other' kernels: {top})")
