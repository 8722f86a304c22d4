"""Where a fused-convolution kernel's instructions and stalls go, by device
function and by source line: Nsight Compute's source counters of one launch.

    PYTHONPATH=. python scripts/kernel_lines.py [--kernel forward|wgrad]
        [--dtype float32] [--algorithm fused] [--padding 0] [--lines 25] [--boost]

Runs the seed shape (conv 8->64 3x3 on 128x8x128x128, NCHW) in
wgrad_probe.py's child under ``ncu`` (on PATH; it locks the clocks near
base unless --boost: the GPU's own clocks, as in training), its
modules compiled with ``-lineinfo``, exports the source page (CUDA lines
with their SASS) and prints, per device function (the one whose definition a line falls in, in
the source CuPy compiled) and for the lines with the most stall samples:
the share of warp instructions executed, the share of stall samples and the
largest stall reasons. What a share of stall samples means: see
kernel_limits.py, which gives the kernel-wide figures.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {
    "forward": ("conv2d_kernel", "conv2d.cu"),
    "wgrad": ("conv2d_wgrad_kernel", "conv2d_wgrad.cu"),
}
_DEF = re.compile(r"\b(__device__|__global__)\b")
_NAME = re.compile(r"\b(\w+)\s*\(")
_SKIP = {"__launch_bounds__", "__align__", "if", "for", "while", "sizeof", "return"}


def child(kernel: str, dtype_name: str, algorithm: str, padding: int) -> None:
    """wgrad_probe.py's child (three launches at the seed shape, ncu takes the
    second), its modules compiled with -lineinfo."""
    from cupy_act import _conv

    sys.path.insert(0, str(ROOT / "scripts"))
    import wgrad_probe

    arch_options = _conv.arch_options
    _conv.arch_options = lambda sm: (*arch_options(sm), "-lineinfo")
    wgrad_probe.child(dtype_name, "nchw", algorithm, kernel, str(padding))


def functions(source: list[str]) -> tuple[list[int], list[str]]:
    """(first line, name) of each device function defined in ``source``,
    in order: a line with __device__ or __global__ starts one, named by the
    first call-like identifier from there to its opening brace."""
    starts, names = [], []
    for i, line in enumerate(source):
        if line.lstrip().startswith("//") or not _DEF.search(line):
            continue
        text = " ".join(source[i : i + 6]).split("{")[0]
        name = next((m.group(1) for m in _NAME.finditer(text) if m.group(1) not in _SKIP), "?")
        starts.append(i + 1)
        names.append(name)
    return starts, names


def source_rows(csv_text: str) -> list[dict]:
    """The source page's CUDA lines: line number, stall samples, warp
    instructions, samples per stall reason."""
    rows = list(csv.reader(io.StringIO(csv_text)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Line No")
    hdr = rows[head]
    samples = hdr.index("Warp Stall Sampling (All Samples)")
    instr = hdr.index("Instructions Executed")
    reasons = [(h[6:], i) for i, h in enumerate(hdr) if h.startswith("stall_") and "(" not in h]

    def num(v: str) -> int:
        try:
            return int(v.replace(",", ""))
        except ValueError:
            return 0

    return [
        {"line": int(r[0]), "samples": num(r[samples]), "instr": num(r[instr]),
         "reasons": {name: num(r[i]) for name, i in reasons}}
        for r in rows[head + 1 :]
        if r and r[0].isdigit()
    ]  # fmt: skip


def report(lines: list[dict], source: list[str], top: int) -> None:
    starts, names = functions(source)
    total_s = sum(r["samples"] for r in lines) or 1
    total_i = sum(r["instr"] for r in lines) or 1
    print(f"{total_i / 1e6:.1f} M warp instructions, {total_s} stall samples\n")
    per: dict[str, list[int]] = {}
    for r in lines:
        k = bisect.bisect_right(starts, r["line"]) - 1
        acc = per.setdefault(names[k] if k >= 0 else "?", [0, 0])
        acc[0] += r["instr"]
        acc[1] += r["samples"]
    print(f"{'function':30s} {'instr':>6s} {'stalls':>7s}")
    for name, (i, s) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        if i / total_i >= 0.005 or s / total_s >= 0.005:
            print(f"{name:30s} {100 * i / total_i:5.1f}% {100 * s / total_s:6.1f}%")
    print(f"\n{'line':>5s} {'instr':>6s} {'stalls':>7s}  top reasons | source")
    for r in sorted(lines, key=lambda r: -r["samples"])[:top]:
        why = sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:3]
        text = source[r["line"] - 1].strip()[:70] if r["line"] <= len(source) else ""
        share = f"{100 * r['instr'] / total_i:5.1f}% {100 * r['samples'] / total_s:6.1f}%"
        print(f"{r['line']:5d} {share}  {', '.join(f'{k} {v}' for k, v in why)} | {text}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kernel", default="forward", choices=list(KERNELS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--algorithm", default="fused", choices=["fused", "fused_tf32"])
    ap.add_argument("--padding", type=int, default=0, help="the convolution's (seed: 0)")
    ap.add_argument("--lines", type=int, default=25, help="how many source lines to list")
    ap.add_argument("--boost", action="store_true", help="leave the clocks to the GPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.kernel, args.dtype, args.algorithm, args.padding)
        return
    sys.path.insert(0, str(ROOT))
    from cupy_act._source import assembled_source

    regex, source_name = KERNELS[args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "k"
        cmd = ["ncu", "-k", f"regex:{regex}", "--launch-skip", "1", "--launch-count", "1",
               "--clock-control", "none" if args.boost else "base",
               "--section", "SourceCounters", "--section", "WarpStateStats",
               "--import-source", "no", "-o", str(rep), sys.executable, __file__, "--child",
               "--kernel", args.kernel, "--dtype", args.dtype, "--algorithm", args.algorithm,
               "--padding", str(args.padding)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if not (Path(tmp) / "k.ncu-rep").exists():
            raise SystemExit(
                f"kernel_lines: ncu wrote no report:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
            )
        page_cmd = ["ncu", "-i", f"{rep}.ncu-rep", "--page", "source", "--csv",
                    "--print-source", "cuda,sass"]  # fmt: skip
        page = subprocess.run(
            page_cmd, capture_output=True, text=True, timeout=600, check=True
        ).stdout
    print(f"{args.kernel} ({regex}), {args.dtype}, {args.algorithm}, padding {args.padding}")
    report(source_rows(page), assembled_source(source_name).splitlines(), args.lines)


if __name__ == "__main__":
    main()
