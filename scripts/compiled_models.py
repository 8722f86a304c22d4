"""Train CNNs with cupy_act's fused BatchNorm + activation, eager and under torch.compile.

    PYTHONPATH=. python scripts/compiled_models.py [--models cspdarknet53 resnet50]
        [--batches 32] [--precisions fp32 bf16cl] [--modes eager default reduce-overhead]
        [--variants pytorch ours ours-inplace ours-traced ours-inplace:inplace ...]
        [--steps 6] [--rounds 5]
        [--loss-steps 20] [--no-peaks | --peaks-only] [--profile] [--policy after_conv]
        [--json F]
    PYTHONPATH=. python scripts/compiled_models.py --block [--rounds 20]

Variants: ``pytorch`` (the model as its package builds it), ``ours``
(``fuse_batchnorm_act``, or ``fuse_batchnorm_act_fx`` where that fuses
nothing, as for torchvision's ResNets, whose residual tails it fuses too;
then ``replace_activations``), ``ours-inplace`` (the same with
``memory="inplace"``), ``ours-traced`` (``ours`` with
``set_compiled_batchnorm("traced")``: PyTorch's operations under compile),
``ours-unfolded`` and ``ours-inplace-unfolded`` (with
``set_compiled_folding(False)``: no neighbour folded into the op); a
variant may name its own ``set_compiled_batchnorm`` policy after a colon
(``ours-inplace:inplace``; else ``--policy``'s),
each eager (``eager``) or ``torch.compile``'d (``default``,
``reduce-overhead``: CUDA graphs). Precisions: ``fp32`` (float32, NCHW) and
``bf16cl`` (bfloat16 autocast, channels-last model and input: timm's ``--amp
--channels-last``). SGD with momentum, ``cudnn.benchmark=True``, every
variant from the same weights on the same batches.

Printed per model, batch and precision: the step time (median over
--rounds blocks of --steps steps, variants interleaved block by block) and
its ratio to PyTorch's in the same mode; the peak memory of steps 2-4 above
what was allocated after step 1 (so a CUDA-graph pool recorded there counts),
each compiled variant's in a process of its own (CUDA-graph trees share one
pool per device), from a second instance whose steps record its graphs
(``peak_of_fresh_instance``); the largest relative difference of --loss-steps losses
from eager PyTorch's, beside eager PyTorch's own float32 noise (its losses in
the other layout). ``--profile``: device ms per step by kind of kernel
(BatchNorm forward and backward: ours against Inductor's), and the bytes
BatchNorm + activation must move per step (``FLOOR_PASSES``: x kept and y
recomputed, one tensor per pair, or y kept) over the copy bandwidth
measured in the same run, with the step PyTorch's would take at each floor:
the best any BatchNorm kernel could give it. Compile default
mode: our ops' calls per step (the profiler's host events) and, timed in
the same process, their host cost per call against the floor op's
(``scripts/overhead.py``: dispatch and allocations, no launches), with the
step they would give at that floor (an estimate, optimistic by the
launches the floor op leaves out). ``--peaks-only``:
the peaks alone, no step timed (a device run of its own: compiling each
variant twice, once to time it and once in a fresh process for its peak,
took cspdarknet53 past 290 s).

``--block``: the seed block (conv 8 -> 64 3x3 on 128 x 8 x 128 x 128, / 2,
LeakyReLU 0.01; x needs no gradient) through ``conv2d_div_leaky_relu``:
"fused" eager against "fused" under ``torch.compile`` (default mode), the
forward (no grad) and forward + backward, CUDA-event medians, interleaved;
and "auto" compiled against every candidate compiled.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

import cupy_act.torch as ct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402  (scripts/measure.py)
import models  # noqa: E402  (build, batches, the peak and pool helpers)

MODES = {"eager": None, "default": "default", "reduce-overhead": "reduce-overhead"}
VARIANTS = (
    "pytorch",
    "ours",
    "ours-inplace",
    "ours-traced",
    "ours-unfolded",
    "ours-inplace-unfolded",
)
PRECISIONS = ("fp32", "bf16cl")
DEFAULT_BATCHES = {"cspdarknet53": [32, 64], "resnet50": [32, 128]}


def variant_name(text: str) -> str:
    """argparse type: a VARIANTS name, optionally ``:`` and a policy."""
    base, _, policy = text.partition(":")
    if base not in VARIANTS or (policy and policy not in ct.batchnorm._bn_ops.POLICIES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {VARIANTS}, optionally ':' and one of "
            f"{ct.batchnorm._bn_ops.POLICIES}"
        )
    return text


def prepare(eager, variant: str, precision: str, device):
    """The variant's model (a copy of ``eager``'s weights)."""
    variant = variant.partition(":")[0]
    model = copy.deepcopy(eager).to(device)
    if variant != "pytorch":
        memory = "inplace" if variant.startswith("ours-inplace") else "default"
        model, count = ct.fuse_batchnorm_act(model, memory=memory)
        if count == 0:  # (torchvision's blocks: pairs only their call graph shows)
            model, count = ct.fuse_batchnorm_act_fx(model, memory=memory)
        ct.replace_activations(model)
    if precision == "bf16cl":
        model = model.to(memory_format=torch.channels_last)
    return model


class Run:
    """One variant in one mode: model, optimizer, step."""

    def __init__(self, eager, variant, mode, precision, device, classes, policy):
        model = prepare(eager, variant, precision, device)
        variant, _, own = variant.partition(":")
        self.policy = "traced" if variant == "ours-traced" else own or policy
        self.fold = not variant.endswith("-unfolded")
        self.graphs = mode == "reduce-overhead"
        self.fn = model if MODES[mode] is None else torch.compile(model, mode=MODES[mode])
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.bf16 = precision == "bf16cl"
        self.classes = classes

    def step(self, x, t):
        ct.set_compiled_batchnorm(self.policy)  # (Dynamo guards on it)
        ct.set_compiled_folding(self.fold)  # (read when the first step compiles)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=self.bf16):
            out = self.fn(x)
        loss = F.cross_entropy(out.float().reshape(-1, self.classes), t.reshape(-1))
        loss.backward()
        self.opt.step()
        return loss.detach().clone()

    def block_ms(self, data) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        models.sync()
        start.record()
        for x, t in data:
            self.step(x, t)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / len(data)


def data_for(shape, classes, batch, precision, steps, device):
    g = torch.Generator(device=device).manual_seed(batch)
    fmt = torch.channels_last if precision == "bf16cl" else torch.contiguous_format
    return [
        (
            torch.randn(batch, *shape, device=device, generator=g).contiguous(memory_format=fmt),
            torch.randint(0, classes, (batch,), device=device, generator=g),
        )
        for _ in range(steps)
    ]


def peak_after_first_step(run: Run, data) -> float:
    """MiB above what was allocated after step 1, over steps 2-4."""
    run.step(*data[0])
    models.sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for x, t in (data * 4)[1:4]:
        run.step(x, t)
    models.sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def peak_of_fresh_instance(make, data) -> float:
    """A compiled variant's peak: a first instance compiles, warms up and
    settles cuDNN's algorithm search; a second (``make()`` again: Dynamo
    recompiles from Inductor's caches) records its CUDA graphs during its
    steps, whose peak above what was allocated before them counts, less the
    optimizer's momentum buffers that its first step creates (a replay
    allocates nothing: measured over the steps that record)."""
    first = make()
    for x, t in data[:3]:
        first.step(x, t)
    first = None
    models.sync()
    torch.cuda.empty_cache()
    run = make()
    momentum = sum(p.numel() * p.element_size() for p in run.opt.param_groups[0]["params"])
    models.sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for x, t in (data * 4)[:4]:
        run.step(x, t)
    models.sync()
    return (torch.cuda.max_memory_allocated() - base - momentum) / 2**20


def peak_in_own_process(args, name, batch, precision, variant, mode) -> float:
    """peak_after_first_step in a fresh process (one compiled function, one pool)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-of", name, str(batch), precision,
           variant, mode, "--policy", args.policy]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("PEAK "):
            return float(line.split()[1])
    print(f"  ({variant} {mode}: no peak: {out.stderr.strip()[-300:]})")
    return float("nan")


