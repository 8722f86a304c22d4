"""What limits the fused convolution's kernels: Nsight Compute's occupancy,
issue and memory figures and the top stall reasons, one launch each.

    PYTHONPATH=. python scripts/kernel_limits.py [--configs float32:fused_tf32:forward ...]
        [--layout nchw] [--padding 0] [--boost] [--memory]

Each config is dtype:algorithm:kernel with kernel "forward" (conv2d_kernel,
as it trains: with the mask), "forward-nograd" (without), "wgrad"
(conv2d_wgrad_kernel; on compute capability 9.0 the seed shape
takes its warpgroup version, conv2d_wgrad_kernel_wg) or "dgrad"
(conv2d_dgrad_kernel, x's gradient alone), run at the seed shape
(conv 8->64 3x3 on 128x8x128x128) by ``wgrad_probe.py``'s child under ``ncu`` (which must be on
PATH; it locks the clocks near base unless --boost leaves them to the GPU, as
in training). Per config one row: duration, issue slots busy,
DRAM throughput, achieved and theoretical occupancy, registers per thread,
shared memory per block, and the stall reasons with the most cycles per
issued instruction ("selected", the issuing cycle itself, left out); with
--memory also DRAM bytes read and written, the L2's write sectors and
requests from the SMs, its throughput and the SM clock during the kernel.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "wgrad_probe.py"
KERNELS = {
    "forward": "conv2d_kernel",
    "forward-nograd": "conv2d_kernel",
    "wgrad": "conv2d_wgrad_kernel",
    "dgrad": "conv2d_dgrad_kernel",
}
SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "LaunchStats", "SchedulerStats")
DEFAULT_CONFIGS = (
    "float32:fused_tf32:forward",
    "float32:fused:forward",
    "float16:fused:forward",
    "float32:fused:wgrad",
    "float32:fused_tf32:wgrad",
)
# details-page metric -> column
COLUMNS = {
    "Duration": "duration",
    "Issue Slots Busy": "issue",
    "DRAM Throughput": "DRAM",
    "Achieved Occupancy": "occupancy",
    "Theoretical Occupancy": "theoretical",
    "Registers Per Thread": "registers",
    "Dynamic Shared Memory Per Block": "smem",
}
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
# --memory: raw metrics -> column (DRAM bytes against the floor's, the L2's
# write sectors and requests from the SMs, the SM clock the kernel ran at)
MEMORY = {
    "dram__bytes_read.sum": "DRAM read",
    "dram__bytes_write.sum": "DRAM write",
    "lts__t_sectors_srcunit_tex_op_write.sum": "L2 write sectors",
    "lts__t_requests_srcunit_tex_op_write.sum": "L2 write requests",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 throughput",
    "sm__cycles_elapsed.avg.per_second": "SM clock",
}


def ncu_csv(report: Path, page: str) -> list[list[str]]:
    out = subprocess.run(["ncu", "-i", str(report), "--page", page, "--csv"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return list(csv.reader(io.StringIO(out)))


def profile(
    config: str, layout: str, padding: int, tmp: Path, boost: bool = False, memory: bool = False
) -> dict[str, str]:
    """One config's figures (column -> text) from one profiled launch (the
    clocks locked near base, or left to the GPU: ``boost``; with ``memory``
    the MEMORY metrics too)."""
    dtype, algorithm, what = config.split(":")
    report = tmp / config.replace(":", "_")
    cmd = ["ncu", "-k", f"regex:{KERNELS[what]}", "--launch-skip", "1", "--launch-count", "1",
           "--clock-control", "none" if boost else "base"]  # fmt: skip
    for s in SECTIONS:
        cmd += ["--section", s]
    if memory:
        cmd += ["--metrics", ",".join(MEMORY)]
    cmd += ["-o", str(report), sys.executable, str(PROBE), "--child", dtype, layout, algorithm,
            what, str(padding)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    rep = report.with_suffix(".ncu-rep")
    rows = ncu_csv(rep, "details")
    head = rows[0]
    name, unit, value = (head.index(k) for k in ("Metric Name", "Metric Unit", "Metric Value"))
    got: dict[str, str] = {}
    for r in rows[1:]:
        col = COLUMNS.get(r[name])
        if col and col not in got:
            got[col] = f"{r[value]} {r[unit]}".strip()
    raw = ncu_csv(rep, "raw")
    for metric, unit, v in zip(*raw[:3]):
        if metric in MEMORY:
            got[MEMORY[metric]] = f"{v} {unit}".strip()
    stalls = []
    for metric, v in zip(raw[0], raw[2]):
        reason = metric[len(STALL[0]) : -len(STALL[1])]
        if metric.startswith(STALL[0]) and metric.endswith(STALL[1]) and reason != "selected":
            try:
                stalls.append((float(v.replace(",", "")), reason))
            except ValueError:
                continue
    stalls.sort(reverse=True)
    got["stalls"] = ", ".join(f"{n} {v:.2f}" for v, n in stalls[:4])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--layout", default="nchw", choices=["nchw", "nhwc"])
    ap.add_argument("--padding", type=int, default=0, help="the convolution's (seed: 0)")
    ap.add_argument("--boost", action="store_true", help="leave the clocks to the GPU")
    ap.add_argument("--memory", action="store_true", help="DRAM bytes, L2 writes, SM clock")
    args = ap.parse_args()
    columns = (*COLUMNS.values(), *MEMORY.values(), "stalls")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            got = profile(config, args.layout, args.padding, Path(tmp), args.boost, args.memory)
            cells = "; ".join(f"{c} {got[c]}" for c in columns if c in got)
            print(f"{config} ({args.layout}): {cells}", flush=True)


if __name__ == "__main__":
    main()
