"""Launch-shape sweep for the generic kernel (a development tool, not the benchmark).

    PYTHONPATH=. python scripts/tune.py

Rebuilds the module for each vectors-per-thread count (CUPY_ACT_UNROLL) and
times forward, forward-with-mask and backward of leaky_relu at 4096 x 393216
(float32 and bfloat16) with the grid capped at the blocks resident on the
device ("resident") or one block per chunk of work ("full"), against the copy.
"""

from __future__ import annotations

import itertools

import cupy
import torch

import cupy_act
from cupy_act import _loader
from cupy_act.testing import median_ms
from cupy_act._kernels import kernel_name



def main():
    shape = (4096, 393216)
    n = shape[0] * shape[1]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        copy = median_ms(lambda: y.copy_(x))
        cx, cy = cupy.from_dlpack(x), cupy.from_dlpack(y)
        mask = cupy.empty(cupy_act.mask_nbytes(n), dtype=cupy.uint8)
        print(f"{dtype} copy {copy:.3f} ms; speed as a fraction of the copy's:")
        for threads, unroll, streaming in itertools.product((128, 256), (1, 2), (0,)):
            _loader.THREADS, _loader.STREAMING = threads, streaming
            _loader.UNROLL = {2: unroll, 4: unroll, 8: unroll}
            _loader.reset()
            k = _loader.kernels(0)[kernel_name("leaky_relu", str(dtype)[6:], "forward_mask")]
            for waves in (1024, 8):
                _loader.GRID_WAVES = waves
                f = median_ms(lambda: cupy_act.leaky_relu(cx, 0.01, out=cy))
                fm = median_ms(lambda: cupy_act.leaky_relu_with_mask(cx, 0.01, out=cy, mask=mask))
                bw = median_ms(lambda: cupy_act.leaky_relu_backward(cx, mask, 0.01, out=cy))
                print(f"  threads {threads:3d} unroll {unroll} streaming {streaming} "
                      f"waves {waves:7d} (resident {k.resident:5d}): fwd {copy / f:6.1%}  "
                      f"fwd+mask {copy / fm:6.1%}  bwd {copy / bw:6.1%}")


if __name__ == "__main__":
    main()
