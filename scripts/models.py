"""Train real models with PyTorch's activations and with cupy_act's, eager and compiled.

    PYTHONPATH=. python scripts/models.py [--models cspdarknet53 resnet50 opt mlp block]
        [--batches 32] [--steps 6] [--rounds 5] [--block N] [--compile-batches 32]
        [--compiled compile ours+compile reduce-overhead ours+RO]
        [--cudnn benchmark deterministic] [--json F] [--device cuda] [--small]

Models: timm's ``cspdarknet53`` (67 ``nn.LeakyReLU(0.01, inplace=True)``,
256 x 256 inputs), torchvision's ``resnet50`` (``nn.ReLU(inplace=True)``,
224 x 224), both with 100 classes and random weights; ``opt``, an OPT-style
decoder built from a ``transformers`` config (6 layers, hidden 768, ReLU
feed-forward of 3072, sequence 256, vocabulary 8192, no weights loaded); the
project's MLP (``scripts/train.py``: 1024 -> 3 x 4096 -> 10, LeakyReLU(0.01));
and ``block``, the seed-003 block (conv 8 -> 64 3x3 on 128 x 8 x 128 x 128,
divide by 2, LeakyReLU 0.01) under torch.compile. A model whose package is
missing is skipped with a message. ``--device cpu --small`` (an MLP 64 -> 3 x
128 -> 10) is a quick check that runs anywhere; memory is reported on CUDA only.

Every variant starts from the same weights and sees the same batches (SGD with
momentum, float32), once per ``--cudnn`` setting: ``benchmark`` (cuDNN picks
its fastest algorithms, as timm trains) and ``deterministic`` (the setting in
which losses are compared bit for bit).

Eager table (every --batches):
  eager    the model as its package builds it;
  floor    each activation replaced by a Python ``autograd.Function`` that only
           calls PyTorch's own op and backward: what any Python autograd path
           costs on the host, with nothing of ours in it;
  ours     ``cupy_act.torch.replace_activations(model)``;
  --bn: ours+bn / ours+bn-inplace   ``fuse_batchnorm_act(model, memory=...)`` too (its FX
        sibling where it fuses none: torchvision);
        ours+bn-floor   ours+bn whose BatchNorm Function launches nothing (the
                        adapter's host floor: its losses are garbage, not compared);
        eager-cl        eager in channels-last, losses only: float32 noise.
Compiled table (--compile-batches; ``torch.compile(model)``, static shapes):
  compile / ours+compile                  mode "default", PyTorch's / ours;
  reduce-overhead / ours+RO               mode "reduce-overhead" (CUDA graphs);
  ours+mask                               ours with a packed 1-bit mask on
                                          every activation (a candidate);
  ours+kernels                            ours through the custom-op route.

Printed per model and batch: the step time (forward, backward, optimizer step;
median over --rounds blocks of --block (default --steps) back-to-back steps,
the variants of a table interleaved block by block; short blocks and many
rounds ride out a noisy host better), the peak memory of a step (eager: above what
was allocated before the model was built; compiled: a steady step after
warm-up, above what was allocated before it; reduce-overhead also the memory of
its CUDA-graph pool), and whether losses equal the reference's bit for bit
(eager: eager's; compiled: the same mode with PyTorch's activations).
The block rows give forward + backward time and the bytes autograd saved
(all, and beyond x and the parameters), the block alone and feeding pooling
and a linear layer, against the same block with PyTorch's operations compiled.

The fused BatchNorm compiled (both memory modes and placement policies,
float32 and bfloat16 with channels-last, each compiled variant's peak in a
process of its own, a profile by kind of kernel) has a script of its own:
``scripts/compiled_models.py``.
"""

from __future__ import annotations

import argparse
import copy
import gc
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
from cupy_act import testing
from cupy_act.torch import _traced

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402  (scripts/measure.py: environment, device time by kernel kind)
from overhead import BareBatchNormAct  # noqa: E402  (the fused BatchNorm's floor)
from train import mlp_model  # noqa: E402  (the project's MLP)


