"""The conv -> divide -> LeakyReLU block: every algorithm against eager and torch.compile.

    PYTHONPATH=. python scripts/conv_bench.py [--shapes ref stem ...] [--max-autotune]
                                              [--no-compile] [--json out.json] [--markdown out.md]

(scripts/bench.py runs it too, for every shape.)

Block: ``leaky_relu(conv2d(x, w, b, stride, padding) / 2, 0.01)``, float32,
NCHW, PyTorch's default Conv2d initialisation and a random normal input.
Per shape, in one run:
  forward      no grad: median CUDA-event ms
  fwd+bwd      autograd forward and backward (x, weight and bias need grad;
               a random upstream gradient in the output's layout)
  w fwd+bwd    the same where x needs no gradient (a first layer, the seed
               model): for the fused algorithms, the fused weight gradient
  w bwd        that backward alone (torch.autograd.grad on a kept graph),
               from the host's call to the GPU's end; "GPU": the same with
               the GPU kept busy while the host queues it (the GPU's time
               alone; the difference is the adapter's host cost)
  max err      max |y - reference| with the reference computed in float64
               (forward, same inputs)
  x floor      forward time over the memory floor: read x, write y, at the
               bandwidth of a device copy of y measured in the same run
  saved MB     what autograd saved for backward in one forward (x and the
               weight included), from saved_tensors_hooks
"auto" is also timed against the candidates it may pick (FP32 class),
interleaved round after round, forward and forward + backward: issue 23's
"within 3%" compares those.
Rows: eager; torch.compile default (and max-autotune with --max-autotune);
cupy_act's algorithms "exact", "channels_last", "fused", "fused_tf32", "auto"
as they run by default (the fused weight gradient where one channel chunk
holds the filter depth, ``conv.FUSED_WGRAD``; where x needs a gradient,
cuDNN then computes only that one), and "fused" / "fused_tf32" with it
forced on ("... wgrad-kernel") and off ("... mask-bwd": the mask backward,
then cuDNN's convolution backward for every gradient).
cuDNN runs with PyTorch's defaults (TF32 allowed for convolutions). The
targets of issues 11 and 23 are evaluated at the end.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import cupy_act.torch as ct
from cupy_act import testing

DIVISOR, SLOPE = 2.0, 0.01
# name -> (batch, cin, height, width, cout, kernel, stride, padding)
SHAPES = {
    "ref": (128, 8, 128, 128, 64, 3, 1, 0),
    "stem": (32, 3, 224, 224, 64, 7, 2, 3),
    "64to64": (64, 64, 56, 56, 64, 3, 1, 1),
    "16to32": (128, 16, 64, 64, 32, 3, 1, 0),
    "5x5": (64, 8, 128, 128, 64, 5, 1, 0),
}
OURS = ("exact", "channels_last", "fused", "fused_tf32", "auto")
# Row suffixes: the fused weight gradient (conv.FUSED_WGRAD) forced on or off.
WGRAD_SETTINGS = {" wgrad-kernel": True, " mask-bwd": False}
# The GPU kept busy before each timing of the backward's GPU time: longer than
# the host takes to queue one backward (well under 1 ms).
QUEUED_MS = 4.0


def block(x, w, b, stride, padding):
    return F.leaky_relu(F.conv2d(x, w, b, stride, padding) / DIVISOR, SLOPE)


def copy_time(shape) -> float:
    """Median ms of a float32 device copy of ``shape``: the bandwidth yardstick."""
    src = torch.randn(shape, device="cuda")
    dst = torch.empty_like(src)
    return testing.median_ms(lambda: dst.copy_(src))


def saved_mb(fn) -> float:
    _, sizes = testing.saved_sizes(fn)
    return testing.nbytes(sizes) / 1e6


def picked(shape) -> list[str]:
    """What "auto" chose at ``shape``: "fwd: ..." without a gradient, else per
    set of inputs that needed one ("x+w+b: ...")."""
    out = []
    for key, choice in ct.conv.auto_choices().items():
        if key[2] == shape:
            grads = key[-1]
            what = "+".join(n for n, g in zip("xwb", grads) if g) if grads else "fwd"
            out.append(f"{what}: {choice}")
    return out


def run_shape(name, shape, args) -> list[dict]:
    n, cin, h, wd, cout, k, stride, pad = shape
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride, pad).cuda()
    w0, b0 = conv.weight.detach(), conv.bias.detach()
    x0 = torch.randn(n, cin, h, wd, device="cuda")
    with torch.no_grad():
        ref = block(x0.double(), w0.double(), b0.double(), stride, pad)
    y_bytes = ref.numel() * 4
    floor_bytes = x0.numel() * 4 + y_bytes
    copy_ms = copy_time(ref.shape)
    floor_ms = copy_ms * floor_bytes / (2 * y_bytes)

    impls = {"eager": lambda x, w, b: block(x, w, b, stride, pad)}
    if not args.no_compile:
        impls["compile"] = torch.compile(lambda x, w, b: block(x, w, b, stride, pad))
        if args.max_autotune:
            impls["max-autotune"] = torch.compile(
                lambda x, w, b: block(x, w, b, stride, pad), mode="max-autotune-no-cudagraphs"
            )
    variants = [a + suffix for suffix in WGRAD_SETTINGS for a in ("fused", "fused_tf32")]
    for alg in (*OURS, *variants):
        base = alg.split(" ")[0]
        impls[alg] = lambda x, w, b, a=base: ct.conv2d_div_leaky_relu(
            x, w, b, DIVISOR, SLOPE, stride, pad, algorithm=a
        )
    rows = []
    default = ct.conv.FUSED_WGRAD
    for impl, fn in impls.items():
        suffix = impl[impl.find(" ") :] if " " in impl else ""
        ct.conv.FUSED_WGRAD = WGRAD_SETTINGS.get(suffix, default)
        with torch.no_grad():
            y = fn(x0, w0, b0)
            err = (y.double() - ref).abs().max().item()
            fwd = testing.median_ms(lambda: fn(x0, w0, b0), iters=args.iters)
        gy = torch.randn_like(y)
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        fb = testing.median_ms(lambda: fn(x, w, b).backward(gy), iters=args.iters)
        w.grad = b.grad = None
        wl, bl = (t.clone().requires_grad_() for t in (w0, b0))
        fbw = testing.median_ms(lambda: fn(x0, wl, bl).backward(gy), iters=args.iters)
        kept = [fn(x0, wl, bl)]

        def backward():
            return torch.autograd.grad(kept[0], (wl, bl), gy, retain_graph=True)

        bw = testing.median_ms(backward, iters=args.iters)
        # the same with the GPU kept busy while the host works: the GPU's time
        # alone (bw less this is the host's cost where the GPU waits for it)
        bw_gpu = testing.median_ms(backward, iters=args.iters, queued_ms=QUEUED_MS)
        kept.clear()
        saved = saved_mb(lambda: fn(x, w, b))
        row = dict(shape=name, impl=impl, forward_ms=fwd, fwd_bwd_ms=fb, max_err=err)
        row.update(w_fwd_bwd_ms=fbw, w_bwd_ms=bw, w_bwd_gpu_ms=bw_gpu)
        row.update(x_floor=fwd / floor_ms, saved_mb=saved, floor_ms=floor_ms)
        if impl == "auto":
            row["picked"] = picked(x0.shape)
        rows.append(row)
        print(
            f"  {name:7s} {impl:20s} fwd {fwd:7.3f} ms ({fwd / floor_ms:5.2f}x floor)  "
            f"fwd+bwd {fb:7.3f}  w fwd+bwd {fbw:7.3f}  w bwd {bw:7.3f} (GPU {bw_gpu:6.3f}) ms  "
            f"max err {err:8.2e}  saved {saved:7.1f} MB"
            + (f"  picked {row['picked']}" if impl == "auto" else ""),
            flush=True,
        )
    ct.conv.FUSED_WGRAD = default
    # "auto" against the candidates it may pick, interleaved round after round
    # (the rows above are timed one after another, and this host's load
    # drifts by more than the 3% the comparison asks for).
    names = [*ct.conv.candidates(torch.float32, False), "auto"]
    with torch.no_grad():
        fwd = testing.interleaved_median_ms(
            {a: (lambda f=impls[a]: f(x0, w0, b0)) for a in names}, rounds=args.iters
        )
    x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
    fb = testing.interleaved_median_ms(
        {a: (lambda f=impls[a]: f(x, w, b).backward(gy)) for a in names}, rounds=args.iters
    )
    for row in rows:
        if row["impl"] in names:
            row.update(forward_il_ms=fwd[row["impl"]], fwd_bwd_il_ms=fb[row["impl"]])
    print(
        f"  {name:7s} interleaved: "
        + "  ".join(f"{a} fwd {fwd[a]:.3f} fwd+bwd {fb[a]:.3f}" for a in names),
        flush=True,
    )
    return rows


def targets(rows, gpu: str) -> list[tuple[str, float, float, bool]]:
    """Issue 11's targets at the reference shape (H200 times; H100 scaled)."""
    by = {r["impl"]: r for r in rows if r["shape"] == "ref"}
    if "fused" not in by:
        return []
    h100 = "H100" in gpu
    out = []
    fused, tf32 = by["fused"], by["fused_tf32"]
    goal = 0.33 if h100 else 0.25
    out.append(("fused forward ms", fused["forward_ms"], goal, fused["forward_ms"] <= goal))
    goal = 0.264 if h100 else 0.20
    out.append(("fused_tf32 forward ms", tf32["forward_ms"], goal, tf32["forward_ms"] <= goal))
    ratio = fused["max_err"] / by["eager"]["max_err"]
    out.append(("fused max err / eager's", ratio, 10.0, ratio <= 10.0))
    out.append(("fused forward x floor", fused["x_floor"], 1.75, fused["x_floor"] <= 1.75))
    if "compile" in by:
        s = by["compile"]["fwd_bwd_ms"] / fused["fwd_bwd_ms"]
        out.append(("fwd+bwd speedup over torch.compile", s, 1.6, s >= 1.6))
    if "max-autotune" in by:
        s = by["max-autotune"]["forward_ms"] / fused["forward_ms"]
        out.append(("forward speedup over max-autotune", s, 3.0, s >= 3.0))
    return out


