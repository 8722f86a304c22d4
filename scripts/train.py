"""Train two small models with PyTorch eager, cupy_act, or torch.compile of either.

    PYTHONPATH=. python scripts/train.py [--backends eager cupy_act compile:eager
                                          compile:cupy_act] [--steps 50] [--device cuda]
                                         [--models conv mlp] [--small] [--json F] [--plot F]
    PYTHONPATH=. torchrun --nproc_per_node=2 scripts/train.py --ddp [--json F]

Models, on synthetic data the script generates (seeded, the same for every backend):
  conv  ConvDivLeakyReLU block at the reference shape (batch 128, 8 -> 64
        channels, 3x3 kernel, 128x128 inputs, divisor 2), then global average
        pooling and a linear classifier over 10 classes;
  mlp   1024 -> 4096 -> 4096 -> 4096 -> 10 with LeakyReLU(0.01) hidden layers,
        batch 2048.
Backends: "eager" writes the activations with torch.nn; "cupy_act" swaps in
cupy_act.torch's modules (same parameters, loaded from the eager model's
state_dict); "compile:X" is torch.compile of backend X. Every backend starts
from the same weights and sees the same batches (SGD with momentum, float32).
Printed per model and backend: final loss, median step time, peak memory
(torch.cuda.max_memory_allocated) and the bytes autograd saves per step, then
whether cupy_act's losses equal eager's bit for bit. --small shrinks the
shapes (for CPU runs). --ddp trains the cupy_act backend with
DistributedDataParallel over NCCL, one GPU per process, each rank taking its
share of the same global batch, and checks that parameters stay identical
across ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import cupy_act.torch as ct
from cupy_act import testing

SLOPE, DIVISOR, CLASSES = 0.01, 2.0, 10


def conv_model(backend: str, cin: int, cout: int) -> nn.Module:
    cls = testing.ConvDivLeakyReLUModel if backend == "eager" else ct.ConvDivLeakyReLU
    block = cls(cin, cout, 3, DIVISOR, SLOPE)
    return nn.Sequential(block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cout, CLASSES))


def mlp_model(backend: str, width: int, depth: int, cin: int) -> nn.Module:
    act = (lambda: nn.LeakyReLU(SLOPE)) if backend == "eager" else (lambda: ct.LeakyReLU(SLOPE))
    layers, d = [], cin
    for _ in range(depth):
        layers += [nn.Linear(d, width), act()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, CLASSES))


class Task:
    """A model family with its shapes and a seeded synthetic data stream."""

    def __init__(self, name: str, small: bool):
        self.name = name
        if name == "conv":
            self.batch, self.cin, self.cout, self.hw = (
                (16, 8, 16, 32) if small else (128, 8, 64, 128)
            )
        else:
            self.batch, self.cin, self.width, self.depth = (
                (64, 64, 128, 3) if small else (2048, 1024, 4096, 3)
            )

    def activation_elements(self) -> int:
        """Elements passing through the activations in one forward pass."""
        if self.name == "conv":
            return self.batch * self.cout * (self.hw - 2) ** 2
        return self.batch * self.width * self.depth

    def build(self, backend: str) -> nn.Module:
        if self.name == "conv":
            return conv_model(backend, self.cin, self.cout)
        return mlp_model(backend, self.width, self.depth, self.cin)

    def batches(self, steps: int, device, seed: int = 0):
        """(inputs, labels) per step; labels come from a fixed random teacher, so the
        loss can fall."""
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (
            (self.batch, self.cin, self.hw, self.hw)
            if self.name == "conv"
            else (self.batch, self.cin)
        )
        teacher = torch.randn(self.cin, CLASSES, device=device, generator=g)
        for _ in range(steps):
            x = torch.randn(shape, device=device, generator=g)
            feats = x.mean(dim=(2, 3)) if self.name == "conv" else x
            yield x, (feats @ teacher).argmax(dim=1)


def initial_state(task: Task, device) -> dict:
    torch.manual_seed(1234)
    return task.build("eager").to(device).state_dict()


def saved_bytes(model, x) -> int:
    """Bytes autograd saves for one forward pass."""
    return testing.nbytes(testing.saved_sizes(model, x)[1])


def train(task: Task, backend: str, steps: int, device, lr=0.05, rank=0, world=1, log=print):
    """Train from the common initial weights; returns losses, step times (ms), peak
    memory, saved bytes."""
    base = backend.split(":")[-1]
    model = task.build(base).to(device)
    model.load_state_dict(initial_state(task, device))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    step_fn = model if not backend.startswith("compile:") else torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, saved = [], [], None
    for i, (x, labels) in enumerate(task.batches(steps, device)):
        share = x.shape[0] // world  # this rank's slice of the global batch
        x, labels = x[rank * share : (rank + 1) * share], labels[rank * share : (rank + 1) * share]
        if saved is None:  # (through DDP a forward without backward would upset its reducer)
            saved = saved_bytes(step_fn if world == 1 else model.module, x)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(step_fn(x), labels)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach())
        if (i + 1) % max(1, steps // 5) == 0 or i + 1 == steps:
            log(f"    {task.name} {backend:16s} step {i + 1:4d}/{steps}  loss {loss.item():.6f}")
    if world > 1:  # the loss of the global batch: the mean over equal shares
        stacked = torch.stack(losses)
        torch.distributed.all_reduce(stacked)
        losses = list(stacked / world)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return dict(
        losses=[float(v) for v in losses],
        step_ms=times,
        peak_bytes=peak,
        saved_bytes=saved,
        model=model,
    )


def bits_equal(a, b) -> bool:
    return torch.equal(
        torch.tensor(a, dtype=torch.float32).view(torch.int32),
        torch.tensor(b, dtype=torch.float32).view(torch.int32),
    )


def run_ddp(args) -> None:
    if "RANK" not in os.environ:
        raise SystemExit("train.py --ddp: run it under torchrun (torchrun --nproc_per_node=2 ...)")
    if not torch.distributed.is_nccl_available() or torch.cuda.device_count() < 1:
        raise SystemExit(
            "train.py --ddp: needs NCCL and one NVIDIA GPU per process; this torch "
            f"({torch.__version__}) sees {torch.cuda.device_count()} GPU(s), NCCL "
            f"{'available' if torch.distributed.is_nccl_available() else 'not built in'}"
        )
    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"DDP over NCCL: {world} processes, {torch.cuda.get_device_name(device)}")
    out = {"world": world, "models": {}}
    for name in args.models:
        task = Task(name, args.small)
        r = train(task, "cupy_act", args.steps, device, rank=rank, world=world, log=log)
        flat = torch.cat([p.detach().reshape(-1) for p in r["model"].parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        devices = [None] * world
        torch.distributed.all_gather_object(devices, str(device))
        same = all(torch.equal(gathered[0], g) for g in gathered[1:])
        log(
            f"  {name}: parameters identical across ranks: {same}; ranks ran on {devices}; "
            f"final loss {r['losses'][-1]:.6f}"
        )
        out["models"][name] = dict(
            losses=r["losses"],
            params_identical=same,
            devices=devices,
            step_ms=statistics.median(r["step_ms"][1:] or r["step_ms"]),
        )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--backends", nargs="+", default=["eager", "cupy_act", "compile:eager", "compile:cupy_act"]
    )
    ap.add_argument("--models", nargs="+", default=["conv", "mlp"], choices=["conv", "mlp"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes, for CPU runs")
    ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel, under torchrun")
    ap.add_argument("--json", help="write losses and measurements here")
    ap.add_argument("--plot", help="write a PNG of the loss curves here")
    args = ap.parse_args(argv)
    if args.plot:  # (before training, not after it)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("train.py --plot: needs matplotlib (pip install matplotlib)") from None
    if args.ddp:
        return run_ddp(args)
    if args.device == "cpu" and not args.small:
        print("train.py: on the CPU without --small the GPU-sized models take many minutes "
              "per backend; --small shrinks them", flush=True)  # fmt: skip
    # Deterministic convolution algorithms, so that equal inputs give equal gradients.
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"training on {name}, torch {torch.__version__}, {args.steps} steps", flush=True)
    results = {}
    for model_name in args.models:
        task = Task(model_name, args.small)
        for backend in args.backends:
            r = train(task, backend, args.steps, device, log=lambda m: print(m, flush=True))
            r.pop("model")
            results[(model_name, backend)] = r
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(
        f"\n{'model':5s} {'backend':17s} {'final loss':>11s} {'step ms':>8s} "
        f"{'peak MiB':>9s} {'saved MiB/step':>15s}"
    )
    for (m, b), r in results.items():
        peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else f"{'-':>9s}"
        step = statistics.median(r["step_ms"][2:] or r["step_ms"])
        print(
            f"{m:5s} {b:17s} {r['losses'][-1]:11.6f} {step:8.2f} {peak} "
            f"{r['saved_bytes'] / 2**20:15.2f}"
        )
    summary = {}
    for m in args.models:
        if (m, "eager") in results and (m, "cupy_act") in results:
            e, o = results[(m, "eager")], results[(m, "cupy_act")]
            same = bits_equal(e["losses"], o["losses"])
            summary[m] = dict(
                losses_bit_identical=same,
                saved_bytes_eager=e["saved_bytes"],
                saved_bytes_cupy_act=o["saved_bytes"],
            )
            line = f"{m}: cupy_act losses equal eager's bit for bit over {args.steps} steps: {same}"
            if e["peak_bytes"] is not None:
                summary[m]["peak_bytes_saved"] = e["peak_bytes"] - o["peak_bytes"]
                line += f"; peak memory {(e['peak_bytes'] - o['peak_bytes']) / 2**20:.1f} MiB lower"
            per = (e["saved_bytes"] - o["saved_bytes"]) / Task(m, args.small).activation_elements()
            summary[m]["saved_bytes_less_per_activation_element"] = per
            line += (
                f"; autograd saves {(e['saved_bytes'] - o['saved_bytes']) / 2**20:.1f} MiB "
                f"less per step ({per:.3f} bytes per activation element)"
            )
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    device=name,
                    steps=args.steps,
                    summary=summary,
                    runs={f"{m}/{b}": r for (m, b), r in results.items()},
                ),
                f,
                indent=1,
            )
    if args.plot:
        plot(results, args.plot)


def plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for m, _ in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for (mm, b), r in results.items():
            if mm == m:
                ax.plot(r["losses"], label=b, linestyle="--" if "compile" in b else "-")
        ax.set_title(f"{m}: training loss")
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
