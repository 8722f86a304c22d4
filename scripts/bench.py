"""Benchmark suite: cupy_act against PyTorch eager, torch.compile and a device copy.

    PYTHONPATH=. python scripts/bench.py [--out bench_out] [--dtypes float32 ...]
                                         [--max-log2 31] [--no-conv] [--no-compile]
                                         [--max-autotune]

Everything is measured in one run, per dtype and size (1-D tensors of 2^16 to
2^31 elements, stepping by 4x, and the 4096 x 393216 reference shape):
  copy           y.copy_(x): the bandwidth roofline of this device
  forward        eager (relu / leaky_relu / x / d then leaky_relu, two passes),
                 torch.compile of the same expression (one fused pass), ours
  forward+mask   ours: y and the 1-bit mask in one pass
  backward       eager (aten threshold_backward / leaky_relu_backward, then / d),
                 ours from dy and the mask
  fwd+bwd        autograd forward and torch.autograd.grad, eager vs ours
  CuPy anchors   cupy.maximum(x, 0, out=y) ("cupy max", relu), a cupy.ElementwiseKernel
                 LeakyReLU into y ("cupy EK"), and our CuPy API, leaky_relu(x, out=y)
                 ("ours cupy"), on the same memory; not for bfloat16
Times are medians of CUDA-event timings after warm-up; below 2^24 elements each
timing covers several back-to-back calls (time per call, host cost included).
GB/s come from the byte formula printed next to each case (N elements of s
bytes, each tensor read or written once, the mask N/8 bytes); "%copy" is that
bandwidth over the copy's in the same run. Ratios are speedups (their time over
ours). Inputs are random normal numbers; our outputs are checked bit for bit
against eager at every size. A ConvDivLeakyReLU section times the reference
model (batch 128, 8 -> 64 channels, 3x3, 128x128, divisor 2), and
scripts/conv_bench.py times every conv2d_div_leaky_relu algorithm at five
shapes (--max-autotune adds torch.compile max-autotune there). The targets of
docs/benchmarks.md are evaluated last. Writes results.json, results.csv,
results.md (the tables in Markdown) and bench.png under --out.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import conv_bench  # scripts/conv_bench.py, next to this script
import measure  # scripts/measure.py
import torch
import torch.nn.functional as F

import cupy_act.torch as ct
from cupy_act import testing
from cupy_act._registry import OPS as REGISTRY
from cupy_act.torch import _impl

SLOPE, DIVISOR = 0.01, 2.0
OPS = tuple(REGISTRY)
REF_SHAPE = (4096, 393216)
DEVICE = "cuda"
ATEN = torch.ops.aten


# The eager baselines are the registry's PyTorch expressions (one Python frame
# over the bare torch call, about 0.1 us, only visible in per-call times).
def eager_forward(op):
    spec = REGISTRY[op]
    if spec.divisor:  # two passes: x / d, then the activation
        return lambda x: spec.torch_forward(torch, x / DIVISOR, SLOPE)
    return lambda x: spec.torch_forward(torch, x, SLOPE)


def ours_forward(op):
    kw = testing.op_kwargs(op, SLOPE, DIVISOR)
    fn = getattr(ct, op)
    return lambda x: fn(x, **kw)


def scalars(op):
    """(slope, divisor) as the tensor-level implementation takes them."""
    spec = REGISTRY[op]
    return SLOPE if spec.slope else 0.0, DIVISOR if spec.divisor else 1.0


def eager_backward(op, x, dy):
    spec = REGISTRY[op]
    if spec.divisor:
        t = x / DIVISOR
        return lambda: spec.torch_backward(torch, dy, t, SLOPE, None) / DIVISOR
    return lambda: spec.torch_backward(torch, dy, x, SLOPE, None)


# Bytes moved, as (multiple of N*s, multiple of N/8).
BYTES = {
    ("copy", "copy"): (2, 0),
    ("forward", "eager"): (2, 0),
    ("forward", "eager div"): (4, 0),  # x / d written, then read again
    ("forward", "compile"): (2, 0),
    ("forward", "cupy_act"): (2, 0),
    ("forward+mask", "cupy_act"): (2, 1),
    ("backward", "eager"): (3, 0),
    ("backward", "eager div"): (5, 0),
    ("backward", "cupy_act"): (2, 1),
    ("fwd+bwd", "eager"): (5, 0),
    ("fwd+bwd", "eager div"): (9, 0),
    ("fwd+bwd", "cupy_act"): (4, 2),
    # CuPy's own elementwise calls and our CuPy API (out= given), on the same memory
    ("forward", "cupy max"): (2, 0),
    ("forward", "cupy EK"): (2, 0),
    ("forward", "ours cupy"): (2, 0),
}


def formula(k):
    a, b = k
    parts = ([f"{a}Ns"] if a else []) + ([f"{b}N/8" if b > 1 else "N/8"] if b else [])
    return "+".join(parts)


def saved_bytes_per_element(fn, dtype, n=4096) -> float:
    """Bytes autograd saves for one call of fn, per element."""
    x = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True)
    # a non-leaf input, as in a network; `* 1` itself saves nothing
    return testing.nbytes(testing.saved_sizes(fn, x * 1)[1]) / n


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.compiled = {}

    def compiled_forward(self, op, static: bool):
        key = (op, static)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(eager_forward(op), dynamic=not static)
        return self.compiled[key]

    def add(self, dtype, label, n, s, op, case, impl, ms, saved=None):
        a, b = BYTES[(case, impl)]
        nbytes = a * n * s + b * n / 8
        row = dict(
            dtype=str(dtype)[6:],
            size=label,
            n=n,
            op=op,
            case=case,
            impl=impl.replace(" div", ""),
            ms=ms,
            bytes=nbytes,
            formula=formula((a, b)),
            gbps=nbytes / ms / 1e6,
            saved_bytes_per_element=saved,
        )
        self.rows.append(row)
        return row

    def sizes(self):
        for k in range(16, self.args.max_log2 + 1, 2):
            yield f"2^{k}", (1 << k,)
        if self.args.max_log2 >= 31:
            yield "2^31", (1 << 31,)
        yield "4096x393216", REF_SHAPE

    def run_dtype(self, dtype):
        s = dtype.itemsize
        saved = {}
        for op in OPS:
            saved[(op, "eager")] = saved_bytes_per_element(eager_forward(op), dtype)
            saved[(op, "cupy_act")] = saved_bytes_per_element(ours_forward(op), dtype)
        seen = set()
        for label, shape in self.sizes():
            if label in seen:
                continue
            seen.add(label)
            n = math.prod(shape)
            free, _ = torch.cuda.mem_get_info()
            if 7 * n * s > free:
                print(
                    f"  {str(dtype)[6:]} {label}: skipped, needs ~{7 * n * s / 2**30:.0f} GiB "
                    f"(free {free / 2**30:.0f} GiB)",
                    flush=True,
                )
                continue
            t0 = time.perf_counter()
            try:
                self.run_size(dtype, label, shape, saved)
                print(
                    f"  {str(dtype)[6:]:9s} {label:12s} done in {time.perf_counter() - t0:5.1f} s",
                    flush=True,
                )
            except torch.OutOfMemoryError:
                print(f"  {str(dtype)[6:]} {label}: out of memory, skipped", flush=True)
            torch.cuda.empty_cache()

    def run_size(self, dtype, label, shape, saved):
        n, s = math.prod(shape), dtype.itemsize
        g = torch.Generator(device=DEVICE).manual_seed(n)
        x = torch.randn(shape, device=DEVICE, dtype=dtype, generator=g)
        dy = torch.randn(shape, device=DEVICE, dtype=dtype, generator=g)
        reps = max(1, min(256, (1 << 24) // n))
        iters = 10 if n >= 1 << 28 else (20 if reps == 1 else 40)  # host-bound sizes are noisier

        def T(fn):
            return testing.median_ms(fn, iters=iters, warmup=3, reps=reps)

        y = torch.empty_like(x)
        # Clocks and memory settle after a change of size: copy for 0.3 s first,
        # then time the copy at the start and again at the end of this size and
        # take the faster as the roofline (the harder one to beat).
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:
            y.copy_(x)
            torch.cuda.synchronize()
        copy_first = T(lambda: y.copy_(x))
        start = len(self.rows)
        static = shape == REF_SHAPE
        add = functools.partial(self.add, dtype, label, n, s)
        for op in OPS:
            div = " div" if REGISTRY[op].divisor else ""
            ef, of = eager_forward(op), ours_forward(op)
            slope, divisor = scalars(op)
            with torch.no_grad():
                testing.assert_bits_equal(of(x), ef(x), f"{op} forward, {label}")
                add(op, "forward", "eager" + div, T(lambda: ef(x)))
                if not self.args.no_compile:
                    cf = self.compiled_forward(op, static)
                    add(op, "forward", "compile", T(lambda: cf(x)))
                add(op, "forward", "cupy_act", T(lambda: of(x)))
                fm = T(lambda: _impl.forward_mask(x, op, slope, divisor, None))
                add(op, "forward+mask", "cupy_act", fm)
                _, mask = _impl.forward_mask(x, op, slope, divisor, None)
                eb = eager_backward(op, x, dy)

                def ob():
                    return _impl.backward(dy, mask, op, slope, divisor, False)

                testing.assert_bits_equal(ob(), eb(), f"{op} backward, {label}")
                add(op, "backward", "eager" + div, T(eb))
                add(op, "backward", "cupy_act", T(ob))
            xg = x.detach().requires_grad_(True)
            for impl, f in (("eager" + div, ef), ("cupy_act", of)):
                ms = T(lambda: torch.autograd.grad(f(xg), xg, dy))
                add(op, "fwd+bwd", impl, ms, saved=saved[(op, impl.replace(" div", ""))])
        self.cupy_anchors(dtype, label, n, s, x, T)
        copy_last = T(lambda: y.copy_(x))
        row = self.add(dtype, label, n, s, "-", "copy", "copy", min(copy_first, copy_last))
        row.update(copy_first_ms=copy_first, copy_last_ms=copy_last)
        self.rows.insert(start, self.rows.pop())
        for r in self.rows[start:]:  # now that the roofline is known
            r["pct_copy"] = 100 * (r["bytes"] / r["ms"]) / (2 * n * s / row["ms"])
            r["x_copy_time"] = r["ms"] / row["ms"]

    def cupy_anchors(self, dtype, label, n, s, x, T):
        """CuPy's own calls against our CuPy API, on x's memory (zero copy): relu as
        cupy.maximum(x, 0, out=y), LeakyReLU as a cupy.ElementwiseKernel into y, and
        cupy_act.leaky_relu(x, out=y). Not for bfloat16 (no CuPy elementwise kernels)."""
        if dtype == torch.bfloat16:
            return
        import cupy

        import cupy_act

        cx = cupy.from_dlpack(x.detach())
        cy = cupy.empty_like(cx)
        ek = cupy.ElementwiseKernel("T x, T s", "T y", "y = x > 0 ? x : x * s", "bench_leaky")
        slope = cx.dtype.type(SLOPE)
        add = functools.partial(self.add, dtype, label, n, s)
        add("relu", "forward", "cupy max", T(lambda: cupy.maximum(cx, 0, out=cy)))
        add("leaky_relu", "forward", "cupy EK", T(lambda: ek(cx, slope, cy)))
        add("leaky_relu", "forward", "ours cupy", T(lambda: cupy_act.leaky_relu(cx, SLOPE, out=cy)))

    def run_conv(self):
        torch.manual_seed(0)
        eager = testing.ConvDivLeakyReLUModel(8, 64, 3, 2.0).to(DEVICE)
        x = torch.randn(128, 8, 128, 128, device=DEVICE)
        models = {"eager": eager}
        if not self.args.no_compile:
            models["compile"] = torch.compile(eager)
        for name, cl in (("cupy_act", False), ("cupy_act channels_last", True)):
            m = ct.ConvDivLeakyReLU(8, 64, 3, 2.0, channels_last=cl).to(DEVICE)
            m.load_state_dict(eager.state_dict())
            models[name] = m
        with torch.no_grad():
            testing.assert_bits_equal(models["cupy_act"](x), eager(x), "ConvDivLeakyReLU")
        out = []
        for name, m in models.items():
            with torch.no_grad():
                fwd = testing.median_ms(lambda: m(x), iters=20, warmup=3)
            gy = torch.randn_like(m(x))
            fb = testing.median_ms(lambda: m(x).backward(gy), iters=20, warmup=3)
            m.zero_grad(set_to_none=True)
            out.append(dict(model=name, forward_ms=fwd, fwd_bwd_ms=fb))
            print(
                f"  conv model {name:24s} forward {fwd:6.3f} ms  fwd+bwd {fb:6.3f} ms", flush=True
            )
        # where the time goes: the convolution alone, without bias, in both layouts
        w = eager.conv.weight.detach()
        cl = torch.channels_last
        x_cl, w_cl = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
        with torch.no_grad():
            for name, fn in (
                ("conv2d alone, no bias, NCHW", lambda: F.conv2d(x, w)),
                ("conv2d alone, no bias, channels_last", lambda: F.conv2d(x_cl, w_cl)),
            ):
                fwd = testing.median_ms(fn, iters=20, warmup=3)
                out.append(dict(model=name, forward_ms=fwd, fwd_bwd_ms=None))
                print(f"  {name:35s} forward {fwd:6.3f} ms", flush=True)
        return out


def find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def targets(rows, conv) -> list:
    """The measure.Target of every goal, at the reference shape unless a size is named."""
    ref, out = "4096x393216", []

    def ms(dtype, op, case, impl, size=ref):
        r = find(rows, dtype=dtype, size=size, op=op, case=case, impl=impl)
        return r and r["ms"]

    def ratio(a, b):
        return a / b if a and b else None

    def add(what, value, goal):
        out.append(measure.target(what, value, goal))

    for dtype in ("float32", "bfloat16", "float16"):
        for op in ("relu", "leaky_relu"):
            e, o = ms(dtype, op, "forward", "eager"), ms(dtype, op, "forward", "cupy_act")
            add(f"{op} forward {dtype}: speed vs eager", ratio(e, o),
                ">= 1.08x" if dtype == "float16" else ">= 0.99x")  # fmt: skip
            r = find(rows, dtype=dtype, size=ref, op=op, case="forward", impl="cupy_act")
            if dtype != "float16" and r:
                add(f"{op} forward {dtype}: % of copy bandwidth", r["pct_copy"], ">= 98%")
    f32, div = "float32", "div_leaky_relu"
    o = ms(f32, div, "forward", "cupy_act")
    add(f"{div} forward {f32}: speed vs eager (two passes)",
        ratio(ms(f32, div, "forward", "eager"), o), ">= 1.95x")  # fmt: skip
    add(f"{div} forward {f32}: speed vs torch.compile",
        ratio(ms(f32, div, "forward", "compile"), o), ">= 0.99x")  # fmt: skip
    for op in OPS:
        r = find(rows, dtype=f32, size=ref, op=op, case="forward+mask", impl="cupy_act")
        add(f"{op} forward+mask {f32}: time / copy time", r and r["x_copy_time"], "<= 1.03x")
        for case, what, goal in (
            ("backward", "speed vs eager backward", ">= 1.43x"),
            ("fwd+bwd", "autograd fwd+bwd: speed vs eager", ">= 1.2x"),
        ):
            e, o = ms(f32, op, case, "eager"), ms(f32, op, case, "cupy_act")
            add(f"{op} {case} {f32}: {what}", ratio(e, o), goal)
        se = find(rows, dtype=f32, size=ref, op=op, case="fwd+bwd", impl="eager")
        so = find(rows, dtype=f32, size=ref, op=op, case="fwd+bwd", impl="cupy_act")
        if se and so:  # (32x, within the float of the measured ratio)
            saved = se["saved_bytes_per_element"] / so["saved_bytes_per_element"]
            add(f"{op} saved memory {f32}: eager / ours", saved, ">= 31.968x")
        for size in ("2^16", "2^18", "2^20"):
            o, e = ms(f32, op, "forward", "cupy_act", size), ms(f32, op, "forward", "eager", size)
            add(f"{op} forward {f32} {size}: time per call / eager", ratio(o, e), "<= 1.3x")
    c = {r["model"]: r for r in conv}
    if "eager" in c and "cupy_act" in c:
        add("ConvDivLeakyReLU forward, bit-exact mode: speed vs eager",
            c["eager"]["forward_ms"] / c["cupy_act"]["forward_ms"], ">= 1.6x")  # fmt: skip
    if "compile" in c and "cupy_act channels_last" in c:
        for k, what in (("forward_ms", "forward"), ("fwd_bwd_ms", "fwd+bwd")):
            add(f"ConvDivLeakyReLU {what}, channels_last: speed vs torch.compile",
                c["compile"][k] / c["cupy_act channels_last"][k], "> 1x")  # fmt: skip
    return [t for t in out if t is not None]


def markdown(meta, rows, conv, res) -> str:
    """The run's tables in Markdown (docs/benchmarks.md quotes them)."""
    L = [
        f"GPU: {measure.header(meta)}. Command: `{meta['command']}`.",
        "",
    ]
    ref = "4096x393216"
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        rs = [r for r in rows if r["dtype"] == dtype and r["size"] == ref]
        if not rs:
            continue
        L += [
            f"### {dtype}, 4096 x 393216 (N = {rs[0]['n']:,})",
            "",
            "| op | case | impl | bytes | ms | GB/s | % copy | vs eager | vs compile "
            "| saved B/elem |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rs:
            e = find(
                rs,
                op=r["op"],
                case="forward" if r["case"] == "forward+mask" else r["case"],
                impl="eager",
            )
            c = find(rs, op=r["op"], case=r["case"], impl="compile")
            ours = r["impl"] == "cupy_act"
            saved = r["saved_bytes_per_element"]
            L.append(
                f"| {r['op']} | {r['case']} | {r['impl']} | {r['formula']} | {r['ms']:.3f} | "
                f"{r['gbps']:.0f} | {r['pct_copy']:.1f} | "
                f"{f'{e_ms:.3f}x' if ours and (e_ms := e and e['ms'] / r['ms']) else ''} | "
                f"{f'{c_ms:.3f}x' if ours and (c_ms := c and c['ms'] / r['ms']) else ''} | "
                f"{'' if saved is None else f'{saved:.3f}'} |"
            )
        L.append("")
    L += [
        "### float32 across sizes (time per call in us; GB/s of our forward)",
        "",
        "| size | copy | eager fwd | compile fwd | ours fwd | ours GB/s | ours fwd+mask "
        "| eager bwd "
        "| ours bwd | eager fwd+bwd | ours fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in dict.fromkeys(r["size"] for r in rows if r["dtype"] == "float32"):
        rs = [r for r in rows if r["dtype"] == "float32" and r["size"] == size]

        def us(case, impl, op="leaky_relu"):
            r = find(rs, op=op if case != "copy" else "-", case=case, impl=impl)
            return f"{1e3 * r['ms']:.1f}" if r else ""

        ours = find(rs, op="leaky_relu", case="forward", impl="cupy_act")
        L.append(
            f"| {size} | {us('copy', 'copy')} | {us('forward', 'eager')} | "
            f"{us('forward', 'compile')} | {us('forward', 'cupy_act')} | "
            f"{ours['gbps']:.0f} | {us('forward+mask', 'cupy_act')} | "
            f"{us('backward', 'eager')} | {us('backward', 'cupy_act')} | "
            f"{us('fwd+bwd', 'eager')} | {us('fwd+bwd', 'cupy_act')} |"
        )
    L += [
        "",
        "(leaky_relu with slope 0.01; below 2^24 elements a timing covers 256 / 64 / 16 / 4 "
        "back-to-back calls at 2^16 / 2^18 / 2^20 / 2^22, so host cost per call is included.)",
        "",
    ]
    if conv:
        L += [
            "### ConvDivLeakyReLU, batch 128, 8 -> 64 channels, 3x3, 128x128, divisor 2 (float32)",
            "",
            "| model | forward ms (no grad) | forward + backward ms |",
            "|---|---|---|",
        ]
        for c in conv:
            fb = "" if c["fwd_bwd_ms"] is None else f"{c['fwd_bwd_ms']:.3f}"
            L.append(f"| {c['model']} | {c['forward_ms']:.3f} | {fb} |")
        L.append("")
    L += ["### Targets", ""] + measure.md_table(
        ("target", "measured", "goal", ""),
        [(t.what, f"{t.value:.3f}", t.goal, "met" if t.met else "**missed**") for t in res],
    )
    return "\n".join(L) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted(
        {r["dtype"] for r in rows}, key=["float32", "bfloat16", "float16", "float64"].index
    )
    fig, axes = plt.subplots(len(dtypes), len(OPS), figsize=(15, 3.6 * len(dtypes)), squeeze=False)
    series = [
        ("copy", "copy", "k--"),
        ("forward", "eager", "C0-"),
        ("forward", "compile", "C1-"),
        ("forward", "cupy_act", "C2-"),
        ("forward+mask", "cupy_act", "C3-"),
        ("backward", "eager", "C0:"),
        ("backward", "cupy_act", "C2:"),
    ]
    for i, dtype in enumerate(dtypes):
        for j, op in enumerate(OPS):
            ax = axes[i][j]
            for case, impl, style in series:
                pts = sorted(
                    (r["n"], r["gbps"])
                    for r in rows
                    if r["dtype"] == dtype
                    and r["case"] == case
                    and r["impl"] == impl
                    and r["op"] in (op, "-")
                    and r["size"].startswith("2^")
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        label=f"{case} {impl}" if case != "copy" else "copy",
                        marker=".",
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {dtype}")
            ax.set_xlabel("elements")
            ax.set_ylabel("GB/s (bytes moved / time)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--max-log2", type=int, default=31)
    ap.add_argument("--no-conv", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--max-autotune", action="store_true", help="conv: torch.compile max-autotune")
    args = ap.parse_args()
    measure.require_gpu("bench.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Each op's lambda is one code object compiled for several dtypes and both
    # static and dynamic shapes; past dynamo's default limit of 8 it would
    # silently run eager, so the limit is raised.
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    meta = measure.environment()
    print(measure.header(meta), flush=True)
    bench = Bench(args)
    t0 = time.perf_counter()
    for name in args.dtypes:
        bench.run_dtype(getattr(torch, name))
    conv = [] if args.no_conv else bench.run_conv()
    algos, algo_targets = [], []
    if not args.no_conv:  # every conv algorithm at five shapes (scripts/conv_bench.py)
        opts = SimpleNamespace(no_compile=args.no_compile, max_autotune=args.max_autotune, iters=20)
        for name in conv_bench.SHAPES:
            algos += conv_bench.run_shape(name, conv_bench.SHAPES[name], opts)
        algo_targets = conv_bench.targets(algos, meta["gpu"])
    res = targets(bench.rows, conv) + algo_targets
    md = markdown(meta, bench.rows, conv, res)
    print("\n" + md)
    print("\ntargets (4096 x 393216 unless a size is named)")
    measure.print_targets(res)
    print(f"{time.perf_counter() - t0:.0f} s")
    (out / "results.json").write_text(
        json.dumps(
            dict(
                meta=meta,
                rows=bench.rows,
                conv=conv,
                conv_algorithms=algos,
                targets=[t._asdict() for t in res],
            ),
            indent=1,
        )
    )
    with open(out / "results.csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in bench.rows for k in r))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(bench.rows)
    if algos:
        md += "\n### conv2d_div_leaky_relu, every algorithm\n\n" + conv_bench.markdown(algos, [])
    (out / "results.md").write_text(md)
    try:
        plot(bench.rows, out / "bench.png")
        print(f"wrote {out}/results.json, results.csv, results.md, bench.png")
    except ImportError:  # (matplotlib is no dependency)
        print(
            f"wrote {out}/results.json, results.csv, results.md (no plot: pip install matplotlib)"
        )


if __name__ == "__main__":
    main()