class Decoder(nn.Module):
    """An OPT-style causal language model, returning logits of shape (batch, seq, vocab)."""

    def __init__(self, transformers):
        super().__init__()
        config = transformers.OPTConfig(
            vocab_size=8192,
            hidden_size=768,
            num_hidden_layers=6,
            ffn_dim=3072,
            num_attention_heads=12,
            max_position_embeddings=512,
            word_embed_proj_dim=768,
            activation_function="relu",
            dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,  # training: no key/value cache (its state recompiles Dynamo)
        )
        self.lm = transformers.OPTForCausalLM(config)

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


def build(name: str, small: bool = False):
    """(model, input shape without the batch, classes, integer inputs), or None if
    its package is missing."""
    try:
        if name == "cspdarknet53":
            timm = importlib.import_module("timm")
            return timm.create_model("cspdarknet53", num_classes=100), (3, 256, 256), 100, False
        if name == "resnet50":
            tv = importlib.import_module("torchvision")
            return tv.models.resnet50(num_classes=100), (3, 224, 224), 100, False
        if name == "opt":
            return Decoder(importlib.import_module("transformers")), (256,), 8192, True
    except Exception as e:  # a missing package, or one whose API moved: skip the model
        print(f"skipping {name}: {type(e).__name__}: {e}")
        return None
    if name == "mlp":
        model = mlp_model("eager", 128, 3, 64) if small else mlp_model("eager", 4096, 3, 1024)
        return model, ((64,) if small else (1024,)), 10, False
    raise ValueError(f"unknown model {name!r}; known: cspdarknet53, resnet50, opt, mlp, block")


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


# compiled variant -> (ours, torch.compile mode, ACT_MASK, compile route)
COMPILED = {
    "compile": (False, "default", None, "traced"),
    "ours+compile": (True, "default", None, "traced"),
    "reduce-overhead": (False, "reduce-overhead", None, "traced"),
    "ours+RO": (True, "reduce-overhead", None, "traced"),
    "ours+mask": (True, "default", (8, "flat"), "traced"),
    "ours+kernels": (True, "default", None, "kernels"),
}
REFERENCE = {"ours+compile": "compile", "ours+RO": "reduce-overhead", "ours+mask": "compile"}
REFERENCE["ours+kernels"] = "compile"


class Run:
    """One variant: its model, optimizer and step function."""

    def __init__(self, eager: nn.Module, variant: str, device, classes: int):
        model = copy.deepcopy(eager).to(device)
        ours, mode, self.mask, self.route = COMPILED.get(variant, (False, None, None, "traced"))
        if variant == "floor":
            to_floor(model)
        elif variant == "ours" or ours:
            ct.replace_activations(model)
        elif variant in BN_VARIANTS or variant == BN_FLOOR:  # BatchNorm + act fused, the rest ours
            memory = BN_VARIANTS.get(variant, "default")
            model, count = ct.fuse_batchnorm_act(model, memory=memory)
            if count == 0:  # (torchvision's blocks: pairs only their call graph shows)
                model, count = ct.fuse_batchnorm_act_fx(model, memory=memory)
            ct.replace_activations(model)
        elif variant == NOISE:
            model.to(memory_format=torch.channels_last)
        # BatchNormAct2d's autograd Function (the floor: one that launches nothing)
        self.apply_fused = BareBatchNormAct.apply if variant == BN_FLOOR else _APPLY_FUSED
        self.graphs = mode == "reduce-overhead"
        self.fn = model if mode is None else torch.compile(model, mode=mode, dynamic=False)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.classes = classes

    def step(self, x, t):
        # the knobs this variant was compiled with (Dynamo guards on them)
        _traced.ACT_MASK = self.mask
        ct.set_compile_route(self.route)
        ct.batchnorm._apply_fused = self.apply_fused
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.fn(x).reshape(-1, self.classes), t.reshape(-1))
        loss.backward()
        self.opt.step()
        return loss.detach().clone()  # (a CUDA graph's output is overwritten by the next run)

    def block_ms(self, data) -> float:
        """Wall milliseconds per step of a block; self.host_ms: the process's CPU
        milliseconds per step before the final synchronization, all threads
        (the backward's host work runs on autograd's device thread): what
        Python and the launches cost, the step time where it exceeds the
        device time."""
        sync()
        t0, c0, g0 = time.perf_counter(), time.process_time(), _gc_seconds[0]
        for x, t in data:
            self.step(x, t)
        self.host_ms = (time.process_time() - c0) * 1e3 / len(data)
        self.gc_ms = (_gc_seconds[0] - g0) * 1e3 / len(data)
        sync()
        return (time.perf_counter() - t0) * 1e3 / len(data)