def losses_of(run: Run, data, steps: int) -> torch.Tensor:
    return torch.stack([run.step(*data[i % len(data)]) for i in range(steps)])


def measure_config(args, name, built, batch, precision) -> dict:
    eager, shape, classes, _ = built
    device = torch.device("cuda")
    data = data_for(shape, classes, batch, precision, args.steps, device)
    row = {"model": name, "batch": batch, "precision": precision}
    keys = _keys(args)
    # eager PyTorch's losses, and its float32 noise: the same model in the other layout
    ref = losses_of(Run(eager, "pytorch", "eager", precision, device, classes, args.policy),
                    data, args.loss_steps)  # fmt: skip
    other = "fp32" if precision == "bf16cl" else "bf16cl"
    noise_run = Run(eager, "pytorch", "eager", precision, device, classes, args.policy)
    noise_run.fn.to(memory_format=torch.contiguous_format if other == "fp32" else
                    torch.channels_last)  # fmt: skip
    noise = losses_of(noise_run, data, args.loss_steps)
    row["noise"] = ((noise - ref).abs() / ref.abs()).max().item()
    noise_run = None
    runs = {}
    for key in keys:
        try:
            run = Run(eager, *key, precision, device, classes, args.policy)
            lo = losses_of(run, data, args.loss_steps)  # (compiles)
            row[f"{key[0]}/{key[1]} loss diff"] = ((lo - ref).abs() / ref.abs()).max().item()
            runs[key] = run
        except Exception as e:  # a compiler failure costs its column, not the table
            print(f"  {name} {batch} {precision} {key}: {type(e).__name__}: {str(e)[:400]}")
    for r in runs.values():
        r.block_ms(data)  # (warm-up: CUDA graphs recorded)
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, r in runs.items():
            times[k].append(r.block_ms(data))
    for (v, m), t in times.items():
        row[f"{v}/{m} ms"] = statistics.median(t)
        row[f"{v}/{m} spread"] = (max(t) - min(t)) / statistics.median(t)
    if args.profile:
        for (v, m), r in runs.items():
            row[f"{v}/{m} profile"] = measure.profile(lambda r=r: r.step(*data[0]))
        row["bn elements"] = bn_elements(eager, shape, batch)
        nbytes = 1 << 28
        row["copy GB/s"] = 2 * nbytes / measure.copy_ms(nbytes) / 1e6
    for (v, m), r in runs.items():
        if m == "default" and v != "pytorch":
            row[f"{v}/{m} op calls"] = op_calls_per_step(r, data[0])
    if any(k.endswith("op calls") for k in row):
        row["op host us"] = op_host_us()
    runs = None
    models._fresh()
    if not args.no_peaks:
        row |= measure_peaks(args, name, built, batch, precision)
    return row


