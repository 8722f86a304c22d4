"""Train real models with PyTorch's activations and with cupy_act's, side by side.

    PYTHONPATH=. python scripts/models.py [--models cspdarknet53 resnet50 mlp]
        [--batches 8 32 64] [--steps 6] [--rounds 5] [--compile-batches 32]
        [--compiled compile reduce-overhead ours+RO] [--json F] [--device cuda] [--small]

Models: timm's ``cspdarknet53`` (67 ``nn.LeakyReLU(0.01, inplace=True)``,
256 x 256 inputs), torchvision's ``resnet50`` (``nn.ReLU(inplace=True)``,
224 x 224), both with 100 classes and random weights, and the project's MLP
(``scripts/train.py``: 1024 -> 3 x 4096 -> 10, ``nn.LeakyReLU(0.01)``). A
model whose package is missing is skipped with a message. ``--device cpu
--small`` (an MLP 64 -> 3 x 128 -> 10) is a quick check that runs anywhere;
peak memory is reported on CUDA only.

Every variant starts from the same weights and sees the same batches (SGD with
momentum, float32, cuDNN deterministic, no benchmark mode):

  eager    the model as its package builds it;
  floor    each activation replaced by a Python ``autograd.Function`` that only
           calls PyTorch's own op and backward: what any Python autograd path
           costs on the host, with nothing of ours in it;
  ours     ``cupy_act.torch.replace_activations(model)``;
  compile  ``torch.compile(eager model)``; ``reduce-overhead`` the same with
           CUDA graphs, and ``ours+RO`` our model compiled that way. Compiling
           a CNN's training step takes minutes, so these run at
           --compile-batches only (static shapes), after the eager table, and
           are timed after three warm-up blocks (compiling, recording graphs).

Printed per model and batch: the step time (forward, backward, optimizer step;
median over --rounds blocks of --steps back-to-back steps, the eager-mode
variants interleaved block by block), the peak memory of a step (above what
was allocated before the model was built: weights, gradients, optimizer state
and activations), and whether the floor's and our losses equal eager's bit for
bit over the first --steps steps.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import cupy_act.torch as ct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import mlp_model  # noqa: E402  (the project's MLP)


def build(name: str, small: bool = False):
    """(model, input shape without the batch, classes), or None if its package is missing."""
    try:
        if name == "cspdarknet53":
            timm = importlib.import_module("timm")
            return timm.create_model("cspdarknet53", num_classes=100), (3, 256, 256), 100
        if name == "resnet50":
            tv = importlib.import_module("torchvision")
            return tv.models.resnet50(num_classes=100), (3, 224, 224), 100
    except ImportError as e:
        print(f"skipping {name}: {e}")
        return None
    if name == "mlp":
        return (
            mlp_model("eager", 128, 3, 64) if small else mlp_model("eager", 4096, 3, 1024),
            ((64,) if small else (1024,)),
            10,
        )
    raise ValueError(f"unknown model {name!r}; known: cspdarknet53, resnet50, mlp")


class _FloorFn(torch.autograd.Function):
    """PyTorch's own activation and backward, saving what PyTorch saves."""

    @staticmethod
    def forward(ctx, x, slope, inplace):
        if slope is None:
            y = torch.relu_(x) if inplace else torch.relu(x)
        else:
            y = F.leaky_relu(x, slope, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.slope, ctx.inplace = slope, inplace
        ctx.save_for_backward(y if slope is None or inplace else x)
        return y

    @staticmethod
    def backward(ctx, gy):
        (saved,) = ctx.saved_tensors
        if ctx.slope is None:
            return torch.ops.aten.threshold_backward(gy, saved, 0), None, None
        return torch.ops.aten.leaky_relu_backward(gy, saved, ctx.slope, ctx.inplace), None, None


class FloorAct(nn.Module):
    def __init__(self, old: nn.Module):
        super().__init__()
        self.slope = getattr(old, "negative_slope", None)
        self.inplace = old.inplace

    def forward(self, x):
        return _FloorFn.apply(x, self.slope, self.inplace)


def to_floor(model: nn.Module) -> nn.Module:
    for parent in list(model.modules()):
        for name, child in parent._modules.items():
            if type(child) in (nn.ReLU, nn.LeakyReLU):
                parent._modules[name] = FloorAct(child)
    return model


class Run:
    """One variant: its model, optimizer and step function."""

    def __init__(self, eager: nn.Module, variant: str, device):
        model = copy.deepcopy(eager).to(device)
        if variant == "floor":
            to_floor(model)
        elif variant in ("ours", "ours+RO"):
            ct.replace_activations(model)
        self.graphs = variant in ("reduce-overhead", "ours+RO")
        if variant in ("compile", "reduce-overhead", "ours+RO"):
            mode = "reduce-overhead" if self.graphs else "default"
            self.fn = torch.compile(model, mode=mode, dynamic=False)
        else:
            self.fn = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(self, x, t):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.fn(x), t)
        loss.backward()
        self.opt.step()
        return loss.detach().clone()  # (a CUDA graph's output is overwritten by the next run)

    def block_ms(self, data) -> float:
        sync()
        t0 = time.perf_counter()
        for x, t in data:
            self.step(x, t)
        sync()
        return (time.perf_counter() - t0) * 1e3 / len(data)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_mib(fn):
    """(fn(), the peak memory fn allocated above what was allocated before, in MiB;
    NaN without CUDA)."""
    if not torch.cuda.is_available():
        return fn(), float("nan")
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    sync()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20