_gc_seconds = [0.0, 0.0]  # total, start of the collection under way


def _gc_timer(phase: str, info: dict) -> None:
    """gc.callbacks entry: Python's garbage collections, timed (a collection
    lands on whichever variant is running; the step rows report them)."""
    now = time.perf_counter()
    if phase == "start":
        _gc_seconds[1] = now
    else:
        _gc_seconds[0] += now - _gc_seconds[1]


gc.callbacks.append(_gc_timer)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_mib(fn, device, empty_cache=True):
    """(fn(), the peak memory fn allocated above what was allocated before, in MiB;
    NaN off CUDA, also where a GPU is present but the run is on the CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return fn(), float("nan")
    sync()
    if empty_cache:
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    sync()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20


def graph_pool_mib() -> float:
    """MiB held in the caching allocator's private pools (CUDA graphs' memory)."""
    if not torch.cuda.is_available():
        return float("nan")
    segments = torch.cuda.memory_snapshot()
    pools = [(s["total_size"], tuple(s.get("segment_pool_id", (0, 0)))) for s in segments]
    return sum(size for size, pool in pools if pool != (0, 0)) / 2**20


EAGER_VARIANTS = ("eager", "floor", "ours")
BN_VARIANTS = {"ours+bn": "default", "ours+bn-inplace": "inplace"}  # (--bn) fuser's memory mode
# --bn: ours+bn with BareBatchNormAct for the kernels' Function (timed only:
# its losses are garbage), the step's host floor for this design; and eager
# PyTorch in channels-last (losses only), whose difference from eager's
# losses is float32 noise: other convolution and BatchNorm kernels.
BN_FLOOR, NOISE = "ours+bn-floor", "eager-cl"
_APPLY_FUSED = ct.batchnorm._apply_fused


def batches(shape, classes, integer, batch, args):
    """--steps (input, label) batches, the same for every variant."""
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(batch)
    if integer:  # a language model: token ids in, the next tokens as labels
        ids = [torch.randint(0, classes, (batch, *shape), device=device, generator=g)]
        return [(i, i.roll(-1, 1)) for i in ids * args.steps]
    return [
        (
            torch.randn(batch, *shape, device=device, generator=g),
            torch.randint(0, classes, (batch,), device=device, generator=g),
        )
        for _ in range(args.steps)
    ]


def same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def eager_row(name, eager, shape, classes, integer, batch, args):
    """One row of the eager table: step times, peak memory, loss equality."""
    device = torch.device(args.device)
    data = batches(shape, classes, integer, batch, args)
    row = {"model": name, "batch": batch, "cudnn": args.cudnn_now}
    losses = {}
    if torch.backends.cudnn.benchmark:  # cuDNN's algorithm search (and its workspaces) first
        Run(eager, "eager", device, classes).step(*data[0])
    variants = EAGER_VARIANTS + ((*BN_VARIANTS, BN_FLOOR) if args.bn else ())
    for v in variants + ((NOISE,) if args.bn else ()):  # losses, peak memory, one at a time

        def train(v=v):
            run = Run(eager, v, device, classes)
            return torch.stack([run.step(x, t) for x, t in data])

        losses[v], row[f"{v} MiB"] = peak_memory_mib(train, device)
    for v in ("floor", "ours"):
        row[f"{v} bit-equal"] = same_bits(losses[v], losses["eager"])
    for v in (*BN_VARIANTS, NOISE) if args.bn else ():  # (other kernels: not bit-equal)
        diff = (losses[v] - losses["eager"]).abs() / losses["eager"].abs()
        row[f"{v} loss max rel diff"] = diff.max().item()
    runs = {v: Run(eager, v, device, classes) for v in variants}
    interleave(runs, data[: args.block or None], row, args.rounds)
    if args.profile:
        row["profile"] = {v: measure.profile(lambda r=r: r.step(*data[0])) for v, r in runs.items()}
    return row


def interleave(runs: dict, data, row: dict, rounds: int) -> None:
    """Median block times of the runs, block by block in turn, into row[f"{v} ms"]."""
    for r in runs.values():
        r.block_ms(data)  # warm-up
    times = {v: [] for v in runs}
    host = {v: [] for v in runs}
    collecting = {v: [] for v in runs}
    for _ in range(rounds):
        for v, r in runs.items():
            times[v].append(r.block_ms(data))
            host[v].append(r.host_ms)
            collecting[v].append(r.gc_ms)
    for v in runs:
        row[f"{v} ms"] = statistics.median(times[v])
        row[f"{v} host ms"] = statistics.median(host[v])
        row[f"{v} gc ms"] = statistics.mean(collecting[v])


def measure_compiled(row, eager, shape, classes, integer, args):
    """Add the compiled variants to an eager-table row. One variant at a time:
    compile, losses, then after warm-up the peak of a steady block above what
    was allocated before it and, for reduce-overhead, the CUDA-graph pool it
    made (graph pools are shared by every compiled function alive, so each
    variant is freed before the next). Then all together again, from warm
    compile caches, timed interleaved."""
    data = batches(shape, classes, integer, row["batch"], args)
    device = torch.device(args.device)
    losses, variants = {}, []
    for v in args.compiled:
        try:
            _fresh()
            pool0 = graph_pool_mib()
            t0 = time.perf_counter()
            run = Run(eager, v, device, classes)
            losses[v] = torch.stack([run.step(x, t) for x, t in data])  # compiles
            row[f"{v} compile s"] = time.perf_counter() - t0
            for _ in range(2):  # warm-up (records the CUDA graphs)
                run.block_ms(data)
            _, row[f"{v} MiB"] = peak_memory_mib(lambda: run.block_ms(data), device, False)
            if run.graphs:
                row[f"{v} pool MiB"] = graph_pool_mib() - pool0
            variants.append(v)
        except Exception as e:  # a compiler failure costs its column, not the table
            print(f"{row['model']} batch {row['batch']} {v}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            run = None
    for v, ref in REFERENCE.items():
        if v in losses and ref in losses:
            row[f"{v} bit-equal"] = same_bits(losses[v], losses[ref])
    for ref in set(REFERENCE.values()) & set(losses):
        # does PyTorch's compiled model repeat its own losses? (If not, a
        # difference of ours says nothing about our operations.)
        _fresh()
        again = Run(eager, ref, device, classes)
        row[f"{ref} repeats"] = same_bits(losses[ref], torch.stack([again.step(*b) for b in data]))
        again = None
    _fresh()
    runs = {v: Run(eager, v, device, classes) for v in variants}
    interleave(runs, data[: args.block or None], row, args.rounds)
    if args.profile:
        row["profile"] = {v: measure.profile(lambda r=r: r.step(*data[0])) for v, r in runs.items()}
    runs = None
    _fresh()


def _fresh() -> None:
    """Forget compiled code and CUDA graphs and give cached memory back."""
    ct.set_compile_route("traced")
    _traced.ACT_MASK = None
    torch.compiler.reset()
    if torch.cuda.is_available():
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
        sync()
        torch.cuda.empty_cache()


def measure_block(args, head: bool) -> list[dict]:
    """The seed-003 block under torch.compile: PyTorch's, and ours with each
    epilogue (traced with Inductor's saved state, traced with a packed mask,
    our kernel), alone (``head`` False: the block ends the compiled region, as
    in the seed model) or feeding global average pooling and a linear layer
    (scripts/train.py's classifier: Inductor can fuse the epilogue into the
    pooling). Input without gradient (the seed model), parameters trained."""
    small = args.small or args.device == "cpu"
    n, cin, hw, cout = (2, 8, 16, 16) if small else (128, 8, 128, 64)
    device = torch.device(args.device)

    def model_of(block):
        return nn.Sequential(block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cout, 10))

    torch.manual_seed(0)
    ref = testing.ConvDivLeakyReLUModel(cin, cout, 3, 2.0)
    ref = (model_of(ref) if head else ref).to(device)
    x = torch.randn(n, cin, hw, hw, device=device)
    gy = torch.randn((n, 10) if head else (n, cout, hw - 2, hw - 2), device=device)
    # name -> (ours, conv.COMPILED_EPILOGUE)
    default = ct.conv.COMPILED_EPILOGUE
    variants = {"torch.compile": (False, None), "ours, traced, no mask": (True, None)}
    masks = [(8, "flat"), (8, "strided"), (32, "flat"), (32, "strided")]
    for mask in masks[:2] if head else masks:
        variants[f"ours, traced, mask {mask[0]}-bit {mask[1]}"] = (True, mask)
    variants["ours, kernel epilogue"] = (True, "kernels")
    variants = {
        k + (" (default)" if ours and epilogue == default else ""): (ours, epilogue)
        for k, (ours, epilogue) in variants.items()
    }
    fns, rows = {}, []
    for name, (ours, epilogue) in variants.items():
        model = copy.deepcopy(ref)
        if ours:
            block = ct.ConvDivLeakyReLU(cin, cout, 3, divisor=2.0)
            model = (model_of(block) if head else block).to(device)
            model.load_state_dict(ref.state_dict())
        compiled = torch.compile(model)

        def fwd_bwd(compiled=compiled, epilogue=epilogue):
            ct.conv.COMPILED_EPILOGUE = epilogue  # (Dynamo guards on it)
            y = compiled(x)
            y.backward(gy)
            return y

        fns[name] = fwd_bwd
        y = fwd_bwd()  # compiles
        row = {"model": "block+pool" if head else "block", "variant": name, "y": y.detach()}
        row["grad"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        _, sizes = testing.saved_sizes(fns[name])
        row["saved MB"] = testing.nbytes(sizes) / 1e6
        # what the backward adds to memory: x and the parameters live anyway
        _, sizes = testing.saved_sizes(fns[name], held=(x, *model.parameters()))
        row["activation state MB"] = testing.nbytes(sizes) / 1e6
        rows.append(row)
    if device.type == "cuda":
        times = testing.interleaved_median_ms(fns, rounds=args.rounds * 3)
    else:  # (a quick check: wall time)
        times = {k: _wall_ms(f) for k, f in fns.items()}
    ct.conv.COMPILED_EPILOGUE = default
    base = rows[0].copy()
    for r in rows:
        r["fwd+bwd ms"] = times[r["variant"]]
        r["x torch.compile"] = r["fwd+bwd ms"] / times[base["variant"]]
        r["saved x torch.compile"] = r["saved MB"] / base["saved MB"]
        r["state x torch.compile"] = r["activation state MB"] / base["activation state MB"]
        grads, want = r.pop("grad"), base["grad"]
        r["bit-equal"] = {"y": same_bits(r.pop("y"), base["y"])}
        r["bit-equal"].update({f"d{k}": same_bits(g, want[k]) for k, g in grads.items()})
        r["grad max rel diff"] = max(
            ((g - want[k]).abs() / want[k].abs().clamp_min(1e-30)).max().item()
            for k, g in grads.items()
        )
    torch.compiler.reset()
    return rows


def print_block(r):
    print(
        f"    {r['variant']:40s} {r['fwd+bwd ms']:7.3f} ms ({r['x torch.compile']:.3f}x)"
        f"  saved {r['saved MB']:6.1f} MB ({r['saved x torch.compile']:.3f}x),"
        f" beyond x and parameters {r['activation state MB']:6.1f} MB"
        f" ({r['state x torch.compile']:.3f}x)  bit-equal: "
        + (
            "all"
            if all(r["bit-equal"].values())
            else f"NOT {r['bit-equal']} (gradients within {r['grad max rel diff']:.1e})"
        ),
        flush=True,
    )


def _wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def print_row(row):
    e, ours = row["eager ms"], row["ours ms"]
    mem = row["ours MiB"] / row["eager MiB"] if row["eager MiB"] else float("nan")
    cols = [
        f"{row['model']:13s} {row['batch']:5d} {row['cudnn'][:5]:5s}",
        f"{e:8.2f}",
        f"{row['floor ms']:8.2f} {row['floor ms'] / e:5.2f}x",
        f"{ours:8.2f} {ours / e:5.2f}x {ours / row['floor ms']:5.2f}x",
        f"{row['eager MiB']:8.0f} {row['ours MiB']:8.0f} {mem:5.2f}x",
        " ".join(f"{'yes' if row[f'{v} bit-equal'] else 'NO':>5s}" for v in ("floor", "ours")),
    ]
    print(" ".join(cols), flush=True)


def print_compiled(row, variants):
    print(f"{row['model']:13s} {row['batch']:5d} {row['cudnn'][:5]:5s}", flush=True)
    for v in variants:
        if f"{v} ms" not in row:
            continue
        ref = REFERENCE.get(v)
        line = f"    {v:16s} {row[f'{v} ms']:8.2f} ms {row.get(f'{v} MiB', 0):8.0f} MiB"
        if f"{v} repeats" in row:
            line += f" (losses repeat run to run: {'yes' if row[f'{v} repeats'] else 'NO'})"
        if f"{v} pool MiB" in row:
            line += f" (+{row[f'{v} pool MiB']:.0f} pool)"
        if ref and f"{ref} ms" in row:
            line += (
                f"   / {ref}: {row[f'{v} ms'] / row[f'{ref} ms']:5.3f}x time,"
                f" {row[f'{v} MiB'] / row[f'{ref} MiB']:5.3f}x peak"
            )
            if f"{v} pool MiB" in row and f"{ref} pool MiB" in row:
                line += f", {row[f'{v} pool MiB'] / max(row[f'{ref} pool MiB'], 1e-9):5.3f}x pool"
            line += f", losses {'bit-equal' if row.get(f'{v} bit-equal') else 'DIFFER'}"
        print(line + f"  (compiled in {row[f'{v} compile s']:.0f} s)", flush=True)


def allow_recompiles(limit: int = 64) -> None:
    """Raise Dynamo's per-frame recompile limit (8): the compiled variants of a
    model share its code objects, each guarded on its own module, and one over
    the limit would silently run eager."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


