"""One training step of the conv -> divide -> LeakyReLU block on a timeline:
when the host queued each piece and when the GPU ran it.

    PYTHONPATH=. python scripts/step_timeline.py [--algorithms fused eager]
        [--x-grad] [--shape 128 8 128 128 64 3 1 0] [--trace DIR]

For each algorithm: the step ``block(x, w, b).backward(gy)`` as
``scripts/conv_bench.py`` times it (x needing no gradient unless
``--x-grad``), warmed up, then profiled (torch.profiler, CPU and CUDA) over
three steps; the last one is printed: host ranges (the step, autograd's
backward nodes, the Python functions they call) and GPU kernels and copies,
each with its start and end in microseconds from the step's first host
event, and the GPU's idle time inside the step. A GPU gap that lines up
with a host range is host cost the step pays. ``--trace DIR`` also writes
each profile as a Chrome trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import cupy_act.torch as ct

DIVISOR, SLOPE = 2.0, 0.01


def step_fn(algorithm: str, stride: int, padding: int):
    """The block's forward for ``algorithm`` ("eager": PyTorch's ops)."""
    if algorithm == "eager":
        return lambda x, w, b: F.leaky_relu(F.conv2d(x, w, b, stride, padding) / DIVISOR, SLOPE)
    return lambda x, w, b: ct.conv2d_div_leaky_relu(
        x, w, b, DIVISOR, SLOPE, stride, padding, algorithm=algorithm
    )


def timeline(prof, step: str) -> list[tuple[float, float, str, str]]:
    """(start us, end us, "host" or "gpu", name) of the events inside the last
    record_function range named ``step``, from its start."""
    events = prof.events()
    marks = [e for e in events if e.name == step and e.device_type == torch.autograd.DeviceType.CPU]
    mark = max(marks, key=lambda e: e.time_range.start)
    t0, t1 = mark.time_range.start, mark.time_range.end
    rows = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if gpu:
            # kernels belong to the step whose host op launched them
            if not (t0 <= start <= t1 + 5000) or e.name == step:
                continue
        elif not (t0 <= start <= t1) or e.name == step:
            continue
        rows.append((start - t0, end - t0, "gpu" if gpu else "host", e.name))
    rows.sort()
    return rows


def gpu_idle(rows) -> float:
    """Microseconds the GPU ran nothing between its first and last event."""
    spans = sorted((s, e) for s, e, where, _ in rows if where == "gpu")
    idle, reach = 0.0, spans[0][0] if spans else 0.0
    for s, e in spans:
        idle += max(0.0, s - reach)
        reach = max(reach, e)
    return idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", nargs="+", default=["fused", "eager"])
    ap.add_argument("--x-grad", action="store_true", help="x needs a gradient too")
    ap.add_argument(
        "--shape",
        nargs=8,
        type=int,
        default=[128, 8, 128, 128, 64, 3, 1, 0],
        metavar="N",
        help="batch cin h w cout k stride padding (seed shape)",
    )
    ap.add_argument("--host-depth", type=int, default=40, help="host rows printed per step")
    ap.add_argument("--trace", type=Path, help="write Chrome traces here")
    args = ap.parse_args()
    n, cin, h, wd, cout, k, stride, pad = args.shape
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride, pad).cuda()
    x = torch.randn(n, cin, h, wd, device="cuda").requires_grad_(args.x_grad)
    for algorithm in args.algorithms:
        fn = step_fn(algorithm, stride, pad)
        w = conv.weight.detach().clone().requires_grad_()
        b = conv.bias.detach().clone().requires_grad_()
        gy = torch.randn_like(fn(x, w, b))

        def step(fn=fn, w=w, b=b, gy=gy):
            with record_function("step"):
                fn(x, w, b).backward(gy)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        if args.trace:
            args.trace.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace / f"{algorithm}.json"))
        rows = timeline(prof, "step")
        host = [r for r in rows if r[2] == "host"]
        gpu = [r for r in rows if r[2] == "gpu"]
        print(f"\n== {algorithm}, x {'needs' if args.x_grad else 'needs no'} gradient")
        print(f"host: {len(host)} events; the first {args.host_depth}:")
        for s, e, _, name in host[: args.host_depth]:
            print(f"  host {s:8.1f} {e:8.1f} {e - s:7.1f}  {name[:90]}")
        for s, e, _, name in gpu:
            print(f"  GPU  {s:8.1f} {e:8.1f} {e - s:7.1f}  {name[:90]}")
        end = max(e for s, e, *_ in rows)
        print(
            f"step: host {host[-1][1] if host else 0:.1f} us; GPU from {gpu[0][0]:.1f} "
            f"to {end:.1f} us, idle {gpu_idle(rows):.1f} us inside"
        )


if __name__ == "__main__":
    main()
