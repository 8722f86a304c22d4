"""Launch-shape sweep for the generic kernel (a development tool, not the benchmark).

    PYTHONPATH=. python scripts/tune.py [--kinds forward forward_mask backward]
                                        [--unrolls 1 2 4] [--threads 128]

For each block size and vectors-per-thread count (``_loader.UNROLL`` of leaky_relu) it rebuilds
the module and times leaky_relu of each kind at 4096 x 393216 float32 (the
same bytes in bfloat16, float16 and float64) against a device copy of the
same tensor, measured in the same loop. Printed: time over the copy's time,
and the floor for that ratio (bytes moved over the copy's bytes: 1 + 1/(16 s)
for the kinds that move a mask).
"""

from __future__ import annotations

import argparse
import copy
import itertools

import cupy
import torch

import cupy_act
from cupy_act import _loader
from cupy_act.testing import median_ms

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["forward", "forward_mask", "backward"])
    ap.add_argument("--unrolls", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[128])
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    defaults = (_loader.THREADS, copy.deepcopy(_loader.UNROLL))
    for dtype in DTYPES:
        rows = args.rows * 4 // dtype.itemsize  # the same bytes as float32 in every dtype
        x = torch.randn((rows, 393216), device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        cx, cy = cupy.from_dlpack(x), cupy.from_dlpack(y)
        mask = cupy.empty(cupy_act.mask_nbytes(x.numel()), dtype=cupy.uint8)
        cupy_act.leaky_relu_with_mask(cx, 0.01, mask=mask)
        run = {
            "forward": lambda: cupy_act.leaky_relu(cx, 0.01, out=cy),
            "forward_mask": lambda: cupy_act.leaky_relu_with_mask(cx, 0.01, out=cy, mask=mask),
            "backward": lambda: cupy_act.leaky_relu_backward(cx, mask, 0.01, out=cy),
        }
        size = dtype.itemsize
        print(f"{str(dtype)[6:]} ({tuple(x.shape)}): time / copy time")
        for kind, threads, u in itertools.product(args.kinds, args.threads, args.unrolls):
            if kind == "forward_mask" and u > 32 * size // 16:
                continue
            _loader.THREADS = threads
            _loader.UNROLL = copy.deepcopy(defaults[1])
            _loader.UNROLL["leaky_relu"][kind][size] = u
            _loader.reset()
            ms, copy = median_ms(run[kind]), median_ms(lambda: y.copy_(x))
            floor = 1 + (1 / (16 * size) if kind != "forward" else 0)
            print(f"  {kind:12s} threads {threads:3d} unroll {u}: {ms:.3f} ms, "
                  f"{ms / copy:.3f}x copy (floor {floor:.3f}x)", flush=True)
    _loader.THREADS, _loader.UNROLL = defaults
    _loader.reset()


if __name__ == "__main__":
    main()