def set_cudnn(setting: str) -> None:
    torch.backends.cudnn.benchmark = setting == "benchmark"
    torch.backends.cudnn.deterministic = setting == "deterministic"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cspdarknet53", "resnet50", "opt", "mlp"])
    ap.add_argument("--batches", nargs="+", type=int, default=[32])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=0, help="steps per timed block (0: --steps)")
    ap.add_argument("--compile-batches", nargs="*", type=int, default=[32])
    default = ["compile", "ours+compile", "reduce-overhead", "ours+RO"]
    ap.add_argument("--compiled", nargs="*", default=default, choices=list(COMPILED))
    ap.add_argument("--cudnn", nargs="+", default=["benchmark", "deterministic"])
    ap.add_argument("--no-eager", action="store_true", help="the compiled table only")
    ap.add_argument(
        "--bn",
        action="store_true",
        help="eager ours+bn and ours+bn-inplace columns: fuse_batchnorm_act as well",
    )
    ap.add_argument(
        "--profile", action="store_true", help="device time per step by kernel kind, per variant"
    )
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a small MLP, for a quick check")
    args = ap.parse_args()
    allow_recompiles()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("models.py: no CUDA device here (--device cpu --small runs anywhere)")
    print(
        f"{measure.header(measure.environment())} ({args.device}); step ms (median of "
        f"{args.rounds} blocks of {args.block or args.steps} steps), peak MiB of a step, "
        f"losses over {args.steps} steps bit-equal"
    )
    rows: list[dict] = []
    for setting in args.cudnn:
        set_cudnn(setting)
        args.cudnn_now = setting
        for name in args.models:
            if name == "block":
                for head in (False, True):
                    what = "feeding pooling and a linear layer" if head else "alone"
                    print(f"\nseed-003 block under torch.compile, {what}, cudnn {setting}")
                    for r in measure_block(args, head):
                        r["cudnn"] = setting
                        rows.append(r)
                        print_block(r)
                save(rows, args.json)
                continue
            torch.manual_seed(0)
            built = build(name, args.small)
            if built is None:
                continue
            print(f"\n{name}, cudnn {setting}")
            for batch in [] if args.no_eager else args.batches:
                rows.append(eager_row(name, *built, batch, args))
                print_row(rows[-1])
                if args.bn:
                    print_bn(rows[-1])
                if args.profile:
                    measure.print_profile(rows[-1]["profile"])
                save(rows, args.json)
            for batch in args.compile_batches if args.compiled else []:
                row = {"model": name, "batch": batch, "cudnn": setting, "table": "compiled"}
                measure_compiled(row, *built, args)
                rows.append(row)
                print_compiled(row, args.compiled)
                if args.profile:
                    measure.print_profile(row["profile"])
                if args.bn:
                    print_bn_against_compile(rows, row)
                save(rows, args.json)