def targets_23(rows, gpu: str) -> list[tuple[str, float, float, bool]]:
    """Issue 23's targets: the reference shape's times (H100 figures; an H200
    scales them by its memory floor, measured in the same run), and "auto"
    within 3% of the best candidate it may pick at every shape."""
    by = {r["impl"]: r for r in rows if r["shape"] == "ref"}
    out = []
    if "fused" in by:
        fused, tf32 = by["fused"], by["fused_tf32"]
        # the H100 floor of the issue (0.200 ms) against this run's
        scale = 1.0 if "H100" in gpu else fused["floor_ms"] / 0.200
        for desc, value, goal in (
            ("fused fwd+bwd ms, x no grad", fused["w_fwd_bwd_ms"], 1.0),
            ("fused_tf32 fwd+bwd ms, x no grad", tf32["w_fwd_bwd_ms"], 0.8),
            ("fused fwd+bwd ms, x needs grad", fused["fwd_bwd_ms"], 1.4),
            ("fused forward ms", fused["forward_ms"], 0.40),
            ("fused_tf32 forward ms", tf32["forward_ms"], 0.30),
            ("fused backward ms, x no grad", fused["w_bwd_ms"], 0.45),
            # the row above less this is the adapter's host cost (its floor)
            ("fused backward ms, x no grad, GPU time alone", fused["w_bwd_gpu_ms"], 0.45),
        ):
            out.append((desc, value, round(goal * scale, 3), value <= goal * scale))
    allowed = ct.conv.candidates(torch.float32, False)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        t = {r["impl"]: r for r in rows if r["shape"] == shape}
        for key, what in (("forward_il_ms", "forward"), ("fwd_bwd_il_ms", "fwd+bwd")):
            best = min(t[a][key] for a in allowed)
            desc = f"{shape}: auto / best of {' or '.join(allowed)}, {what} (interleaved)"
            out.append((desc, t["auto"][key] / best, 1.03, t["auto"][key] <= 1.03 * best))
    return out