def op_calls_per_step(run: Run, batch) -> int:
    """Calls of our BatchNorm ops in one step (the profiler's host events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run.step(*batch)
    return sum(e.name in _OPS for e in prof.events())


_OPS = ("cupy_act::batchnorm_act", "cupy_act::batchnorm_act_backward")


def op_host_us() -> dict:
    """Host us per call of our forward and backward ops and of the floor op
    (``scripts/overhead.py``: allocations only), on a small input."""
    import overhead

    x = torch.randn(8, 64, 16, 16, device="cuda", requires_grad=True)
    ours = ct.BatchNormAct2d(64, act_layer="leaky_relu", memory="inplace").cuda()
    calls = overhead.op_calls(x, torch.randn_like(x), ours)
    return dict(zip(calls, overhead.per_call_us(list(calls.values()), 500, 7)))


def print_floor(row, k: str, ms: float, base) -> None:
    """Compile default mode: what our step would take if our ops cost the
    floor op's host time (an estimate from this run's figures: the step
    minus each call's host cost above the floor), against PyTorch's."""
    host = row["op host us"]
    ours = (host["our forward op"] + host["our backward op"]) / 2
    calls, floor = row[f"{k} op calls"], host["floor op (no kernels)"]
    at_floor = ms - calls * (ours - floor) / 1000
    print(
        f"        host floor: {calls} op calls a step at {ours:.1f} us (floor op {floor:.1f} us):"
        f" at the floor about {at_floor:.2f} ms, {at_floor / base if base else float('nan'):.3f}x"
    )


# Passes over BatchNorm-input-sized tensors in one training step (each reads or
# writes every element once), by what the backward keeps:
FLOOR_PASSES = {
    # forward: x read for the statistics, x read and y written; backward: y
    # recomputed for the next convolution's weight gradient (x read, y
    # written), the gradient sums (dy and x read), dx (dy and x read, dx
    # written). One tensor kept per pair, as when Inductor's partitioner
    # recomputes its own BatchNorm; the gradients from x exact.
    "x kept, y recomputed": 10,
    # the backward reads y, which the next convolution keeps anyway: no
    # recomputation (the in-place mode; a ReLU's y cannot give x back), or x
    # and y both kept (the default mode's op: a tensor more per pair)
    "y kept": 8,
}


def bn_elements(eager, shape, batch) -> int:
    """Elements of every BatchNorm's input in one forward pass at ``batch``
    (a copy of the model on the meta device: shapes only, nothing computed)."""
    model = copy.deepcopy(eager).to("meta").eval()
    seen = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.register_forward_pre_hook(lambda _mod, a: seen.append(a[0].numel()))
    with torch.no_grad():
        model(torch.empty(batch, *shape, device="meta"))
    return sum(seen)


def print_byte_floor(row, m: str, base: float) -> None:
    """BatchNorm + activation against the bytes it must move: each variant's
    BatchNorm device time per step (the profile) beside FLOOR_PASSES' floors
    at this run's copy bandwidth, and the step PyTorch's would take with its
    BatchNorm at each floor and nothing else changed, against its own: the
    best any BatchNorm kernel keeping that much could give. Residual and
    shortcut adds are not counted, which lowers the floors."""
    n, rate = row["bn elements"], row["copy GB/s"]
    size = 2 if row["precision"] == "bf16cl" else 4
    p = row[f"pytorch/{m} profile"]
    bn = p["BN fwd"] + p["BN bwd"]
    floors = {k: passes * n * size / rate / 1e6 for k, passes in FLOOR_PASSES.items()}
    at = ", ".join(f"{k} {f:.2f} ms (step {(base - bn + f) / base:.3f}x)"
                   for k, f in floors.items())  # fmt: skip
    own = ", ".join(f"{k.split('/')[0]} {v['BN fwd'] + v['BN bwd']:.2f}"
                    for k, v in row.items() if k.endswith(f"/{m} profile"))  # fmt: skip
    print(f"        BN byte floor, {n} elements x {size} B a pass at {rate:.0f} GB/s: {at};"
          f" BN device ms: {own}")  # fmt: skip


def _keys(args) -> list:
    """(variant, mode) pairs the run measures."""
    return [(v, m) for m in args.modes for v in args.variants
            if not (m == "eager" and v == "ours-traced")]  # fmt: skip


def measure_peaks(args, name, built, batch, precision) -> dict:
    """Each variant's peak (``"<variant>/<mode> MiB"``): eager here, each
    compiled one in a process of its own."""
    eager, shape, classes, _ = built
    row = {}
    for v, m in _keys(args):
        if m == "eager":
            device = torch.device("cuda")
            data = data_for(shape, classes, batch, precision, args.steps, device)
            run = Run(eager, v, m, precision, device, classes, args.policy)
            row[f"{v}/{m} MiB"] = peak_after_first_step(run, data)
            run = data = None
            models._fresh()
        else:
            row[f"{v}/{m} MiB"] = peak_in_own_process(args, name, batch, precision, v, m)
    return row


def print_peaks(row, args) -> None:
    """A ``--peaks-only`` row: each variant's peak and its ratio to PyTorch's."""
    print(f"\n{row['model']} batch {row['batch']} {row['precision']}: peak MiB")
    for m in args.modes:
        mem = row.get(f"pytorch/{m} MiB")
        for v in args.variants:
            mib = row.get(f"{v}/{m} MiB")
            if mib is not None:
                ratio = mib / mem if mem else float("nan")
                print(f"    {f'{v}/{m}':40s} {mib:9.0f} {ratio:9.3f}")


def print_row(row, args) -> None:
    print(f"\n{row['model']} batch {row['batch']} {row['precision']} (eager PyTorch's own "
          f"loss noise {row['noise']:.1e})")  # fmt: skip
    print(f"    {'variant':26s} {'step ms':>8s} {'x PyTorch':>9s} {'spread':>7s} {'peak MiB':>9s}"
          f" {'x PyTorch':>9s} {'loss diff':>9s}")  # fmt: skip
    for m in args.modes:
        base = row.get(f"pytorch/{m} ms")
        mem = row.get(f"pytorch/{m} MiB")
        for v in args.variants:
            k = f"{v}/{m}"
            if f"{k} ms" not in row:
                continue
            ms, mib = row[f"{k} ms"], row.get(f"{k} MiB", float("nan"))
            print(
                f"    {k:26s} {ms:8.2f} {ms / base if base else float('nan'):9.3f}"
                f" {row[f'{k} spread']:7.1%} {mib:9.0f}"
                f" {mib / mem if mem else float('nan'):9.3f} {row[f'{k} loss diff']:9.1e}"
            )
            if f"{k} op calls" in row:
                print_floor(row, k, ms, base)
            if f"{k} profile" in row:
                p = row[f"{k} profile"]
                top = ", ".join(f"{n[:40]} {ms:.2f}" for n, ms in p["top other"][:4])
                print(
                    f"        BN fwd {p['BN fwd']:.2f} + bwd {p['BN bwd']:.2f} ms, convolution "
                    f"{p['convolution']:.2f}, other {p['other']:.2f}, total {p['total']:.2f}; "
                    f"largest other: {top}"
                )
        if f"pytorch/{m} profile" in row and "bn elements" in row and row["bn elements"]:
            print_byte_floor(row, m, base)


def measure_block(args) -> None:
    """The seed block's rows and targets (``--block``)."""
    from cupy_act import testing
    from cupy_act.torch import _conv_auto

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 8, 128, 128, device="cuda", generator=gen)
    w = (torch.randn(64, 8, 3, 3, device="cuda", generator=gen) * 0.1).requires_grad_()
    b = torch.randn(64, device="cuda", generator=gen).requires_grad_()
    gy = torch.randn(128, 64, 126, 126, device="cuda", generator=gen)
    names = ("auto", *_conv_auto.candidates(torch.float32, False))

    def block(algorithm):
        return lambda t: ct.conv2d_div_leaky_relu(t, w, b, 2.0, 0.01, algorithm=algorithm)

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(x)

        return run

    def train(fn):
        def run():
            w.grad = b.grad = None
            fn(x).backward(gy)

        return run

    fns = {"fused eager": block("fused")}
    fns |= {f"{a} compiled": torch.compile(block(a)) for a in names}
    rows = {}
    for what, make in (("forward", forward), ("fwd+bwd", train)):
        runs = {k: make(f) for k, f in fns.items()}
        for run in runs.values():
            run()  # (compiles; "auto" measures its candidates, eager's own way)
        rows[what] = testing.interleaved_median_ms(runs, rounds=args.rounds)
    print("\nseed block (128 x 8 x 128 x 128 -> 64, 3x3), CUDA-event ms")
    targets = []
    for what, t in rows.items():
        best = min(t[f"{a} compiled"] for a in names[1:])
        for k, ms in t.items():
            print(f"    {what:8s} {k:26s} {ms:7.3f}  {ms / t['fused eager']:5.3f}x fused eager")
        fused = t["fused compiled"] / t["fused eager"]
        targets.append(measure.target(f"{what}: fused compiled / eager", fused, "<= 1.05x"))
        auto = t["auto compiled"] / best
        targets.append(measure.target(f"{what}: auto compiled / best compiled", auto, "<= 1.03x"))
    print(f"    auto picked: {sorted(set(_conv_auto.auto_choices().values()))}")
    measure.print_targets(targets)


