"""BatchNorm + LeakyReLU, training forward and forward + backward, at a CNN layer's shape.

    PYTHONPATH=. python scripts/bn_bench.py [--shape 32 32 256 256 [--shape ...]]
        [--dtype float32] [--channels-last] [--rounds 20] [--neighbour] [--kernels]
        [--eager-only]

Candidates, timed interleaved with CUDA events (median): PyTorch eager
(``nn.BatchNorm2d`` then ``nn.LeakyReLU(0.01, inplace=True)``, timm's
BatchNormAct2d), ``cupy_act.torch.BatchNormAct2d`` with the fused kernels, the
same module in the in-place mode (``memory="inplace"``: y over x, the
backward from y), the module without the kernels (``batchnorm.FUSED =
False``), torch.compile of PyTorch's pair (Inductor's fused kernels), and
torch.compile of the module in both memory modes (the ``cupy_act::batchnorm_act``
ops: ``set_compiled_batchnorm``'s "everywhere"). ``--neighbour`` feeds every
candidate ``x * 1.5 + 0.5`` instead of x, computed inside the compiled
functions, where Inductor fuses it into its BatchNorm and cannot into ours:
the case the "after_conv" policy leaves traced. ``--kernels`` adds each
eager candidate's fwd + bwd by kernel (the profiler's device time per call,
and the bytes over that time the fused kernels' traffic model gives each).
Forwards run with autograd recording (the weight needs a gradient), as in
training. The floor is the fused kernels' traffic over the copy bandwidth
measured in the same run: forward reads x twice (statistics, then
normalization) and writes y and the 1-bit mask; backward reads x, dy and the
mask twice (reductions, then dx) and writes dx. The in-place mode's floor
has no mask and reads y where the default reads x: "of its floor" uses it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import cupy_act.torch as ct
from cupy_act import testing


class Neighbour(nn.Module):
    """An elementwise op that Inductor fuses into a following BatchNorm."""

    def forward(self, x):
        return x * 1.5 + 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs=4, type=int, action="append",
                    help="N C H W (repeat for more shapes, one after another; default "
                         "32 32 256 256)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--neighbour", action="store_true", help="an elementwise op before each")
    ap.add_argument("--kernels", action="store_true", help="fwd + bwd device time by kernel")
    ap.add_argument("--eager-only", action="store_true", help="no torch.compile candidates")
    args = ap.parse_args()
    import measure  # (scripts/measure.py, beside this script)

    measure.require_gpu("bn_bench.py")
    for shape in args.shape or [[32, 32, 256, 256]]:
        bench(args, tuple(shape))


def bench(args, shape: tuple) -> None:
    """Every candidate at one shape: the timings, then (``--kernels``) the kernels."""
    dtype = getattr(torch, args.dtype)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    n, c, h, w = shape
    x = torch.randn(n, c, h, w, device="cuda").to(dtype).contiguous(memory_format=fmt)
    gy = torch.randn_like(x)
    torch.backends.cudnn.benchmark = True

    theirs = nn.Sequential(nn.BatchNorm2d(c), nn.LeakyReLU(0.01, inplace=True)).cuda()
    ours = ct.BatchNormAct2d(c, act_layer="leaky_relu").cuda()
    inplace = ct.BatchNormAct2d(c, act_layer="leaky_relu", memory="inplace").cuda()
    x_inplace = x.clone()  # (overwritten by each call with its own normalized values)
    pre = Neighbour() if args.neighbour else nn.Identity()
    compiled = torch.compile(nn.Sequential(pre, nn.BatchNorm2d(c), nn.LeakyReLU(0.01)).cuda())
    ct.set_compiled_batchnorm("everywhere")
    ours_compiled = torch.compile(nn.Sequential(
        pre, ct.BatchNormAct2d(c, act_layer="leaky_relu")).cuda())  # fmt: skip
    inplace_compiled = torch.compile(nn.Sequential(
        pre, ct.BatchNormAct2d(c, act_layer="leaky_relu", memory="inplace")).cuda())  # fmt: skip
    if args.neighbour:  # (the eager candidates take the same input)
        theirs, ours, inplace = (nn.Sequential(pre, m) for m in (theirs, ours, inplace))

    def unfused(xx):
        ct.batchnorm.FUSED = False
        try:
            return ours(xx)
        finally:
            ct.batchnorm.FUSED = True

    models = {"pytorch": theirs, "ours fused": ours, "ours in place": inplace}
    models["ours unfused"] = unfused
    if not args.eager_only:
        models["torch.compile"] = compiled
        models["ours compiled"] = ours_compiled
        models["ours compiled in place"] = inplace_compiled

    def fwd(m):
        if m is inplace:  # (detached: each call's graph ends at its own input)
            return lambda: m(x_inplace.detach())
        return lambda: m(x)

    def fwd_bwd(m):
        def f():
            if m is inplace:  # (x does not need a gradient here; dx is computed all the same)
                m(x_inplace.detach()).backward(gy)
                return
            xx = x.detach().requires_grad_(True)
            m(xx).backward(gy)

        return f

    def copy():
        gy.copy_(x)  # (gy's values do not matter to the timings)

    size = x.numel() * x.element_size()
    mask = -(-x.numel() // 32) * 4
    fwd_bytes = 3 * size + mask
    bwd_bytes = 2 * (2 * size + mask) + size
    for what, make, nbytes, nbytes_inplace in (
        ("forward", fwd, fwd_bytes, 3 * size),
        ("fwd+bwd", fwd_bwd, fwd_bytes + bwd_bytes, 3 * size + 5 * size),
    ):
        fns = {k: make(m) for k, m in models.items()}
        fns["copy"] = copy
        t = testing.interleaved_median_ms(fns, rounds=args.rounds)
        bw = 2 * size / (t["copy"] * 1e-3)
        floor, floor_inplace = nbytes / bw * 1e3, nbytes_inplace / bw * 1e3
        print(
            f"{what} {shape} {args.dtype} {'NHWC' if args.channels_last else 'NCHW'}:"
            f" copy {bw / 1e9:.0f} GB/s, floor {floor:.3f} ms (in place {floor_inplace:.3f})"
        )
        for k, m in models.items():
            f = floor_inplace if m is inplace else floor
            print(
                f"    {k:14s} {t[k]:7.3f} ms  {t[k] / t['pytorch']:5.2f}x pytorch"
                f"  {f / t[k]:5.1%} of its floor's speed",
                flush=True,
            )
    if args.kernels:
        for k in ("pytorch", "ours fused", "ours in place"):
            print_kernels(k, fwd_bwd(models[k]), size, mask)


# Bytes each fused kernel moves per call (element size s, mask bytes m),
# by the name's kernel and pass: forward reads x (and writes y and the mask),
# the gradient reductions read x (or y), dy and the mask, dx reads them again
# and writes dx. (The finalizing launches move next to nothing.)
def _traffic(name: str, s: int, m: int) -> int | None:
    if "bn_forward" in name:
        return 2 * s + m
    if "bn_backward" in name:
        return 3 * s + (0 if "true>" in name else m)
    if "bn_reduce" in name:
        stage = name.split(",")[3].strip()  # (T, layout, V, pass, act)
        return {"0": s, "1": 2 * s + m, "2": 2 * s}.get(stage)
    return None


def print_kernels(label: str, step, s: int, m: int) -> None:
    """``step``'s device time per call by kernel, with the fused kernels' GB/s."""
    import measure

    rows = measure.kernel_us(step, steps=5)
    print(f"  {label}, fwd + bwd by kernel (us per call):")
    for name, us in sorted(rows.items(), key=lambda kv: -kv[1]):
        nbytes = _traffic(name, s, m)
        rate = f"{nbytes / us / 1e3:7.0f} GB/s" if nbytes else " " * 12
        print(f"    {us:8.1f} {rate}  {name[:110]}")


if __name__ == "__main__":
    main()
