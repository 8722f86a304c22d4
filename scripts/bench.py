"""Benchmark cupy_act against PyTorch eager and a device copy, in one run.

    PYTHONPATH=. python scripts/bench.py [--shape 4096 393216] [--dtype float32]

Every case is timed with CUDA events after warm-up; the median of --iters runs
is reported with GB/s from the byte formula shown (each tensor read or written
once; N elements of s bytes; the mask is N/8 bytes), % of the copy bandwidth
measured in the same run, and the speed ratio against PyTorch's equivalent.
Inputs are random (never zeros); outputs are checked bit for bit once.
"""

from __future__ import annotations

import argparse
import cupy
import torch
import torch.nn.functional as F

import cupy_act
from cupy_act import testing



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs="+", default=[4096, 393216])
    ap.add_argument("--dtype", default="float32", choices=[str(d)[6:] for d in testing.DTYPES])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = tuple(args.shape)
    n = torch.Size(shape).numel()
    s = torch.tensor([], dtype=dtype).element_size()
    slope, divisor = 0.01, 2.0

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    dy = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    y = torch.empty_like(x)
    dx = torch.empty_like(x)
    cx, cdy, cy, cdx = (cupy.from_dlpack(t) for t in (x, dy, y, dx))
    mask = cupy.empty(cupy_act.mask_nbytes(n), dtype=cupy.uint8)

    rows = []  # (name, ms, bytes, formula, reference name or None)

    def add(name, fn, nbytes, formula, ref=None):
        rows.append((name, testing.median_ms(fn, args.iters), nbytes, formula, ref))

    two, two_mask, three = 2 * n * s, 2 * n * s + n // 8, 3 * n * s
    add("copy", lambda: y.copy_(x), two, "2Ns")
    add("torch relu", lambda: torch.relu(x), two, "2Ns")
    add("torch leaky_relu", lambda: F.leaky_relu(x, slope), two, "2Ns")
    add("torch x/d, leaky_relu", lambda: F.leaky_relu(x / divisor, slope), 4 * n * s, "4Ns")
    add("torch leaky_relu_backward",
        lambda: torch.ops.aten.leaky_relu_backward(dy, x, slope, False), three, "3Ns")
    add("torch threshold_backward",
        lambda: torch.ops.aten.threshold_backward(dy, x, 0), three, "3Ns")
    for op, kw, ref_f, ref_b in [
        ("relu", {}, "torch relu", "torch threshold_backward"),
        ("leaky_relu", {"negative_slope": slope}, "torch leaky_relu", "torch leaky_relu_backward"),
        ("div_leaky_relu", {"divisor": divisor, "negative_slope": slope},
         "torch x/d, leaky_relu", "torch leaky_relu_backward"),
    ]:
        fwd, fwd_mask, bwd = (getattr(cupy_act, op + k) for k in ("", "_with_mask", "_backward"))
        add(f"{op}", lambda: fwd(cx, **kw, out=cy), two, "2Ns", ref_f)
        add(f"{op}_with_mask", lambda: fwd_mask(cx, **kw, out=cy, mask=mask), two_mask,
            "2Ns+N/8", ref_f)
        add(f"{op}_backward", lambda: bwd(cdy, mask, **kw, out=cdx), two_mask, "2Ns+N/8", ref_b)

    # one correctness check on the benchmark data itself
    fwd_mask_ok = cupy_act.leaky_relu_with_mask(cx, slope, out=cy, mask=mask)
    testing.assert_bits_equal(y, F.leaky_relu(x, slope), "bench leaky_relu")
    del fwd_mask_ok

    copy_ms = rows[0][1]
    copy_gbs = rows[0][2] / copy_ms / 1e6
    by_name = {r[0]: r[1] for r in rows}
    print(f"\n{torch.cuda.get_device_name()}  shape {shape} {args.dtype}  N={n}  "
          f"median of {args.iters}  torch {torch.__version__}  cupy {cupy.__version__}")
    print(f"{'case':28s} {'bytes':>8s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'vs torch':>9s}")
    for name, ms, nbytes, formula, ref in rows:
        gbs = nbytes / ms / 1e6
        vs = f"{by_name[ref] / ms:8.3f}x" if ref else ""
        print(f"{name:28s} {formula:>8s} {ms:8.3f} {gbs:7.0f} {100 * gbs / copy_gbs:5.1f}% {vs:>9s}")


if __name__ == "__main__":
    main()