def peak_only(args) -> None:
    name, batch, precision, variant, mode = args.peak_of
    models.allow_recompiles()
    torch.backends.cudnn.benchmark = True
    built = models.build(name)
    eager, shape, classes, _ = built
    device = torch.device("cuda")
    data = data_for(shape, classes, int(batch), precision, 4, device)
    make = lambda: Run(eager, variant, mode, precision, device, classes, args.policy)  # noqa: E731
    print(f"PEAK {peak_of_fresh_instance(make, data)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cspdarknet53", "resnet50"])
    ap.add_argument("--batches", nargs="*", type=int, help="default: 32 64 / 32 128")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16cl"], choices=PRECISIONS)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS[:3]), type=variant_name)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loss-steps", type=int, default=20)
    peaks = ap.add_mutually_exclusive_group()
    peaks.add_argument("--no-peaks", action="store_true")
    peaks.add_argument(
        "--peaks-only",
        action="store_true",
        help="each variant's peak alone (no steps timed, no losses)",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--policy", default="after_conv", choices=ct.batchnorm._bn_ops.POLICIES)
    ap.add_argument("--block", action="store_true", help="the seed block's rows instead")
    ap.add_argument("--peak-of", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    measure.require_gpu("compiled_models.py")
    if args.peak_of:
        return peak_only(args)
    if args.block:
        print(measure.header(measure.environment()))
        return measure_block(args)
    models.allow_recompiles()
    torch.backends.cudnn.benchmark = True
    print(measure.header(measure.environment()))
    rows = []
    for name in args.models:
        built = models.build(name)
        if built is None:
            continue
        for batch in args.batches or DEFAULT_BATCHES.get(name, [32]):
            for precision in args.precisions:
                if args.peaks_only:
                    row = {"model": name, "batch": batch, "precision": precision}
                    rows.append(row | measure_peaks(args, name, built, batch, precision))
                    print_peaks(rows[-1], args)
                else:
                    rows.append(measure_config(args, name, built, batch, precision))
                    print_row(rows[-1], args)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
