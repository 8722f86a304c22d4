"""Where the fused weight gradient's time goes: what is left of it without its loads.

    PYTHONPATH=. python scripts/wgrad_probe.py [--dtypes float32 float16]
        [--layouts nchw nhwc] [--algorithm fused] [--repeats 2]
        [--variants kernel "no dy" "no dy, x"] [--base DIR ...]
        [--forward | --only-forward | --only-dgrad] [--padding 0] [--timing ncu|events]

Nsight Compute's duration (``ncu`` must be on PATH; it locks the clocks, so
the figures compare across variants on a noisy host; ``--timing events``:
CUDA events at the GPU's own clocks instead, which is what users see) of one launch of
``conv2d_wgrad_kernel`` at the seed shape (conv 8->64 3x3 on 128x8x128x128;
"fused": 3xTF32 for float32, "fused_tf32": one pass), for this version and
for copies of it with parts of the memory traffic taken out:

  kernel     cuda/conv2d_wgrad.cu as it is
  no dy      dy and the mask not read: load_dz4 (NCHW) and the NHWC loads
             make up values from the index instead (same instructions after)
  no dy, x   also no input loads (NCHW patch copy: every load predicated off)
  DIR        with --base DIR ...: each DIR's cupy_act/ and cuda/ as they are
             (other versions, e.g. ``git archive`` of the last commit), to
             compare; the column is named after the directory

The gaps bound what hiding those loads behind the MMAs can gain; what is left
is the kernel's instruction-bound part (forming dz, splitting, the MMA loop).
On compute capability 9.0 the seed shape runs ``conv2d_wgrad_kernel_wg``
(warpgroup MMAs; the regex takes it), which forms dz from copied rows: the
"no dy" edits do not reach it there, so use ``--variants kernel``.
--forward adds the forward kernel (``conv2d_kernel``, same shape) for this
version and the bases; --only-forward times that alone, --only-dgrad the
input gradient's kernel (``conv2d_dgrad_kernel``) alone. Rows repeat
``--repeats`` times, variants interleaved.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (variant, [(text in cuda/conv2d_wgrad.cu, replacement)]); each text must occur once.
_LOAD_DZ = """  const u32* m = mask + (e >> 5);
  const int sh = (int)(e & 31);
  if (vec4) {"""
_SYNTH_DZ = """#pragma unroll
  for (int j = 0; j < 4; ++j) d[j] = Num<T>::from_op((float)((e + j) & 7) - 3.5f);
  bits = (u32)(e * 2654435761u) & (valid > 0 ? 0xfu : 0u);
  if (true) return;
  const u32* m = mask + (e >> 5);
  const int sh = (int)(e & 31);
  if (vec4) {"""
_NHWC_DY = """              d[h][j] = dy[e];
              bit[h][j] = __ldg(p.mask + (e >> 5)) >> (e & 31);"""
_SYNTH_NHWC = """              d[h][j] = Num<T>::from_op((float)(e & 7) - 3.5f);
              bit[h][j] = (u32)(e * 2654435761u) >> 7;"""
_ROW_OK = "const bool row_ok = row < rows &&"
_NO_X = "const bool row_ok = false && row < rows &&"
VARIANTS = {
    "kernel": [],
    "no dy": [(_LOAD_DZ, _SYNTH_DZ), (_NHWC_DY, _SYNTH_NHWC)],
    "no dy, x": [(_LOAD_DZ, _SYNTH_DZ), (_NHWC_DY, _SYNTH_NHWC), (_ROW_OK, _NO_X)],
}


# the files the edits may touch (under the copy's root): the kernel and the
# patch copy it shares
EDITED = ("cuda/conv2d_wgrad.cu", "cuda/conv2d_tiles.cuh")


def make_copy(edits: list[tuple[str, str]], where: Path, files: tuple[str, ...] = EDITED) -> Path:
    """cupy_act/ and cuda/ under ``where`` with ``edits`` applied (each text
    must occur once in ``files``, all of them together)."""
    shutil.copytree(ROOT / "cupy_act", where / "cupy_act")
    shutil.copytree(ROOT / "cuda", where / "cuda")
    texts = {name: (where / name).read_text() for name in files}
    for old, new in edits:
        if sum(t.count(old) for t in texts.values()) != 1:
            raise SystemExit(f"wgrad_probe: the kernel changed; update the probe's edit of {old!r}")
        name = next(n for n, t in texts.items() if old in t)
        texts[name] = texts[name].replace(old, new)
    for name, text in texts.items():
        (where / name).write_text(text)
    return where


def child(dtype_name: str, layout: str, algorithm: str, what: str, padding: str,
          timing: str = "ncu") -> None:  # fmt: skip
    """Run the seed shape's weight gradient (or forward; "forward-nograd": the
    forward without a gradient, so without a mask; "dgrad": the input gradient
    alone, x's gradient only) three times (ncu times the
    second); with ``timing`` "events", print its median CUDA-event time
    instead (EVENT_TIMINGS timings of EVENT_CALLS back-to-back calls each, at
    the GPU's own clocks)."""
    import torch

    import cupy_act.torch as ct

    dt = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x = torch.randn(128, 8, 128, 128, device="cuda", dtype=dt)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(what == "dgrad")
    w = (torch.randn(64, 8, 3, 3, device="cuda", dtype=dt) * 0.1).requires_grad_(what != "dgrad")
    b = torch.randn(64, device="cuda", dtype=dt).requires_grad_(what != "dgrad")
    pad = int(padding)
    y = ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, pad, algorithm=algorithm)
    gy = torch.randn_like(y)
    ct.conv.FUSED_WGRAD = True

    def call():
        if what == "forward":
            ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, pad, algorithm=algorithm)
        elif what == "forward-nograd":  # no mask
            with torch.no_grad():
                ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, 1, pad, algorithm=algorithm)
        elif what == "dgrad":
            torch.autograd.grad(y, (x,), gy, retain_graph=True)
        else:
            torch.autograd.grad(y, (w, b), gy, retain_graph=True)

    if timing == "events":
        from cupy_act import testing

        ms = testing.median_ms(call, iters=EVENT_TIMINGS, warmup=5, reps=EVENT_CALLS)
        print(f"median_ms={ms:.5f}")
        return
    for _ in range(3):
        call()
    torch.cuda.synchronize()


