"""Launch-shape sweep for the generic kernel (a development tool, not the benchmark).

    PYTHONPATH=. python scripts/tune.py [--op leaky_relu] [--dtypes float32 ...]
                                        [--kinds forward forward_mask backward]
                                        [--unrolls 1 2 4] [--threads 128]

For each block size and vectors-per-thread count (the registry's launch shape
of --op, ``cupy_act._registry.OPS[op].unroll``) it rebuilds the module and
times --op of each kind at 4096 x 393216 float32
(the same bytes in bfloat16, float16 and float64) against a device copy of
the same tensor, measured in the same loop. Printed: time over the copy's time,
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
from cupy_act import _loader, testing
from cupy_act._registry import OPS
from cupy_act.testing import median_ms

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["forward", "forward_mask", "backward"])
    ap.add_argument("--unrolls", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--threads", nargs="+", type=int, default=[128])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--op", default="leaky_relu", choices=list(OPS))
    ap.add_argument("--dtypes", nargs="+", default=[str(d)[6:] for d in DTYPES])
    args = ap.parse_args()
    import measure  # (scripts/measure.py, beside this script)

    measure.require_gpu("tune.py")
    unroll = OPS[args.op].unroll  # kind -> item size -> vectors, edited in place below
    defaults = (_loader.THREADS, copy.deepcopy(unroll))
    kw = testing.op_kwargs(args.op, 0.01, 2.0)
    fwd, fwd_mask, bwd = (getattr(cupy_act, args.op + k) for k in ("", "_with_mask", "_backward"))
    for dtype in (getattr(torch, d) for d in args.dtypes):
        rows = args.rows * 4 // dtype.itemsize  # the same bytes as float32 in every dtype
        x = torch.randn((rows, 393216), device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        cx, cy = cupy.from_dlpack(x), cupy.from_dlpack(y)
        mask = cupy.empty(cupy_act.mask_nbytes(x.numel()), dtype=cupy.uint8)
        fwd_mask(cx, **kw, mask=mask)
        run = {
            "forward": lambda: fwd(cx, **kw, out=cy),
            "forward_mask": lambda: fwd_mask(cx, **kw, out=cy, mask=mask),
            "backward": lambda: bwd(cx, mask, **kw, out=cy),
        }
        size = dtype.itemsize
        print(f"{args.op} {str(dtype)[6:]} ({tuple(x.shape)}): time / copy time")
        for kind, threads, u in itertools.product(args.kinds, args.threads, args.unrolls):
            if kind == "forward_mask" and u > 32 * size // 16:
                continue
            _loader.THREADS = threads
            unroll.update(copy.deepcopy(defaults[1]))
            unroll[kind][size] = u
            _loader.reset()
            ms, copy_ms = median_ms(run[kind]), median_ms(lambda: y.copy_(x))
            floor = 1 + (1 / (16 * size) if kind != "forward" else 0)
            print(
                f"  {kind:12s} threads {threads:3d} unroll {u}: {ms:.3f} ms, "
                f"{ms / copy_ms:.3f}x copy (floor {floor:.3f}x)",
                flush=True,
            )
    _loader.THREADS = defaults[0]
    unroll.update(defaults[1])
    _loader.reset()


if __name__ == "__main__":
    main()
