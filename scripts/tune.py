"""Launch-shape sweep for the generic kernel (a development tool, not the benchmark).

    PYTHONPATH=. python scripts/tune.py [--what mask|plain]

Rebuilds the module for each setting and times leaky_relu at 4096 x 393216 in
float32, bfloat16, float16 and float64 against a device copy of the same
tensor, as a fraction of the copy's speed (bytes moved / time, over the copy's).
"mask" sweeps the forward-with-mask kind's vectors per thread (MASK_UNROLL; at
32 / V each warp stores whole 128-byte mask lines) and the block size; "plain"
sweeps forward and backward's UNROLL and the grid cap (GRID_WAVES).
"""

from __future__ import annotations

import argparse
import itertools

import cupy
import torch

import cupy_act
from cupy_act import _loader
from cupy_act.testing import median_ms

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _setup(shape):
    """Per dtype: (name, x, out, mask, copy ms) on the current device."""
    for dtype in DTYPES:
        rows = shape[0] * 4 // dtype.itemsize  # the same bytes as float32 in every dtype
        x = torch.randn((rows, shape[1]), device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        mask = cupy.empty(cupy_act.mask_nbytes(x.numel()), dtype=cupy.uint8)
        copy = median_ms(lambda: y.copy_(x))
        yield str(dtype)[6:], cupy.from_dlpack(x), cupy.from_dlpack(y), mask, copy


def sweep_mask(shape) -> None:
    for name, cx, cy, mask, copy in _setup(shape):
        extra = 1 + 1 / 16 / cx.itemsize  # bytes with the mask (1/8 per element) over 2 x itemsize
        print(f"{name}: copy {copy:.3f} ms; fwd+mask speed vs copy, counting the mask's bytes")
        for threads, u in itertools.product((128, 256), (1, 2, 4, 8, 16)):
            size = cx.itemsize
            if u > 32 * size // 16:
                continue
            _loader.THREADS = threads
            _loader.MASK_UNROLL = {**_DEFAULTS["MASK_UNROLL"], size: u}
            _loader.reset()
            fm = median_ms(lambda: cupy_act.leaky_relu_with_mask(cx, 0.01, out=cy, mask=mask))
            print(f"  threads {threads:3d} mask_unroll {u:2d}: {fm:.3f} ms = "
                  f"{copy * extra / fm:6.1%} of copy speed, {fm / copy:.3f}x copy time")
    _restore()


def sweep_plain(shape) -> None:
    for name, cx, cy, mask, copy in _setup(shape):
        cupy_act.leaky_relu_with_mask(cx, 0.01, mask=mask)
        print(f"{name}: copy {copy:.3f} ms; speed vs copy")
        for unroll, waves in itertools.product((1, 2, 4), (1024, 8)):
            _loader.UNROLL = {**_DEFAULTS["UNROLL"], cx.itemsize: unroll}
            _loader.GRID_WAVES = waves
            _loader.reset()
            f = median_ms(lambda: cupy_act.leaky_relu(cx, 0.01, out=cy))
            bw = median_ms(lambda: cupy_act.leaky_relu_backward(cx, mask, 0.01, out=cy))
            print(f"  unroll {unroll} waves {waves:5d}: fwd {copy / f:6.1%}  bwd {copy / bw:6.1%}")
    _restore()


_DEFAULTS = {k: getattr(_loader, k) for k in ("THREADS", "UNROLL", "MASK_UNROLL", "GRID_WAVES")}


def _restore() -> None:
    for k, v in _DEFAULTS.items():
        setattr(_loader, k, v)
    _loader.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("mask", "plain"), default="mask")
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    shape = (args.rows, 393216)
    (sweep_mask if args.what == "mask" else sweep_plain)(shape)


if __name__ == "__main__":
    main()