def print_bn(r: dict) -> None:
    """The fused BatchNorm rows, and every eager variant's host time per step
    (CPU time of the launching thread: the step's floor where the device is
    faster)."""
    noise = r[f"{NOISE} loss max rel diff"]
    print(f"    float32 noise: eager channels-last's losses within {noise:.1e} of eager's")
    for v in BN_VARIANTS:
        ms, mib = r[f"{v} ms"], r[f"{v} MiB"]
        print(
            f"    {v:15s} {ms:8.2f} ms ({ms / r['eager ms']:.3f}x eager), {mib:.0f} MiB"
            f" ({mib / r['eager MiB']:.3f}x eager), losses within"
            f" {r[f'{v} loss max rel diff']:.1e} of eager's",
            flush=True,
        )
    floor = r[f"{BN_FLOOR} ms"]
    print(
        f"    floor: {BN_FLOOR} (the adapter, no kernels) {floor:.2f} ms"
        f" ({floor / r['eager ms']:.3f}x eager); ours+bn {r['ours+bn ms'] / floor:.3f}x it,"
        f" in place / default {r['ours+bn-inplace ms'] / r['ours+bn ms']:.3f}x",
        flush=True,
    )
    variants = (*EAGER_VARIANTS, *BN_VARIANTS, BN_FLOOR)
    hosts = ", ".join(f"{v} {r[f'{v} host ms']:.2f}" for v in variants)
    print(f"    host (process CPU) ms per step: {hosts}", flush=True)
    gcs = ", ".join(f"{v} {r[f'{v} gc ms']:.2f}" for v in variants)
    print(f"    Python garbage collection, mean ms per step: {gcs}", flush=True)


def print_bn_against_compile(rows: list, compiled: dict) -> None:
    """The fused modules' eager step time against torch.compile's (same model,
    batch and cuDNN setting, this run)."""
    for r in rows:
        same = [r.get(k) == compiled[k] for k in ("model", "batch", "cudnn")]
        if all(same) and "table" not in r and "compile ms" in compiled:
            for v in BN_VARIANTS:
                ratio = r[f"{v} ms"] / compiled["compile ms"]
                print(f"    {v} eager: {ratio:.3f}x torch.compile's step", flush=True)


def save(rows, path) -> None:
    """Write the rows so far (a run cut short keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
