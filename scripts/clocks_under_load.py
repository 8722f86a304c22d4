"""The GPU's SM clock and power while the convolution block's kernels run
back to back: whether a kernel is held back by the card's power limit.

    PYTHONPATH=. python scripts/clocks_under_load.py [--seconds 3] [--interval-ms 50]

Each workload runs in a loop at the seed shape (conv 8->64 3x3 on
128x8x128x128 float32, divide by 2, LeakyReLU 0.01) while ``nvidia-smi``
samples the card every --interval-ms: per workload the median SM clock
(MHz), the median and largest power draw (W), the share of samples in which
the driver reported the software power cap as a reason for lower clocks
(event reason bit 0x4), and the time per call (wall clock over the loop, the
queue kept short). "copy" is a device copy of the output's size (the memory
floor's yardstick); "idle" samples with nothing running. nvidia-smi must be
on PATH; the card's settings are only read, never changed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

import cupy_act.torch as ct

POWER_CAP = 0x4  # clocks event reason: software power cap


def sample(fn, seconds: float, interval_ms: int, device: str) -> dict:
    """Run ``fn`` in a loop for ``seconds`` (None: nothing) while nvidia-smi
    samples; the medians and shares described in the module docstring."""
    query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
    cmd = ["nvidia-smi", "-i", device, f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    proc = subprocess.Popen([*cmd, "-lms", str(interval_ms)], stdout=subprocess.PIPE, text=True)
    calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if fn is None:
            time.sleep(interval_ms / 1000)
            continue
        fn()
        calls += 1
        if calls % 4 == 0:  # a short queue: the samples see the work, not a backlog
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    proc.terminate()
    r = summarize(proc.communicate()[0])
    r["ms"] = 1e3 * wall / calls if calls else float("nan")
    return r


def summarize(out: str) -> dict:
    """Median SM clock and power, largest power, the share of samples capped
    by power and the sample count, from nvidia-smi's lines ("clock, power,
    reasons as hex"; a line cut off by the end of sampling is skipped)."""
    clocks, power, capped = [], [], 0
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            c, w, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except (ValueError, IndexError):
            continue
        clocks.append(c)
        power.append(w)
        capped += bool(reasons & POWER_CAP)
    nan = float("nan")
    return dict(
        clock=statistics.median(clocks) if clocks else nan,
        power=statistics.median(power) if power else nan,
        power_max=max(power, default=nan),
        capped=capped / max(1, len(clocks)),
        samples=len(clocks),
    )


def workloads() -> dict:
    """name -> a call of one workload at the seed shape (None: idle)."""
    torch.manual_seed(0)
    x = torch.randn(128, 8, 128, 128, device="cuda")
    conv = torch.nn.Conv2d(8, 64, 3).cuda()
    w, b = conv.weight.detach(), conv.bias.detach()
    src = torch.randn(128, 64, 126, 126, device="cuda")
    dst = torch.empty_like(src)
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()

    def forward(alg):
        def run():
            with torch.no_grad():
                ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm=alg)

        return run

    def train():
        wl.grad = bl.grad = None
        ct.conv2d_div_leaky_relu(x, wl, bl, 2.0, 0.01, algorithm="fused").backward(src)

    return {
        "idle": None,
        "copy": lambda: dst.copy_(src),
        "fused forward": forward("fused"),
        "fused_tf32 forward": forward("fused_tf32"),
        "exact forward": forward("exact"),
        "fused fwd+bwd (w, b)": train,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--interval-ms", type=int, default=50)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    uuid = getattr(props, "uuid", None)
    device = f"GPU-{uuid}" if uuid is not None else "0"
    print(f"{props.name}, torch {torch.__version__}, nvidia-smi -i {device}", flush=True)
    rows = {}
    for name, fn in workloads().items():
        if fn is not None:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        r = rows[name] = sample(fn, args.seconds, args.interval_ms, device)
        print(
            f"  {name:22s} SM clock {r['clock']:6.0f} MHz  power {r['power']:5.0f} W "
            f"(max {r['power_max']:4.0f})  power-capped {100 * r['capped']:3.0f}% of "
            f"{r['samples']} samples  {r['ms']:7.3f} ms per call",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