EAGER_VARIANTS = ("eager", "floor", "ours")
COMPILED = ("compile", "reduce-overhead", "ours+RO")


def batches(shape, classes, batch, args):
    """--steps (input, label) batches, the same for every variant."""
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(batch)
    return [
        (
            torch.randn(batch, *shape, device=device, generator=g),
            torch.randint(0, classes, (batch,), device=device, generator=g),
        )
        for _ in range(args.steps)
    ]


def measure(name, eager, shape, classes, batch, args):
    """One row of the eager table: step times, peak memory, loss equality."""
    device = torch.device(args.device)
    data = batches(shape, classes, batch, args)
    row = {"model": name, "batch": batch}
    losses = {}
    for v in EAGER_VARIANTS:  # losses and peak memory, one variant at a time

        def train(v=v):
            run = Run(eager, v, device)
            return torch.stack([run.step(x, t) for x, t in data])

        losses[v], row[f"{v} MiB"] = peak_memory_mib(train)
    for v in ("floor", "ours"):
        same = torch.equal(losses[v].view(torch.int32), losses["eager"].view(torch.int32))
        row[f"{v} bit-equal"] = bool(same)
    runs = {v: Run(eager, v, device) for v in EAGER_VARIANTS}
    for r in runs.values():
        r.block_ms(data)  # warm-up
    times = {v: [] for v in runs}
    for _ in range(args.rounds):  # interleaved, block by block
        for v, r in runs.items():
            times[v].append(r.block_ms(data))
    for v in runs:
        row[f"{v} ms"] = statistics.median(times[v])
    return row


def measure_compiled(row, eager, shape, classes, args):
    """Add the compiled variants' step times to an eager table row."""
    data = batches(shape, classes, row["batch"], args)
    for v in args.compiled:
        try:
            run = Run(eager, v, torch.device(args.device))
            for _ in range(3):  # compile, and record the CUDA graphs
                run.block_ms(data)
            row[f"{v} ms"] = statistics.median(run.block_ms(data) for _ in range(args.rounds))
        except Exception as e:  # a compiler failure costs its column, not the table
            print(f"{row['model']} batch {row['batch']} {v}: {type(e).__name__}: {str(e)[:300]}")
            row[f"{v} ms"] = float("nan")
        finally:
            run = None
            torch.compiler.reset()


def print_row(row):
    e, ours = row["eager ms"], row["ours ms"]
    mem = row["ours MiB"] / row["eager MiB"] if row["eager MiB"] else float("nan")
    cols = [
        f"{row['model']:13s} {row['batch']:5d}",
        f"{e:8.2f}",
        f"{row['floor ms']:8.2f} {row['floor ms'] / e:5.2f}x",
        f"{ours:8.2f} {ours / e:5.2f}x {ours / row['floor ms']:5.2f}x",
        f"{row['eager MiB']:8.0f} {row['ours MiB']:8.0f} {mem:5.2f}x",
        " ".join(f"{'yes' if row[f'{v} bit-equal'] else 'NO':>5s}" for v in ("floor", "ours")),
    ]
    print(" ".join(cols), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cspdarknet53", "resnet50", "mlp"])
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32, 64])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile-batches", nargs="*", type=int, default=[32])
    ap.add_argument("--compiled", nargs="*", default=list(COMPILED), choices=COMPILED)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small MLP, for a quick check")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("models.py: no CUDA device here (--device cpu --small runs anywhere)")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"{where}, torch {torch.__version__}; step ms (median of {args.rounds} x "
        f"{args.steps} steps), peak MiB of a step, losses over {args.steps} steps bit-equal"
    )
    print(
        f"{'model':13s} {'batch':>5s} {'eager':>8s} {'floor':>8s} {'/eag':>6s} {'ours':>8s} "
        f"{'/eag':>6s} {'/flr':>6s} {'eagerMiB':>8s} {'oursMiB':>8s} {'ratio':>6s} "
        f"{'flr=':>5s} {'ours=':>5s}"
    )
    rows, models = [], {}
    for name in args.models:
        torch.manual_seed(0)
        built = build(name, args.small)
        if built is None:
            continue
        models[name] = built
        for batch in args.batches:
            rows.append(measure(name, *built, batch, args))
            print_row(rows[-1])
            save(rows, args.json)
    again = [r for r in rows if r["batch"] in args.compile_batches]
    if args.compiled and again:
        print("\ncompiled, step ms (static shapes) and x eager")
        head = " ".join(f"{v:>16s}" for v in args.compiled)
        print(f"{'model':13s} {'batch':>5s} {'eager':>8s} {head}")
        for row in again:
            measure_compiled(row, *models[row["model"]], args)
            print(
                f"{row['model']:13s} {row['batch']:5d} {row['eager ms']:8.2f} "
                + " ".join(
                    f"{row[f'{v} ms']:8.2f} {row[f'{v} ms'] / row['eager ms']:6.2f}x"
                    for v in args.compiled
                ),
                flush=True,
            )
            save(rows, args.json)


def save(rows, path) -> None:
    """Write the rows so far (a run cut short keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