def markdown(rows, res) -> str:
    """The rows and targets as Markdown tables (docs/benchmarks.md)."""
    L = [
        "| shape | algorithm | forward ms | x floor | fwd+bwd ms | w fwd+bwd ms | w bwd ms "
        "| w bwd GPU ms | max err vs float64 | saved MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        impl = r["impl"] + (f" ({', '.join(r['picked'])})" if r.get("picked") else "")
        L.append(
            f"| {r['shape']} | {impl} | {r['forward_ms']:.3f} | {r['x_floor']:.2f} | "
            f"{r['fwd_bwd_ms']:.3f} | {r['w_fwd_bwd_ms']:.3f} | {r['w_bwd_ms']:.3f} | "
            f"{r['w_bwd_gpu_ms']:.3f} | "
            f"{r['max_err']:.2e} | {r['saved_mb']:.1f} |"
        )
    L += ["", "| target (reference shape) | measured | goal | |", "|---|---|---|---|"]
    for desc, value, goal, ok in res:
        L.append(f"| {desc} | {value:.3f} | {goal} | {'met' if ok else '**missed**'} |")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--max-autotune", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="write the tables as Markdown here")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}  torch {torch.__version__}", flush=True)
    rows = []
    for name in args.shapes:
        s = SHAPES[name]
        conv = f"Conv2d({s[1]}, {s[4]}, {s[5]}, stride={s[6]}, padding={s[7]})"
        print(f"{name}: x {s[0]}x{s[1]}x{s[2]}x{s[3]}, {conv}", flush=True)
        rows += run_shape(name, s, args)
        torch.cuda.empty_cache()
    res = targets(rows, gpu)
    res23 = targets_23(rows, gpu)
    for title, items in (("issue 11", res), ("issue 23", res23)):
        print(f"\ntargets ({title})")
        for desc, value, goal, ok in items:
            print(f"  {'PASS' if ok else 'MISS'}  {desc}: {value:.3f} (goal {goal})")
    res = res + res23
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, rows=rows, targets=res), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, res))
    assert all(math.isfinite(r["forward_ms"]) for r in rows)


if __name__ == "__main__":
    main()
