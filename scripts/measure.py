"""What the benchmarks of scripts/ share: the run's environment line, the copy
bandwidth they measure against, Markdown tables, targets, and the profiler's
device time by kind of kernel. Not a script of its own; the timing itself is
``cupy_act.testing.median_ms`` / ``interleaved_median_ms``.
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from cupy_act import testing

ROOT = Path(__file__).resolve().parents[1]


def require_gpu(script: str) -> None:
    """Exit with a sentence, not a traceback, where no CUDA GPU is usable."""
    if not torch.cuda.is_available():
        raise SystemExit(
            f"scripts/{script}: needs an NVIDIA GPU that torch can use (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}: torch.cuda.is_available() "
            "is False). The tests run without one: python3 -m pytest -q tests"
        )


def environment() -> dict:
    """GPU, versions, date, commit and command line of this run."""
    import cupy

    try:
        # (-dirty where the files differ from the commit: a copy of a working tree)
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT,
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        commit = ""
    return dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        cupy=cupy.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        date=datetime.date.today().isoformat(),
        commit=commit or "unknown",
        command=" ".join(["python", *sys.argv]),
    )


def header(env: dict) -> str:
    """The environment as the first line of a run's output."""
    return (
        f"{env['gpu']}; torch {env['torch']}, cupy {env['cupy']}, CUDA {env['cuda']}, "
        f"Python {env['python']}; {env['date']}, commit {env['commit']}"
    )


def copy_ms(nbytes: int, iters: int = 20) -> float:
    """Median time of ``y.copy_(x)`` over ``nbytes`` bytes: the roofline every
    bandwidth figure is a fraction of (it reads nbytes and writes nbytes)."""
    x = torch.empty(nbytes // 4, device="cuda").normal_()
    y = torch.empty_like(x)
    return testing.median_ms(lambda: y.copy_(x), iters=iters)


def md_table(head, rows) -> list[str]:
    """A Markdown table: ``head`` the column names, ``rows`` their cells."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


class Target(NamedTuple):
    """A goal and what one run measured against it."""

    what: str
    value: float
    goal: str  # e.g. ">= 1.2x"
    met: bool
    floor: float | None = None  # the least any call could take (GPU time + host floor)

    @property
    def bound(self) -> float:
        return float(re.sub(r"[^\d.]", "", self.goal))

    def floor_note(self) -> str:
        """The floor, and whether the goal lies below it."""
        if self.floor is None:
            return ""
        below = ", goal below the floor" if self.bound < self.floor else ""
        return f"floor {self.floor:.3f}{below}"


def target(what: str, value: float | None, goal: str, floor: float | None = None):
    """The Target of ``value`` against ``goal`` (">= 1.2x", "<= 0.3", "> 1x");
    None where nothing was measured."""
    if value is None:
        return None
    op, number = re.fullmatch(r"(>=|<=|>|<) ?([\d.]+)[x%]?", goal).groups()
    bound = float(number)
    met = {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}
    return Target(what, value, goal, met[op], floor)


def print_targets(targets) -> None:
    """Each target's verdict, then how many were met."""
    for t in targets:
        note = f"; {t.floor_note()}" if t.floor is not None else ""
        print(f"  {'PASS' if t.met else 'MISS'}  {t.what}: {t.value:.3f} (goal {t.goal}{note})")
    print(f"{sum(t.met for t in targets)} of {len(targets)} targets met")


# ---- device time by kind of kernel (the PyTorch profiler) ----

KINDS = ("convolution", "BN fwd", "BN bwd", "activation", "other")
# First match wins, over cuDNN's, PyTorch's, ours (bn_*, cupy_act::) and
# Inductor's kernel names (triton_* kernels are named after the ops they hold).
_KIND_PATTERNS = (
    ("BN bwd", r"batch_norm_backward|bn_bw|bn_backward|bn_finalize_grad|bn_finalize<[12]>"),
    ("BN bwd", r"bn_reduce<[^,>]+, [^,>]+, \d+, [12], "),  # (T, layout, V, pass: 1, 2 gradients)
    ("BN fwd", r"(?i)batch_norm|bn_fw|bn_forward|bn_finalize|bn_reduce<|welford"),
    ("convolution", r"(?i)conv|cudnn|xmma|gemm|cutlass|implicit|[wd]grad|nchwToNhwc|nhwcToNchw"),
    ("convolution", r"sm\d\d_"),
    ("activation", r"(?i)leaky_relu|relu|threshold|act_kernel|cupy_act::"),
)


def kind(kernel: str) -> str:
    """The KINDS entry of a kernel's name."""
    return next((k for k, pattern in _KIND_PATTERNS if re.search(pattern, kernel)), "other")


def kernel_us(step, steps: int = 3) -> dict:
    """Device us per call of ``step()`` by kernel name, from ``steps``
    profiled calls after one unprofiled one."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            out[e.key] = out.get(e.key, 0.0) + us / steps
    return out


def profile(step, steps: int = 3) -> dict:
    """Device ms per step of ``step()`` by KINDS (and "total"; "top other":
    the largest other kernels, (name, ms); "kernels": every kernel, largest
    first), from ``steps`` profiled calls after one unprofiled one."""
    out = dict.fromkeys(KINDS, 0.0)
    other = {}
    kernels = kernel_us(step, steps)
    for name, us in kernels.items():
        k = kind(name)
        out[k] += us / 1e3
        if k == "other":
            other[name] = us / 1e3
    out["total"] = sum(out[k] for k in KINDS)
    # (the largest "other" kernels: where a step's time goes beyond the named kinds)
    out["top other"] = sorted(other.items(), key=lambda kv: -kv[1])[:40]
    out["kernels"] = sorted(((n, us / 1e3) for n, us in kernels.items()), key=lambda kv: -kv[1])
    return out


def print_profile(rows: dict) -> None:
    """rows: variant -> profile()."""
    print("    device ms / step  " + "".join(f"{k:>12s}" for k in (*KINDS, "total")))
    for v, r in rows.items():
        print(f"    {v:18s}" + "".join(f"{r[k]:12.2f}" for k in (*KINDS, "total")))
