"""The fused weight (or input) gradient against the path it replaces, backward alone.

    PYTHONPATH=. python scripts/wgrad_bench.py [--shapes ref 16to32 ...]
        [--dtypes float32 float16 bfloat16] [--layouts nchw nhwc] [--iters 15]
        [--grad w|x] [--json out.json]

The convolution block of scripts/conv_bench.py (same shapes), x needing no
gradient (a first layer, the seed model): per shape, dtype, layout and fused
algorithm, the median CUDA-event ms of ``torch.autograd.grad`` of the weight
and bias on a kept graph, with ``conv.FUSED_WGRAD`` False (the mask
backward, then cuDNN's weight gradient) and True (cuda/conv2d_wgrad.cu),
interleaved over two rounds (the better round counts), and the ratio. "chunks":
how many channel chunks the kernel splits the filter depth into (each reads
dy once; the default, FUSED_WGRAD None, takes the kernel at one chunk).
"floor": reading dy, the mask and x once at the bandwidth of a device copy
of dy measured in the same run.

``--grad x``: the same for the input gradient alone (x needing a gradient,
the weight and bias not), with ``conv.FUSED_DGRAD`` False (the mask
backward, then cuDNN's data gradient) and True (cuda/conv2d_dgrad.cu, where
it applies: "chunks" is 1 there, else 0); "floor": reading dy and the mask
and writing dx once.
"""

from __future__ import annotations

import argparse
import json

import torch
from conv_bench import DIVISOR, SHAPES, SLOPE

import cupy_act.torch as ct
from cupy_act import _conv, testing

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


FLAGS = {"w": "FUSED_WGRAD", "x": "FUSED_DGRAD"}


def backward_ms(y, wrt, gy, flag: str, fused: bool, iters: int) -> float:
    """Median ms of the gradients of ``wrt`` with the kernel (``flag``) on or off."""
    setattr(ct.conv, flag, fused)

    def step():
        torch.autograd.grad(y, wrt, gy, retain_graph=True)

    step()
    return testing.median_ms(step, iters=iters)


def run(name: str, dtype: torch.dtype, channels_last: bool, iters: int, grad: str) -> list[dict]:
    n, cin, h, wd, cout, k, stride, pad = SHAPES[name]
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride, pad).cuda()
    w0, b0 = conv.weight.detach().to(dtype), conv.bias.detach().to(dtype)
    x0 = torch.randn(n, cin, h, wd, device="cuda", dtype=dtype)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    g = _conv.geometry("bench", x0.shape, w0.shape, stride, pad)
    rows = []
    for alg in ("fused", "fused_tf32") if dtype == torch.float32 else ("fused",):
        w, b = (t.clone().requires_grad_(grad == "w") for t in (w0, b0))
        x = x0.clone().requires_grad_(grad == "x")
        y = ct.conv2d_div_leaky_relu(x, w, b, DIVISOR, SLOPE, stride, pad, algorithm=alg)
        wrt = (w, b) if grad == "w" else (x,)
        gy = torch.randn_like(y)
        src, dst = torch.randn_like(y), torch.empty_like(y)
        times: dict[object, list[float]] = {False: [], True: [], "copy": []}
        for _ in range(2):
            for fused in (False, True):
                times[fused].append(backward_ms(y, wrt, gy, FLAGS[grad], fused, iters))
            times["copy"].append(testing.median_ms(lambda: dst.copy_(src), iters=iters))
        dy_bytes = y.numel() * y.element_size()
        moved = dy_bytes + y.numel() / 8 + x0.numel() * x0.element_size()
        floor = min(times["copy"]) * moved / (2 * dy_bytes)
        precision = "tf32" if alg == "fused_tf32" else "fp32"
        n_passes = _conv.passes(str(dtype).removeprefix("torch."), precision)
        if grad == "x":
            chunks = int(_conv.dgrad_fits(g, n_passes))
        else:
            chunks = _conv.wgrad_chunks(g, n_passes) if _conv.wgrad_fits(g, n_passes) else 0
        default, kernel = min(times[False]), min(times[True])
        row = dict(shape=name, dtype=str(dtype)[6:], layout="nhwc" if channels_last else "nchw",
                   algorithm=alg, chunks=chunks, default_ms=default, kernel_ms=kernel,
                   ratio=kernel / default, floor_ms=floor)  # fmt: skip
        print(
            f"{name:7s} {row['dtype']:9s} {row['layout']} {alg:10s} chunks {chunks}  "
            f"default {default:7.3f}  kernel {kernel:7.3f} ms  ({kernel / default:4.2f}x)  "
            f"floor {floor:6.3f}",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
    ap.add_argument("--layouts", nargs="+", default=["nchw"], choices=["nchw", "nhwc"])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--grad", choices=list(FLAGS), default="w")
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    print(gpu, flush=True)
    flag = FLAGS[args.grad]
    setting = getattr(ct.conv, flag)
    rows = []
    try:
        for name in args.shapes:
            for dt in args.dtypes:
                for layout in args.layouts:
                    rows += run(name, DTYPES[dt], layout == "nhwc", args.iters, args.grad)
    finally:
        setattr(ct.conv, flag, setting)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