# --timing events: per child, the median of this many timings of this many calls each
EVENT_TIMINGS, EVENT_CALLS = 7, 10


def events_us(pythonpath: Path, child_args: list[str]) -> float:
    """The median time (us) of one call at the GPU's own clocks (CUDA events;
    host work included, which back-to-back calls of these kernels hide)."""
    cmd = [sys.executable, __file__, "--child", *child_args, "events"]
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    m = re.search(r"median_ms=([\d.]+)", out.stdout)
    if m is None:
        raise SystemExit(f"wgrad_probe: no time from the child:\n{out.stdout[-1000:]}"
                         f"{out.stderr[-2000:]}")  # fmt: skip
    return float(m.group(1)) * 1000.0


def ncu_us(pythonpath: Path, kernel: str, child_args: list[str]) -> float:
    """``kernel``'s duration (us) under ncu, this script's child in ``pythonpath``."""
    cmd = ["ncu", "-k", f"regex:{kernel}", "--launch-skip", "1", "--launch-count", "1",
           "--metrics", "gpu__time_duration.sum", sys.executable, __file__, "--child",
           *child_args]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300).stdout
    m = re.search(r"gpu__time_duration\.sum\s+(\S+)\s+([\d.,]+)", out)
    if m is None:
        raise SystemExit(f"wgrad_probe: no duration in ncu's output:\n{out[-2000:]}")
    value = float(m.group(2).replace(",", ""))
    return value * {"ms": 1000.0, "msecond": 1000.0}.get(m.group(1), 1.0)


def table(title: str, dirs: dict[str, Path], kernel: str, what: str, args) -> None:
    """One row per dtype and layout, one column per variant (min over repeats)."""
    print(f"{title}\n{'dtype':9s} {'layout':6s} " + " ".join(f"{v:>10s}" for v in dirs) + "  (us)")
    for dt in args.dtypes:
        for layout in args.layouts:
            times: dict[str, list[float]] = {v: [] for v in dirs}
            for _ in range(args.repeats):
                for name, where in dirs.items():
                    if name == "no dy, x" and layout == "nhwc":
                        continue  # the NHWC patch copy is the forward's (conv2d_tiles.cuh)
                    cargs = [dt, layout, args.algorithm, what, str(args.padding)]
                    if args.timing == "events":
                        times[name].append(events_us(where, cargs))
                    else:
                        times[name].append(ncu_us(where, kernel, cargs))
            cells = [f"{min(t):10.1f}" if t else f"{'-':>10s}" for t in times.values()]
            print(f"{dt:9s} {layout:6s} " + " ".join(cells), flush=True)
            if args.timing == "events":  # every repeat: the spread is the noise
                for name, t in times.items():
                    print(f"    {name}: " + " ".join(f"{v:.1f}" for v in t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"],
                    choices=["float32", "float16", "bfloat16"])  # fmt: skip
    ap.add_argument("--layouts", nargs="+", default=["nchw"], choices=["nchw", "nhwc"])
    ap.add_argument("--algorithm", default="fused", choices=["fused", "fused_tf32"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--base", type=Path, nargs="+", default=[],
                    help="other versions' cupy_act/ and cuda/")  # fmt: skip
    ap.add_argument("--forward", action="store_true", help="also the forward kernel")
    ap.add_argument("--only-forward", action="store_true", help="the forward kernel alone")
    ap.add_argument("--only-dgrad", action="store_true",
                    help="the input-gradient kernel alone")  # fmt: skip
    ap.add_argument("--padding", type=int, default=0, help="the convolution's (seed: 0)")
    ap.add_argument("--no-grad", action="store_true",
                    help="the forward without a gradient (no mask)")  # fmt: skip
    ap.add_argument("--timing", default="ncu", choices=["ncu", "events"],
                    help="ncu: Nsight's duration, clocks locked near base; events: CUDA "
                    "events at the GPU's own clocks, EVENT_CALLS calls per timing")  # fmt: skip
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for base in args.base:
            dirs[base.name] = base.resolve()
        for i, name in enumerate(args.variants):
            dirs[name] = make_copy(VARIANTS[name], Path(tmp) / str(i))
        if args.only_dgrad:
            dg = {k: v for k, v in dirs.items() if k not in ("no dy", "no dy, x")}
            table(f"conv2d_dgrad_kernel, {args.algorithm}", dg, "conv2d_dgrad_kernel", "dgrad",
                  args)  # fmt: skip
        elif not args.only_forward:
            table(f"conv2d_wgrad_kernel, {args.algorithm}", dirs, "conv2d_wgrad_kernel", "wgrad",
                  args)  # fmt: skip
        if args.forward or args.only_forward:
            fwd = {k: v for k, v in dirs.items() if k not in ("no dy", "no dy, x")}
            what = "forward-nograd" if args.no_grad else "forward"
            table(f"conv2d_kernel ({what}), {args.algorithm}", fwd, "conv2d_kernel", what, args)


if __name__ == "__main__":
    main()
