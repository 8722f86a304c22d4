"""SyncBatchNormAct2d under DDP: timm's cspdarknet53 with every BatchNorm
synchronized, trained as a multi-GPU run trains it (SGD with momentum,
float32, cudnn.benchmark), three variants interleaved in one run:

  pytorch   timm.layers.convert_sync_batchnorm(model) (timm's SyncBatchNormAct)
  ours      the same, then fuse_batchnorm_act (SyncBatchNormAct2d)
  inplace   the same with memory="inplace"

plus "local": ours without synchronization (BatchNormAct2d), whose step
time against "ours" is the collectives' cost. Each variant's step: CUDA-event
median over the rounds (rank 0's; DDP keeps the ranks in step); peak: memory
allocated over steps 2-4 above what step 1 left, the largest over the ranks.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        scripts/sync_bench.py [--batch 16] [--rounds 7] [--json OUT]

Two GPUs: NCCL, a GPU per rank (the issue's setting). One GPU: gloo with
both ranks on it, which times gloo's host copies, not NCCL: a smoke run of
the script, its figures not the targets'.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build  # noqa: E402

import cupy_act.torch as ct  # noqa: E402

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
VARIANTS = ("pytorch", "ours", "inplace", "local")


def make(variant: str, dev) -> nn.Module:
    torch.manual_seed(0)
    model, _shape, _classes, _ = build("cspdarknet53")
    if variant != "local":  # (timm's converter: torch's would drop its norm-act layers' act)
        model = importlib.import_module("timm.layers").convert_sync_batchnorm(model)
    if variant != "pytorch":
        model, count = ct.fuse_batchnorm_act(
            model, memory="inplace" if variant == "inplace" else "default"
        )
        assert count > 0, variant
    return nn.parallel.DistributedDataParallel(model.to(dev))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="images per GPU")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--json", help="write the results (rank 0)")
    args = p.parse_args()
    nccl = torch.cuda.device_count() >= WORLD
    dev = torch.device(f"cuda:{RANK if nccl else 0}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if nccl else "gloo")
    torch.backends.cudnn.benchmark = True
    _, shape, classes, _ = build("cspdarknet53")
    g = torch.Generator().manual_seed(RANK)
    x = torch.randn(args.batch, *shape, generator=g).to(dev)
    t = torch.randint(0, classes, (args.batch,), generator=g).to(dev)
    runs, peaks = {}, {}
    for v in VARIANTS:  # (one model at a time for the peaks: steps 2-4 above step 1)
        model = make(v, dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model=model, opt=opt):
            loss = nn.functional.cross_entropy(model(x), t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        peak = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 2**20], device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks[v] = peak.item()
        runs[v] = step
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # (variants interleaved, round by round)
        for v in VARIANTS:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            for _ in range(args.steps):
                runs[v]()
            end.record()
            end.synchronize()
            times[v].append(start.elapsed_time(end) / args.steps)
    if RANK:
        return
    med = {v: statistics.median(ts) for v, ts in times.items()}
    spread = {v: (max(ts) - min(ts)) / med[v] for v, ts in times.items()}
    print(f"cspdarknet53, batch {args.batch} per GPU, {WORLD} ranks, "
          f"{'NCCL' if nccl else 'gloo on one GPU (a smoke run: not the targets)'}")  # fmt: skip
    print("| variant | step ms (spread) | x pytorch | peak MiB | x pytorch |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.2f} ({spread[v]:.1%}) | {med[v] / med['pytorch']:.3f} | "
              f"{peaks[v]:.0f} | {peaks[v] / peaks['pytorch']:.3f} |")  # fmt: skip
    print(f"collectives' cost (ours - local): {med['ours'] - med['local']:.2f} ms per step")
    print("targets: ours step <= 0.85x pytorch; inplace peak <= 0.65x pytorch")
    if args.json:
        out = {"median_ms": med, "spread": spread, "peak_mib": peaks, "ranks": WORLD, "nccl": nccl}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
